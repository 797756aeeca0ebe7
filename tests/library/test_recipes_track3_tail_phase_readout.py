"""`recipes.track3_tail_phase_readout` (Track 3 result #43) against a float64 numpy
transcription of its log's optimizer, hooks and final validation: #41's loop
(`test_recipes_track3_circuit_muon.RecordCircuit`: #30's `Muon.step` and AdamW with
Circuit-Muon's coupled V/O pass, inside ``EMA_Nesterov``; #43's script is #41's with the
changes ``diff`` shows) at #43's constants: its ``_lr`` whose ``t_end`` is
``_active_schedule_steps(step)`` (2950, then 3010 from step 2600, script:2177-2184), the
momentum's cool-down ending at its 2850 (script:2206), the lookahead ending at 1900
(script:1240); then its hooks after ``EMA_Nesterov.step`` (script:2309-2314:
TrailDelta, BroadDelta, the phase readout's copies: `test_tail_phase_readout.Hooks`) and
its final validation (the phase readout, then the final readout toward the step-2400
weights, script:2250-2275). One update at a time over the record's 2850 updates scaled
by 1/50 (57): the lookahead from 6 to 38, BroadDelta's copy after 40 and pulse after 48
(also the final readout's anchor), the PowerCool switch at 52 (t_end 59 -> 60), TrailDelta's
copy after 53 and pulses after 55 and 57, the phase readout's copies after 53 and 55, the
momentum's cool-down from 55. The training weights (the params: the lookahead point) after
every update and the weights `optax_snoo.eval_params` reads out are compared. Constants
from `references.track3_constants.R43`; controls must fail."""

from __future__ import annotations

import dataclasses

import pytest

from library.test_recipes_track3_aurora_proj import problem, torch_layout, worst
from library.test_recipes_track3_circuit_muon import HEADS, RecordCircuit
from library.test_recipes_track3_ema_nesterov_aurora import ours
from library.test_tail_phase_readout import Hooks, Schedule, record_final_readout
from optax_snoo import recipes
from references.track3_constants import R30, R40, R41, R43

T = 57  # R43.steps / 50: each step constant is x/50 (3010 -> 60.2, rounded to 60)

#: The test network's names (ours) as the record's: its scopes read them.
TORCH = {
    "wte/embedding": "embed.weight",
    "blocks/0/ln_1/scale": "blocks.0.norm1.gains",
    "blocks/0/attn/c_q/kernel": "blocks.0.attn.q.weight",
    "blocks/0/attn/c_q/bias": "blocks.0.attn.q.bias",
    "blocks/0/attn/c_v/kernel": "blocks.0.attn.v.weight",
    "blocks/0/attn/c_proj/kernel": "blocks.0.attn.proj.weight",
    "blocks/0/mlp/c_fc/kernel": "blocks.0.mlp.fc.weight",
    "blocks/0/mlp/c_proj/kernel": "blocks.0.mlp.proj.weight",
    "lm_head/kernel": "proj.weight",
    "lm_head/bias": "proj.bias",
}


