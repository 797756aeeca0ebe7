"""modded-nanogpt Track 3's Muon variants on #5's aux AdamW: Muon² (#7), PMuon (#18),
SinkSOAP (#26), SpectralDescent (#22), DynMuon (#28).

Muon² (#7, 3325 steps): Muon (EMA-Nesterov momentum 0.95, Newton-Schulz ``(2, -1.5, 0.5)``
x 12 in bfloat16 after ``X/(‖X‖_F + 1e-7)``, shape scale ``sqrt(max(1, out/in))``) on the
momentum divided by the raw gradient's RMS (`optax_snoo.muon_squared_precondition`: β₂ 0.95,
eps 1e-10), ``p ← p (1 - lr·0.0125) - lr·O``, lr 0.10; the aux AdamW (embedding 0.3, head
1/320, 1-D 0.01, betas (0.8, 0.95), eps 1e-10, no decay); every lr flat for 30%, then linear
to 0.

PMuon (#18: a 3250-step schedule, 3.28 crossed at 3225): Muon as in #7 on
``P_L U P_R`` instead of the Nesterov momentum ``U`` (`optax_snoo.pmuon_precondition`: ``P``
the streaming powers ``^-0.3`` of the decayed sums (β 0.95) of ``U Uᵀ`` and ``Uᵀ U``, one
orthogonal iteration a step, damping and eps 1e-6), ``p ← p (1 - lr·0.025) - lr·O``,
lr 0.035; the same aux AdamW and schedule. Its epsilons are in the units of the record's
gradient, the summed loss over 524288 tokens (the trainer's Track 3 default).

SinkSOAP (#26: a 3125-step schedule, 3.28 crossed at 3090): Muon's EMA-Nesterov momentum 0.95
balanced in the eigenbasis of its gradient's Gram EMAs (β 0.95) by 10 Sinkhorn steps on its
squared entries (eps 1e-8) in place of Newton-Schulz, at a semi-orthogonal matrix's Frobenius
norm (`optax_snoo.gram_sinkhorn`), NorMuon (β₂ 0.95) on the non-square matrices only, the shape
scale, ``p ← p (1 - lr·0.025) - lr·O``, lr 0.04; the same aux AdamW and schedule (no
PowerCool). The eps is not scale-free: it is sized for the record's summed loss over 524288
tokens (a mean loss's gradients need ``sinkhorn_eps = 1e-8/524288²`` for the same balancing).

SpectralDescent (#22: an 8500-step schedule, its loss below 3.28 at step 8225): Muon with
momentum 0 (so the Newton-Schulz iteration runs on the raw gradient, ``O ≈ U Vᵀ`` of
``G = U S Vᵀ``), the same Newton-Schulz and shape scale, ``p ← p (1 - lr·0.015) - lr·O``,
lr 0.03; the same aux AdamW and schedule. The record's
table writes it also as Shampoo with betas (0, 0), frequency 1, power -1/4:
``(G Gᵀ)^{-1/4} G (Gᵀ G)^{-1/4} = U Vᵀ``.

DynMuon (#28: a 3200-step schedule, 3.28 crossed at 3175): the gradient divided by the
batch's 8·64·1024 tokens (the mean loss's), summed Nesterov momentum 0.95
(``m ← 0.95 m + g``, ``v = 0.95 m + g``), then the power map of `optax_snoo.scale_by_muon`'s
``spectral_map="power"``: Newton-Schulz on ``v/(‖v‖_F + 1e-7)``, times the second-order
series of its Gram to the power ``p/2`` and ``(‖v‖_F + 1e-7)^p``, the singular values near
``σᵢ^p``; ``p`` logistic from 0.25 to -0.25 around 4% of the run (`logistic_schedule`),
``p ← p (1 - lr·0.025) - lr·U``, lr 0.02; the same aux AdamW and schedule. Our EMA momentum
is ``(1-β)`` times the summed one, so the recipe's ``spectral_input_scale`` is
``gradient_scale/(1-β)``.

References:
  Liu et al., `Muon²: Boosting Muon via Adaptive Second-Moment Preconditioning
  <https://arxiv.org/abs/2604.09967>`_, 2026; modded-nanogpt Track 3 result #7
  (`results/20260501_muonsq
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026; modded-nanogpt Track 3 result #18 (`results/20260507_pmuon`, PR #285 by zzp1012),
  2026; modded-nanogpt Track 3 result #26, SinkSOAP, by L. Liu and Z. Xu
  (`results/20260514_sinksoap`, PR #298), 2026; modded-nanogpt Track 3 result #22
  (`results/20260517_ortho`), 2026; modded-nanogpt Track 3 result #28
  (`results/20260519_dynmuon`), 2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import group_labels, muon
from optax_snoo._src.muon_squared import muon_squared_precondition
from optax_snoo._src.pmuon import pmuon_precondition
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import TRACK3_ADAM_PATTERNS, patterns
from optax_snoo._src.recipes.track3_hyperball import (
    AuxAdamWHyperparameters,
    aux_adamw_groups,
    aux_adamw_stack,
    aux_schedule,
)
from optax_snoo._src.schedules import logistic_schedule, stable_cooldown_schedule
from optax_snoo._src.sinksoap import scale_by_sinksoap
from optax_snoo._src.weight_decay import add_decoupled_weight_decay

__all__ = ["DynMuonHyperparameters", "MuonSquaredHyperparameters", "PMuonHyperparameters",
           "SinkSOAPHyperparameters", "SpectralDescentHyperparameters"]


@dataclasses.dataclass(frozen=True)
class MuonSquaredHyperparameters(AuxAdamWHyperparameters):
    """Result #7's constants."""

    muon_learning_rate: float = hyperparameter(0.10, "Muon²'s peak lr", check="positive")
    muon_weight_decay: float = hyperparameter(0.0125, "Muon²'s decoupled weight decay (times "
                                              "its lr)", check="non_negative")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    muon_sq_beta2: float = hyperparameter(0.95, "the raw gradient's second-moment decay "
                                          "(before Newton-Schulz)", check="unit_interval")
    muon_sq_eps: float = hyperparameter(1e-10, "added to the second moment's square root",
                                        check="positive")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _muon_squared(t: MuonSquaredHyperparameters, total_steps: int, *, labels: Any = None,
                  adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
                  shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    groups = aux_adamw_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), total_steps,
                              t.cooldown_frac)
    tx = muon(lr, beta=t.muon_momentum, weight_decay=t.muon_weight_decay,
              coefficients="track3", ns_dtype=t.ns_dtype,
              precondition=muon_squared_precondition(t.muon_sq_beta2, t.muon_sq_eps),
              adam_groups=groups, labels=labels, newton_schulz_plan=newton_schulz_plan,
              shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, lr, groups=group_labels(groups, labels))


