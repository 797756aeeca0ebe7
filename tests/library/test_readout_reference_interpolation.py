"""`reference_interpolation` (modded-nanogpt Track 3 result #42) against a float64 numpy
transcription of the log's readout code (`train_gpt_simple_aurora_ema_ref.py`:
`maybe_capture_ref_extrap_state`, `ref_extrap_gamma_for_step`, `apply_ref_extrap_weights`,
`restore_ref_extrap_weights` and the training loop that calls them, with its `EMA_Nesterov`
around the inner optimizer), over the record's whole schedule (capture 2375, readout from
2850, claim 2860; lookahead 300-1949). Constants from `references.track3_constants.R42`.

#42's base (#40's Aurora/EMA-Nesterov stack) is not a recipe of the library, so the inner
optimizer is a stand-in (SGD with momentum on #42's PowerCool ratio): the readout is a
transform around any inner optimizer, and what is checked is its capture, its switch-on,
its formula and its place inside `ema_nesterov`. Controls (the capture step, the readout
step, gamma moved; the readout outside EMA-Nesterov where that matters) must fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import ema_nesterov, eval_params, reference_interpolation, tail_ema
from references.error import in_float64
from references.track3_constants import R42

SHAPES = {"embed": (6, 4), "w": (4, 5), "b": (5,)}
CURV = {n: 0.5 + np.arange(np.prod(s)).reshape(s) / np.prod(s) for n, s in SHAPES.items()}
LR0 = 0.05   # the stand-in inner optimizer's flat lr
MOM = 0.5    # its momentum


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's constants: #42's by default."""

    steps: int = R42.claim                       # the loop runs to the claim step
    schedule_steps: int = R42.schedule_steps
    prefill: int = R42.lookahead_prefill
    stop: int = R42.lookahead_stop
    capture: int = R42.ref_capture
    start: int = R42.ref_start
    gamma: float = R42.ref_gamma


def ratio(step, t_end, xp=np):
    """`_lr(step, 0.3, ADAM_EMBED_POWER_C, 1.2) / 0.3` (script:689-693): the embedding
    group's lr over its initial lr, which `EMA_Nesterov.get_lr_lambda` reads."""
    down = R42.embed_c * xp.maximum(0.0, t_end - step) ** R42.power
    return xp.minimum(R42.embed_lr, down) / R42.embed_lr


def noises(steps):
    rng = np.random.default_rng(42)
    return {n: 0.3 * rng.standard_normal((steps, *s)) for n, s in SHAPES.items()}


def init_params():
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s) for n, s in SHAPES.items()}


def record(run: Run, p, noise):
    """The log's loop (script:794-848) in float64 on the weights `p`: validation at every
    step (it changes what is evaluated only), `EMA_Nesterov` (script:486-575) around SGD
    with momentum. Returns the weights validation sees at each step 0..steps, and the
    points the gradients are taken at (the training weights with the lookahead, after
    the readout was subtracted again) at each step 0..steps-1."""
    p = {n: x.copy() for n, x in p.items()}
    prev = {n: x.copy() for n, x in p.items()}                 # initialize_buffers
    buf = {n: np.zeros_like(x) for n, x in p.items()}
    mom = {n: np.zeros_like(x) for n, x in p.items()}
    group_lr = LR0                                             # group["lr"] = initial_lr
    ref_state = None
    evaluated, points = [], []
    for step in range(run.steps + 1):
        # ref_extrap_gamma_for_step; apply_ref_extrap_weights; validate; restore.
        gamma = run.gamma if step >= run.start else 0.0
        applied = []
        if gamma != 0.0:
            assert ref_state is not None, "reference interpolation requested before capture"
            for n in p:
                delta = (p[n] - ref_state[n]) * gamma
                p[n] = p[n] + delta
                applied.append((n, delta))
        evaluated.append({n: x.copy() for n, x in p.items()})
        for n, delta in reversed(applied):
            p[n] = p[n] - delta
        if step == run.steps:
            break
        # nesterov_step: the lookahead with the lr ratio set on the previous step.
        it = step
        if it + 1 > run.prefill and it < run.stop:
            beta = R42.lookahead * (group_lr / LR0)
            p = {n: p[n] + beta * buf[n] for n in p}
        points.append({n: x.copy() for n, x in p.items()})
        grad = {n: CURV[n] * p[n] + noise[n][step] for n in p}
        group_lr = LR0 * ratio(step, run.schedule_steps)       # set_hparams(step)
        mom = {n: MOM * mom[n] + grad[n] for n in p}
        p = {n: p[n] - group_lr * mom[n] for n in p}
        # accum_lookahead: buf.lerp_(p - prev, 1 - lookahead_ema); prev = p.
        buf = {n: buf[n] + (1 - R42.lookahead_ema) * ((p[n] - prev[n]) - buf[n]) for n in p}
        prev = {n: x.copy() for n, x in p.items()}
        if step + 1 == run.capture and ref_state is None:     # maybe_capture_ref_extrap_state
            ref_state = {n: x.copy() for n, x in p.items()}
    return evaluated, points


