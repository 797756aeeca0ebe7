"""A `MatrixPrecondition` runs once per device over all its matrices (`apply_batched`):
same-shape matrices as one stack, and SOAP's basis refresh as one batched ``eigh`` / QR
per Gram size. Batched and per-matrix programs are one computation: each as accurate as
the other against their float64 run, and the batched program holds one QR (one
``eigh``) per Gram size instead of one per matrix side."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hlo
from optax_snoo import scale_by_muon, soap_whitening
from optax_snoo._src.muon_squared import muon_squared_precondition
from references.error import assert_as_accurate, run_in_float64
from references.soap import first_gradient

F32, F64 = jnp.float32, jnp.float64
# Our (in, out) leaves: two squares (one gated: a stack mixing gated and plain matrices),
# the MLP pair (Grams of 8 and 16 on both sides), a stack of 2 squares: Grams of 8 and 16.
SHAPES = {"a": (8, 8), "b": (8, 8), "fc": (8, 16), "proj": (16, 8), "e": (2, 8, 8)}
GRAM_SIZES = 2
STEPS = 4


def gradients():
    """A rectangular diagonal first (its ``eigh`` is exact, also on the null space of the
    MLP's longer side), then random gradients, full rank before the first refresh."""
    rng = np.random.default_rng(4)
    return [{k: (first_gradient(s, rng) if t == 0 else rng.standard_normal(s)).astype(np.float32)
             for k, s in SHAPES.items()} for t in range(STEPS)]


def soap(dtype=F32):
    return scale_by_muon(precondition=soap_whitening(trust_gate=lambda path: path == "a"),
                         ns_normalization="gram_frobenius", ns_dtype=dtype)


def run(make, grads, dtype, keys):
    """The updates of ``make(dtype)`` on the leaves ``keys`` (one transform over them)."""
    tx = make(dtype)
    params = {k: jnp.zeros(SHAPES[k], dtype) for k in keys}
    state, update, out = tx.init(params), jax.jit(tx.update), []
    for g in grads:
        u, state = update({k: jnp.asarray(g[k], dtype) for k in keys}, state, params)
        out.append({k: np.asarray(v) for k, v in u.items()})
    return out


def per_matrix(make, grads, dtype):
    """Each leaf through its own transform: one refresh per leaf, as before batching."""
    runs = {k: run(make, grads, dtype, [k]) for k in SHAPES}
    return [{k: runs[k][t][k] for k in SHAPES} for t in range(STEPS)]


def test_batched_soap_equals_per_matrix_to_float32_rounding():
    grads = gradients()
    batched = run(soap, grads, F32, list(SHAPES))
    single = per_matrix(soap, grads, F32)
    exact = run_in_float64(lambda gs: run(soap, gs, F64, list(SHAPES)), grads)
    assert_as_accurate(batched, single, exact, what="batched vs per matrix")
    # ... and the per-matrix program as accurate as the batched one (the same computation)
    assert_as_accurate(single, batched, exact, what="per matrix vs batched")


def test_batched_muon_squared_equals_per_matrix():
    """A precondition without ``apply_stacks`` gets one ``apply`` per matrix shape."""
    make = lambda dtype: scale_by_muon(precondition=muon_squared_precondition(), ns_dtype=dtype)
    grads = gradients()
    exact = run_in_float64(lambda gs: run(make, gs, F64, list(SHAPES)), grads)
    assert_as_accurate(run(make, grads, F32, list(SHAPES)), per_matrix(make, grads, F32),
                       exact)


def test_one_qr_and_one_eigh_per_gram_size():
    """The compiled update of 6 matrices (12 Gram sides, sizes 8 and 16) runs one batched
    ``geqrf``/``orgqr`` per Gram size on a refresh step and one ``eigh`` per size on the
    first; each leaf through its own transform would run one per side."""
    tx = soap()
    params = {k: jnp.zeros(s, F32) for k, s in SHAPES.items()}
    text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    refresh, first = hlo.analyze(text, without_eigh=True), hlo.analyze(text, eigh_branch=True)
    # a, b and e's two: both sides 8; fc and proj: one side 8, one 16
    sides = {8: 2 + 2 + 4 + 1 + 1, 16: 2}
    assert sorted(refresh.linalg_calls.values()) == [GRAM_SIZES] * 2, refresh.linalg_calls
    assert dict(refresh.qr) == sides and not refresh.eigh, (refresh.qr, refresh.eigh)
    assert list(first.linalg_calls.values()) == [GRAM_SIZES], first.linalg_calls
    assert dict(first.eigh) == sides, first.eigh
