"""Snoo against a float64 numpy implementation (Kallusky et al., modded-nanogpt PR #128),
plus properties and the optax matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo import snoo
from references.error import assert_as_accurate, float64, in_float64
from references.snoo import SHAPES, NumpyAdamW, NumpySGD, numpy_snoo


def init_params():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s) for k, s in SHAPES.items()}


def grad_seq(steps):
    rng = np.random.default_rng(1)
    return [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(steps)]


def run_ours(tx, params, grads, dtype=jnp.float32, **extra):
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    state = tx.init(params)
    update = jax.jit(tx.update, static_argnames=("snoo_sync",))
    history = []
    for g in grads:
        g = jax.tree.map(lambda x: jnp.asarray(x, dtype), g)
        u, state = update(g, state, params, **extra)
        params = optax.apply_updates(params, u)
        history.append(params)
    return history, state


def assert_histories_close(ours, ref, rtol, atol):
    assert len(ours) == len(ref)
    for t, (a, b) in enumerate(zip(ours, ref, strict=True)):
        for key in b:
            np.testing.assert_allclose(np.asarray(a[key], np.float64), b[key], rtol=rtol,
                                       atol=atol, err_msg=f"step {t}, leaf {key}")


# ---------------------------------------------------------------- reference trajectories
@pytest.mark.parametrize("k", [1, 3, 28])
@pytest.mark.parametrize("inner_name", ["sgd", "adamw"])
def test_matches_numpy_reference(k, inner_name):
    steps = 120
    params, grads = init_params(), grad_seq(steps)
    if inner_name == "sgd":
        ours_inner, ref_inner = optax.sgd(0.05), NumpySGD(0.05)
    else:
        ours_inner = optax.adamw(0.01, weight_decay=1e-4)
        ref_inner = NumpyAdamW(0.01, wd=1e-4)
    ours, state = run_ours(snoo(ours_inner, 0.68, 0.37, k), params, grads)
    ref = numpy_snoo(ref_inner, params, grads, 0.68, 0.37, k)
    assert_histories_close(ours, ref, rtol=2e-5, atol=2e-5)
    assert int(state.count) == steps


def test_outer_schedules_see_the_outer_step_count():
    steps, k = 60, 4
    params, grads = init_params(), grad_seq(steps)
    lr = lambda n: 0.9 / (1.0 + n)
    mom = lambda n: 0.1 + 0.05 * jnp.minimum(n, 4)
    ref_mom = lambda n: 0.1 + 0.05 * min(n, 4)
    ours, _ = run_ours(snoo(optax.sgd(0.05), lr, mom, k), params, grads)
    ref = numpy_snoo(NumpySGD(0.05), params, grads, lr, ref_mom, k)
    assert_histories_close(ours, ref, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- properties
def test_first_update_syncs_with_nesterov_scale():
    """t = 0 fires: params move by η(1 + μ)·u after the very first inner step."""
    params = {"w": jnp.ones((3,))}
    grads = {"w": jnp.full((3,), 2.0)}
    tx = snoo(optax.sgd(0.1), 0.68, 0.37, 28)
    u, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(u["w"], 0.68 * 1.37 * (-0.2), rtol=1e-6)
    np.testing.assert_allclose(state.slow["w"], 1 + 0.68 * 1.37 * (-0.2), rtol=1e-6)
    # The second update (t = 1) is the plain inner step.
    u, _ = tx.update(grads, state, optax.apply_updates(params, u))
    np.testing.assert_allclose(u["w"], -0.2, rtol=1e-6)


def test_identity_wrapper():
    """k = 1, η = 1, μ = 0 is exactly the inner optimizer."""
    params, grads = init_params(), grad_seq(30)
    inner = optax.adamw(0.01)
    ours, _ = run_ours(snoo(inner, 1.0, 0.0, 1), params, grads)
    plain, _ = run_ours(inner, params, grads)
    # The inner optimizer in float64 from the float32 inputs: what both programs round
    # (slow + 1·(fast - slow) rounds once more a step than fast).
    params32, grads32 = (jax.tree.map(lambda x: np.asarray(x, np.float32), t)
                         for t in (params, grads))
    with in_float64():
        exact = float64(run_ours(inner, params32, grads32, dtype=jnp.float64)[0])
    for t, (a, b) in enumerate(zip(ours, plain, strict=True)):
        assert_as_accurate(a, b, exact[t], what=f"step {t}")


def test_interpolation():
    """k = 1, μ = 0: each step is p + η·u."""
    params, grads = init_params(), grad_seq(20)
    ours, _ = run_ours(snoo(optax.sgd(0.1), 0.5, 0.0, 1), params, grads)
    p = params
    ref = []
    for g in grads:
        p = {k: p[k] + 0.5 * (-0.1 * g[k]) for k in p}
        ref.append(p)
    assert_histories_close(ours, ref, 1e-5, 1e-6)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_static_sync_hint_gives_the_same_trajectory(k):
    """The trainer's fast path (a sync and a no-sync compiled step) equals the plain path."""
    params, grads = init_params(), grad_seq(4 * k + 2)
    tx = snoo(optax.adamw(0.01), 0.68, 0.37, k)
    plain, _ = run_ours(tx, params, grads)
    # The inputs as float32 has them, then the plain path in float64: what both round.
    params32, grads32 = (jax.tree.map(lambda x: np.asarray(x, np.float32), t)
                         for t in (params, grads))
    with in_float64():
        tx64 = snoo(optax.adamw(0.01), 0.68, 0.37, k, slow_dtype="float64")
        exact = float64(run_ours(tx64, params32, grads32, dtype=jnp.float64)[0])
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = tx.init(p)
    update = jax.jit(tx.update, static_argnames=("snoo_sync",))
    for t, g in enumerate(grads):
        g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
        u, state = update(g, state, p, snoo_sync=optax_snoo.snoo_is_sync_step(t, k))
        p = optax.apply_updates(p, u)
        # Two compiled programs (a static branch, a traced one): as accurate as each other.
        assert_as_accurate(p, plain[t], exact[t], what=f"step {t}")


