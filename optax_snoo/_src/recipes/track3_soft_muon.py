"""modded-nanogpt Track 3 result #20 (Contra-Muon to Soft-Muon, 3030 steps).

Per hidden matrix (PyTorch ``(out, in)`` in the record, our Flax ``(in, out)`` kernels), with
``‖X‖₄ = ‖XᵀX‖_F^{1/2}`` (the record's ``gram_frobenius_norm_estimate``) and ``t`` the
update count::

    m = 0.95 m + 0.05 g;  v = 0.95 m + 0.05 g                 # EMA-Nesterov momentum
    v = SOAP(v)   on mlp.fc, mlp.proj (and attn.v: blend 0.95, denominator floor 0.55)
    O = NS(v)                                                 # (2, -1.5, 0.5) x 12 on v/‖v‖₄
    C = [O - (k_t/2) v/‖v‖₄];  S = [Σ_j w_j X_j];  O = [C + b_t (S - C)]   # [Y] = Y ‖O‖₄/‖Y‖₄
    O = NorMuon-lite(O) (β₂ 0.95, ‖·‖₄ kept)
    O = O · max(1, 0.3825 ‖W‖/‖O‖);   W ← W - lr_t O        # the u/w floor, no decay

``k_t = 0.4 (1 - min(1, t/2000))`` (Contra-Muon fading out), ``b_t = min(0.8, clip((t -
2500)/510, 0, 1))`` (Soft-Muon, ``p = 0.1``, blending in), `optax_snoo.scale_by_muon`'s
``spectral_map="soft"``; SOAP is `optax_snoo.soap_whitening` (basis refreshed every 10
updates); every learning rate is PowerCool ``min(lr0, c (3105 - t)^1.2)`` with the run
ending at 3040 (the claim at 3030): Muon 0.0375, the aux AdamW's embedding 0.3, head
1/320, 1-D parameters 0.01 (betas (0.8, 0.95), eps 1e-10, no decay).

Ours differs from the log in three places, none of which changes the formula: the shape
scale comes after NorMuon-lite (which is scale-invariant up to its 1e-10 clamps), the
Soft-Muon series and its rescale are summed in float32 (the log keeps them in bfloat16, a
rounding of ~2^-8 on that term), and the V matrices' ``norm_preserving_blend`` with gate 1
(a second rescale to the momentum's ``‖·‖₄``, which SOAP's own rescale already gave it: a
factor 1 to rounding) is left out. The float64 test runs both programs with every step
constant crossed and agrees to 4e-13. The matrices of the three SOAP settings are three
`scale_by_muon` groups (each its own sharded plan). At ``N`` steps every step constant is
``round(x·N/3040)`` and each PowerCool constant keeps its flat fraction
(`optax_snoo.power_cool_scaled` at the scaled ``t_end``).

Result #32 (``results/20260518_soda_fade_3000_n9``, claim 3000 of the same 3040 steps) is
#20's script with every constant kept and SODA's anchor correction added to ``Muon.step``
(`track3_soda`): after the update and its u/w floor are formed from ``W``, the hidden
matrix is mixed toward its initial value, ``W ← (1 - λ_t) W + λ_t W₀ - lr_t O`` with
``λ_t = s_t/(t + 2)``, ``s_t`` 1 before update 2000, ``½(1 + cos(π (t - 2000)/750))`` to
2750 and 0 after (`optax_snoo.pull_to_init` last in the Muon chain). At ``N`` steps the
fade's two ends scale as the other step constants; the ``t + 2`` of dual averaging does not.

References:
  nilin, `Contra-Muon and Soft-Muon <https://nilin.github.io/contra-muon-and-soft-muon/>`_,
  2026

  Jordan et al., `modded-nanogpt Track 3 result #20 (results/20260509_contra_soft_muon)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  wakamex, `modded-nanogpt Track 3 result #32, SODA fade at 3000 steps
  (results/20260518_soda_fade_3000_n9)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.labels import by_path, partition
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import MuonGroup, group_labels, with_adam_groups
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import (
    TRACK3_ADAM_PATTERNS,
    adam_groups,
    patterns,
    steps_in_order,
)
from optax_snoo._src.recipes.track3_hyperball import AuxAdamWHyperparameters
from optax_snoo._src.schedules import power_cool_scaled
from optax_snoo._src.soap_muon import soap_whitening
from optax_snoo._src.trajectory import pull_to_init

__all__ = ["TRACK3_SOAP_MLP_PATTERN", "TRACK3_SOAP_V_PATTERN", "ContraSoftMuonHyperparameters",
           "SodaFadeHyperparameters"]

#: #20's MLP matrices (``mlp.fc``, ``mlp.proj``): SOAP whitening as #14's.
TRACK3_SOAP_MLP_PATTERN = r"(^|/)mlp/c_(fc|proj)/kernel$"
#: #20's attention value projections (``attn.v``): SOAP with #16's denominator floor and a
#: blend.
TRACK3_SOAP_V_PATTERN = r"(^|/)attn/c_v/kernel$"


@dataclasses.dataclass(frozen=True)
class ContraSoftMuonHyperparameters(AuxAdamWHyperparameters):
    """Result #20's constants, at its 3040 training steps."""

    RECORD_STEPS = 3040

    muon_learning_rate: float = hyperparameter(0.0375, "Muon's flat lr (PowerCool)",
                                               check="positive")
    power_cool_power: float = hyperparameter(1.2, "PowerCool's exponent", check="positive")
    power_cool_end: int = hyperparameter(3105, "PowerCool's t_end, where every lr would "
                                         "reach 0 (after the run's end)", check="at_least_1",
                                         steps=True)
    muon_power_cool_c: float = hyperparameter(3.3169534699576625e-06, "Muon's PowerCool c "
                                              "at its record lr and t_end", check="positive")
    embed_power_cool_c: float = hyperparameter(4.976805410800738e-05, "the embedding's "
                                               "PowerCool c", check="positive")
    head_power_cool_c: float = hyperparameter(5.184172302917436e-07, "the head's PowerCool c",
                                              check="positive")
    vector_power_cool_c: float = hyperparameter(1.6589351369335795e-06, "the 1-D groups' "
                                                "PowerCool c", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    muon_beta2: float = hyperparameter(0.95, "NorMuon-lite's per-neuron second-moment decay",
                                       check="unit_interval")
    uw_floor: float = hyperparameter(0.3825, "the u/w floor on ‖U‖/‖W‖ per matrix",
                                     check="non_negative")
    contra_muon: float = hyperparameter(0.4, "Contra-Muon's strength at update 0 (the log's "
                                        "CONTRA_MUON_COEFF -0.2 = -c/2)", check="non_negative")
    contra_end: int = hyperparameter(2000, "Contra-Muon has faded linearly to 0 here",
                                     check="at_least_1", steps=True)
    soft_power: float = hyperparameter(0.1, "Soft-Muon's singular-value power p",
                                       check="non_negative")
    soft_start: int = hyperparameter(2500, "Soft-Muon's blend starts rising from 0",
                                     check="at_least_1", steps=True)
    soft_end: int = hyperparameter(3010, "Soft-Muon's blend would reach 1 here",
                                   check="at_least_1", steps=True)
    soft_cap: float = hyperparameter(0.8, "the cap on Soft-Muon's blend", check="fraction")
    soap_beta: float = hyperparameter(0.9, "SOAP's Gram and V decay", check="unit_interval")
    soap_frequency: int = hyperparameter(10, "SOAP's basis refresh period (updates)",
                                         check="at_least_1")
    v_soap_blend: float = hyperparameter(0.95, "attn.v's whitened share (V_SOAP_BLEND)",
                                         check="positive_fraction")
    v_soap_denom_floor: float = hyperparameter(0.55, "attn.v's SOAP denominators floored at "
                                               "this times their RMS", check="non_negative")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))

    def validate(self) -> None:
        steps_in_order(self, "contra_end", "soft_start", "soft_end")


