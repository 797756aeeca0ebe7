"""Muon: momentum orthogonalised by Newton-Schulz, as in modded-nanogpt's GPT-2 Medium track.

`orthogonalize` is the Newton-Schulz iteration, `scale_by_muon` the direction (momentum,
orthogonalisation, shape scale, optional update smoothing), `muon` the whole-tree
optimizer (Muon on matrices and matrix stacks, AdamW groups on the rest: the library's
one Muon + Adam builder) and `muon_momentum_warmup` the record's momentum warm-up. On
sharded params the iteration runs on whole matrices assigned to devices (see
`scale_by_muon`'s ``shard_newton_schulz``).

Differences from `optax.contrib.muon` (optax 0.2.8), all deliberate:

- the momentum is not bias-corrected by default (modded-nanogpt); `bias_correction=True`
  reproduces optax's corrected momentum and Nesterov step exactly;
- the iteration runs in `ns_dtype` (bfloat16 by default, as in the record), not in the
  gradient dtype, and the momentum is kept in float32 for bf16/f16/f32 params (float64
  for float64 params);
- leaves with more than two axes are stacks of matrices (`matrix_axes` names the two
  matrix axes), so MoE expert weights `(E, in, out)` get Muon instead of silently going
  to Adam;
- weight decay takes a per-leaf multiplier (the record's `wd_mul`);
- the AdamW group does not use Nesterov momentum unless `adam_nesterov=True` (optax's
  `muon(nesterov=True)` applies Nesterov to both groups; ours keeps AdamW plain, as the
  record does);
- on sharded params each device orthogonalises whole matrices of its own
  (`shard_newton_schulz`); optax leaves the iteration to the partitioner.

References:
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024

  Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
  <https://github.com/KellerJordan/modded-nanogpt>`_ (records), 2024-2025

  Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_,
  2025 (Moonlight; the consistent-RMS shape scale)

  Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their Application to
  the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.adam import AdamGroup, adam_group
from optax_snoo._src.labels import muon_adam_labels, partition
from optax_snoo._src.muon_sharding import (
    MatrixPrecondition,
    NewtonSchulzPlan,
    OwnedPreconditionState,
    init_precondition,
    orthogonalize_leaves,
    place_leaves,
)
from optax_snoo._src.schedules import muon_momentum_schedule
from optax_snoo._src.utils import (
    check_float_dtype,
    check_int_at_least,
    check_non_negative,
    check_unit_interval,
    path_to_str,
    state_dtype,
    value_at,
)
from optax_snoo._src.weight_decay import add_decoupled_weight_decay

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
#: The Newton-Schulz presets of ``coefficients=`` by name, each a tuple of ``(a, b, c)``
#: triples, one per iteration: ``"keller"``, ``"modded"``, ``"polar_express"`` (see
#: `orthogonalize`).
COEFFICIENT_PRESETS: dict[str, Triples] = {
    "keller": KELLER_COEFFICIENTS,
    "modded": MODDED_COEFFICIENTS,
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
}
SMOOTHING_FORMS = ("ema", "nesterov")
#: How the Newton-Schulz input is scaled before the iteration (see `orthogonalize`).
NS_NORMALIZATIONS = ("frobenius", "gram_frobenius")
SHAPE_SCALES = ("modded", "consistent_rms")


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


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _newton_schulz(x: jax.Array, triples: Triples, ns_dtype: jnp.dtype,
                   eps: jax.typing.ArrayLike, normalization: str = "frobenius") -> jax.Array:
    """The iteration on the last two axes. Jitted so that eager callers compile it once
    per shape instead of op by op; inside an outer jit it is simply inlined."""
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

    X, _ = jax.lax.scan(iteration, X, jnp.asarray(triples, out_dtype))
    X = up(X)
    return jnp.swapaxes(X, -1, -2) if transposed else X


class MuonState(NamedTuple):
    """State of `scale_by_muon`.

    Attributes:
      count: number of updates so far (int32 scalar); schedules are evaluated at it.
      mu: momentum buffer, shaped like the params, in ``mu_dtype`` (by default float32,
        float64 for float64 params).
      smooth: update-smoothing buffer (shaped like the params, float32 or float64 as
        ``mu``), or ``optax.EmptyState()`` when smoothing is off.
      nu: NorMuon's second moment (float32 or float64 as ``mu``, shaped like the params
        with the reduced matrix axis of size 1), or ``optax.EmptyState()`` without
        ``beta2``.
      precondition: the state of the ``precondition`` transform (e.g.
        `SoapWhiteningState`), or ``optax.EmptyState()`` without one.
    """

    count: jax.Array
    mu: optax.Updates
    smooth: optax.Updates | optax.EmptyState
    nu: optax.Updates | optax.EmptyState = optax.EmptyState()
    precondition: optax.OptState = optax.EmptyState()


def muon_momentum_warmup(start: float = 0.85, end: float = 0.95,
                         steps: int = 300) -> optax.Schedule:
    """The record's momentum warm-up: ``β(t) = start + (end - start) * min(t / steps, 1)``.

    `muon_momentum_schedule` without a cool-down (``warmup=steps``).

    Args:
      start: momentum at update 0.
      end: momentum from update ``steps`` on.
      steps: length of the linear warm-up (> 0).

    Returns:
      A schedule (callable of the update count) to pass as ``beta``.

    Example:
      >>> from optax_snoo import muon_momentum_warmup, scale_by_muon
      >>> beta = muon_momentum_warmup()
      >>> round(float(beta(150)), 4)
      0.9
      >>> tx = scale_by_muon(beta=beta)

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    check_unit_interval("start", start)
    check_unit_interval("end", end)
    check_int_at_least("steps", steps, 1)
    return muon_momentum_schedule(start, end, warmup=steps)