def ours(run: Run, p, noise, *, readout="inside"):
    """The readout in `ema_nesterov`'s inner chain ("inside"), around it ("outside") or
    absent (None), in float64; the weights `eval_params` gives and the params, at each
    step 0..steps."""
    with in_float64():
        lr = lambda t: LR0 * ratio(t, run.schedule_steps, jnp)
        ref = reference_interpolation(run.capture, run.start, run.gamma)
        inner = optax.sgd(lr, momentum=MOM)
        if readout == "inside":
            inner = optax.chain(inner, ref)
        tx = ema_nesterov(inner, R42.lookahead, R42.lookahead_ema, prefill=run.prefill,
                          stop=run.stop, lr_ratio=lambda t: ratio(jnp.maximum(t - 1, 0),
                                                                  run.schedule_steps, jnp))
        if readout == "outside":
            tx = optax.chain(tx, ref)
        params = {n: jnp.asarray(x, jnp.float64) for n, x in p.items()}
        xs = {n: jnp.asarray(x, jnp.float64) for n, x in noise.items()}

        def step(carry, noise_t):
            params, state = carry
            grads = {n: jnp.asarray(CURV[n]) * params[n] + noise_t[n] for n in params}
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            return (params, state), (eval_params(params, state), params)

        xs = {n: x[:run.steps] for n, x in xs.items()}
        _, (evaluated, trained) = jax.lax.scan(step, (params, tx.init(params)), xs)
        first = {n: np.asarray(x) for n, x in params.items()}

        def stack(tree):
            tree = {n: np.asarray(x) for n, x in tree.items()}
            return [first] + [{n: x[i] for n, x in tree.items()} for i in range(run.steps)]

        return stack(evaluated), stack(trained)


def worst(a, b):
    return max(float(np.max(np.abs(x[n] - y[n]))) for x, y in zip(a, b, strict=True)
               for n in SHAPES)


TOL = 1e-12  # float64 against float64: both sides are the same few additions per step


def test_matches_record_over_its_schedule():
    """Every step of #42's 2860: the weights evaluated are the log's (the interpolation
    from step 2850, the reference from 2375), and the params are the points the log
    takes its gradients at (its training weights, the readout subtracted again)."""
    run, p0, noise = Run(), init_params(), noises(R42.claim)
    evaluated, points = record(run, p0, noise)
    got, params = ours(run, p0, noise)
    assert worst(got, evaluated) < TOL
    assert worst(params[:-1], points) < TOL
    # After the lookahead and before the readout's step the params are evaluated as
    # they are; from that step on the readout is not the params.
    assert worst(got[run.stop:run.start], params[run.stop:run.start]) == 0.0
    effect = worst(got[run.start:], params[run.start:])
    assert effect > 1e-3, effect
    # Controls: the capture, the readout's start and gamma moved must fail.
    for control in (dict(capture=run.capture + 1), dict(capture=run.capture - 25),
                    dict(start=run.start - 1), dict(gamma=run.gamma * 1.05)):
        moved, _ = ours(dataclasses.replace(run, **control), p0, noise)
        assert worst(moved, evaluated) > 1e6 * TOL, control


