"""SOAP-Muon (optax_snoo.soap_whitening, soap_muon) against a float64 numpy
implementation written from modded-nanogpt Track 3 record #46's log code
(`soap_precondition_momentum`, `soap_update_preconditioner`, `soap_eigenbasis`,
`soap_basis_qr`, `trust_gate`, `bounded_trust_gate`, `norm_preserving_blend`,
`gram_frobenius_norm_estimate`, `zeropower_via_newtonschulz5`, `Muon.step`), in its
PyTorch (out, in) layout: each of our (in, out) leaves is transposed for it.

Eigenbases are defined up to the sign (and, for equal eigenvalues, the choice) of their
vectors; the whitened update is not. The first gradient is a rectangular diagonal with
distinct entries, so the first `eigh` returns signed standard basis vectors in both
implementations (also on the null space of the longer side), and later random gradients
make the Grams full rank (aspect ratios <= 2). The trajectories run in float64 (x64) and
compare the updates, which are invariant to those signs and orders.
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
    MatrixPrecondition,
    MuonState,
    NewtonSchulzPlan,
    OwnedPreconditionState,
    SoapMatrixState,
    orthogonalize,
    scale_by_muon,
    soap_muon,
    soap_whitening,
    trust_gate_cap,
    trust_gate_floor,
)
from optax_snoo.memory import soap_muon_state_bytes, state_bytes
from references.error import assert_as_accurate, program_text, run_in_float64
from references.soap import (
    RefSoapMuon,
    first_gradient,
    ref_frob_norm,
    ref_gram_norm,
    ref_newton_schulz,
)

F32, F64 = jnp.float32, jnp.float64
STEPS = 20
# Our (in, out) leaves: record-tall (out > in), record-wide, square, and a stack of 2.
SHAPES = {"tall": (6, 10), "wide": (10, 6), "square": (8, 8), "stack": (2, 6, 8)}


# ----------------------------------------------------------------------------------------
# The reference (float64 numpy, PyTorch (out, in) layout, from record #46's code) is
# references/soap.py; the gradients it runs on and its updates in our layout:


def gradients(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(STEPS):
        out.append({k: first_gradient(s, rng) if t == 0 else rng.standard_normal(s)
                    for k, s in SHAPES.items()})
    return out


def reference_updates(grads, *, freq, norm, gated_keys, fade, mu, beta2=None):
    """Per step, the reference update of every leaf, back in our (in, out) layout."""
    refs = {}
    for key, shape in SHAPES.items():
        mats = [()] if len(shape) == 2 else [(e,) for e in range(shape[0])]
        refs[key] = [(i, RefSoapMuon(shape[-1], shape[-2], freq, norm, key in gated_keys, fade))
                     for i in mats]
    history = []
    for t, g in enumerate(grads):
        step = {}
        for key, shape in SHAPES.items():
            u = np.zeros(shape)
            for i, ref in refs[key]:
                u[i] = ref.step(g[key][i].T, mu(t), t, beta2=beta2).T
            step[key] = u
        history.append(step)
    return history


CONFIGS = {
    # record #44/#46: every-step refresh, Gram norm, trust gate on some leaves
    "f1_gram_gated": dict(freq=1, norm_match="gram", gated=("square", "stack")),
    # record #14: refresh every 10 updates, Frobenius norm, no gate
    "f10_frobenius": dict(freq=10, norm_match="frobenius", gated=()),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_record_reference_step_by_step(name):
    cfg = CONFIGS[name]
    fade = (5, 15)  # the gate's floor fades and its cap lifts inside the run
    warm = lambda t: 0.85 + 0.10 * min(t / 10, 1.0)
    grads = gradients()
    expected = reference_updates(
        grads, freq=cfg["freq"], norm=ref_gram_norm if cfg["norm_match"] == "gram"
        else ref_frob_norm, gated_keys=cfg["gated"], fade=fade, mu=warm)
    with jax.enable_x64(True):
        whitening = soap_whitening(
            0.9, precondition_frequency=cfg["freq"], norm_match=cfg["norm_match"],
            trust_gate=lambda path: path in cfg["gated"],
            trust_floor=trust_gate_floor(0.45, *fade), trust_cap=trust_gate_cap(0.85, fade[1]))
        tx = scale_by_muon(
            lambda t: 0.85 + 0.10 * jnp.minimum(t.astype(jnp.float64) / 10, 1.0),
            precondition=whitening,
            ns_normalization="gram_frobenius", coefficients=((2.0, -1.5, 0.5),) * 12,
            ns_dtype=jnp.float64, mu_dtype=jnp.float64)
        params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
        state = tx.init(params)
        update = jax.jit(tx.update)
        for t, g in enumerate(grads):
            u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
            for key in SHAPES:
                np.testing.assert_allclose(
                    np.asarray(u[key]), expected[t][key], rtol=1e-7, atol=1e-9,
                    err_msg=f"{name}: leaf {key!r} at step {t}")
        assert int(state.count) == STEPS


def test_float32_run_matches_record_reference():
    """The default dtypes (float32 statistics, momentum and iteration) against the float64
    reference: 20 steps within 1e-5 of updates of size ~0.3 (measured: 2e-6 at worst)."""
    grads = gradients()
    fade = (5, 15)
    expected = reference_updates(grads, freq=1, norm=ref_gram_norm, gated_keys=("square",),
                                 fade=fade, mu=lambda t: 0.95)
    tx = soap_muon(1.0, trust_gate=lambda path: path == "square",
                   trust_floor=trust_gate_floor(0.45, *fade),
                   trust_cap=trust_gate_cap(0.85, fade[1]), ns_dtype=F32)
    params = {k: jnp.zeros(s, F32) for k, s in SHAPES.items()}
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update({k: jnp.asarray(v, F32) for k, v in g.items()}, state)
        for key in SHAPES:  # the learning rate 1 step is -update
            np.testing.assert_allclose(-np.asarray(u[key], np.float64), expected[t][key],
                                       rtol=0, atol=1e-5, err_msg=f"{key} at step {t}")


def run_f64(grads, scale=1.0, **whitening):
    """SOAP-Muon in float64 (momentum 0.95, the record's Newton-Schulz, no gate) on
    ``scale`` x ``grads``: per step the updates and the leaves' ``V`` after the update."""
    with jax.enable_x64(True):
        tx = scale_by_muon(precondition=soap_whitening(**whitening),
                           ns_normalization="gram_frobenius",
                           coefficients=((2.0, -1.5, 0.5),) * 12, ns_dtype=jnp.float64,
                           mu_dtype=jnp.float64)
        params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
        state, update, updates, second = tx.init(params), jax.jit(tx.update), [], []
        for g in grads:
            u, state = update({k: scale * jnp.asarray(v) for k, v in g.items()}, state, params)
            updates.append({k: np.asarray(v) for k, v in u.items()})
            second.append({k: np.asarray(state.precondition.leaves[k].second_moment)
                           for k in SHAPES})
    return updates, second


def test_whitening_is_scale_invariant_down_to_its_floor():
    """Muon's update does not depend on the gradient's scale, and SOAP's floor ``eps²`` on
    ``V`` keeps it so for gradients 1e-4 of these: their ``V`` (measured below) lies
    between ``eps²`` and ``eps`` on every entry, so a floor at ``eps`` would bind on every
    entry (the update would be the unwhitened momentum's) and the floor ``eps²`` on none.
    The first whitened step's ``V`` is ``(1-β) P²`` entry by entry, so a small entry of
    ``P`` makes a small ``V``: seed 2's smallest is 7.6e-8 at scale 1 (others reach 2e-13,
    where ``eps²`` would bind at scale 1e-4 too)."""
    eps, scale = 1e-8, 1e-4
    grads = gradients(seed=2)[:8]
    updates, second = run_f64(grads, scale, eps=eps)
    v = np.concatenate([x.ravel() for step in second[1:] for x in step.values()])  # V used
    assert 4 * eps ** 2 < v.min() and v.max() < eps / 4, (v.min(), v.max())
    expected = reference_updates(grads, freq=1, norm=ref_gram_norm, gated_keys=(),
                                 fade=(0, 0), mu=lambda t: 0.95)
    for t, step in enumerate(updates):
        for key in SHAPES:  # the tolerance of the float64 reference test above
            np.testing.assert_allclose(step[key], expected[t][key], rtol=1e-7, atol=1e-9,
                                       err_msg=f"leaf {key!r} at step {t}")


def test_beta2_is_the_second_moment_decay():
    """``beta2`` decays ``V`` (and ``beta`` the Grams alone): with ``beta2 = 0.6`` the run
    equals the float64 reference with that decay, and differs from ``beta2 = beta`` far
    beyond the reference test's tolerance (from step 2 on: the first whitened step's
    ``D = sign(P)/sqrt(1-β₂)`` does not depend on ``β₂`` once rescaled)."""
    grads = gradients()[:8]
    kw = dict(freq=1, norm=ref_gram_norm, gated_keys=(), fade=(0, 0), mu=lambda t: 0.95)
    expected = reference_updates(grads, beta2=0.6, **kw)
    updates, _ = run_f64(grads, beta=0.9, beta2=0.6)
    same, _ = run_f64(grads, beta=0.9)
    for t, step in enumerate(updates):
        for key in SHAPES:
            np.testing.assert_allclose(step[key], expected[t][key], rtol=1e-7, atol=1e-9,
                                       err_msg=f"leaf {key!r} at step {t}")
    gap = max(np.max(np.abs(step[k] - other[k]))
              for step, other in zip(updates, same, strict=True) for k in SHAPES)
    assert gap > 1e-2, gap  # updates of entries ~0.3


def test_state_shapes_and_layout():
    params = {k: jnp.zeros(s, F32) for k, s in SHAPES.items()}
    state = scale_by_muon(precondition=soap_whitening()).init(params).precondition
    assert isinstance(state, OwnedPreconditionState) and state.owned == ()
    leaves = state.leaves
    assert all(isinstance(s, SoapMatrixState) for s in leaves.values())
    # L over the fan_out axis (our last), R over fan_in: the record's sides swapped.
    assert leaves["tall"].gram_out.shape == (10, 10) and leaves["tall"].gram_in.shape == (6, 6)
    assert leaves["stack"].gram_out.shape == (2, 8, 8)
    assert leaves["stack"].basis_in.shape == (2, 6, 6)
    assert leaves["wide"].second_moment.shape == (6, 10)  # the record's (out, in)
    np.testing.assert_array_equal(leaves["stack"].basis_out,
                                  np.broadcast_to(np.eye(8), (2, 8, 8)))
    # (out, in) PyTorch layout via Muon's matrix_axes=(1, 0): L is then over axis 0.
    torch_state = scale_by_muon(precondition=soap_whitening(), matrix_axes=(1, 0)).init(
        {"w": jnp.zeros((10, 6))}).precondition
    assert torch_state.leaves["w"].gram_out.shape == (10, 10)
    assert torch_state.leaves["w"].second_moment.shape == (10, 6)


def test_pytorch_layout_equals_transposed_flax_layout():
    grads = gradients()
    f64 = dict(ns_dtype=jnp.float64, mu_dtype=jnp.float64, ns_normalization="gram_frobenius")
    with jax.enable_x64(True):
        flax = scale_by_muon(precondition=soap_whitening(), **f64)
        torch = scale_by_muon(precondition=soap_whitening(), matrix_axes=(1, 0), **f64)
        p = {"w": jnp.zeros((6, 10), jnp.float64)}
        s1, s2 = flax.init(p), torch.init({"w": p["w"].T})
        flax_update, torch_update = jax.jit(flax.update), jax.jit(torch.update)
        for t in range(4):
            g = jnp.asarray(grads[t]["tall"])
            u1, s1 = flax_update({"w": g}, s1)
            u2, s2 = torch_update({"w": g.T}, s2)
            np.testing.assert_allclose(u1["w"], u2["w"].T, rtol=1e-9, atol=1e-12)


def test_gram_frobenius_normalisation():
    x = np.random.default_rng(0).standard_normal((6, 10))
    expected = ref_newton_schulz(x.T).T  # the reference runs (out, in): any orientation
    got = orthogonalize(jnp.asarray(x), ((2.0, -1.5, 0.5),) * 12, jnp.float32,
                        normalization="gram_frobenius")
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match="ns_normalization"):
        orthogonalize(jnp.asarray(x), normalization="spectral")


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm_match"):
        soap_whitening(norm_match="spectral")
    with pytest.raises(ValueError, match="precondition_frequency"):
        soap_whitening(precondition_frequency=0)
    with pytest.raises(ValueError, match="beta"):
        soap_whitening(1.0)
    with pytest.raises(ValueError, match="beta2"):
        soap_whitening(beta2=1.0)
    with pytest.raises(ValueError, match="ns_normalization"):
        scale_by_muon(ns_normalization="gram")
    with pytest.raises(ValueError, match="precondition must be a MatrixPrecondition.*function"):
        scale_by_muon(precondition=lambda g: g)
    # A tree transform is refused, naming the per-matrix form and the chain before Muon.
    with pytest.raises(ValueError, match=r"MatrixPrecondition \(e.g. soap_whitening\(\)\).*"
                       r"GradientTransformation.*chain a transform before scale_by_muon"):
        scale_by_muon(precondition=optax.scale(-1.0))