def test_hint_must_be_a_static_bool():
    params = {"w": jnp.ones(2)}
    tx = snoo(optax.sgd(0.1))
    with pytest.raises(ValueError, match="snoo_sync"):
        tx.update(params, tx.init(params), params, snoo_sync=jnp.array(True))


def test_extra_args_reach_the_inner_transform():
    seen = {}

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, scale=1.0, **extra):
        seen["scale"] = scale
        return jax.tree.map(lambda g: -scale * g, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = snoo(inner, 1.0, 0.0, 1)
    params = {"w": jnp.ones(3)}
    u, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params, scale=3.0)
    assert seen["scale"] == 3.0
    np.testing.assert_allclose(u["w"], -3.0)


def test_outermost_over_partition_keeps_plain_params():
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    labels = {"w": "a", "b": "b"}
    tx = snoo(optax.partition({"a": optax.sgd(0.1), "b": optax.adam(0.1)}, labels), k=2)
    state = tx.init(params)
    u, state = tx.update(params, state, params)
    new = optax.apply_updates(params, u)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    assert jax.tree.structure(state.slow) == jax.tree.structure(params)


def test_slow_copy_is_a_real_copy_so_donation_works():
    """Init inside jit, then a step donating params and state: no shared buffers."""
    params = {"w": jnp.ones((8, 8))}
    tx = snoo(optax.adamw(1e-2), k=2)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def fresh(p):
        return p, tx.init(p)

    params, state = fresh(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)), donate_argnums=(0, 1))
    for _ in range(3):
        params, state = step(params, state, {"w": jnp.ones((8, 8))})
    assert bool(jnp.all(jnp.isfinite(params["w"])))


@pytest.mark.parametrize("inner", [optax.adamw(1e-2), optax.sgd(0.1, momentum=0.9)])
def test_plain_step_keeps_state_in_place(inner):
    """The compiled plain step (donated params and state) needs at most one params-sized
    temporary: the sync branch's own. Copying the inner state for the conditional, or
    materialising the update for it, would show up here (XLA's memory analysis, no timing)."""
    params = {"w": jnp.zeros((256, 128)), "b": jnp.zeros(128), "stack": jnp.zeros((4, 32, 16))}
    tx = snoo(inner, k=4)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)), donate_argnums=(0, 1))
    compiled = step.lower(params, tx.init(params), params).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert compiled.memory_analysis().temp_size_in_bytes <= 1.5 * param_bytes


def test_bf16_params_keep_fp32_slow_weights():
    params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    tx = snoo(optax.adamw(1e-2), k=2)
    state = tx.init(params)
    assert state.slow["w"].dtype == jnp.float32
    assert state.momentum["w"].dtype == jnp.float32
    u, state = tx.update({"w": jnp.ones((4, 4), jnp.bfloat16)}, state, params)
    assert u["w"].dtype == jnp.bfloat16


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    ({"k": 0}, "snoo: k must be an int >= 1, got 0"),
    ({"k": 2.5}, "snoo: k must be an int >= 1, got 2.5"),
    ({"learning_rate": -0.1}, r"snoo: learning_rate must be >= 0 \(a float or a schedule\), "
                              "got -0.1"),
    ({"learning_rate": jnp.asarray(-0.1)}, "snoo: learning_rate must be >= 0"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
    ({"momentum": -0.2}, r"momentum must be in \[0, 1\), got -0.2"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        snoo(optax.sgd(0.1), **kwargs)


def test_inner_must_be_a_transformation():
    with pytest.raises(ValueError, match="inner must be an optax.GradientTransformation"):
        snoo("adamw")


def test_update_needs_params():
    tx = snoo(optax.sgd(0.1))
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))


