"""The K-FAC refresh split over devices: equal to the replicated refresh, and, read from
the compiled program, each device eigendecomposes only its share (plus padding), the
results come back in one all_gather per factor size, a plain step runs no eigh, and the
factor statistics are reduce-scattered into row-split factor EMAs (`stats_axes`)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import hlo
from library.support import LAYERS, TEMPLATE, curvature_at, grads_at, make_params
from optax_snoo import kfac
from references.error import assert_as_accurate
from references.kfac import ReferenceKfac, cached_operator, operator

# Factor sizes of TEMPLATE -> number of matrices: l1 a 5, g 6; l2 a 6, g 3; experts (2) a 4, g 4.
GROUPS = {3: 1, 4: 4, 5: 1, 6: 2}
EMA_DECAY = 0.95  # scale_by_kfac's default, which the tests below leave


def _mesh(n, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((n,), ("data",), axis_types=(kind,), devices=jax.devices()[:n])


def _refresh(tx, params, steps=3, mesh=None):
    state, outs = tx.init(params), []
    update = jax.jit(tx.update)
    for t in range(steps):
        if mesh is None:
            u, state = update(grads_at(t, params), state, params, curvature=curvature_at(t))
        else:
            with jax.set_mesh(mesh):
                u, state = update(grads_at(t, params), state, params,
                                  curvature=curvature_at(t))
        outs.append(u)
    return outs, state


def _refresh_kwargs(mode):
    return dict(refresh=kfac.every(1, first=0), mode=mode, layers=TEMPLATE, damping=1e-2)


@functools.cache
def _replicated_refresh(mode):
    """The program the test below compares with, the same for every mesh: once per mode."""
    tx = kfac.scale_by_kfac(distributed_refresh=False, **_refresh_kwargs(mode))
    return _refresh(tx, make_params())


@functools.cache
def _float64_refresh(mode, steps=3):
    """The same three refreshing steps in float64 numpy: the updates and the reference
    (its factor EMAs, EMA weight and refreshed snapshot)."""
    ref = ReferenceKfac(LAYERS, EMA_DECAY, _refresh_kwargs(mode)["damping"], mode,
                        lambda *_: True)
    params = make_params()
    return [ref.update(t, grads_at(t, params), curvature_at(t), 0.0) for t in range(steps)], ref


@pytest.mark.parametrize("mode", ["pi", "eigen"])
@pytest.mark.parametrize("n,explicit", [(2, False), (4, True), (8, False)])
def test_distributed_refresh_equals_the_replicated_one(mode, n, explicit):
    """Each device decomposes other matrices in other batches than the replicated
    program does, so the two round differently: every float of the distributed updates
    and state is as close to float64 K-FAC as the replicated program's (error.py), the
    counts and the refreshed step equal."""
    params = make_params()
    kw = _refresh_kwargs(mode)
    ref_u, ref_s = _replicated_refresh(mode)
    u, s = _refresh(kfac.scale_by_kfac(stats_axes=("data",), **kw), params,
                    mesh=_mesh(n, explicit))
    u64, ref = _float64_refresh(mode)
    for t in range(3):
        assert_as_accurate(u[t], ref_u[t], u64[t], what=f"update {t}")
    assert_as_accurate(s.factor_weight, ref_s.factor_weight, ref.weight, what="weight")
    factors64 = {name: {"kernel": kfac.LayerCurvature(*ref.factors[name])} for name in LAYERS}
    assert_as_accurate(s.factors, ref_s.factors, factors64, what="factors")
    # The cached inverses as the operators they apply (eigenvector signs are arbitrary).
    for name in LAYERS:
        a, g = ref.snapshot[name]
        stack = a.shape[:-2]
        want = np.stack([operator(a[i], g[i], kw["damping"], mode) for i in np.ndindex(stack)])
        got, peer = (cached_operator(x.inverses[name]["kernel"]) for x in (s, ref_s))
        assert_as_accurate(got, peer, want.reshape(got.shape), what=f"inverse {name}")
    eigs = [[np.linalg.eigvalsh(f[i]).ravel() for f in ref.snapshot.values()] for i in (0, 1)]
    spectrum = {"a_max": max(e.max() for e in eigs[0]), "a_min": min(e.min() for e in eigs[0]),
                "g_max": max(e.max() for e in eigs[1]), "g_min": min(e.min() for e in eigs[1])}
    for field in s.event._fields:
        got, peer = getattr(s.event, field), getattr(ref_s.event, field)
        if field in spectrum:
            assert_as_accurate(got, peer, spectrum[field], what=field)
        else:  # counts, the refreshed step, the learning rate passed in: no arithmetic
            np.testing.assert_array_equal(got, peer, err_msg=field)
    assert int(s.count) == int(s.event.count) == 3
    # stats_axes: each factor EMA whose rows divide by n keeps 1/n of them per device.
    for f in jax.tree.leaves(s.factors):
        split = n if f.shape[-2] % n == 0 else 1
        assert math.prod(f.sharding.shard_shape(f.shape)) * split == f.size, (f.shape, n)


def test_statistics_are_reduce_scattered_into_row_split_factors():
    """curvature_from_stats(scatter_axes=...) on tokens split over 4 devices: the factors
    equal the float64 ones, arrive with their rows split (1/4 per device) by one
    reduce-scatter per factor and no all-reduce; with a bias (d_in + 1 rows) or rows that
    do not divide, as before (replicated, all-reduce)."""
    mesh = _mesh(4)
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(32, 8)), rng.normal(size=(32, 6)) / 32
    stats = {"l/kernel": kfac.LayerStats(jnp.asarray(x, jnp.float32),
                                         jnp.asarray(dy, jnp.float32)),
             "b/kernel": kfac.LayerStats(jnp.asarray(x, jnp.float32),
                                         jnp.asarray(dy, jnp.float32), has_bias=True)}
    tokens = NamedSharding(mesh, P("data", None))
    stats = jax.tree.map(lambda v: jax.device_put(v, tokens), stats)
    fn = jax.jit(lambda s: kfac.curvature_from_stats(s, scatter_axes=("data",)))
    with jax.set_mesh(mesh):
        compiled = fn.lower(stats).compile()
        out = fn(stats)
    a, g = x.T @ x / 32, (32 * dy).T @ (32 * dy) / 32
    np.testing.assert_allclose(out["l/kernel"].a, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["l/kernel"].g, g, rtol=1e-5, atol=1e-6)
    xb = np.concatenate([x, np.ones((32, 1))], axis=1)
    np.testing.assert_allclose(out["b/kernel"].a, xb.T @ xb / 32, rtol=1e-5, atol=1e-6)
    assert out["l/kernel"].a.sharding.spec == P("data", None)          # 8 rows: 2 each
    assert out["l/kernel"].g.sharding.spec == P(None, None) or (
        out["l/kernel"].g.sharding.is_fully_replicated)                # 6 rows: replicated
    assert out["b/kernel"].a.sharding.is_fully_replicated             # 9 rows (bias)
    cost = hlo.analyze(compiled.as_text())
    # Only l's A (8 rows) is reduce-scattered; the Gs (6 rows) and b's A (9) all-reduced.
    assert cost.by_kind.get("reduce-scatter", 0) == 8 * 8 * 4
    assert cost.by_kind.get("all-reduce", 0) <= (6 * 6 * 2 + 9 * 9) * 4


def _costs(n, mode="pi"):
    params = make_params()
    tx = kfac.scale_by_kfac(refresh=kfac.every(2), mode=mode, layers=TEMPLATE)
    state = tx.init(params)
    with jax.set_mesh(_mesh(n)):
        compiled = jax.jit(tx.update).lower(grads_at(0, params), state, params,
                                            curvature=curvature_at(0)).compile()
    text = compiled.as_text()
    return hlo.analyze(text, eigh_branch=True), hlo.analyze(text, eigh_branch=False)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_each_device_runs_its_share_of_the_eigh(n):
    refresh, plain = _costs(n)
    assert refresh.eigh == {d: math.ceil(k / n) for d, k in GROUPS.items()}
    # One all-gather per factor size of the inverses, one of the spectrum statistics.
    assert refresh.counts.get("all-gather", 0) == (0 if n == 1 else 2 * len(GROUPS))
    assert plain.eigh == {} and plain.counts == {}


# ------------------------------------------------- preconditioning where gradients live
# (kernel shape, with bias, kernel sharding): rows split, columns split, both (tensor).
SPLIT_LAYERS = {"l1": ((64, 128), True, P("fsdp", None)),
                "l2": ((128, 64), False, P(None, "fsdp")),
                "l3": ((32, 64), True, P("fsdp", "tensor"))}


def _split_problem(mesh, scale=1):
    """Sharded params and gradients of `SPLIT_LAYERS` (dimensions x scale), batch factors."""
    rng = np.random.default_rng(0)
    params, grads, curvature = {}, {}, {}
    for name, ((d_in, d_out), bias, spec) in SPLIT_LAYERS.items():
        d_in, d_out = d_in * scale, d_out * scale
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        params[name] = {"kernel": put(rng.standard_normal((d_in, d_out), np.float32), spec)}
        grads[name] = {"kernel": put(rng.standard_normal((d_in, d_out), np.float32), spec)}
        if bias:
            params[name]["bias"] = put(np.zeros(d_out, np.float32), P())
            grads[name]["bias"] = put(rng.standard_normal(d_out, np.float32), P())
        x = rng.standard_normal((4 * d_in, d_in), np.float32)
        dy = rng.standard_normal((4 * d_in, d_out), np.float32) / d_in
        curvature[name] = {"kernel": kfac.layer_factors(jnp.asarray(x), jnp.asarray(dy),
                                                        has_bias=bias)}
    return params, grads, curvature


def _split_update(mode, mesh, distributed, scale=1, run=True):
    """One refreshing update under jit (out shardings = the gradients'), and its program
    (compiled once and run as compiled; ``run=False``: the program only)."""
    params, grads, curvature = _split_problem(mesh, scale)
    tx = kfac.scale_by_kfac(refresh=kfac.every(1, first=0), mode=mode, damping=1e-2,
                            distributed_precondition=distributed, shardings=params)
    with jax.set_mesh(mesh):
        state = tx.init(params)
        update = jax.jit(tx.update, out_shardings=(jax.tree.map(lambda g: g.sharding, grads),
                                                   None))
        compiled = update.lower(grads, state, params, curvature=curvature).compile()
        if not run:
            return grads, None, state, compiled.as_text()
        updates, state = compiled(grads, state, params, curvature=curvature)
    return grads, updates, state, compiled.as_text()


def _expected(grads, state, mode):
    """The preconditioned gradients in float64 from the state's cached inverses."""
    out = {}
    for name, (_, bias, _) in SPLIT_LAYERS.items():
        inv = jax.tree.map(lambda x: np.asarray(x, np.float64), state.inverses[name]["kernel"])
        x = np.asarray(grads[name]["kernel"], np.float64)
        if bias:
            x = np.concatenate([x, np.asarray(grads[name]["bias"], np.float64)[None]])
        if mode == "eigen":
            y = inv.q_a @ ((inv.q_a.T @ x @ inv.q_g) * inv.scale) @ inv.q_g.T
        else:
            y = inv.a_inv @ x @ inv.g_inv
        d_in = grads[name]["kernel"].shape[0]
        out[name] = {"kernel": y[:d_in], **({"bias": y[d_in]} if bias else {})}
    return out


@pytest.mark.parametrize("mode", ["pi", "eigen"])
@pytest.mark.parametrize("shape,explicit", [((1, 8, 1), False), ((2, 4, 1), False),
                                            ((2, 2, 2), False), ((2, 4, 1), True)])
def test_split_preconditioning_matches_float64(mode, shape, explicit):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)
    for distributed in (True, False):
        grads, updates, state, _ = _split_update(mode, mesh, distributed)
        expected = _expected(grads, state, mode)
        for name, leaves in expected.items():
            for key, want in leaves.items():
                got = updates[name][key]
                # float32 products of length <= 129, against the float64 ones
                np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                                           atol=1e-5 * np.abs(want).max(), err_msg=name)
                assert got.sharding.is_equivalent_to(grads[name][key].sharding, got.ndim)


