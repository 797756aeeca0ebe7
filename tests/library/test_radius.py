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
from references.radius import (
    ref_muon_step,
    ref_row_floor,
    ref_scalar_floor,
    ref_scale_invariant_update,
    ref_scale_radial_update,
)

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


# ---- the brake and the floor alone, on directions built to take each branch -----------

EPS32 = float(np.finfo(np.float32).eps)


def direction_only(tx, o, w):
    """The direction O' the transform steps along: with lr = 1, no pin and no decay its
    update is -O' (W' = W - O')."""
    updates, _ = tx.update(o, tx.init(w), w)
    return {n: -np.asarray(u, np.float64) for n, u in updates.items()}


def assert_rounding_close(ours, expected, w, n_terms, msg):
    """Elementwise within the float32 rounding of computing (W - O') - W with O' from norms
    of `n_terms` squares: (n_terms + 8) ulps of |W| + |O'|."""
    bound = (n_terms + 8) * EPS32 * (np.abs(w) + np.abs(expected))
    err = np.abs(ours - expected)
    assert np.all(err <= bound), f"{msg}: worst error {np.max(err - bound):.3g} over the bound"


def with_radial(w, tangent, a):
    """O = T_⊥ + a·W: T's component along W (Frobenius) removed, then a radial part a·W."""
    t_perp = tangent - np.sum(tangent * w) / np.sum(w * w) * w
    return t_perp + a * w, t_perp


def test_brake_scales_only_the_outward_radial_part():
    """#29's scale_radial_update with s = 0.25: a matrix stepping outward (⟨O,W⟩ < 0, the
    step is -lr·O) keeps its tangential part and s times its radial part; one stepping
    inward is unchanged; ‖W‖² is clamped at 1e-12 (a matrix of norm 1e-7 here)."""
    rng = np.random.default_rng(0)
    s = 0.25
    w_e = rng.normal(size=(3, 5, 4))  # (E, in, out): three matrices, three branches
    built = [with_radial(w_e[e], rng.normal(size=(5, 4)), a)
             for e, a in enumerate((-0.8, 0.6, -0.3))]
    o_e = np.stack([o for o, _ in built])
    w_tiny = rng.normal(size=(6, 3))
    w_tiny *= 1e-7 / np.linalg.norm(w_tiny)  # ‖W‖² = 1e-14 < 1e-12: the clamp binds
    o_tiny, _ = with_radial(w_tiny, rng.normal(size=(6, 3)), -1.0 / 1e-7)  # ⟨O,W⟩ = -1e-7
    w = {"experts": jnp.asarray(w_e, jnp.float32), "tiny": jnp.asarray(w_tiny, jnp.float32)}
    o = {"experts": jnp.asarray(o_e, jnp.float32), "tiny": jnp.asarray(o_tiny, jnp.float32)}
    ours = direction_only(radius_steps(1.0, brake=s, floor=None, pin=None,
                                       cautious_weight_decay=0.0), o, w)
    # The float64 reference (record layout) on the float32 inputs the transform saw.
    expected = {n: from_record([ref_scale_radial_update(u, p, outward=s)
                                for u, p in zip(to_record(o[n]), to_record(w[n]), strict=True)],
                               w[n].shape) for n in w}
    for n in w:
        assert_rounding_close(ours[n], expected[n], np.asarray(w[n], np.float64), 20, n)
    # From the construction: T_⊥ + s·a·W outward, T_⊥ + a·W inward (the float32 rounding of
    # the inputs is inside the bound), and the tiny one's coefficient ⟨O,W⟩/1e-12.
    want = np.stack([t_perp + (s * a if a < 0 else a) * w_e[e]
                     for e, (a, (_, t_perp)) in enumerate(zip((-0.8, 0.6, -0.3), built,
                                                              strict=True))])
    assert_rounding_close(ours["experts"], want, w_e, 20, "experts, from the construction")
    assert np.sum(w_tiny * w_tiny) < 1e-12
    w64, o64 = (np.asarray(x["tiny"], np.float64) for x in (w, o))
    c_clamped = np.sum(o64 * w64) / 1e-12
    assert_rounding_close(ours["tiny"], o64 + (s - 1.0) * c_clamped * w64, w64, 20,
                          "tiny, from the construction")


def column_floor_case(rng):
    """A (in=5, out=4) kernel whose output neurons (columns) take each branch of RowFloor:
    ‖O_j‖/‖W_j‖ = 0.1 (binds), 0.75 (free: kept as it is), ‖O_j‖ = 1e-10 (counts as 1e-8:
    binds by t·0.5/1e-8), W_j = 0 with ‖O_j‖ = 1e-9 (both count as 1e-8: free, as a neuron
    without weights should be; a clamp of ‖W_j‖² at 1e-8 would scale it by 3825). The
    matrix as a whole is free, ‖O‖/‖W‖ = 0.66 > 0.3825: a per-matrix floor would keep O."""
    unit = lambda v: v / np.linalg.norm(v)
    w = np.stack([unit(rng.normal(size=5)) * r for r in (1.0, 2.0, 0.5, 0.0)], axis=1)
    o = np.stack([unit(rng.normal(size=5)) * r for r in (0.1, 1.5, 1e-10, 1e-9)], axis=1)
    return w, o