@dataclasses.dataclass(frozen=True)
class SodaFadeHyperparameters(ContraSoftMuonHyperparameters):
    """Result #32's constants: #20's, and SODA's pull of the hidden matrices to their start."""

    soda_strength: float = hyperparameter(1.0, "SODA's strength s (the pull is s/(t+2) of "
                                          "the way to the initial weights)",
                                          check="non_negative")
    soda_fade_start: int = hyperparameter(2000, "SODA's cosine fade of s starts here",
                                          check="at_least_1", steps=True)
    soda_fade_end: int = hyperparameter(2750, "SODA's fade has reached 0 here",
                                        check="at_least_1", steps=True)

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "soda_fade_start", "soda_fade_end")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ContraSoftMuonHyperparameters)}


def _power_cool(t: ContraSoftMuonHyperparameters, group: str) -> optax.Schedule:
    """``group``'s PowerCool ``min(lr, c' (t_end - t)^p)``: the record's c, at its lr and
    t_end, rescaled to this lr and (scaled) t_end, so the flat part keeps its fraction."""
    return power_cool_scaled(
        getattr(t, f"{group}_learning_rate"), c=getattr(t, f"{group}_power_cool_c"),
        lr0_record=_DEFAULTS[f"{group}_learning_rate"],
        record_steps=_DEFAULTS["power_cool_end"], total_steps=t.power_cool_end,
        power=t.power_cool_power)


