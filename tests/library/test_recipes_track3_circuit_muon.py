"""`recipes.track3_circuit_muon` (Track 3 result #41) against a float64 numpy transcription
of its log's optimizer: #40's loop (`test_recipes_track3_ema_nesterov_aurora.RecordEma`;
#41's log is #40's script with the same constants, log:47-48) with its
``_circuit_muon_step`` (log:735-746: each (attn.v, attn.proj) pair's directions from
``_direction``, coupled by ``circuit_muon`` (log:591-631,
`test_circuit.record_circuit_muon`) on the weights the step starts from, then each leg's
``_finish``: radial scale, u/w floor, step, radius pin), one update at a time over #40's
58 updates of a 60-step run (the lookahead from 6 to 38: the coupling reads the lookahead
point). The test network's attention has 2 heads of 4 (the record's 6 of 128).
Constants from `references.track3_constants.R41`; controls must fail."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from library.test_circuit import record_circuit_muon
from library.test_recipes_track3_aurora_proj import problem, torch_layout, worst
from library.test_recipes_track3_ema_nesterov_aurora import STEPS, RecordEma, ours
from optax_snoo import recipes
from references.track3_constants import R40, R41

HEADS = 2  # the test network's attention: c_v (8, 8) as 2 heads of 4
VALUE, OUTPUT = "blocks/0/attn/c_v/kernel", "blocks/0/attn/c_proj/kernel"


@dataclasses.dataclass
class RecordCircuit(RecordEma):
    """#40's loop with #41's coupled (attn.v, attn.proj) pass."""

    damping: float = R41.damping
    heads: int = HEADS
    controls: tuple = ()
    partner_weights: str = "step"  # "step": the weights the step starts from (log:743)

    def couple(self, directions, w):
        weights = w if self.partner_weights == "step" else self.prev  # prev: no lookahead
        directions = dict(directions)
        directions[VALUE], directions[OUTPUT] = record_circuit_muon(
            directions[VALUE], directions[OUTPUT], weights[VALUE], weights[OUTPUT],
            w[VALUE].shape[0] // self.heads, self.damping, controls=self.controls)
        return directions


@functools.cache
def reference(**control):
    weights, grads = problem()
    record = RecordCircuit(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads[:STEPS]])
    return steps, record


def ours_41():
    return ours("track3_circuit_muon", num_heads=HEADS)


def test_matches_its_record_in_float64():
    steps, record = reference()
    params, evaluated = ours_41()
    assert worst(params, steps) < 1e-10
    assert worst(evaluated, record.evaluated) < 1e-10
    # every mechanism acted but the free floor: on this problem every step is below
    # 0.3825 of its matrix here (the floor's free branch is #40's test's)
    assert [k for k, v in record.seen.items() if not v] == ["floor_free"], record.seen


def test_the_coupling_moves_only_attn_v_and_attn_proj_at_the_first_step():
    """After update 1 the other matrices are #40's (to rounding); V and O are not."""
    params, params_40 = ours_41()[0], ours()[0]
    others = [n for n in params[0] if n not in (VALUE, OUTPUT)]
    assert worst([{n: params[0][n] for n in others}], [{n: params_40[0][n] for n in others}]
                 ) < 1e-12
    assert worst([{VALUE: params[0][VALUE]}], [{VALUE: params_40[0][VALUE]}]) > 1e-6
    assert worst([{OUTPUT: params[0][OUTPUT]}], [{OUTPUT: params_40[0][OUTPUT]}]) > 1e-6


@pytest.mark.parametrize("control", [
    dict(damping=R41.damping * 1.05), dict(heads=1), dict(heads=4),
    dict(controls=("swap",)), dict(controls=("no_renorm",)), dict(controls=("no_gauge",)),
    dict(partner_weights="without_lookahead")])
def test_a_moved_constant_fails_the_comparison(control):
    assert worst(ours_41()[0], reference(**control)[0]) > 1e-6


def test_the_defaults_are_the_records():
    recipe = recipes.track3_circuit_muon
    assert recipe.defaults.circuit_damping == R41.damping
    assert recipe.options["num_heads"] * R41.head_dim == 768  # Track 3's 6 heads of 128
    assert R41.steps == R40.train_steps  # #41 runs #40's schedule
    base = recipes.track3_ema_nesterov_aurora.defaults
    t = recipe.defaults
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)} == (
        dataclasses.asdict(base))