def test_trust_gate_bounds():
    floor, cap = trust_gate_floor(), trust_gate_cap()
    np.testing.assert_allclose([float(floor(t)) for t in (0, 1374, 1375, 1500, 1625, 3000)],
                               [0.45, 0.45, 0.45, 0.225, 0.0, 0.0], atol=1e-7)
    assert [float(cap(t)) for t in (1624, 1625)] == [pytest.approx(0.85), 1.0]
    step = trust_gate_floor(0.45, 10, 10)
    assert [float(step(t)) for t in (9, 10)] == [pytest.approx(0.45), 0.0]


def test_memory_prediction_matches_state():
    params = {k: jnp.zeros(s, F32) for k, s in SHAPES.items()}
    state = soap_muon(0.02).init(params)
    # Momentum 4N + V 4N + L, R, Q_L, Q_R per matrix (float32); counts not counted.
    assert soap_muon_state_bytes(params) == state_bytes(state, statistics_only=True)
    n = 6 * 10
    assert soap_muon_state_bytes({"w": params["tall"]}) == 4 * (2 * n + 2 * (10 * 10 + 6 * 6))


# ----------------------------------------------------------------------------------------
# The optax matrix

# Square: a non-square matrix's first Gram is rank-deficient on its longer side, and the
# basis `eigh` gives its null space is decided by rounding; whitening then makes runs that
# round differently (jit vs eager, sharded) differ beyond rounding, as the record's would.
MATRICES = {"a": jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)), F32),
            "e": jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 8)), F32)}
