"""modded-nanogpt Track 3 result #40 (#30's Aurora stack inside EMA-Nesterov) and the
results built on it (#41, #42, #43).

#40 (``results/20260522_ema_nesterov_aurora_proj``, 2890 steps of a 2900-step run whose
PowerCool ends at 2980) runs #30's optimizer (`optax_snoo.recipes.track3_aurora_proj`:
Aurora on ``mlp.proj``, SOAP on the MLP and ``attn.v``, the Gram-norm Contra-Muon ramp,
the radial brake, the u/w floor and the radius pin, AdamW on PowerCool) with two of its
schedule constants moved, its momentum cool-down ending at 2900 (``FINAL_TRAIN_STEPS``)
and PowerCool's ``t_end`` at 2980 (``FINAL_SCHEDULE_STEPS``), and wraps both optimizers in
EMA-Nesterov (`optax_snoo.ema_nesterov`, its class ``EMA_Nesterov``): every gradient is
taken at ``W + β_t b`` with ``b`` an EMA (γ 0.99) of the weights' displacement per step,
``β_t = 0.3 · lr_t/lr_0`` of the embedding's AdamW group (the lr set on the previous
step) while ``300 <= t < 2900 - 950``, and the inner step is taken from that point.
The weights to evaluate are ``params - β b`` (`optax_snoo.eval_params`; equal to the
params from update 1950 on). The network is #30's (``--init=cgi``).

Where ours differs from the log's arithmetic: #30's (see `track3_aurora_proj`), and the
lookahead buffer ``b`` is float32 where the log keeps it in the parameter's dtype (bfloat16
for the embedding).

#42 (``results/20260525_aurora_ema_ref``, 2860 steps of #40's schedule; its script is a
cleaned #40 with the same optimizer and constants) adds a fixed reference interpolation
(`optax_snoo.reference_interpolation`, last in EMA-Nesterov's inner chain so that it copies
and evaluates the weights without the lookahead, as the record's copy after
``EMA_Nesterov.step``): the weights after update 2375 are kept, and from update 2850 on
the weights to evaluate are ``w - 0.075 (w - w_2375)``, on every parameter. Its network
keeps #30's depth-scaled ``fc`` but drops the Rademacher gains and zeroes the biases:
the model's ``init="depth_fc"`` (``--init=depth_fc``).

#41 (``results/20260523_circuit_muon``, 2875 steps of #40's schedule, the same constants)
adds Circuit-Muon's OV coupling (`optax_snoo.scale_by_circuit_ov`, damping 1e-3) of each
block's ``attn.v`` and ``attn.proj`` directions per head, where its log places it: after
each leg's direction (momentum, SOAP, the polar, Contra-Muon) and before the radial
brake, the u/w floor, the lr and the radius pin, on the weights the step starts from (the
lookahead point). The log's heads are 128 wide (``HEAD_DIM``, the network's 6 heads of
768); the recipe takes the network's head count (``num_heads``, the trainer's
``--n_head``).

#43 (``results/20260529_tail_phase_readout_2850``, 2850 steps; its trainer run with its
``run.sh``, whose environment its logs print) is #41's script with its own constants and
four late transforms: PowerCool's ``t_end`` is 2950 before update 2600 and 3010 from it
(``_active_schedule_steps``; the same c), the momentum's cool-down ends at 2850 and
EMA-Nesterov's lookahead at 1900 (``2850 - 950``). After each update (its hooks after
``EMA_Nesterov.step``, here last in EMA-Nesterov's inner chain, in their order):
TrailDelta (`optax_snoo.delta_pulses`: a copy after 2650, pulses ``γ (w - copy + Δ_prev)``
after 2750 and 2850 with γ -0.04 then -0.12) on every parameter but the token embedding;
BroadDelta (one pulse ``-0.005 (w_2400 - w_2000)``) on the Muon matrices but
Circuit-Muon's V and O ("muon_other"). After the last update the weights to evaluate are
the normalized orthogonal phase readout (`optax_snoo.phase_readout`: copies after 2650
and 2750, κ 0.01) on "muon_other", then the final readout ``w + 0.08 (w_2400 - w)``
(`optax_snoo.reference_interpolation`) on all but the embedding. The pulses and readouts
differ from the log's arithmetic as their transforms say (float32 copies, moves added to
the update), and EMA-Nesterov's displacement takes a pulse in with its own update where
the log's takes it in with the next (the same weights: the lookahead has ended by 2000).
Its network is #41's (``--init=cgi``).

#40's, #41's and #42's step constants are written at 2980 steps (``RECORD_STEPS``,
PowerCool's ``t_end``) and scaled to the run: `Hyperparameters.scaled` gives
``round(x·N/2980)``, each PowerCool constant becomes ``c·(lr/lr_record)·(2980/N)^1.2``
(`optax_snoo.power_cool_scaled`). #43's are written at its 2850 updates (its run, whose
last update its readouts evaluate), its two PowerCool ends among them, with the same
``c·(lr/lr_record)·(2850/N)^1.2``; TrailDelta's grid (2650, 2750, 2850, where the phase
readout copies too) is kept whole (`TailPhaseReadoutHyperparameters.scaled_steps`).

References:
  OscarYau525, `modded-nanogpt Track 3 result #40, EMA-Nesterov + Aurora
  (results/20260522_ema_nesterov_aurora_proj)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  chenchenygu, `modded-nanogpt Track 3 result #42, fixed reference interpolation
  (results/20260525_aurora_ema_ref)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  liyang2019, `modded-nanogpt Track 3 result #41, Circuit-Muon
  (results/20260523_circuit_muon)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  Jesse Clark (jn2clark), `modded-nanogpt Track 3 result #43, tail phase readout
  (results/20260529_tail_phase_readout_2850)
  <https://github.com/KellerJordan/modded-nanogpt/pull/318>`_, 2026

  EMA-Nesterov: `arXiv:2605.25395 <https://arxiv.org/abs/2605.25395>`_, 2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.averaging import ema_nesterov, reference_interpolation
from optax_snoo._src.circuit import OVHeads, circuit_ov_heads, scale_by_circuit_ov
from optax_snoo._src.phase_readout import phase_readout
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_aurora_proj import (
    AuroraProjHyperparameters,
    _aurora_proj,
    _power_cool,
)
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import steps_in_order
from optax_snoo._src.trajectory import delta_pulses

__all__ = ["AuroraEmaRefHyperparameters", "CircuitMuonHyperparameters",
           "EmaNesterovAuroraHyperparameters", "TailPhaseReadoutHyperparameters"]


@dataclasses.dataclass(frozen=True)
class EmaNesterovAuroraHyperparameters(AuroraProjHyperparameters):
    """Result #40's constants (its log's, at PowerCool's 2980 steps): #30's, its momentum
    cool-down ending at 2900, and EMA-Nesterov's."""

    RECORD_STEPS = 2980

    train_steps: int = hyperparameter(2900, "where the momentum's cool-down ends (the "
                                      "log's FINAL_TRAIN_STEPS)", check="at_least_1",
                                      steps=True)
    lookahead: float = hyperparameter(0.3, "EMA-Nesterov's beta0 (0 = no lookahead)",
                                      check="non_negative")
    lookahead_ema: float = hyperparameter(0.99, "EMA-Nesterov's gamma",
                                          check="unit_interval")
    lookahead_start: int = hyperparameter(300, "EMA-Nesterov's first lookahead",
                                          check="at_least_0", steps=True)
    lookahead_stop: int = hyperparameter(1950, "EMA-Nesterov's last lookahead + 1 (the "
                                         "log's train_steps - 950)", check="at_least_0",
                                         steps=True)

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "lookahead_start", "lookahead_stop")


