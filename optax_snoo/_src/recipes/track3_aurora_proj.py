"""modded-nanogpt Track 3 results #30 (Aurora on the MLP's output projection, on the
radial-brake stack of PR #294), #34 (#30 with capped RRE extrapolation) and #38 (#30 retuned
late, with Tempered Polar and the tail-velocity and reference-interpolation readouts).

#30 (``results/20260514_aurora_proj_pruned_extended_contra``, 2930 steps of a 3020-step
run whose PowerCool ends at 3050) runs, per hidden matrix, in PyTorch's ``(out, in)``:

- EMA-Nesterov momentum ``μ`` (0.85 -> 0.95 over 300 updates, back to 0.85 over the last
  100 of the 3020, `optax_snoo.muon_momentum_schedule`);
- SOAP whitening of the momentum (`optax_snoo.soap_whitening`: Grams' decay 0.9, basis
  refresh every 10 updates) on ``mlp.fc``, ``mlp.proj`` and ``attn.v`` (``attn.v`` with
  a 0.95 blend and the denominator floored at 0.55 of its RMS); ``q``, ``k`` and
  ``attn.proj`` plain;
- the polar: Aurora's row-balanced ``polar(D v)`` (3 rounds, damping 0.25) on the wide
  ``mlp.proj`` (768 x 3072; the record's rule is "out < in", which on this network is
  ``mlp.proj`` alone), Newton-Schulz ``(2, -1.5, 0.5)`` x 12 after the Gram-Frobenius
  normalisation elsewhere;
- Contra-Muon with Gram-Frobenius norms, ``O - (c/2) v/g(v)`` rescaled to ``g(O)``, its
  ``c`` ramped from 0.4 to 0 over updates 0 to 2500 (`scale_by_muon`'s Soft-Muon map with
  its blend 0: ``spectral_map="soft", spectral_strength=0, soft_contra=c``); the shape
  scale ``sqrt(max(1, out/in))``;
- the radial brake (outward radial part halved), the u/w floor 0.3825 per matrix and the
  radius pin (`optax_snoo.radius_steps`), no weight decay, Muon's lr 0.0375 on PowerCool;
- PyTorch's AdamW (bias-corrected, betas (0.8, 0.99), eps 1e-10, no decay) on the
  embedding (0.3), the head (1/320) and every 1-D parameter (0.01), each on its PowerCool.

Its network differs from Track 3's in its initialisation only (PyTorch's default init,
``fc`` of block ``l`` times ``1 - 0.3 l/11``, the two norms' gains ``1 ∓ 0.14 s`` with one
Rademacher ``s`` per channel and block): the model's ``init="cgi"`` (``--init=cgi``), not
part of the optimizer.

The log's soft-Muon (``SOFT_MUON_CEIL = 0``) and NorMuon-lite (``NOR_BETA2 = 1``: its
second moment stays 0, a uniform factor the next line divides out) are off; ours leaves
them out. Where ours differs from the log's arithmetic: the V path's second rescale to
the momentum's Gram norm (``norm_preserving_blend`` with gate 1, the identity up to
rounding) is not repeated, and Aurora's ``D`` comes from the float32 momentum (the log
rounds it to bfloat16 first; see `optax_snoo.scale_by_muon`'s ``aurora_iterations``).

#34 (``results/20260520_rre_extrapolation_pr300_2925``, 2925 steps of #30's schedule)
adds, after each Muon step, `optax_snoo.rre_extrapolation` on the hidden matrices (all of
them one vector): from update 2820 to 2925 it keeps the post-step weights and every 5th
update moves them by the damped (0.875) RRE step of the last 4, capped at 1e-3 of their
norm, the momentum kept; the Adam parameters are not moved.

#38 (``results/20260520_tail_refinterp_2900``, claim at 2900: its script trains 2900 steps
of a PowerCool ending at 3020, with #30's code and constants otherwise) sets Contra-Muon's
ramp end to 2750, the momentum's cool-down to end at 2900, and adds, late in the run:
Tempered Polar (`scale_by_muon`'s ``tempered_polar``, ``ρ`` 0 -> 0.05 over updates 2600 to
2800, clip 0.25, on every hidden matrix, Aurora's included, before the Contra term); the
brake 0.5 -> 0.4 over 2400 to 2900 and the u/w floor 0.3825 -> 0.4 over 2400 to 2800
(`radius_steps`' ``brake`` and ``floor`` as schedules); and two readouts
(`optax_snoo.eval_params`): `optax_snoo.tail_velocity` (from update 2500, EMA 0.9, step -6
along it, clipped at 0.01 of the norm) on the hidden matrices, then
`optax_snoo.reference_interpolation` of every parameter (``w + (-0.075)(w - w_2375)``
from update 2900), in that order as its evaluation applies them. Its step constants are
written at 3020 (its ``RECORD_STEPS``). Where ours differs from its arithmetic: the
Contra term is rescaled to the tempered polar's ``‖·‖₄`` (the record: the untempered
polar's, the same number but for the tempered polar's rounding to ``ns_dtype``), and the
tail velocity's displacement is read from the update (the record keeps a copy of the
previous weights).

Every step constant is written at 3050 steps (``RECORD_STEPS``, PowerCool's ``t_end``)
and scaled to the run: `Hyperparameters.scaled` gives ``round(x·N/3050)``, each PowerCool
constant becomes ``c·(lr/lr_record)·(3050/N)^1.2`` (`optax_snoo.power_cool_scaled`).

References:
  Jordan et al., `modded-nanogpt Track 3 result #30
  (results/20260514_aurora_proj_pruned_extended_contra)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  J. Clark, `modded-nanogpt Track 3 result #38, tail reference interpolation at 2900
  (results/20260520_tail_refinterp_2900)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  tomoqt, `modded-nanogpt Track 3 result #34, capped RRE extrapolation
  (results/20260520_rre_extrapolation_pr300_2925)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  Tilde Research, `Aurora <https://github.com/tilde-research/aurora-release>`_, 2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from optax_snoo._src.averaging import reference_interpolation, tail_velocity
from optax_snoo._src.labels import by_path, partition
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import group_labels, with_adam_groups
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.recipes.base import Hyperparameters, Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import (
    TRACK3_ADAM_PATTERNS,
    adam_groups,
    patterns,
    steps_in_order,
)
from optax_snoo._src.schedules import muon_momentum_schedule, power_cool_scaled, wide_count
from optax_snoo._src.soap_muon import soap_whitening
from optax_snoo._src.trajectory import rre_extrapolation

__all__ = ["TRACK3_AURORA_PROJ_PATTERNS", "AuroraProjHyperparameters", "RreHyperparameters",
           "TailRefinterpHyperparameters"]

#: #30's Muon matrices by how their direction is computed, first match wins (this
#: repository's GPT names): Aurora + SOAP, SOAP, SOAP with the blend and floor; the rest
#: (``q``, ``k``, ``attn.proj``) plain.
TRACK3_AURORA_PROJ_PATTERNS: dict[str, str] = {
    "mlp_proj": r"(^|/)mlp/c_proj/kernel$",
    "mlp_fc": r"(^|/)mlp/c_fc/kernel$",
    "attn_v": r"(^|/)attn/c_v/kernel$",
}


@dataclasses.dataclass(frozen=True)
class AuroraProjHyperparameters(Hyperparameters):
    """Result #30's constants (its log's, at PowerCool's 3050 steps)."""

    RECORD_STEPS = 3050

    muon_learning_rate: float = hyperparameter(0.0375, "Muon's flat lr (PowerCool)",
                                               check="positive")
    embed_learning_rate: float = hyperparameter(0.3, "AdamW's flat lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(1 / 320, "AdamW's flat lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.01, "AdamW's flat lr on every 1-D "
                                                 "parameter", check="positive")
    power_cool_power: float = hyperparameter(1.2, "PowerCool's exponent", check="positive")
    muon_power_cool_c: float = hyperparameter(3.3169534699576625e-06, "Muon's PowerCool c "
                                              "(record lr, 3050 steps)", check="positive")
    embed_power_cool_c: float = hyperparameter(4.976805410800738e-05, "the embedding's "
                                               "PowerCool c (record lr, 3050 steps)",
                                               check="positive")
    head_power_cool_c: float = hyperparameter(5.184172302917436e-07, "the head's PowerCool c "
                                              "(record lr, 3050 steps)", check="positive")
    vector_power_cool_c: float = hyperparameter(1.6589351369335795e-06, "the 1-D group's "
                                                "PowerCool c (record lr, 3050 steps)",
                                                check="positive")
    adam_b1: float = hyperparameter(0.8, "AdamW's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.99, "AdamW's second-moment decay",
                                    check="unit_interval")
    adam_eps: float = hyperparameter(1e-10, "AdamW's epsilon", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum between its warm-up and "
                                          "cool-down", check="unit_interval")
    muon_momentum_start: float = hyperparameter(0.85, "Muon's momentum at the first update "
                                                "and at the cool-down's end",
                                                check="unit_interval")
    muon_momentum_warmup_steps: int = hyperparameter(300, "the momentum's warm-up",
                                                     check="at_least_0", steps=True)
    muon_momentum_cooldown_steps: int = hyperparameter(100, "the momentum's cool-down, "
                                                       "ending at train_steps",
                                                       check="at_least_0", steps=True)
    train_steps: int = hyperparameter(3020, "where the momentum's cool-down ends (the "
                                      "log's FINAL_TRAIN_STEPS)", check="at_least_1",
                                      steps=True)
    contra_muon: float = hyperparameter(0.4, "Contra-Muon's c at update 0 (the log's "
                                        "CONTRA_MUON_COEFF = -c/2)", check="non_negative")
    contra_ramp_end: int = hyperparameter(2500, "Contra-Muon's c reaches 0 here",
                                          check="at_least_1", steps=True)
    aurora_iterations: int = hyperparameter(3, "Aurora's rounds of polar(D v) on mlp.proj",
                                            check="at_least_1")
    aurora_beta: float = hyperparameter(0.25, "Aurora's damping exponent of D's update",
                                        check="positive_fraction")
    soap_beta: float = hyperparameter(0.9, "SOAP's Gram and V decay", check="unit_interval")
    soap_precondition_frequency: int = hyperparameter(10, "SOAP's basis refresh period "
                                                      "(updates)", check="at_least_1")
    v_soap_blend: float = hyperparameter(0.95, "the whitened share of attn.v's direction",
                                         check="fraction")
    v_soap_denom_floor: float = hyperparameter(0.55, "attn.v's SOAP denominator floor (times "
                                               "its RMS)", check="non_negative")
    brake: float | None = hyperparameter(0.5, "the radial brake on outward steps (None = "
                                         "off)", check="fraction")
    floor: float | None = hyperparameter(0.3825, "the u/w floor: each matrix's step is at "
                                         "least this times its norm (None = off)",
                                         check="non_negative")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))

    def validate(self) -> None:
        steps_in_order(self, "muon_momentum_warmup_steps")
        if self.muon_momentum_warmup_steps + self.muon_momentum_cooldown_steps > (
                self.train_steps):
            raise ValueError(f"muon_momentum_warmup_steps={self.muon_momentum_warmup_steps} "
                             f"+ muon_momentum_cooldown_steps="
                             f"{self.muon_momentum_cooldown_steps} must be <= train_steps="
                             f"{self.train_steps}")


