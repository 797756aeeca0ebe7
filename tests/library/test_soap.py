"""`scale_by_soap` / `soap` through the optax matrix (tests/optax_matrix.py) and their
properties; the step-by-step float64 check against Track 3 #27's own code is
`test_recipes_track3_soaph.py` (it runs the transform inside the recipe's
`optax.partition`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from library.support import assert_lies_like, compiled_update, fsdp_matrices
from optax_snoo import NewtonSchulzPlan, SoapState, scale_by_soap, soap
from references.error import in_float64

# Square matrices: a non-square one's first Gram is rank-deficient on its longer side, where
# eigh's basis is arbitrary (float32 and float64 pick different ones) and SOAP's elementwise
# division is not rotation-invariant (non-square leaves: test_layout_stacks_...).
PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (6, 6)),
          "b": 0.3 * jax.random.normal(jax.random.key(7), (2, 5, 5))}


@pytest.mark.parametrize("factor_update", ["gram", "kl"])
def test_optax_matrix(tmp_path, factor_update):
    # At the first update the bases are the gradient's singular vectors, so Q_Lᵀ G Q_R is
    # diagonal up to rounding and the other entries of U are that rounding over
    # sqrt(V) + eps: float32 and float64 runs agree only where eps is far above float32's
    # rounding of G (the log's 1e-8 is not; see scale_by_soap).
    tx = soap(optax.linear_schedule(0.05, 0.01, 10), eps=1e-3, factor_update=factor_update)
    f64 = dict(float64=tx)  # the state follows the params' dtype: float64 params, float64 run
    m.check_jit_matches_eager(tx, PARAMS, steps=4, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=2)


def test_sharded_params():
    """On the 8-device mesh: the first moment keeps its param's sharding, the split
    matrix's statistics live on its owner (none per leaf), and the run equals the
    unsharded one. (`check_sharded_state` asks every state leaf shaped like a param to
    carry its sharding: a square matrix's Grams and bases have its shape but are
    statistics of both its axes; non-square leaves have rank-deficient first Grams.)"""
    mesh = m.mesh8()
    sharded = m.shard_params(PARAMS, mesh)  # "a" split over "model", "b" replicated
    tx = soap(0.05, eps=1e-3, newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    p, state, _ = m.run(tx, sharded, 2, state=tx.init(sharded))
    assert isinstance(state[0].matrices["a"], optax.EmptyState)
    assert state[0].matrices["b"].gram_out.shape == (2, 5, 5) and len(state[0].owned) == 1
    assert_lies_like((state[0].mu, p), sharded)
    plain = soap(0.05, eps=1e-3)  # the plan names the sharded params' layout
    m.assert_runs_agree(p, m.run(plain, PARAMS, 2)[0], m.float64_run(plain, PARAMS, 2),
                        what="sharded vs unsharded")


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(scale_by_soap, PARAMS, dict(b1=0.9, b2=0.95, eps=1e-3),
                                       static_args=("precondition_frequency",), float64=True)
    assert float(state.hyperparams["b2"]) == pytest.approx(0.95)
    labels = lambda params: jax.tree.map(lambda p: "matrix" if p.ndim == 2 else "vector", params)
    tx = optax.partition({"matrix": soap(0.02, pin=None), "vector": optax.adam(1e-2)}, labels)
    m.check_nnx_optimizer(tx, steps=5)


def _steps(tx, params, grads):
    state, update = tx.init(params), jax.jit(tx.update)
    out = []
    for g in grads:
        u, state = update(g, state, params)
        out.append(u)
    return out, state


def test_layout_stacks_and_the_first_basis():
    """A (in, out) kernel and its transpose with matrix_axes swapped give transposed
    updates; a stack is its matrices alone; the first bases are the first gradient's Gram
    eigenvectors by decreasing eigenvalue, orthonormal after every refresh."""
    with in_float64():
        rng = np.random.default_rng(0)
        grads = [jnp.asarray(rng.standard_normal((3, 5, 4))) for _ in range(4)]
        stack, state = _steps(scale_by_soap(), {"w": grads[0]}, [{"w": g} for g in grads])
        for e in range(3):
            one, _ = _steps(scale_by_soap(), {"w": grads[0][e]}, [{"w": g[e]} for g in grads])
            swapped, _ = _steps(scale_by_soap(matrix_axes=(-1, -2)), {"w": grads[0][e].T},
                                [{"w": g[e].T} for g in grads])
            for a, b, c in zip(stack, one, swapped, strict=True):
                np.testing.assert_allclose(a["w"][e], b["w"], rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(c["w"].T, b["w"], rtol=1e-12, atol=1e-12)
        st = state.matrices["w"]
        for q in (st.basis_out, st.basis_in):
            eye = jnp.broadcast_to(jnp.eye(q.shape[-1]), q.shape)
            np.testing.assert_allclose(jnp.swapaxes(q, -1, -2) @ q, eye, atol=1e-12)
        # One update with no refresh: the bases are eigh's of the first gradient's Grams.
        g = grads[0][0]
        _, s1 = _steps(scale_by_soap(precondition_frequency=5), {"w": g}, [{"w": g}])
        G = g.T  # the record's (out, in) view of our (in, out) kernel
        for q, gram in ((s1.matrices["w"].basis_out, G @ G.T),
                        (s1.matrices["w"].basis_in, G.T @ G)):
            vals = jnp.diag(q.T @ gram @ q)
            np.testing.assert_allclose(q.T @ gram @ q, jnp.diag(vals), atol=1e-10)
            assert np.all(np.diff(np.asarray(vals)) <= 1e-12)


def test_properties():
    # The hyperball keeps every matrix's radius; a fixed gradient gives a direction with
    # the sign of Adam's (momentum over the root of the second moment).
    p, state, _ = m.run(soap(0.05), PARAMS, 30)
    for name in PARAMS:
        r0 = jnp.linalg.norm(PARAMS[name].reshape(-1, *PARAMS[name].shape[-2:]), axis=(-2, -1))
        r = jnp.linalg.norm(p[name].reshape(-1, *p[name].shape[-2:]), axis=(-2, -1))
        np.testing.assert_allclose(np.asarray(r), np.asarray(r0), rtol=2e-6)
    assert isinstance(state[0], SoapState)
    g = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)}
    u, _ = _steps(scale_by_soap(), g, [g] * 3)
    assert float(jnp.sum(u[-1]["w"] * g["w"])) > 0


def test_kl_first_update_builds_statistics_only():
    """KL-SOAP's first update returns zeros and leaves the moments out; its factors are
    the first gradient's Grams over the other side's size, its inverse roots 0.1^-1/2."""
    g = {"w": jnp.asarray(np.random.default_rng(2).standard_normal((6, 4)), jnp.float32)}
    tx = scale_by_soap(factor_update="kl")
    state = tx.init(g)
    assert state.kl_inverse_roots["w"][0].shape == (4,)
    u, state = tx.update(g, state)
    np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
    np.testing.assert_array_equal(np.asarray(state.mu["w"]), 0.0)
    G = g["w"].T  # the record's (out, in) view
    np.testing.assert_allclose(state.matrices["w"].gram_out, G @ G.T / 6, rtol=1e-5)
    np.testing.assert_allclose(state.matrices["w"].gram_in, G.T @ G / 4, rtol=1e-5)
    for r in state.kl_inverse_roots["w"]:
        np.testing.assert_allclose(r, 0.1 ** -0.5, rtol=1e-6)
    u, state = tx.update(g, state)
    assert float(jnp.sum(u["w"] * g["w"])) > 0
    assert isinstance(scale_by_soap().init(g).kl_inverse_roots, optax.EmptyState)


@pytest.mark.parametrize("kwargs, match", [
    (dict(b1=1.0), "b1 must be in"), (dict(b2=-0.1), "b2 must be in"),
    (dict(shampoo_beta=1.5), "shampoo_beta must be in"), (dict(eps=0.0), "eps must be > 0"),
    (dict(precondition_frequency=0), "precondition_frequency must be an int >= 1"),
    (dict(factor_update="shampoo"), r"factor_update must be one of \('gram', 'kl'\), got "
                                    "'shampoo'"),
    (dict(matrix_axes=(1, 1)), "matrix_axes must be two distinct ints")])
def test_bad_hyperparameters_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_by_soap(**kwargs)


def test_bad_leaves_fail_at_init():
    with pytest.raises(ValueError, match=r"at least two axes.*\['b'\] has shape \(3,\)"):
        scale_by_soap().init({"b": jnp.zeros(3)})
    with pytest.raises(ValueError, match="matrix_axes"):
        scale_by_soap(matrix_axes=(0, 2)).init({"w": jnp.zeros((3, 4))})
    with pytest.raises(ValueError, match="newton_schulz_plan must be a NewtonSchulzPlan"):
        scale_by_soap(newton_schulz_plan="fsdp")


@pytest.mark.parametrize("factor_update", ["gram", "kl"])
def test_fsdp_update_gathers_no_matrix(factor_update):
    """On an 8-device FSDP mesh (rows split), the compiled update sends each whole matrix's
    gradient and first moment to one owner and its direction back (two all-to-alls, at
    most three whole matrices of the largest owner's per device), and holds no all-gather
    or all-reduce; left to the partitioner (``shard_matrices=False``, the control) the
    Gram products gather the matrices."""
    params = fsdp_matrices()
    compiled = lambda **kw: compiled_update(scale_by_soap(
        factor_update=factor_update, newton_schulz_plan=NewtonSchulzPlan.from_params(params),
        **kw), params)

    state, cost = compiled()
    assert all(isinstance(x, optax.EmptyState) for x in state.matrices.values())
    assert dict(cost.counts) == {"all-to-all": 2}
    # one matrix per owner: its gradient and first moment in, its direction out
    assert cost.by_kind["all-to-all"] <= 3 * 4 * 32 * 64
    assert compiled(shard_matrices=False)[1].counts["all-gather"] > 0
