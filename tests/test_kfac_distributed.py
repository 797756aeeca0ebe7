"""The K-FAC refresh split over devices: equal to the replicated refresh, and, read from
the compiled program, each device eigendecomposes only its share (plus padding), the
results come back in one all_gather per factor size, and a plain step reduces the factor
statistics in one all-reduce and runs no eigh."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from test_kfac_transform import TEMPLATE, curvature_at, grads_at, make_params

from benchmarks import kfac_scaling
from optax_snoo import kfac

# Factor sizes of TEMPLATE -> number of matrices: l1 a 5, g 6; l2 a 6, g 3; experts (2) a 4, g 4.
GROUPS = {3: 1, 4: 4, 5: 1, 6: 2}


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


@pytest.mark.parametrize("mode", ["pi", "eigen"])
@pytest.mark.parametrize("n,explicit", [(2, False), (4, True), (8, False)])
def test_distributed_refresh_equals_the_replicated_one(mode, n, explicit):
    params = make_params()
    kw = dict(refresh=kfac.every(1, first=0), mode=mode, layers=TEMPLATE, damping=1e-2)
    ref_u, ref_s = _refresh(kfac.scale_by_kfac(distributed_refresh=False, **kw), params)
    u, s = _refresh(kfac.scale_by_kfac(**kw), params, mesh=_mesh(n, explicit))
    for a, b in zip(jax.tree.leaves((u, s)), jax.tree.leaves((ref_u, ref_s)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(s.event.count) == 3


def _costs(n, mode="pi"):
    params = make_params()
    tx = kfac.scale_by_kfac(refresh=kfac.every(2), mode=mode, layers=TEMPLATE)
    state = tx.init(params)
    with jax.set_mesh(_mesh(n)):
        compiled = jax.jit(tx.update).lower(grads_at(0, params), state, params,
                                            curvature=curvature_at(0)).compile()
    return kfac_scaling.analyse(compiled.as_text())


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_each_device_runs_its_share_of_the_eigh(n):
    costs = _costs(n)
    assert costs["refresh"]["eigh"] == {d: math.ceil(k / n) for d, k in GROUPS.items()}
    gathers = costs["refresh"]["collective_ops"].get("all-gather", 0)
    assert gathers == (0 if n == 1 else 2 * len(GROUPS))  # inverses + spectrum stats
    assert costs["plain"]["eigh"] == {} and costs["plain"]["collective_ops"] == {}


def test_gpt_refresh_flops_per_device_within_target_and_stats_reduced_once():
    rows = kfac_scaling.kfac_rows((1, 2, 4, 8), n_layer=2, n_embd=64, n_head=2,
                                  block_size=16, batch_size=4, moe_every=2, n_experts=4)
    for r in rows:
        assert r["within_target"], r
        if r["devices"] > 1:
            # The factor statistics of every layer: one (combined) all-reduce.
            assert r["plain"]["collective_ops"] == {"all-reduce": 1}, r["plain"]
    assert rows[-1]["refresh"]["eigh_flops"] < rows[0]["refresh"]["eigh_flops"] / 4
