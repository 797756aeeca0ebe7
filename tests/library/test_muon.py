"""Muon (optax_snoo.muon) against a float64 numpy implementation written from the formulas of
Jordan's Muon post (2024) and the modded-nanogpt records
(and, for the Polar Express preset, from the paper's Algorithm 1).

The reference (`references.muon`) is independent of the library: its own coefficient
tables, its own Newton-Schulz, momentum, smoothing, shape scale, weight decay and AdamW.
Trajectories run >= 100 steps with the Newton-Schulz iteration in float32 and are compared
step by step.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import optax_matrix as m
from optax_snoo import (
    MatrixPrecondition,
    MuonGroup,
    MuonState,
    add_decoupled_weight_decay,
    muon,
    muon_momentum_warmup,
    orthogonalize,
    scale_by_muon,
)
from references.error import assert_as_accurate, bound, error, program_text, run_in_float64
from references.muon import KELLER, MODDED, RefMuon, ref_ns, ref_scalar_ns

# Amsel et al. 2025 (arXiv 2505.16932), Algorithm 1, copied from the paper: the degree-5
# polynomials for l = 1e-3, safety factor 1.01 on all but the last, input normalised by
# 1.01 ||X||_F + 1e-7.
PAPER_POLAR_EXPRESS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
PAPER_POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5)
                       for a, b, c in PAPER_POLAR_EXPRESS[:-1]] + [PAPER_POLAR_EXPRESS[-1]]


def ref_polar_express(x, steps=5):
    """The paper's Algorithm 1 in float64 (its own normalisation, no folding)."""
    X = np.asarray(x, np.float64)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = np.swapaxes(X, -1, -2)
    X = X / (np.linalg.norm(X, axis=(-2, -1), keepdims=True) * 1.01 + 1e-7)
    for a, b, c in PAPER_POLAR_EXPRESS[:steps]:
        A = X @ np.swapaxes(X, -1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return np.swapaxes(X, -1, -2) if transposed else X


# The same as triples on the plain ||X||_F normalisation: p1(x / 1.01).
PE_FOLDED = ((PAPER_POLAR_EXPRESS[0][0] / 1.01, PAPER_POLAR_EXPRESS[0][1] / 1.01**3,
              PAPER_POLAR_EXPRESS[0][2] / 1.01**5), *PAPER_POLAR_EXPRESS[1:5])
PRESETS = {"keller": KELLER, "modded": MODDED, "polar_express": PE_FOLDED}
F32, F64 = jnp.float32, jnp.float64
# Jitted once per (shape, coefficients, dtype): eager lax.scan would compile op by op.
ortho = jax.jit(orthogonalize, static_argnums=(1, 2, 3))


# ----------------------------------------------------------------------------------------
# The float64 reference (the Muon update of modded-nanogpt) is references/muon.py.


def normal(shape, seed, scale=1.0):
    """Test data from numpy: each new shape given to jax.random.normal costs a compile."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), F32)


def normal_tree(params, step):
    """Gradient-like tree for `step` (float32, independent of the params' values)."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([normal(np.shape(x), seed=(step, i)) for i, x in enumerate(leaves)])


# A transformer-ish tree: attention/MLP matrices (both aspect ratios), an expert stack,
# and the 0-D/1-D leaves Muon must leave to Adam.
PARAMS = {
    "wq": normal((8, 16), seed=1, scale=0.1),
    "mlp_proj": normal((16, 8), seed=3, scale=0.1),
    "experts": normal((2, 6, 12), seed=4, scale=0.1),
    "norm": jnp.ones((16,)),
    "scalar": jnp.asarray(0.5, jnp.float32),
}
LABELS = {k: "muon" if v.ndim >= 2 else "adam" for k, v in PARAMS.items()}
WD_MUL = {k: 2.0 if k.startswith("mlp") else 1.0 for k in PARAMS}
LR_MUL = {k: 0.5 if k.startswith("mlp") else 1.0 for k in PARAMS}
# The record's wd_mul 2 on the MLP matrices as Muon groups: twice the decay there.
MLP_GROUPS = [MuonGroup(r"^mlp", weight_decay=0.02, name="mlp"), MuonGroup(".*")]
ndim_labels = lambda p: jax.tree.map(lambda x: "muon" if x.ndim >= 2 else "adam", p)
MATRICES = {"v": PARAMS["mlp_proj"], "e": PARAMS["experts"]}  # transposed path and a stack
MIXED = dict(MATRICES, norm=PARAMS["norm"], scalar=PARAMS["scalar"])  # + Adam's 1-D and 0-D


def first_update(tx, grads, params=None):
    """One jitted update from a fresh state (eager mode would compile op by op)."""
    return jax.jit(tx.update)(grads, tx.init(grads if params is None else params), params)


def first_update64(make, grads):
    """`first_update(make(F64), grads)` on the float64 values of `grads` (x64 inside only):
    the computation that the float32 programs of `make(F32)` round. Two float32 programs
    of it (another blocking, batching or fusion) differ by their rounding of it, so they
    are compared by their errors against this (`references.error`), not by a fixed rtol."""
    return run_in_float64(lambda g: first_update(make(F64), g)[0], grads)


def in_dtype_of(grads, params):
    """`grads` cast to the params' dtypes (float64 in a float64 run)."""
    return jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)


def trajectory(tx, params, steps):
    """The params after `steps` jitted updates on `normal_tree` gradients, and the state."""
    state, update = tx.init(params), jax.jit(tx.update)
    for t in range(steps):
        u, state = update(in_dtype_of(normal_tree(params, t), params), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def update_sequence(tx, grads_like, steps):
    """The updates of `steps` jitted updates on `normal_tree` gradients without params,
    and the last state."""
    state, update, out = tx.init(grads_like), jax.jit(tx.update), []
    for t in range(steps):
        u, state = update(in_dtype_of(normal_tree(grads_like, t), grads_like), state)
        out.append(u)
    return out, state


def cooldown(T, frac=0.7, final=0.01, xp=np):
    """The record's stable-then-cooldown learning-rate multiplier."""
    def mult(t):
        x = t / T
        return xp.where(x < 1 - frac, 1.0, (1 - x) / frac * (1 - final) + final)
    return mult


STEPS = 100
CONFIGS = {
    "keller_nesterov_wd_mul": dict(
        ours=dict(learning_rate=0.02, beta=0.95, coefficients="keller", weight_decay=0.01,
                  muon_groups=MLP_GROUPS, adam_learning_rate=3e-3),
        ref=dict(lr=0.02, beta=0.95, triples=KELLER, wd=0.01, wd_mul=WD_MUL, adam_lr=3e-3)),
    "modded_plain_warmup_ema_smoothing": dict(
        ours=dict(learning_rate=0.03, beta=muon_momentum_warmup(0.85, 0.95, 50),
                  nesterov=False, smoothing=0.2, smoothing_form="ema", adam_b1=0.8,
                  adam_b2=0.95, adam_eps=1e-10, adam_weight_decay=0.1),
        ref=dict(lr=0.03, beta=lambda t: 0.85 + 0.10 * min(t / 50, 1), triples=MODDED,
                 nesterov=False, smoothing=0.2, smoothing_form="ema", b1=0.8, b2=0.95,
                 eps=1e-10, adam_wd=0.1)),
    "modded_nesterov_smoothing_schedules": dict(
        ours=dict(learning_rate=lambda t: 0.03 * cooldown(STEPS, xp=jnp)(t),
                  beta=muon_momentum_warmup(), weight_decay=0.01,
                  # The MLP group: its own schedule (half the rate) and twice the decay.
                  muon_groups=[MuonGroup("mlp", lambda t: 0.015 * cooldown(STEPS, xp=jnp)(t),
                                         weight_decay=0.02),
                               MuonGroup(".*", name="rest")],
                  smoothing=optax.linear_schedule(0.5, 0.2, 60), smoothing_form="nesterov"),
        ref=dict(lr=lambda t: 0.03 * cooldown(STEPS)(t),
                 beta=lambda t: 0.85 + 0.10 * min(t / 300, 1), triples=MODDED, wd=0.01,
                 wd_mul=WD_MUL, lr_mul=LR_MUL, smoothing=lambda t: 0.5 - 0.3 * min(t / 60, 1),
                 smoothing_form="nesterov")),
    "polar_express_consistent_rms": dict(
        ours=dict(learning_rate=0.01, beta=0.9, coefficients="polar_express",
                  shape_scale="consistent_rms", weight_decay=0.05),
        ref=dict(lr=0.01, beta=0.9, triples=PE_FOLDED, shape_scale="consistent_rms",
                 wd=0.05)),
    "keller_bias_corrected": dict(
        ours=dict(learning_rate=0.02, beta=0.9, coefficients="keller", bias_correction=True),
        ref=dict(lr=0.02, beta=0.9, triples=KELLER, bias_correction=True)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trajectory_matches_float64_reference(name):
    cfg = CONFIGS[name]
    tx = muon(ns_dtype=F32, labels=LABELS, **cfg["ours"])
    ref = RefMuon(PARAMS, LABELS, **cfg["ref"])
    update = jax.jit(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    adam_err, adam_scale = {}, {}
    for t in range(STEPS):
        grads = normal_tree(PARAMS, t)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        expected = ref.step(grads)
        for k, u in updates.items():
            err = np.max(np.abs(np.asarray(u, np.float64) - expected[k]))
            scale = np.max(np.abs(expected[k]))
            if LABELS[k] == "muon":
                # f32 Newton-Schulz: measured <= 3e-6 relative over these matrices.
                assert err / scale < 1e-5, (name, t, k, err / scale)
            else:
                adam_err[k] = max(adam_err.get(k, 0.0), err)
                adam_scale[k] = max(adam_scale.get(k, 0.0), scale)
    # AdamW leaves, relative to their largest update (a step where the decay and the Adam
    # term nearly cancel has no meaningful relative error): optax forms 1 - b2 from the
    # Python float but 1 - b2**t from b2 rounded to f32 (0.999: off by 1.3e-5), so the
    # measured error is 1.0e-5.
    for k, err in adam_err.items():
        assert 0 < err / adam_scale[k] < 3e-5, (name, k, err / adam_scale[k])
    for k, p in params.items():
        np.testing.assert_allclose(np.asarray(p, np.float64), ref.p[k], rtol=1e-5, atol=1e-5)


# Wide, tall and a stack of wide matrices (squares: the test after).
NORMUON_PARAMS = {"wq": PARAMS["wq"], "mlp_proj": PARAMS["mlp_proj"],
                  "experts": PARAMS["experts"], "norm": PARAMS["norm"]}
NORMUON_CONFIGS = {
    "normuon": dict(
        ours=dict(learning_rate=0.02, beta=0.95, beta2=0.95, weight_decay=0.01,
                  adam_learning_rate=3e-3),
        ref=dict(lr=0.02, beta=0.95, triples=MODDED, beta2=0.95, wd=0.01, adam_lr=3e-3)),
    "normuon_cautious_schedules": dict(
        ours=dict(learning_rate=lambda t: 0.03 * cooldown(STEPS, xp=jnp)(t),
                  beta=muon_momentum_warmup(0.85, 0.95, 50),
                  beta2=optax.linear_schedule(0.8, 0.95, 40),
                  weight_decay=0.05, adam_weight_decay=0.1, cautious_weight_decay=True),
        ref=dict(lr=lambda t: 0.03 * cooldown(STEPS)(t),
                 beta=lambda t: 0.85 + 0.10 * min(t / 50, 1), triples=MODDED,
                 beta2=lambda t: 0.8 + 0.15 * min(t / 40, 1), wd=0.05, adam_wd=0.1,
                 cautious=True)),
}


@pytest.mark.parametrize("name", sorted(NORMUON_CONFIGS))
def test_normuon_trajectory_matches_float64_reference(name):
    """NorMuon (and cautious decay on both groups) against the record's formulas in float64,
    100 steps, on wide, tall and stacked matrices."""
    cfg, labels = NORMUON_CONFIGS[name], ndim_labels(NORMUON_PARAMS)
    tx = muon(ns_dtype=F32, labels=labels, **cfg["ours"])
    ref = RefMuon(NORMUON_PARAMS, labels, **cfg["ref"])
    update = jax.jit(tx.update)
    params, state = NORMUON_PARAMS, tx.init(NORMUON_PARAMS)
    for t in range(STEPS):
        grads = normal_tree(NORMUON_PARAMS, t)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        expected = ref.step(grads)
        for k in ("wq", "mlp_proj", "experts"):
            err = np.max(np.abs(np.asarray(updates[k], np.float64) - expected[k]))
            assert err / np.max(np.abs(expected[k])) < 1e-5, (name, t, k)
    for k, p in params.items():
        np.testing.assert_allclose(np.asarray(p, np.float64), ref.p[k], rtol=1e-5, atol=1e-5)
    nu = state.inner_states["muon"].inner_state[0].nu
    assert nu["wq"].shape == (1, 16) and nu["mlp_proj"].shape == (16, 1)
    assert nu["experts"].shape == (2, 1, 12)


def test_normuon_on_square_matrices_reduces_over_fan_in():
    """Squares, on the NorMuon stage alone: fed the same orthogonalised input (our float32
    iteration; on a square matrix its float32 result is only ~1e-5 from float64's, the
    small singular values sitting where the polynomials are steep), the update equals the
    record's formula in float64, statistics per output neuron (one per column of (in, out)),
    over 5 steps of the EMA."""
    tx = scale_by_muon(0.0, ns_dtype=F32, shape_scale=None, beta2=0.9)  # beta 0: v = g
    ref = RefMuon({"w": jnp.zeros((12, 12))}, {"w": "muon"}, lr=1.0, beta=0.0, triples=MODDED,
                  beta2=0.9)
    update, state = jax.jit(tx.update), tx.init({"w": jnp.zeros((12, 12))})
    for t in range(5):
        g = normal((12, 12), seed=(t, 11))
        u, state = update({"w": g}, state)
        o = np.asarray(orthogonalize(g, "modded", F32), np.float64)
        np.testing.assert_allclose(np.asarray(u["w"], np.float64), ref.normuon("w", o, 0.9),
                                   rtol=0, atol=1e-6 * np.max(np.abs(o)))
    assert state.nu["w"].shape == (1, 12)


def test_normuon_on_a_dead_neuron_and_an_expert_with_no_tokens_stays_finite():
    """The floors (1e-10 under the second moment and under the rescaled norm) are what keep
    these finite: a neuron whose gradient is zero (its second moment stays 0) and an
    expert that got no tokens (its whole matrix zero: 0/0 without them). Over 4 steps the
    dead parts get exactly no update and the rest equals the record's formula (float64)."""
    tx = scale_by_muon(0.0, ns_dtype=F32, shape_scale=None, beta2=0.9)  # beta 0: v = g
    shapes = {"w": (12, 16), "experts": (2, 8, 12)}
    ref = RefMuon({k: jnp.zeros(v) for k, v in shapes.items()}, dict.fromkeys(shapes, "muon"),
                  lr=1.0, beta=0.0, triples=MODDED, beta2=0.9)
    update, state = jax.jit(tx.update), tx.init({k: jnp.zeros(v) for k, v in shapes.items()})
    for t in range(4):
        g = {k: normal(v, seed=(t, 21 + i)) for i, (k, v) in enumerate(shapes.items())}
        g["w"] = g["w"].at[:, 3].set(0.0)  # output neuron 3 never gets a gradient
        g["experts"] = g["experts"].at[1].set(0.0)  # expert 1 routed no token
        u, state = update(g, state)
        for k in shapes:
            assert np.all(np.isfinite(np.asarray(u[k]))), (k, t)
            o = np.asarray(orthogonalize(g[k], "modded", F32), np.float64)
            np.testing.assert_allclose(np.asarray(u[k], np.float64), ref.normuon(k, o, 0.9),
                                       rtol=0, atol=1e-6 * np.max(np.abs(o)))
        assert np.all(np.asarray(u["w"])[:, 3] == 0) and np.all(np.asarray(u["experts"])[1] == 0)
        assert float(np.max(np.abs(np.asarray(u["w"])))) > 0.1  # the rest does move
    assert np.all(np.asarray(state.nu["w"])[:, 3] == 0)


def test_normuon_keeps_the_frobenius_norm_and_evens_the_neurons():
    """Properties: the update's Frobenius norm is the orthogonalised one's, and a matrix
    whose orthogonalised rows differ in size comes out with rows of equal RMS at step 0."""
    w = normal((8, 32), seed=7)
    g = w * jnp.linspace(0.1, 3.0, 32)[None, :]  # columns (the longer axis) of unequal size
    make = lambda dtype: scale_by_muon(0.9, ns_dtype=dtype, shape_scale=None)
    plain, _ = first_update(make(F32), {"w": g})
    normed, state = first_update(scale_by_muon(0.9, ns_dtype=F32, shape_scale=None,
                                               beta2=0.5), {"w": g})
    # As accurate as the orthogonalised one's own float32 norm.
    norm = lambda u: np.linalg.norm(np.asarray(u["w"], np.float64))
    assert_as_accurate(norm(normed), norm(plain), norm(first_update64(make, {"w": g})))
    col_rms = np.sqrt(np.mean(np.square(np.asarray(normed["w"])), axis=0))
    np.testing.assert_allclose(col_rms, col_rms.mean(), rtol=1e-4)
    assert np.std(np.sqrt(np.mean(np.square(np.asarray(plain["w"])), axis=0))) > 1e-3
    assert state.nu["w"].shape == (1, 32)


# ----------------------------------------------------------------------------------------
# Newton-Schulz

@pytest.mark.parametrize("preset", ["keller", "modded"])
def test_orthogonalize_float32_matches_reference(preset):
    rng = np.random.default_rng(0)
    for shape in [(8, 16), (16, 8), (3, 6, 12), (2, 2, 12, 6)]:
        x = rng.standard_normal(shape).astype(np.float32)
        out = ortho(jnp.asarray(x), preset, F32)
        assert out.dtype == F32 and out.shape == shape
        np.testing.assert_allclose(np.asarray(out), ref_ns(x, PRESETS[preset]), atol=5e-6)
    # The preset is its triples: the same program (constants included), so bitwise equal.
    assert (program_text(ortho.lower(jnp.asarray(x), PRESETS[preset], F32))
            == program_text(ortho.lower(jnp.asarray(x), preset, F32)))
    explicit = ortho(jnp.asarray(x), PRESETS[preset], F32)
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(out))


def test_orthogonalize_explicit_triples_and_eps():
    x = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    triples = ((2.0, -1.5, 0.5), (1.5, -0.5, 0.0), (3.0, -3.2, 1.2))
    np.testing.assert_allclose(np.asarray(ortho(jnp.asarray(x), triples, F32, 1e-7)),
                               ref_ns(x, triples), atol=5e-6)
    np.testing.assert_allclose(np.asarray(ortho(jnp.asarray(x), triples, F32, 3.0)),
                               ref_ns(x, triples, eps=3.0), atol=5e-6)
    zeros = ortho(jnp.zeros((4, 6), jnp.bfloat16), "modded", jnp.bfloat16, 1e-7)
    assert zeros.dtype == F32
    np.testing.assert_array_equal(np.asarray(zeros), 0.0)
    as_list = orthogonalize(jnp.asarray(x), np.asarray(triples), F32)  # (n, 3) arrays work too
    np.testing.assert_allclose(np.asarray(as_list), ref_ns(x, triples), atol=5e-6)


@pytest.mark.parametrize("preset", ["keller", "modded"])
def test_bf16_singular_values_in_the_band_the_coefficients_produce(preset):
    """The band is derived from the coefficients: each normalised singular value s of the
    input becomes phi(s), phi the composed polynomial; over the inputs' range of s the
    image of phi is the band. bfloat16 must land in it up to bf16 rounding."""
    triples = PRESETS[preset]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(shape).astype(np.float32)
          for shape in [(32, 64)] * 4 + [(64, 32)] * 4 + [(3, 24, 48)]]
    s_in = np.concatenate([
        np.linalg.svd(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True),
                      compute_uv=False).ravel() for x in xs])
    grid = np.linspace(s_in.min(), s_in.max(), 20001)
    lo, hi = ref_scalar_ns(grid, triples).min(), ref_scalar_ns(grid, triples).max()
    s_ref = np.concatenate([np.linalg.svd(ref_ns(x, triples), compute_uv=False).ravel()
                            for x in xs])
    s_bf16 = np.concatenate([
        np.linalg.svd(np.asarray(ortho(jnp.asarray(x), preset, jnp.bfloat16), np.float64),
                      compute_uv=False).ravel() for x in xs])
    # The f64 reference is the polynomial applied to the singular values (exactly).
    assert lo - 1e-9 <= s_ref.min() and s_ref.max() <= hi + 1e-9
    # bf16 keeps 8 significant bits (relative rounding <= 2^-9 per op), and a X + B X
    # cancels terms of size ~4 down to ~1, so one iteration's rounding moves a singular
    # value by up to ~4 * 2^-9 = 0.008; measured <= 0.009 outside the band over several
    # seeds. Allowance 0.02. (Elementwise steps in bf16 with the coefficients rounded to
    # bf16, as JAX's weak typing would do, measured ~0.035: the implementation avoids it.)
    tol = 0.02
    assert lo - tol <= s_bf16.min() and s_bf16.max() <= hi + tol, (preset, lo, hi,
                                                                   s_bf16.min(), s_bf16.max())
    # ... and fills it: the wrong coefficients would give another band.
    assert abs(s_bf16.min() - lo) < tol and abs(s_bf16.max() - hi) < tol
    expected_band = {"keller": (0.68, 1.13), "modded": (0.98, 1.03)}[preset]
    np.testing.assert_allclose((lo, hi), expected_band, atol=0.01)


def test_polar_express_is_the_papers_algorithm_and_its_band():
    """The preset runs Amsel et al.'s Algorithm 1 (five steps): equal to the paper's code
    in float64; and the band it promises: every normalised singular value in [1e-3, 1]
    is mapped by the composed polynomials into [lo, hi] (computed here from the paper's
    list: [0.840, 1.124]), which float32 and bfloat16 outputs must land in."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(shape).astype(np.float32)
          for shape in [(32, 64), (64, 32), (3, 24, 48), (16, 16)]]
    for x in xs:
        out = ortho(jnp.asarray(x), "polar_express", F32)
        np.testing.assert_allclose(np.asarray(out), ref_polar_express(x), atol=5e-6)
    grid = np.linspace(1e-3, 1.0, 200001) / 1.01
    for a, b, c in PAPER_POLAR_EXPRESS[:5]:
        grid = a * grid + b * grid**3 + c * grid**5
    lo, hi = grid.min(), grid.max()
    np.testing.assert_allclose((lo, hi), (0.840, 1.124), atol=1e-3)
    for x in xs[:3]:  # non-square: normalised singular values above 1e-3
        s_in = np.linalg.svd(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True),
                             compute_uv=False)
        assert s_in.min() > 1e-3
        for dtype, tol in ((F32, 1e-5), (jnp.bfloat16, 0.02)):
            out = np.asarray(ortho(jnp.asarray(x), "polar_express", dtype), np.float64)
            s = np.linalg.svd(out, compute_uv=False)
            assert lo - tol <= s.min() and s.max() <= hi + tol, (dtype, s.min(), s.max())


@functools.cache
def unscaled64(seed):
    """The first update of `scale_by_muon(shape_scale=None)` on `normal((8, 32), seed)`,
    in float64 (two tests compare with it)."""
    return first_update64(lambda dtype: scale_by_muon(ns_dtype=dtype, shape_scale=None),
                          normal((8, 32), seed=seed))


def test_shape_scale_options():
    w = normal((8, 32), seed=9)
    base, _ = first_update(scale_by_muon(ns_dtype=F32, shape_scale=None), w)
    exact = unscaled64(9)
    for value, factor in (("modded", 2.0), (True, 2.0), (False, 1.0), (None, 1.0),
                          ("consistent_rms", 0.2 * np.sqrt(32))):
        u, _ = first_update(scale_by_muon(ns_dtype=F32, shape_scale=value), w)
        # Another program than `base`'s: as accurate as `base` scaled (one more rounding).
        assert_as_accurate(u, factor * np.asarray(base, np.float64), factor * exact,
                           what=str(value))
    # An orthogonal O of shape (m, n) has ||O||_F^2 = min(m, n), so RMS(O) =
    # 1/sqrt(max(m, n)) and 0.2 sqrt(max(m, n)) O has RMS 0.2, AdamW's typical update
    # RMS (up to the Newton-Schulz band).
    u, _ = first_update(scale_by_muon(ns_dtype=F32, shape_scale="consistent_rms",
                                      coefficients="polar_express"), w)
    assert abs(float(jnp.sqrt(jnp.mean(jnp.square(u)))) - 0.2) < 0.02
    with pytest.raises(ValueError, match="shape_scale.*'rms'"):
        scale_by_muon(shape_scale="rms")


def test_consistent_rms_and_adam_nesterov_match_optax_contrib():
    """optax.contrib.muon(consistent_rms=0.2, nesterov=True) uses Nesterov in its AdamW
    group too: ours matches it with adam_nesterov=True (and differs without)."""
    params = {"w": PARAMS["wq"], "v": PARAMS["mlp_proj"], "norm": PARAMS["norm"]}
    theirs = lambda: optax.contrib.muon(0.02, beta=0.9, eps=1e-7, consistent_rms=0.2,
                                        nesterov=True, adam_learning_rate=3e-3)
    kw = dict(beta=0.9, coefficients="keller", ns_dtype=F32, bias_correction=True,
              shape_scale="consistent_rms", adam_learning_rate=3e-3, adam_eps=1e-7,
              labels=ndim_labels)
    txs = {"ours": muon(0.02, adam_nesterov=True, **kw), "plain": muon(0.02, **kw),
           "theirs": theirs()}
    p = {k: trajectory(tx, params, 6)[0] for k, tx in txs.items()}
    # optax's on float64 params (its iteration and momentum follow them): what both round.
    exact = run_in_float64(lambda q: trajectory(theirs(), q, 6)[0], params)
    assert_as_accurate(p["ours"], p["theirs"], exact)
    assert float(jnp.max(jnp.abs(p["plain"]["norm"] - p["theirs"]["norm"]))) > 1e-4
    matrices = lambda tree: {k: tree[k] for k in "wv"}
    assert_as_accurate(matrices(p["plain"]), matrices(p["theirs"]), matrices(exact))


def test_convolution_kernels_warn_once_per_leaf():
    import warnings

    params = {"conv": normal((3, 3, 4, 8), seed=1), "conv2": normal((3, 3, 8, 8), seed=2),
              "experts": normal((2, 6, 12), seed=3)}
    tx = scale_by_muon(ns_dtype=F32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = tx.init(params)
        jax.jit(tx.update)(params, state)
        tx.update(params, state)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 2, messages
    assert "'conv'" in messages[0] and "(3, 3, 4, 8)" in messages[0]
    assert "9 separate 4x8 matrices" in messages[0] and "'conv2'" in messages[1]


def test_stacks_equal_per_matrix_results():
    # Slicing and transposing happen in numpy: eager jax indexing compiles per index.
    x = np.asarray(normal((4, 8, 12), seed=5))
    grads = [np.asarray(normal_tree({"e": x}, t)["e"]) for t in range(2)]

    def per_matrix(dtype):  # the four matrices as four leaves: their updates per step
        tx = scale_by_muon(0.9, ns_dtype=dtype)
        split = lambda a: {f"e{i}": jnp.asarray(a[i], dtype) for i in range(4)}
        state, update, out = tx.init(split(x)), jax.jit(tx.update), []
        for g in grads:
            u, state = update(split(g), state)
            out.append(u)
        return out

    split32, split64 = per_matrix(F32), run_in_float64(lambda: per_matrix(F64))
    tx = scale_by_muon(0.9, ns_dtype=F32)
    state, update = tx.init({"e": jnp.asarray(x)}), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update({"e": jnp.asarray(g)}, state)
        u = np.asarray(u["e"])
        # One batched iteration, blocked unlike four: as accurate as the four.
        assert_as_accurate({f"e{i}": u[i] for i in range(4)}, split32[t], split64[t],
                           what=f"step {t}")


_alone64 = {}


def alone64(key, g):
    """The first update of `scale_by_muon(0.9)` on the one leaf `{key: g}`, in float64."""
    if key not in _alone64:
        _alone64[key] = first_update64(lambda dtype: scale_by_muon(0.9, ns_dtype=dtype),
                                       {key: g})[key]
    return _alone64[key]


@pytest.mark.parametrize("ns_dtype", [F32, jnp.bfloat16])
def test_same_shape_leaves_share_one_iteration_with_their_own_results(ns_dtype):
    # Same-shape leaves (a tall one transposed, a stack) run as one batched iteration; each
    # comes out as it would alone: float32 to accumulation order, bf16 within its rounding.
    tree = {"a": normal((8, 16), seed=1), "b": normal((8, 16), seed=2),
            "tall": normal((16, 8), seed=3), "stack": normal((2, 8, 16), seed=4),
            "other": normal((6, 10), seed=5)}
    tx = scale_by_muon(0.9, ns_dtype=ns_dtype)
    together, _ = first_update(tx, tree)
    for k, g in tree.items():
        alone = np.asarray(first_update(tx, {k: g})[0][k])
        # As accurate as alone, against alone's computation in float64 (bf16's is ~1%
        # from it, so that case allows 4x that: the float32 case is the sharp one).
        exact = alone64(k, np.asarray(g))
        if ns_dtype == F32:
            assert_as_accurate(together[k], alone, exact, what=k)
        else:
            assert error(together[k], exact) <= bound(alone, exact), k
    # one Newton-Schulz loop for the five (8, 16) matrices, one for the (6, 10)
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree)).compile().as_text()
    assert hlo.count(" while(") == 2


def test_matrix_axes_other_than_the_last_two():
    g = np.asarray(normal((6, 3, 12), seed=7))  # (in, E, out)
    ours = scale_by_muon(0.9, ns_dtype=F32, matrix_axes=(0, 2))
    u, _ = first_update(ours, jnp.asarray(g))
    default = scale_by_muon(0.9, ns_dtype=F32)
    ut, _ = first_update(default, jnp.asarray(g.transpose(1, 0, 2)))
    default64 = lambda x: first_update64(lambda dtype: scale_by_muon(0.9, ns_dtype=dtype), x)
    # Another program (the transposes inside it): as accurate as the default one.
    assert_as_accurate(u, np.asarray(ut).transpose(1, 0, 2),
                       default64(g.transpose(1, 0, 2)).transpose(1, 0, 2))
    # PyTorch (out, in) layout: fan_in is axis 1. (16, 8) with axes (1, 0) is a 8 -> 16 map.
    w = np.asarray(normal((16, 8), seed=8))
    torch_tx = scale_by_muon(0.9, ns_dtype=F32, matrix_axes=(1, 0))
    u_torch, _ = first_update(torch_tx, jnp.asarray(w))
    u_flax, _ = first_update(default, jnp.asarray(w.T))
    assert_as_accurate(u_torch, np.asarray(u_flax).T, default64(w.T).T)
    np.testing.assert_allclose(np.asarray(u_torch), np.sqrt(2.0) * ref_ns(w, MODDED), atol=1e-5)


def test_shape_scale_flag_and_state():
    w = normal((8, 32), seed=9)
    on, off = scale_by_muon(ns_dtype=F32), scale_by_muon(ns_dtype=F32, shape_scale=False)
    u_on, s_on = first_update(on, w)
    u_off, _ = first_update(off, w)
    assert_as_accurate(u_on, 2.0 * np.asarray(u_off, np.float64), 2.0 * unscaled64(9))
    assert isinstance(s_on, MuonState) and s_on.mu.dtype == F32
    assert isinstance(s_on.smooth, optax.EmptyState) and int(s_on.count) == 1
    smoothed = scale_by_muon(smoothing=0.2).init(w.astype(jnp.bfloat16))
    assert smoothed.smooth.dtype == F32 and smoothed.mu.dtype == F32


def test_add_decoupled_weight_decay():
    params = {"mlp": jnp.full((2, 3), 2.0), "attn": jnp.full((3,), -1.0, jnp.bfloat16)}
    u = {"mlp": jnp.full((2, 3), 0.5), "attn": jnp.full((3,), 0.25, jnp.bfloat16)}
    by_tree = add_decoupled_weight_decay(0.1, {"mlp": 2.0, "attn": 1.0})
    by_fn = add_decoupled_weight_decay(
        0.1, lambda p: {"mlp": 2.0 * jnp.ones(()), "attn": jnp.ones(())})
    for tx in (by_tree, by_fn):
        out, _ = jax.jit(tx.update)(u, tx.init(params), params)
        np.testing.assert_allclose(np.asarray(out["mlp"]), 0.5 + 0.1 * 2.0 * 2.0, rtol=1e-6)
        assert out["attn"].dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out["attn"], np.float32), 0.25 - 0.1, rtol=1e-2)
    # Masked leaves (optax.MaskedNode) are skipped: only "mlp" decays.
    masked = optax.masked(by_tree, {"mlp": True, "attn": False})
    out, _ = masked.update(u, masked.init(params), params)
    np.testing.assert_array_equal(np.asarray(out["attn"]), np.asarray(u["attn"]))
    np.testing.assert_allclose(np.asarray(out["mlp"]), 0.9, rtol=1e-6)
    # A Python 0 is a no-op that needs no params; a negative rate is rejected.
    zero = add_decoupled_weight_decay(0.0, {"mlp": 2.0, "attn": 1.0})
    assert zero.update(u, zero.init(params))[0] is u
    with pytest.raises(ValueError, match=r"weight_decay.*-0\.1"):
        add_decoupled_weight_decay(-0.1)


def test_momentum_warmup_schedule():
    beta = muon_momentum_warmup()
    for t in [0, 1, 150, 299, 300, 301, 5000]:
        np.testing.assert_allclose(float(beta(t)), 0.85 + 0.10 * min(t / 300, 1), rtol=1e-6)
    np.testing.assert_allclose(float(muon_momentum_warmup(0.5, 0.9, 10)(5)), 0.7, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# optax.contrib.muon with bias correction

@pytest.mark.parametrize("preset,nesterov", [("keller", True), ("keller", False),
                                             ("modded", True)])
def test_bias_correction_matches_optax_contrib(preset, nesterov):
    dims = {"v": optax.contrib.MuonDimensionNumbers(0, 1),
            "e": optax.contrib.MuonDimensionNumbers(1, 2)}
    theirs = lambda: optax.contrib.scale_by_muon(
        ns_coeffs=PRESETS[preset], ns_steps=5, beta=0.9, eps=1e-7, nesterov=nesterov,
        weight_dimension_numbers=dims)
    ours = scale_by_muon(0.9, coefficients=preset, ns_dtype=F32, nesterov=nesterov,
                         bias_correction=True, shape_scale=False)
    # Bias correction matters for Nesterov from step 1 on (step 0: both are multiples of g);
    # without Nesterov it only rescales the momentum, which Newton-Schulz normalises away.
    plain = lambda dtype: scale_by_muon(0.9, coefficients=preset, ns_dtype=dtype,
                                        nesterov=nesterov, shape_scale=False)
    (u_ours, s_ours), (u_theirs, s_theirs), (u_plain, _) = (
        update_sequence(tx, MATRICES, 8) for tx in (ours, theirs(), plain(F32)))
    # The float64 runs of optax's (its iteration and momentum follow the gradients' dtype)
    # and of ours without bias correction: what the float32 programs round.
    def theirs_float64(g):
        updates, state = update_sequence(theirs(), g, 8)
        return updates, state.mu

    theirs64, mu64 = run_in_float64(theirs_float64, MATRICES)
    plain64 = run_in_float64(lambda g: update_sequence(plain(F64), g, 8)[0], MATRICES)
    for t in range(8):
        assert_as_accurate(u_ours[t], u_theirs[t], theirs64[t], what=f"step {t}")
        if nesterov and t > 0:
            diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                       for a, b in zip(jax.tree.leaves(u_ours[t]), jax.tree.leaves(u_plain[t]),
                                       strict=True))
            assert diff > 1e-2, (t, diff)
        else:  # the same update as without it, to the float32 rounding of that one
            assert_as_accurate(u_ours[t], u_plain[t], plain64[t], what=f"unchanged {t}")
    assert_as_accurate(s_ours.mu, s_theirs.mu, mu64, what="mu")


def test_muon_alias_matches_optax_contrib_muon_on_matrices():
    params = {"w": PARAMS["wq"], "v": PARAMS["mlp_proj"]}  # shape scale sqrt(2) and 1
    theirs = lambda: optax.contrib.muon(0.02, beta=0.9, eps=1e-7, weight_decay=0.01)
    ours = muon(0.02, beta=0.9, coefficients="keller", ns_dtype=F32, bias_correction=True,
                weight_decay=0.01, labels=ndim_labels)
    exact = run_in_float64(lambda p: trajectory(theirs(), p, 6)[0], params)
    assert_as_accurate(trajectory(ours, params, 6)[0], trajectory(theirs(), params, 6)[0],
                       exact)


# ----------------------------------------------------------------------------------------
# Bad input

def test_one_dimensional_leaf_belongs_to_adam():
    tx = scale_by_muon()
    with pytest.raises(ValueError, match=r"shape \(16,\).*Adam"):
        tx.init({"w": jnp.ones((4, 4)), "b": jnp.ones((16,))})
    with pytest.raises(ValueError, match=r"shape \(\)"):
        tx.init(jnp.asarray(1.0))
    with pytest.raises(ValueError, match="Adam"):
        muon(0.1, labels=lambda p: jax.tree.map(lambda _: "muon", p)).init(
            {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))})


@pytest.mark.parametrize("kwargs,match", [
    (dict(coefficients="dion"), "'dion'.*keller"),
    (dict(coefficients=()), "non-empty"),
    (dict(coefficients=(3.4445, -4.7750, 2.0315)), "triples"),
    (dict(coefficients=[(1.0, 2.0)]), "triples"),
    (dict(coefficients=[(1.0, 2.0, "x")]), "triples"),
    (dict(coefficients=[(1.0, 2.0, 3.0), (1.0, 2.0)]), "triples"),
    (dict(ns_dtype=jnp.int8), "ns_dtype.*floating"),
    (dict(beta=1.0), r"beta.*\[0, 1\).*1\.0"),
    (dict(beta=-0.1), "beta"),
    (dict(smoothing=1.5), "smoothing"),
    (dict(smoothing_form="lerp"), "'lerp'"),
    (dict(matrix_axes=(1, 1)), r"matrix_axes.*\(1, 1\)"),
    (dict(matrix_axes=(0,)), "matrix_axes"),
    (dict(matrix_axes="ab"), "matrix_axes"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_by_muon(**kwargs)
    with pytest.raises(ValueError, match=match):
        muon(0.1, labels=LABELS, **kwargs)


def test_bad_alias_and_function_arguments_raise():
    with pytest.raises(ValueError, match=r"learning_rate.*-0\.1"):
        muon(-0.1, labels=LABELS)
    with pytest.raises(ValueError, match="adam_learning_rate"):
        muon(0.1, adam_learning_rate=-1.0, labels=LABELS)
    with pytest.raises(ValueError, match="weight_decay"):
        muon(0.1, weight_decay=-1.0, labels=LABELS)
    with pytest.raises(ValueError, match="steps"):
        muon_momentum_warmup(steps=0)
    with pytest.raises(ValueError, match="start"):
        muon_momentum_warmup(start=1.2)
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        orthogonalize(jnp.ones((5,)))
    with pytest.raises(ValueError, match="preset 'nope'"):
        orthogonalize(jnp.ones((2, 3)), "nope")
    with pytest.raises(ValueError, match=r"out of range.*\(4, 4\)"):
        scale_by_muon(matrix_axes=(0, 2)).init(jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="same axis"):
        scale_by_muon(matrix_axes=(1, -1)).init(jnp.ones((4, 4)))
    decayed = muon(0.1, weight_decay=0.1, labels=LABELS)
    with pytest.raises(ValueError, match="params"):  # traced only: no need to run it
        jax.eval_shape(decayed.update, PARAMS, decayed.init(PARAMS))


def test_default_labels_come_from_optax_snoo_labels():
    labels_mod = pytest.importorskip("optax_snoo.labels")
    params = {"w": MIXED["v"], "b": MIXED["norm"]}
    default = muon(0.1, ns_dtype=F32)
    explicit = muon(0.1, ns_dtype=F32, labels=labels_mod.muon_adam_labels)
    # The labels are read at trace time: one program, so bitwise one trajectory.
    lowered = [jax.jit(tx.update).lower(params, tx.init(params), params)
               for tx in (default, explicit)]
    assert program_text(lowered[0]) == program_text(lowered[1])
    p1, _, _ = m.run(default, params, 2)
    p2, _, _ = m.run(explicit, params, 2)
    m.assert_trees_equal(p1, p2)


# ----------------------------------------------------------------------------------------
# The optax matrix

def test_matrix_scale_by_muon(tmp_path):
    # One transform for most checks, so its compiled update is reused between them.
    tx = scale_by_muon(muon_momentum_warmup(), ns_dtype=F32, smoothing=0.2)
    # The same computation in float64 (its state follows the params; mu_dtype says so).
    tx64 = scale_by_muon(muon_momentum_warmup(), ns_dtype=F64, mu_dtype=F64, smoothing=0.2)
    m.check_jit_matches_eager(tx, MATRICES, float64=tx64)
    m.check_state_stable(tx, MATRICES)
    m.check_dtype_preserved(scale_by_muon(smoothing=0.2), MATRICES)  # bf16 Newton-Schulz
    m.check_inject_hyperparams(
        scale_by_muon, MATRICES,
        dict(beta=0.9, smoothing=0.3, coefficients="keller", ns_dtype=F32),
        static_args=("ns_dtype", "mu_dtype"),
        float64=lambda **kw: scale_by_muon(**dict(kw, ns_dtype=F64, mu_dtype=F64)))
    m.check_multisteps(tx, MATRICES, float64=tx64)
    m.check_partition(tx, MATRICES, float64=tx64)
    m.check_sharded_state(tx, MATRICES, float64=tx64)
    m.check_orbax_roundtrip(tx, MATRICES, tmp_path)


def test_matrix_muon_alias(tmp_path):
    """muon() on a mixed tree (matrices, a stack, 1-D and 0-D leaves for AdamW). Partition
    is muon() itself; scale_by_muon covers jit-vs-eager and nesting in a partition."""
    groups = [MuonGroup("^v$", 0.01, weight_decay=0.02), MuonGroup(".*")]
    kw = dict(learning_rate=0.02, beta=0.9, weight_decay=0.01, smoothing=0.2,
              adam_learning_rate=3e-3, muon_groups=groups, labels=ndim_labels)
    tx = muon(ns_dtype=F32, **kw)
    tx64 = muon(ns_dtype=F64, **kw)  # the same in float64 (Muon's and Adam's state follow)
    m.check_state_stable(tx, MIXED)
    m.check_dtype_preserved(muon(0.02, weight_decay=0.01, labels=ndim_labels), MIXED)
    m.check_inject_hyperparams(
        muon, MIXED, dict(kw, ns_dtype=F32, learning_rate=lambda t: 0.02),
        static_args=("labels", "ns_dtype", "muon_groups"),
        float64=lambda **kw: muon(**dict(kw, ns_dtype=F64)))
    m.check_multisteps(tx, MIXED, float64=tx64)
    m.check_nnx_optimizer(muon(0.02, weight_decay=0.01, ns_dtype=F32, labels=ndim_labels))
    m.check_sharded_state(tx, MIXED, float64=tx64)
    m.check_orbax_roundtrip(tx, MIXED, tmp_path)


def test_matrix_new_options(tmp_path):
    """The optax matrix for consistent_rms, polar_express, adam_nesterov, NorMuon and
    cautious weight decay together."""
    kw = dict(learning_rate=0.02, beta=0.9, coefficients="polar_express",
              shape_scale="consistent_rms", adam_nesterov=True, adam_learning_rate=3e-3,
              weight_decay=0.01, labels=ndim_labels, beta2=0.95, cautious_weight_decay=True)
    tx = muon(ns_dtype=F32, **kw)
    tx64 = muon(ns_dtype=F64, **kw)  # the same in float64 (Muon's and Adam's state follow)
    m.check_state_stable(tx, MIXED)
    m.check_jit_matches_eager(tx, MIXED, float64=tx64)
    m.check_dtype_preserved(muon(**kw), MIXED)
    m.check_inject_hyperparams(
        muon, MIXED, dict(kw, ns_dtype=F32),
        static_args=("labels", "ns_dtype", "coefficients", "shape_scale", "adam_nesterov",
                     "cautious_weight_decay"),
        float64=lambda **kw: muon(**dict(kw, ns_dtype=F64)))
    m.check_multisteps(tx, MIXED, float64=tx64)
    m.check_sharded_state(tx, MIXED, float64=tx64)
    m.check_orbax_roundtrip(tx, MIXED, tmp_path)


# ---------------------------------------------------------------- Aurora's polar (#17)

def _aurora_update(v, **kw):
    """One `scale_by_muon` update of gradient ``v`` (momentum 0: the update is polar(v)
    or Aurora's), without the shape scale, in float64."""
    def update(v):
        tx = scale_by_muon(0.0, nesterov=False, coefficients="track3", ns_dtype="float64",
                           shape_scale=None, **kw)
        return tx.update(v, tx.init(v))[0]
    return np.asarray(run_in_float64(update, v))


def _uneven(shape, seed=0):
    """A matrix whose lines along the longer axis have norms over two decades."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape)
    long_axis = 0 if shape[0] > shape[1] else 1
    scales = np.logspace(-1, 1, shape[long_axis])
    return g * (scales[:, None] if long_axis == 0 else scales[None, :])


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_aurora_makes_the_longer_axis_lines_uniform(shape):
    """D's damped fixed-point update converges: polar(D v)'s lines along the longer axis
    approach the squared norm n/m with each round (plain polar: off by up to 2x here)."""
    g = _uneven(shape)
    short_axis = 1 if shape[0] > shape[1] else 0
    target = min(shape) / max(shape)

    def spread(u):
        return np.max(np.abs(np.sum(u * u, axis=short_axis) / target - 1))

    spreads = [spread(_aurora_update(g, aurora_iterations=k)) for k in (1, 2, 3, 4, 10)]
    assert spread(_aurora_update(g)) > 1.5 > 0.75 > spreads[0], spreads
    assert all(a > 1.5 * b for a, b in itertools.pairwise(spreads[:-1])), spreads
    assert spreads[-1] < 0.005, spreads


def test_aurora_of_a_square_matrix_is_the_plain_polar_and_one_round_is_muon_eq():
    sq = _uneven((24, 24))
    np.testing.assert_array_equal(_aurora_update(sq, aurora_iterations=2), _aurora_update(sq))
    g = _uneven((48, 16))
    eq = g / np.linalg.norm(g, axis=1, keepdims=True)  # each row normalised, then the polar
    np.testing.assert_allclose(_aurora_update(g, aurora_iterations=1), _aurora_update(eq),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw,message", [
    (dict(aurora_iterations=0), "aurora_iterations must be None or an integer >= 1, got 0"),
    (dict(aurora_iterations=1.5), "aurora_iterations must be None or an integer >= 1"),
    (dict(aurora_iterations=2, aurora_beta=0.0), r"aurora_beta must be in \(0, 1\], got 0.0")])
def test_aurora_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        scale_by_muon(**kw)


def test_aurora_under_inject_hyperparams():
    """aurora_beta may be injected (a traced number); aurora_iterations, a count of
    rounds, is named as static, and the injected run equals the plain one."""
    p = {"w": jnp.asarray(_uneven((24, 8)), jnp.float32)}
    with pytest.raises(ValueError, match=r"static_args=\('aurora_iterations',\)"):
        optax.inject_hyperparams(scale_by_muon, static_args=("ns_dtype",))(
            aurora_iterations=2).init(p)
    inj = optax.inject_hyperparams(scale_by_muon, static_args=("aurora_iterations", "ns_dtype"))(
        0.9, aurora_iterations=2, aurora_beta=0.5)
    plain = scale_by_muon(0.9, aurora_iterations=2, aurora_beta=0.5)
    a = jax.jit(inj.update)(p, inj.init(p))[0]["w"]
    b = jax.jit(plain.update)(p, plain.init(p))[0]["w"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- DynMuon's power map (#28)

@pytest.mark.parametrize("p", [0.25, -0.25])
def test_power_map_scales_as_the_input_to_the_power_p(p):
    """Not scale-free, by design: v -> λv gives λ^p times the update (‖v‖_F ~ 3e6 here, so
    the 1e-7 added to the norms moves nothing at float64's rounding)."""
    g = 1e5 * _uneven((24, 8))
    base = _aurora_update(g, spectral_map="power", spectral_strength=p)
    for lam in (4.0, 0.25):
        np.testing.assert_allclose(
            _aurora_update(lam * g, spectral_map="power", spectral_strength=p),
            lam**p * base, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        _aurora_update(g, spectral_map="power", spectral_strength=p, spectral_input_scale=4.0),
        4.0**p * base, rtol=1e-9, atol=1e-12)


def test_power_map_at_p_0_is_the_polar_of_the_normalised_input():
    g = _uneven((24, 8))
    n = g / (np.linalg.norm(g) + 1e-7)
    np.testing.assert_allclose(_aurora_update(g, spectral_map="power", spectral_strength=0.0),
                               _aurora_update(n), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw,message", [
    (dict(spectral_map="contra", spectral_input_scale=2.0),
     "spectral_input_scale=2.0 is read only by spectral_map='power'"),
    (dict(spectral_input_scale=0.0), "spectral_input_scale must be > 0"),
    (dict(spectral_map="power", aurora_iterations=2), "does not combine with precondition"),
    (dict(spectral_map="dyn"), "spectral_map must be one of")])
def test_power_map_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        scale_by_muon(**kw)


# ------------------------------------------ no orthogonalisation, NorMuon off on square (#26)

def test_without_orthogonalize_the_direction_is_the_input_itself():
    """``orthogonalize=False``: no Newton-Schulz and no normalisation, so (momentum 0, no
    precondition) the update is the gradient times the shape scale."""
    g = _uneven((8, 24))  # (fan_in, fan_out) = (8, 24): shape factor sqrt(3)
    np.testing.assert_array_equal(_aurora_update(g, orthogonalize=False), g)

    def scaled(v):
        tx = scale_by_muon(0.0, nesterov=False, orthogonalize=False)
        return tx.update(v, tx.init(v))[0]
    np.testing.assert_allclose(np.asarray(run_in_float64(scaled, g)), 3**0.5 * g, rtol=1e-15)


@pytest.mark.parametrize("kw", [dict(spectral_map="contra"), dict(aurora_iterations=2),
                                dict(tempered_polar=0.05)])
def test_without_orthogonalize_what_reads_the_polar_is_refused(kw):
    """Contra, Aurora and Tempered-Polar each read the polar factor ``orthogonalize=False``
    does not compute: refused at construction, naming the setting."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"orthogonalize=False .*{name}={kw[name]!r}"):
        scale_by_muon(orthogonalize=False, **kw)


def test_soft_map_reads_the_tempered_polar():
    """With both, the Contra-Muon term ``C = [O - (k/2) v/‖v‖₄]`` and its size ``n`` read
    the tempered polar (#38's `muon_update` tempers ``ns_update`` before its Contra and
    Soft terms): one float64 update of a wide matrix (no momentum, no shape scale, Soft's
    blend 0) against numpy."""
    from references.track3_constants import NS_COEFFICIENTS, NS_EPS

    def norm4(x, eps=1e-10):
        return max(np.sqrt(np.linalg.norm(x @ x.T)), eps)  # wide: the smaller Gram

    g = np.random.default_rng(3).standard_normal((12, 20))
    x = g / norm4(g, NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    n, residual = norm4(x), g / norm4(g) - x
    o = x + 0.05 * min(0.25 * n / norm4(residual), 1.0) * residual
    o = o * (n / norm4(o))
    contra = o - 0.2 * g / norm4(g)
    want = contra * (n / norm4(contra))
    untempered = x - 0.2 * g / norm4(g)
    untempered = untempered * (n / norm4(untempered))

    def update(g):
        tx = scale_by_muon(0.0, nesterov=False, coefficients="track3", ns_dtype="float64",
                           ns_normalization="gram_frobenius", spectral_map="soft",
                           spectral_strength=0.0, soft_contra=0.4, tempered_polar=0.05,
                           shape_scale=None, shard_newton_schulz=False)
        params = {"w": jnp.zeros_like(g)}
        return tx.update({"w": g}, tx.init(params), params)[0]["w"]

    got = run_in_float64(update, g)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert np.max(np.abs(got - untempered)) > 1e-4  # the tempering is seen


def test_normuon_square_false_skips_square_matrices_only():
    """``normuon_square=False``: a square matrix's update and ``ν`` are those without
    NorMuon; a non-square one is normalised as with ``normuon_square=True``."""
    params = {"sq": jnp.asarray(_uneven((8, 8))), "wide": jnp.asarray(_uneven((8, 16), 1))}
    run = lambda **kw: scale_by_muon(0.0, beta2=0.9, ns_dtype=jnp.float32, **kw).update(
        params, scale_by_muon(0.0, beta2=0.9, **kw).init(params))
    (skip, s_skip), (both, _) = run(normuon_square=False), run()
    plain, _ = scale_by_muon(0.0, ns_dtype=jnp.float32).update(
        params, scale_by_muon(0.0).init(params))
    np.testing.assert_array_equal(np.asarray(skip["sq"]), np.asarray(plain["sq"]))
    np.testing.assert_array_equal(np.asarray(s_skip.nu["sq"]), 0.0)
    np.testing.assert_array_equal(np.asarray(skip["wide"]), np.asarray(both["wide"]))
    assert not np.allclose(np.asarray(both["sq"]), np.asarray(plain["sq"]))
# ------------------------------------------------------ Soft-Muon's map (#20, spectral_map)

def _spectrum(shape, lo, seed=0):
    """A matrix with singular values spread log-uniformly over [lo, 1]."""
    rng = np.random.default_rng(seed)
    m, n = shape
    k = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    s = np.logspace(np.log10(lo), 0, k)
    return u @ np.diag(s) @ v.T, s


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_soft_map_raises_the_singular_values_to_p(shape):
    """Soft-Muon's series (blend 1, no Contra-Muon term): the update's singular values are
    ``σ^0.1`` of the input's (relative to the largest) to 1% over 1.7 decades (1.2% off
    at two), where Muon's are all 1; the update keeps Muon's
    Schatten-4 norm."""
    g, s = _spectrum(shape, 2e-2)
    soft = _aurora_update(g, spectral_map="soft", spectral_strength=1.0, soft_power=0.1,
                          ns_normalization="gram_frobenius")
    muon = _aurora_update(g, ns_normalization="gram_frobenius")
    got = np.linalg.svd(soft, compute_uv=False)
    np.testing.assert_allclose(got / got[0], (s[::-1] / s[-1]) ** 0.1, rtol=0.01)
    np.testing.assert_allclose(np.linalg.svd(muon, compute_uv=False), 1.0, atol=1e-3)
    schatten4 = lambda x: np.sum(np.linalg.svd(x, compute_uv=False) ** 4) ** 0.25
    np.testing.assert_allclose(schatten4(soft), schatten4(muon), rtol=1e-12)


def test_soft_map_is_contra_muon_at_blend_0_and_its_blends_are_linear():
    """``b = 0, k = 0``: Muon itself; ``b = 0``: ``[O - (k/2) v/‖v‖₄]`` (numpy here);
    ``b`` in between: ``[C + b (S - C)]`` of the two ends; scale-free in ``v``."""
    g = _uneven((24, 8))
    kw = dict(spectral_map="soft", ns_normalization="gram_frobenius")
    muon = _aurora_update(g, ns_normalization="gram_frobenius")
    np.testing.assert_allclose(_aurora_update(g, spectral_strength=0.0, **kw), muon,
                               rtol=1e-12, atol=1e-14)
    s4 = lambda x: np.sqrt(np.linalg.norm(x.T @ x))
    fit = lambda y: y * s4(muon) / s4(y)
    contra = fit(muon - 0.2 * g / s4(g))
    c = _aurora_update(g, spectral_strength=0.0, soft_contra=0.4, **kw)
    np.testing.assert_allclose(c, contra, rtol=1e-12, atol=1e-14)
    s = _aurora_update(g, spectral_strength=1.0, soft_contra=0.4, **kw)
    np.testing.assert_allclose(_aurora_update(g, spectral_strength=0.3, soft_contra=0.4, **kw),
                               fit(c + 0.3 * (s - c)), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        _aurora_update(1e3 * g, spectral_strength=0.3, soft_contra=0.4, **kw),
        fit(c + 0.3 * (s - c)), rtol=1e-12, atol=1e-14)


def test_soft_map_under_schedules_and_jit_equals_constants():
    """Scheduled ``b`` and ``k`` (the blend 0 at update 0: the series skipped under
    ``lax.cond``) give the constants' updates, update by update."""
    p = {"w": jnp.asarray(_uneven((24, 8)), jnp.float32)}
    kw = dict(spectral_map="soft", ns_dtype=F32, ns_normalization="gram_frobenius")
    scheduled = scale_by_muon(0.9, spectral_strength=lambda n: jnp.minimum(0.5 * n, 0.8),
                              soft_contra=lambda n: 0.4 - 0.1 * n, **kw)
    state, update = scheduled.init(p), jax.jit(scheduled.update)
    for t, (b, k) in enumerate([(0.0, 0.4), (0.5, 0.3), (0.8, 0.2)]):
        fixed = scale_by_muon(0.9, spectral_strength=b, soft_contra=k, **kw)
        fixed_state = fixed.init(p)._replace(mu=state.mu, count=state.count)
        want = fixed.update(p, fixed_state)[0]["w"]
        got, state = update(p, state)
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want), rtol=2e-6,
                                   atol=2e-7, err_msg=f"update {t}")


