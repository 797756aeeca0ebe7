"""K-FAC pure functions against float64 numpy (Martens & Grosse 2015, arXiv:1503.05671).

Factors: `layer_factors` (dense with/without bias, masks, expert stacks). Preconditioning:
eigen mode against the exact Kronecker solve, pi mode against the explicit pi-damped
formula, on random SPD factors and on a tiny MLP's real statistics; rank-deficient and
zero factors stay finite.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_snoo.kfac import (
    EigenInverse,
    LayerCurvature,
    PiInverse,
    apply_inverse,
    clipped_eigh,
    identity_inverse,
    pi_adjustment,
)
from optax_snoo.kfac import layer_factors as layer_factors_eager
from optax_snoo.kfac import precondition as precondition_eager
from optax_snoo.kfac import refresh_inverse as refresh_inverse_eager
from references.error import assert_as_accurate
from references.kfac import operator

RNG = np.random.default_rng(0)
# Jitted once per shape: far fewer compilations than op-by-op dispatch on a busy CPU.
layer_factors = jax.jit(layer_factors_eager, static_argnames=("has_bias", "stacked"))
precondition = jax.jit(precondition_eager, static_argnames=("mode",))
refresh_inverse = jax.jit(refresh_inverse_eager, static_argnames=("mode",))


def _np_factors(x, dy, has_bias, mask=None, num_tokens=None):
    """The factors in float64: tokens = rows after flattening the leading axes."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    dy = np.asarray(dy, np.float64).reshape(-1, dy.shape[-1])
    w = np.ones(len(x)) if mask is None else np.asarray(mask, np.float64).reshape(-1)
    x, dy = x[w > 0], dy[w > 0]
    m = len(x)
    scale = m if num_tokens is None else num_tokens
    if has_bias:
        x = np.concatenate([x, np.ones((m, 1))], axis=1)
    g = scale * dy
    if m == 0:
        return np.zeros((x.shape[1],) * 2), np.zeros((g.shape[1],) * 2)
    return x.T @ x / m, g.T @ g / m


def assert_close(actual, expected, rtol=1e-5, atol_rel=1e-6):
    expected = np.asarray(expected, np.float64)
    atol = atol_rel * max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ factors
@pytest.mark.parametrize("has_bias", [False, True])
def test_dense_factors_match_numpy(has_bias):
    x = RNG.normal(size=(2, 5, 4)).astype(np.float32)
    dy = (RNG.normal(size=(2, 5, 3)) / 10).astype(np.float32)
    a, g = layer_factors(jnp.asarray(x), jnp.asarray(dy), has_bias)
    a_ref, g_ref = _np_factors(x, dy, has_bias)
    assert a.dtype == g.dtype == jnp.float32
    assert a.shape == ((5, 5) if has_bias else (4, 4)) and g.shape == (3, 3)
    assert_close(a, a_ref)
    assert_close(g, g_ref)
    if has_bias:
        np.testing.assert_allclose(float(a[-1, -1]), 1.0, rtol=1e-6)


def test_dense_factors_mask_and_num_tokens():
    x = RNG.normal(size=(3, 4, 2)).astype(np.float32)
    dy = RNG.normal(size=(3, 4, 3)).astype(np.float32)
    mask = RNG.random((3, 4)) > 0.4
    a, g = layer_factors(jnp.asarray(x), jnp.asarray(dy), True, mask=jnp.asarray(mask))
    a_ref, g_ref = _np_factors(x, dy, True, mask)
    assert_close(a, a_ref)
    assert_close(g, g_ref)
    a2, g2 = layer_factors(jnp.asarray(x), jnp.asarray(dy), False, num_tokens=7.0)
    a2_ref, g2_ref = _np_factors(x, dy, False, num_tokens=7.0)
    assert_close(a2, a2_ref)
    assert_close(g2, g2_ref)


def test_dense_factors_bf16_inputs_computed_in_f32():
    x = jnp.asarray(RNG.normal(size=(6, 4)), jnp.bfloat16)
    dy = jnp.asarray(RNG.normal(size=(6, 3)) / 6, jnp.bfloat16)
    a, g = layer_factors(x, dy, True)
    assert a.dtype == g.dtype == jnp.float32
    a_ref, g_ref = _np_factors(np.asarray(x, np.float32), np.asarray(dy, np.float32), True)
    assert_close(a, a_ref)
    assert_close(g, g_ref)