def _ramp(start: int, end: int) -> optax.Schedule:
    """The log's ``_linear_ramp``: 0 before ``start``, 1 from ``end``, linear between."""
    def schedule(count: Any) -> jax.Array:
        t = jnp.asarray(count).astype(jnp.result_type(float))  # float64 under x64
        return jnp.clip((t - start) / (end - start), 0.0, 1.0)
    return schedule


def _cosine_fade(start: int, end: int) -> optax.Schedule:
    """#32's ``soda_fade_multiplier``: 1 before ``start``, 0 from ``end``, a half cosine
    between."""
    ramp = _ramp(start, end)
    return lambda count: 0.5 * (1.0 + jnp.cos(jnp.pi * ramp(count)))


def _contra_soft_muon(t: ContraSoftMuonHyperparameters, total_steps: int, *,
                      labels: Any = None, adam_patterns: dict[str, str] | None = None,
                      newton_schulz_plan: Any = None, shard_newton_schulz: bool = True,
                      soap_mlp_pattern: str = TRACK3_SOAP_MLP_PATTERN,
                      soap_v_pattern: str = TRACK3_SOAP_V_PATTERN) -> Stack:
    lr = _power_cool(t, "muon")
    fade = _ramp(0, t.contra_end)
    rise = _ramp(t.soft_start, t.soft_end)
    direction = dict(
        beta2=t.muon_beta2, normuon_norm="gram_frobenius", coefficients="track3",
        ns_normalization="gram_frobenius", ns_dtype=t.ns_dtype, spectral_map="soft",
        soft_power=t.soft_power, soft_contra=lambda n: t.contra_muon * (1 - fade(n)),
        spectral_strength=lambda n: jnp.minimum(t.soft_cap, rise(n)),
        newton_schulz_plan=newton_schulz_plan, shard_newton_schulz=shard_newton_schulz)

    def muon_group(**soap: Any) -> optax.GradientTransformation:
        whitening = soap_whitening(t.soap_beta, precondition_frequency=t.soap_frequency,
                                   **soap) if soap else None
        return optax.chain(
            scale_by_muon(t.muon_momentum, precondition=whitening, **direction),
            radius_steps(lr, brake=None, floor=t.uw_floor, floor_per="matrix", pin=None,
                         cautious_weight_decay=0.0))

    kind = by_path([(soap_mlp_pattern, "soap_mlp"), (soap_v_pattern, "soap_v")],
                   default="plain", what="SOAP group")
    muon_tx = partition({"plain": muon_group(),
                         "soap_mlp": muon_group(blend=1.0),
                         "soap_v": muon_group(blend=t.v_soap_blend,
                                              denom_floor=t.v_soap_denom_floor)}, kind)
    if isinstance(t, SodaFadeHyperparameters):  # #32: after the step is formed from W
        soda = _cosine_fade(t.soda_fade_start, t.soda_fade_end)
        muon_tx = optax.chain(muon_tx, pull_to_init(lambda n: t.soda_strength * soda(n)))
    names = patterns(TRACK3_ADAM_PATTERNS, adam_patterns)
    groups = adam_groups(names, [  # torch's AdamW, bias-corrected, no decay
        (name, _power_cool(t, group), t.adam_b1, t.adam_b2, t.adam_eps, 0.0, True)
        for name, group in (("vectors", "vector"), ("embed", "embed"), ("head", "head"))])
    shown = [MuonGroup(soap_mlp_pattern, name="soap_mlp"),
             MuonGroup(soap_v_pattern, name="soap_v"), MuonGroup(".*", name="plain")]
    return Stack(with_adam_groups(muon_tx, groups, labels=labels), lr,
                 groups=group_labels(groups, labels, muon_groups=shown))


track3_contra_soft_muon = register(Recipe(
    "track3_contra_soft_muon", ContraSoftMuonHyperparameters, _contra_soft_muon,
    options={**TRACK3_OPTIONS, "soap_mlp_pattern": TRACK3_SOAP_MLP_PATTERN,
             "soap_v_pattern": TRACK3_SOAP_V_PATTERN},
    summary="Track 3 result #20 (3040 steps, claim 3030): Contra-Muon fading to Muon, then "
    "blending into Soft-Muon p=0.1, SOAP on MLP and V, NorMuon-lite, the u/w floor 0.3825, "
    "every lr on PowerCool"))
track3_soda = register(Recipe(
    "track3_soda", SodaFadeHyperparameters, _contra_soft_muon,
    options={**TRACK3_OPTIONS, "soap_mlp_pattern": TRACK3_SOAP_MLP_PATTERN,
             "soap_v_pattern": TRACK3_SOAP_V_PATTERN},
    summary="Track 3 result #32 (3040 steps, claim 3000): #20's stack with SODA's pull of the "
    "hidden matrices toward their initial values, s/(t+2) with s 1 to update 2000, "
    "cosine-faded to 0 at 2750"))