@pytest.mark.parametrize("kw,message", [
    (dict(spectral_map="soft", soft_power=0.2), r"soft_power must be one of \[0.0, 0.1\]"),
    (dict(spectral_map="soft", spectral_strength=1.5), r"blend\) must be in \[0, 1\]"),
    (dict(spectral_map="soft", soft_contra=-0.1), "soft_contra"),
    (dict(spectral_map="contra", soft_contra=0.4), "soft_contra=0.4 is read only by"),
    (dict(normuon_norm="spectral"), "normuon_norm must be one of")])
def test_soft_map_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        scale_by_muon(**kw)


def test_normuon_can_keep_the_schatten4_norm():
    """``normuon_norm="gram_frobenius"``: the same direction as NorMuon's (one positive
    factor apart), with the orthogonalised update's ‖·‖₄ instead of its ‖·‖_F."""
    g = _uneven((24, 8))
    fro = _aurora_update(g, beta2=0.95)
    s4 = _aurora_update(g, beta2=0.95, normuon_norm="gram_frobenius")
    muon = _aurora_update(g)
    norm4 = lambda x: np.sqrt(np.linalg.norm(x.T @ x))
    np.testing.assert_allclose(s4, fro * norm4(muon) / norm4(fro), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(fro), np.linalg.norm(muon), rtol=1e-12)
    assert abs(np.linalg.norm(s4) / np.linalg.norm(fro) - 1) > 1e-3


