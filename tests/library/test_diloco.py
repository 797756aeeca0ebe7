"""DiLoCo (`optax_snoo.diloco`, `snoo(..., replica_axis=)`) against a float64 numpy
implementation (Douillard et al. 2023), its M = 1 case against `snoo`, shard_map against
vmap, and its compiled cross-replica collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_snoo
from benchmarks import diloco as bench
from benchmarks import hlo
from references.error import assert_as_accurate, run_in_float64
from references.snoo import SHAPES, NumpyAdamW, NumpySGD


def replica_params(m):
    rng = np.random.default_rng(0)
    one = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    return {k: np.broadcast_to(v, (m, *v.shape)).copy() for k, v in one.items()}


def replica_grads(m, steps):
    """Each replica its own gradients (its own data)."""
    rng = np.random.default_rng(1)
    return [{k: rng.normal(size=(m, *s)) for k, s in SHAPES.items()} for _ in range(steps)]


def numpy_diloco(inner, params, grads, lr, mom, k):
    """DiLoCo written out: every replica its own inner step; at t % k == 0 the mean of the
    replicas' pseudo-gradients drives Nesterov SGD on the one slow copy, which every
    replica then starts from."""
    m = next(iter(params.values())).shape[0]
    p = [{kk: v[r].copy() for kk, v in params.items()} for r in range(m)]
    slow = {kk: v.copy() for kk, v in p[0].items()}
    buf = {kk: np.zeros_like(v) for kk, v in slow.items()}
    states = [inner.init(p[r]) for r in range(m)]
    history = []
    for t, g in enumerate(grads):
        fast = []
        for r in range(m):
            u, states[r] = inner.update({kk: v[r] for kk, v in g.items()}, states[r], p[r])
            fast.append({kk: p[r][kk] + u[kk] for kk in p[r]})
        if t % k == 0:
            for kk in slow:
                d = np.mean([slow[kk] - f[kk] for f in fast], axis=0)
                buf[kk] = mom * buf[kk] + d
                slow[kk] = slow[kk] - lr * (d + mom * buf[kk])
            p = [{kk: v.copy() for kk, v in slow.items()} for _ in range(m)]
        else:
            p = fast
        history.append({kk: np.stack([p[r][kk] for r in range(m)]) for kk in slow})
    return history


def as_float32(tree):
    """The values a float32 run starts from (its float64 reference starts from them too)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def run(tx, params, grads, hint_k=None, sync="start", dtype=jnp.float32):
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    state = tx.init(params)
    update = jax.jit(tx.update, static_argnames=("snoo_sync",))
    history = []
    for t, g in enumerate(grads):
        extra = ({} if hint_k is None else
                 {"snoo_sync": optax_snoo.snoo_is_sync_step(t, hint_k, sync)})
        u, state = update(jax.tree.map(lambda x: jnp.asarray(x, dtype), g), state,
                          params, **extra)
        params = optax.apply_updates(params, u)
        history.append(params)
    return history, state


@pytest.mark.parametrize("m, inner_name, hinted", [(2, "adamw", False), (4, "sgd", True)])
def test_matches_numpy_reference(m, inner_name, hinted):
    k, steps = 3, 11  # syncs at t = 0, 3, 6, 9; inner steps in between
    params, grads = replica_params(m), replica_grads(m, steps)
    if inner_name == "sgd":
        ours_inner, ref_inner = optax.sgd(0.05), NumpySGD(0.05)
    else:
        ours_inner, ref_inner = optax.adamw(0.01, weight_decay=1e-4), NumpyAdamW(0.01, wd=1e-4)
    tx = optax_snoo.diloco(ours_inner, 0.68, 0.37, k)
    ours, state = run(tx, params, grads, hint_k=k if hinted else None)
    ref = numpy_diloco(ref_inner, params, grads, 0.68, 0.37, k)
    for t, (a, b) in enumerate(zip(ours, ref, strict=True)):
        for key in b:
            np.testing.assert_allclose(np.asarray(a[key], np.float64), b[key], rtol=2e-5,
                                       atol=2e-5, err_msg=f"step {t}, leaf {key}")
        if t % k:  # between syncs the replicas drift apart on their own data
            assert not np.allclose(a["w"][0], a["w"][1])
    assert int(state.count) == steps and state.count.shape == ()
    # The slow weights and outer momentum are the same on every replica, bit for bit; the
    # params after the last sync (t = 9) are within one rounding of p + (slow - p).
    for tree in (state.slow, state.momentum):
        for leaf in jax.tree.leaves(tree):
            assert all(np.array_equal(leaf[0], leaf[r]) for r in range(m))
    after_sync = ours[9]
    for key, leaf in after_sync.items():
        np.testing.assert_allclose(leaf, np.broadcast_to(state.slow[key][0], leaf.shape),
                                   rtol=0, atol=4 * float(jnp.finfo(jnp.float32).eps))