adam_for_vectors = lambda p: jax.tree.map(lambda x: "soap" if x.ndim >= 2 else "adam", p)


def test_matrix_soap_muon(tmp_path):
    gate = lambda path: path == "e"
    make = lambda ns_dtype=F32, **kw: soap_muon(0.02, ns_dtype=ns_dtype, trust_gate=gate,
                                                trust_floor=trust_gate_floor(0.45, 1, 3), **kw)
    tx = make()
    tx64 = make(F64)  # the same in float64: momentum and whitening state follow the params
    m.check_jit_matches_eager(tx, MATRICES, steps=2, float64=tx64)
    m.check_state_stable(tx, MATRICES)
    m.check_dtype_preserved(soap_muon(0.02), MATRICES)  # bf16 params, bf16 Newton-Schulz
    m.check_inject_hyperparams(
        soap_muon, MATRICES, dict(learning_rate=lambda t: 0.02, beta=0.9, soap_beta=0.85,
                                  ns_dtype=F32, trust_gate=gate),
        static_args=("ns_dtype", "trust_gate", "coefficients", "precondition_frequency",
                     "mu_dtype"),
        float64=lambda **kw: soap_muon(**dict(kw, ns_dtype=F64)))
    m.check_multisteps(tx, MATRICES, float64=tx64)
    m.check_partition(tx, MATRICES, float64=tx64)
    check_sharded(make, MATRICES, plain=tx, float64=tx64)
    m.check_orbax_roundtrip(tx, MATRICES, tmp_path)
    state = tx.init(MATRICES)
    assert isinstance(state[0], MuonState)
    assert isinstance(state[0].precondition, OwnedPreconditionState)
    assert isinstance(state[0].precondition.leaves["e"], SoapMatrixState)
    assert state[0].precondition.leaves["e"].gram_out.shape == (2, 8, 8)