@dataclasses.dataclass(frozen=True)
class RreHyperparameters(AuroraProjHyperparameters):
    """Result #34's constants: #30's, and its RRE extrapolation of the hidden matrices."""

    rre_start: int = hyperparameter(2820, "the first update whose weights RRE keeps",
                                    check="at_least_1", steps=True)
    rre_stop: int = hyperparameter(2925, "the last update that keeps weights and may move "
                                   "them", check="at_least_1", steps=True)
    rre_every: int = hyperparameter(5, "RRE moves at multiples of this update count (not "
                                    "scaled: a period of the trajectory)", check="at_least_1")
    rre_history: int = hyperparameter(4, "how many kept weights a move uses",
                                      check="at_least_1")
    rre_damping: float = hyperparameter(0.875, "the fraction of the RRE step taken",
                                        check="positive")
    rre_max_relative: float = hyperparameter(1e-3, "the cap on a move's norm relative to "
                                             "the weights' (0 = none)", check="non_negative")
    rre_regularization: float = hyperparameter(1e-6, "the ridge on RRE's Gram, relative to "
                                               "its mean diagonal", check="non_negative")

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "rre_start", "rre_stop")
        if self.rre_history < 3:
            raise ValueError(f"rre_history={self.rre_history} must be >= 3")


@dataclasses.dataclass(frozen=True)
class TailRefinterpHyperparameters(AuroraProjHyperparameters):
    """Result #38's constants (its script's, at PowerCool's 3020 steps): #30's, with the
    run and Contra-Muon's ramp ending elsewhere, and its late controls and readouts."""

    RECORD_STEPS = 3020

    train_steps: int = hyperparameter(2900, "where the momentum's cool-down ends (the "
                                      "script's TRAIN_STEPS)", check="at_least_1",
                                      steps=True)
    contra_ramp_end: int = hyperparameter(2750, "Contra-Muon's c reaches 0 here",
                                          check="at_least_1", steps=True)
    tempered_polar: float = hyperparameter(0.05, "Tempered Polar's rho after its ramp",
                                           check="non_negative")
    tempered_polar_max: float = hyperparameter(0.25, "Tempered Polar's clip of the "
                                               "residual relative to the polar",
                                               check="positive")
    tempered_polar_start: int = hyperparameter(2600, "Tempered Polar's rho rises from 0 here",
                                               check="at_least_1", steps=True)
    tempered_polar_end: int = hyperparameter(2800, "Tempered Polar's rho is full from here",
                                             check="at_least_1", steps=True)
    brake_late: float = hyperparameter(0.4, "the radial brake after its ramp",
                                       check="fraction")
    brake_ramp_start: int = hyperparameter(2400, "the brake's linear ramp starts",
                                           check="at_least_1", steps=True)
    brake_ramp_end: int = hyperparameter(2900, "the brake's linear ramp ends",
                                         check="at_least_1", steps=True)
    floor_late: float = hyperparameter(0.4, "the u/w floor after its ramp",
                                       check="non_negative")
    floor_ramp_start: int = hyperparameter(2400, "the floor's linear ramp starts",
                                           check="at_least_1", steps=True)
    floor_ramp_end: int = hyperparameter(2800, "the floor's linear ramp ends",
                                         check="at_least_1", steps=True)
    velocity_start: int = hyperparameter(2500, "the tail velocity is 0 after this update "
                                         "and moves from the next", check="at_least_1",
                                         steps=True)
    velocity_beta: float = hyperparameter(0.9, "the tail velocity's EMA factor",
                                          check="unit_interval")
    velocity_gamma: float = hyperparameter(-6.0, "the evaluation's step along the tail "
                                           "velocity (negative: back)")
    velocity_max_ratio: float = hyperparameter(0.01, "the velocity clipped to this times "
                                               "the weights' norm", check="positive")
    reference_capture: int = hyperparameter(2375, "the weights after this update are the "
                                            "reference", check="at_least_1", steps=True)
    reference_start: int = hyperparameter(2900, "evaluation interpolates from this update "
                                          "on", check="at_least_1", steps=True)
    reference_gamma: float = hyperparameter(-0.075, "the interpolation's w + gamma (w - ref)")

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "tempered_polar_start", "tempered_polar_end")
        steps_in_order(self, "brake_ramp_start", "brake_ramp_end")
        steps_in_order(self, "floor_ramp_start", "floor_ramp_end")
        steps_in_order(self, "reference_capture", "reference_start")
        if self.brake is None or self.floor is None:
            raise ValueError(f"brake={self.brake!r}, floor={self.floor!r}: #38 ramps both "
                             "(numbers expected)")


