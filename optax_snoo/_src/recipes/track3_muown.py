"""modded-nanogpt Track 3 results #23 (Muown, 3.28 at 3125 of 3200 steps) and #31 (Muown
with Contra-Muon and NorMuon-lite, 2995 of 3000 steps).

Every hidden matrix is per-row gains times unit directions (`optax_snoo.muown`): the
directions move by Muon on the tangent gradient (summed Nesterov momentum 0.95, the
record's 12-step Polar Express, shape scale ``0.2 sqrt(max(m, n))``) on a sphere whose
radius rises from each row's initial norm to 2.688 (8.96 on mlp.proj) by a smoothstep
over the run; the gains take Adam (betas (0.9, 0.95), eps 1e-8) at the same learning rate
0.0035. The aux AdamW: embedding 0.9, head 0.009375, 1-D parameters 0.03 (betas
(0.8, 0.95), eps 1e-10, no decay); every lr flat for 30%, then linear to 0.

#31 moves the directions by #11's Contra-Muon (``O - (c/2) v/‖v‖_op``, ``c`` 0.65 falling
linearly to 0 at step 1925) and NorMuon-lite (β₂ 0.8) on the same Muon (momentum 0.946),
the radius rising as ``p^0.9`` over 3005 steps to 2.496 (×1.5 on attn.proj and mlp.fc,
×10/3 on mlp.proj), lr 0.0045, embedding 0.6; every lr flat for 30% of a 3045-step
schedule, then ``((1 - t/3045)/0.7)^0.9`` (the run stops at 3000). At ``N`` steps its step
constants are ``round(x·N/3000)``.

References:
  fhuebler and kcc-lion, `Muown <https://arxiv.org/abs/2605.10797>`_, 2026; modded-nanogpt
  Track 3 result #23 (`results/20260508_muown
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.labels import by_path
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muown import muown
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import steps_in_order
from optax_snoo._src.recipes.track3_hyperball import (
    AuxAdamWHyperparameters,
    aux_adamw_stack,
    aux_schedule,
)
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["MUOWN_POLAR_EXPRESS", "TRACK3_MLP_PROJ_PATTERN", "ContraNorMuownHyperparameters",
           "MuownHyperparameters"]

#: #23's ``POLAR_EXPRESS_LONG_COEFFS`` for its 12 iterations (the last repeats).
MUOWN_POLAR_EXPRESS = ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                       (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                       (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                       (1.8564, -1.2132, 0.3568)) + ((1.8750, -1.2500, 0.3750),) * 5
#: The MLP output projections (``mlp.proj``), whose radius target #23 multiplies.
TRACK3_MLP_PROJ_PATTERN = r"(^|/)mlp/c_proj/kernel$"


@dataclasses.dataclass(frozen=True)
class MuownHyperparameters(AuxAdamWHyperparameters):
    """Result #23's constants."""

    muon_learning_rate: float = hyperparameter(0.0035, "Muown's lr (directions and gains)",
                                               check="positive")
    muon_momentum: float = hyperparameter(0.95, "the directions' summed Nesterov momentum",
                                          check="unit_interval")
    radius_target: float = hyperparameter(2.688, "the directions' radius at the end "
                                          "(V_NORM_TARGET_SCALE)", check="positive")
    mlp_proj_radius_mult: float = hyperparameter(3.33333333333, "mlp.proj's multiplier of "
                                                 "the radius target", check="positive")
    gain_b1: float = hyperparameter(0.9, "the gains' Adam first-moment decay",
                                    check="unit_interval")
    gain_b2: float = hyperparameter(0.95, "the gains' Adam second-moment decay",
                                    check="unit_interval")
    gain_eps: float = hyperparameter(1e-8, "the gains' Adam epsilon", check="positive")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    embed_learning_rate: float = hyperparameter(0.9, "AdamW's peak lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(0.009375, "AdamW's peak lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.03, "AdamW's peak lr on every 1-D "
                                                 "parameter", check="positive")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _muown(t: MuownHyperparameters, total_steps: int, *, labels: Any = None,
           adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
           shard_newton_schulz: bool = True,
           mlp_proj_pattern: str = TRACK3_MLP_PROJ_PATTERN) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    direction = optax.chain(
        # EMA momentum of G_v/(1-β) is the record's summed momentum of G_v
        optax.scale(1 / (1 - t.muon_momentum)),
        scale_by_muon(t.muon_momentum, coefficients=MUOWN_POLAR_EXPRESS,
                      shape_scale="consistent_rms", ns_dtype=t.ns_dtype,
                      newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz))
    target = by_path([(mlp_proj_pattern, t.radius_target * t.mlp_proj_radius_mult)],
                     default=t.radius_target, what="radius target")
    muon_tx = muown(direction, lr, radius_target=target.value, radius_steps=total_steps,
                    gain_b1=t.gain_b1, gain_b2=t.gain_b2, gain_eps=t.gain_eps)
    return aux_adamw_stack(muon_tx, lr, t, aux_schedule(total_steps, t.cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


track3_muown = register(Recipe(
    "track3_muown", MuownHyperparameters, _muown,
    options={**TRACK3_OPTIONS, "mlp_proj_pattern": TRACK3_MLP_PROJ_PATTERN},
    record_steps=3200,
    summary="Track 3 result #23 (3.28 at 3125 of 3200 steps): Muown, per-row gains (Adam) "
    "times unit directions moved by Muon on a radius rising 2.688 (x10/3 on mlp.proj) by "
    "a smoothstep, lr 0.0035; aux AdamW 0.9 / 0.009375 / 0.03, cooldown 0.7"))


#: #31's radius multipliers by family (``V_NORM_FAMILY_MULT``); q, k, v: 1.
_FAMILY = (("attn_proj", r"(^|/)attn/c_proj/kernel$"), ("mlp_fc", r"(^|/)mlp/c_fc/kernel$"),
           ("mlp_proj", TRACK3_MLP_PROJ_PATTERN))


@dataclasses.dataclass(frozen=True)
class ContraNorMuownHyperparameters(AuxAdamWHyperparameters):
    """Result #31's constants, at its 3000 steps."""

    RECORD_STEPS = 3000

    muon_learning_rate: float = hyperparameter(0.0045, "Muown's flat lr (directions and "
                                               "gains)", check="positive")
    muon_momentum: float = hyperparameter(0.946, "the directions' summed Nesterov momentum",
                                          check="unit_interval")
    contra_muon: float = hyperparameter(0.65, "Contra-Muon's CONTRA_MUON at step 0",
                                        check="non_negative")
    contra_end: int = hyperparameter(1925, "Contra-Muon has faded linearly to 0 here",
                                     check="at_least_1", steps=True)
    muon_beta2: float = hyperparameter(0.8, "NorMuon-lite's second-moment decay",
                                       check="unit_interval")
    radius_target: float = hyperparameter(2.496, "the directions' radius at the schedule's "
                                          "end (V_NORM_TARGET_SCALE)", check="positive")
    attn_proj_radius_mult: float = hyperparameter(1.5, "attn.proj's multiplier of the "
                                                  "radius target", check="positive")
    mlp_fc_radius_mult: float = hyperparameter(1.5, "mlp.fc's multiplier", check="positive")
    mlp_proj_radius_mult: float = hyperparameter(3.33333333333, "mlp.proj's multiplier",
                                                 check="positive")
    radius_steps: int = hyperparameter(3005, "the radius schedule's length "
                                       "(V_NORM_SCHEDULE_STEPS)", check="at_least_1",
                                       steps=True)
    radius_power: float = hyperparameter(0.9, "the radius schedule's power",
                                         check="positive")
    gain_b1: float = hyperparameter(0.9, "the gains' Adam first-moment decay",
                                    check="unit_interval")
    gain_b2: float = hyperparameter(0.95, "the gains' Adam second-moment decay",
                                    check="unit_interval")
    gain_eps: float = hyperparameter(1e-8, "the gains' Adam epsilon", check="positive")
    schedule_steps: int = hyperparameter(3045, "the lr schedule's length "
                                         "(LR_SCHEDULE_STEPS)", check="at_least_1",
                                         steps=True)
    cooldown_frac: float = hyperparameter(0.7, "every lr's cooldown fraction (of "
                                          "schedule_steps)", check="positive_fraction")
    cooldown_power: float = hyperparameter(0.9, "the cooldown's power (LR_POWER)",
                                           check="positive")
    embed_learning_rate: float = hyperparameter(0.6, "AdamW's flat lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(0.009375, "AdamW's flat lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.03, "AdamW's flat lr on every 1-D "
                                                 "parameter", check="positive")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))

    def validate(self) -> None:
        steps_in_order(self, "contra_end", "radius_steps")