@dataclasses.dataclass(frozen=True)
class AuroraEmaRefHyperparameters(EmaNesterovAuroraHyperparameters):
    """Result #42's constants: #40's, and its fixed reference interpolation."""

    reference_capture: int = hyperparameter(2375, "the update after which the weights are "
                                            "kept as the reference", check="at_least_1",
                                            steps=True)
    reference_start: int = hyperparameter(2850, "the first update whose evaluated weights "
                                          "are interpolated", check="at_least_1",
                                          steps=True)
    reference_gamma: float = hyperparameter(-0.075, "the interpolation's gamma: evaluate "
                                            "w + gamma (w - reference)")

    def validate(self) -> None:
        super().validate()
        if self.reference_start < self.reference_capture:
            raise ValueError(f"reference_start={self.reference_start} must be >= "
                             f"reference_capture={self.reference_capture}")


@dataclasses.dataclass(frozen=True)
class CircuitMuonHyperparameters(EmaNesterovAuroraHyperparameters):
    """Result #41's constants: #40's, and Circuit-Muon's damping."""

    circuit_damping: float = hyperparameter(1e-3, "Circuit-Muon's floor on each head's "
                                            "||W_h||^2/hd (the log's CIRCUIT_OV_DAMPING)",
                                            check="non_negative")