def check_sharded(make, params, steps=2, *, plain=None, float64=None):
    """SOAP-Muon on the 8-device ``(data 4, model 2)`` mesh: the momentum carries the
    param's sharding, the whitening's statistics lie on the matrices' owners (one row of
    the owners' flat state per device, nothing per leaf), and the run equals the unsharded
    one (as accurate as it, against its float64 run). ``make(newton_schulz_plan=...)``
    builds the transform; `plain` (``make()``) is the unsharded one and `float64`
    (``make(F64)``) its float64 computation (passed in, their compiled updates are reused)."""
    mesh = m.mesh8()
    sharded = m.shard_params(params, mesh)
    tx = make(newton_schulz_plan=NewtonSchulzPlan.from_params(sharded))
    state = tx.init(sharded)
    soap = state[0].precondition
    for key, p in sharded.items():
        assert state[0].mu[key].sharding.is_equivalent_to(p.sharding, p.ndim)
        assert soap.leaves[key] == optax.EmptyState(), key
    for table in soap.owned:
        assert table.shape[0] % 8 == 0 and len(table.sharding.device_set) == 8
        assert {s.data.shape[0] for s in table.addressable_shards} == {table.shape[0] // 8}
    p_sharded, state, _ = m.run(tx, sharded, steps, state=state)
    p_ref, _, _ = m.run(plain or make(), params, steps)
    exact = m.float64_run(float64 or make(F64), params, steps)
    assert_as_accurate(p_sharded, p_ref, exact, what="sharded vs unsharded")
    assert [t.shape for t in state[0].precondition.owned] == [t.shape for t in soap.owned]


def test_update_planning_another_assignment_than_init_is_named():
    """Concrete sharded params at init lay the statistics out on owners; a jitted update
    on Auto axes without a plan cannot see that layout and says what to pass."""
    sharded = m.shard_params(MATRICES, m.mesh8())
    tx = soap_muon(0.02, ns_dtype=F32)
    state = tx.init(sharded)
    with pytest.raises(ValueError, match="newton_schulz_plan=NewtonSchulzPlan"):
        jax.jit(tx.update)(sharded, state, sharded)


def test_whitening_on_owners_moves_gradient_with_momentum_and_equals_one_device():
    """On the 8-device FSDP mesh (rows split), SOAP-Muon's compiled step whitens each
    matrix on the device that orthogonalises it: its only collectives are the Newton-Schulz
    plan's two all-to-alls (none in a loop; the whitening's Grams, ``eigh`` and QR gather
    nothing), the way in carrying the momentum and the gradient (float32 iteration: 8
    bytes an element against Muon's 4, the way back the same: 1.5x Muon's bytes; 2.5x in
    bfloat16, benchmarks/README.md), and the updates equal the single-device ones (in the
    (out, in) orientation, as accurate as them against the float64 run). The
    first gradient is a rectangular diagonal (`first_gradient`), so the first ``eigh`` is
    exact also on the null space of a non-square matrix's longer side, and the MLP is
    2x wide, so the second gradient makes every Gram full rank before the first refresh
    (docs/soap_muon.md: rank-deficient bases are decided by rounding)."""
    d = 16
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "attn_proj": (d, d),
              "fc": (d, 2 * d), "mlp_proj": (2 * d, d)}
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = lambda s: P("fsdp", None) if s[0] <= s[1] else P(None, "fsdp")
    params = {k: jax.device_put(jnp.zeros(s, F32), NamedSharding(mesh, rows(s)))
              for k, s in shapes.items()}
    plan = NewtonSchulzPlan.from_params(params)
    gate = lambda path: path == "attn_proj"
    kw = dict(ns_dtype=F32, ns_normalization="gram_frobenius")
    soap = scale_by_muon(precondition=soap_whitening(trust_gate=gate),
                         newton_schulz_plan=plan, **kw)
    plain = scale_by_muon(newton_schulz_plan=plan, **kw)

    def compiled(tx):
        state = tx.init(params)
        exe = jax.jit(tx.update).lower(params, state, params).compile()
        return exe, state, hlo.analyze(exe.as_text())

    _, _, muon_cost = compiled(plain)
    exe, state, cost = compiled(soap)
    assert dict(muon_cost.counts) == {"all-to-all": 2}
    assert dict(cost.counts) == {"all-to-all": 2}, cost.counts
    assert cost.loop_collective_bytes == 0
    assert cost.collective_bytes == 1.5 * muon_cost.collective_bytes

    rng = np.random.default_rng(3)
    grads = [{k: (first_gradient(s, rng) if t == 0 else rng.standard_normal(s)).astype(np.float32)
              for k, s in shapes.items()} for t in range(4)]

    def one_device(grads, dtype, out_in=False):
        """The updates of the unsharded program; `out_in`: on the transposed matrices
        (``matrix_axes=(1, 0)``), the orientation the owners whiten in."""
        turn = (lambda x: x.T) if out_in else (lambda x: x)
        single = scale_by_muon(precondition=soap_whitening(trust_gate=gate), ns_dtype=dtype,
                               ns_normalization="gram_frobenius",
                               matrix_axes=(1, 0) if out_in else (-2, -1))
        one = {k: jax.device_put(turn(jnp.zeros(p.shape, dtype)), jax.devices()[0])
               for k, p in params.items()}
        state, update, out = single.init(one), jax.jit(single.update), []
        for g in grads:
            u, state = update({k: turn(v) for k, v in g.items()}, state, one)
            out.append({k: turn(v) for k, v in u.items()})
        return out

    # The peer whitens in the owners' (out, in) orientation: where a Gram is near-singular
    # (mlp_proj at update 2) the two orientations' float32 errors differ ~10x, and the
    # orientations are one computation (`test_pytorch_layout_equals_transposed_flax_layout`).
    single = one_device(grads, F32, out_in=True)
    exact = run_in_float64(lambda gs: one_device(gs, F64), grads)
    for t, g in enumerate(grads):
        out, state = exe({k: jax.device_put(v, params[k].sharding) for k, v in g.items()},
                         state, params)
        assert_as_accurate(out, single[t], exact[t], what=f"step {t}")


