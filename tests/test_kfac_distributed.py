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

from benchmarks import hlo
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
    text = compiled.as_text()
    return hlo.analyze(text, eigh_branch=True), hlo.analyze(text, eigh_branch=False)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_each_device_runs_its_share_of_the_eigh(n):
    refresh, plain = _costs(n)
    assert refresh.eigh == {d: math.ceil(k / n) for d, k in GROUPS.items()}
    # One all-gather per factor size of the inverses, one of the spectrum statistics.
    assert refresh.counts.get("all-gather", 0) == (0 if n == 1 else 2 * len(GROUPS))
    assert plain.eigh == {} and plain.counts == {}