def test_soft_map_under_inject_hyperparams():
    """The blend and Contra-Muon strength may be injected (traced numbers); the power picks
    a table of weights, so it is named as static, and the injected run equals the plain."""
    p = {"w": jnp.asarray(_uneven((24, 8)), jnp.float32)}
    kw = dict(spectral_map="soft", ns_dtype=F32)
    with pytest.raises(ValueError, match=r"static_args=\('soft_power',\)"):
        optax.inject_hyperparams(scale_by_muon, static_args=("ns_dtype",))(
            0.875, spectral_strength=0.5, soft_contra=0.25, soft_power=0.1, **kw).init(p)
    inj = optax.inject_hyperparams(scale_by_muon, static_args=("soft_power", "ns_dtype"))(
        0.875, spectral_strength=0.5, soft_contra=0.25, **kw)
    plain = scale_by_muon(0.875, spectral_strength=0.5, soft_contra=0.25, **kw)
    a = jax.jit(inj.update)(p, inj.init(p))[0]["w"]
    b = jax.jit(plain.update)(p, plain.init(p))[0]["w"]
    # numbers float32 holds exactly: one float32 computation, its scalars constants in one
    # program and arguments in the other (XLA folds them differently: an ulp or two)
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 4 * 2.0**-24 * np.max(np.abs(b))
# ------------------- Contra-Muon with Gram-Frobenius norms (#30): "soft" with its blend 0

