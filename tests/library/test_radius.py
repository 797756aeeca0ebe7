"""radius_steps against float64 numpy references written from the records' code.

The references (`references.radius`) follow modded-nanogpt Track 3's logs in PyTorch's
(out, in) layout: #29 `scale_radial_update`, `target_radius_after_update`,
`rescale_to_radius`; #9/#46 the scalar u/w floor and the `ROWFLOOR` branch of `Muon.step`;
#46 `CWD_POST`; #5 `scale_invariant_update_` (MuonH). Our kernels are (in, out): each is
transposed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo import radius_steps
from references.error import assert_as_accurate, run_in_float64
from references.radius import ref_muon_step, ref_scale_invariant_update

SHAPES = {"tall": (8, 4), "wide": (4, 8), "square": (6, 6), "experts": (3, 4, 5)}
STEPS = 25


def lr_schedule(t):
    return 0.05 * (1.0 - t / 40.0)


# ---- the float64 references (references/radius.py) take the record layout (out, in) -


def to_record(x):  # (..., in, out) -> list of (out, in) float64 matrices
    x = np.asarray(x, np.float64)
    return [np.swapaxes(x, -1, -2)] if x.ndim == 2 else [b.T for b in x]


def from_record(mats, shape):
    out = np.stack([mm.T for mm in mats]) if len(shape) == 3 else mats[0].T
    return out.reshape(shape)


def init_params(scale=0.5):
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    return {n: scale * jax.random.normal(k, s, jnp.float32)
            for (n, s), k in zip(SHAPES.items(), keys, strict=True)}


def directions(t):
    """Muon-like directions whose size varies over steps, so floors both bind and not."""
    keys = jax.random.split(jax.random.key(100 + t), 2 * len(SHAPES))
    out = {}
    for i, (n, s) in enumerate(SHAPES.items()):
        size = 10.0 ** jax.random.uniform(keys[2 * i], (), minval=-1.5, maxval=0.5)
        out[n] = size * jax.random.normal(keys[2 * i + 1], s, jnp.float32)
    return out


CONFIGS = {
    "record46": dict(brake=0.5, floor=0.3825, floor_per="fan_out", pin="first_order",
                     cwd=0.025),
    "record29": dict(brake=0.5, floor=0.3825, floor_per="matrix", pin="first_order", cwd=0.0),
    "no_pin_cwd": dict(brake=None, floor=0.35, floor_per="matrix", pin=None, cwd=0.4),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_record_reference(name):
    c = CONFIGS[name]
    tx = radius_steps(lr_schedule, brake=c["brake"], floor=c["floor"],
                      floor_per=c["floor_per"], pin=c["pin"],
                      cautious_weight_decay=c["cwd"])
    params = init_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref = {n: to_record(p) for n, p in params.items()}
    stats = {"outward": 0, "inward": 0, "bind": 0, "free": 0}
    for t in range(STEPS):
        o = directions(t)
        updates, state = update(o, state, params)
        params = optax.apply_updates(params, updates)
        lr = lr_schedule(t)
        for n, shape in SHAPES.items():
            ref[n] = [ref_muon_step(p, u, lr, brake=c["brake"], floor=c["floor"],
                                    floor_per=c["floor_per"], pin=c["pin"], cwd=c["cwd"],
                                    stats=stats)
                      for p, u in zip(ref[n], to_record(o[n]), strict=True)]
            np.testing.assert_allclose(np.asarray(params[n], np.float64),
                                       from_record(ref[n], shape), rtol=2e-5, atol=2e-6,
                                       err_msg=f"{name} {n} step {t}")
    # Every branch was taken: brake outward and inward, floor binding and free.
    if c["brake"] is not None:
        assert stats["outward"] > 10 and stats["inward"] > 10, stats
    assert stats["bind"] > 10 and stats["free"] > 10, stats


def test_hyperball_matches_muonh_and_keeps_the_initial_radius():
    tx = radius_steps(lr_schedule, brake=None, floor=None, pin="initial",
                      cautious_weight_decay=0.0)
    params = init_params()
    radius0 = {n: np.linalg.norm(to_record(p), axis=(-2, -1)) for n, p in params.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref = {n: to_record(p) for n, p in params.items()}
    worst = 0.0
    for t in range(200):
        o = directions(t)
        updates, state = update(o, state, params)
        params = optax.apply_updates(params, updates)
        for n, shape in SHAPES.items():
            norms = np.linalg.norm(to_record(params[n]), axis=(-2, -1))
            worst = max(worst, float(np.max(np.abs(norms / radius0[n] - 1.0))))
            if t < STEPS:
                ref[n] = [ref_scale_invariant_update(p, u, lr_schedule(t))
                          for p, u in zip(ref[n], to_record(o[n]), strict=True)]
                np.testing.assert_allclose(np.asarray(params[n], np.float64),
                                           from_record(ref[n], shape), rtol=2e-5, atol=2e-6,
                                           err_msg=f"{n} step {t}")
    assert worst < 2e-6, worst  # float32 rounding, no drift over 200 steps
    # The weights did move: the step is relative (lr·‖W‖), not a no-op on the sphere.
    assert not np.allclose(np.asarray(params["square"]), np.asarray(init_params()["square"]))


def test_hyperball_at_the_current_radius():
    """pin="current" (#5's scale_invariant_update_ as written: R = ‖W‖ now) equals the
    record's step when something else moved ‖W‖ between steps (MuLoCo's outer step, #13),
    where pin="initial" pulls the matrix back to ‖W₀‖."""
    current = radius_steps(lr_schedule, brake=None, floor=None, pin="current",
                           cautious_weight_decay=0.0)
    initial = radius_steps(lr_schedule, brake=None, floor=None, pin="initial",
                           cautious_weight_decay=0.0)
    params = init_params()
    states = current.init(params), initial.init(params)
    ref = {n: to_record(p) for n, p in params.items()}
    for t in range(4):
        params = jax.tree.map(lambda p: 1.3 * p, params)  # an outer step moves the radius
        ref = {n: [1.3 * p for p in mats] for n, mats in ref.items()}
        o = directions(t)
        (u_cur, s_cur), (u_init, s_init) = (tx.update(o, s, params) for tx, s in
                                            zip((current, initial), states, strict=True))
        states = s_cur, s_init
        ref = {n: [ref_scale_invariant_update(p, u, lr_schedule(t))
                   for p, u in zip(ref[n], to_record(o[n]), strict=True)] for n in SHAPES}
        moved = optax.apply_updates(params, u_init)
        params = optax.apply_updates(params, u_cur)
        for n, shape in SHAPES.items():
            np.testing.assert_allclose(np.asarray(params[n], np.float64),
                                       from_record(ref[n], shape), rtol=2e-5, atol=2e-6,
                                       err_msg=f"{n} step {t}")
            assert not np.allclose(np.asarray(moved[n]), np.asarray(params[n]), rtol=1e-3)


def test_matrix_axes():
    """(E, out, in) stacks via matrix_axes: the same step as the (E, in, out) layout."""
    w = 0.5 * jax.random.normal(jax.random.key(3), (3, 5, 4))  # (E, fan_out, fan_in)
    o = jax.random.normal(jax.random.key(4), (3, 5, 4))
    swap = lambda x: jnp.swapaxes(x, 1, 2)

    def new_weights(w, o):  # (E, out, in) via matrix_axes, and the default layout
        ours, default = radius_steps(0.1, matrix_axes=(2, 1)), radius_steps(0.1)
        u1, _ = ours.update({"w": o}, ours.init({"w": w}), {"w": w})
        u2, _ = default.update({"w": swap(o)}, default.init({"w": swap(w)}), {"w": swap(w)})
        return w + u1["w"], swap(swap(w) + u2["w"])

    # The norms reduce over other axes, so the layouts round differently: as accurate as
    # the default layout against its float64 computation.
    ours, default = new_weights(w, o)
    assert_as_accurate(ours, default, run_in_float64(new_weights, w, o)[1])


def test_bad_input():
    with pytest.raises(ValueError, match="floor_per"):
        radius_steps(0.1, floor_per="row")
    with pytest.raises(ValueError, match="pin"):
        radius_steps(0.1, pin="fixed")
    with pytest.raises(ValueError, match="floor=0.3825 has no effect"):
        radius_steps(0.1, pin="initial")
    with pytest.raises(ValueError, match="brake"):
        radius_steps(0.1, brake=-1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        radius_steps(-0.1)
    with pytest.raises(ValueError, match="matrix_axes"):
        radius_steps(0.1, matrix_axes=(0, 0))
    tx = radius_steps(0.1)
    with pytest.raises(ValueError, match="1-D parameters"):
        tx.init({"b": jnp.zeros(3)})
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.ones((2, 2))}, tx.init({"w": jnp.ones((2, 2))}))


MATRIX_PARAMS = {"a": 0.5 * jnp.ones((8, 4)) + 0.1 * jnp.eye(8, 4),
                 "b": 0.3 * jax.random.normal(jax.random.key(7), (2, 4, 6))}


def test_optax_matrix(tmp_path):
    tx = radius_steps(optax.linear_schedule(0.05, 0.01, 10), cautious_weight_decay=0.1)
    f64 = dict(float64=tx, float32_state=True)  # (its statistics stay float32: issue 34.3)
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=4, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=3)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=3)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_partition(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=2, steps_after=2)
    ball = radius_steps(0.05, brake=None, floor=None, pin="initial", cautious_weight_decay=0.0)
    m.check_orbax_roundtrip(ball, MATRIX_PARAMS, tmp_path / "ball", steps_before=2,
                            steps_after=2)


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(
        radius_steps, MATRIX_PARAMS,
        dict(learning_rate=0.05, brake=0.5, floor=0.3825, cautious_weight_decay=0.025))
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.05)
    labels = lambda params: jax.tree.map(lambda p: "matrix" if p.ndim == 2 else "vector", params)
    tx = optax.partition({"matrix": optax.chain(optax_snoo.scale_by_muon(),
                                                radius_steps(0.02)),
                          "vector": optax.adam(1e-2)}, labels)
    m.check_nnx_optimizer(tx, steps=5)


def test_properties():
    w = {"w": 0.5 * jax.random.normal(jax.random.key(5), (6, 4))}
    o = {"w": jax.random.normal(jax.random.key(6), (6, 4))}

    def step(tx):
        return tx.update(o, tx.init(w), w)[0]["w"]

    # Without brake, floor, pin or decay it is SGD's step -lr·O.
    plain = step(radius_steps(0.1, brake=None, floor=None, pin=None, cautious_weight_decay=0.0))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(-0.1 * o["w"]), rtol=1e-6,
                               atol=1e-6)
    # brake=1.0 is no brake.
    m.assert_trees_close(step(radius_steps(0.1, brake=1.0)), step(radius_steps(0.1, brake=None)),
                         1e-6, 1e-7)
    # A purely tangential direction keeps the radius under the first-order pin.
    wf = w["w"]
    tangential = o["w"] - jnp.sum(o["w"] * wf) / jnp.sum(wf * wf) * wf
    tx = radius_steps(0.3, brake=None, floor=None, cautious_weight_decay=0.0)
    new = wf + tx.update({"w": tangential}, tx.init(w), w)[0]["w"]
    assert float(jnp.linalg.norm(new)) == pytest.approx(float(jnp.linalg.norm(wf)), rel=1e-6)
    # The floor only ever enlarges the step; a zero learning rate leaves W unchanged.
    floored = step(radius_steps(0.1, brake=None, pin=None, cautious_weight_decay=0.0))
    assert float(jnp.linalg.norm(floored)) >= float(jnp.linalg.norm(plain)) * (1 - 1e-6)
    assert float(jnp.max(jnp.abs(step(radius_steps(0.0))))) < 1e-6