def test_nnx_optimizer():
    tx = optax.partition({"soap": soap_muon(0.02, ns_dtype=F32), "adam": optax.adam(3e-3)},
                         adam_for_vectors)
    m.check_nnx_optimizer(tx)


def test_trust_gate_by_tree_equals_by_path():
    """A tree of bools and a callable of the path select the same leaves in Muon; gating
    changes the gated leaf only (a low cap pulls it toward the momentum); the whitening
    leaves update 0's input alone and changes the later ones (the reference tests would
    not see a whitening that did nothing if the reference did nothing too)."""
    grads = gradients()
    params = {"a": jnp.zeros((8, 8), F32), "b": jnp.zeros((8, 8), F32)}
    treedef = jax.tree.structure(params)

    def whiten(gate):
        """The precondition alone, per leaf, on the flags Muon would pass it."""
        pre = soap_whitening(trust_gate=gate, trust_cap=0.3)
        flags = dict(zip(params, pre.flags(list(params), treedef), strict=True))
        # The flags are static (a numpy array of the batch's shape), closed over.
        jitted = lambda f: jax.jit(lambda *a: pre.apply(*a, np.full((1,), f)))
        apply = {k: jitted(flags[k]) for k in params}
        states = {k: pre.init(1, 8, 8, F32) for k in params}
        outs, programs = [], {}
        for t in range(3):
            g = jnp.asarray(grads[t]["square"], F32)[None]  # (1, out, in)
            out = {}
            for k in params:
                if t == 0:
                    programs[k] = program_text(apply[k].lower(g, g, states[k], jnp.int32(t)))
                out[k], states[k] = apply[k](g, g, states[k], jnp.int32(t))
            outs.append((g, out))
        return outs, programs

    (by_path, path_programs), (by_tree, tree_programs) = (
        whiten(lambda path: path == "a"), whiten({"a": True, "b": False}))
    # The same flags make the same programs, so bit for bit the same outputs.
    assert path_programs == tree_programs
    m.assert_trees_equal([o for _, o in by_path], [o for _, o in by_tree])
    for t, (g, out) in enumerate(by_tree):
        whitened = float(jnp.max(jnp.abs(out["b"] - g)))
        assert (whitened == 0.0) if t == 0 else (whitened > 1e-2), (t, whitened)
    assert float(jnp.max(jnp.abs(out["a"] - out["b"]))) > 1e-2

    def muon(gate):
        tx = scale_by_muon(precondition=soap_whitening(trust_gate=gate, trust_cap=0.3),
                           ns_dtype=F32)
        state, update, outs = tx.init(params), jax.jit(tx.update), []
        program = program_text(update.lower(params, state, params))
        for t in range(3):
            g = jnp.asarray(grads[t]["square"], F32)
            u, state = update({"a": g, "b": g}, state, params)
            outs.append(u)
        return outs, program

    # Through Muon (its flags plumbing): the same program, so bit for bit.
    (via_path, path_program), (via_tree, tree_program) = (
        muon(lambda path: path == "a"), muon({"a": True, "b": False}))
    assert path_program == tree_program
    m.assert_trees_equal(via_path, via_tree)
    assert float(jnp.max(jnp.abs(via_tree[-1]["a"] - via_tree[-1]["b"]))) > 1e-2