@pytest.mark.parametrize("mode,max_moved", [("pi", 2), ("eigen", 4)])
def test_split_preconditioning_moves_shares_not_whole_gradients(mode, max_moved):
    """fsdp over 8 devices: all-to-alls of each device's share (twice in pi, at most four
    times in eigen mode) and no more FLOPs; the partitioner alone moves the split
    gradients whole."""
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    scale = 4  # large enough that the kernels dominate the program's collectives
    kernel_bytes = {n: 4 * d_in * d_out * scale**2
                    for n, ((d_in, d_out), _, _) in SPLIT_LAYERS.items()}
    share = sum(kernel_bytes.values()) / 8
    bias_bytes = sum(4 * d_out * scale for (_, d_out), bias, _ in SPLIT_LAYERS.values() if bias)
    cost = {}
    for distributed in (True, False):
        text = _split_update(mode, mesh, distributed, scale, run=False)[3]
        cost[distributed] = hlo.analyze(text, eigh_branch=False)
    ours, theirs = cost[True], cost[False]
    assert set(ours.by_kind) == {"all-to-all", "all-gather"}
    assert ours.by_kind["all-to-all"] <= max_moved * share + bias_bytes
    assert ours.by_kind["all-gather"] <= bias_bytes  # vectors, never a kernel
    # The partitioner's choice moves at least the two big kernels whole (all-gathers,
    # and all-reduces of partial products in eigen mode).
    assert theirs.collective_bytes >= kernel_bytes["l1"] + kernel_bytes["l2"]
    assert ours.flops <= theirs.flops * 1.01


