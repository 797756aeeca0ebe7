"""A float64 run is float64 throughout: every optimizer statistic takes its dtype from the
params (float32 for bf16/f16/f32 params, float64 for float64 ones), and the Track 3
recipes run in float64 agree with their records' float64 transcriptions to float64's
rounding (with float32 state they were 1e-6 to 1e-5 off)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
from library.test_recipes_track3_records import (
    PARAMS,
    Record46,
    RecordMuonH,
    gradients,
    init_weights,
)
from optax_snoo import recipes
from references.track3 import flatten, nest
from references.track3_constants import R13

SHAPES = {"w": (6, 4), "stack": (2, 4, 8)}


def muon(**kw):
    return optax_snoo.scale_by_muon(ns_dtype=jnp.float32, **kw)


# name -> a transformation; each keeps float statistics (buffers and scalars) in its state
TRANSFORMS = {
    "muon": lambda: muon(),
    "muon, smoothing": lambda: muon(smoothing=0.2),
    "normuon": lambda: optax_snoo.scale_by_normuon(0.9, ns_dtype=jnp.float32),
    "soap_muon": lambda: optax_snoo.soap_muon(0.02, ns_dtype=jnp.float32),
    "soap per matrix": lambda: muon(precondition=optax_snoo.soap_whitening()),
    "ema_nesterov": lambda: optax_snoo.ema_nesterov(optax.sgd(0.1), prefill=0, stop=10),
    "tail_ema": lambda: optax.chain(optax.sgd(0.1), optax_snoo.tail_ema(start=1)),
    "pull_to_init": lambda: optax.chain(optax.sgd(0.1), optax_snoo.pull_to_init(1.0)),
    "rre_extrapolation": lambda: optax.chain(optax.sgd(0.1), optax_snoo.rre_extrapolation(
        start=1, every=2, history=3)),
    "delta_pulses": lambda: optax.chain(optax.sgd(0.1), optax_snoo.delta_pulses(
        1, 1, -0.1, momentum=0.5)),
    "phase_readout": lambda: optax.chain(optax.sgd(0.1), optax_snoo.phase_readout(1, 2, 3)),
    "radius_steps (hyperball)": lambda: optax.chain(muon(), optax_snoo.radius_steps(
        optax_snoo.power_cool(0.02, t_end=10, c=1e-4), brake=None, floor=None, pin="initial",
        cautious_weight_decay=0.0)),
    "radius_steps (pin)": lambda: optax.chain(muon(), optax_snoo.radius_steps(0.02)),
    "snoo": lambda: optax_snoo.snoo(optax.sgd(0.1), k=2),
    "newton_muon": lambda: optax_snoo.precondition_by_input_covariance(refresh_every=1),
}


def float_dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)}


def run_two_steps(name, dtype):
    tx = TRANSFORMS[name]()
    ramp = lambda shape: 0.5 + jnp.arange(np.prod(shape), dtype=dtype).reshape(shape) / 100
    params = {"l": {"kernel": ramp((6, 4))}, "stack": ramp((2, 4, 8))}
    extra = {}
    if name == "newton_muon":
        params = {"l": params["l"]}
        extra = dict(input_covariance={"l/kernel": jnp.eye(6, dtype=dtype)})
    state = tx.init(params)
    seen = [float_dtypes(state)]
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.sin(p * 7), params)
        updates, state = tx.update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
        seen.append(float_dtypes(state))
        assert float_dtypes(updates) == {str(jnp.dtype(dtype))}  # updates in the param dtype
    return seen


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_float64_params_keep_float64_state(name):
    with jax.enable_x64(True):
        seen = run_two_steps(name, jnp.float64)
    assert all(s == {"float64"} for s in seen), seen  # at init and after each update


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_and_f32_params_keep_float32_state(name, dtype):
    """The library's default: statistics in float32, also for bf16 params, also under x64."""
    for x64 in (False, True):
        with jax.enable_x64(x64):
            seen = run_two_steps(name, jnp.dtype(dtype))
        assert all(s == {"float32"} for s in seen), (x64, seen)


def test_a_given_state_dtype_is_used_as_is():
    with jax.enable_x64(True):
        p = {"w": jnp.ones((4, 6), jnp.float64)}
        assert optax_snoo.scale_by_muon(mu_dtype=jnp.bfloat16).init(p).mu["w"].dtype == \
            jnp.bfloat16
        assert optax_snoo.ema_nesterov(optax.sgd(1.0), buffer_dtype="float32").init(
            p).displacement["w"].dtype == jnp.float32
        assert optax_snoo.snoo(optax.sgd(1.0), slow_dtype="float32").init(
            p).slow["w"].dtype == jnp.float32
    with pytest.raises(ValueError, match="ema_nesterov: buffer_dtype must be a floating"):
        optax_snoo.ema_nesterov(optax.sgd(1.0), buffer_dtype="int32")


