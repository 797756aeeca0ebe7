"""`recipes.track3_rre` (Track 3 result #34) against a float64 numpy transcription of its
script's optimizer: #30's `Muon.step` and AdamW (`test_recipes_track3_aurora_proj.Record`,
the same code in #34's script, whose constants block is #30's) and, at the end of each
Muon step, #34's `Muon._maybe_extrapolate` with `rre_extrapolate` (script:660-686,
1105-1158), on the hidden matrices as one vector. Over a 305-step run (the record's 3050 /
10): the base path before the window, then RRE's window from update 282 to 292 (2820 and
2925 scaled), its moves at 285 and 290; controls must fail. Constants from
`references.track3_constants.R30` / `R34`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from library.test_recipes_track3_aurora_proj import (
    MATRICES,
    PARAMS,
    Record,
    first_gradient,
    torch_layout,
    worst,
)
from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R30, R34

T = 305  # R30.schedule_steps / 10: the recipe's total_steps
STEPS = 295  # the run: past RRE's window (to 292), before train_steps (302), where the
# log's momentum cool-down ends (its formula is not meant past it)


def rre_extrapolate(iterates, regularization, damping):  # script:660-686
    k = len(iterates) - 1
    U = np.stack([iterates[i + 1] - iterates[i] for i in range(k)])
    G = U @ U.T
    G = G + (regularization * max(np.trace(G), 0) / k + R34.ridge_floor) * np.eye(k)
    coeffs = np.linalg.solve(G, np.ones(k))
    if not np.isfinite(coeffs.sum()) or abs(coeffs.sum()) < R34.coefficient_floor:
        return iterates[-1].copy()
    gamma = np.flip(np.cumsum(np.flip(coeffs / coeffs.sum())))
    extrapolated = iterates[-1] - gamma @ U
    return iterates[-1] + damping * (extrapolated - iterates[-1])  # lerp(., damping)


@dataclasses.dataclass
class RecordRre(Record):
    """#30's steps, then `_maybe_extrapolate` on the Muon matrices (script:1105-1158)."""

    start: int = R34.start
    stop: int = R34.stop
    every: int = R34.every
    history: int = R34.history
    damping: float = R34.damping
    max_rel: float = R34.max_rel
    regularization: float = R34.regularization
    rre: bool = True
    total: int = T

    def __post_init__(self):
        super().__post_init__()
        self.moves, self.rel, self.capped, self.checkpoints = [], [], 0, []

    def after_step(self, w, step):
        next_step = step + 1  # the script's step_count + 1
        start, stop = self.scaled(self.start), self.scaled(self.stop)
        if self.rre and start <= next_step <= stop:  # after_stop_every = 0: none after
            self.maybe_extrapolate(w, next_step)

    def maybe_extrapolate(self, w, next_step):
        current = np.concatenate([w[n].ravel() for n in MATRICES])
        self.checkpoints.append(current)
        if len(self.checkpoints) > self.history:
            self.checkpoints.pop(0)
        if next_step % self.every or len(self.checkpoints) < self.history:
            return
        moved = rre_extrapolate(self.checkpoints, self.regularization, self.damping)
        delta = moved - current
        rel = np.linalg.norm(delta) / max(np.linalg.norm(current), R34.norm_floor)
        self.rel.append(rel)
        if self.max_rel > 0 and rel > self.max_rel:
            delta = delta * (self.max_rel / max(rel, 1e-12))
            self.capped += 1
        moved = current + delta
        self.moves.append(next_step)
        self.checkpoints = [moved]
        offset = 0
        for n in MATRICES:
            size = w[n].size
            w[n] = moved[offset:offset + size].reshape(w[n].shape)
            offset += size


@functools.cache
def problem(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    weights = {n: scale * rng.standard_normal(s) + (1.0 if n.endswith("scale") else 0.0)
               for n, (s, _) in PARAMS.items()}
    grads = [{n: (first_gradient(s, rng) if t == 0 and n in MATRICES
                  else rng.standard_normal(s)) for n, (s, _) in PARAMS.items()}
             for t in range(STEPS)]
    return weights, grads


@functools.cache
def ours(name="track3_rre", max_relative=None):
    weights, grads = problem()
    cap = {} if max_relative is None else dict(rre_max_relative=max_relative)

    def run(w, gs):
        tx = recipes.get(name)(T, ns_dtype="float64", **cap)
        params = nest(w, dtype=None)
        state, update, out = tx.init(params), jax.jit(tx.update), []
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(**control):
    weights, grads = problem()
    record = RecordRre(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads])
    return steps, record


def test_matches_its_record_in_float64():
    steps, record = reference()
    assert worst(ours(), steps) < 1e-10
    assert record.moves == [285, 290]  # 2820..2925 scaled to 282..292, every 5, 4 kept
    assert record.capped == 2  # the cap bound (as at #34's first moves)
    assert all(record.seen.values()), record.seen


def test_the_base_step_is_30s_and_the_moves_happen_at_its_steps():
    """Up to update 284 the run is #30's (`track3_aurora_proj`, and the record without
    RRE); the first move, at update 285, leaves both."""
    ours_rre, ours_30 = ours(), ours("track3_aurora_proj")
    plain, _ = reference(rre=False)
    assert worst(ours_rre[:284], ours_30[:284]) < 1e-12
    assert worst(ours_rre[:284], plain[:284]) < 1e-10
    assert worst(ours_rre[284:285], ours_30[284:285]) > 1e-3
    assert worst(ours_rre[284:285], plain[284:285]) > 1e-3


def test_uncapped_moves_match_the_record():
    """Without the cap (``rre_max_relative=0`` on both sides) the damped RRE step itself is
    compared (with the cap, both moves are the cap's 1e-3 of the weights' norm)."""
    steps, record = reference(max_rel=0.0)
    assert worst(ours(max_relative=0.0), steps) < 1e-10
    assert record.moves == [285, 290] and record.capped == 0
    assert min(record.rel) > R34.max_rel, record.rel  # 1.4e-3, 1.06e-3: the cap binds


@pytest.mark.parametrize("control", [
    dict(max_rel=0.0011), dict(start=2850), dict(stop=2880), dict(every=4), dict(history=3),
    dict(rre=False)])
def test_a_moved_constant_fails_the_comparison(control):
    assert worst(ours(), reference(**control)[0]) > 1e-6


@pytest.mark.parametrize("control", [dict(damping=0.9), dict(regularization=1e-2)])
def test_a_moved_constant_fails_the_uncapped_comparison(control):
    assert worst(ours(max_relative=0.0), reference(max_rel=0.0, **control)[0]) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_rre.defaults
    assert (t.rre_start, t.rre_stop, t.rre_every, t.rre_history, t.rre_damping,
            t.rre_max_relative, t.rre_regularization) == (
        R34.start, R34.stop, R34.every, R34.history, R34.damping, R34.max_rel,
        R34.regularization)
    assert R34.reset_momentum is False and R34.after_stop_every == 0  # rre_extrapolation's
    assert recipes.track3_rre.record_steps == R30.schedule_steps
    assert R34.steps == R30.train_steps  # #34 runs #30's schedule
    base = recipes.track3_aurora_proj.defaults
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)} == (
        dataclasses.asdict(base))