def _late_ramp(early: float, late: float, start: int, end: int) -> optax.Schedule:
    """#38's late ramps: ``early`` before ``start``, ``late`` from ``end``, linear between."""
    return wide_count(optax.linear_schedule(early, late, end - start, start))


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AuroraProjHyperparameters)}


def _power_cool(t: AuroraProjHyperparameters, group: str, total_steps: int, *,
                t_end: int | None = None) -> optax.Schedule:
    """``group``'s PowerCool: the record's c at the record's lr, rescaled to this lr and run;
    reaching 0 at the run's end, or at ``t_end`` (a horizon past it, scaled: #43's)."""
    return power_cool_scaled(
        getattr(t, f"{group}_learning_rate"), c=getattr(t, f"{group}_power_cool_c"),
        lr0_record=_DEFAULTS[f"{group}_learning_rate"], record_steps=t.RECORD_STEPS,
        total_steps=total_steps, power=t.power_cool_power, t_end=t_end)


def _muon_direction(t: AuroraProjHyperparameters, *, newton_schulz_plan: Any = None,
                    shard_newton_schulz: bool = True) -> optax.GradientTransformation:
    """#30's Muon direction: one `scale_by_muon` per kind of matrix
    (`TRACK3_AURORA_PROJ_PATTERNS`), sharing the momentum and Contra-Muon schedules."""
    momentum = muon_momentum_schedule(
        t.muon_momentum_start, t.muon_momentum, warmup=t.muon_momentum_warmup_steps,
        cooldown=t.muon_momentum_cooldown_steps, total=t.train_steps)
    contra = wide_count(optax.linear_schedule(t.contra_muon, 0.0, t.contra_ramp_end))
    soap = dict(precondition_frequency=t.soap_precondition_frequency)
    tempered = {}
    if isinstance(t, TailRefinterpHyperparameters):  # #38: before the Contra term
        tempered = dict(tempered_polar=_late_ramp(0.0, t.tempered_polar, t.tempered_polar_start,
                                                  t.tempered_polar_end),
                        tempered_polar_max=t.tempered_polar_max)

    def direction(**kind: Any) -> optax.GradientTransformation:
        return scale_by_muon(momentum, coefficients="track3", ns_dtype=t.ns_dtype,
                             ns_normalization="gram_frobenius", spectral_map="soft",
                             spectral_strength=0.0, soft_contra=contra,
                             newton_schulz_plan=newton_schulz_plan,
                             shard_newton_schulz=shard_newton_schulz, **tempered, **kind)

    kinds = {
        "mlp_proj": direction(precondition=soap_whitening(t.soap_beta, **soap),
                              aurora_iterations=t.aurora_iterations,
                              aurora_beta=t.aurora_beta),
        "mlp_fc": direction(precondition=soap_whitening(t.soap_beta, **soap)),
        "attn_v": direction(precondition=soap_whitening(
            t.soap_beta, blend=t.v_soap_blend, denom_floor=t.v_soap_denom_floor, **soap)),
        "plain": direction()}
    labels = by_path([(pattern, kind) for kind, pattern in TRACK3_AURORA_PROJ_PATTERNS.items()],
                     default="plain", what="#30 matrix kind")
    return partition(kinds, labels)