def _gram(x):
    g = x.T @ x if x.shape[0] > x.shape[1] else x @ x.T
    return max(np.sqrt(np.linalg.norm(g)), 1e-10)


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
def test_contra_gram_frobenius_is_its_formula(shape):
    """``O' = O - (c/2) v/g(v)`` rescaled to ``g(O)``, ``g`` the Gram-Frobenius norm
    (Track 3 #30's ``muon_update``): Soft-Muon's map with its blend 0 and ``soft_contra=c``,
    on top of the plain polar, in float64."""
    v = np.random.default_rng(1).standard_normal(shape)
    o = _aurora_update(v, ns_normalization="gram_frobenius")
    c = o - 0.2 * v / _gram(v)
    expected = c * _gram(o) / _gram(c)
    got = _aurora_update(v, ns_normalization="gram_frobenius", spectral_map="soft",
                         spectral_strength=0.0, soft_contra=0.4)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    operator = _aurora_update(v, ns_normalization="gram_frobenius", spectral_map="contra",
                              spectral_strength=0.4)
    assert np.max(np.abs(operator - expected)) > 1e-3  # #11's operator-norm map differs


def test_contra_gram_frobenius_sees_the_preconditioned_input():
    """With a precondition, the map reads the iteration's input (the whitened momentum),
    as #30 whitens before ``muon_update``: a precondition that flips the sign of half the
    fan_in lines gives the update of the flipped momentum (the map read the flipped
    input, not the momentum)."""
    v = np.random.default_rng(2).standard_normal((12, 20))
    flip = np.where(np.arange(12) < 6, -1.0, 1.0)[:, None]
    pre = MatrixPrecondition(  # M is (..., fan_out, fan_in) = (..., 20, 12)
        lambda batch, out, inn, dtype: jnp.zeros((batch,), dtype),
        lambda M, G, st, count, gated: (M * jnp.asarray(flip.T), st))
    kw = dict(ns_normalization="gram_frobenius", spectral_map="soft", spectral_strength=0.0,
              soft_contra=0.4)
    got = _aurora_update(v, precondition=pre, **kw)
    expected = _aurora_update(v * flip, **kw)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)