def test_precondition_hook_inputs():
    """A `MatrixPrecondition` gets each matrix's Newton-Schulz input ``M`` in the
    ``(out, in)`` layout (negating it negates the direction: NS is odd), its raw gradient
    ``G`` (orthogonalising it is Muon with momentum 0) and its own state, kept per
    matrix across updates."""
    params = {"w": jnp.zeros((6, 10), F32), "e": jnp.zeros((2, 6, 8), F32)}
    grads = [m.random_grads(params, t) for t in range(3)]
    seen = set()

    def per_matrix(fn):
        def apply(M, G, calls, count, flags):
            seen.add(M.shape)
            return fn(M, G), calls + 1
        return MatrixPrecondition(lambda batch, out, inn, dtype: jnp.zeros(batch, jnp.int32),
                                  apply)

    def run(tx, params=params, grads=grads):
        state, update, outs = tx.init(params), jax.jit(tx.update), []
        for g in grads:
            u, state = update(g, state, params)
            outs.append(u)
        return outs, state

    kw = dict(ns_dtype=F32)
    # Muon with momentum `beta` in float64: what the float32 programs below round.
    exact = lambda beta: run_in_float64(
        lambda p, gs: run(scale_by_muon(beta, ns_dtype=F64), p, gs)[0], params, grads)
    plain, _ = run(scale_by_muon(0.9, **kw))
    negated, state = run(scale_by_muon(0.9, precondition=per_matrix(lambda M, G: -M), **kw))
    assert seen == {(10, 6), (2, 8, 6)}
    np.testing.assert_array_equal(state.precondition.leaves["w"], 3)
    np.testing.assert_array_equal(state.precondition.leaves["e"], [3, 3])
    # Two programs XLA may fuse differently (the negation): as accurate as each other.
    negative = lambda tree: jax.tree.map(lambda x: -np.asarray(x, np.float64), tree)
    assert_as_accurate(negated, negative(plain), negative(exact(0.9)))
    # Another program than momentum 0's (the hook, its state): as accurate as it.
    assert_as_accurate(run(scale_by_muon(0.9, precondition=per_matrix(lambda M, G: G),
                                         **kw))[0],
                       run(scale_by_muon(0.0, **kw))[0], exact(0.0))


