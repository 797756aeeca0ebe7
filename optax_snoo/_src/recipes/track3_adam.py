"""modded-nanogpt Track 3's plain Adam baseline, result #2 (5625 steps): AdamW on the hidden
matrices in place of Muon, the aux AdamW groups unchanged, every group warmed up.

- the blocks' matrices (`optax_snoo.labels.muon_adam_labels`' ``"muon"`` leaves): AdamW
  (PyTorch's: bias-corrected, ``p ← p (1 - lr·wd)``), lr 0.0015, betas (0.9, 0.95), eps
  1e-10, wd 0.1;
- aux AdamW (betas (0.8, 0.95), eps 1e-10, no decay): embedding 0.3, head 1/320, every 1-D
  parameter 0.01;
- every group: ``lr·min(1, (t + 1)/250)·eta(t)`` with ``eta`` flat for the first 30% of the run,
  then linear to 0 (`optax_snoo.stable_cooldown_schedule` with ``warmup_steps``); the warm-up is
  a step constant of the record's 5625 and scales with the run.

References:
  Jordan, `modded-nanogpt Track 3 result #2, Adam (results/a63a68d1-24aa-4a22-af9a-224e43209ea4.txt)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026; Kingma and Ba, `Adam: A Method for Stochastic Optimization
  <https://arxiv.org/abs/1412.6980>`_, 2015
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from optax_snoo._src.adam import AdamGroup, adam_group
from optax_snoo._src.labels import partition
from optax_snoo._src.muon_adam import group_labels
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import TRACK3_ADAM_PATTERNS, patterns
from optax_snoo._src.recipes.track3_hyperball import AuxAdamWHyperparameters, _aux_groups
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["Track3AdamHyperparameters"]


@dataclasses.dataclass(frozen=True)
class Track3AdamHyperparameters(AuxAdamWHyperparameters):
    """Result #2's constants (AdamW on the matrices, the aux groups of #5's family)."""

    RECORD_STEPS = 5625

    matrix_learning_rate: float = hyperparameter(0.0015, "AdamW's peak lr on the blocks' "
                                                 "matrices", check="positive")
    matrix_b1: float = hyperparameter(0.9, "the matrices' first-moment decay",
                                      check="unit_interval")
    matrix_b2: float = hyperparameter(0.95, "the matrices' second-moment decay",
                                      check="unit_interval")
    matrix_weight_decay: float = hyperparameter(0.1, "the matrices' decoupled weight decay "
                                                "(times the lr)", check="non_negative")
    warmup_steps: int = hyperparameter(250, "every group's linear warm-up (steps at 5625)",
                                       check="at_least_0", steps=True)
    cooldown_frac: float = hyperparameter(0.7, "fraction of the run in the linear cooldown "
                                          "to 0", check="positive_fraction")


def _track3_adam(t: Track3AdamHyperparameters, total_steps: int, *, labels: Any = None,
                 adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
                 shard_newton_schulz: bool = True) -> Stack:
    del newton_schulz_plan, shard_newton_schulz  # no Newton-Schulz: AdamW on the matrices
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, t.cooldown_frac,
                                                     warmup_steps=t.warmup_steps)
    lr = schedule(t.matrix_learning_rate)
    matrices = adam_group(AdamGroup(".*", lr, t.matrix_b1, t.matrix_b2, t.adam_eps,
                                    t.matrix_weight_decay, name="matrices"))
    groups = _aux_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), schedule)
    muon_or_adam = group_labels(groups, labels)
    # The matrices Muon would take are one more AdamW group, "matrices".
    names = lambda params: jax.tree.map(lambda g: "matrices" if g == "muon" else g,
                                        muon_or_adam(params))
    transforms = {"matrices": matrices} | {g.name: adam_group(g) for g in groups}
    return Stack(partition(transforms, names), lr, groups=names)


track3_adam = register(Recipe(
    "track3_adam", Track3AdamHyperparameters, _track3_adam, options=TRACK3_OPTIONS,
    summary="Track 3 result #2 (5625 steps): AdamW on the hidden matrices (lr 0.0015, betas "
    "(0.9, 0.95), wd 0.1) beside the aux AdamW groups, every group warmed up over 250 steps"))