def test_dense_factors_bf16_on_cpu_use_a_bf16_dot():
    """The CPU fast path (canonical bf16 dots): the compiled program multiplies bf16
    operands, and the factors still equal float64 sums of the exact bf16 products."""
    x = jnp.asarray(RNG.normal(size=(3, 32, 24)), jnp.bfloat16)
    dy = jnp.asarray(RNG.normal(size=(3, 32, 16)) / 96, jnp.bfloat16)
    a, g = layer_factors(x, dy, True)
    a_ref, g_ref = _np_factors(np.asarray(x, np.float32), np.asarray(dy, np.float32), True)
    assert_close(a, a_ref)
    assert_close(g, g_ref)
    if jax.default_backend() == "cpu":
        hlo = layer_factors.lower(x, dy, True).compile().as_text()
        blocks = [b for b in hlo.split("\n\n") if " dot(" in b]    # computations with a dot
        assert len(blocks) == 2, hlo
        for block in blocks:
            header = block.strip().splitlines()[0]
            assert "bf16[" in header and "f32[" not in header.split("->")[0], block
            assert "lhs_contracting_dims={1}, rhs_contracting_dims={0}" in block, block


def test_expert_stack_factors_with_mask():
    E, C, d_in, d_out, N = 3, 5, 4, 2, 11
    x = RNG.normal(size=(E, C, d_in)).astype(np.float32)
    dy = (RNG.normal(size=(E, C, d_out)) / N).astype(np.float32)
    mask = RNG.random((E, C)) > 0.3
    mask[2] = False                                   # an expert that got no token
    a, g = layer_factors(jnp.asarray(x), jnp.asarray(dy), True, mask=jnp.asarray(mask),
                         num_tokens=N, stacked=True)
    assert a.shape == (E, d_in + 1, d_in + 1) and g.shape == (E, d_out, d_out)
    for e in range(E):
        a_ref, g_ref = _np_factors(x[e], dy[e], True, mask[e], num_tokens=N)
        assert_close(a[e], a_ref)
        assert_close(g[e], g_ref)
    assert not np.any(np.asarray(a[2])) and not np.any(np.asarray(g[2]))


def test_layer_factors_errors():
    x, dy = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5))
    layer_factors = layer_factors_eager
    with pytest.raises(ValueError, match="leading"):
        layer_factors(x, jnp.ones((2, 4, 5)))
    with pytest.raises(ValueError, match="num_tokens"):
        layer_factors(x, dy, stacked=True)
    with pytest.raises(ValueError, match="mask"):
        layer_factors(x, dy, mask=jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"\(E, C, d_in\)"):
        layer_factors(jnp.ones((3, 4)), jnp.ones((3, 5)), stacked=True, num_tokens=3)


