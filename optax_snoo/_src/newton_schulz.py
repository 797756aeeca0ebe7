"""Newton-Schulz orthogonalisation: the coefficient presets and the iteration.

`orthogonalize` (public) and `_newton_schulz` (its jitted body, what `scale_by_muon` runs),
Aurora's leverage-balanced polar and #38's tempered polar around it (`leverage_balanced`,
`tempered_polar`), the coefficient presets
(``"keller"``, ``"modded"``, ``"polar_express"``), the Gram-norm normalisation of
modded-nanogpt Track 3 and the checks of ``matrix_axes`` shared by Muon's transforms.

References:
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024

  Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their Application to
  the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025

  Tilde Research, `Aurora <https://github.com/tilde-research/aurora-release>`_, 2026;
  modded-nanogpt Track 3 result #17 (``results/20260505_aurora``), 2026

  Clark, modded-nanogpt Track 3 result #38 (``results/20260520_tail_refinterp_2900``,
  ``apply_tempered_polar``), 2026
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_snoo._src.utils import check_float_dtype, concrete_real

Triples = tuple[tuple[float, float, float], ...]
Coefficients = str | Sequence[Sequence[float]]

KELLER_COEFFICIENTS: Triples = ((3.4445, -4.7750, 2.0315),) * 5
MODDED_COEFFICIENTS: Triples = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
# Amsel et al. (2025), Algorithm 1: the degree-5 Polar Express polynomials for
# l = 1e-3, each but the last divided by 1.01 at x (a/1.01, b/1.01^3, c/1.01^5), and the
# input normalised by 1.01 ||X||_F. That extra 1.01 is folded into the first triple here
# (p(x / 1.01)), so the preset runs on the usual ||X||_F normalisation.
_POLAR_EXPRESS_PAPER: Triples = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def _polar_express(steps: int = 5, safety: float = 1.01) -> Triples:
    scaled = [(a / safety, b / safety**3, c / safety**5) for a, b, c in _POLAR_EXPRESS_PAPER[:-1]]
    scaled.append(_POLAR_EXPRESS_PAPER[-1])
    triples = scaled[:steps] + [scaled[-1]] * (steps - len(scaled))
    (a, b, c), rest = triples[0], triples[1:]
    return ((a / safety, b / safety**3, c / safety**5), *rest)


#: The ``"polar_express"`` preset: the first five polynomials of Amsel et al.'s
#: Algorithm 1 (degree 5, l = 1e-3), their 1.01 safety factors and ``1.01 ‖X‖_F``
#: normalisation folded into the first triple, so they run on plain ``‖X‖_F``.
POLAR_EXPRESS_COEFFICIENTS: Triples = _polar_express(5)
#: modded-nanogpt Track 3's Newton-Schulz (``train_gpt_simple.py`` and every record
#: after it): the cubic (2, -1.5, 0.5), i.e. ``X <- 2X - 1.5 XXᵀX + 0.5 (XXᵀ)²X``, twelve
#: times (the ``"track3"`` preset).
TRACK3_COEFFICIENTS: Triples = ((2.0, -1.5, 0.5),) * 12
#: The Newton-Schulz presets of ``coefficients=`` by name, each a tuple of ``(a, b, c)``
#: triples, one per iteration: ``"keller"``, ``"modded"``, ``"polar_express"``,
#: ``"track3"`` (see `orthogonalize`).
COEFFICIENT_PRESETS: dict[str, Triples] = {
    "keller": KELLER_COEFFICIENTS,
    "modded": MODDED_COEFFICIENTS,
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
    "track3": TRACK3_COEFFICIENTS,
}
#: How the Newton-Schulz input is scaled before the iteration (see `orthogonalize`).
NS_NORMALIZATIONS = ("frobenius", "gram_frobenius")


def _resolve_coefficients(coefficients: Coefficients) -> Triples:
    """A preset name or a sequence of (a, b, c) triples -> a tuple of float triples."""
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_PRESETS:
            raise ValueError(
                f"Unknown Newton-Schulz coefficient preset {coefficients!r}; expected one of "
                f"{sorted(COEFFICIENT_PRESETS)} or a sequence of (a, b, c) triples.")
        return COEFFICIENT_PRESETS[coefficients]
    expected = ("expected a non-empty sequence of (a, b, c) triples, one per iteration, "
                "e.g. ((3.4445, -4.7750, 2.0315),) * 5")
    try:
        table = np.asarray(coefficients, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"Bad Newton-Schulz coefficients {coefficients!r}: {expected}.") from None
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] != 3:
        raise ValueError(f"Bad Newton-Schulz coefficients {coefficients!r}: {expected}.")
    return tuple((float(a), float(b), float(c)) for a, b, c in table)


def _check_matrix_axes(matrix_axes: Any) -> tuple[int, int]:
    if (not isinstance(matrix_axes, Sequence) or len(matrix_axes) != 2
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in matrix_axes)
            or matrix_axes[0] == matrix_axes[1]):
        raise ValueError(
            f"matrix_axes must be two distinct ints (fan_in axis, fan_out axis), e.g. (-2, -1) "
            f"for Flax (in, out) kernels or (1, 2) for (E, in, out) stacks; got {matrix_axes!r}.")
    return int(matrix_axes[0]), int(matrix_axes[1])


def _normalized_axes(shape: tuple[int, ...], matrix_axes: tuple[int, int]) -> tuple[int, int]:
    """`matrix_axes` as non-negative axes of `shape`, or a ValueError at init/trace time."""
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(
            f"Muon needs a matrix or a stack of matrices, got a leaf of shape {shape}: "
            "0-D and 1-D parameters (biases, norms, scalars) belong to Adam; use `muon()`, "
            "which sends them to AdamW, or label them for another optimizer.")
    if not all(-ndim <= a < ndim for a in matrix_axes):
        raise ValueError(f"matrix_axes {matrix_axes} out of range for a leaf of shape {shape}.")
    fan_in_axis, fan_out_axis = (a % ndim for a in matrix_axes)
    if fan_in_axis == fan_out_axis:
        raise ValueError(
            f"matrix_axes {matrix_axes} name the same axis of a leaf of shape {shape}.")
    return fan_in_axis, fan_out_axis


def orthogonalize(
    x: jax.Array,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    eps: float = 1e-7,
    normalization: str = "frobenius",
) -> jax.Array:
    r"""Approximately orthogonalise a matrix (or each matrix of a stack) by Newton-Schulz.

    The iteration of Jordan's Muon and modded-nanogpt: cast to ``ns_dtype``, transpose
    when rows > cols, divide by ``‖X‖_F + eps`` (``normalization="frobenius"``) or by
    ``max(‖X Xᵀ‖_F^{1/2}, eps)`` (``"gram_frobenius"``, modded-nanogpt Track 3 record
    #46: ``‖X Xᵀ‖_F^{1/2} = (Σσ⁴)^{1/4}`` is still ``>= σ_max`` but closer to it than
    ``‖X‖_F``, so the iteration starts with larger singular values), then for each
    triple ``(a, b, c)``:
    ``A = X Xᵀ; B = b A + c A A; X = a X + B X``, and transpose back. It maps each singular
    value ``σ/‖X‖_F`` through the composed odd polynomial, so ``X = U S Vᵀ`` comes out as
    ``U S' Vᵀ`` with ``S'`` in a band around 1, not exactly 1 (each preset's band, checked
    by the tests: docs/muon.md, "Newton-Schulz").

    The last two axes are the matrix; leading axes are a batch (each matrix is normalised
    and orthogonalised on its own, by batched matmuls). Matmuls run in ``ns_dtype``; the
    elementwise steps run in float32, as PyTorch's bfloat16 arithmetic does, so the
    coefficients are not rounded to bfloat16 (which would widen the band: docs/muon.md).

    The iterations run under ``lax.scan``, which keeps one iteration's temporaries live
    (docs/design.md has the measurements behind the implementation choices).

    Args:
      x: an array of shape ``(..., rows, cols)``, any float dtype.
      coefficients: ``"modded"`` (the five per-iteration triples of modded-nanogpt's
        GPT-2 Medium track, optax's ``"dion"``), ``"keller"`` ((3.4445, -4.7750, 2.0315)
        five times, optax.contrib.muon's default), ``"polar_express"`` (the first five
        polynomials of Amsel et al.'s Algorithm 1, with its 1.01 safety factors and its
        ``1.01 ‖X‖_F`` normalisation folded into the first), or a sequence of
        ``(a, b, c)`` triples, one per iteration.
      ns_dtype: dtype of the iteration (bfloat16 as in the record; float32 for accuracy).
      eps: added to the Frobenius norm (``"frobenius"``), or the floor of the Gram norm
        (``"gram_frobenius"``), before dividing.
      normalization: ``"frobenius"`` or ``"gram_frobenius"`` (above).

    Returns:
      An array of ``x.shape`` in float32 (float64 when ``ns_dtype`` is float64),
      whatever the input dtype, so callers can accumulate it before casting.

    Raises:
      ValueError: for an unknown preset, malformed coefficients, an unknown
        ``normalization``, or ``x.ndim < 2``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from optax_snoo import orthogonalize
      >>> g = jax.random.normal(jax.random.key(0), (64, 128))
      >>> s = jnp.linalg.svd(orthogonalize(g, "keller", jnp.float32), compute_uv=False)
      >>> bool(jnp.all((s > 0.6) & (s < 1.2)))
      True

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024

      Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their Application
      to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025
    """
    triples = _resolve_coefficients(coefficients)
    check_float_dtype("ns_dtype", ns_dtype)
    _check_ns_normalization(normalization)
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs an array with >= 2 axes, got shape {x.shape}.")
    return _newton_schulz(x, triples, jnp.dtype(ns_dtype), eps, normalization)


def gram_frobenius_norm(x: jax.Array, eps: float) -> jax.Array:
    """``max(‖Xᵀ X‖_F^{1/2}, eps)`` per matrix (last two axes), from the smaller Gram.

    ``(Σσ⁴)^{1/4}``: between ``σ_max`` and ``‖X‖_F`` (modded-nanogpt Track 3's
    ``gram_frobenius_norm_estimate``). The matrix axes are kept (size 1), to divide by.
    """
    spec = "...ji,...jk->...ik" if x.shape[-2] > x.shape[-1] else "...ij,...kj->...ik"
    gram = jnp.einsum(spec, x, x, precision=jax.lax.Precision.HIGHEST)
    norm = jnp.sqrt(jnp.sqrt(jnp.sum(jnp.square(gram), axis=(-2, -1), keepdims=True)))
    return jnp.maximum(norm, eps)


def _check_ns_normalization(normalization: Any) -> None:
    if normalization not in NS_NORMALIZATIONS:
        raise ValueError(f"ns_normalization must be one of {NS_NORMALIZATIONS}, "
                         f"got {normalization!r}.")


@functools.partial(jax.jit, static_argnums=(1, 2, 4, 5))
def _newton_schulz(x: jax.Array, triples: Triples, ns_dtype: jnp.dtype,
                   eps: jax.typing.ArrayLike, normalization: str = "frobenius",
                   series: tuple[float, ...] | None = None) -> jax.Array:
    """The iteration on the last two axes. Jitted so that eager callers compile it once
    per shape instead of op by op; inside an outer jit it is simply inlined.

    ``series`` (``len(triples) + 1`` weights ``w_k``): instead of the last iterate, the
    weighted sum ``Σ_k w_k X_k`` of every iterate (``X_0`` the normalised input), summed
    in float32 (Soft-Muon's series, `optax_snoo.scale_by_muon`'s ``spectral_map="soft"``).
    """
    out_dtype = jnp.promote_types(ns_dtype, jnp.float32)
    transposed = x.shape[-2] > x.shape[-1]
    X = jnp.swapaxes(x, -1, -2) if transposed else x
    info = jnp.finfo(ns_dtype)
    narrow = info.bits < jnp.finfo(out_dtype).bits

    # XLA:CPU drops bf16 round trips per program (excess precision); reduce_precision stays.
    def rounded(v: jax.Array) -> jax.Array:
        return jax.lax.reduce_precision(v, info.nexp, info.nmant) if narrow else v

    def down(v: jax.Array) -> jax.Array:
        return rounded(v).astype(ns_dtype)

    def up(v: jax.Array) -> jax.Array:
        return rounded(v.astype(out_dtype))

    X = up(X.astype(ns_dtype))
    if normalization == "gram_frobenius":
        X = down(X / gram_frobenius_norm(X, eps))
    else:
        norm = jnp.sqrt(jnp.sum(jnp.square(X), axis=(-2, -1), keepdims=True))
        X = down(X / (norm + eps))

    # Each product accumulates in out_dtype and is rounded to ns_dtype after, which is
    # what a bf16 @ bf16 -> bf16 product computes; written so, XLA:CPU runs it on its
    # bf16 kernels instead of converting to float32 first (benchmarks/README.md, "Trainer
    # step throughput").
    def dot(x: jax.Array, y: jax.Array, spec: str = "...ij,...jk->...ik") -> jax.Array:
        return jnp.einsum(spec, x, y, preferred_element_type=out_dtype).astype(ns_dtype)

    def iteration(X: jax.Array, abc: jax.Array) -> tuple[jax.Array, None]:
        a, b, c = abc[0], abc[1], abc[2]
        A = dot(X, X, "...ij,...kj->...ik")  # X Xᵀ
        B = down(b * up(A) + c * up(dot(A, A)))
        return down(a * up(X) + up(dot(B, X))), None

    if series is None:
        X, _ = jax.lax.scan(iteration, X, jnp.asarray(triples, out_dtype))
        X = up(X)
    else:
        def weighted(carry: tuple, abcw: jax.Array) -> tuple[tuple, None]:
            X, total = carry
            return (iteration(X, abcw)[0], total + abcw[3] * up(X)), None

        steps = jnp.asarray([(*t, w) for t, w in zip(triples, series[:-1], strict=True)],
                            out_dtype)
        (X, total), _ = jax.lax.scan(weighted, (X, jnp.zeros(X.shape, out_dtype)), steps)
        X = total + series[-1] * up(X)
    return jnp.swapaxes(X, -1, -2) if transposed else X



def soft_polar(x: jax.Array, newton_schulz: Callable[[jax.Array], jax.Array], *,
               contra: Any, blend: Any, series: tuple[float, ...], ns_dtype: Any,
               eps: float = 1e-10) -> jax.Array:
    """Soft-Muon's blend with (Contra-)Muon of the last two axes, around ``newton_schulz``.

    With ``‖X‖₄ = max(‖XᵀX‖_F^{1/2}, eps)``, ``O = newton_schulz(x)``, ``n = ‖O‖₄`` and
    ``[Y] = Y n/‖Y‖₄``: ``C = [O - (contra/2) x/‖x‖₄]``, ``S = [Σ_j w_j X_j]`` (``w`` =
    ``series``, ``X_j`` the iterates of the ``"track3"`` iteration on the Gram-normalised
    ``x``) and the result ``[C + blend (S - C)]`` (``C`` while ``blend`` is 0: the series
    is not run). Float32 (float64 for float64 ``x``), as modded-nanogpt Track 3 result
    #20's ``muon_update``; see `optax_snoo.scale_by_muon`'s ``spectral_map="soft"``.
    """
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(dtype)
    o = newton_schulz(x).astype(dtype)
    n = gram_frobenius_norm(o, eps)
    fit = lambda y: y * (n / gram_frobenius_norm(y, eps))
    c = fit(o - (contra / 2) * (x / gram_frobenius_norm(x, eps)))

    def with_series() -> jax.Array:
        s = _newton_schulz(x, TRACK3_COEFFICIENTS, jnp.dtype(ns_dtype), 1e-7,
                           "gram_frobenius", tuple(series))
        return fit(c + blend * (fit(s.astype(dtype)) - c))

    b = concrete_real(blend)
    if b == 0:
        return c
    if b is not None:
        return with_series()
    return jax.lax.cond(blend == 0, lambda: c, with_series)


def leverage_balanced(x: jax.Array, newton_schulz: Callable[[jax.Array], jax.Array],
                      iterations: int, beta: float, eps: float = 1e-7) -> jax.Array:
    """Aurora's leverage-uniform polar of the last two axes: ``polar(D·X)``.

    With ``m`` the longer matrix axis and ``n`` the shorter (tall: ``D`` scales rows; wide:
    columns), ``D = 1/max(‖X_i‖, eps)`` per line of the longer axis (norm over the shorter
    one), then ``iterations`` rounds of ``U = newton_schulz(D·X)``, between rounds
    ``D ← D ((n/m) / max(‖U_i‖², eps²))^beta``: ``U``'s lines of the longer axis get the
    uniform squared norm ``n/m``. A square matrix has no such freedom: plain
    ``newton_schulz(X)``. ``D`` in float32 (float64 for float64 input), as the record.
    """
    rows, cols = x.shape[-2], x.shape[-1]
    if rows == cols:
        return newton_schulz(x)
    short = -1 if rows > cols else -2  # the axis each line's norm runs over
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(dtype)
    target = min(rows, cols) / max(rows, cols)
    d = 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=short, keepdims=True)), eps)
    for k in range(iterations):
        u = newton_schulz(d * x)
        if k < iterations - 1:
            line_sq = jnp.sum(jnp.square(u.astype(dtype)), axis=short, keepdims=True)
            d = d * (target / jnp.maximum(line_sq, eps * eps)) ** beta
    return u


# #38's clamp of the three norms in its tempered polar.
_TEMPER_EPS = 1e-10


def tempered_polar(x: jax.Array, newton_schulz: Callable[[jax.Array], jax.Array],
                   rho: jax.typing.ArrayLike, max_delta: float,
                   round_dtype: Any = None) -> jax.Array:
    """Tempered polar of the last two axes: ``U = newton_schulz(X)`` moved toward ``X``.

    With ``‖·‖`` the Gram-Frobenius norm (`gram_frobenius_norm`, ``(Σσ⁴)^{1/4}``, clamped
    at 1e-10), ``P = X/‖X‖`` and ``R = P - U``:
    ``M = U + ρ·min(1, max_delta·‖U‖/‖R‖)·R``, rescaled to ``‖U‖``: a little of the
    input's spectrum (its large singular values larger) comes back into the polar, the
    step's size unchanged. ``ρ = 0`` returns ``U``. Computed in float32 (float64 for
    float64 input) and rounded to ``round_dtype`` where that is narrower, as the record
    casts the result back to its bfloat16 polar.
    """
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    u = newton_schulz(x)
    uf, xf = u.astype(dtype), x.astype(dtype)
    norm = gram_frobenius_norm(uf, _TEMPER_EPS)
    residual = xf / gram_frobenius_norm(xf, _TEMPER_EPS) - uf
    clip = jnp.minimum(max_delta * norm / gram_frobenius_norm(residual, _TEMPER_EPS), 1.0)
    rho = jnp.asarray(rho, dtype)
    mixed = uf + rho * residual * clip
    mixed = mixed * (norm / gram_frobenius_norm(mixed, _TEMPER_EPS))
    if round_dtype is not None and jnp.finfo(round_dtype).bits < jnp.finfo(dtype).bits:
        info = jnp.finfo(round_dtype)
        mixed = jax.lax.reduce_precision(mixed, info.nexp, info.nmant)
    return jnp.where(rho == 0, uf, mixed).astype(u.dtype)