def test_split_shardings_given_explicitly_and_follow_the_update_mesh():
    """Under jit on Auto axes the gradients carry no sharding: given as `shardings=`
    (here the params' `NamedSharding` s), the update moves shares only; on another mesh
    than theirs, nothing is split."""
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    params, grads, curvature = _split_problem(mesh)

    def gathered(mesh_now, state, shardings):
        tx = kfac.scale_by_kfac(refresh=kfac.every(1, first=0), damping=1e-2,
                                shardings=shardings)
        with jax.set_mesh(mesh_now):
            text = jax.jit(tx.update).lower(grads, state, params,
                                            curvature=curvature).compile().as_text()
        return hlo.analyze(text, eigh_branch=False).by_kind.get("all-gather", 0)

    with jax.set_mesh(mesh):
        state = kfac.scale_by_kfac().init(params)
    kernel = 4 * 64 * 128  # l1's kernel, bytes
    given = jax.tree.map(lambda x: x.sharding, params)
    assert gathered(mesh, state, given) < kernel
    other = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"),
                          axis_types=(AxisType.Auto,) * 3)
    unsharded = jax.tree.map(np.asarray, (params, grads, state))
    params, grads, state = jax.device_put(unsharded, NamedSharding(other, P()))
    assert gathered(other, state, given) == 0  # replicated on the other mesh: nothing split


def test_grafting_norms_do_not_gather_a_column_split_leaf():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    leaf = jax.device_put(np.ones((64, 128), np.float32), NamedSharding(mesh, P(None, "fsdp")))
    tx = kfac.graft(optax.scale_by_adam(b1=0.0), optax.scale(2.0))
    state = tx.init({"w": leaf})
    with jax.set_mesh(mesh):
        text = jax.jit(tx.update).lower({"w": leaf}, state).compile().as_text()
    cost = hlo.analyze(text)
    assert cost.by_kind.get("all-gather", 0) == 0
    assert cost.collective_bytes <= 16  # the two norms' scalar all-reduces
