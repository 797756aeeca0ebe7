"""The optax matrix for K-FAC (tests/optax_matrix.py pieces, with the curvature extra
argument passed on every update): jit, bf16 params, schedules, inject_hyperparams,
MultiSteps, partition with AdamW, nnx.Optimizer, sharded params with replicated factors,
Orbax round trip mid-interval; and the `kfac` alias (grafting, momentum, weight decay)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo.kfac import (
    LayerCurvature,
    every,
    kfac,
    layer_factors,
    lr_ratio,
    precondition,
    refresh_events,
    scale_by_kfac,
)
from references.error import assert_as_accurate, run_in_float64
from references.kfac import fixed_curvature_kfac, operator


def make_params(dtype=jnp.float32):
    rng = np.random.default_rng(3)
    p = {"d1": {"kernel": rng.normal(size=(3, 4)), "bias": rng.normal(size=4)},
         "d2": {"kernel": rng.normal(size=(4, 2))}, "s": rng.normal(size=2)}
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), p)


def _spd(rng, n):
    b = rng.normal(size=(n, 2 * n))
    return jnp.asarray(b @ b.T / (2 * n) + 0.1 * np.eye(n), jnp.float32)


def make_curvature(seed=4):
    rng = np.random.default_rng(seed)
    return {"d1": {"kernel": LayerCurvature(_spd(rng, 4), _spd(rng, 4))},
            "d2": {"kernel": LayerCurvature(_spd(rng, 4), _spd(rng, 2))}}


PARAMS, CURV = make_params(), make_curvature()
# One transform shared by most checks, so its update compiles once for the module.
TX = kfac(0.1, damping=1e-2, momentum=0.9, refresh=every(2, first=0))
# TX's computation for the fixed CURV the checks pass, in float64 under x64: the reference
# the float32 programs compared below (wrapped and plain, sharded and not) are measured by.
TX64 = fixed_curvature_kfac(CURV, 0.1, damping=1e-2, momentum=0.9)


def in_float64(wrap, steps, params=PARAMS, tx=TX64):
    """The params after `steps` of `wrap(tx)` in float64 (every update with CURV)."""
    return run_in_float64(lambda p: m.run(wrap(tx), p, steps, curvature=CURV)[0], params)


def test_jit_matches_eager():
    # One layer: eager dispatch compiles every op per shape, which dominates the cost.
    params, curvature = {"d1": PARAMS["d1"]}, {"d1": CURV["d1"]}
    p_jit, s_jit, _ = m.run(TX, params, 3, curvature=curvature)
    p_eager, s_eager, _ = m.run(TX, params, 3, jit=False, curvature=curvature)
    # Op by op and fused, the programs round differently: as accurate as each other.
    exact = in_float64(lambda tx: tx, 3, params=params,
                       tx=fixed_curvature_kfac(curvature, 0.1, damping=1e-2, momentum=0.9))
    assert_as_accurate(p_jit, p_eager, exact)
    assert jax.tree.structure(s_jit) == jax.tree.structure(s_eager)
    assert refresh_events(s_jit)[0]["refresh"] == 2


def test_state_stable_and_bf16_params():
    tx = kfac(0.1, damping=1e-2, refresh=every(2, first=0), weight_decay=0.1)
    params = make_params(jnp.bfloat16)
    state0 = tx.init(params)
    spec = lambda s: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), s)
    update = jax.jit(tx.update)
    state = state0
    for t in range(3):
        updates, state = update(m.random_grads(params, t), state, params, curvature=CURV)
        for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
            assert u.dtype == jnp.bfloat16 == p.dtype
            assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
        params = optax.apply_updates(params, updates)
    assert spec(state0) == spec(state)
    factors = state[0].factors
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(factors))


def test_learning_rate_and_damping_schedules():
    """Update = -lr(t) · precondition(g, C.a, C.g, damping(t)) with a fixed curvature C
    (the EMA of identical batches is C) and a refresh on every step."""
    lr = optax.linear_schedule(0.2, 0.05, 5)
    damping = lambda t: 0.1 * 0.5 ** t
    tx = kfac(lr, damping=damping, momentum=None, refresh=every(1, first=0))
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    solve = jax.jit(precondition)
    for t in range(4):
        grads = m.random_grads(PARAMS, t)
        updates, state = update(grads, state, PARAMS, curvature=CURV)
        for name, has_bias in (("d1", True), ("d2", False)):
            full = grads[name]["kernel"]
            if has_bias:
                full = jnp.concatenate([full, grads[name]["bias"][None]], axis=0)
            c = CURV[name]["kernel"]
            want = -float(lr(t)) * solve(full, c.a, c.g, damping(t))
            got = updates[name]["kernel"]
            if has_bias:
                got = jnp.concatenate([got, updates[name]["bias"][None]], axis=0)
            # The transform's cached inverses and `precondition`'s direct solve round
            # differently: each as accurate as the other against the float64 solve.
            exact = -float(lr(t)) * (operator(c.a, c.g, damping(t), "pi")
                                     @ np.asarray(full, np.float64).reshape(-1))
            assert_as_accurate(got, want, exact.reshape(full.shape), what=f"{name} step {t}")
        np.testing.assert_allclose(np.asarray(updates["s"]),
                                   -float(lr(t)) * np.asarray(grads["s"]), rtol=1e-6)


def test_inject_hyperparams():
    sched = optax.linear_schedule(0.1, 0.01, 8)
    kwargs = dict(learning_rate=sched, damping=1e-2, momentum=0.9, weight_decay=1e-3,
                  refresh=lr_ratio(0.3, max_interval=4))
    plain = kfac(**kwargs)
    injected = optax.inject_hyperparams(kfac, static_args=("refresh",))(**kwargs)
    p1, s1, _ = m.run(plain, PARAMS, 8, curvature=CURV)
    p2, s2, _ = m.run(injected, PARAMS, 8, curvature=CURV)
    exact = in_float64(lambda tx: tx, 8, tx=fixed_curvature_kfac(
        CURV, sched, damping=1e-2, momentum=0.9, weight_decay=1e-3))
    m.assert_runs_agree(p2, p1, exact, what="injected vs plain")
    e1, e2 = refresh_events(s1)[0], refresh_events(s2)[0]
    assert e1["refresh"] == e2["refresh"] >= 3 and e1["step"] == e2["step"]
    assert e2["lr"] == pytest.approx(float(sched(e2["step"])))


def test_multisteps():
    tx = TX
    ms = optax.MultiSteps(tx, every_k_schedule=2)
    ms_state, state = ms.init(PARAMS), tx.init(PARAMS)
    ms_update, update = jax.jit(ms.update), jax.jit(tx.update)
    p_ms = p_ref = PARAMS
    for outer in range(2):
        grads = [m.random_grads(PARAMS, 2 * outer + i) for i in range(2)]
        for g in grads:
            u, ms_state = ms_update(g, ms_state, p_ms, curvature=CURV)
            p_ms = optax.apply_updates(p_ms, u)
        mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
        u, state = update(mean, state, p_ref, curvature=CURV)
        p_ref = optax.apply_updates(p_ref, u)
    exact = in_float64(lambda tx: optax.MultiSteps(tx, every_k_schedule=2), 4)
    m.assert_runs_agree(p_ms, p_ref, exact, what="MultiSteps vs the mean gradient")
    assert refresh_events(ms_state)[0]["refresh"] == 1


def test_partition_kfac_and_adamw_groups():
    """Curvature reaches the K-FAC group through optax.partition; the entry for d2 (in the
    AdamW group, masked there) is ignored; each group equals its transform alone."""
    labels = {"d1": {"kernel": "kfac", "bias": "kfac"}, "d2": {"kernel": "adam"}, "s": "adam"}
    kfac_tx = TX
    adam_tx = optax.adamw(1e-2)
    part = optax.partition({"kfac": kfac_tx, "adam": adam_tx}, labels)
    p_part, s_part, _ = m.run(part, PARAMS, 5, curvature=CURV)

    sub = lambda tree, keys: {k: tree[k] for k in keys}
    ref = {}
    for tx, keys, extra in ((kfac_tx, ("d1",), {"curvature": {"d1": CURV["d1"]}}),
                            (adam_tx, ("d2", "s"), {})):
        p, state, update = sub(PARAMS, keys), tx.init(sub(PARAMS, keys)), jax.jit(tx.update)
        for t in range(5):
            u, state = update(sub(m.random_grads(PARAMS, t), keys), state, p, **extra)
            p = optax.apply_updates(p, u)
        ref.update(p)
    exact = in_float64(lambda tx: optax.partition({"kfac": tx, "adam": adam_tx}, labels), 5,
                       tx=fixed_curvature_kfac({"d1": CURV["d1"]}, 0.1, damping=1e-2))
    m.assert_runs_agree(p_part, ref, exact, what="partition vs each group alone")
    assert refresh_events(s_part)[0]["refresh"] == 3


def test_nnx_optimizer_with_captured_curvature():
    """nnx.Optimizer forwards the curvature; factors come from a real capture (zero
    perturbations on the layer outputs); the loss falls and refreshes happen."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, kfac(0.3, damping=1e-2, momentum=0.5, refresh=every(2, first=0)),
                        wrt=nnx.Param)

    def loss_fn(model, perturb):
        h = jnp.tanh(model.l1(x) + perturb["l1"])
        out = model.l2(h) + perturb["l2"]
        return jnp.mean(jnp.sum((out - y) ** 2, -1)), h

    @nnx.jit
    def step(model, opt):
        perturb = {"l1": jnp.zeros((16, 8)), "l2": jnp.zeros((16, 2))}
        (loss, h), (grads, dy) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            model, perturb)
        curvature = {"l1": {"kernel": layer_factors(x, dy["l1"], has_bias=True)},
                     "l2": {"kernel": layer_factors(h, dy["l2"], has_bias=True)}}
        opt.update(model, grads, curvature=curvature)
        return loss

    losses = [float(step(model, opt)) for _ in range(6)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert refresh_events(opt.opt_state)[0]["refresh"] == 3


def test_sharded_params_replicated_factors():
    """Params sharded on the 8-device mesh: init places the factors replicated, and under
    `jax.set_mesh` they stay replicated through jitted updates; momentum keeps the params'
    sharding; the result equals the unsharded run."""
    mesh = m.mesh8()
    sharded = m.shard_params(PARAMS, mesh)
    state = TX.init(sharded)
    kfac_leaves = lambda s: jax.tree.leaves((s[0].factors, s[0].inverses))
    assert all(x.sharding.is_fully_replicated for x in kfac_leaves(state))
    with jax.set_mesh(mesh):
        p, state, _ = m.run(TX, sharded, 3, state=state, curvature=CURV)
    p_ref, _, _ = m.run(TX, PARAMS, 3, curvature=CURV)
    m.assert_runs_agree(p, p_ref, in_float64(lambda tx: tx, 3), what="sharded vs unsharded")
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(sharded), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    for leaf in kfac_leaves(state):
        assert leaf.sharding.is_fully_replicated, leaf.sharding
    for t, x in zip(jax.tree.leaves(state[1].trace), jax.tree.leaves(sharded), strict=True):
        assert t.sharding.is_equivalent_to(x.sharding, t.ndim)


def test_orbax_roundtrip_mid_interval(tmp_path):
    """Saved after 3 updates (refreshes at 0 and 2), resumed for 4 more (refresh at 4, 6)."""
    m.check_orbax_roundtrip(TX, PARAMS, tmp_path, steps_before=3, steps_after=4, curvature=CURV)


def test_graft_sgd_and_adam_norms():
    grads = m.random_grads(PARAMS, 0)
    direction_tx = scale_by_kfac(damping=1e-2, refresh=every(1, first=0))
    direction, _ = jax.jit(direction_tx.update)(grads, direction_tx.init(PARAMS), PARAMS,
                                                curvature=CURV)
    for graft, norm_of in (("sgd", lambda g: jnp.linalg.norm(g)),
                           ("adam", lambda g: jnp.sqrt(g.size))):     # Adam step 1: ±1
        tx = kfac(1.0, damping=1e-2, momentum=None, refresh=every(1, first=0), graft=graft)
        updates, _ = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS, curvature=CURV)
        for u, g, d in zip(jax.tree.leaves(updates), jax.tree.leaves(grads),
                           jax.tree.leaves(direction), strict=True):
            np.testing.assert_allclose(float(jnp.linalg.norm(u)), float(norm_of(g)), rtol=1e-5)
            cos = jnp.vdot(-u, d) / (jnp.linalg.norm(u) * jnp.linalg.norm(d))
            np.testing.assert_allclose(float(cos), 1.0, rtol=1e-5)
    with pytest.raises(ValueError, match="graft"):
        kfac(0.1, graft="shampoo")


def test_curvature_reaches_kfac_through_snoo():
    """optax_snoo.snoo forwards extra args: with k=1, η=1, μ=0 Snoo is its inner optimizer,
    here K-FAC in an optax.partition group next to AdamW."""
    from optax_snoo import snoo

    labels = {"d1": {"kernel": "kfac", "bias": "kfac"}, "d2": {"kernel": "kfac"}, "s": "adam"}
    inner = optax.partition({"kfac": TX, "adam": optax.adamw(1e-2)}, labels)
    wrapped = snoo(inner, learning_rate=1.0, momentum=0.0, k=1)
    p_snoo, s_snoo, _ = m.run(wrapped, PARAMS, 4, curvature=CURV)
    p_ref, _, _ = m.run(inner, PARAMS, 4, curvature=CURV)
    exact = in_float64(lambda tx: optax.partition({"kfac": tx, "adam": optax.adamw(1e-2)},
                                                  labels), 4)
    m.assert_runs_agree(p_snoo, p_ref, exact, what="Snoo (k=1) vs its inner chain")
    assert refresh_events(s_snoo)[0]["refresh"] == 2
