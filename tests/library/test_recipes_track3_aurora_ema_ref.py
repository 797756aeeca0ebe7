"""`recipes.track3_aurora_ema_ref` (Track 3 result #42) against a float64 numpy
transcription of its script's optimizer and readout: #40's loop
(`test_recipes_track3_ema_nesterov_aurora.RecordEma`: #30's `Muon.step` and AdamW inside
``EMA_Nesterov``; #42's script is a cleaned copy with the same constants, script:45-83)
and its ``maybe_capture_ref_extrap_state`` (after ``EMA_Nesterov.step``, at update
``step + 1``, script:728-738, 843) and ``apply_ref_extrap_weights`` (``p + (p - ref)·γ``
from update 2850 on, script:740-759), one update at a time over #40's 58 updates of a
60-step run: the lookahead from 6 to 38, the capture after update 48 (2375 scaled), the
interpolated readout from update 57 (2850 scaled). Params (the training weights, which the
readout never touches) and the evaluated weights (`optax_snoo.eval_params`) are compared.
Constants from `references.track3_constants.R42`; controls must fail."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from library.test_recipes_track3_aurora_proj import problem, torch_layout, worst
from library.test_recipes_track3_ema_nesterov_aurora import STEPS, RecordEma, ours
from optax_snoo import recipes
from references.track3_constants import R40, R42


@dataclasses.dataclass
class RecordEmaRef(RecordEma):
    """#40's loop, then #42's reference capture and its interpolated readout."""

    capture: int = R42.ref_capture
    start: int = R42.ref_start
    gamma: float = R42.ref_gamma

    def __post_init__(self):
        super().__post_init__()
        self.ref, self.interpolated = None, 0

    def after_step(self, w, step):
        super().after_step(w, step)  # appends the weights without the lookahead
        weights = self.evaluated[-1]
        if step + 1 == self.scaled(self.capture):  # script:843 capture(step + 1)
            self.ref = {n: x.copy() for n, x in weights.items()}
        if step + 1 >= self.scaled(self.start):  # script:740-741
            self.interpolated += 1
            self.evaluated[-1] = {n: x + (x - self.ref[n]) * self.gamma
                                  for n, x in weights.items()}  # script:755


@functools.cache
def reference(**control):
    weights, grads = problem()
    record = RecordEmaRef(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads[:STEPS]])
    return steps, record


def test_matches_its_record_in_float64():
    steps, record = reference()
    params, evaluated = ours("track3_aurora_ema_ref")
    assert worst(params, steps) < 1e-10
    assert worst(evaluated, record.evaluated) < 1e-10
    assert record.interpolated == 2  # updates 57 and 58 (2850 of 2980, scaled to 60)
    assert all(record.seen.values()), record.seen


def test_training_is_40s_and_the_readout_moves_at_its_start():
    """The interpolation changes what is evaluated only: the params are #40's recipe's
    (to float64 rounding: another XLA program), and so are the evaluated weights before
    update 57."""
    params_40, evaluated_40 = ours()
    params, evaluated = ours("track3_aurora_ema_ref")
    assert worst(params, params_40) < 1e-12
    assert worst(evaluated[:56], evaluated_40[:56]) < 1e-12
    assert worst(evaluated[56:], evaluated_40[56:]) > 1e-3


@pytest.mark.parametrize("control", [
    dict(gamma=-0.08), dict(capture=2325), dict(capture=2425), dict(start=2800),
    dict(gamma=0.0)])
def test_a_moved_constant_fails_the_comparison(control):
    evaluated = ours("track3_aurora_ema_ref")[1]
    assert worst(evaluated, reference(**control)[1].evaluated) > 1e-6


def test_the_defaults_are_the_records():
    recipe = recipes.track3_aurora_ema_ref
    t, r = recipe.defaults, R42
    assert (t.reference_capture, t.reference_start, t.reference_gamma) == (
        r.ref_capture, r.ref_start, r.ref_gamma)
    # #42's script keeps #40's schedule and EMA-Nesterov (script:45-83)
    assert (r.steps, r.schedule_steps) == (R40.train_steps, R40.schedule_steps)
    assert (r.lookahead, r.lookahead_ema, r.lookahead_prefill, r.lookahead_stop) == (
        R40.lookahead, R40.lookahead_ema, R40.lookahead_prefill, R40.lookahead_stop)
    assert recipe.record_steps == R40.schedule_steps
    base = recipes.track3_ema_nesterov_aurora.defaults
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)} == (
        dataclasses.asdict(base))


def test_the_interpolation_must_start_after_its_capture():
    with pytest.raises(ValueError, match="reference_start=2000 must be >= "
                                         "reference_capture=2375"):
        recipes.track3_aurora_ema_ref(2980, reference_start=2000)


def test_the_readout_is_w_minus_its_share_toward_the_reference():
    """At update 57: ``0.925 w_57 + 0.075 w_48`` (numbers, not the record's code)."""
    params, evaluated = ours("track3_aurora_ema_ref")
    for n in params[56]:
        expected = 0.925 * params[56][n] + 0.075 * params[47][n]
        np.testing.assert_allclose(evaluated[56][n], expected, rtol=1e-12, atol=1e-14)
