"""modded-nanogpt Track 3's SOAP on the hyperball: SOAP-H, result #27 (3125 steps), and
KL-SOAP-H, results #19 (3125 steps) and #25 (3040 steps).

- the blocks' matrices: `optax_snoo.soap` (`scale_by_soap`: momentum 0.95 and SOAP's second
  moment 0.9 in the eigenbasis of the gradient's two Gram EMAs (0.9), bases from the first
  gradient's ``eigh`` and refreshed by one power iteration + QR every update, eps 1e-8, no
  bias correction), then the hyperball at the matrix's present norm
  (``W' = W - lr‖W‖U/max(‖U‖, 1e-10)`` rescaled to ``‖W‖``); lr 0.018 times
  ``(1 - t/3200)^1.25`` (a power decay over 3200 steps of the 3125-step run);
- aux AdamW (betas (0.8, 0.95), eps 1e-10, no decay, bias-corrected): embedding 0.3, head
  1/320, every 1-D parameter 0.01, flat then linear to 0 over the last 40%.

KL-SOAP-H (#19) is the same with KL-SOAP's factor statistics
(``scale_by_soap(factor_update="kl")``: the first update only builds them) and lr 0.018
linear to 0 over the run; #25 trains it 3040 steps on a 3125-step power decay with floors:
the matrices' lr ``0.018 (0.017 + 0.983 (1 - t/3125)^1.5)``, the aux groups' flat to 60%
of 3125 then ``0.04 + 0.96 ((1 - t/3125)/0.4)^1.5``.

The hyperball keeps every matrix at its initial norm, so a zero-initialised matrix stays zero:
the record initialises the blocks' matrices as #5 (MuonH) does (PyTorch's uniform init, times
1.25 on the attention output, 3 on the MLP output, 1.5 on its input): train it with
``--init=hyperball``.

References:
  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024;
  Lin et al., `Understanding and Improving Shampoo and SOAP via Kullback-Leibler
  Minimization <https://arxiv.org/abs/2509.03378>`_, 2025;
  modded-nanogpt Track 3 results #27 (`results/20260518_soaph/train_gpt_simple_soaph.py
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  #19 (`results/20260508_klsoap_h_clean_tuple_sweep/b1095_sh090/`), #25
  (`results/20260511_klsoap_h_lr_power_decay/train_gpt_simple_klsoap_h_lr_power_decay.py`),
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_hyperball import AuxAdamWHyperparameters, aux_adamw_stack
from optax_snoo._src.schedules import stable_cooldown_schedule
from optax_snoo._src.soap import FACTOR_UPDATES, soap

__all__ = ["KLSoapHHyperparameters", "KLSoapHPowerDecayHyperparameters",
           "SoapHHyperparameters"]


@dataclasses.dataclass(frozen=True)
class SoapHHyperparameters(AuxAdamWHyperparameters):
    """Result #27's constants (SOAP-H)."""

    RECORD_STEPS = 3125

    soap_learning_rate: float = hyperparameter(0.018, "the hyperball's relative step at "
                                               "update 0", check="positive")
    soap_lr_steps: int = hyperparameter(3200, "the horizon of the matrices' power decay "
                                        "(steps at 3125)", check="at_least_1", steps=True)
    soap_lr_power: float = hyperparameter(1.25, "the exponent of the matrices' decay "
                                          "(1 - t/soap_lr_steps)^power", check="positive")
    soap_lr_floor: float = hyperparameter(0.0, "the matrices' lr at the horizon, times "
                                          "their peak", check="fraction")
    soap_b1: float = hyperparameter(0.95, "SOAP's momentum (no bias correction)",
                                    check="unit_interval")
    soap_b2: float = hyperparameter(0.9, "decay of SOAP's second moment in the eigenbasis",
                                    check="unit_interval")
    shampoo_beta: float = hyperparameter(0.9, "decay of the Gram factors L, R (the log's "
                                         "one ema_beta with soap_b2)", check="unit_interval")
    soap_eps: float = hyperparameter(1e-8, "added to sqrt(V)", check="positive")
    precondition_frequency: int = hyperparameter(1, "refresh the eigenbases every this many "
                                                 "updates", check="at_least_1")
    factor_update: str = hyperparameter("gram", "the factors' statistics: SOAP's Gram EMAs, "
                                        "or KL-SOAP's whitened ones (#19, #25)",
                                        choices=FACTOR_UPDATES)
    pin: str = hyperparameter("current", "the hyperball's radius: the norm the matrix has "
                              "(the log's), or the initial norm", choices=("current", "initial"))
    adam_cooldown_frac: float = hyperparameter(0.4, "the aux AdamW groups' cooldown fraction "
                                               "(of adam_lr_steps)", check="positive_fraction")
    adam_lr_steps: int = hyperparameter(3125, "the horizon of the aux groups' schedule (steps "
                                        "at 3125)", check="at_least_1", steps=True)
    adam_lr_power: float = hyperparameter(1.0, "the exponent of the aux groups' cooldown",
                                          check="positive")
    adam_lr_floor: float = hyperparameter(0.0, "the aux groups' lr at the horizon, times "
                                          "their peak", check="fraction")


