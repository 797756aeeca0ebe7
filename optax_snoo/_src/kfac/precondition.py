"""Preconditioning one layer's gradient by its Kronecker factors (Martens & Grosse 2015, §6.3).

The expensive part (`refresh_inverse`: two eigendecompositions) is separated from the cheap
part (`apply_inverse`: matmuls), so `scale_by_kfac` can run the first only on refresh steps
and cache its result. `precondition` does both at once (tests, one-off use).

Gradients use the Flax ``(in, out)`` layout: ``grad`` is ``(d_in [+1], d_out)`` with the
bias gradient as the last row, and ``A`` (``d_in [+1]``) acts on the rows, ``G`` on the
columns. With row-major ``vec`` (``vec(∇)[i·d_out + j] = ∇[i, j]``) the Kronecker product
is ``A ⊗ G`` exactly as written: ``(A ⊗ G) vec(∇) = vec(A ∇ G)`` for symmetric factors.

Two damping modes:

- ``"eigen"`` (exact damping, the test oracle): with ``A = Q_A diag(s_A) Q_Aᵀ`` and
  ``G = Q_G diag(s_G) Q_Gᵀ``,
  ``Q_A [(Q_Aᵀ ∇ Q_G) / (s_A s_Gᵀ + λ)] Q_Gᵀ = (A ⊗ G + λ I)⁻¹ vec(∇)``.
  Cached: ``EigenInverse(q_a, q_g, scale = 1 / (s_A s_Gᵀ + λ))``.
- ``"pi"`` (factored Tikhonov damping, kfac-jax's default): ``π = sqrt((tr A/dim A) /
  (tr G/dim G))`` (1 when either trace is 0), ``Â = A + π√λ I``, ``Ĝ = G + (√λ/π) I``,
  update ``Â⁻¹ ∇ Ĝ⁻¹``. Cached: ``PiInverse(a_inv = Â⁻¹, g_inv = Ĝ⁻¹)`` as explicit
  matrices built from the eigendecompositions (so applying costs two matmuls).

Eigenvalue clipping: on every refresh each factor's eigenvalues are floored at
``max(eig_floor_abs, eig_floor_rel · s_max)`` before damping and inverting, so zero or
rank-deficient factors (and tiny negative eigenvalues from round-off) never give inf/NaN,
even with ``λ = 0``. All leading axes of the factors are a batch (expert stacks).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
MODES = ("pi", "eigen")


class EigenInverse(NamedTuple):
    """Cached exact-damping inverse of ``A ⊗ G + λI`` in the factors' eigenbases.

    Attributes:
      q_a: eigenvectors of A, ``(*stack, d_in', d_in')``.
      q_g: eigenvectors of G, ``(*stack, d_out, d_out)``.
      scale: ``1 / (s_A s_Gᵀ + λ)`` with clipped eigenvalues, ``(*stack, d_in', d_out)``.
    """

    q_a: jax.Array
    q_g: jax.Array
    scale: jax.Array


class PiInverse(NamedTuple):
    """Cached pi-damped inverses ``Â⁻¹`` and ``Ĝ⁻¹``.

    Attributes:
      a_inv: ``(A + π√λ I)⁻¹``, ``(*stack, d_in', d_in')``.
      g_inv: ``(G + √λ/π I)⁻¹``, ``(*stack, d_out, d_out)``.
    """

    a_inv: jax.Array
    g_inv: jax.Array


class SpectrumStats(NamedTuple):
    """Extremes of the raw (unclipped) factor eigenvalues seen by one refresh.

    Attributes:
      a_max, a_min: largest and smallest eigenvalue of A (over a stack too).
      g_max, g_min: same for G.
      num_clipped: how many eigenvalues of A and G were raised to the floor (int32).
    """

    a_max: jax.Array
    a_min: jax.Array
    g_max: jax.Array
    g_min: jax.Array
    num_clipped: jax.Array


Inverse = EigenInverse | PiInverse


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")


def _eigh(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``eigh`` of a matrix or a stack. On CPU a stack goes through ``lax.map`` (one matrix
    at a time)."""
    # Batched LAPACK calls on CPU can deadlock: docs/design.md, "Implementation notes".
    eigh = lambda x: jnp.linalg.eigh(x, symmetrize_input=False)
    if m.ndim == 2 or jax.default_backend() != "cpu":
        return eigh(m)
    n = m.shape[-1]
    s, q = jax.lax.map(eigh, m.reshape(-1, n, n))
    return s.reshape(m.shape[:-1]), q.reshape(m.shape)


def clipped_eigh(
    m: jax.Array, eig_floor_abs: float = 1e-8, eig_floor_rel: float = 1e-6
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Eigendecomposition of symmetric matrices with the eigenvalues floored.

    Args:
      m: ``(..., n, n)`` symmetric matrices (symmetrised before ``eigh``).
      eig_floor_abs: absolute floor.
      eig_floor_rel: floor relative to each matrix's largest eigenvalue.

    Returns:
      ``(s_raw, s_clipped, q, num_clipped)``: raw eigenvalues ``(..., n)``, eigenvalues
      floored at ``max(eig_floor_abs, eig_floor_rel · max(s_raw))``, eigenvectors
      ``(..., n, n)`` (columns) and the number of floored eigenvalues (int32 scalar).
    """
    m = m.astype(jnp.float32)
    s, q = _eigh(0.5 * (m + jnp.swapaxes(m, -1, -2)))
    floor = jnp.maximum(eig_floor_abs, eig_floor_rel * jnp.max(s, axis=-1, keepdims=True))
    clipped = s < floor
    return s, jnp.where(clipped, floor, s), q, jnp.sum(clipped).astype(jnp.int32)


def pi_adjustment(a: jax.Array, g: jax.Array) -> jax.Array:
    """``π = sqrt((tr A / dim A) / (tr G / dim G))`` per stacked layer; 1 where undefined.

    Args:
      a: ``(..., da, da)``.
      g: ``(..., dg, dg)``.

    Returns:
      π of shape ``(...)``: 1 where either mean diagonal is not positive or finite.
    """
    norm_a = jnp.trace(a, axis1=-2, axis2=-1) / a.shape[-1]
    norm_g = jnp.trace(g, axis1=-2, axis2=-1) / g.shape[-1]
    ok = (norm_a > 0) & (norm_g > 0) & jnp.isfinite(norm_a) & jnp.isfinite(norm_g)
    return jnp.sqrt(jnp.where(ok, norm_a, 1.0) / jnp.where(ok, norm_g, 1.0))


def refresh_inverse(
    a: jax.Array,
    g: jax.Array,
    damping: jax.Array | float,
    mode: str = "pi",
    eig_floor_abs: float = 1e-8,
    eig_floor_rel: float = 1e-6,
) -> tuple[Inverse, SpectrumStats]:
    """The expensive half of preconditioning: eigendecompose, clip, damp, invert.

    Args:
      a: input factor ``(*stack, d_in', d_in')``.
      g: output-gradient factor ``(*stack, d_out, d_out)``.
      damping: λ >= 0.
      mode: ``"pi"`` (factored damping) or ``"eigen"`` (exact damping of ``A ⊗ G``).
      eig_floor_abs: absolute eigenvalue floor.
      eig_floor_rel: eigenvalue floor relative to each factor's largest eigenvalue.

    Returns:
      ``(inverse, stats)``: a `PiInverse` or `EigenInverse` for `apply_inverse`, and the
      `SpectrumStats` of the raw eigenvalues.

    Raises:
      ValueError: unknown ``mode``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import apply_inverse, refresh_inverse
      >>> inv, stats = refresh_inverse(2 * jnp.eye(3), 4 * jnp.eye(2), 0.0, mode="eigen")
      >>> apply_inverse(inv, jnp.ones((3, 2)))[0, 0].item()
      0.125

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015 (§6.3, factored Tikhonov damping)

      George et al., `Fast Approximate Natural Gradient Descent in a Kronecker-factored
      Eigenbasis <https://arxiv.org/abs/1806.03884>`_, 2018
    """
    _check_mode(mode)
    damping = jnp.asarray(damping, jnp.float32)
    s_a_raw, s_a, q_a, clip_a = clipped_eigh(a, eig_floor_abs, eig_floor_rel)
    s_g_raw, s_g, q_g, clip_g = clipped_eigh(g, eig_floor_abs, eig_floor_rel)
    stats = SpectrumStats(
        a_max=jnp.max(s_a_raw), a_min=jnp.min(s_a_raw),
        g_max=jnp.max(s_g_raw), g_min=jnp.min(s_g_raw),
        num_clipped=clip_a + clip_g)
    if mode == "eigen":
        scale = 1.0 / (s_a[..., :, None] * s_g[..., None, :] + damping)
        return EigenInverse(q_a=q_a, q_g=q_g, scale=scale), stats
    pi = pi_adjustment(a.astype(jnp.float32), g.astype(jnp.float32))[..., None]
    root = jnp.sqrt(damping)
    inv_a = 1.0 / (s_a + pi * root)
    inv_g = 1.0 / (s_g + root / pi)
    a_inv = jnp.matmul(q_a * inv_a[..., None, :], jnp.swapaxes(q_a, -1, -2), precision=_HIGHEST)
    g_inv = jnp.matmul(q_g * inv_g[..., None, :], jnp.swapaxes(q_g, -1, -2), precision=_HIGHEST)
    return PiInverse(a_inv=a_inv, g_inv=g_inv), stats


def identity_inverse(a_shape: tuple[int, ...], g_shape: tuple[int, ...],
                     mode: str = "pi") -> Inverse:
    """The cache before the first refresh: `apply_inverse` returns the gradient unchanged.

    Args:
      a_shape: shape of the A factor ``(*stack, d_in', d_in')``.
      g_shape: shape of the G factor ``(*stack, d_out, d_out)``.
      mode: ``"pi"`` or ``"eigen"``.

    Returns:
      A float32 `PiInverse` (identities) or `EigenInverse` (identities, unit scale).
    """
    _check_mode(mode)
    eye_a = jnp.broadcast_to(jnp.eye(a_shape[-1], dtype=jnp.float32), a_shape)
    eye_g = jnp.broadcast_to(jnp.eye(g_shape[-1], dtype=jnp.float32), g_shape)
    if mode == "eigen":
        scale = jnp.ones(a_shape[:-1] + g_shape[-1:], jnp.float32)
        return EigenInverse(q_a=eye_a, q_g=eye_g, scale=scale)
    return PiInverse(a_inv=eye_a, g_inv=eye_g)


def apply_inverse(inverse: Inverse, grad: jax.Array) -> jax.Array:
    """The cheap half: precondition ``grad`` ``(*stack, d_in', d_out)`` with a cached inverse.

    Args:
      inverse: from `refresh_inverse` (or `identity_inverse`).
      grad: the layer gradient, bias row last when the factors include it.

    Returns:
      The preconditioned gradient in float32, same shape as ``grad``.
    """
    grad = grad.astype(jnp.float32)
    t = lambda x: jnp.swapaxes(x, -1, -2)
    mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)
    if isinstance(inverse, EigenInverse):
        rotated = mm(mm(t(inverse.q_a), grad), inverse.q_g) * inverse.scale
        return mm(mm(inverse.q_a, rotated), t(inverse.q_g))
    return mm(mm(inverse.a_inv, grad), inverse.g_inv)


def precondition(
    grad: jax.Array,
    a: jax.Array,
    g: jax.Array,
    damping: jax.Array | float,
    mode: str = "pi",
    eig_floor_abs: float = 1e-8,
    eig_floor_rel: float = 1e-6,
) -> jax.Array:
    r"""Precondition one layer's gradient: `refresh_inverse` then `apply_inverse`.

    ``mode="eigen"`` computes ``(A ⊗ G + λI)⁻¹ vec(∇)`` (row-major vec, Flax layout);
    ``mode="pi"`` computes ``(A + π√λ I)⁻¹ ∇ (G + √λ/π I)⁻¹``, both with
    clipped eigenvalues.

    Args:
      grad: ``(*stack, d_in [+1], d_out)``, the bias gradient as the last row when ``a``
        includes the homogeneous coordinate.
      a: ``(*stack, d_in [+1], d_in [+1])``.
      g: ``(*stack, d_out, d_out)``.
      damping: λ >= 0.
      mode: ``"pi"`` or ``"eigen"``.
      eig_floor_abs: absolute eigenvalue floor.
      eig_floor_rel: eigenvalue floor relative to each factor's largest eigenvalue.

    Returns:
      The preconditioned gradient, float32, shape of ``grad``.

    Raises:
      ValueError: unknown ``mode`` or shapes that do not fit together.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import precondition
      >>> a, g = jnp.diag(jnp.array([1.0, 4.0])), jnp.eye(3)
      >>> precondition(jnp.ones((2, 3)), a, g, damping=0.0, mode="pi")[:, 0].tolist()
      [1.0, 0.25]

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015
    """
    if (a.shape[-1] != a.shape[-2] or g.shape[-1] != g.shape[-2]
            or grad.shape[-2:] != (a.shape[-1], g.shape[-1])):
        raise ValueError(
            f"grad {grad.shape} must be (*stack, d_in', d_out) for a {a.shape} and g {g.shape}.")
    inverse, _ = refresh_inverse(a, g, damping, mode, eig_floor_abs, eig_floor_rel)
    return apply_inverse(inverse, grad)