# --------------------------------------------------------------- a tiny MLP's statistics
@functools.cache
def mlp_statistics(seed=0, tokens=(4, 3), d=(5, 6, 3)):
    """Per-layer (inputs, out_grads) of a 2-layer MLP with a mean cross-entropy loss over
    tokens, captured the kfac-jax way: a zero perturbation added to each layer output and
    differentiated. Returns params, kernel/bias gradients and the per-layer captures."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    params = {
        "l1": {"kernel": normal(d[0], d[1]) / np.sqrt(d[0]), "bias": 0.1 * normal(d[1])},
        "l2": {"kernel": normal(d[1], d[2]) / np.sqrt(d[1]), "bias": 0.1 * normal(d[2])},
    }
    x = normal(*tokens, d[0])
    labels = jnp.asarray(rng.integers(0, d[2], size=tokens))

    def loss(params, perturb):
        y1 = x @ params["l1"]["kernel"] + params["l1"]["bias"] + perturb["l1"]
        h = jnp.tanh(y1)
        y2 = h @ params["l2"]["kernel"] + params["l2"]["bias"] + perturb["l2"]
        logp = jax.nn.log_softmax(y2)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1)), h

    perturb = {"l1": jnp.zeros((*tokens, d[1])), "l2": jnp.zeros((*tokens, d[2]))}
    (grads, out_grads), h = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        params, perturb)
    captures = {"l1": (x, out_grads["l1"]), "l2": (h, out_grads["l2"])}
    return params, grads, captures


def test_mlp_capture_reproduces_the_gradient():
    """The captured (x, ∂L/∂y) give back the kernel and bias gradients: x̃ᵀ ∂L/∂y."""
    _, grads, captures = mlp_statistics()
    for name, (x, dy) in captures.items():
        x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        x2 = np.concatenate([x2, np.ones((len(x2), 1))], axis=1)
        full = x2.T @ np.asarray(dy, np.float64).reshape(-1, dy.shape[-1])
        assert_close(full[:-1], grads[name]["kernel"], rtol=1e-5)
        assert_close(full[-1], grads[name]["bias"], rtol=1e-5)


# --------------------------------------------------------------------- preconditioning
def _spd(n, rng, shift=0.1, scale=1.0):
    b = rng.normal(size=(n, 2 * n))
    return scale * (b @ b.T / (2 * n) + shift * np.eye(n))


def _kron_solve(grad, a, g, lam):
    """(A ⊗ G + λI)⁻¹ vec(∇) with row-major vec of the (in, out) gradient.

    vec(∇)[i·d_out + j] = ∇[i, j] and np.kron(A, G)[(i, j), (k, l)] = A[i, k] G[j, l], so
    (A ⊗ G) vec(∇) = vec(A ∇ Gᵀ) = vec(A ∇ G): the Kronecker order matches the layout.
    """
    n = grad.size
    v = np.linalg.solve(np.kron(a, g) + lam * np.eye(n), grad.reshape(-1))
    return v.reshape(grad.shape)


def _pi_explicit(grad, a, g, lam):
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
    a_hat = a + pi * np.sqrt(lam) * np.eye(len(a))
    g_hat = g + np.sqrt(lam) / pi * np.eye(len(g))
    return np.linalg.solve(a_hat, grad) @ np.linalg.inv(g_hat)


def _f32(x):
    """float32 inputs and the float64 values of those exact numbers for the oracle."""
    x32 = np.asarray(x, np.float32)
    return jnp.asarray(x32), x32.astype(np.float64)


@pytest.mark.parametrize("lam", [1e-3, 0.1])
def test_eigen_mode_is_the_exact_kronecker_solve(lam):
    a, a64 = _f32(_spd(5, RNG))
    g, g64 = _f32(_spd(3, RNG, scale=2.0))
    grad, grad64 = _f32(RNG.normal(size=(5, 3)))
    out = precondition(grad, a, g, lam, mode="eigen")
    assert_close(out, _kron_solve(grad64, a64, g64, lam), rtol=2e-5)


@pytest.mark.parametrize("lam", [1e-3, 0.1])
def test_pi_mode_is_the_explicit_pi_damped_formula(lam):
    a, a64 = _f32(_spd(5, RNG, scale=3.0))
    g, g64 = _f32(_spd(3, RNG, scale=0.5))
    grad, grad64 = _f32(RNG.normal(size=(5, 3)))
    out = precondition(grad, a, g, lam, mode="pi")
    assert_close(out, _pi_explicit(grad64, a64, g64, lam), rtol=2e-5)
    # π from the traces.
    pi = np.sqrt((np.trace(a64) / 5) / (np.trace(g64) / 3))
    np.testing.assert_allclose(float(pi_adjustment(a, g)), pi, rtol=1e-6)


def test_pi_and_eigen_agree_without_damping():
    a, a64 = _f32(_spd(4, RNG))
    g, g64 = _f32(_spd(3, RNG))
    grad, grad64 = _f32(RNG.normal(size=(4, 3)))
    exact = np.linalg.solve(a64, grad64) @ np.linalg.inv(g64)
    assert_close(precondition(grad, a, g, 0.0, mode="pi"), exact, rtol=1e-4)
    assert_close(precondition(grad, a, g, 0.0, mode="eigen"), exact, rtol=1e-4)


@pytest.mark.parametrize("mode", ["eigen", "pi"])
def test_on_mlp_statistics(mode):
    """Real factors (from the MLP capture above) against the float64 oracles."""
    lam = 1e-2
    _, grads, captures = mlp_statistics()
    for name, (x, dy) in captures.items():
        a, g = layer_factors(x, dy, has_bias=True)
        grad = jnp.concatenate([grads[name]["kernel"], grads[name]["bias"][None]], axis=0)
        a64, g64 = np.asarray(a, np.float64), np.asarray(g, np.float64)
        grad64 = np.asarray(grad, np.float64)
        want = (_kron_solve(grad64, a64, g64, lam) if mode == "eigen"
                else _pi_explicit(grad64, a64, g64, lam))
        assert_close(precondition(grad, a, g, lam, mode=mode), want, rtol=1e-4, atol_rel=1e-5)


@pytest.mark.parametrize("mode", ["eigen", "pi"])
def test_stacked_factors_equal_per_expert(mode):
    E = 3
    a = np.stack([_spd(4, RNG) for _ in range(E)])
    g = np.stack([_spd(2, RNG) for _ in range(E)])
    grad = RNG.normal(size=(E, 4, 2))
    (grad, grad64), (a, a64), (g, g64) = (_f32(v) for v in (grad, a, g))
    out = precondition(grad, a, g, 0.05, mode=mode)
    for e in range(E):
        single = precondition(grad[e], a[e], g[e], 0.05, mode=mode)
        # A batch of 3 decompositions rounds otherwise than one: as accurate as it.
        want = (operator(a64[e], g64[e], 0.05, mode) @ grad64[e].reshape(-1)).reshape(4, 2)
        assert_as_accurate(out[e], single, want, what=f"expert {e}")


@pytest.mark.parametrize("mode", ["eigen", "pi"])
@pytest.mark.parametrize("lam", [0.0, 1e-3])
def test_zero_and_rank_deficient_factors_are_finite(mode, lam):
    grad = jnp.asarray(RNG.normal(size=(4, 3)), jnp.float32)
    x = jnp.asarray(RNG.normal(size=(1, 3)), jnp.float32)          # one token: rank 1
    cases = [
        (jnp.zeros((4, 4)), jnp.zeros((3, 3))),
        (layer_factors(x, jnp.ones((1, 3)), has_bias=True).a, jnp.zeros((3, 3))),
        (jnp.zeros((4, 4)), jnp.outer(jnp.arange(3.0), jnp.arange(3.0))),
    ]
    for a, g in cases:
        inverse, stats = refresh_inverse(a, g, lam, mode=mode)
        out = apply_inverse(inverse, grad)
        assert bool(jnp.all(jnp.isfinite(out))), (mode, lam)
        assert int(stats.num_clipped) > 0
    if lam > 0:
        # zero factors: both modes reduce to ∇/λ (pi: π = 1 when a trace is zero).
        assert_close(precondition(grad, jnp.zeros((4, 4)), jnp.zeros((3, 3)), lam, mode=mode),
               np.asarray(grad, np.float64) / lam, rtol=1e-5)


def test_clipped_eigh_floors_and_counts():
    m = jnp.diag(jnp.array([1.0, 1e-9, -1e-7, 0.5]))
    s_raw, s, q, n = clipped_eigh(m, eig_floor_abs=1e-8, eig_floor_rel=1e-6)
    np.testing.assert_allclose(np.sort(np.asarray(s_raw)), [-1e-7, 1e-9, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.sort(np.asarray(s)), [1e-6, 1e-6, 0.5, 1.0], rtol=1e-6)
    assert int(n) == 2
    assert_close(q @ jnp.diag(s_raw) @ q.T, m, rtol=1e-6)
    _, s_abs, _, n_abs = clipped_eigh(jnp.zeros((3, 3)), eig_floor_abs=1e-8, eig_floor_rel=1e-6)
    np.testing.assert_allclose(np.asarray(s_abs), 1e-8)
    assert int(n_abs) == 3


def test_identity_inverse_and_cache_types():
    grad = jnp.asarray(RNG.normal(size=(2, 4, 3)), jnp.float32)
    for mode, cls in (("pi", PiInverse), ("eigen", EigenInverse)):
        inverse = identity_inverse((2, 4, 4), (2, 3, 3), mode)
        assert isinstance(inverse, cls)
        np.testing.assert_array_equal(np.asarray(apply_inverse(inverse, grad)), np.asarray(grad))
        refreshed, _ = refresh_inverse(jnp.eye(4), jnp.eye(3), 0.0, mode=mode)
        assert isinstance(refreshed, cls)
    with pytest.raises(ValueError, match="mode"):
        refresh_inverse_eager(jnp.eye(2), jnp.eye(2), 0.1, mode="exact")
    with pytest.raises(ValueError, match="grad"):
        precondition_eager(jnp.ones((3, 3)), jnp.eye(2), jnp.eye(3), 0.1)


def test_layer_curvature_is_a_pytree():
    c = LayerCurvature(jnp.eye(2), jnp.eye(3))
    assert [x.shape for x in jax.tree.leaves(c)] == [(2, 2), (3, 3)]


def test_eigenvalue_floor_is_per_matrix_of_a_stack():
    """Each matrix of a stacked factor is floored relative to its own largest eigenvalue,
    not the stack's: a small expert keeps its spectrum next to a large one."""
    small = np.diag([1.0, 1e-3, 1e-7])          # floor 1e-6 · 1 = 1e-6: one clipped
    large = np.diag([1e4, 1.0, 1e-3])           # floor 1e-6 · 1e4 = 1e-2: one clipped
    stack = jnp.asarray(np.stack([small, large]), jnp.float32)
    _, s, _, clipped = jax.jit(clipped_eigh)(stack, 1e-8, 1e-6)
    np.testing.assert_allclose(np.sort(np.asarray(s[0])), [1e-6, 1e-3, 1.0], rtol=1e-5)
    np.testing.assert_allclose(np.sort(np.asarray(s[1])), [1e-2, 1.0, 1e4], rtol=1e-5)
    assert int(clipped) == 2
    # The same through the refresh: the small expert's inverse is that of its own floor.
    inv, _ = refresh_inverse(stack, jnp.ones((2, 1, 1)), 0.0, mode="eigen")
    np.testing.assert_allclose(np.sort(np.asarray(inv.scale[0, :, 0])), [1.0, 1e3, 1e6],
                               rtol=1e-4)