def _aurora_proj(t: AuroraProjHyperparameters, total_steps: int, *, labels: Any = None,
                 adam_patterns: dict[str, str] | None = None, newton_schulz_plan: Any = None,
                 shard_newton_schulz: bool = True,
                 coupling: optax.GradientTransformation | None = None,
                 schedule: Any = _power_cool) -> Stack:
    """#30's stack; ``coupling`` (#41's Circuit-Muon) goes between the Muon directions and
    the radius steps; ``schedule(t, group, total_steps)`` gives each group's learning rate
    (#43 switches PowerCool's end)."""
    names = patterns(TRACK3_ADAM_PATTERNS, adam_patterns)
    muon_lr = schedule(t, "muon", total_steps)
    brake, floor = t.brake, t.floor
    late = isinstance(t, TailRefinterpHyperparameters)
    if late:  # #38's late ramps
        brake = _late_ramp(t.brake, t.brake_late, t.brake_ramp_start, t.brake_ramp_end)
        floor = _late_ramp(t.floor, t.floor_late, t.floor_ramp_start, t.floor_ramp_end)
    # #30 has no weight decay: "u/w target replaces wd's role" (its Muon.step).
    direction = _muon_direction(t, newton_schulz_plan=newton_schulz_plan,
                                shard_newton_schulz=shard_newton_schulz)
    muon_tx = optax.chain(
        *([direction] if coupling is None else [direction, coupling]),
        radius_steps(muon_lr, brake=brake, floor=floor, floor_per="matrix",
                     pin="first_order", cautious_weight_decay=0.0))
    if late:  # #38's first readout: on the hidden matrices' weights after each full step
        muon_tx = optax.chain(muon_tx, tail_velocity(
            t.velocity_start, t.velocity_beta, t.velocity_gamma, t.velocity_max_ratio))
    if isinstance(t, RreHyperparameters):  # #34: after the Muon step, on its weights alone
        muon_tx = optax.chain(muon_tx, rre_extrapolation(
            t.rre_start, t.rre_stop, every=t.rre_every, history=t.rre_history,
            damping=t.rre_damping, max_relative=t.rre_max_relative,
            regularization=t.rre_regularization))
    groups = adam_groups(names, [
        (name, schedule(t, name if name != "vectors" else "vector", total_steps),
         t.adam_b1, t.adam_b2, t.adam_eps, 0.0, True)
        for name in ("vectors", "embed", "head")])
    tx = with_adam_groups(muon_tx, groups, labels=labels)
    if late:  # #38's second readout, of every parameter, applied after the velocity's
        tx = optax.chain(tx, reference_interpolation(t.reference_capture, t.reference_start,
                                                     t.reference_gamma))
    return Stack(tx, muon_lr, groups=group_labels(groups, labels), readout=late)