# ---------------------------------------------------------------- the optax matrix
MATRIX_PARAMS = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,)), "stack": jnp.ones((2, 8, 4))}


def test_optax_matrix(tmp_path):
    tx = snoo(optax.adamw(1e-2), k=3)
    tx64 = snoo(optax.adamw(1e-2), k=3, slow_dtype="float64")  # the same in float64
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=5, float64=tx64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=4)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=4)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=4, float64=tx64)
    m.check_partition(tx, MATRIX_PARAMS, steps=4, float64=tx64)
    m.check_nnx_optimizer(snoo(optax.adam(1e-2), k=2), steps=5)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=4, float64=tx64)
    # Saved after 5 updates: mid-period for k = 3 (the next sync is at t = 6).
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=5, steps_after=5)


def test_inject_hyperparams():
    """Numeric hyperparameters become state (k must be static: it is a period).

    (`inject_hyperparams` evaluates callables on its own update count, not on Snoo's
    outer-step count, so outer schedules are passed to `snoo` directly.)"""
    inner = optax.adamw(1e-2)
    state = m.check_inject_hyperparams(
        snoo, MATRIX_PARAMS, {"inner": inner, "learning_rate": 0.68, "momentum": 0.37, "k": 2},
        static_args=("k",), steps=5,
        float64=lambda **kw: snoo(**kw, slow_dtype="float64"))
    assert float(state.hyperparams["momentum"]) == pytest.approx(0.37)
    # The injected value is the one used: zero outer lr freezes the params at the slow copy.
    tx = optax.inject_hyperparams(snoo, static_args=("k",))(inner, 0.68, 0.37, 2)
    fresh = tx.init(MATRIX_PARAMS)
    fresh.hyperparams["learning_rate"] = jnp.zeros([])
    u, _ = tx.update(m.random_grads(MATRIX_PARAMS, 0), fresh, MATRIX_PARAMS)
    m.assert_trees_close(u, jax.tree.map(jnp.zeros_like, MATRIX_PARAMS), 0, 1e-7)


# ---------------------------------------------------------------- skipped updates
def test_skip_update_advances_every_snoo_count_and_nothing_else():
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones(2)}
    inner = optax.partition({"x": snoo(optax.adam(0.1), k=2), "y": optax.sgd(0.1)},
                            {"a": "x", "b": "y"})
    tx = optax.chain(optax.clip_by_global_norm(1.0), snoo(inner, k=3))
    state = tx.init(params)
    state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)[1]
    skipped = optax_snoo.skip_update(state)
    outer, nested = skipped[1], skipped[1].inner_state.inner_states["x"].inner_state
    assert int(outer.count) == 2 and int(nested.count) == 2  # both were 1
    # Every leaf but the two Snoo counts is unchanged (Adam's own count included).
    changed = [jax.tree_util.keystr(p) for (p, new), old in zip(
        jax.tree_util.tree_flatten_with_path(skipped)[0], jax.tree.leaves(state), strict=True)
        if not np.array_equal(new, old)]
    assert len(changed) == 2 and all(c.endswith(".count") for c in changed), changed
    assert jax.tree.structure(skipped) == jax.tree.structure(state)


def test_a_skipped_update_keeps_its_slot_in_the_period():
    """After a skip at t = 1 (k = 3), the next sync is at t = 3, as the host's hint says."""
    params = {"w": jnp.ones(4)}
    tx = snoo(optax.sgd(0.5), k=3)
    grads = {"w": jnp.ones(4)}
    state = tx.update(grads, tx.init(params), params, snoo_sync=True)[1]  # t = 0
    state = optax_snoo.skip_update(state)  # t = 1 skipped
    for t in (2, 3):
        hinted = tx.update(grads, state, params, snoo_sync=optax_snoo.snoo_is_sync_step(t, 3))
        decided = tx.update(grads, state, params)  # Snoo's own in-jit decision
        # Exactly equal: sums and halvings of ones, exact in float32 in any order.
        jax.tree.map(np.testing.assert_array_equal, hinted, decided)
        state = hinted[1]
    assert int(state.count) == 4