@dataclasses.dataclass
class RecordTail(RecordCircuit):
    """#41's loop at #43's constants, its hooks and its final validation."""

    total: int = T
    schedule_steps: int = R43.steps  # what `scaled` divides by: #43's run
    train_steps: int = R43.steps
    stop: int = R43.lookahead_stop
    t_end: int = R43.schedule_steps
    switch: int = R43.tail_switch
    tail_t_end: int = R43.tail_schedule_steps
    anchor: int = R43.anchor_step
    alpha: float = R43.anchor_alpha
    tail: dict = dataclasses.field(default_factory=dict)  # the hooks' Schedule, moved

    def __post_init__(self):
        super().__post_init__()
        sc = self.scaled
        schedule = Schedule(
            steps=sc(R43.steps), broad_capture=sc(R43.broad_capture),
            broad_apply=sc(R43.broad_apply), trail_start=sc(R43.trail_start),
            trail_stop=sc(R43.trail_stop), trail_every=sc(R43.trail_every),
            t0=sc(R43.phase_t0), t1=sc(R43.phase_t1))
        self.hooks = Hooks(dataclasses.replace(schedule, **self.tail), torch=TORCH)

    def lr(self, lr0, c, step):  # script:2177-2184 _lr with _active_schedule_steps(step)
        t_end = self.scaled(self.tail_t_end if step >= self.scaled(self.switch) else self.t_end)
        c = c * (self.schedule_steps / self.total) ** R43.power
        return min(lr0, c * max(0.0, t_end - step) ** R43.power)

    def after_ema_step(self, w, step):  # script:2309-2314, after EMA_Nesterov.step
        self.hooks.after_update(w, step + 1)

    def run(self, weights, grads_by_step):
        out = super().run(weights, grads_by_step)
        # the final validation (script:2250-2275): the phase readout, then the final one
        phase = self.hooks.phase_readout(self.evaluated[-1])
        self.evaluated[-1] = record_final_readout(self.evaluated, phase,
                                                  self.scaled(self.anchor), self.alpha, TORCH)
        return out


def reference(**control):
    weights, grads = problem()
    record = RecordTail(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads[:T]])
    return steps, record


CONTROLS = {
    "PowerCool switch one update late": dict(switch=R43.tail_switch + 50),
    "no PowerCool switch": dict(tail_t_end=R43.schedule_steps),
    "lookahead end at #41's 1950": dict(stop=R40.lookahead_stop),
    "cool-down ending at #41's 2900": dict(train_steps=R41.steps),
    "TrailDelta first gamma x1.05": dict(tail=dict(trail_gammas=(
        R43.trail_gammas[0] * 1.05, R43.trail_gammas[1]))),
    "TrailDelta last gamma x1.05": dict(tail=dict(trail_gammas=(
        R43.trail_gammas[0], R43.trail_gammas[1] * 1.05))),
    "TrailDelta momentum 0.95": dict(tail=dict(trail_momentum=0.95)),
    "TrailDelta one update late": dict(tail=dict(trail_start=54)),
    "BroadDelta gamma x1.05": dict(tail=dict(broad_gamma=R43.broad_gamma * 1.05)),
    "BroadDelta copy one update late": dict(tail=dict(broad_capture=41)),
    "phase kappa x1.05": dict(tail=dict(kappa=R43.phase_kappa * 1.05)),
    "phase t1 + 1": dict(tail=dict(t1=56)),
    "final alpha x1.05": dict(alpha=R43.anchor_alpha * 1.05),
    "final anchor before the BroadDelta pulse": dict(anchor=R43.anchor_step - 50),
}


@pytest.fixture(scope="module")
def runs():
    """Ours, the record's run and each control's (one reference run each)."""
    params, evaluated = ours("track3_tail_phase_readout", total=T, steps=T, num_heads=HEADS)
    steps, record = reference()
    controls = {}
    for name, control in CONTROLS.items():
        c_steps, c_record = reference(**control)
        controls[name] = max(worst(params, c_steps), worst(evaluated, c_record.evaluated))
    return params, evaluated, steps, record, controls


def test_matches_its_record_in_float64(runs):
    params, evaluated, steps, record, _ = runs
    assert worst(params, steps) < 1e-10
    assert worst(evaluated, record.evaluated) < 1e-10
    hooks = record.hooks
    assert hooks.trail_count == 2 and hooks.broad_applied  # pulses after 55, 57; 48
    assert [k for k, v in record.seen.items() if not v] == ["floor_free"], record.seen


def test_the_readouts_move_only_the_last_evaluated_weights(runs):
    """After the lookahead (38) the evaluated weights are the params but at update 57,
    where the two readouts move them (the params are the record's training weights)."""
    params, evaluated = runs[:2]
    assert worst(params[38:56], evaluated[38:56]) == 0.0
    assert worst(params[56:], evaluated[56:]) > 1e-4


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_a_moved_constant_fails_the_comparison(runs, control):
    assert runs[4][control] > 1e-6, runs[4][control]


