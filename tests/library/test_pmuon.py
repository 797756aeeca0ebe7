"""PMuon's precondition (optax_snoo.pmuon_precondition): its streaming power against the
exact normalised power, against a float64 numpy transcription of modded-nanogpt Track 3
result #18's code per matrix (`references.pmuon`, PyTorch's (out, in) layout), the optax
matrix of Muon with it, and the 8-device mesh path (the precondition on the matrices'
owners).

Non-square matrices: a longer side's first covariance is singular, and the basis the
orthogonal iteration gives its null space is made of rounding, from which the next update
starts; so (as in tests/library/test_soap_muon.py) two programs that round differently
agree only where that null space is exact: the first gradient of a non-square matrix is
zero outside its leading square block (exact zero rows in both programs) and aspect
ratios are at most 2 (full rank from the second update on); the matrix checks use square
matrices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_matrix as m
from benchmarks import hlo
from optax_snoo import (
    MuonState,
    NewtonSchulzPlan,
    OwnedPreconditionState,
    PMuonState,
    muon,
    pmuon_precondition,
    scale_by_muon,
)
from optax_snoo._src.pmuon import covariance_power, initial_basis
from references.error import assert_as_accurate, run_in_float64
from references.pmuon import RefPMuon, start_basis, zeropower

F32, F64 = jnp.float32, jnp.float64


def block_first(shape, rng, size=1.0):
    """A gradient zero outside each matrix's leading square block (our (in, out) layout)."""
    g = size * rng.standard_normal(shape)
    k = min(shape[-2:])
    g[..., k:, :] = 0.0
    g[..., :, k:] = 0.0
    return g


def gradients(shapes, steps, seed=0, size=1.0):
    rng = np.random.default_rng(seed)
    return [{k: (block_first(s, rng, size) if t == 0 else size * rng.standard_normal(s))
             for k, s in shapes.items()} for t in range(steps)]


# ----------------------------------------------------------------------------------------
# The streaming power


def test_covariance_power_converges_to_the_normalised_power():
    """On a fixed covariance the orthogonal iteration finds its eigenvectors, so the power
    becomes ``C^{-γ}`` with eigenvalues of RMS 1 (``sqrt(n)/‖λ^{-γ}‖``)."""
    n, gamma, eps = 12, 0.3, 1e-6
    rng = np.random.default_rng(0)
    V = np.linalg.qr(rng.standard_normal((n, n)))[0]
    lam = 2.0 ** np.arange(n)  # distinct, so the iteration converges
    C = (V * lam) @ V.T
    d = lam ** -gamma
    exact = (V * d) @ V.T * np.sqrt(n) / (np.linalg.norm(d) + eps)
    with jax.enable_x64(True):
        Q = initial_basis(n, 0, F64)
        step = jax.jit(lambda q: covariance_power(jnp.asarray(C), q, gamma, eps))
        for _ in range(120):
            Pow, Q = step(Q)
        Pow = np.asarray(Pow)
    np.testing.assert_allclose(Pow, exact, atol=1e-12)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(Pow)),
                               np.sort(d * np.sqrt(n) / (np.linalg.norm(d) + eps)), atol=1e-12)


def test_the_signs_of_the_basis_do_not_matter():
    """QR's sign convention: flipping columns of the basis flips the same columns of the
    new one and leaves the power unchanged."""
    n = 8
    rng = np.random.default_rng(1)
    X = rng.standard_normal((n, n))
    C = X @ X.T + 1e-6 * np.eye(n)
    signs = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    with jax.enable_x64(True):
        Q = np.asarray(initial_basis(n, 0, F64))
        p1, q1 = covariance_power(jnp.asarray(C), jnp.asarray(Q), 0.3, 1e-6)
        p2, q2 = covariance_power(jnp.asarray(C), jnp.asarray(Q * signs), 0.3, 1e-6)
    np.testing.assert_allclose(np.asarray(p2), np.asarray(p1), atol=1e-13)
    np.testing.assert_allclose(np.abs(np.asarray(q2)), np.abs(np.asarray(q1)), atol=1e-13)


