"""modded-nanogpt Track 3's NorMuon-lite + u/w floor (#9), Contra-Muon on it (#11) and
Aurora + Contra-Muon + u/w floor (#17).

#9 (Skylight-001, 3250 steps): Muon (EMA-Nesterov momentum 0.95, Newton-Schulz
``(2, -1.5, 0.5)`` x 12 in bfloat16 after ``X/(‖X‖_F + 1e-7)``, shape scale
``sqrt(max(1, out/in))``), NorMuon-lite (per-neuron second moment, β₂ 0.95, Frobenius norm
kept), then the u/w floor: per matrix, if ``‖U‖/‖W‖ < 0.35`` the update is scaled up to
``0.35‖W‖`` (norms clamped at 1e-8); ``W ← W - lr·U``, lr 0.0375, no weight decay (the
logs print ``weight_decay=0.025``, which ``Muon.step`` never reads); the aux AdamW
(embedding 0.3, head 1/320, 1-D 0.01, betas (0.8, 0.95), eps 1e-10, no decay); every lr
flat for 30%, then linear to 0.

#11 (Contra-Muon, 3225 steps): #9 with ``O ← O - 0.2·v/‖v‖_op`` rescaled to ``‖O‖_F``
after Newton-Schulz (`optax_snoo.scale_by_muon`'s ``spectral_map="contra"``,
``CONTRA_MUON=0.4``).

#17 (Aurora, 3200-step schedule, 3.28 crossed at 3175): #11's Contra-Muon and u/w floor
without NorMuon-lite, the polar replaced by Aurora's leverage-uniform ``polar(D·v)`` (2
rounds, damping 0.5; `optax_snoo.scale_by_muon`'s ``aurora_iterations``/``aurora_beta``).

Ours differs from the logs in one place: the shape scale is applied after NorMuon (the
logs apply it before); NorMuon's normalisation is scale-invariant, so the update is the
same up to its 1e-10 clamps, and the second moment holds ``1/s²`` of the log's.

References:
  Tilde Research, `Aurora <https://github.com/tilde-research/aurora-release>`_, 2026

  nilin, `Contra-Muon <https://github.com/nilin/contra-muon>`_, 2026; modded-nanogpt
  Track 3 results #9 (`results/20260501_skylight001`) and #11
  (`results/20260501_contra_muon`) and #17 (`results/20260505_aurora
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_hyperball import (
    AuxAdamWHyperparameters,
    aux_adamw_stack,
    aux_schedule,
)
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["AuroraHyperparameters", "ContraMuonHyperparameters",
           "NorMuonFloorHyperparameters"]


@dataclasses.dataclass(frozen=True)
class NorMuonFloorHyperparameters(AuxAdamWHyperparameters):
    """Results #9's and #11's constants (#9's by default)."""

    muon_learning_rate: float = hyperparameter(0.0375, "Muon's peak lr", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    muon_beta2: float = hyperparameter(0.95, "NorMuon-lite's per-neuron second-moment decay",
                                       check="unit_interval")
    uw_floor: float = hyperparameter(0.35, "the u/w floor on ‖U‖/‖W‖ per matrix",
                                     check="non_negative")
    contra_muon: float | None = hyperparameter(
        None, "Contra-Muon's CONTRA_MUON (#11: 0.4; None = #9, no spectral map)",
        check="non_negative")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


@dataclasses.dataclass(frozen=True)
class ContraMuonHyperparameters(NorMuonFloorHyperparameters):
    """Result #11's constants: #9's with ``CONTRA_MUON=0.4``."""

    contra_muon: float | None = hyperparameter(
        0.4, "Contra-Muon's CONTRA_MUON (None = #9, no spectral map)", check="non_negative")


@dataclasses.dataclass(frozen=True)
class AuroraHyperparameters(ContraMuonHyperparameters):
    """Result #17's constants: #11's without NorMuon-lite, Aurora's polar (2 rounds, 0.5)."""

    muon_beta2: float | None = hyperparameter(
        None, "NorMuon-lite's second-moment decay (#17: None, no NorMuon)",
        check="unit_interval")
    aurora_iterations: int = hyperparameter(
        2, "Aurora's rounds of polar(D v) (pp_iterations; 1 = Muon EQ)", check="at_least_1")
    aurora_beta: float = hyperparameter(0.5, "Aurora's damping exponent of D's update "
                                        "(pp_beta)", check="positive_fraction")


def _normuon_floor(t: NorMuonFloorHyperparameters, total_steps: int, *, labels: Any = None,
                   adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
                   shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    contra = {} if t.contra_muon is None else dict(spectral_map="contra",
                                                   spectral_strength=t.contra_muon)
    if isinstance(t, AuroraHyperparameters):
        contra |= dict(aurora_iterations=t.aurora_iterations, aurora_beta=t.aurora_beta)
    muon_tx = optax.chain(
        scale_by_muon(t.muon_momentum, beta2=t.muon_beta2, coefficients="track3",
                      ns_dtype=t.ns_dtype, newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz, **contra),
        radius_steps(lr, brake=None, floor=t.uw_floor, floor_per="matrix", pin=None,
                     cautious_weight_decay=0.0))
    return aux_adamw_stack(muon_tx, lr, t, aux_schedule(total_steps, t.cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


track3_normuon_floor = register(Recipe(
    "track3_normuon_floor", NorMuonFloorHyperparameters, _normuon_floor,
    options=TRACK3_OPTIONS, record_steps=3250,
    summary="Track 3 result #9 (3250 steps): NorMuon-lite with the u/w floor 0.35 (lr "
    "0.0375, no decay), the aux AdamW"))
track3_contra_muon = register(Recipe(
    "track3_contra_muon", ContraMuonHyperparameters, _normuon_floor,
    options=TRACK3_OPTIONS, record_steps=3225,
    summary="Track 3 result #11 (3225 steps): Contra-Muon (O - 0.2 v/‖v‖_op, rescaled) on "
    "#9's NorMuon-lite + u/w floor"))
track3_aurora = register(Recipe(
    "track3_aurora", AuroraHyperparameters, _normuon_floor,
    options=TRACK3_OPTIONS, record_steps=3200,
    summary="Track 3 result #17 (3200-step schedule, 3.28 at 3175): Aurora's leverage-uniform "
    "polar(D v) with #11's Contra-Muon and u/w floor 0.35, no NorMuon"))