track3_muon_squared = register(Recipe(
    "track3_muon_squared", MuonSquaredHyperparameters, _muon_squared, options=TRACK3_OPTIONS,
    record_steps=3325,
    summary="Track 3 result #7 (3325 steps): Muon² (the momentum over the raw gradient's RMS "
    "before Newton-Schulz; lr 0.10, wd 0.0125), the aux AdamW"))


@dataclasses.dataclass(frozen=True)
class PMuonHyperparameters(AuxAdamWHyperparameters):
    """Result #18's constants."""

    muon_learning_rate: float = hyperparameter(0.035, "PMuon's peak lr", check="positive")
    muon_weight_decay: float = hyperparameter(0.025, "decoupled weight decay (times its lr)",
                                              check="non_negative")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    covariance_beta: float = hyperparameter(0.95, "decay of the sums of U Uᵀ and Uᵀ U",
                                            check="unit_interval")
    covariance_power: float = hyperparameter(0.3, "gamma: the covariances' power is -gamma",
                                             check="non_negative")
    covariance_damping: float = hyperparameter(1e-6, "added to the covariances' diagonal",
                                               check="positive")
    covariance_eps: float = hyperparameter(1e-6, "floor of the Rayleigh quotients, added to "
                                           "the norm of their powers", check="positive")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _pmuon(t: PMuonHyperparameters, total_steps: int, *, labels: Any = None,
           adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
           shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    groups = aux_adamw_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), total_steps,
                              t.cooldown_frac)
    precondition = pmuon_precondition(t.covariance_beta, t.covariance_power,
                                      damping=t.covariance_damping, eps=t.covariance_eps)
    tx = muon(lr, beta=t.muon_momentum, weight_decay=t.muon_weight_decay,
              coefficients="track3", ns_dtype=t.ns_dtype, precondition=precondition,
              adam_groups=groups, labels=labels, newton_schulz_plan=newton_schulz_plan,
              shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, lr, groups=group_labels(groups, labels))