def _powered_cooldown(peak: float, steps: int, frac: float, power: float) -> optax.Schedule:
    """#31's ``lr_eta``: 1 while ``t/S < 1 - frac``, then ``((1 - t/S)/frac)^power``."""
    def schedule(count: Any) -> jax.Array:
        progress = jnp.asarray(count).astype(jnp.result_type(float)) / steps
        cool = jnp.maximum((1 - progress) / frac, 0.0) ** power
        return peak * jnp.where(progress < 1 - frac, 1.0, cool)
    return schedule


def _contra_normuown(t: ContraNorMuownHyperparameters, total_steps: int, *,
                     labels: Any = None, adam_patterns: dict[str, str] | None = None,
                     newton_schulz_plan: Any = None, shard_newton_schulz: bool = True) -> Stack:
    sched = lambda peak: _powered_cooldown(peak, t.schedule_steps, t.cooldown_frac,
                                           t.cooldown_power)
    lr = sched(t.muon_learning_rate)
    contra = lambda n: t.contra_muon * (1 - jnp.clip(
        jnp.asarray(n).astype(jnp.result_type(float)) / t.contra_end, 0.0, 1.0))
    direction = optax.chain(
        optax.scale(1 / (1 - t.muon_momentum)),  # the record's summed momentum, as in #23
        scale_by_muon(t.muon_momentum, coefficients=MUOWN_POLAR_EXPRESS,
                      shape_scale="consistent_rms", spectral_map="contra",
                      spectral_strength=contra, beta2=t.muon_beta2, ns_dtype=t.ns_dtype,
                      newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz))
    target = by_path([(pattern, t.radius_target * getattr(t, f"{name}_radius_mult"))
                      for name, pattern in _FAMILY], default=t.radius_target,
                     what="radius target")
    muon_tx = muown(direction, lr, radius_target=target.value, radius_steps=t.radius_steps,
                    radius_power=t.radius_power, gain_b1=t.gain_b1, gain_b2=t.gain_b2,
                    gain_eps=t.gain_eps)
    # torch's AdamW, bias-corrected, no decay
    return aux_adamw_stack(muon_tx, lr, t, sched, labels=labels, adam_patterns=adam_patterns)


track3_contra_normuown = register(Recipe(
    "track3_contra_normuown", ContraNorMuownHyperparameters, _contra_normuown,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #31 (2995 of 3000 steps): Muown with Contra-Muon (0.65, fading "
    "by step 1925) and NorMuon-lite (0.8) on its directions, radius p^0.9 to 2.496 (x1.5 "
    "attn.proj, mlp.fc; x10/3 mlp.proj), lr 0.0045; aux AdamW 0.6 / 0.009375 / 0.03; every "
    "lr flat 30% of 3045 steps, then a 0.9-power cooldown"))