track3_aurora_proj = register(Recipe(
    "track3_aurora_proj", AuroraProjHyperparameters, _aurora_proj, options=TRACK3_OPTIONS,
    summary="Track 3 result #30 (2930 of a 3050-step PowerCool): Aurora (3 rounds, 0.25) on "
    "mlp.proj, SOAP on MLP + attn.v, Contra-Muon (Gram norms) ramped out by 2500, the "
    "radial brake, u/w floor 0.3825 and radius pin, momentum warm-up/cool-down, AdamW on "
    "PowerCool"))
track3_rre = register(Recipe(
    "track3_rre", RreHyperparameters, _aurora_proj, options=TRACK3_OPTIONS,
    summary="Track 3 result #34 (2925 of #30's 3050-step PowerCool): #30's stack with capped "
    "RRE extrapolation of the hidden matrices (updates 2820-2925, every 5, 4 kept weights, "
    "damping 0.875, at most 1e-3 of their norm, momentum kept)"))
track3_tail_refinterp = register(Recipe(
    "track3_tail_refinterp", TailRefinterpHyperparameters, _aurora_proj,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #38 (2900 of a 3020-step PowerCool): #30's stack with Contra-Muon "
    "to 2750, Tempered Polar (rho 0 -> 0.05 over 2600-2800), the brake 0.5 -> 0.4 and the "
    "u/w floor 0.3825 -> 0.4 ramped from 2400; evaluated through the tail velocity (from "
    "2500, -6 steps, clip 0.01) then the interpolation 0.075 back toward the 2375 weights "
    "(evaluate optax_snoo.eval_params)"))