@dataclasses.dataclass(frozen=True)
class TailPhaseReadoutHyperparameters(CircuitMuonHyperparameters):
    """Result #43's constants (its run's, at its 2850 updates): #41's, its run ending at
    2850 on a PowerCool whose end moves from 2950 to 3010 at update 2600, EMA-Nesterov's
    lookahead ending at 1900, and its tail's pulses and readouts."""

    RECORD_STEPS = 2850

    train_steps: int = hyperparameter(2850, "the run's last update: the momentum's "
                                      "cool-down ends and the readouts evaluate here (the "
                                      "log's FINAL_TRAIN_STEPS)", check="at_least_1",
                                      steps=True)
    lookahead_stop: int = hyperparameter(1900, "EMA-Nesterov's last lookahead + 1 (the "
                                         "log's train_steps - 950)", check="at_least_0",
                                         steps=True)
    schedule_steps: int = hyperparameter(2950, "PowerCool's t_end before tail_switch (the "
                                         "log's SCHEDULE_STEPS)", check="at_least_1",
                                         steps=True)
    tail_switch: int = hyperparameter(2600, "the first update on the tail's PowerCool (the "
                                      "log's TAIL_SCHEDULE_SWITCH_STEP)", check="at_least_1",
                                      steps=True)
    tail_schedule_steps: int = hyperparameter(3010, "PowerCool's t_end from tail_switch on "
                                              "(the log's TAIL_SCHEDULE_STEPS)",
                                              check="at_least_1", steps=True)
    trail_start: int = hyperparameter(2650, "TrailDelta copies the weights after this "
                                      "update", check="at_least_1", steps=True)
    trail_every: int = hyperparameter(100, "updates between TrailDelta's pulses",
                                      check="at_least_1", steps=True)
    trail_stop: int = hyperparameter(2850, "the last update TrailDelta may pulse after",
                                     check="at_least_1", steps=True)
    trail_gamma_first: float = hyperparameter(-0.04, "TrailDelta's first pulse: w + gamma "
                                              "(its move since the copy)")
    trail_gamma_final: float = hyperparameter(-0.12, "TrailDelta's later pulses' gamma")
    trail_momentum: float = hyperparameter(1.0, "the previous pulse's move added to the "
                                           "next (the log's TRAIL_DELTA_MOMENTUM_BETA)",
                                           check="non_negative")
    broad_capture: int = hyperparameter(2000, "BroadDelta copies the hidden matrices but "
                                        "attn.v/attn.proj after this update",
                                        check="at_least_1", steps=True)
    broad_apply: int = hyperparameter(2400, "BroadDelta's one pulse, after this update",
                                      check="at_least_1", steps=True)
    broad_gamma: float = hyperparameter(-0.005, "BroadDelta's gamma: w + gamma (w - copy)")
    phase_t0: int = hyperparameter(2650, "the phase readout's first copy, after this "
                                   "update", check="at_least_1", steps=True)
    phase_t1: int = hyperparameter(2750, "the phase readout's second copy, after this "
                                   "update", check="at_least_1", steps=True)
    phase_kappa: float = hyperparameter(0.01, "the phase readout's step along the "
                                        "orthogonal velocity change")
    phase_velocity_weight: float = hyperparameter(0.0, "the phase readout's step along "
                                                  "the velocity (the log's "
                                                  "PHASE_READOUT_GAMMA)")
    final_readout_anchor: int = hyperparameter(2400, "the final readout's anchor: the "
                                               "weights after this update",
                                               check="at_least_1", steps=True)
    final_readout_alpha: float = hyperparameter(0.08, "the final readout: evaluate "
                                                "w + alpha (anchor - w), all but the "
                                                "embedding")

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "trail_start", "trail_stop")
        steps_in_order(self, "broad_capture", "broad_apply")
        steps_in_order(self, "phase_t0", "phase_t1")
        for name in ("phase_t1", "final_readout_anchor", "trail_stop"):
            if getattr(self, name) > self.train_steps:
                raise ValueError(f"{name}={getattr(self, name)} must be <= train_steps="
                                 f"{self.train_steps}")

    def scaled_steps(self, total_steps: int) -> dict[str, Any]:
        """Each step rounded on its own, then the steps on TrailDelta's grid (``trail_stop
        - k·trail_every``: the record's copies at 2650 and pulse at 2750, where the phase
        readout also copies) put back on it from the scaled stop and interval (at least
        1): rounded apart, a quarter of run lengths would move the last pulse past its
        stop."""
        values = super().scaled_steps(total_steps)
        values["trail_every"] = max(values["trail_every"], 1)  # 0 would be no pulses
        for name in ("trail_start", "phase_t0", "phase_t1"):
            lead, off_grid = divmod(self.trail_stop - getattr(self, name), self.trail_every)
            if not off_grid and lead >= 0:
                values[name] = values["trail_stop"] - lead * values["trail_every"]
        return values


