"""`scale_by_psgd_kron` / `psgd_kron` through the optax matrix (tests/optax_matrix.py) and
its properties; the step-by-step float64 check against Track 3 #33's own code is
`test_recipes_track3_psgd.py` (it also runs the transform inside `optax.partition`: the
recipe's groups)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from library.support import assert_lies_like, compiled_update, fsdp_matrices
from optax_snoo import NewtonSchulzPlan, psgd_kron, psgd_spectral_norm, scale_by_psgd_kron

PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": 0.3 * jax.random.normal(jax.random.key(7), (2, 4, 6))}


def test_optax_matrix(tmp_path):
    tx = psgd_kron(optax.linear_schedule(0.05, 0.01, 10))
    f64 = dict(float64=tx)  # the state follows the params' dtype: float64 params, float64 run
    m.check_jit_matches_eager(tx, PARAMS, steps=4, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=2)


def test_sharded_params():
    """On the 8-device mesh: the momentum keeps its param's sharding, the split matrices'
    factors live on their owners (none per leaf), and the run equals the unsharded one
    (float64 run as the reference): the probes are drawn per leaf wherever it lies."""
    make = lambda **kw: psgd_kron(optax.linear_schedule(0.05, 0.01, 10), **kw)
    mesh = m.mesh8()
    sharded = m.shard_params(PARAMS, mesh)  # "a" split over both axes, "b" over "model"
    tx = make(newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    p, state, _ = m.run(tx, sharded, 3, state=tx.init(sharded))
    assert_lies_like((state[0].mu, p), sharded)
    assert all(isinstance(x, optax.EmptyState) for x in state[0].q_a.values())
    assert state[0].owned
    plain = make()  # the plan names the sharded params' layout
    m.assert_runs_agree(p, m.run(plain, PARAMS, 3)[0], m.float64_run(plain, PARAMS, 3),
                        what="sharded vs unsharded", steps=3)


def test_fsdp_update_gathers_no_matrix():
    """On an 8-device FSDP mesh (rows split) the compiled update moves each whole matrix's
    ``M̂``, gradient and two probes to one owner and its direction back (two all-to-alls)
    and holds no all-gather or all-reduce (the probes are drawn where each leaf lies, with
    no collective); left to the partitioner (``shard_matrices=False``, the control) the
    factors' products gather the matrices."""
    params = fsdp_matrices()
    compiled = lambda **kw: compiled_update(scale_by_psgd_kron(
        newton_schulz_plan=NewtonSchulzPlan.from_params(params), **kw), params)

    state, cost = compiled()
    assert all(isinstance(x, optax.EmptyState) for x in state.q_a.values())
    assert dict(cost.counts) == {"all-to-all": 2}
    # one matrix per owner: its M̂, gradient and probes in, its direction out
    assert cost.by_kind["all-to-all"] <= 5 * 4 * 32 * 64
    assert compiled(shard_matrices=False)[1].counts["all-gather"] > 0


def test_bad_plan_fails_at_construction():
    with pytest.raises(ValueError, match="newton_schulz_plan must be a NewtonSchulzPlan"):
        scale_by_psgd_kron(newton_schulz_plan="fsdp")


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(scale_by_psgd_kron, PARAMS,
                                       dict(b1=0.9, precond_lr=0.5), float64=True)
    assert float(state.hyperparams["precond_lr"]) == pytest.approx(0.5)
    labels = lambda params: jax.tree.map(lambda p: "matrix" if p.ndim == 2 else "vector", params)
    tx = optax.partition({"matrix": psgd_kron(0.02, pin=None), "vector": optax.adam(1e-2)},
                         labels)
    m.check_nnx_optimizer(tx, steps=5)


def test_probes_depend_on_the_leaf_path_and_the_count():
    """Two leaves of equal shape and gradient get different draws, so different factors;
    the same tree twice gives the same run (the key lives in the state)."""
    p = {"x": jnp.ones((5, 3)), "y": jnp.ones((5, 3))}
    g = {"x": jnp.arange(15.0).reshape(5, 3), "y": jnp.arange(15.0).reshape(5, 3)}
    tx = scale_by_psgd_kron()
    u, s = tx.update(g, tx.init(p))
    assert not np.allclose(np.asarray(s.q_a["x"]), np.asarray(s.q_a["y"]))
    u2, _ = tx.update(g, tx.init(p))
    np.testing.assert_array_equal(np.asarray(u["x"]), np.asarray(u2["x"]))
    other, _ = scale_by_psgd_kron(seed=1).update(g, scale_by_psgd_kron(seed=1).init(p))
    assert not np.allclose(np.asarray(u["x"]), np.asarray(other["x"]))


def test_properties():
    # The factors stay upper triangular; the hyperball keeps every radius.
    tx = psgd_kron(0.05)
    p, state, _ = m.run(tx, PARAMS, 30)
    for q in jax.tree.leaves((state[0].q_a, state[0].q_b)):
        np.testing.assert_array_equal(np.asarray(jnp.tril(q, -1)), 0.0)
    for name in PARAMS:
        r0 = jnp.linalg.norm(PARAMS[name].reshape(-1, *PARAMS[name].shape[-2:]), axis=(-2, -1))
        r = jnp.linalg.norm(p[name].reshape(-1, *p[name].shape[-2:]), axis=(-2, -1))
        np.testing.assert_allclose(np.asarray(r), np.asarray(r0), rtol=2e-6)
    # The spectral estimate is exact for a rank-one PSD matrix, 0 for a zero one, and never
    # above the true norm for a PSD matrix.
    x = jnp.arange(1.0, 5.0)
    assert float(psgd_spectral_norm(jnp.outer(x, x))) == pytest.approx(float(x @ x), rel=1e-6)
    assert float(psgd_spectral_norm(jnp.zeros((3, 3)))) == 0.0
    a = jax.random.normal(jax.random.key(1), (6, 6))
    s = a @ a.T
    assert float(psgd_spectral_norm(s)) <= float(jnp.linalg.norm(s, 2)) * (1 + 1e-6)