def test_initial_basis_is_orthogonal_and_the_same_for_every_dtype():
    q32 = np.asarray(initial_basis(6, 0, F32))
    np.testing.assert_allclose(q32.T @ q32, np.eye(6), atol=1e-6)
    with jax.enable_x64(True):
        q64 = np.asarray(initial_basis(6, 0, F64))
    np.testing.assert_allclose(np.abs(q64), np.abs(start_basis(6)), atol=1e-12)
    np.testing.assert_allclose(q64, q32, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Against the record's code, per matrix

SHAPES = {"square": (8, 8), "wide": (6, 12), "tall": (12, 6), "stack": (2, 8, 6)}
CONFIGS = {
    "record": dict(kw={}, size=1.0),
    # the Rayleigh quotients floored (eps above the damping), another decay and power
    "floored": dict(kw=dict(beta=0.9, gamma=0.5, damping=1e-4, eps=1e-3), size=0.01),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_the_records_code_per_matrix_in_float64(name):
    """`scale_by_muon(precondition=pmuon_precondition(...))` on Flax (in, out) leaves and a
    stack: each matrix's update is the record's ``zeropower(A_neg @ u @ C_neg)`` times
    ``sqrt(max(1, out/in))`` of that matrix alone, over 12 updates."""
    cfg = CONFIGS[name]
    steps = 12
    grads = gradients(SHAPES, steps, size=cfg["size"])
    refs = {k: [RefPMuon(s[-1], s[-2], **cfg["kw"]) for _ in range(int(np.prod(s[:-2])))]
            for k, s in SHAPES.items()}
    with jax.enable_x64(True):
        tx = scale_by_muon(0.95, precondition=pmuon_precondition(**cfg["kw"]),
                           coefficients="track3", ns_dtype=F64)
        params = {k: jnp.zeros(s, F64) for k, s in SHAPES.items()}
        state, update = tx.init(params), jax.jit(tx.update)
        for t, g in enumerate(grads):
            got, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
            for k, s in SHAPES.items():
                mats = np.asarray(g[k]).reshape(-1, *s[-2:])
                want = np.stack([ref.update(x.T).T for ref, x in zip(refs[k], mats,
                                                                      strict=True)])
                np.testing.assert_allclose(np.asarray(got[k]).reshape(want.shape), want,
                                           atol=1e-11, err_msg=f"{k} at update {t}")


def test_gamma_zero_is_muon():
    """``γ = 0``: every eigenvalue's power is 1, the power is ``I`` up to
    ``sqrt(n)/(sqrt(n) + eps)``, which the iteration's normalisation removes."""
    grads = gradients(SHAPES, 4)
    with jax.enable_x64(True):
        params = {k: jnp.zeros(s, F64) for k, s in SHAPES.items()}
        outs = []
        for pre in (pmuon_precondition(gamma=0.0), None):
            tx = scale_by_muon(precondition=pre, coefficients="track3", ns_dtype=F64)
            state, out, update = tx.init(params), [], jax.jit(tx.update)
            for g in grads:
                u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
                out.append(u)
            outs.append(out)
    for a, b in zip(*outs, strict=True):
        for k in a:
            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=1e-10)


def test_the_precondition_changes_the_update():
    """With the record's γ the update is not Muon's (the comparisons above would not see a
    precondition that did nothing if the transcription did nothing too)."""
    grads = gradients({"w": (8, 8)}, 3)
    params = {"w": jnp.zeros((8, 8), F32)}
    outs = []
    for pre in (pmuon_precondition(), None):
        tx = scale_by_muon(precondition=pre, ns_dtype=F32)
        state, update = tx.init(params), jax.jit(tx.update)
        for g in grads:
            u, state = update({"w": jnp.asarray(g["w"], F32)}, state, params)
        outs.append(np.asarray(u["w"]))
    assert np.linalg.norm(outs[0] - outs[1]) > 0.1 * np.linalg.norm(outs[1])


def test_state_layout():
    tx = scale_by_muon(precondition=pmuon_precondition())
    state = tx.init({"w": jnp.zeros((6, 10), F32), "e": jnp.zeros((3, 4, 5), F32)})
    w, e = state.precondition.leaves["w"], state.precondition.leaves["e"]
    assert isinstance(w, PMuonState)
    # (in, out) kernels: L over fan_out (10), R over fan_in (6); a stack keeps its axis
    assert (w.cov_out.shape, w.cov_in.shape, w.basis_out.shape, w.basis_in.shape) == (
        (10, 10), (6, 6), (10, 10), (6, 6))
    assert (e.cov_out.shape, e.cov_in.shape) == ((3, 5, 5), (3, 4, 4))
    assert w.cov_out.dtype == F32
    np.testing.assert_allclose(np.asarray(e.basis_in[2]), np.asarray(initial_basis(4, 0, F32)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(beta=1.0), "beta"), (dict(beta=-0.1), "beta"), (dict(gamma=-0.3), "gamma"),
    (dict(damping=0.0), "damping"), (dict(eps=-1e-6), "eps"), (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pmuon_precondition(**kwargs)


# ----------------------------------------------------------------------------------------
# The optax matrix (square matrices: see the module docstring)

MATRICES = {"a": jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)), F32),
            "e": jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 8)), F32)}


def make(learning_rate=0.02, beta=0.95, gamma=0.3, ns_dtype=F32, newton_schulz_plan=None):
    return muon(learning_rate, precondition=pmuon_precondition(beta, gamma),
                ns_dtype=ns_dtype, newton_schulz_plan=newton_schulz_plan)