def test_schedules_compute_in_float64_under_x64():
    """PowerCool, the momentum schedule and the stable-cooldown schedule: float64 values
    (the exact ones, as Python computes them) under x64, float32 ones without."""
    cool = optax_snoo.power_cool(0.0375, t_end=29, c=3.3169534699576625e-06 * 100 ** 1.2)
    mu = optax_snoo.muon_momentum_schedule(0.85, 0.95, warmup=3, cooldown=2, total=29)
    flat = optax_snoo.stable_cooldown_schedule(0.03, 10, cooldown_frac=1.0)
    exact = {"cool": min(0.0375, 3.3169534699576625e-06 * 100 ** 1.2 * 12 ** 1.2),
             "mu": 0.85 + 0.1 * 1 / 3, "flat": 0.03 * (1 - 3 / 10)}
    # a few epsilons of each dtype
    for x64, dtype, tol in ((True, jnp.float64, 1e-15), (False, jnp.float32, 5e-7)):
        with jax.enable_x64(x64):
            got = {"cool": cool(jnp.int32(17)), "mu": mu(jnp.int32(1)),
                   "flat": flat(jnp.int32(3))}
            for key, value in got.items():
                assert value.dtype == dtype, (key, x64)
                np.testing.assert_allclose(float(value), exact[key], rtol=tol, err_msg=key)


# ---- float64 runs of the Track 3 recipes against their records' float64 transcriptions

# float64 rounding of a few dozen float64 steps: measured <= 6e-14 at weights of order 1
# (2e-6 to 2e-5 with the float32 state this replaced), so 1e-12 (4500 float64 epsilons)
# bounds the program's own rounding and catches any float32 left in it.
F64_TOL = 1e-12


def steps64(tx, ref, steps):
    """`tx` and the record's reference `ref` stepped together on the same gradients, in
    float64: yields ``(t, params, state)`` after both took step `t` (its float64 state
    asserted before the first step and after the last)."""
    grads = gradients(steps)
    params = nest(ref.p, jnp.float64)
    state, update = tx.init(params), jax.jit(tx.update)
    assert float_dtypes(state) == {"float64"}
    for t, g in enumerate(grads):
        u, state = update(nest(g, jnp.float64), state, params)
        params = optax.apply_updates(params, u)
        ref.step(g, t)
        yield t, params, state
    assert float_dtypes(state) == {"float64"}


def assert_close64(ours, ref, msg):
    for k in PARAMS:
        np.testing.assert_allclose(ours[k], ref[k], rtol=F64_TOL, atol=F64_TOL,
                                   err_msg=f"{msg} {k}")


def test_muonh_in_float64_matches_record_5():
    T = 10
    with jax.enable_x64(True):
        ref = RecordMuonH(init_weights(), T)
        tx = recipes.muonh(T, ns_dtype="float64")
        for t, params, _ in steps64(tx, ref, T):
            assert_close64(flatten(params), ref.p, f"step {t}")


def test_muloco_normuonh_in_float64_matches_record_13():
    T, k = 9, 3
    with jax.enable_x64(True):
        ref = RecordMuonH(init_weights(), T, rec=R13, k=k)
        tx = recipes.muloco_normuonh(T, snoo_k=k, ns_dtype="float64")
        for t, params, _ in steps64(tx, ref, T):
            assert_close64(flatten(params), ref.p, f"step {t}")


def test_track3_record_in_float64_matches_record_46():
    """EMA-Nesterov, the tail EMA, SOAP, the radius steps, PowerCool and the momentum
    schedule, all 29 steps of the 1/100 schedule, params and readout."""
    n = 29
    with jax.enable_x64(True):
        ref = Record46(init_weights(), n)
        tx = recipes.track3_record(n, ns_dtype="float64")
        for t, params, state in steps64(tx, ref, n):
            ahead = {k: w + ref.beta(t + 1) * ref.buf[k] for k, w in ref.p.items()}
            assert_close64(flatten(params), ahead, f"params after step {t}")
            assert_close64(flatten(optax_snoo.eval_params(params, state)), ref.readout(),
                           f"readout after step {t}")
        assert ref.ema is not None  # the tail EMA was exercised


def test_qk_clip_scales_float64_logits_in_float64():
    tau = 100 / 3  # not a float32 number: float32 arithmetic would be 1e-8 off
    with jax.enable_x64(True):
        q, k = optax_snoo.qk_clip_scales(jnp.array([50.0, 400.0], jnp.float64), tau, 2)
        assert q.dtype == k.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(q * k), [tau / 50, tau / 400], rtol=1e-15)