def test_the_defaults_are_the_records():
    recipe = recipes.track3_tail_phase_readout
    t, r = recipe.defaults, R43
    assert recipe.record_steps == t.RECORD_STEPS == r.steps == t.train_steps
    assert (t.schedule_steps, t.tail_switch, t.tail_schedule_steps) == (
        r.schedule_steps, r.tail_switch, r.tail_schedule_steps)
    assert (t.lookahead, t.lookahead_ema, t.lookahead_start, t.lookahead_stop) == (
        r.lookahead, r.lookahead_ema, r.lookahead_prefill, r.lookahead_stop)
    assert (t.trail_start, t.trail_every, t.trail_stop, t.trail_momentum) == (
        r.trail_start, r.trail_every, r.trail_stop, r.trail_momentum)
    assert (t.trail_gamma_first, t.trail_gamma_final) == r.trail_gammas
    assert (t.broad_capture, t.broad_apply, t.broad_gamma) == (
        r.broad_capture, r.broad_apply, r.broad_gamma)
    assert (t.phase_t0, t.phase_t1, t.phase_kappa, t.phase_velocity_weight) == (
        r.phase_t0, r.phase_t1, r.phase_kappa, r.phase_velocity)
    assert (t.final_readout_anchor, t.final_readout_alpha) == (r.anchor_step,
                                                               r.anchor_alpha)
    assert (t.circuit_damping, t.muon_learning_rate, t.floor, t.contra_ramp_end) == (
        r.damping, r.muon_lr, r.target_uw, r.contra_end)
    # #43's PowerCool constants and cool-down length are #30's, as the reference uses
    assert (r.power, r.embed_c, r.head_c, r.vector_c, r.muon_c, r.mu_cooldown) == (
        R30.power, R30.embed_c, R30.head_c, R30.vector_c, R30.muon_c, R30.mu_cooldown)
    # every other constant is #41's
    base = recipes.track3_circuit_muon.defaults
    moved = {"train_steps", "lookahead_stop"}
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)
            if f.name not in moved} == {
        k: v for k, v in dataclasses.asdict(base).items() if k not in moved}


def test_its_powercool_at_the_records_length():
    """At 2850 updates the schedule is the record's ``_lr`` (script:2177-2184)."""
    lr = recipes.track3_tail_phase_readout.stack(R43.steps).learning_rate
    for step in (0, 1500, R43.tail_switch - 1, R43.tail_switch, R43.steps - 1):
        t_end = R43.tail_schedule_steps if step >= R43.tail_switch else R43.schedule_steps
        expected = min(R43.muon_lr, R43.muon_c * (t_end - step) ** R43.power)
        assert float(lr(step)) == pytest.approx(expected, rel=1e-6), step


def test_every_run_length_keeps_the_tail_on_its_grid():
    """Two TrailDelta pulses, the last at the run's end, the phase readout's second copy
    at the first pulse, at every length (each step rounded on its own, a quarter of them
    would lose the last pulse)."""
    recipe = recipes.track3_tail_phase_readout
    for n in range(recipe.min_steps, R43.steps + 1):
        t = recipe.defaults.scaled(n)
        assert t.trail_start + 2 * t.trail_every == t.trail_stop == t.train_steps == n, n
        assert (t.phase_t0, t.phase_t1) == (t.trail_start, t.trail_start + t.trail_every), n


def test_bad_tail_steps_are_refused_in_one_line():
    with pytest.raises(ValueError, match="phase_t1=2900 must be <= train_steps=2850"):
        recipes.track3_tail_phase_readout(2850, phase_t1=2900)
    with pytest.raises(ValueError, match="broad_capture=2400, broad_apply=2000"):
        recipes.track3_tail_phase_readout(2850, broad_capture=2400, broad_apply=2000)
