"""`scale_by_shampoo` / `shampoo` through the optax matrix (tests/optax_matrix.py) and its
properties; the step-by-step float64 check against the code of Track 3 #21 and #35 is
`test_recipes_track3_shampoo.py` (it also runs the transform inside `optax.partition`: the
recipes' groups)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from library.support import assert_lies_like, compiled_update, fsdp_matrices
from optax_snoo import NewtonSchulzPlan, scale_by_shampoo, shampoo, shampoo_inverse_root
from references.error import in_float64

PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": 0.3 * jax.random.normal(jax.random.key(7), (2, 4, 6))}


def test_optax_matrix(tmp_path):
    tx = shampoo(optax.linear_schedule(0.05, 0.01, 10), weight_decay=0.1, frequency=2)
    f64 = dict(float64=tx)  # the state follows the params' dtype: float64 params, float64 run
    m.check_jit_matches_eager(tx, PARAMS, steps=4, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=2)


def test_sharded_params():
    """On the 8-device mesh: the moments keep their param's sharding, the split matrices'
    factors and roots live on their owners (none per leaf), and the run equals the
    unsharded one (float64 run as the reference)."""
    make = lambda **kw: shampoo(optax.linear_schedule(0.05, 0.01, 10), weight_decay=0.1,
                                frequency=2, **kw)
    mesh = m.mesh8()
    sharded = m.shard_params(PARAMS, mesh)  # "a" split over both axes, "b" over "model"
    tx = make(newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    p, state, _ = m.run(tx, sharded, 3, state=tx.init(sharded))
    assert_lies_like((state[0].mu, state[0].nu, p), sharded)
    assert all(isinstance(x, optax.EmptyState) for x in state[0].left_root.values())
    assert state[0].owned
    plain = make()  # the plan names the sharded params' layout
    m.assert_runs_agree(p, m.run(plain, PARAMS, 3)[0], m.float64_run(plain, PARAMS, 3),
                        what="sharded vs unsharded", steps=3)


def test_fsdp_update_gathers_no_matrix():
    """On an 8-device FSDP mesh (rows split) the compiled update moves each whole matrix's
    gradient and filtered gradient to one owner and its direction back (two all-to-alls)
    and gathers no matrix: its only other collectives are the graft's per-matrix norms
    (scalars); left to the partitioner (``shard_matrices=False``, the control) the
    factors' products gather the matrices."""
    params = fsdp_matrices()
    compiled = lambda **kw: compiled_update(scale_by_shampoo(
        frequency=1, newton_schulz_plan=NewtonSchulzPlan.from_params(params), **kw), params)[1]

    cost = compiled()
    assert cost.counts["all-to-all"] == 2 and "all-gather" not in cost.counts
    assert cost.by_kind["all-to-all"] <= 3 * 4 * 32 * 64  # one matrix per owner
    assert cost.by_kind.get("all-reduce", 0) <= 4 * 2 * len(params)  # two norms per matrix
    assert compiled(shard_matrices=False).counts["all-gather"] > 0


def test_a_refresh_every_update_traces_no_branch():
    """With ``frequency = start = 1`` (#35) every update refreshes the roots: the update
    holds no conditional, so its compiled cost is the refresh's; otherwise the refresh
    is a ``cond``."""
    params = {"w": jnp.ones((4, 6))}
    conds = lambda tx: str(jax.make_jaxpr(tx.update)(params, tx.init(params))).count("cond[")
    assert conds(scale_by_shampoo(frequency=1)) == 0
    assert conds(scale_by_shampoo(frequency=2)) == conds(scale_by_shampoo(frequency=1,
                                                                          start=2)) == 1


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(
        scale_by_shampoo, PARAMS, dict(b1=0.8, b2=0.9, graft_b2=0.9, frequency=2),
        static_args=("frequency",), float64=True)
    assert float(state.hyperparams["b2"]) == pytest.approx(0.9)
    labels = lambda params: jax.tree.map(lambda p: "matrix" if p.ndim == 2 else "vector", params)
    tx = optax.partition({"matrix": shampoo(0.01, frequency=1), "vector": optax.adam(1e-2)},
                         labels)
    m.check_nnx_optimizer(tx, steps=5)


def run(tx, params, grads):
    state, outs, states = tx.init(params), [], []
    for g in grads:
        u, state = tx.update(g, state, params)
        outs.append(u)
        states.append(state)
    return outs, states


def grads(n, shape=(6, 4)):
    return [{"w": jax.random.normal(jax.random.key(10 + i), shape)} for i in range(n)]


def test_roots_refresh_at_start_then_every_frequency_updates():
    params = {"w": jnp.zeros((6, 4))}
    for frequency, start, refreshed in ((3, None, {3, 6, 9}), (3, 4, {4, 6, 9})):
        _, states = run(scale_by_shampoo(frequency=frequency, start=start), params, grads(10))
        roots = [np.asarray(s.left_root["w"]) for s in states]
        changed = {t for t in range(1, 11)
                   if not np.array_equal(roots[t - 1], roots[t - 2] if t > 1 else np.eye(6))}
        assert changed == refreshed