track3_pmuon = register(Recipe(
    "track3_pmuon", PMuonHyperparameters, _pmuon, options=TRACK3_OPTIONS, record_steps=3250,
    summary="Track 3 result #18 (3250-step schedule, 3.28 at 3225): PMuon, the momentum "
    "between streaming covariance powers L^-0.3 U R^-0.3 before Newton-Schulz (lr 0.035, "
    "wd 0.025), the aux AdamW"))


@dataclasses.dataclass(frozen=True)
class SinkSOAPHyperparameters(AuxAdamWHyperparameters):
    """Result #26's constants."""

    muon_learning_rate: float = hyperparameter(0.04, "SinkSOAP's peak lr", check="positive")
    muon_weight_decay: float = hyperparameter(0.025, "decoupled weight decay (times its lr)",
                                              check="non_negative")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    gram_beta: float = hyperparameter(0.95, "decay of the gradient's Gram EMAs",
                                      check="unit_interval")
    normuon_beta: float = hyperparameter(0.95, "NorMuon's second-moment decay (non-square "
                                         "matrices)", check="unit_interval")
    sinkhorn_steps: int = hyperparameter(10, "Sinkhorn iterations in the Gram eigenbasis",
                                         check="at_least_1")
    sinkhorn_eps: float = hyperparameter(1e-8, "the balancing's eps (Grams' diagonal, "
                                         "squared entries, denominators, norm floor), sized "
                                         "for the summed loss's gradients (mean loss: "
                                         "1e-8/524288**2)", check="positive")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")


