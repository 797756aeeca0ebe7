"""`tail_velocity` then `reference_interpolation` (modded-nanogpt Track 3 result #38)
against a float64 numpy transcription of the log's readout code
(`train_gpt_tail_refinterp_2900.py`: `update_tail_velocity`, `apply_tail_velocity_weights`,
`maybe_capture_ref_extrap_state`, `ref_extrap_gamma_for_step`, `apply_ref_extrap_weights`,
the restores and the training loop that calls them in that order), over the record's whole
2900 steps (reference copied at 2375, velocity from 2500, interpolation at 2900).
Constants from `references.track3_constants.R38`.

#38's base (PR #300's Aurora-on-mlp.proj stack) is not a recipe of the library, so the
inner optimizer is a stand-in (SGD with momentum on #38's Muon PowerCool ratio); the
velocity moves the hidden matrix only (the record's Muon parameters), the interpolation
every parameter. Controls (each step, EMA factor, gamma and clip moved; the two readouts
in the other order) must fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import eval_params, over_replicas, reference_interpolation, tail_velocity
from references.error import in_float64
from references.track3_constants import R38

SHAPES = {"embed": (6, 4), "w": (4, 5), "b": (5,)}
MOVED = {"embed": False, "w": True, "b": False}  # the record's tail_vel_params: Muon's
CURV = {n: 0.5 + np.arange(np.prod(s)).reshape(s) / np.prod(s) for n, s in SHAPES.items()}
LR0 = 0.05   # the stand-in inner optimizer's flat lr
MOM = 0.5    # its momentum


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's constants: #38's by default."""

    steps: int = R38.steps
    schedule_steps: int = R38.schedule_steps
    lr0: float = LR0
    vel_start: int = R38.vel_start
    vel_beta: float = R38.vel_beta
    vel_gamma: float = R38.vel_gamma
    vel_max_ratio: float = R38.vel_max_ratio
    capture: int = R38.ref_capture
    ref_start: int = R38.ref_start
    ref_gamma: float = R38.ref_gamma


def ratio(step, t_end, xp=np):
    """`_lr(step, MUON_LR, MUON_POWER_C, 1.2) / MUON_LR` (script:1525-1529)."""
    down = R38.muon_c * xp.maximum(0.0, t_end - step) ** R38.power
    return xp.minimum(R38.muon_lr, down) / R38.muon_lr


def noises(steps):
    rng = np.random.default_rng(38)
    return {n: 0.3 * rng.standard_normal((steps, *s)) for n, s in SHAPES.items()}


def init_params():
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s) for n, s in SHAPES.items()}


def record(run: Run, p, noise):
    """The log's loop (script:1605-1748) in float64 on the weights `p`, validating at every
    step. Returns the weights validation sees at each step 0..steps, the training weights
    at each step 0..steps-1 (the readouts subtracted again) and at which steps the
    velocity's clip was active."""
    p = {n: x.copy() for n, x in p.items()}
    mom = {n: np.zeros_like(x) for n, x in p.items()}
    prev, vel, ref_state = {}, {}, None
    evaluated, points, clipped = [], [], []
    for step in range(run.steps + 1):
        # apply_tail_velocity_weights(step) (script:1357-1372)
        vel_applied = []
        if step >= run.vel_start and run.vel_gamma != 0.0:
            for n in vel:
                delta_norm = max(np.linalg.norm(vel[n]), R38.vel_norm_eps)
                max_delta = run.vel_max_ratio * max(np.linalg.norm(p[n]), R38.vel_norm_eps)
                clip = min(max_delta / delta_norm, 1.0)
                clipped.append(clip < 1.0)
                extrap = vel[n] * (run.vel_gamma * clip)
                p[n] = p[n] + extrap
                vel_applied.append((n, extrap))
        # apply_ref_extrap_weights(ref_extrap_gamma_for_step(step)) (script:1431-1451)
        gamma = run.ref_gamma if step >= run.ref_start else 0.0
        ref_applied = []
        if gamma != 0.0:
            assert ref_state is not None, "ref extrapolation requested but none captured"
            for n in p:
                extrap = (p[n] - ref_state[n]) * gamma
                p[n] = p[n] + extrap
                ref_applied.append((n, extrap))
        evaluated.append({n: x.copy() for n, x in p.items()})
        for applied in (ref_applied, vel_applied):           # script:1626-1627
            for n, extrap in reversed(applied):
                p[n] = p[n] - extrap
        if step == run.steps:
            break
        points.append({n: x.copy() for n, x in p.items()})
        grad = {n: CURV[n] * p[n] + noise[n][step] for n in p}
        lr = run.lr0 * ratio(step, run.schedule_steps)        # set_hparams(step)
        mom = {n: MOM * mom[n] + grad[n] for n in p}
        p = {n: p[n] - lr * mom[n] for n in p}
        # update_tail_velocity(step + 1) (script:1324-1335)
        if step + 1 >= run.vel_start:
            for n in p:
                if not MOVED[n]:
                    continue
                if n not in prev:
                    prev[n], vel[n] = p[n].copy(), np.zeros_like(p[n])
                else:
                    vel[n] = vel[n] * run.vel_beta + (p[n] - prev[n]) * (1.0 - run.vel_beta)
                    prev[n] = p[n].copy()
        if step + 1 == run.capture and ref_state is None:   # maybe_capture_ref_extrap_state
            ref_state = {n: x.copy() for n, x in p.items()}
    return evaluated, points, clipped