def _tail_power_cool(t: TailPhaseReadoutHyperparameters, group: str,
                     total_steps: int) -> optax.Schedule:
    """#43's PowerCool (its ``_lr`` with ``_active_schedule_steps``): ``t_end`` is
    ``schedule_steps`` before update ``tail_switch`` and ``tail_schedule_steps`` from it,
    the same c."""
    before = _power_cool(t, group, total_steps, t_end=t.schedule_steps)
    after = _power_cool(t, group, total_steps, t_end=t.tail_schedule_steps)
    # join_schedules counts the second piece from its boundary: read it at the update.
    return optax.join_schedules([before, lambda count: after(count + t.tail_switch)],
                                [t.tail_switch])


def _tail(t: TailPhaseReadoutHyperparameters, groups: Any,
          heads: Any) -> list[optax.GradientTransformation]:
    """#43's late transforms in its hooks' order, on its scopes: ``nonembed`` (all but the
    embedding group) and ``muon_other`` (the Muon matrices but Circuit-Muon's V and O)."""

    def nonembed(tree: Any) -> Any:
        return jax.tree.map(lambda label: label != "embed", groups(tree))

    def muon_other(tree: Any) -> Any:
        return jax.tree.map(lambda label, h: label == "muon" and not isinstance(h, OVHeads),
                            groups(tree), heads(tree))

    return [
        optax.masked(delta_pulses(t.trail_start, t.trail_every,
                                  (t.trail_gamma_first, t.trail_gamma_final),
                                  stop=t.trail_stop, momentum=t.trail_momentum), nonembed),
        optax.masked(delta_pulses(t.broad_capture, t.broad_apply - t.broad_capture,
                                  t.broad_gamma, stop=t.broad_apply), muon_other),
        optax.masked(phase_readout(t.phase_t0, t.phase_t1, t.train_steps, t.phase_kappa,
                                   velocity_weight=t.phase_velocity_weight), muon_other),
        reference_interpolation(t.final_readout_anchor, t.train_steps,
                                -t.final_readout_alpha, mask=nonembed)]


