"""`gram_sinkhorn` / `scale_by_sinksoap` / `sinksoap` through the optax matrix
(tests/optax_matrix.py; `optax.partition` is the recipe test's) and their properties; the
step-by-step float64 check against Track 3 #26's own code is
`test_recipes_track3_sinksoap.py`.

The optax-matrix runs use ``eps=1e-2``: their random first gradients leave a non-square
matrix's longer-side Gram rank-deficient, where the momentum is zero but for rounding and the
balancing multiplies that rounding by ``1/sqrt(eps)`` (docs/sinksoap.md); at 1e-2 two float32
programs' roundings stay below their float32 error elsewhere, as they must to be compared."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import (
    GramSinkhornState,
    MuonState,
    NewtonSchulzPlan,
    gram_sinkhorn,
    scale_by_muon,
    scale_by_sinksoap,
    sinkhorn_balance,
    sinksoap,
)
from references.error import assert_as_accurate, in_float64

F32, F64 = jnp.float32, jnp.float64
rng = np.random.default_rng(0)
PARAMS = {"fc": jnp.asarray(rng.standard_normal((8, 16)), F32),
          "e": jnp.asarray(rng.standard_normal((2, 8, 8)), F32)}


def test_optax_matrix(tmp_path):
    tx = sinksoap(0.04, eps=1e-2)
    f64 = dict(float64=tx)  # the state follows the params' dtype: float64 params, float64 run
    m.check_jit_matches_eager(tx, PARAMS, steps=2, **f64)
    m.check_state_stable(tx, PARAMS, steps=2)
    m.check_dtype_preserved(tx, PARAMS, steps=2)
    m.check_multisteps(tx, PARAMS, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=2)
    state = tx.init(PARAMS)
    assert isinstance(state[0], MuonState)
    pre = state[0].precondition.leaves
    assert isinstance(pre["e"], GramSinkhornState)
    # (fan_in, fan_out) = (8, 16): L over fan_out, R over fan_in, per expert for "e"
    assert pre["fc"].gram_out.shape == (16, 16) and pre["fc"].gram_in.shape == (8, 8)
    assert pre["e"].gram_out.shape == (2, 8, 8)


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(
        scale_by_sinksoap, PARAMS, dict(beta=0.9, gram_beta=0.9, normuon_beta=0.9, eps=1e-2),
        static_args=("sinkhorn_steps", "mu_dtype", "matrix_axes"), float64=True)
    assert float(state.hyperparams["gram_beta"]) == pytest.approx(0.9)
    labels = lambda p: jax.tree.map(lambda x: "matrix" if x.ndim >= 2 else "vector", p)
    tx = optax.partition({"matrix": sinksoap(0.02), "vector": optax.adam(1e-2)}, labels)
    m.check_nnx_optimizer(tx, steps=5)


def test_sharded_balancing_runs_on_the_owners_and_equals_one_device():
    """On the 8-device ``(data 4, model 2)`` mesh the momentum keeps the param's sharding,
    the Grams lie on the matrices' owners (nothing per leaf), and the run is as accurate as
    the unsharded one against the float64 run."""
    make = lambda **kw: sinksoap(0.04, eps=1e-2, **kw)
    sharded = m.shard_params(PARAMS, m.mesh8())
    tx = make(newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    state = tx.init(sharded)
    for key, p in sharded.items():
        assert state[0].mu[key].sharding.is_equivalent_to(p.sharding, p.ndim)
        assert state[0].precondition.leaves[key] == optax.EmptyState(), key
    assert state[0].precondition.owned
    p_sharded, _, _ = m.run(tx, sharded, 2, state=state)
    p_plain, _, _ = m.run(make(), PARAMS, 2)
    exact = m.float64_run(make(), PARAMS, 2)
    assert_as_accurate(p_sharded, p_plain, exact, what="sharded vs unsharded")


def apply(pre, M, G, state):
    return pre.apply(M, G, state, jnp.zeros([], jnp.int32), np.zeros(M.shape[:-2], bool))


@pytest.mark.parametrize("shape", [(8, 8), (12, 8), (8, 12)])
def test_rotation_equivariance_and_muon_norm(shape):
    """Rotating the gradients and the momentum by orthogonal ``P`` (rows) and ``Q``
    (columns) rotates the result alike (the Grams' eigenbases rotate, ``A = Uᵀ M V`` does
    not; so the eigenvectors' signs and order do not matter either), and the result has a
    semi-orthogonal matrix's Frobenius norm ``sqrt(min(m, n))``. Checked once both Grams
    have full rank (the second update): before that this momentum, unlike Muon's, has a
    part in the longer-side Gram's null space, whose basis is arbitrary."""
    with in_float64():
        pre = gram_sinkhorn()
        rows, cols = shape
        r = np.random.default_rng(1)
        P = np.linalg.qr(r.standard_normal((rows, rows)))[0]
        Q = np.linalg.qr(r.standard_normal((cols, cols)))[0]
        Gs = [r.standard_normal((1, rows, cols)) for _ in range(3)]  # full-rank Grams
        Ms = [r.standard_normal((1, rows, cols)) for _ in range(3)]
        s1, s2 = pre.init(1, rows, cols, F64), pre.init(1, rows, cols, F64)
        for t, (G, M) in enumerate(zip(Gs, Ms, strict=True)):
            D1, s1 = apply(pre, jnp.asarray(M), jnp.asarray(G), s1)
            D2, s2 = apply(pre, jnp.asarray(P @ M @ Q.T), jnp.asarray(P @ G @ Q.T), s2)
            assert np.linalg.norm(np.asarray(D1)) == pytest.approx(min(shape) ** 0.5, rel=1e-12)
            if t >= 1:
                np.testing.assert_allclose(np.asarray(D2), P @ np.asarray(D1) @ Q.T,
                                           atol=1e-11)


def test_scale_invariance_when_eps_is_negligible():
    """With ``eps`` far below ``A²``, scaling the gradients and the momentum leaves the
    result unchanged (the Sinkhorn scalings absorb the scale); with the record's 1e-8 and
    gradients of 1e-4, it does not."""
    with in_float64():
        r = np.random.default_rng(2)
        Gs = [jnp.asarray(r.standard_normal((1, 8, 12))) for _ in range(2)]

        def run(eps, scale):
            pre = gram_sinkhorn(eps=eps)
            state = pre.init(1, 8, 12, F64)
            for G in Gs:
                D, state = apply(pre, scale * G, scale * G, state)
            return np.asarray(D)

        np.testing.assert_allclose(run(1e-30, 1e-4), run(1e-30, 1.0), atol=1e-12)
        assert np.abs(run(1e-8, 1e-4) - run(1e-8, 1.0)).max() > 1e-3


def test_sinkhorn_balance_marginals():
    """Columns of ``diag(r) B diag(c)`` sum to ``1/n`` after every step (``c`` is updated
    last), rows to ``1/m`` once converged; the signs of ``A`` are kept."""
    with in_float64():
        a = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 10)))
        one = np.asarray(sinkhorn_balance(a, steps=1, eps=0.0))
        np.testing.assert_allclose((one**2).sum(axis=-2), 1 / 10, rtol=1e-12)
        many = np.asarray(sinkhorn_balance(a, steps=500, eps=0.0))
        np.testing.assert_allclose((many**2).sum(axis=-1), 1 / 6, rtol=1e-9)
        np.testing.assert_allclose((many**2).sum(axis=-2), 1 / 10, rtol=1e-12)
        assert np.array_equal(np.sign(many), np.sign(np.asarray(a)))