def ours(run: Run, p, noise, *, order=("velocity", "reference")):
    """Ours in float64: the weights `eval_params` gives and the params at each step
    0..steps; `order` is the readouts' order in the chain (None: none)."""
    with in_float64():
        lr = lambda t: run.lr0 * ratio(t, run.schedule_steps, jnp)
        readouts = {
            "velocity": tail_velocity(run.vel_start, run.vel_beta, run.vel_gamma,
                                      run.vel_max_ratio, mask=MOVED),
            "reference": reference_interpolation(run.capture, run.ref_start, run.ref_gamma)}
        tx = optax.chain(optax.sgd(lr, momentum=MOM), *[readouts[k] for k in order or ()])
        params = {n: jnp.asarray(x, jnp.float64) for n, x in p.items()}
        xs = {n: jnp.asarray(x[:run.steps], jnp.float64) for n, x in noise.items()}

        def step(carry, noise_t):
            params, state = carry
            grads = {n: jnp.asarray(CURV[n]) * params[n] + noise_t[n] for n in params}
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            return (params, state), (eval_params(params, state), params)

        _, (evaluated, trained) = jax.lax.scan(step, (params, tx.init(params)), xs)
        first = {n: np.asarray(x) for n, x in params.items()}

        def stack(tree):
            tree = {n: np.asarray(x) for n, x in tree.items()}
            return [first] + [{n: x[i] for n, x in tree.items()} for i in range(run.steps)]

        return stack(evaluated), stack(trained)


def worst(a, b):
    return max(float(np.max(np.abs(x[n] - y[n]))) for x, y in zip(a, b, strict=True)
               for n in SHAPES)


TOL = 1e-12  # float64 against float64: the same few operations per step


def test_matches_record_over_its_schedule():
    """Every step of #38's 2900: the weights evaluated are the log's (the velocity step
    on the hidden matrix from 2500, the interpolation of the result at 2900), and the
    params are its training weights."""
    run, p0, noise = Run(), init_params(), noises(R38.steps)
    evaluated, points, _ = record(run, p0, noise)
    got, params = ours(run, p0, noise)
    assert worst(got, evaluated) < TOL
    assert worst(params[:-1], points) < TOL
    assert worst(got[:run.vel_start], params[:run.vel_start]) == 0.0
    effect = worst(got[run.vel_start + 1:], params[run.vel_start + 1:])
    assert effect > 1e-4, effect
    for n in ("embed", "b"):  # the velocity moves the hidden matrix only
        assert all(np.array_equal(g[n], q[n]) for g, q in zip(got[:-1], params[:-1], strict=True))
    controls = (dict(vel_start=run.vel_start + 1), dict(vel_beta=0.92),
                dict(vel_gamma=run.vel_gamma * 1.05), dict(capture=run.capture + 1),
                dict(ref_start=run.ref_start - 1), dict(ref_gamma=run.ref_gamma * 1.05))
    for control in controls:
        moved, _ = ours(dataclasses.replace(run, **control), p0, noise)
        assert worst(moved, evaluated) > 1e6 * TOL, control
    # The readouts in the other order (interpolate, then step) must fail too.
    other, _ = ours(run, p0, noise, order=("reference", "velocity"))
    assert worst(other, evaluated) > 1e6 * TOL