def test_floor_per_output_neuron():
    """#46's RowFloor, O_j ← O_j·max(1, t‖W_j‖/‖O_j‖) per output neuron j (a fan-out column
    of the (in, out) kernel), norms clamped at 1e-8: raises the binding neurons only."""
    rng = np.random.default_rng(1)
    t = 0.3825
    w2, o2 = column_floor_case(rng)
    w3, o3 = column_floor_case(rng)
    # A stack: expert 1 has expert 0's neurons in the reverse order (per expert, per neuron).
    w = {"kernel": w2, "experts": np.stack([w3, w3[:, ::-1]]),
         "wide": rng.normal(size=(3, 7))}  # 7 neurons of 3 inputs: not per input row
    o = {"kernel": o2, "experts": np.stack([o3, o3[:, ::-1]]),
         "wide": 0.2 * rng.normal(size=(3, 7))}
    w = {n: jnp.asarray(x, jnp.float32) for n, x in w.items()}
    o = {n: jnp.asarray(x, jnp.float32) for n, x in o.items()}
    ours = direction_only(radius_steps(1.0, brake=None, floor=t, floor_per="fan_out", pin=None,
                                       cautious_weight_decay=0.0), o, w)
    stats = {"bind": 0, "free": 0}
    expected = {n: from_record([ref_row_floor(u, p, t, stats)
                                for u, p in zip(to_record(o[n]), to_record(w[n]), strict=True)],
                               w[n].shape) for n in w}
    for n in w:
        assert_rounding_close(ours[n], expected[n], np.asarray(w[n], np.float64), 5, n)
    assert stats["bind"] > 3 and stats["free"] > 3, stats  # "wide" takes both at random
    # From the construction: neuron 0 raised to t·‖W_0‖, neuron 1 kept (not shrunk to the
    # floor), neuron 2 scaled by t·0.5/1e-8, neuron 3 (W_3 = 0) kept.
    o_in, w_in = (np.asarray(x["kernel"], np.float64) for x in (o, w))
    unit = o_in / np.linalg.norm(o_in, axis=0)
    want = np.stack([t * 1.0 * unit[:, 0], o_in[:, 1], o_in[:, 2] * t * 0.5 / 1e-8,
                     o_in[:, 3]], axis=1)
    assert_rounding_close(ours["kernel"], want, w_in, 5, "kernel, from the construction")


def test_floor_per_matrix():
    """#9's scalar floor, O ← O·t‖W‖/‖O‖ where ‖O‖ < t‖W‖, per matrix of a stack (norms
    clamped at 1e-8): one matrix binds, one is free and kept as it is, one has ‖O‖ = 1e-10
    (counts as 1e-8), one W = 0 with ‖O‖ = 1e-9 (both count as 1e-8: free)."""
    rng = np.random.default_rng(2)
    t = 0.3825
    w = rng.normal(size=(4, 5, 4))
    o = rng.normal(size=(4, 5, 4))
    for e, ratio in enumerate((0.1, 0.9, 1e-10)):
        o[e] *= ratio * np.linalg.norm(w[e]) / np.linalg.norm(o[e])
    w[3], o[3] = 0.0, o[3] * 1e-9 / np.linalg.norm(o[3])
    w, o = ({"experts": jnp.asarray(x, jnp.float32)} for x in (w, o))
    ours = direction_only(radius_steps(1.0, brake=None, floor=t, floor_per="matrix", pin=None,
                                       cautious_weight_decay=0.0), o, w)["experts"]
    stats = {"bind": 0, "free": 0}
    expected = from_record([ref_scalar_floor(u, p, t, stats) for u, p in
                            zip(to_record(o["experts"]), to_record(w["experts"]), strict=True)],
                           w["experts"].shape)
    assert_rounding_close(ours, expected, np.asarray(w["experts"], np.float64), 20, "experts")
    assert stats == {"bind": 2, "free": 2}
    w64, o64 = (np.asarray(x["experts"], np.float64) for x in (w, o))
    norm = lambda x: np.linalg.norm(x)
    want = np.stack([o64[0] * t * norm(w64[0]) / norm(o64[0]), o64[1],  # raised; not shrunk
                     o64[2] * t * norm(w64[2]) / 1e-8, o64[3]])  # clamped norms
    assert_rounding_close(ours, want, w64, 20, "experts, from the construction")


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
    # A purely tangential direction keeps the radius under the first-order pin.
    wf = w["w"]
    tangential = o["w"] - jnp.sum(o["w"] * wf) / jnp.sum(wf * wf) * wf
    tx = radius_steps(0.3, brake=None, floor=None, cautious_weight_decay=0.0)
    new = wf + tx.update({"w": tangential}, tx.init(w), w)[0]["w"]
    assert float(jnp.linalg.norm(new)) == pytest.approx(float(jnp.linalg.norm(wf)), rel=1e-6)
    # A zero learning rate leaves W unchanged.
    assert float(jnp.max(jnp.abs(step(radius_steps(0.0))))) < 1e-6
