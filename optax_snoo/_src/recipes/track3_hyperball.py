"""modded-nanogpt Track 3's hyperball records: MuonH (#5), NorMuonH (#8), MuLoCo around
NorMuonH (#13) and AdamH (#4).

MuonH: Muon's direction ``O`` (momentum 0.95, Newton-Schulz ``(2, -1.5, 0.5)`` x 12) and
`optax_snoo.radius_steps` with ``pin="initial"``: ``W' = W - lr·‖W₀‖·O/‖O‖``, retracted to
the sphere of radius ``‖W₀‖`` (each matrix keeps its initial norm; no weight decay); lr
0.018 decaying linearly to 0 over the whole run. Aux AdamW (betas (0.8, 0.95), eps 1e-10,
no decay, bias-corrected): embedding 0.3, head 1/320, 1-D 0.01, flat then linear to 0
over the last 40%. ``muon_beta2=0.95`` is NorMuonH (#8): NorMuon's per-neuron
normalisation before the retraction. MuLoCo (#13): Snoo's outer step after every 30th
update (``sync="end"``, 0.7, 0.5) around NorMuonH with ``pin="current"`` (#5's
``scale_invariant_update_`` keeps the radius the matrix has, which the outer step moves).

AdamH (#4): the same hyperball step along Adam's direction ``m̂/(sqrt(v̂) + 1e-8)`` (betas
(0.9, 0.95), bias-corrected) instead of Muon's, its lr 0.018 warmed up from 0 over 250 steps
(``t/250``), then ``1 - t/T`` (the record's ``set_hparams``: the two pieces meet with a drop
at step 250); the same aux AdamW.

A zero-initialised matrix stays zero on the hyperball: the records initialise every hidden
matrix non-zero (``models.GPTConfig(init="hyperball")``).

References:
  Jordan et al., `modded-nanogpt Track 3 records #4 (AdamH), #5 (MuonH), #8 (NorMuonH),
  #13 (MuLoCo-NorMuonH)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax

from optax_snoo._src.adam import scale_by_adam
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import group_labels, with_adam_groups
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.recipes.base import (
    Hyperparameters,
    Recipe,
    Stack,
    hyperparameter,
    register,
    with_snoo,
)
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import TRACK3_ADAM_PATTERNS, adam_groups, patterns
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["AdamHHyperparameters", "AuxAdamWHyperparameters", "MuonHHyperparameters",
           "aux_adamw_groups", "aux_adamw_stack", "aux_schedule"]


@dataclasses.dataclass(frozen=True)
class AuxAdamWHyperparameters(Hyperparameters):
    """The aux ``torch.optim.AdamW`` of records #5, #8, #13 and #15: embedding, head and 1-D
    groups, betas (0.8, 0.95), eps 1e-10, no decay."""

    embed_learning_rate: float = hyperparameter(0.3, "AdamW's peak lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(1 / 320, "AdamW's peak lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.01, "AdamW's peak lr on every 1-D "
                                                 "parameter", check="positive")
    adam_b1: float = hyperparameter(0.8, "AdamW's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.95, "AdamW's second-moment decay",
                                    check="unit_interval")
    adam_eps: float = hyperparameter(1e-10, "AdamW's epsilon", check="positive")


def aux_schedule(total_steps: int, cooldown_frac: float) -> Callable[[float], Any]:
    """The aux AdamW groups' usual schedule: ``peak`` flat, then linear to 0 over the last
    ``cooldown_frac`` of ``total_steps``."""
    return lambda peak: stable_cooldown_schedule(peak, total_steps, cooldown_frac)


def aux_adamw_groups(t: AuxAdamWHyperparameters, names: dict[str, str], total_steps: int,
                     cooldown_frac: float) -> list:
    """The aux AdamW groups on a flat-then-linear schedule."""
    return _aux_groups(t, names, aux_schedule(total_steps, cooldown_frac))


def _aux_groups(t: AuxAdamWHyperparameters, names: dict[str, str],
                schedule: Callable[[float], Any]) -> list:
    """The aux AdamW groups (vectors, embed, head), each on ``schedule(its peak lr)``."""
    return adam_groups(names, [
        (name, schedule(lr), t.adam_b1, t.adam_b2, t.adam_eps, 0.0, True)
        for name, lr in (("vectors", t.vector_learning_rate), ("embed", t.embed_learning_rate),
                         ("head", t.head_learning_rate))])


def aux_adamw_stack(matrices: optax.GradientTransformation, lr: Any,
                    t: AuxAdamWHyperparameters, schedule: Callable[[float], Any], *,
                    labels: Any = None, adam_patterns: dict[str, str] | None = None) -> Stack:
    """The Track 3 recipes' common tail: ``matrices`` on the hidden matrices and the aux AdamW
    groups (`TRACK3_ADAM_PATTERNS` updated by ``adam_patterns``, each on
    ``schedule(peak)``, e.g. `aux_schedule`) on the rest, as a `Stack` reporting ``lr``."""
    groups = _aux_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), schedule)
    return Stack(with_adam_groups(matrices, groups, labels=labels), lr,
                 groups=group_labels(groups, labels))


@dataclasses.dataclass(frozen=True)
class MuonHHyperparameters(AuxAdamWHyperparameters):
    """Record #5's MuonH (#8 with ``muon_beta2``)."""

    muon_learning_rate: float = hyperparameter(0.018, "the hyperball's relative step at "
                                               "update 0, linear to 0 over the run",
                                               check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum", check="unit_interval")
    muon_beta2: float | None = hyperparameter(None, "NorMuon's per-neuron second-moment decay "
                                              "(NorMuonH #8: 0.95; None = MuonH)",
                                              check="unit_interval")
    pin: str = hyperparameter("initial", "the hyperball's radius: the initial norm, or the "
                              "norm the matrix has (#5's code; differs under an outer "
                              "optimizer)", choices=("initial", "current"))
    adam_cooldown_frac: float = hyperparameter(0.4, "the AdamW groups' cooldown fraction",
                                               check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _muonh(t: MuonHHyperparameters, total_steps: int, *, labels: Any = None,
           adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
           shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, cooldown_frac=1.0)
    muon_tx = optax.chain(
        scale_by_muon(t.muon_momentum, beta2=t.muon_beta2, coefficients="track3",
                      ns_dtype=t.ns_dtype, newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz),
        radius_steps(lr, brake=None, floor=None, pin=t.pin, cautious_weight_decay=0.0))
    return aux_adamw_stack(muon_tx, lr, t, aux_schedule(total_steps, t.adam_cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


muonh = register(Recipe(
    "muonh", MuonHHyperparameters, _muonh, options=TRACK3_OPTIONS, record_steps=3325,
    summary="Track 3 record #5's MuonH: Muon on the hyperball (each matrix kept at its "
    "initial norm), aux AdamW; muon_beta2=0.95 is NorMuonH (#8)"))
muloco_normuonh = register(with_snoo(
    muonh, "muloco_normuonh", sync="end", snoo_learning_rate=0.7, snoo_momentum=0.5,
    snoo_k=30, muon_beta2=0.95, pin="current",
    summary="Track 3 record #13 (3210 = 107 x 30 steps): MuLoCo's outer Nesterov (0.7, 0.5) "
    "after every 30th update around NorMuonH with the radius it finds"))
muloco_normuonh.record_steps = 3210


@dataclasses.dataclass(frozen=True)
class AdamHHyperparameters(AuxAdamWHyperparameters):
    """Record #4's AdamH, at its 4875 steps."""

    RECORD_STEPS = 4875

    matrix_learning_rate: float = hyperparameter(0.018, "the hyperball's relative step after "
                                                 "the warm-up, linear to 0 over the run",
                                                 check="positive")
    matrix_b1: float = hyperparameter(0.9, "AdamH's first-moment decay", check="unit_interval")
    matrix_b2: float = hyperparameter(0.95, "AdamH's second-moment decay",
                                      check="unit_interval")
    matrix_eps: float = hyperparameter(1e-8, "AdamH's epsilon", check="positive")
    warmup_steps: int = hyperparameter(250, "the matrices' warm-up from 0 (steps at 4875)",
                                       check="at_least_0", steps=True)
    pin: str = hyperparameter("initial", "the hyperball's radius: the initial norm, or the "
                              "norm the matrix has (the same without an outer optimizer)",
                              choices=("initial", "current"))
    adam_cooldown_frac: float = hyperparameter(0.4, "the aux AdamW groups' cooldown fraction",
                                               check="positive_fraction")


def _adamh(t: AdamHHyperparameters, total_steps: int, *, labels: Any = None,
           adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
           shard_newton_schulz: bool = True) -> Stack:
    del newton_schulz_plan, shard_newton_schulz  # Adam's direction: no Newton-Schulz
    cool = stable_cooldown_schedule(t.matrix_learning_rate, total_steps, cooldown_frac=1.0)

    def lr(count):  # the record's eta: t/warmup during the warm-up, then 1 - t/T
        if t.warmup_steps == 0:
            return cool(count)
        step = jnp.asarray(count, jnp.result_type(float))  # float64 under x64
        warm = t.matrix_learning_rate * step / t.warmup_steps
        return jnp.where(step < t.warmup_steps, warm, cool(count))
    matrices = optax.chain(
        scale_by_adam(t.matrix_b1, t.matrix_b2, t.matrix_eps),
        radius_steps(lr, brake=None, floor=None, pin=t.pin, cautious_weight_decay=0.0))
    return aux_adamw_stack(matrices, lr, t, aux_schedule(total_steps, t.adam_cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


adamh = register(Recipe(
    "adamh", AdamHHyperparameters, _adamh, options=TRACK3_OPTIONS,
    summary="Track 3 record #4's AdamH (4875 steps): Adam's direction on the hyperball (each "
    "matrix kept at its initial norm), lr 0.018 warmed up over 250 steps then linear to 0, "
    "aux AdamW"))