def test_adam_alone_before_start_and_adams_norm_after():
    """Before the first root the update is Adam's (optax.scale_by_adam with β₁ and the
    graft's β₂, eps); from it, Shampoo's direction with Adam's Frobenius norm per matrix."""
    params = {"w": jnp.zeros((2, 6, 4))}
    gs = grads(7, (2, 6, 4))
    outs, _ = run(scale_by_shampoo(0.9, 0.95, frequency=5, graft_b2=0.95, graft_eps=1e-10),
                  params, gs)
    adam, _ = run(optax.scale_by_adam(0.9, 0.95, 1e-10), params, gs)
    for t in range(4):
        np.testing.assert_allclose(outs[t]["w"], adam[t]["w"], rtol=1e-5, atol=1e-7)
    for t in range(4, 7):
        norms = lambda u: np.linalg.norm(np.asarray(u["w"]), axis=(-2, -1))
        np.testing.assert_allclose(norms(outs[t]), norms(adam[t]), rtol=1e-5)
        assert not np.allclose(outs[t]["w"], adam[t]["w"], rtol=1e-2)


def test_betas_zero_give_the_polar_factor():
    """Track 3 #22's identity: Shampoo with betas (0, 0), frequency 1, no grafting and
    exponent 1/4 is ``(GGᵀ)^(-1/4) G (GᵀG)^(-1/4) = U Vᵀ``; the pseudo-inverse handles the
    rank-deficient 6x6 factor of a 6x4 gradient (float64: rounding far below the cutoff)."""
    with in_float64():
        g = jax.random.normal(jax.random.key(0), (6, 4), jnp.float64)
        tx = scale_by_shampoo(0.0, 0.0, epsilon=0.0, frequency=1, pseudo_inverse=True,
                              rank_rtol=1e-10, grafting=None)
        u, _ = tx.update({"w": g}, tx.init({"w": g}))
        uu, _, vt = np.linalg.svd(np.asarray(g), full_matrices=False)
        np.testing.assert_allclose(np.asarray(u["w"]), uu @ vt, atol=1e-12)


def test_transposed_and_batched_leaves_agree():
    g = grads(6, (2, 6, 4))
    tx = scale_by_shampoo(frequency=2)
    outs, _ = run(tx, {"w": jnp.zeros((2, 6, 4))}, g)
    swapped = scale_by_shampoo(frequency=2, matrix_axes=(-1, -2))
    outs_t, _ = run(swapped, {"w": jnp.zeros((2, 4, 6))},
                    [{"w": jnp.swapaxes(x["w"], -1, -2)} for x in g])
    one, _ = run(tx, {"w": jnp.zeros((6, 4))}, [{"w": x["w"][1]} for x in g])
    for t in range(6):
        np.testing.assert_allclose(outs[t]["w"], jnp.swapaxes(outs_t[t]["w"], -1, -2),
                                   rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(outs[t]["w"][1], one[t]["w"], rtol=2e-4, atol=1e-6)


def test_inverse_root():
    with in_float64():
        a = jax.random.normal(jax.random.key(1), (5, 5), jnp.float64)
        x = a @ a.T + 0.1 * jnp.eye(5)
        r = shampoo_inverse_root(x, 0.25, 1e-12)
        lam, q = np.linalg.eigh(np.asarray(x) + 1e-12 * np.eye(5))
        np.testing.assert_allclose(np.asarray(r), (q * lam**-0.25) @ q.T, rtol=1e-10)
        # Damped: a spectrum below epsilon is shifted to start at epsilon.
        d = jnp.diag(jnp.array([-1.0, 0.0, 2.0]))
        np.testing.assert_allclose(np.diag(np.asarray(shampoo_inverse_root(d, 0.5, 1e-2))),
                                   np.array([1e-2, 1.01, 3.01]) ** -0.5, rtol=1e-12)
        # Pseudo-inverse: eigenvalues at or below the cutoff give 0.
        p = shampoo_inverse_root(jnp.diag(jnp.array([-1e-9, 0.0, 4.0])), 0.5,
                                 pseudo_inverse=True)
        np.testing.assert_allclose(np.diag(np.asarray(p)), [0.0, 0.0, 0.5], atol=1e-15)


def test_a_non_finite_root_keeps_the_previous_one():
    params = {"w": jnp.zeros((6, 4))}
    bad = grads(2)
    bad[1] = {"w": bad[1]["w"].at[0, 0].set(jnp.nan)}
    _, states = run(scale_by_shampoo(frequency=1), params, bad)
    np.testing.assert_array_equal(states[1].left_root["w"], states[0].left_root["w"])
    assert np.all(np.isfinite(np.asarray(states[1].right_root["w"])))


def test_bad_hyperparameters_fail_at_construction():
    with pytest.raises(ValueError, match="epsilon must be 0.0 with pseudo_inverse"):
        scale_by_shampoo(epsilon=1e-12, pseudo_inverse=True)
    with pytest.raises(ValueError, match="epsilon must be > 0 without pseudo_inverse"):
        scale_by_shampoo(epsilon=0.0)
    with pytest.raises(ValueError, match="start must be an int >= 5"):
        scale_by_shampoo(frequency=5, start=2)
    with pytest.raises(ValueError, match="frequency"):
        scale_by_shampoo(frequency=0)
    with pytest.raises(ValueError, match="b2 must be in"):
        scale_by_shampoo(b2=1.5)
    with pytest.raises(ValueError, match="grafting must be one of"):
        scale_by_shampoo(grafting="sgd")
    with pytest.raises(ValueError, match="root_exponent"):
        scale_by_shampoo(root_exponent=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        shampoo(0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="at least two axes"):
        scale_by_shampoo().init({"b": np.zeros(3)})
    with pytest.raises(ValueError, match="newton_schulz_plan must be a NewtonSchulzPlan"):
        scale_by_shampoo(newton_schulz_plan="fsdp")