def test_pytorch_layout_equals_transposed_flax_layout():
    """``matrix_axes=(1, 0)`` on the transposed leaves is the same computation."""
    with in_float64():
        r = np.random.default_rng(4)
        w = jnp.asarray(r.standard_normal((8, 12)))
        grads = [jnp.asarray(r.standard_normal((8, 12))) for _ in range(3)]
        flax_tx, torch_tx = scale_by_sinksoap(), scale_by_sinksoap(matrix_axes=(1, 0))
        sf, st = flax_tx.init({"w": w}), torch_tx.init({"w": w.T})
        update_f, update_t = jax.jit(flax_tx.update), jax.jit(torch_tx.update)
        for g in grads:
            uf, sf = update_f({"w": g}, sf)
            ut, st = update_t({"w": g.T}, st)
            np.testing.assert_allclose(np.asarray(ut["w"]).T, np.asarray(uf["w"]), atol=1e-12)


def test_normuon_only_on_non_square_matrices():
    """Square matrices skip NorMuon (their ``ν`` stays zero: the record's ``m != n``), so
    their updates equal those without NorMuon; non-square ones differ."""
    with in_float64():
        r = np.random.default_rng(5)
        params = {"sq": jnp.zeros((8, 8)), "wide": jnp.zeros((8, 16))}
        grads = [{k: jnp.asarray(r.standard_normal(p.shape)) for k, p in params.items()}
                 for _ in range(3)]
        with_nu, without = scale_by_sinksoap(), scale_by_sinksoap(normuon_beta=None)
        s1, s2 = with_nu.init(params), without.init(params)
        update1, update2 = jax.jit(with_nu.update), jax.jit(without.update)
        for g in grads:
            u1, s1 = update1(g, s1)
            u2, s2 = update2(g, s2)
        np.testing.assert_array_equal(np.asarray(s1.nu["sq"]), 0.0)
        np.testing.assert_allclose(np.asarray(u1["sq"]), np.asarray(u2["sq"]), atol=1e-13)
        assert np.abs(np.asarray(u1["wide"] - u2["wide"])).max() > 1e-3
        # shape scale sqrt(16/8) after NorMuon, which keeps the norm sqrt(min(8, 16))
        assert np.linalg.norm(np.asarray(u1["wide"])) == pytest.approx(4.0, rel=1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(beta=1.0), "beta"), (dict(sinkhorn_steps=0), "sinkhorn_steps"),
    (dict(sinkhorn_steps=2.0), "sinkhorn_steps"), (dict(eps=0.0), "eps")])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        gram_sinkhorn(**bad)


def test_bad_combinations_with_muon():
    with pytest.raises(ValueError, match="orthogonalize=False"):
        scale_by_muon(precondition=gram_sinkhorn(), orthogonalize=False, spectral_map="contra")
    with pytest.raises(ValueError, match="orthogonalize=False"):
        scale_by_muon(orthogonalize=False, aurora_iterations=2)
    with pytest.raises(ValueError, match="learning_rate"):
        sinksoap(-1.0)
