"""modded-nanogpt Track 3's PSGD, result #33 (3400 steps): PSGD Kron on the hyperball.

- the blocks' matrices: `optax_snoo.psgd_kron` (bias-corrected momentum 0.95, Kronecker
  whitening factors fitted every step with ``precond_lr`` 1.0 and float32's eps as damping,
  ``O = (Q_aᵀQ_a) M̂ (Q_bᵀQ_b)``), then the hyperball at the matrix's present norm
  (``W' = W - lr‖W‖O/‖O‖`` rescaled to ``‖W‖``), lr 0.025 linear to 0 over the whole run;
- aux AdamW (betas (0.8, 0.95), eps 1e-10, no decay): embedding 0.3, head 1/320, every 1-D
  parameter 0.01, flat for half the run then linear to 0.1 of its peak.

The hyperball keeps every matrix at its initial norm, so a zero-initialised matrix stays zero:
the record initialises the blocks' matrices ``N(0, (c/sqrt(3 fan_in))²)`` (``c`` = 3 on the MLP
output, 1.5 on its input, 1.25 on the attention output, 1 else), the variance of
``init="hyperball"``'s ``Uniform(c/sqrt(fan_in))``: train it with ``--init=hyperball``.

References:
  Li, `Preconditioned Stochastic Gradient Descent <https://arxiv.org/abs/1512.04202>`_, 2015;
  modded-nanogpt Track 3 result #33 (`results/20260527_psgd/train_psgd.py
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_snoo._src.psgd import FLOAT32_EPS, psgd_kron
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_hyperball import AuxAdamWHyperparameters, aux_adamw_stack
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["PSGDHyperparameters"]


@dataclasses.dataclass(frozen=True)
class PSGDHyperparameters(AuxAdamWHyperparameters):
    """Result #33's constants."""

    psgd_learning_rate: float = hyperparameter(0.025, "the hyperball's relative step at "
                                               "update 0, linear to 0 over the run",
                                               check="positive")
    psgd_b1: float = hyperparameter(0.95, "PSGD's momentum (bias-corrected)",
                                    check="unit_interval")
    precond_lr: float = hyperparameter(1.0, "the Kronecker factors' step (over the spectral "
                                       "norm)", check="positive")
    psgd_damping: float = hyperparameter(FLOAT32_EPS, "relative noise added to the fitted "
                                         "momentum (float32's eps)", check="non_negative")
    pin: str = hyperparameter("current", "the hyperball's radius: the norm the matrix has "
                              "(the log's), or the initial norm", choices=("current", "initial"))
    adam_cooldown_frac: float = hyperparameter(0.5, "the aux AdamW groups' cooldown fraction",
                                               check="positive_fraction")
    adam_final_lr_scale: float = hyperparameter(0.1, "the aux AdamW groups' lr at the end, "
                                                "times their peak", check="unit_interval")


def _psgd(t: PSGDHyperparameters, total_steps: int, *, labels: Any = None,
          adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
          shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.psgd_learning_rate, total_steps, cooldown_frac=1.0)
    matrices = psgd_kron(lr, t.psgd_b1, t.precond_lr, damping=t.psgd_damping, pin=t.pin,
                         shard_matrices=shard_newton_schulz,
                         newton_schulz_plan=newton_schulz_plan)
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, t.adam_cooldown_frac,
                                                     t.adam_final_lr_scale)
    return aux_adamw_stack(matrices, lr, t, schedule, labels=labels,
                           adam_patterns=adam_patterns)


track3_psgd = register(Recipe(
    "track3_psgd", PSGDHyperparameters, _psgd, options=TRACK3_OPTIONS, record_steps=3400,
    summary="Track 3 result #33 (3400 steps): PSGD Kron (whitening Kronecker factors fitted "
    "every step) on the hyperball, lr 0.025 linear to 0, aux AdamW (needs --init=hyperball)"))