@pytest.mark.parametrize("sync", ["start", "end"])
def test_one_replica_is_snoo(sync):
    """M = 1: `diloco` is `snoo` on the one replica, with and without the hint, syncing at
    the start of each period or (MuLoCo) after its last update: another program (a
    replica axis, a mean over it), as accurate as Snoo's against Snoo's float64 run."""
    k, steps = 3, 8
    params, grads = as_float32(replica_params(1)), as_float32(replica_grads(1, steps))
    inner = optax.adamw(0.01, weight_decay=1e-4)
    squeeze = lambda tree: jax.tree.map(lambda x: x[0], tree)
    plain = lambda dtype, hint=None: run(optax_snoo.snoo(inner, 0.68, 0.37, k, sync=sync),
                                         squeeze(params), [squeeze(g) for g in grads], hint,
                                         sync, dtype)
    # Snoo's slow copy follows the params' dtype, AdamW's moments too.
    def plain64():
        history, state = plain(jnp.float64)
        return history, state.slow

    exact, exact_slow = run_in_float64(plain64)
    for hint in (None, k):
        ours, state = run(optax_snoo.diloco(inner, 0.68, 0.37, k, sync=sync), params, grads,
                          hint, sync)
        snoo_history, snoo_state = plain(jnp.float32, hint)
        for t, (a, b) in enumerate(zip(ours, snoo_history, strict=True)):
            assert_as_accurate(squeeze(a), b, exact[t], what=f"hint {hint}, step {t}")
        assert_as_accurate(squeeze(state.slow), snoo_state.slow, exact_slow, what="slow")


def test_shard_map_over_the_replica_axis_equals_vmap():
    """`snoo(replica_axis="diloco")` inside `jax.shard_map` (one replica per device of a
    4-device `diloco` axis) takes the same steps as `diloco`'s vmap."""
    m, k, steps = 4, 2, 5
    mesh = jax.make_mesh((m,), ("diloco",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:m])
    params, grads = replica_params(m), replica_grads(m, steps)
    tx = optax_snoo.snoo(optax.sgd(0.05, momentum=0.9), 0.68, 0.37, k, replica_axis="diloco")
    # This device's replica, without its leading axis of 1 (the count has none).
    squeeze = lambda tree: jax.tree.map(lambda x: x[0] if x.ndim else x, tree)
    stack = lambda tree: jax.tree.map(lambda x: x[None] if x.ndim else x, tree)

    def local_step(g, s, p):
        u, s = tx.update(squeeze(g), squeeze(s), squeeze(p))
        return optax.apply_updates(p, stack(u)), stack(s)

    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = jax.vmap(tx.init)(p)
    state = state._replace(count=state.count[0])
    specs = optax_snoo.SnooState(count=P(), slow=P("diloco"), momentum=P("diloco"),
                                 inner_state=P("diloco"))
    step = jax.jit(jax.shard_map(local_step, mesh=mesh,
                                 in_specs=(P("diloco"), specs, P("diloco")),
                                 out_specs=(P("diloco"), specs)))
    vmap = lambda dtype: run(optax_snoo.diloco(optax.sgd(0.05, momentum=0.9), 0.68, 0.37, k),
                             as_float32(params), as_float32(grads), dtype=dtype)[0]
    vmapped, exact = vmap(jnp.float32), run_in_float64(lambda: vmap(jnp.float64))
    for t, g in enumerate(grads):
        p, state = step(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, p)
        # Another program (a psum across devices, not a mean over an axis): as accurate.
        assert_as_accurate(p, vmapped[t], exact[t], what=f"step {t}")
    # One all-reduce per step program, and it sits in the conditional's sync branch.
    text = step.lower(g, state, p).compile().as_text()
    assert hlo.in_conditional_branch(text, "all-reduce") == [True]


