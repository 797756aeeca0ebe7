"""modded-nanogpt Track 3's Shampoo results: #21 (a 4150-step schedule, 3.28 crossed at 4100)
and #35 (3375 steps, with a pseudo-inverse root).

Both run Meta's ``DistributedShampoo`` (`optax_snoo.shampoo`) on the blocks' matrices and the
aux AdamW (embedding 0.3, head 1/320, every 1-D parameter 0.01, betas (0.8, 0.95), eps 1e-10,
no decay); every lr is flat for 30% of the run, then linear to 0.

- #21: lr 0.0015, betas (0.9, 0.95), epsilon 1e-12 (damped roots), decoupled wd 0.2, roots
  ``L^(-1/4)``, ``R^(-1/4)`` refreshed every 5 updates from update 5, Adam's direction
  (β₂ 0.95, eps 1e-10) alone for updates 1-4 and its norm after.
- #35: lr 0.01, betas (0.9, 0.9), epsilon 0 with the pseudo-inverse root (eigenvalues
  ``<= 0`` dropped), wd 0.1, refreshed every update, Adam graft β₂ 0.9, eps 1e-15.

#35's table row calls it "One-Sided Shampoo", but its logged script sets nothing that makes
it one-sided (no ``inverse_exponent_override``): with the package copy committed with #21,
its configuration preconditions both sides, ``L^(-1/4) M R^(-1/4)``, which is what this
recipe runs. The one-sidedness, if any, came from a package version not in the record.

The absolute epsilons (1e-12, 1e-10, 1e-15) are the logs' numbers, for the logs' loss summed
over the batch's tokens (the trainer's Track 3 settings: ``loss_reduction="sum"``).

References:
  Gupta, Koren, Singer, `Shampoo <https://arxiv.org/abs/1802.09568>`_, 2018; Anil et al.,
  `Scalable Second Order Optimization for Deep Learning <https://arxiv.org/abs/2002.09018>`_,
  2020; modded-nanogpt Track 3 results #21 (`results/20260513_shampoo_1_4_power
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_)
  and #35 (``results/sh-origpinv-s3375-lr1em2-wd010-b9em1-ge15-pf1-near1-record-130563a2-...``),
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_hyperball import (
    AuxAdamWHyperparameters,
    aux_adamw_stack,
    aux_schedule,
)
from optax_snoo._src.schedules import stable_cooldown_schedule
from optax_snoo._src.shampoo import shampoo

__all__ = ["ShampooHyperparameters", "ShampooPinvHyperparameters"]


@dataclasses.dataclass(frozen=True)
class ShampooHyperparameters(AuxAdamWHyperparameters):
    """Result #21's constants."""

    shampoo_learning_rate: float = hyperparameter(0.0015, "Shampoo's peak lr",
                                                  check="positive")
    shampoo_b1: float = hyperparameter(0.9, "the filtered gradient's decay (betas[0])",
                                       check="unit_interval")
    shampoo_b2: float = hyperparameter(0.95, "the Kronecker factors' decay (betas[1])",
                                       check="unit_interval")
    shampoo_epsilon: float = hyperparameter(1e-12, "added to each factor before its root "
                                            "(0 with the pseudo-inverse)",
                                            check="non_negative")
    shampoo_weight_decay: float = hyperparameter(0.2, "decoupled weight decay (times its lr)",
                                                 check="non_negative")
    precondition_frequency: int = hyperparameter(5, "updates between root refreshes (the "
                                                 "first at this update)", check="at_least_1")
    pseudo_inverse: bool = hyperparameter(False, "pseudo-inverse roots (drop eigenvalues "
                                          "<= 0) instead of damped ones")
    graft_b2: float = hyperparameter(0.95, "the Adam graft's second-moment decay",
                                     check="unit_interval")
    graft_eps: float = hyperparameter(1e-10, "the Adam graft's epsilon", check="non_negative")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")


@dataclasses.dataclass(frozen=True)
class ShampooPinvHyperparameters(ShampooHyperparameters):
    """Result #35's constants."""

    shampoo_learning_rate: float = hyperparameter(0.01, "Shampoo's peak lr", check="positive")
    shampoo_b2: float = hyperparameter(0.9, "the Kronecker factors' decay (betas[1])",
                                       check="unit_interval")
    shampoo_epsilon: float = hyperparameter(0.0, "added to each factor before its root "
                                            "(0 with the pseudo-inverse)",
                                            check="non_negative")
    shampoo_weight_decay: float = hyperparameter(0.1, "decoupled weight decay (times its lr)",
                                                 check="non_negative")
    precondition_frequency: int = hyperparameter(1, "updates between root refreshes (the "
                                                 "first at this update)", check="at_least_1")
    pseudo_inverse: bool = hyperparameter(True, "pseudo-inverse roots (drop eigenvalues "
                                          "<= 0) instead of damped ones")
    graft_b2: float = hyperparameter(0.9, "the Adam graft's second-moment decay",
                                     check="unit_interval")
    graft_eps: float = hyperparameter(1e-15, "the Adam graft's epsilon", check="non_negative")


def _shampoo(t: ShampooHyperparameters, total_steps: int, *, labels: Any = None,
             adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
             shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.shampoo_learning_rate, total_steps, t.cooldown_frac)
    matrices = shampoo(lr, t.shampoo_b1, t.shampoo_b2, weight_decay=t.shampoo_weight_decay,
                       epsilon=t.shampoo_epsilon, frequency=t.precondition_frequency,
                       pseudo_inverse=t.pseudo_inverse, graft_b2=t.graft_b2,
                       graft_eps=t.graft_eps, shard_matrices=shard_newton_schulz,
                       newton_schulz_plan=newton_schulz_plan)
    return aux_adamw_stack(matrices, lr, t, aux_schedule(total_steps, t.cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


track3_shampoo = register(Recipe(
    "track3_shampoo", ShampooHyperparameters, _shampoo, options=TRACK3_OPTIONS,
    record_steps=4150,
    summary="Track 3 result #21 (4150-step schedule, 3.28 crossed at 4100): Shampoo "
    "(L^-1/4 M R^-1/4 refreshed every 5 updates, grafted onto Adam's norm), lr 0.0015, "
    "wd 0.2, the aux AdamW"))

track3_shampoo_pinv = register(Recipe(
    "track3_shampoo_pinv", ShampooPinvHyperparameters, _shampoo, options=TRACK3_OPTIONS,
    record_steps=3375,
    summary="Track 3 result #35 (3375 steps): Shampoo with pseudo-inverse roots refreshed "
    "every update (epsilon 0), grafted onto Adam's norm (eps 1e-15), lr 0.01, wd 0.1, the "
    "aux AdamW"))
