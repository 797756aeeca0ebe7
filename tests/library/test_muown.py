"""`muown` through the optax matrix (tests/optax_matrix.py) and its properties; the
step-by-step float64 check against Track 3 #23's own code is `test_recipes_track3_muown.py`
(it also runs the transform inside `optax.partition`: the recipe's groups)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import MuownState, muown, scale_by_muon
from references.error import run_in_float64

F32, F64 = jnp.float32, jnp.float64
PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": 0.3 * jax.random.normal(jax.random.key(7), (2, 4, 6))}


def make(ns_dtype=F32, lr=None, **kw):
    lr = optax.linear_schedule(0.01, 0.002, 6) if lr is None else lr
    return muown(scale_by_muon(0.9, shape_scale="consistent_rms", ns_dtype=ns_dtype), lr,
                 radius_steps=6, radius_target=2.0, **kw)


def test_optax_matrix(tmp_path):
    tx, f64 = make(), dict(float64=make(F64))  # state follows the params' dtype
    m.check_jit_matches_eager(tx, PARAMS, steps=3, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=2)
    m.check_multisteps(tx, PARAMS, steps=2, **f64)
    m.check_partition(tx, PARAMS, steps=2, **f64)
    m.check_sharded_state(tx, PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=2)
    m.check_inject_hyperparams(
        lambda learning_rate, gain_b1: make(lr=learning_rate, gain_b1=gain_b1), PARAMS,
        dict(learning_rate=0.01, gain_b1=0.85), float64=lambda **kw: make(
            F64, lr=kw["learning_rate"], gain_b1=kw["gain_b1"]))


def _one_update(w, g, **kw):
    def update(w, g):
        tx = make(F64, **kw)
        state = tx.init({"w": w})
        u, state = tx.update({"w": g}, state, {"w": w})
        return u["w"], state
    return run_in_float64(update, w, g)


def test_rows_are_gains_times_unit_directions():
    """After an update each output neuron's row (its line along fan_out, norm over
    fan_in) has the norm of its gain; a zero row at init takes ``zero_row_gain``."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5))
    w[:, 2] = 0.0  # output neuron 2 is a zero row
    u, state = _one_update(w, rng.standard_normal((6, 5)), lr=0.05)
    assert isinstance(state, MuownState)
    new = w + u
    np.testing.assert_allclose(state.gain["w"][0, 2], 0.33**0.5, rtol=1e-15)
    np.testing.assert_allclose(np.linalg.norm(new, axis=0), np.abs(state.gain["w"][0]),
                               rtol=1e-12)


def test_a_gradient_along_the_rows_moves_only_the_gains():
    """``G_i = c_i W_i``: the tangent gradient is 0, so the directions stay; each gain
    takes Adam's first step, ``g - lr·sign(c_i)`` (to Adam's eps)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 5))
    c = np.array([1.0, -2.0, 0.5, -0.1, 3.0])
    u, _ = _one_update(w, w * c, lr=0.05)
    new = w + u
    r = np.linalg.norm(w, axis=0)
    np.testing.assert_allclose(np.linalg.norm(new, axis=0), r - 0.05 * np.sign(c), rtol=1e-7)
    np.testing.assert_allclose(new / np.linalg.norm(new, axis=0), w / r, atol=1e-12)


def test_the_radius_target_is_per_path_and_slows_the_directions():
    """A larger radius ``R`` (reached at the schedule's end) makes the same direction step
    a smaller rotation: measured as the rows' angle moved after the schedule."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 5)) / 3
    grads = [rng.standard_normal((6, 5)) for _ in range(8)]

    def angle(target):
        def run(w, grads):
            tx = muown(scale_by_muon(0.9, shape_scale="consistent_rms", ns_dtype=F64), 0.02,
                       radius_steps=4, radius_target=target)
            params, state = {"w": w}, tx.init({"w": w})
            for g in grads:
                before = params["w"]
                u, state = tx.update({"w": g}, state, params)
                params = optax.apply_updates(params, u)
            return before, params["w"]
        a, b = run_in_float64(run, w, grads)
        cos = np.sum(a * b, axis=0) / (np.linalg.norm(a, axis=0) * np.linalg.norm(b, axis=0))
        return np.arccos(np.clip(cos, -1, 1))

    small, large = angle(1.0), angle(lambda path: 4.0 if path == "w" else 1.0)
    np.testing.assert_allclose(large, small / 4, rtol=0.1)


@pytest.mark.parametrize("kw,message", [
    (dict(learning_rate=-1.0), "learning_rate"), (dict(gain_b1=1.0), "gain_b1"),
    (dict(gain_eps=0.0), "gain_eps"), (dict(radius_steps=0), "radius_steps"),
    (dict(radius_target=-1.0), "radius_target"), (dict(radius_power=0.0), "radius_power"),
    (dict(direction=lambda g: g), "direction"),
    (dict(matrix_axes=(1, 1)), "matrix_axes")])
def test_refuses_bad_settings(kw, message):
    args = dict(direction=scale_by_muon(), learning_rate=0.01) | kw
    with pytest.raises(ValueError, match=message):
        muown(**args)


def test_refuses_vectors_and_a_missing_params():
    tx = make()
    with pytest.raises(ValueError, match=r"shape \(4,\).*matrices"):
        tx.init({"b": jnp.ones(4)})
    with pytest.raises(ValueError, match="needs params"):
        tx.update(PARAMS, tx.init(PARAMS))


@pytest.mark.parametrize("power", [None, 0.9])
def test_the_radius_schedule(power):
    """The radius at update t is ``r = r₀ + (R - r₀) s(clip((t-1)/(T-1), 0, 1))``, ``s``
    the smoothstep or ``p^q``, read back from the rows' rotations: with the identity as
    direction and a unit gradient tangent to every row (its gain's gradient 0), a row
    turns by ``atan(η g/r²)`` (``G_v = (g/r) G``, ``v = r u``)."""
    r0 = np.array([0.5, 1.0, 1.5, 2.0, 2.5])
    w = np.eye(6, 5) * r0  # output neuron j: r0_j e_j over the 6 inputs
    T, R, lr = 5, 3.0, 0.01

    def run(w):
        tx = muown(optax.identity(), lr, radius_target=R, radius_steps=T, radius_power=power)
        params, state, angles = {"w": w}, tx.init({"w": w}), []
        for _ in range(T + 2):
            u = params["w"] / jnp.linalg.norm(params["w"], axis=0)
            e5 = jnp.zeros(6).at[5].set(1.0)[:, None]
            tangent = e5 - u * jnp.sum(e5 * u, axis=0)
            g = tangent / jnp.linalg.norm(tangent, axis=0)
            upd, state = tx.update({"w": g}, state, params)
            new = params["w"] + upd["w"]
            cos = jnp.sum(new * params["w"], axis=0) / (
                jnp.linalg.norm(new, axis=0) * jnp.linalg.norm(params["w"], axis=0))
            angles.append(jnp.arccos(jnp.clip(cos, -1.0, 1.0)))
            params = {"w": new}
        return jnp.stack(angles)

    angles = run_in_float64(run, w)
    for t, a in enumerate(angles):
        p = min(max(t - 1, 0) / (T - 1), 1.0)
        r = r0 + (R - r0) * (p * p * (3 - 2 * p) if power is None else p**power)
        np.testing.assert_allclose(np.tan(a), lr * r0 / r**2, rtol=1e-9, err_msg=f"t={t}")