def test_compiled_cross_replica_collectives():
    """Under jit on a (diloco=2, fsdp=4) mesh: inner steps move nothing across replicas; a
    sync step all-reduces each device's share of the params once; data-parallel AdamW on a
    (data=2, fsdp=4) mesh moves its gradients' share across replicas on every step; the
    in-jit conditional keeps its all-reduce inside the sync branch."""
    m, devices = 2, 8
    share = bench.param_bytes(bench.init_params(jax.random.key(0))) / (devices // m)
    programs = bench.diloco_programs(m, k=4)
    across = hlo.spans_blocks(devices // m)
    inner = hlo.analyze(programs["inner"], only=across)
    sync = hlo.analyze(programs["sync"], only=across)
    assert inner.collective_bytes == 0
    assert sync.collective_bytes == share and sync.counts == {"all-reduce": 1}
    data_parallel_text = bench.data_parallel_program(m)
    data_parallel = hlo.analyze(data_parallel_text, only=across)
    assert data_parallel.collective_bytes >= share
    outside = hlo.in_conditional_branch(data_parallel_text, "all-reduce")
    assert outside and not any(outside)  # the structural check's control: no conditional

    # Without the hint: one all-reduce, in the conditional's sync branch.
    mesh = jax.make_mesh((m, devices // m), ("diloco", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    params = jax.device_put({"w": jnp.zeros((m, 64, 32))},
                            NamedSharding(mesh, P("diloco", "fsdp")))
    tx = optax_snoo.diloco(optax.adam(1e-3), k=4)
    state = jax.device_put(tx.init(params), jax.tree.map(
        lambda x: NamedSharding(mesh, P("diloco", "fsdp") if x.ndim == 3 else P()),
        tx.init(params)))
    text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
    assert hlo.in_conditional_branch(text, "all-reduce") == [True]
    assert hlo.analyze(text, only=across).collective_bytes == 64 * 32 * 4 / (devices // m)


def test_bad_input():
    params = {"w": jnp.ones((2, 3))}
    with pytest.raises(ValueError, match="replica_axis must be None, an axis name"):
        optax_snoo.snoo(optax.sgd(0.1), replica_axis=3)
    with pytest.raises(ValueError, match="replica_axis must be None, an axis name"):
        optax_snoo.snoo(optax.sgd(0.1), replica_axis="")
    # An axis name that no surrounding map binds: at trace time, with the fix in the message.
    tx = optax_snoo.snoo(optax.sgd(0.1), replica_axis="diloco")
    with pytest.raises(ValueError, match="replica_axis='diloco' is not an axis of the"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match="replica_axis='replicas' is not an axis"):
        jax.vmap(optax_snoo.snoo(optax.sgd(0.1), replica_axis="replicas").update,
                 axis_name="diloco")(params, jax.vmap(tx.init)(params), params)
    with pytest.raises(ValueError, match="diloco: axis_name must be a non-empty str"):
        optax_snoo.diloco(optax.sgd(0.1), axis_name=None)
    dl = optax_snoo.diloco(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"same leading replica axis \(M, ...\); got shapes "
                                         r"\[\(2, 3\), \(4,\)\]"):
        dl.init({"a": jnp.ones((2, 3)), "b": jnp.ones(4)})
    with pytest.raises(ValueError, match=r"got shapes \[\(\)\]"):
        dl.init({"a": jnp.ones(())})
    state = dl.init(params)
    with pytest.raises(ValueError, match="updates have 3 replicas, params 2"):
        dl.update({"w": jnp.ones((3, 3))}, state, params)
    with pytest.raises(ValueError, match="needs params"):
        dl.update(params, state)
    # A data-dependent integer scalar in the inner state (a per-replica skip count).
    guarded = optax_snoo.diloco(optax.apply_if_finite(optax.sgd(0.1), 3))
    with pytest.raises(ValueError, match="depends on each replica's data"):
        guarded.update({"w": jnp.array([[1.0, 2, 3], [np.nan, 1, 1]])}, guarded.init(params),
                       params)