def _resolve_shape_scale(shape_scale: Any) -> str | None:
    """``True``/``"modded"`` -> "modded", ``"consistent_rms"``, ``False``/``None`` -> None."""
    if shape_scale is True:
        return "modded"
    if shape_scale is False or shape_scale is None:
        return None
    if isinstance(shape_scale, str) and shape_scale in SHAPE_SCALES:
        return shape_scale
    raise ValueError(
        f"shape_scale must be one of {SHAPE_SCALES}, True (= 'modded'), False or None "
        f"(no scale); got {shape_scale!r}.")


def _shape_factor(kind: str | None, fan_in: int, fan_out: int) -> float:
    if kind == "modded":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if kind == "consistent_rms":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    return 1.0


def scale_by_muon(
    beta: float | optax.Schedule = 0.95,
    *,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    beta2: float | optax.Schedule | None = None,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    mu_dtype: jax.typing.DTypeLike | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    precondition: optax.GradientTransformation | MatrixPrecondition | None = None,
    ns_normalization: str = "frobenius",
) -> optax.GradientTransformation:
    r"""The Muon direction: orthogonalised momentum, scaled by the matrix shape.

    For each leaf (a matrix, or a stack of matrices whose two matrix axes are
    ``matrix_axes``), with gradient ``g`` and ``t`` the update count::

        m = β m + (1-β) g                                 # float32 buffer
        v = β m + (1-β) g   if nesterov else   m          # EMA form of Nesterov
        v = precondition(v, raw_gradient=g)               # if precondition (below)
        O = orthogonalize(v)                              # each matrix on its own
        O = normuon(O)                                    # if beta2 (NorMuon, below)
        S = σ S + (1-σ) O;  O = S (ema) or σ S + (1-σ) O (nesterov)   # if smoothing
        update = s(fan_in, fan_out) * O                   # shape scale

    with ``s = sqrt(max(1, fan_out / fan_in))`` (``shape_scale="modded"``, the record's)
    or ``s = 0.2 sqrt(max(fan_in, fan_out))`` (``"consistent_rms"``, Moonlight's: the
    update's RMS matches AdamW's, about 0.2, so AdamW's learning rate and weight decay
    carry over).

    NorMuon (``beta2`` set; Li et al. 2025, as modded-nanogpt's current record runs it):
    with ``r`` the shorter matrix axis (``fan_in`` for a square matrix, so the statistic
    is per output neuron), ``q = mean_r(O²)`` (one value per row of the longer axis),
    ``ν = β₂ ν + (1-β₂) q``, ``D = O / sqrt(max(ν, 1e-10))`` and
    ``O = D ‖O‖_F / max(‖D‖_F, 1e-10)``: each neuron's update gets the same RMS on
    average, and the matrix keeps the Frobenius norm orthogonalisation gave it.

    Preconditioning (``precondition`` set, e.g. `scale_by_soap_whitening` for
    SOAP-Muon): a transform that receives the tree of Newton-Schulz inputs ``v`` as its
    ``updates``, the params, and the raw gradient ``g`` as the extra argument
    ``raw_gradient``, keeps its own state (`MuonState`'s ``precondition`` field) and
    returns the matrices to orthogonalise. With sharded params it runs before the
    matrices go to their owners, on the leaves as they lie (their own sharding; the
    partitioner places its products), and only the iteration runs on whole matrices.
    A `MatrixPrecondition` (e.g. `soap_whitening_per_matrix`) is a function of each
    matrix alone: with sharded params the raw gradient travels to the owner beside the
    momentum (the same all-to-all), the owner preconditions its whole matrices before
    their iteration and keeps their state (`OwnedPreconditionState`), so the sharded
    plan's collectives stay one redistribution in and one out.

    With ``bias_correction=True`` the momentum is bias-corrected exactly as
    ``optax.contrib.scale_by_muon`` does: ``v = β m/(1-β^(t+2)) + (1-β) g/(1-β^(t+1))``
    with Nesterov, ``v = m/(1-β^(t+1))`` without. The update is returned in the gradient
    dtype; no learning rate and no sign are applied (chain with
    ``optax.scale_by_learning_rate``, or use `muon`).

    Sharded params (``shard_newton_schulz=True``): the whole matrices of the leaves
    split over a multi-device mesh, of every shape, are assigned to devices in one
    balanced assignment, each device runs the iteration on its own matrices, and the
    results return to the leaves' shardings: no collective inside the iteration, one
    redistribution in and one out per step, the single-device result (float32
    iteration: to ~1e-6 relative).
    Where each leaf lives is read from the arrays when they are concrete (or typed on
    Explicit mesh axes); under ``jax.jit`` on Auto mesh axes it comes from
    ``newton_schulz_plan`` (`NewtonSchulzPlan.from_params` on the params or their
    abstract shapes). Leaves of unknown sharding are split over ``mesh`` (or the
    ``jax.set_mesh`` context of the update) as FSDP lays them out, and XLA converts
    them there and back; without a mesh the partitioner decides for them. Leaves known
    to stay whole are orthogonalised together by shape (one batched iteration per shape).

    Args:
      beta: momentum in [0, 1), or a schedule of the update count (e.g.
        `muon_momentum_warmup`).
      coefficients: Newton-Schulz preset (``"modded"``, ``"keller"``,
        ``"polar_express"``) or a sequence of ``(a, b, c)`` triples, one per iteration;
        see `orthogonalize`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      nesterov: orthogonalise ``β m + (1-β) g`` instead of ``m``.
      bias_correction: bias-correct the momentum like optax.contrib.muon (the record does
        not).
      matrix_axes: ``(fan_in axis, fan_out axis)`` of every leaf; the other axes are batch
        axes. ``(-2, -1)`` fits Flax ``(in, out)`` kernels and ``(E, in, out)`` stacks;
        ``(1, 0)`` fits PyTorch ``(out, in)`` weights. A 4-D leaf (a convolution kernel)
        is treated as a stack of matrices, with a warning.
      shape_scale: ``"modded"`` (or ``True``), ``"consistent_rms"``, or ``None`` (or
        ``False``) for no scale.
      beta2: NorMuon's second-moment decay in [0, 1) or a schedule of the count
        (the paper's 0.95; modded-nanogpt's record 0.9); ``None``: plain Muon.
      smoothing: update-smoothing coefficient σ in [0, 1) or a schedule of the count;
        ``None`` turns smoothing off (record PR #137 used 0.2).
      smoothing_form: ``"ema"`` (use ``S``, PR #137) or ``"nesterov"`` (use
        ``σ S + (1-σ) O``, PR #129).
      mu_dtype: dtype of the momentum buffer; ``None``: float32, or the param's dtype
        where it is wider (float64 params keep float64 momentum, smoothing and NorMuon
        statistics).
      shard_newton_schulz: on sharded params, give each device whole matrices to
        orthogonalise (above); ``False`` leaves the iteration to the partitioner.
      newton_schulz_plan: where the leaves live when the update cannot see it (above);
        `NewtonSchulzPlan`.
      mesh: the mesh to split leaves of unknown sharding over (above); default: the
        plan's, else the ``jax.set_mesh`` context of the update, if any.
      precondition: a transform applied to the Newton-Schulz input before the
        iteration (above), called with ``raw_gradient=``, or a `MatrixPrecondition`
        run per matrix (on its owner under the sharded plan); ``None``: none.
      ns_normalization: how the iteration's input is scaled, ``"frobenius"`` or
        ``"gram_frobenius"`` (modded-nanogpt Track 3's SOAP-Muon); see `orthogonalize`.

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState`.

    Raises:
      ValueError: for bad coefficients, ``beta``, ``beta2`` or ``smoothing`` outside
        [0, 1), bad ``matrix_axes``, ``shape_scale``, ``smoothing_form``,
        ``ns_normalization`` or ``precondition``; at init/trace
        time for 0-D/1-D leaves (those belong to Adam) and axes that do not fit a leaf.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import scale_by_muon
      >>> params = {"w": jnp.ones((4, 8)), "experts": jnp.ones((2, 8, 4))}
      >>> tx = optax.chain(scale_by_muon(shape_scale="consistent_rms", beta2=0.95),
      ...                  optax.scale_by_learning_rate(0.02))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state)
      >>> updates["w"].shape
      (4, 8)

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024

      Liu et al., `Muon is Scalable for LLM Training
      <https://arxiv.org/abs/2502.16982>`_, 2025

      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025
    """
    triples = _resolve_coefficients(coefficients)
    check_float_dtype("ns_dtype", ns_dtype)
    check_unit_interval("beta", beta)
    check_unit_interval("beta2", beta2, allow_none=True)
    check_unit_interval("smoothing", smoothing, allow_none=True)
    axes = _check_matrix_axes(matrix_axes)
    scale_kind = _resolve_shape_scale(shape_scale)
    if smoothing_form not in SMOOTHING_FORMS:
        raise ValueError(
            f"smoothing_form must be one of {SMOOTHING_FORMS}, got {smoothing_form!r}.")
    if newton_schulz_plan is not None and not isinstance(newton_schulz_plan, NewtonSchulzPlan):
        raise ValueError(f"newton_schulz_plan must be a NewtonSchulzPlan (e.g. "
                         f"NewtonSchulzPlan.from_params(params)), got {newton_schulz_plan!r}.")
    _check_ns_normalization(ns_normalization)
    per_matrix = isinstance(precondition, MatrixPrecondition)
    if precondition is not None and not per_matrix:
        if not isinstance(precondition, optax.GradientTransformation):
            raise ValueError(f"precondition must be an optax.GradientTransformation (e.g. "
                             f"scale_by_soap_whitening()) or a MatrixPrecondition, got "
                             f"{precondition!r}.")
        precondition = optax.with_extra_args_support(precondition)
    plan = newton_schulz_plan or NewtonSchulzPlan()
    spread_mesh = mesh if mesh is not None else plan.mesh
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    ns_dt = jnp.dtype(ns_dtype)
    newton_schulz = functools.partial(_newton_schulz, triples=triples, ns_dtype=ns_dt, eps=1e-7,
                                      normalization=ns_normalization)

    def init_fn(params: optax.Params) -> MuonState:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            _warn_if_convolution(path_to_str(path), jnp.shape(p), axes)
        # statistics in float32, or wider with the param (a float64 run stays float64)
        zeros = lambda dtype: lambda p: jnp.zeros_like(p, dtype=state_dtype(dtype, p))
        stats_like = lambda: jax.tree.map(zeros(None), params)
        nu = optax.EmptyState() if beta2 is None else jax.tree.map(
            lambda p: jnp.zeros(_reduced_shape(jnp.shape(p), axes), state_dtype(None, p)),
            params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros(mu_dtype), params),
                         smooth=optax.EmptyState() if smoothing is None else stats_like(), nu=nu,
                         precondition=(optax.EmptyState() if precondition is None
                                       else init_owned(params) if per_matrix
                                       else precondition.init(params)))

    def flags_of(paths: list[str], treedef: Any) -> list[bool]:
        flags = precondition.flags
        return [False] * len(paths) if flags is None else list(flags(paths, treedef))

    def init_owned(params: optax.Params) -> OwnedPreconditionState:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths, leaves = [path_to_str(p) for p, _ in with_paths], [p for _, p in with_paths]
        placements = place_leaves(plan, paths, [[p] for p in leaves])
        per_leaf, owned = init_precondition(
            precondition, leaves, [_normalized_axes(jnp.shape(p), axes) for p in leaves],
            placements, mesh=spread_mesh, split=shard_newton_schulz,
            flags=flags_of(paths, treedef))
        return OwnedPreconditionState(treedef.unflatten(per_leaf), owned)

    def update_fn(updates: optax.Updates, state: MuonState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, MuonState]:
        count = state.count
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths, grads = [path_to_str(p) for p, _ in with_paths], [g for _, g in with_paths]
        mus = treedef.flatten_up_to(state.mu)
        leaf_axes = [_normalized_axes(jnp.shape(g), axes) for g in grads]

        beta_t = value_at(beta, count)
        moments = [_momentum(g, m, beta_t, count, nesterov=nesterov,
                             bias_correction=bias_correction)
                   for g, m in zip(grads, mus, strict=True)]
        inputs = [v for v, _ in moments]
        pre_state = state.precondition
        if precondition is not None and not per_matrix:
            whitened, pre_state = precondition.update(
                treedef.unflatten(inputs), pre_state, params, raw_gradient=updates)
            inputs = treedef.flatten_up_to(whitened)
        placements = place_leaves(plan, paths, list(zip(grads, mus, strict=True)))
        owned = {}
        if per_matrix:
            owned = dict(precondition=precondition, grads=grads, count=count,
                         leaf_states=treedef.flatten_up_to(pre_state.leaves),
                         owned=pre_state.owned, flags=flags_of(paths, treedef))
        ortho, leaf_states, owned_states = orthogonalize_leaves(
            inputs, leaf_axes, placements, newton_schulz=newton_schulz, ns_dtype=ns_dt,
            mesh=spread_mesh, split=shard_newton_schulz, **owned)
        if per_matrix:
            pre_state = OwnedPreconditionState(treedef.unflatten(leaf_states), owned_states)
        nu = state.nu
        if beta2 is not None:
            beta2_t = value_at(beta2, count)
            normed = [_normuon(o, v, beta2_t, a)
                      for o, v, a in zip(ortho, treedef.flatten_up_to(nu), leaf_axes, strict=True)]
            ortho, nu = [o for o, _ in normed], treedef.unflatten([v for _, v in normed])
        smooth = state.smooth
        if smoothing is not None:
            ortho, smooth = _smooth(ortho, treedef.flatten_up_to(smooth),
                                    value_at(smoothing, count), smoothing_form)
            smooth = treedef.unflatten(smooth)

        new_updates = [(_shape_factor(scale_kind, g.shape[a[0]], g.shape[a[1]]) * o).astype(g.dtype)
                       for o, g, a in zip(ortho, grads, leaf_axes, strict=True)]
        return treedef.unflatten(new_updates), MuonState(
            count=optax.safe_increment(count), mu=treedef.unflatten([m for _, m in moments]),
            smooth=smooth, nu=nu, precondition=pre_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _momentum(g: jax.Array, m: jax.Array, beta: Any, count: jax.Array, *, nesterov: bool,
              bias_correction: bool) -> tuple[jax.Array, jax.Array]:
    """(float32 input of the iteration, new momentum buffer in the buffer's dtype) of one
    leaf; float64 for float64 gradients or buffers."""
    mu_dtype = m.dtype
    compute = jnp.promote_types(jnp.promote_types(g.dtype, mu_dtype), jnp.float32)
    g32 = g.astype(compute)
    m = beta * m.astype(compute) + (1 - beta) * g32
    if bias_correction:
        bc_g = 1 - beta ** (count + 1)
        v = m / (1 - beta ** (count + 2) if nesterov else bc_g)
        if nesterov:
            v = beta * v + (1 - beta) * (g32 / bc_g)
    else:
        v = beta * m + (1 - beta) * g32 if nesterov else m
    return v, m.astype(mu_dtype)


def _reduced_axis(shape: tuple[int, ...], axes: tuple[int, int]) -> int:
    """NorMuon's reduced axis: the shorter matrix axis, ``fan_in`` for a square matrix
    (modded-nanogpt reduces the last axis of its (out, in) weights unless rows < cols)."""
    fan_in, fan_out = _normalized_axes(shape, axes)
    return fan_out if shape[fan_out] < shape[fan_in] else fan_in


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, int]) -> tuple[int, ...]:
    red = _reduced_axis(shape, axes)
    return tuple(1 if a == red else n for a, n in enumerate(shape))


