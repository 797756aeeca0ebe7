"""radius_steps with the brake and the floor as schedules: modded-nanogpt Track 3 result
#38's late ramps (`train_gpt_tail_refinterp_2900.py`: `radial_outward_scale_for_step`, the
brake 0.5 -> 0.4 over updates 2400-2900; `target_uw_for_step`, the u/w floor 0.3825 ->
0.400 over 2400-2800; `scale_radial_update`, the scalar floor and the radius pin of
`Muon.step`), against a float64 numpy transcription over updates 2390-2910. Constants
from `references.track3_constants.R38`; controls (a ramp's end value or step moved) fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo import radius_steps
from references.error import in_float64
from references.radius import ref_muon_step
from references.track3_constants import R38

SHAPES = {"tall": (8, 4), "wide": (4, 8), "square": (6, 6)}
FIRST, LAST = 2390, 2910  # every ramp boundary inside


@dataclasses.dataclass(frozen=True)
class Ramps:
    brake: float = R38.brake
    brake_late: float = R38.brake_late
    brake_ramp: tuple[int, int] = R38.brake_ramp
    floor: float = R38.floor
    floor_late: float = R38.floor_late
    floor_ramp: tuple[int, int] = R38.floor_ramp


def record_brake(r: Ramps, step):
    """`radial_outward_scale_for_step` (script:876-884)."""
    start, end = r.brake_ramp
    if step < start:
        return r.brake
    if step >= end:
        return r.brake_late
    progress = (step - start) / (end - start)
    return r.brake * (1.0 - progress) + r.brake_late * progress


def record_floor(r: Ramps, step):
    """`target_uw_for_step` (script:789-800; no train-loss gate, no decay) with
    `_linear_ramp` (script:756-759)."""
    start, end = r.floor_ramp
    ramp = min(1.0, max(0.0, (step - start) / (end - start)))
    return r.floor * (1.0 - ramp) + r.floor_late * ramp


def ramp(before, after, steps):
    """A float64 linear ramp of the update count (optax.linear_schedule's, unrounded)."""
    start, end = steps
    return lambda t: before + (after - before) * jnp.clip(
        (jnp.asarray(t, jnp.float64) - start) / (end - start), 0.0, 1.0)


def lr(t):
    """The learning rate at update t (a Python float, or float64 of a traced count)."""
    t = t if isinstance(t, int) else jnp.asarray(t, jnp.float64)
    return 0.05 * (1.0 - (t - FIRST) / (2 * (LAST - FIRST)))


def directions(t):
    """Directions whose size and sign vary, so the brake and the floor take each branch."""
    rng = np.random.default_rng(t)
    return {n: 10.0 ** rng.uniform(-1.5, 0.5) * rng.standard_normal(s)
            for n, s in SHAPES.items()}


def run(r: Ramps):
    """The record's steps from update FIRST to LAST in float64 (its (out, in) matrices are
    our kernels transposed), and ours in float64 one update at a time from the record's
    weights before it (a run of 500 updates would compare accumulated rounding, not the
    step). Returns (ours, record, branch counts), lists of {name: kernel}."""
    rng = np.random.default_rng(0)
    ref = {n: 0.5 * rng.standard_normal(s).T for n, s in SHAPES.items()}
    before, record, stats = [], [], {"outward": 0, "inward": 0, "bind": 0, "free": 0}
    for t in range(FIRST, LAST + 1):
        before.append({n: x.T for n, x in ref.items()})
        o = directions(t)
        ref = {n: ref_muon_step(ref[n], o[n].T, lr(t), brake=record_brake(Ramps(), t),
                                floor=record_floor(Ramps(), t), floor_per="matrix",
                                pin="first_order", cwd=0.0, stats=stats)
               for n in SHAPES}
        record.append({n: x.T for n, x in ref.items()})
    with in_float64():
        tx = radius_steps(lr, brake=ramp(r.brake, r.brake_late, r.brake_ramp),
                          floor=ramp(r.floor, r.floor_late, r.floor_ramp),
                          floor_per="matrix", pin="first_order", cautious_weight_decay=0.0)
        state = tx.init({n: jnp.asarray(x) for n, x in before[0].items()})
        state = state._replace(count=jnp.asarray(FIRST, jnp.int32))
        update = jax.jit(tx.update)
        ours = []
        for t, weights in zip(range(FIRST, LAST + 1), before, strict=True):
            params = {n: jnp.asarray(x) for n, x in weights.items()}
            updates, state = update({n: jnp.asarray(x) for n, x in directions(t).items()},
                                    state, params)
            ours.append({n: np.asarray(x) for n, x in
                         optax.apply_updates(params, updates).items()})
    return ours, record, stats


def worst(a, b):
    return max(float(np.max(np.abs(x[n] - y[n]))) for x, y in zip(a, b, strict=True)
               for n in SHAPES)


TOL = 1e-14  # one float64 update of weights of norm ~2: a few roundings


def test_ramped_brake_and_floor_match_record():
    ours, record, stats = run(Ramps())
    assert worst(ours, record) < TOL
    assert min(stats.values()) > 100, stats  # both branches of the brake and the floor
    for control in (dict(brake_late=0.42), dict(brake_ramp=(2450, 2900)),
                    dict(floor_late=0.41), dict(floor_ramp=(2400, 2850))):
        moved, _, _ = run(Ramps(**control))
        assert worst(moved, record) > 1e6 * TOL, control


def test_optax_linear_schedule_is_the_record_ramp():
    """The ramps a user writes with optax.linear_schedule are the record's (float32)."""
    brake = optax.linear_schedule(R38.brake, R38.brake_late,
                                  R38.brake_ramp[1] - R38.brake_ramp[0], R38.brake_ramp[0])
    floor = optax.linear_schedule(R38.floor, R38.floor_late,
                                  R38.floor_ramp[1] - R38.floor_ramp[0], R38.floor_ramp[0])
    steps = np.arange(FIRST, LAST + 1)
    np.testing.assert_allclose(np.asarray(jax.vmap(brake)(steps)),
                               [record_brake(Ramps(), t) for t in steps], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.vmap(floor)(steps)),
                               [record_floor(Ramps(), t) for t in steps], rtol=1e-7)