def test_training_weights_unchanged():
    """The readout is a pass-through: the params (what training steps from) are bitwise
    those of the same optimizer without it; only `eval_params` sees the reference."""
    run, p0, noise = Run(steps=60, schedule_steps=70, prefill=5, stop=30, capture=20,
                         start=40), init_params(), noises(60)
    got, params = ours(run, p0, noise)
    _, plain = ours(run, p0, noise, readout=None)
    for a, b in zip(params, plain, strict=True):
        m.assert_trees_equal(a, b)
    assert worst(got[run.start:], params[run.start:]) > 1e-3


def test_inside_ema_nesterov_reads_the_evaluated_weights():
    """A capture inside the lookahead window: the record copies the weights without the
    lookahead (after `EMA_Nesterov.step`); so does the readout inside `ema_nesterov`'s
    inner chain. Around `ema_nesterov` it copies the lookahead point: a control that
    must fail here (at #42's steps the two agree, the lookahead ending at 1950). Gamma
    -1 (evaluate the reference itself) shows the lookahead in the copy whole."""
    run, p0, noise = Run(steps=60, schedule_steps=70, prefill=5, stop=30, capture=28,
                         start=40, gamma=-1.0), init_params(), noises(60)
    evaluated, _ = record(run, p0, noise)
    got, _ = ours(run, p0, noise)
    assert worst(got, evaluated) < TOL
    outside, _ = ours(run, p0, noise, readout="outside")
    assert worst(outside, evaluated) > 1e6 * TOL
    # At the record's steps the placement does not matter (capture after the lookahead).
    run, noise = Run(), noises(R42.claim)
    assert worst(ours(run, p0, noise, readout="outside")[0], record(run, p0, noise)[0]) < TOL


def test_eval_params_order_and_masks():
    """Readouts are applied in the state's order (a tail EMA before the interpolation
    blends first); a mask leaves the other leaves as they are; bfloat16 params come back
    bfloat16 (the readout computed in float32)."""
    params = {"embed": jnp.ones((3, 2)), "w": jnp.linspace(0.0, 1.0, 6).reshape(3, 2)}
    mask = {"embed": False, "w": True}
    tx = optax.chain(optax.sgd(0.5), tail_ema(1, 2.0, 0.5),
                     reference_interpolation(1, 2, -0.25, mask=mask))
    state = tx.init(params)
    w = params
    for t in range(3):
        updates, state = tx.update({k: jnp.full_like(v, 1.0 + t) for k, v in w.items()},
                                   state, w)
        w = optax.apply_updates(w, updates)
    ema, ref = state[1].ema, state[2].reference
    blended = {k: 0.5 * w[k] + 0.5 * ema[k] for k in w}
    expect = dict(blended, w=blended["w"] - 0.25 * (blended["w"] - ref["w"]))
    got = eval_params(w, state)
    for k in w:
        np.testing.assert_allclose(got[k], expect[k], rtol=1e-6)
    assert isinstance(state[2].reference["embed"], optax.MaskedNode)
    bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), w)
    assert eval_params(bf, state)["w"].dtype == jnp.bfloat16


def test_bad_input():
    with pytest.raises(ValueError, match="capture"):
        reference_interpolation(0, 5)
    with pytest.raises(ValueError, match="start"):
        reference_interpolation(5, 4)
    with pytest.raises(ValueError, match="gamma"):
        reference_interpolation(1, 2, gamma=float("nan"))
    with pytest.raises(ValueError, match="gamma"):
        reference_interpolation(1, 2, gamma=lambda t: 0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx = reference_interpolation(1, 2)
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


MATRIX_PARAMS = {"a": jnp.ones((8, 4)), "b": jnp.linspace(-1.0, 1.0, 6)}


def test_optax_matrix(tmp_path):
    tx = optax.chain(optax.adam(1e-2), reference_interpolation(1, 2, -0.5))
    f64 = dict(float64=tx, float32_state=True)
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=4, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=3)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=3)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_partition(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_nnx_optimizer(tx, steps=5)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=3, steps_after=3)
    m.check_inject_hyperparams(lambda gamma: reference_interpolation(1, 2, gamma),
                               MATRIX_PARAMS, dict(gamma=-0.5), steps=4, float64=True,
                               float32_state=True)