def _ema_nesterov_aurora(t: EmaNesterovAuroraHyperparameters, total_steps: int, *,
                         num_heads: int | None = None, **options: Any) -> Stack:
    schedule = _power_cool
    if isinstance(t, TailPhaseReadoutHyperparameters):  # #43: PowerCool's end moves
        schedule = options["schedule"] = _tail_power_cool
    if isinstance(t, CircuitMuonHyperparameters):  # #41: between directions and steps
        heads = circuit_ov_heads(num_heads)
        options["coupling"] = scale_by_circuit_ov(heads, t.circuit_damping)
    stack = _aurora_proj(t, total_steps, **options)
    inner = stack.tx
    if isinstance(t, AuroraEmaRefHyperparameters):  # #42: on the weights without lookahead
        inner = optax.chain(inner, reference_interpolation(
            t.reference_capture, t.reference_start, t.reference_gamma))
    if isinstance(t, TailPhaseReadoutHyperparameters):  # #43: after the step, as its hooks
        inner = optax.chain(inner, *_tail(t, stack.groups, heads))
    embed_lr = schedule(t, "embed", total_steps)
    # The log reads the embedding group's lr ratio as set on the previous update.
    ratio = lambda count: embed_lr(jnp.maximum(count - 1, 0)) / t.embed_learning_rate
    tx = ema_nesterov(inner, t.lookahead, t.lookahead_ema, prefill=t.lookahead_start,
                      stop=t.lookahead_stop, lr_ratio=ratio)
    return dataclasses.replace(stack, tx=tx, readout=True)


track3_ema_nesterov_aurora = register(Recipe(
    "track3_ema_nesterov_aurora", EmaNesterovAuroraHyperparameters, _ema_nesterov_aurora,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #40 (2890 of a 2980-step PowerCool): #30's stack (Aurora on "
    "mlp.proj, SOAP on MLP + attn.v, Contra-Muon ramp, radial brake, u/w floor, radius pin, "
    "AdamW; momentum cool-down ending at 2900) inside EMA-Nesterov (beta 0.3 lr/lr0, "
    "gamma 0.99, updates 300-1949; evaluate optax_snoo.eval_params)"))
track3_aurora_ema_ref = register(Recipe(
    "track3_aurora_ema_ref", AuroraEmaRefHyperparameters, _ema_nesterov_aurora,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #42 (2860 of #40's 2980-step PowerCool): #40's stack with a "
    "fixed reference interpolation (the weights after update 2375 kept; from 2850 evaluate "
    "w - 0.075 (w - w_2375); evaluate optax_snoo.eval_params)"))
track3_circuit_muon = register(Recipe(
    "track3_circuit_muon", CircuitMuonHyperparameters, _ema_nesterov_aurora,
    options={**TRACK3_OPTIONS, "num_heads": 6},
    summary="Track 3 result #41 (2875 of #40's 2980-step PowerCool): #40's stack with "
    "Circuit-Muon's OV coupling (per-head partner post-whitening and trace-only gauge, "
    "damping 1e-3) of attn.v and attn.proj between their directions and the radius steps"))
track3_tail_phase_readout = register(Recipe(
    "track3_tail_phase_readout", TailPhaseReadoutHyperparameters, _ema_nesterov_aurora,
    options={**TRACK3_OPTIONS, "num_heads": 6},
    summary="Track 3 result #43 (2850 steps; PowerCool to 2950, to 3010 from update 2600; "
    "the lookahead to 1900): #41's stack with TrailDelta (pulses -0.04, -0.12 at 2750, "
    "2850, momentum 1, all but the embedding), BroadDelta (-0.005 (w_2400 - w_2000) on the "
    "hidden matrices but V/O) and two readouts after the last update: the orthogonal phase "
    "readout (2650, 2750; kappa 0.01) then 0.08 toward the 2400 weights (evaluate "
    "optax_snoo.eval_params)"))