def _sinksoap(t: SinkSOAPHyperparameters, total_steps: int, *, labels: Any = None,
              adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
              shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    muon_tx = optax.chain(
        scale_by_sinksoap(t.muon_momentum, gram_beta=t.gram_beta, normuon_beta=t.normuon_beta,
                          sinkhorn_steps=t.sinkhorn_steps, eps=t.sinkhorn_eps,
                          newton_schulz_plan=newton_schulz_plan,
                          shard_newton_schulz=shard_newton_schulz),
        add_decoupled_weight_decay(t.muon_weight_decay),
        optax.scale_by_learning_rate(lr))
    return aux_adamw_stack(muon_tx, lr, t, aux_schedule(total_steps, t.cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


track3_sinksoap = register(Recipe(
    "track3_sinksoap", SinkSOAPHyperparameters, _sinksoap, options=TRACK3_OPTIONS,
    record_steps=3125,
    summary="Track 3 result #26 (3125-step schedule, 3.28 at 3090): SinkSOAP, the momentum "
    "Sinkhorn-balanced in its gradient's Gram eigenbasis instead of Newton-Schulz, NorMuon on "
    "non-square matrices (lr 0.04, wd 0.025), the aux AdamW"))


@dataclasses.dataclass(frozen=True)
class SpectralDescentHyperparameters(AuxAdamWHyperparameters):
    """Result #22's constants (Muon's momentum is 0: no momentum hyperparameter)."""

    muon_learning_rate: float = hyperparameter(0.03, "the spectral step's peak lr",
                                               check="positive")
    muon_weight_decay: float = hyperparameter(0.015, "decoupled weight decay (times its lr)",
                                              check="non_negative")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _spectral_descent(t: SpectralDescentHyperparameters, total_steps: int, *,
                      labels: Any = None, adam_patterns: dict[str, str] | None = None,
                      newton_schulz_plan: Any = None, shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    groups = aux_adamw_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), total_steps,
                              t.cooldown_frac)
    tx = muon(lr, beta=0.0, weight_decay=t.muon_weight_decay, coefficients="track3",
              ns_dtype=t.ns_dtype, adam_groups=groups, labels=labels,
              newton_schulz_plan=newton_schulz_plan, shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, lr, groups=group_labels(groups, labels))


track3_spectral_descent = register(Recipe(
    "track3_spectral_descent", SpectralDescentHyperparameters, _spectral_descent,
    options=TRACK3_OPTIONS, record_steps=8500,
    summary="Track 3 result #22 (8500-step schedule, 3.28 crossed at 8225): SpectralDescent, "
    "Muon with momentum 0 (lr 0.03, wd 0.015), the aux AdamW"))


@dataclasses.dataclass(frozen=True)
class DynMuonHyperparameters(AuxAdamWHyperparameters):
    """Result #28's constants."""

    muon_learning_rate: float = hyperparameter(0.02, "DynMuon's peak lr", check="positive")
    muon_weight_decay: float = hyperparameter(0.025, "decoupled weight decay (times its lr)",
                                              check="non_negative")
    muon_momentum: float = hyperparameter(0.95, "the summed Nesterov momentum's decay",
                                          check="unit_interval")
    power_start: float = hyperparameter(0.25, "the spectral power p before the switch (p_max)")
    power_end: float = hyperparameter(-0.25, "the spectral power p after it (p_min)")
    power_midpoint_frac: float = hyperparameter(
        0.04, "where p is half-way, as a fraction of the run (tau_ratio)", check="fraction")
    power_width_frac: float = hyperparameter(
        0.04, "the logistic's width as a fraction of the run (width_ratio)", check="positive")
    gradient_scale: float = hyperparameter(
        1 / (8 * 64 * 1024), "factor on the gradient before the momentum (the record's "
        "1/(8*64*1024): its summed loss's gradient as the mean token's)", check="positive")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _dynmuon(t: DynMuonHyperparameters, total_steps: int, *, labels: Any = None,
             adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
             shard_newton_schulz: bool = True) -> Stack:
    lr = stable_cooldown_schedule(t.muon_learning_rate, total_steps, t.cooldown_frac)
    power = logistic_schedule(t.power_start, t.power_end, total_steps,
                              midpoint_frac=t.power_midpoint_frac,
                              width_frac=t.power_width_frac)
    # the EMA momentum is (1-β) times the record's summed one: the map sees the summed one
    input_scale = t.gradient_scale / (1 - t.muon_momentum)
    muon_tx = optax.chain(
        scale_by_muon(t.muon_momentum, coefficients="track3", ns_dtype=t.ns_dtype,
                      spectral_map="power", spectral_strength=power,
                      spectral_input_scale=input_scale, newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz),
        add_decoupled_weight_decay(t.muon_weight_decay),
        optax.scale_by_learning_rate(lr))
    return aux_adamw_stack(muon_tx, lr, t, aux_schedule(total_steps, t.cooldown_frac),
                           labels=labels, adam_patterns=adam_patterns)


track3_dynmuon = register(Recipe(
    "track3_dynmuon", DynMuonHyperparameters, _dynmuon, options=TRACK3_OPTIONS,
    record_steps=3200,
    summary="Track 3 result #28 (3200-step schedule, 3.28 at 3175): DynMuon, singular values "
    "near sigma^p with p logistic from 0.25 to -0.25 (lr 0.02, wd 0.025), the aux AdamW"))