def test_clip_matches_record_where_it_binds():
    """A short run with a large lr, where the velocity's clip binds on some steps and not
    on others: both branches agree with the log, and a clip moved 5% fails."""
    run = Run(steps=60, schedule_steps=2400, lr0=0.1, vel_start=20, vel_max_ratio=0.08,
              capture=15, ref_start=50)
    p0, noise = init_params(), noises(60)
    evaluated, points, clipped = record(run, p0, noise)
    assert 0 < sum(clipped) < len(clipped), clipped
    got, params = ours(run, p0, noise)
    assert worst(got, evaluated) < TOL
    assert worst(params[:-1], points) < TOL
    moved, _ = ours(dataclasses.replace(run, vel_max_ratio=0.084), p0, noise)
    assert worst(moved, evaluated) > 1e6 * TOL


def test_training_weights_unchanged():
    """Both readouts pass the update through: each returns the very updates it is given
    (before, at and after its capture and start steps), so the params are those of the
    same optimizer without them, at the float64 rounding of the two compiled chains (XLA
    may contract their multiply-adds differently)."""
    run = Run(steps=60, schedule_steps=2400, lr0=0.1, vel_start=20, vel_max_ratio=0.08,
              capture=15, ref_start=50)
    p0, noise = init_params(), noises(60)
    params = {n: jnp.asarray(x) for n, x in p0.items()}
    for tx in (tail_velocity(2, 0.9, -1.0, mask=MOVED), reference_interpolation(2, 3, -0.5)):
        state = tx.init(params)
        for t in range(5):
            updates = {n: jnp.full_like(x, 0.01 * (t + 1)) for n, x in params.items()}
            out, state = tx.update(updates, state, params)
            assert out is updates, (tx, t)
            params = optax.apply_updates(params, updates)
    got, params = ours(run, p0, noise)
    _, plain = ours(run, p0, noise, order=None)
    assert worst(params, plain) <= TOL
    assert worst(got[run.vel_start + 1:], params[run.vel_start + 1:]) > 1e-3


def test_over_replicas_each_replica_clips_by_its_own_norms():
    """Under `over_replicas` each replica's velocity and its clip use its own weights."""
    tx = over_replicas(optax.chain(
        optax.sgd(1.0), tail_velocity(1, 0.5, -1.0, max_ratio=0.11)))
    params = {"w": jnp.stack([jnp.full((2, 2), 10.0), jnp.full((2, 2), 1.0)])}
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update({"w": jnp.ones((2, 2, 2))}, state, params)
        params = optax.apply_updates(params, updates)
    # v = -0.75 on both (|v| = 1.5); replica 0 (w = 7, |w| = 14): 0.11 * 14 > 1.5,
    # unclipped, 7 + 0.75; replica 1 (w = -2, |w| = 4): v scaled by 0.11 * 4 / 1.5,
    # -2 + 0.22. (Norms over both replicas would clip both by one factor.)
    ev = eval_params(params, state)["w"]
    np.testing.assert_allclose(ev[0], 7.75, rtol=1e-6)
    np.testing.assert_allclose(ev[1], -1.78, rtol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="start"):
        tail_velocity(0)
    with pytest.raises(ValueError, match="beta"):
        tail_velocity(5, beta=1.0)
    with pytest.raises(ValueError, match="gamma"):
        tail_velocity(5, gamma=float("inf"))
    with pytest.raises(ValueError, match="max_ratio"):
        tail_velocity(5, max_ratio=0.0)
    with pytest.raises(ValueError, match="needs params"):
        tx = tail_velocity(1)
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


MATRIX_PARAMS = {"a": jnp.ones((8, 4)), "b": jnp.linspace(-1.0, 1.0, 6)}


def test_optax_matrix(tmp_path):
    tx = optax.chain(optax.adam(1e-2), tail_velocity(1, 0.5, -2.0, 0.5))
    f64 = dict(float64=tx, float32_state=True)
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=4, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=3)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=3)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_partition(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_nnx_optimizer(tx, steps=5)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=3, steps_after=3)
    m.check_inject_hyperparams(lambda gamma: tail_velocity(1, 0.5, gamma, 0.5),
                               MATRIX_PARAMS, dict(gamma=-2.0), steps=4, float64=True,
                               float32_state=True)