def test_matrix_pmuon(tmp_path):
    tx, tx64 = make(), make(ns_dtype=F64)  # the state follows the params: float64 for x64
    m.check_jit_matches_eager(tx, MATRICES, steps=3, float64=tx64)
    m.check_state_stable(tx, MATRICES)
    m.check_dtype_preserved(make(ns_dtype=jnp.bfloat16), MATRICES)
    m.check_inject_hyperparams(
        make, MATRICES, dict(learning_rate=lambda t: 0.02, beta=0.9, gamma=0.25),
        static_args=("ns_dtype", "newton_schulz_plan"),
        float64=lambda **kw: make(**kw, ns_dtype=F64))
    m.check_multisteps(tx, MATRICES, float64=tx64)
    m.check_partition(tx, MATRICES, float64=tx64)
    m.check_orbax_roundtrip(tx, MATRICES, tmp_path, steps_before=2, steps_after=2)
    state = tx.init(MATRICES)
    assert isinstance(state.inner_states["muon"].inner_state[0], MuonState)


def test_sharded_on_owners_equals_unsharded():
    """On the 8-device ``(data 4, model 2)`` mesh the statistics and bases lie on the
    matrices' owners (one row of the owners' flat state per device, nothing per leaf), and
    the run is as accurate as the unsharded one against its float64 run."""
    mesh = m.mesh8()
    sharded = m.shard_params(MATRICES, mesh)
    tx = make(newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    state = tx.init(sharded)
    pre = state.inner_states["muon"].inner_state[0].precondition
    assert isinstance(pre, OwnedPreconditionState)
    for key in sharded:
        assert pre.leaves[key] == optax.EmptyState(), key
    for table in pre.owned:
        assert table.shape[0] % 8 == 0 and len(table.sharding.device_set) == 8
    p_sharded, _, _ = m.run(tx, sharded, 3, state=state)
    p_ref, _, _ = m.run(make(), MATRICES, 3)
    exact = m.float64_run(make(ns_dtype=F64), MATRICES, 3)
    assert_as_accurate(p_sharded, p_ref, exact, what="sharded vs unsharded")


def test_on_owners_of_a_block_one_redistribution_each_way_and_equals_one_device():
    """A transformer block's six matrices, rows split over an 8-device FSDP mesh: the
    compiled update's only collectives are the Newton-Schulz plan's two all-to-alls (none
    in a loop: the covariances, QRs and powers gather nothing; the bytes of SOAP-Muon's),
    and the updates equal the single-device ones (as accurate as them against the float64 run)."""
    d = 16
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "attn_proj": (d, d),
              "fc": (d, 2 * d), "mlp_proj": (2 * d, d)}
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = lambda s: P("fsdp", None) if s[0] <= s[1] else P(None, "fsdp")
    params = {k: jax.device_put(jnp.zeros(s, F32), NamedSharding(mesh, rows(s)))
              for k, s in shapes.items()}
    plan = NewtonSchulzPlan.from_params(params)

    def compiled(tx):
        state = tx.init(params)
        exe = jax.jit(tx.update).lower(params, state, params).compile()
        return exe, state, hlo.analyze(exe.as_text())

    _, _, muon_cost = compiled(scale_by_muon(ns_dtype=F32, newton_schulz_plan=plan))
    exe, state, cost = compiled(scale_by_muon(precondition=pmuon_precondition(), ns_dtype=F32,
                                              newton_schulz_plan=plan))
    assert dict(cost.counts) == {"all-to-all": 2}, cost.counts
    assert cost.loop_collective_bytes == 0
    # in: the momentum and the raw gradient (a `MatrixPrecondition` gets both; PMuon reads
    # the momentum only), out: the result, each float32: 1.5x Muon's float32 bytes
    assert cost.collective_bytes == 1.5 * muon_cost.collective_bytes

    grads = [{k: v.astype(np.float32) for k, v in g.items()} for g in gradients(shapes, 3)]

    def one_device(grads, dtype):
        single = scale_by_muon(precondition=pmuon_precondition(), ns_dtype=dtype)
        one = {k: jax.device_put(jnp.zeros(p.shape, dtype), jax.devices()[0])
               for k, p in params.items()}
        state, update, out = single.init(one), jax.jit(single.update), []
        for g in grads:
            u, state = update(g, state, one)
            out.append(u)
        return out

    single = one_device(grads, F32)
    exact = run_in_float64(lambda gs: one_device(gs, F64), grads)
    for t, g in enumerate(grads):
        out, state = exe({k: jax.device_put(v, params[k].sharding) for k, v in g.items()},
                         state, params)
        assert_as_accurate(out, single[t], exact[t], what=f"step {t}")


def test_zeropower_reference_is_the_track3_iteration():
    """The transcription's Newton-Schulz is the library's ``coefficients="track3"`` one
    (so the per-matrix comparison above compares the preconditions)."""
    from optax_snoo import orthogonalize

    x = np.random.default_rng(4).standard_normal((6, 10))
    with jax.enable_x64(True):
        ours = np.asarray(orthogonalize(jnp.asarray(x), coefficients="track3", ns_dtype=F64))
    np.testing.assert_allclose(ours, zeropower(x), atol=1e-12)