# ------------------------------------------ the blend and the denominator floor (#20-#34)

def run_plain_f64(grads):
    """`run_f64`'s Muon without the whitening (its Gram normalisation kept)."""
    with jax.enable_x64(True):
        tx = scale_by_muon(ns_normalization="gram_frobenius",
                           coefficients=((2.0, -1.5, 0.5),) * 12, ns_dtype=jnp.float64,
                           mu_dtype=jnp.float64)
        params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
        state, update, out = tx.init(params), jax.jit(tx.update), []
        for g in grads:
            u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
            out.append({k: np.asarray(v) for k, v in u.items()})
    return out


def test_blend_and_denominator_floor_at_their_ends():
    """``blend=1``, ``denom_floor=0`` is the default program; ``blend=0`` (no whitened
    share) and a floor far above every denominator (a constant denominator: ``Q_L P Q_Rᵀ =
    M``) both give Muon on the unwhitened momentum; a floor of 0.55 of the RMS (the
    records' on attn.v) binds and moves the update."""
    grads = gradients()[:12]
    default, _ = run_f64(grads)
    ends, _ = run_f64(grads, blend=1.0, denom_floor=0.0)
    plain = run_plain_f64(grads)
    unblended, _ = run_f64(grads, blend=0.0)
    floored, _ = run_f64(grads, denom_floor=1e6)
    partly, _ = run_f64(grads, denom_floor=0.55)
    for t in range(len(grads)):
        for k in SHAPES:
            np.testing.assert_array_equal(ends[t][k], default[t][k])
            np.testing.assert_allclose(unblended[t][k], plain[t][k], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(floored[t][k], plain[t][k], rtol=1e-9, atol=1e-11)
    gap = max(np.max(np.abs(partly[t][k] - default[t][k]))
              for t in range(len(grads)) for k in SHAPES)
    assert gap > 1e-2, gap


@pytest.mark.parametrize("kw,message", [
    (dict(blend=1.5), r"blend must be a number in \[0, 1\], got 1.5"),
    (dict(blend=None), r"blend must be a number in \[0, 1\], got None"),
    (dict(denom_floor=-0.1), "denom_floor must be >= 0"),
    (dict(denom_floor="0.5"), "denom_floor must be a number >= 0")])
def test_blend_and_floor_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        soap_whitening(**kw)
