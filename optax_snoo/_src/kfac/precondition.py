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

from collections.abc import Callable
from typing import Any, NamedTuple

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


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of `MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")


def map_matrices(fn: Callable[..., Any], *stacks: jax.Array) -> Any:
    """``fn`` of one matrix (and its per-matrix operands) over stacks ``(K, ...)``.

    On CPU one matrix at a time through ``lax.map``, elsewhere ``vmap``.
    """
    # Batched LAPACK calls on CPU can deadlock: docs/design.md, "Implementation notes".
    if jax.default_backend() == "cpu":
        return jax.lax.map(lambda xs: fn(*xs), stacks)
    return jax.vmap(fn)(*stacks)


def floored_eigh(m: jax.Array, eig_floor_abs: float, eig_floor_rel: float
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``eigh`` of one ``(n, n)`` matrix (symmetrised first), eigenvalues floored.

    Returns ``(s_raw, s, q, clipped)``: raw and floored eigenvalues, eigenvectors
    (columns), and which eigenvalues were raised to ``max(eig_floor_abs, eig_floor_rel ·
    max(s_raw))``.
    """
    m = m.astype(jnp.float32)
    s_raw, q = jnp.linalg.eigh(0.5 * (m + m.T), symmetrize_input=False)
    floor = jnp.maximum(eig_floor_abs, eig_floor_rel * jnp.max(s_raw))
    clipped = s_raw < floor
    return s_raw, jnp.where(clipped, floor, s_raw), q, clipped


def refresh_stack(mats: jax.Array, shifts: jax.Array, mode: str, eig_floor_abs: float,
                  eig_floor_rel: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The refresh of ``K`` equal-size factors ``(K, d, d)`` on one device.

    Args:
      mats: the factors.
      shifts: ``(K,)`` each factor's damping shift (pi mode: ``π√λ`` for A, ``√λ/π`` for G).
      mode: ``"pi"`` or ``"eigen"``.
      eig_floor_abs: absolute eigenvalue floor.
      eig_floor_rel: floor relative to each matrix's largest eigenvalue.

    Returns:
      ``(out, s, stats)``: ``out`` ``(K, d, d)`` the eigenvectors (eigen) or the inverses
      ``Q diag(1/(s + shift)) Qᵀ`` (pi), ``s`` ``(K, d)`` the floored eigenvalues,
      ``stats`` ``(K, 3)`` each matrix's raw max, raw min and number floored (float32).
    """
    def one(m, shift):
        s_raw, s, q, clipped = floored_eigh(m, eig_floor_abs, eig_floor_rel)
        stats = jnp.stack([jnp.max(s_raw), jnp.min(s_raw),
                           jnp.sum(clipped).astype(jnp.float32)])
        if mode == "eigen":
            return q, s, stats
        inv = jnp.matmul(q * (1.0 / (s + shift))[None, :], q.T, precision=_HIGHEST)
        return inv, s, stats

    return map_matrices(one, mats, shifts)


def damping_shifts(a: jax.Array, g: jax.Array, damping: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """The pi-damping shifts ``(π√λ, √λ/π)`` of A and G, shaped like their stack axes."""
    pi = pi_adjustment(a.astype(jnp.float32), g.astype(jnp.float32))
    root = jnp.sqrt(damping)
    return pi * root, root / pi


def assemble_inverse(refreshed_a: tuple[jax.Array, ...], refreshed_g: tuple[jax.Array, ...],
                     a_shape: tuple[int, ...], g_shape: tuple[int, ...], damping: jax.Array,
                     mode: str) -> tuple[Inverse, SpectrumStats]:
    """One layer's cached inverse and spectrum from `refresh_stack` of its A and G.

    Args:
      refreshed_a: ``(out, s, stats)`` of the layer's A matrices (its stack flattened).
      refreshed_g: the same for G.
      a_shape: ``(*stack, d_a, d_a)``.
      g_shape: ``(*stack, d_g, d_g)``.
      damping: λ (eigen mode's scale ``1 / (s_A s_Gᵀ + λ)``).
      mode: ``"pi"`` or ``"eigen"``.

    Returns:
      ``(inverse, stats)`` as `refresh_inverse` returns them.
    """
    (out_a, s_a, st_a), (out_g, s_g, st_g) = refreshed_a, refreshed_g
    out_a, out_g = out_a.reshape(a_shape), out_g.reshape(g_shape)
    if mode == "eigen":
        s_a, s_g = s_a.reshape(a_shape[:-1]), s_g.reshape(g_shape[:-1])
        scale = 1.0 / (s_a[..., :, None] * s_g[..., None, :] + damping)
        inverse: Inverse = EigenInverse(q_a=out_a, q_g=out_g, scale=scale)
    else:
        inverse = PiInverse(a_inv=out_a, g_inv=out_g)
    stats = SpectrumStats(
        a_max=jnp.max(st_a[:, 0]), a_min=jnp.min(st_a[:, 1]),
        g_max=jnp.max(st_g[:, 0]), g_min=jnp.min(st_g[:, 1]),
        num_clipped=(jnp.sum(st_a[:, 2]) + jnp.sum(st_g[:, 2])).astype(jnp.int32))
    return inverse, stats


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
    n = m.shape[-1]
    s_raw, s, q, clipped = map_matrices(
        lambda x: floored_eigh(x, eig_floor_abs, eig_floor_rel), m.reshape(-1, n, n))
    lead = m.shape[:-1]
    return (s_raw.reshape(lead), s.reshape(lead), q.reshape(m.shape),
            jnp.sum(clipped).astype(jnp.int32))


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
    *,
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
    check_mode(mode)
    damping = jnp.asarray(damping, jnp.float32)
    shift_a, shift_g = damping_shifts(a, g, damping)
    refreshed = [refresh_stack(m.reshape(-1, *m.shape[-2:]), shift.reshape(-1), mode,
                               eig_floor_abs, eig_floor_rel)
                 for m, shift in ((a, jnp.broadcast_to(shift_a, a.shape[:-2])),
                                  (g, jnp.broadcast_to(shift_g, g.shape[:-2])))]
    return assemble_inverse(*refreshed, a.shape, g.shape, damping, mode)


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
    check_mode(mode)
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
    *,
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
    inverse, _ = refresh_inverse(a, g, damping, mode=mode, eig_floor_abs=eig_floor_abs,
                                  eig_floor_rel=eig_floor_rel)
    return apply_inverse(inverse, grad)