@dataclasses.dataclass(frozen=True)
class KLSoapHHyperparameters(SoapHHyperparameters):
    """Result #19's constants (KL-SOAP-H, b1095_sh090)."""

    soap_lr_steps: int = hyperparameter(3125, "the horizon of the matrices' decay (steps at "
                                        "3125)", check="at_least_1", steps=True)
    soap_lr_power: float = hyperparameter(1.0, "the exponent of the matrices' decay "
                                          "(1 - t/soap_lr_steps)^power", check="positive")
    factor_update: str = hyperparameter("kl", "the factors' statistics: KL-SOAP's whitened "
                                        "ones, or SOAP's Gram EMAs (#27)",
                                        choices=FACTOR_UPDATES)


@dataclasses.dataclass(frozen=True)
class KLSoapHPowerDecayHyperparameters(KLSoapHHyperparameters):
    """Result #25's constants: #19 trained 3040 steps on a 3125-step power decay."""

    RECORD_STEPS = 3040

    soap_lr_steps: int = hyperparameter(3125, "the horizon of the matrices' decay (steps at "
                                        "3040)", check="at_least_1", steps=True)
    soap_lr_power: float = hyperparameter(1.5, "the exponent of the matrices' decay",
                                          check="positive")
    soap_lr_floor: float = hyperparameter(0.017, "the matrices' lr at the horizon, times "
                                          "their peak", check="fraction")
    adam_lr_steps: int = hyperparameter(3125, "the horizon of the aux groups' schedule (steps "
                                        "at 3040)", check="at_least_1", steps=True)
    adam_lr_power: float = hyperparameter(1.5, "the exponent of the aux groups' cooldown",
                                          check="positive")
    adam_lr_floor: float = hyperparameter(0.04, "the aux groups' lr at the horizon, times "
                                          "their peak", check="fraction")


def _soaph(t: SoapHHyperparameters, total_steps: int, *, labels: Any = None,
           adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
           shard_newton_schulz: bool = True) -> Stack:
    del total_steps  # the horizons are in `t`
    lr = stable_cooldown_schedule(t.soap_learning_rate, t.soap_lr_steps, cooldown_frac=1.0,
                                  final_lr_scale=t.soap_lr_floor, power=t.soap_lr_power)
    matrices = soap(lr, t.soap_b1, t.soap_b2, shampoo_beta=t.shampoo_beta, eps=t.soap_eps,
                    precondition_frequency=t.precondition_frequency,
                    factor_update=t.factor_update, pin=t.pin,
                    shard_matrices=shard_newton_schulz, newton_schulz_plan=newton_schulz_plan)
    schedule = lambda peak: stable_cooldown_schedule(peak, t.adam_lr_steps, t.adam_cooldown_frac,
                                                     t.adam_lr_floor, power=t.adam_lr_power)
    return aux_adamw_stack(matrices, lr, t, schedule, labels=labels,
                           adam_patterns=adam_patterns)


track3_soaph = register(Recipe(
    "track3_soaph", SoapHHyperparameters, _soaph, options=TRACK3_OPTIONS,
    summary="Track 3 result #27 (3125 steps): SOAP (Adam in the eigenbasis of the gradient's "
    "Gram EMAs, refreshed every step) on the hyperball, lr 0.018 x (1 - t/3200)^1.25, aux "
    "AdamW (needs --init=hyperball)"))
track3_klsoap = register(Recipe(
    "track3_klsoap", KLSoapHHyperparameters, _soaph, options=TRACK3_OPTIONS,
    summary="Track 3 result #19 (3125 steps): KL-SOAP (SOAP with KL-whitened factor "
    "statistics) on the hyperball, lr 0.018 linear to 0, aux AdamW (needs --init=hyperball)"))
track3_klsoap_power_decay = register(Recipe(
    "track3_klsoap_power_decay", KLSoapHPowerDecayHyperparameters, _soaph,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #25 (3040 steps): #19's KL-SOAP-H on a 3125-step power-1.5 decay "
    "with lr floors 0.017 (matrices) and 0.04 (aux AdamW) (needs --init=hyperball)"))