def _normuon(o: jax.Array, nu: jax.Array, beta2: Any, axes: tuple[int, int]
             ) -> tuple[jax.Array, jax.Array]:
    """NorMuon's variance normalisation of one leaf's orthogonalised update (float32).

    Written as the record fuses it: ``‖O‖_F² = Σ n q`` and ``‖D‖_F² = Σ n q / ν`` from
    the per-neuron mean squares ``q``, so only one pass over ``O`` reads it whole.
    """
    red, dtype = _reduced_axis(o.shape, axes), nu.dtype  # the state keeps its dtype
    n = o.shape[red]
    q = jnp.mean(jnp.square(o), axis=red, keepdims=True)
    nu = beta2 * nu + (1 - beta2) * q
    inv_rms = jax.lax.rsqrt(jnp.maximum(nu, 1e-10))
    norm = jnp.sqrt(jnp.sum(n * q, axis=axes, keepdims=True))
    new_norm = jnp.sqrt(jnp.sum(n * q * jnp.square(inv_rms), axis=axes, keepdims=True))
    return o * (inv_rms * (norm / jnp.maximum(new_norm, 1e-10))), nu.astype(dtype)


def _smooth(ortho: Sequence[jax.Array], smooth: Sequence[jax.Array], sigma: Any, form: str
            ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Update smoothing: ``S = σ S + (1-σ) O``; the update is ``S`` ("ema") or
    ``σ S + (1-σ) O`` ("nesterov")."""
    smooth = [(sigma * s + (1 - sigma) * o).astype(s.dtype)
              for s, o in zip(smooth, ortho, strict=True)]
    if form == "ema":
        return smooth, smooth
    return [sigma * s + (1 - sigma) * o for s, o in zip(smooth, ortho, strict=True)], smooth


def _warn_if_convolution(name: str, shape: tuple[int, ...], axes: tuple[int, int]) -> None:
    """Check the leaf fits `axes`; warn (once per leaf: the warnings registry) on 4-D ones."""
    fan_in_axis, fan_out_axis = _normalized_axes(shape, axes)
    if len(shape) == 4:
        fan_in, fan_out = shape[fan_in_axis], shape[fan_out_axis]
        warnings.warn(
            f"Muon: leaf {name!r} of shape {shape} is 4-D (a convolution kernel?); it is "
            f"orthogonalised as a stack of {math.prod(shape) // (fan_in * fan_out)} separate "
            f"{fan_in}x{fan_out} matrices (matrix_axes={axes}). To orthogonalise it as one "
            "matrix, reshape it to (kh*kw*in, out); or label it for Adam.",
            UserWarning, stacklevel=4)


def scale_by_normuon(beta2: float | optax.Schedule = 0.95, **kwargs: Any
                     ) -> optax.GradientTransformation:
    r"""NorMuon's direction: `scale_by_muon` with its per-neuron variance normalisation.

    ``scale_by_muon(beta2=beta2, **kwargs)``: after orthogonalisation, each neuron's
    update (a row of the longer matrix axis) is divided by the square root of an EMA of
    its mean square and the matrix rescaled to keep its Frobenius norm (formula in
    `scale_by_muon`).

    Args:
      beta2: decay of the per-neuron second moment in [0, 1) or a schedule (the paper's
        0.95; modded-nanogpt's current record uses 0.9).
      **kwargs: any other argument of `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState` (``nu`` holds the
      second moment).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_normuon
      >>> tx = scale_by_normuon(0.95)
      >>> state = tx.init({"w": jnp.ones((4, 8))})
      >>> state.nu["w"].shape  # one value per column: the longer axis
      (1, 8)

    References:
      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025
    """
    return scale_by_muon(beta2=beta2, **kwargs)


def normuon(learning_rate: optax.ScalarOrSchedule, *,
            beta2: float | optax.Schedule = 0.95, **kwargs: Any
            ) -> optax.GradientTransformation:
    r"""NorMuon on matrices and matrix stacks, AdamW on every other leaf.

    ``muon(learning_rate, beta2=beta2, **kwargs)``: `muon` with NorMuon's per-neuron
    variance normalisation after orthogonalisation (see `scale_by_muon`). NorMuon's
    normalisation gives every neuron an update of similar size, which plain Muon's
    orthogonalisation does not; the paper reports 11-22% fewer steps than Muon at 1.1B
    to 5.4B parameters, and modded-nanogpt's records run it.

    Args:
      learning_rate: NorMuon learning rate (float >= 0 or schedule).
      beta2: per-neuron second-moment decay in [0, 1) or a schedule.
      **kwargs: any other argument of `muon`.

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import normuon
      >>> params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}
      >>> tx = normuon(0.02, labels={"w": "muon", "b": "adam"}, adam_learning_rate=3e-3)
      >>> updates, state = tx.update(params, tx.init(params), params)

    References:
      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025

      Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_ (NorMuonAndAdam), 2025
    """
    return muon(learning_rate, beta2=beta2, **kwargs)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float | optax.Schedule = 0.95,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_multiplier: optax.Params | Callable[[optax.Params], Any] | None = None,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    beta2: float | optax.Schedule | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    adam_nesterov: bool = False,
    adam_groups: Sequence[AdamGroup] | None = None,
    cautious_weight_decay: bool = False,
    labels: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon on matrices and matrix stacks, AdamW groups on every other leaf.

    The one Muon + Adam builder of the library (the recipes and the trainer build their
    stacks with it): an ``optax.partition`` of

    - ``"muon"``: ``chain(scale_by_muon(...), decoupled weight decay,
      scale_by_learning_rate(learning_rate))``, i.e.
      ``p ← p (1 - lr·wd·wd_mul) - lr·s(fan_in, fan_out)·O`` with the shape scale ``s``
      of `scale_by_muon` (``sqrt(max(1, fan_out/fan_in))`` by default);
    - one AdamW group per `AdamGroup` of ``adam_groups`` (`adam_group`: its own
      learning rate or schedule, betas, eps, decoupled weight decay and bias correction),
      each non-Muon leaf in the first group whose pattern its path matches; without
      ``adam_groups``, one group ``"adam"`` of every non-Muon leaf from the ``adam_*``
      arguments: the numbers and the state tree of ``optax.adamw(adam_learning_rate,
      adam_b1, adam_b2, adam_eps, weight_decay=adam_weight_decay,
      nesterov=adam_nesterov)`` for float32 params (for bf16 params ``wd·p`` is formed
      in float32, see `add_decoupled_weight_decay`).

    Every decay is `add_decoupled_weight_decay`; with ``cautious_weight_decay=True``
    all groups decay only where the update and the weight agree in sign (Chen et al., as
    in modded-nanogpt's GPT-2 Medium record).

    Labels default to ``optax_snoo.labels.muon_adam_labels`` (hidden matrices and stacks to
    Muon; embeddings, head, norms, biases, scalars to Adam).

    Args:
      learning_rate: Muon learning rate (float >= 0 or schedule); record: 0.027-0.03 with
        a linear cooldown over the last ~70% of training (`stable_cooldown_schedule`).
      beta: Muon momentum or schedule (records: `muon_momentum_warmup`,
        `muon_momentum_schedule`).
      weight_decay: decoupled weight decay of the Muon group, multiplied by the learning
        rate (record: 0.01).
      weight_decay_multiplier: per-leaf factor on ``weight_decay``: a tree of floats with
        the params' structure, or a callable ``params -> tree`` (inside the partition it
        receives the params with Adam leaves replaced by ``optax.MaskedNode``); ``None``
        means 1.0 everywhere (record: 2.0 on MLP weights).
      coefficients: Newton-Schulz preset or triples; see `orthogonalize`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      nesterov: Nesterov (EMA form) momentum for Muon.
      bias_correction: bias-correct the Muon momentum like optax.contrib.muon.
      smoothing: update smoothing σ (float, schedule) or ``None``; see `scale_by_muon`.
      smoothing_form: ``"ema"`` or ``"nesterov"``.
      matrix_axes: the (fan_in, fan_out) axes of every Muon leaf.
      shape_scale: ``"modded"`` (or ``True``), ``"consistent_rms"`` (Moonlight's
        ``0.2 sqrt(max(fan_in, fan_out))``: with it AdamW's learning rate and weight decay
        suit the Muon group too), or ``None``/``False``; see `scale_by_muon`.
      beta2: NorMuon's per-neuron second-moment decay, or ``None`` for plain Muon;
        see `scale_by_muon` and `normuon`.
      shard_newton_schulz: on sharded params each device orthogonalises whole matrices;
        see `scale_by_muon`.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``
        (`NewtonSchulzPlan.from_params(params)`); see `scale_by_muon`.
      mesh: the mesh for leaves of unknown sharding (default: the ``jax.set_mesh``
        context); see `scale_by_muon`.
      adam_learning_rate: learning rate of the single AdamW group (default:
        ``learning_rate``); not with ``adam_groups``.
      adam_b1: first-moment decay of the single AdamW group.
      adam_b2: second-moment decay of the single AdamW group.
      adam_eps: epsilon of the single AdamW group.
      adam_weight_decay: decoupled weight decay of the single AdamW group.
      adam_nesterov: Nesterov momentum in the single AdamW group
        (``optax.adamw(nesterov=)``); ``optax.contrib.muon(nesterov=True)`` does this,
        the record does not.
      adam_groups: ordered `AdamGroup` entries for the non-Muon leaves (first match wins; a
        leaf no group matches is an error at init); replaces the ``adam_*`` arguments,
        which must then keep their defaults.
      cautious_weight_decay: in every group, decay only the entries where the update
        (before the learning rate) and the weight agree in sign,
        ``u + wd·mul·p·[u·p >= 0]``; see `add_decoupled_weight_decay`.
      labels: a tree of ``"muon"``/``"adam"`` strings with the params' structure, or a
        callable ``params -> tree``; overrides the default labelling (``"adam"`` leaves
        then go to the Adam groups by path).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (a checked ``optax.partition``, see
      `optax_snoo.labels.partition`), its state's ``inner_states`` keyed by the group
      labels.

    Raises:
      ValueError: for a negative learning rate or weight decay, bad groups (duplicate
        names, ``adam_*`` arguments beside ``adam_groups``), and everything
        `scale_by_muon` rejects; at init time for a 0-D/1-D leaf labelled ``"muon"`` and
        for a non-Muon leaf no Adam group matches.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import AdamGroup, muon, muon_momentum_warmup
      >>> params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,)), "wte": jnp.ones((4, 8))}
      >>> labels = {"w": "muon", "b": "adam", "wte": "adam"}
      >>> tx = muon(0.03, beta=muon_momentum_warmup(), weight_decay=0.01,
      ...           adam_learning_rate=3e-3, labels=labels)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> tx = muon(0.03, labels=labels, adam_groups=[
      ...     AdamGroup("wte", 0.3, b1=0.8, b2=0.95, name="embed"),
      ...     AdamGroup(".*", 0.01, b1=0.8, b2=0.99, bias_correction=False, name="vectors")])
      >>> sorted(tx.init(params).inner_states)
      ['embed', 'muon', 'vectors']

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    check_non_negative("learning_rate", learning_rate)
    check_non_negative("weight_decay", weight_decay)
    if adam_groups is None:
        check_non_negative("adam_learning_rate", adam_learning_rate)
        adam_groups = (AdamGroup(
            ".*", learning_rate if adam_learning_rate is None else adam_learning_rate,
            adam_b1, adam_b2, adam_eps, adam_weight_decay, nesterov=adam_nesterov,
            name="adam"),)
    else:
        single = dict(adam_learning_rate=adam_learning_rate, adam_b1=adam_b1, adam_b2=adam_b2,
                      adam_eps=adam_eps, adam_weight_decay=adam_weight_decay,
                      adam_nesterov=adam_nesterov)
        changed = {k: v for k, v in single.items() if v != _SINGLE_ADAM_DEFAULTS[k]}
        if changed:
            raise ValueError(f"muon: {changed} given beside adam_groups; set the Adam "
                             "hyperparameters on each AdamGroup instead.")
    muon_tx = optax.chain(
        scale_by_muon(
            beta, coefficients=coefficients, ns_dtype=ns_dtype, nesterov=nesterov,
            bias_correction=bias_correction, matrix_axes=matrix_axes, smoothing=smoothing,
            smoothing_form=smoothing_form, shape_scale=shape_scale, beta2=beta2,
            shard_newton_schulz=shard_newton_schulz, newton_schulz_plan=newton_schulz_plan,
            mesh=mesh),
        add_decoupled_weight_decay(weight_decay, weight_decay_multiplier,
                                   cautious=cautious_weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    return with_adam_groups(muon_tx, adam_groups, labels=labels,
                            cautious_weight_decay=cautious_weight_decay)


def with_adam_groups(
    muon_tx: optax.GradientTransformation,
    adam_groups: Sequence[AdamGroup],
    *,
    labels: Any | Callable[[optax.Params], Any] | None = None,
    cautious_weight_decay: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """`muon`'s partition with a given Muon-group chain: ``muon_tx`` on the ``"muon"``
    leaves, each non-Muon leaf in the first `AdamGroup` whose pattern its path matches.

    `muon` builds its Muon group as ``chain(scale_by_muon, decay, scale_by_learning_rate)``;
    stacks whose hidden-matrix step is something else (SOAP whitening, `radius_steps` in
    place of the learning rate: modded-nanogpt Track 3's records) pass their own chain.

    Args:
      muon_tx: the Muon group's transformation (its updates are final).
      adam_groups: ordered `AdamGroup` entries (first match wins).
      labels: ``"muon"``/``"adam"`` labels (tree or callable); ``None``:
        `optax_snoo.labels.muon_adam_labels`.
      cautious_weight_decay: the Adam groups' decay only where update and weight agree
        in sign.

    Returns:
      A checked ``optax.partition`` (its state's ``inner_states`` keyed by ``"muon"`` and
      the groups' names).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import AdamGroup
      >>> from optax_snoo._src.muon import scale_by_muon, with_adam_groups
      >>> tx = with_adam_groups(optax.chain(scale_by_muon(), optax.scale(-0.02)),
      ...                       [AdamGroup(".*", 3e-3, name="rest")])
      >>> sorted(tx.init({"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}).inner_states)
      ['muon', 'rest']
    """
    names = _adam_group_names(adam_groups)
    transforms = {"muon": muon_tx} | {
        name: adam_group(group, cautious_weight_decay=cautious_weight_decay)
        for name, group in zip(names, adam_groups, strict=True)}
    base = muon_adam_labels if labels is None else labels
    return partition(transforms, _labels_with_adam_groups(base, adam_groups, names))


_SINGLE_ADAM_DEFAULTS = dict(adam_learning_rate=None, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8,
                             adam_weight_decay=0.0, adam_nesterov=False)


def _adam_group_names(groups: Sequence[AdamGroup]) -> list[str]:
    """Each group's label: its ``name``, else ``"adam"`` alone or ``"adam_<i>"``."""
    groups = tuple(groups)
    if not groups:
        raise ValueError("adam_groups: expected at least one AdamGroup, got none.")
    for group in groups:
        if not isinstance(group, AdamGroup):
            raise ValueError(f"adam_groups: expected AdamGroup(pattern, learning_rate, ...) "
                             f"entries, got {group!r}.")
    default = (lambda i: "adam") if len(groups) == 1 else (lambda i: f"adam_{i}")
    names = [default(i) if g.name is None else g.name for i, g in enumerate(groups)]
    if len(set(names)) != len(names) or "muon" in names:
        raise ValueError(f"adam_groups: group names must be distinct and not 'muon', got "
                         f"{names}.")
    return names


def _labels_with_adam_groups(labels: Any, groups: Sequence[AdamGroup], names: Sequence[str]
                             ) -> Callable[[optax.Params], Any]:
    """``labels`` (a tree or a function of the params) with each ``"adam"`` leaf relabelled
    by the first group whose pattern its path matches."""
    compiled = [re.compile(g.pattern) for g in groups]

    def group_labels(params: optax.Params) -> Any:
        def refine(path: Any, label: Any) -> Any:
            if label != "adam":
                return label
            name = path_to_str(path)
            for regex, group_name in zip(compiled, names, strict=True):
                if regex.search(name):
                    return group_name
            raise ValueError(f"parameter {name!r} matches no Adam group "
                             f"{[regex.pattern for regex in compiled]}")

        return jax.tree.map_with_path(refine, labels(params) if callable(labels) else labels)

    return group_labels
