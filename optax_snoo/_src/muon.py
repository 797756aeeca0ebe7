"""Muon: momentum orthogonalised by Newton-Schulz, as in modded-nanogpt's GPT-2 Medium track.

`orthogonalize` is the Newton-Schulz iteration (SPEC §2.1), `scale_by_muon` the direction
(momentum, orthogonalisation, shape scale, optional update smoothing; SPEC §2.2 and §2.4),
`muon` the whole-tree optimizer (Muon on matrices and matrix stacks, AdamW on the rest;
SPEC §2.3) and `muon_momentum_warmup` the record's momentum warm-up.

Differences from `optax.contrib.muon` (optax 0.2.8), all deliberate:

- the momentum is not bias-corrected by default (modded-nanogpt); `bias_correction=True`
  reproduces optax's corrected momentum and Nesterov step exactly;
- the iteration runs in `ns_dtype` (bfloat16 by default, as in the record), not in the
  gradient dtype, and the momentum is kept in float32 whatever the param dtype;
- leaves with more than two axes are stacks of matrices (`matrix_axes` names the two
  matrix axes), so MoE expert weights `(E, in, out)` get Muon instead of silently going
  to Adam;
- weight decay takes a per-leaf multiplier (the record's `wd_mul`).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
COEFFICIENT_PRESETS: dict[str, Triples] = {
    "keller": KELLER_COEFFICIENTS,
    "modded": MODDED_COEFFICIENTS,
}
SMOOTHING_FORMS = ("ema", "nesterov")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


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


def _check_float_dtype(name: str, dtype: Any) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.bfloat16), got {dtype!r}.")


def _check_unit_interval(name: str, value: Any) -> None:
    """A float must lie in [0, 1); arrays (traced hyperparameters) and schedules pass."""
    if _is_number(value) and not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}.")


def _check_non_negative(name: str, value: Any) -> None:
    if _is_number(value) and value < 0:
        raise ValueError(f"{name} must be >= 0 (a float or a schedule), got {value!r}.")


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
) -> jax.Array:
    r"""Approximately orthogonalise a matrix (or each matrix of a stack) by Newton-Schulz.

    The iteration of modded-nanogpt (SPEC §2.1): cast to ``ns_dtype``, transpose when
    rows > cols, divide by ``‖X‖_F + eps``, then for each triple ``(a, b, c)``:
    ``A = X Xᵀ; B = b A + c A A; X = a X + B X``, and transpose back. It maps each singular
    value ``σ/‖X‖_F`` through the composed odd polynomial, so ``X = U S Vᵀ`` comes out as
    ``U S' Vᵀ`` with ``S'`` in a band around 1, not exactly 1: on Gaussian matrices of
    aspect ratio 2, about [0.68, 1.13] for ``"keller"`` and [0.98, 1.03] for ``"modded"``
    (very small input singular values, as in near-square matrices, come out lower).

    The last two axes are the matrix; leading axes are a batch (each matrix is normalised
    and orthogonalised on its own, by batched matmuls). Matmuls run in ``ns_dtype``; the
    elementwise steps run in float32, as PyTorch's bfloat16 arithmetic does, so the
    coefficients are not rounded to bfloat16 (elementwise steps in bfloat16, with the
    coefficients rounded as JAX's weak typing would, left singular values up to ~0.035
    outside the band the coefficients produce, instead of ~0.009).

    The iterations run under ``lax.scan``: on XLA:CPU it ran as fast as an unrolled loop
    (within noise), compiled in half the time, and it keeps only one iteration's
    temporaries live (optax moved its own loop off unrolling for peak memory).

    Args:
      x: an array of shape ``(..., rows, cols)``, any float dtype.
      coefficients: ``"modded"`` (the five per-iteration triples of modded-nanogpt's
        GPT-2 Medium track, optax's ``"dion"``), ``"keller"`` ((3.4445, -4.7750, 2.0315)
        five times, optax.contrib.muon's default), or a sequence of ``(a, b, c)`` triples,
        one per iteration.
      ns_dtype: dtype of the iteration (bfloat16 as in the record; float32 for accuracy).
      eps: added to the Frobenius norm before dividing.

    Returns:
      An array of ``x.shape`` in float32 (float64 when ``ns_dtype`` is float64),
      whatever the input dtype, so callers can accumulate it before casting.

    Raises:
      ValueError: for an unknown preset, malformed coefficients, or ``x.ndim < 2``.

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
    """
    triples = _resolve_coefficients(coefficients)
    _check_float_dtype("ns_dtype", ns_dtype)
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs an array with >= 2 axes, got shape {x.shape}.")
    return _newton_schulz(x, triples, jnp.dtype(ns_dtype), eps)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _newton_schulz(x: jax.Array, triples: Triples, ns_dtype: jnp.dtype,
                   eps: jax.typing.ArrayLike) -> jax.Array:
    """SPEC §2.1 on the last two axes. Jitted so that eager callers compile it once per
    shape instead of op by op; inside an outer jit it is simply inlined."""
    out_dtype = jnp.promote_types(ns_dtype, jnp.float32)
    transposed = x.shape[-2] > x.shape[-1]
    X = jnp.swapaxes(x, -1, -2) if transposed else x
    X = X.astype(ns_dtype).astype(out_dtype)
    norm = jnp.sqrt(jnp.sum(jnp.square(X), axis=(-2, -1), keepdims=True))
    X = (X / (norm + eps)).astype(ns_dtype)

    def iteration(X: jax.Array, abc: jax.Array) -> tuple[jax.Array, None]:
        a, b, c = abc[0], abc[1], abc[2]
        A = X @ jnp.swapaxes(X, -1, -2)
        B = (b * A.astype(out_dtype) + c * (A @ A).astype(out_dtype)).astype(ns_dtype)
        return (a * X.astype(out_dtype) + (B @ X).astype(out_dtype)).astype(ns_dtype), None

    X, _ = jax.lax.scan(iteration, X, jnp.asarray(triples, out_dtype))
    X = X.astype(out_dtype)
    return jnp.swapaxes(X, -1, -2) if transposed else X


class MuonState(NamedTuple):
    """State of `scale_by_muon`.

    Attributes:
      count: number of updates so far (int32 scalar); schedules are evaluated at it.
      mu: momentum buffer, shaped like the params, in ``mu_dtype`` (float32 by default).
      smooth: update-smoothing buffer (float32, shaped like the params), or
        ``optax.EmptyState()`` when smoothing is off.
    """

    count: jax.Array
    mu: optax.Updates
    smooth: optax.Updates | optax.EmptyState


def muon_momentum_warmup(start: float = 0.85, end: float = 0.95,
                         steps: int = 300) -> optax.Schedule:
    """The record's momentum warm-up: ``β(t) = start + (end - start) * min(t / steps, 1)``.

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
    _check_unit_interval("start", start)
    _check_unit_interval("end", end)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ValueError(f"steps must be a positive int, got {steps!r}.")

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        frac = jnp.minimum(jnp.asarray(count, jnp.float32) / steps, 1.0)
        return start + (end - start) * frac

    return schedule


def scale_by_muon(
    beta: float | optax.Schedule = 0.95,
    *,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool = True,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    mu_dtype: jax.typing.DTypeLike | None = jnp.float32,
) -> optax.GradientTransformation:
    r"""The Muon direction: orthogonalised momentum, scaled by the matrix shape.

    For each leaf (a matrix, or a stack of matrices whose two matrix axes are
    ``matrix_axes``), with gradient ``g`` and ``t`` the update count (SPEC §2.2, §2.4)::

        m = β m + (1-β) g                                 # float32 buffer
        v = β m + (1-β) g   if nesterov else   m          # EMA form of Nesterov
        O = orthogonalize(v)                              # each matrix on its own
        S = σ S + (1-σ) O;  O = S (ema) or σ S + (1-σ) O (nesterov)   # if smoothing
        update = sqrt(max(1, fan_out / fan_in)) * O       # if shape_scale

    With ``bias_correction=True`` the momentum is bias-corrected exactly as
    ``optax.contrib.scale_by_muon`` does: ``v = β m/(1-β^(t+2)) + (1-β) g/(1-β^(t+1))``
    with Nesterov, ``v = m/(1-β^(t+1))`` without. The update is returned in the gradient
    dtype; no learning rate and no sign are applied (chain with
    ``optax.scale_by_learning_rate``, or use `muon`).

    Args:
      beta: momentum in [0, 1), or a schedule of the update count (e.g.
        `muon_momentum_warmup`).
      coefficients: Newton-Schulz preset (``"modded"``, ``"keller"``) or a sequence of
        ``(a, b, c)`` triples, one per iteration; see `orthogonalize`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      nesterov: orthogonalise ``β m + (1-β) g`` instead of ``m``.
      bias_correction: bias-correct the momentum like optax.contrib.muon (the record does
        not).
      matrix_axes: ``(fan_in axis, fan_out axis)`` of every leaf; the other axes are batch
        axes. ``(-2, -1)`` fits Flax ``(in, out)`` kernels and ``(E, in, out)`` stacks;
        ``(1, 0)`` fits PyTorch ``(out, in)`` weights.
      shape_scale: multiply by ``sqrt(max(1, fan_out / fan_in))``.
      smoothing: update-smoothing coefficient σ in [0, 1) or a schedule of the count;
        ``None`` turns smoothing off (record PR #137 used 0.2).
      smoothing_form: ``"ema"`` (use ``S``, PR #137) or ``"nesterov"`` (use
        ``σ S + (1-σ) O``, PR #129).
      mu_dtype: dtype of the momentum buffer (``None``: the gradient dtype).

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState`.

    Raises:
      ValueError: for bad coefficients, ``beta`` or ``smoothing`` outside [0, 1), bad
        ``matrix_axes`` or ``smoothing_form``; at init/trace time for 0-D/1-D leaves
        (those belong to Adam) and axes that do not fit a leaf.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import scale_by_muon
      >>> params = {"w": jnp.ones((4, 8)), "experts": jnp.ones((2, 8, 4))}
      >>> tx = optax.chain(scale_by_muon(), optax.scale_by_learning_rate(0.02))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state)

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    _resolve_coefficients(coefficients)
    _check_float_dtype("ns_dtype", ns_dtype)
    _check_unit_interval("beta", beta)
    axes = _check_matrix_axes(matrix_axes)
    if smoothing is not None:
        _check_unit_interval("smoothing", smoothing)
    if smoothing_form not in SMOOTHING_FORMS:
        raise ValueError(
            f"smoothing_form must be one of {SMOOTHING_FORMS}, got {smoothing_form!r}.")
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def fans(shape: tuple[int, ...]) -> tuple[int, int]:
        fan_in_axis, fan_out_axis = _normalized_axes(shape, axes)
        return shape[fan_in_axis], shape[fan_out_axis]

    def init_fn(params: optax.Params) -> MuonState:
        for p in jax.tree.leaves(params):
            fans(jnp.shape(p))
        mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
        smooth = (optax.EmptyState() if smoothing is None
                  else jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params))
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu, smooth=smooth)

    def direction(g: jax.Array, m: jax.Array, beta_t: jax.Array,
                  count: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(orthogonalised float32 direction, new momentum) of one leaf."""
        g32 = g.astype(jnp.float32)
        m = beta_t * m.astype(jnp.float32) + (1 - beta_t) * g32
        if bias_correction:
            bc_g = 1 - beta_t ** (count + 1)
            v = m / (1 - beta_t ** (count + 2) if nesterov else bc_g)
            if nesterov:
                v = beta_t * v + (1 - beta_t) * (g32 / bc_g)
        else:
            v = beta_t * m + (1 - beta_t) * g32 if nesterov else m
        fan_in_axis, fan_out_axis = _normalized_axes(g.shape, axes)
        v = jnp.moveaxis(v, (fan_in_axis, fan_out_axis), (-2, -1))
        o = orthogonalize(v, coefficients, ns_dtype)
        o = jnp.moveaxis(o, (-2, -1), (fan_in_axis, fan_out_axis))
        return o, m.astype(g.dtype if mu_dtype is None else mu_dtype)

    def update_fn(updates: optax.Updates, state: MuonState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, MuonState]:
        del params
        count = state.count
        beta_t = beta(count) if callable(beta) else beta
        grads, treedef = jax.tree.flatten(updates)
        ortho, mu = [], []
        for g, m in zip(grads, treedef.flatten_up_to(state.mu), strict=True):
            o, m = direction(g, m, beta_t, count)
            ortho.append(o)
            mu.append(m)

        smooth = state.smooth
        if smoothing is not None:
            sigma = smoothing(count) if callable(smoothing) else smoothing
            smooth = [sigma * s + (1 - sigma) * o
                      for s, o in zip(treedef.flatten_up_to(smooth), ortho, strict=True)]
            if smoothing_form == "ema":
                ortho = smooth
            else:
                ortho = [sigma * s + (1 - sigma) * o for s, o in zip(smooth, ortho, strict=True)]
            smooth = treedef.unflatten(smooth)

        def finish(o: jax.Array, g: jax.Array) -> jax.Array:
            if shape_scale:
                fan_in, fan_out = fans(g.shape)
                o = math.sqrt(max(1.0, fan_out / fan_in)) * o
            return o.astype(g.dtype)

        new_updates = treedef.unflatten([finish(o, g) for o, g in zip(ortho, grads, strict=True)])
        new_state = MuonState(count=optax.safe_increment(count), mu=treedef.unflatten(mu),
                              smooth=smooth)
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def add_decoupled_weight_decay(
    weight_decay: jax.typing.ArrayLike,
    multiplier: optax.Params | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformation:
    r"""Add ``weight_decay * multiplier * p`` to each update, with a per-leaf multiplier.

    Put it before ``optax.scale_by_learning_rate(lr)`` so that the decay is multiplied by
    the (scheduled) learning rate, as in modded-nanogpt's Muon:
    ``p ← p (1 - lr·wd·wd_mul) - lr·u`` (SPEC §2.2). Unlike ``optax.add_decayed_weights``
    it takes a per-leaf factor (the record's ``wd_mul``: 2.0 on MLP weights) and skips
    ``optax.MaskedNode`` leaves, so it works inside ``optax.partition``/``optax.masked``.
    The sum is formed in float32 and cast back to the update dtype.

    Args:
      weight_decay: decay rate (float >= 0, or a traced array under
        ``optax.inject_hyperparams``); a Python 0 makes the transform a no-op that needs
        no params.
      multiplier: per-leaf factors: a tree of floats with the params' structure, or a
        callable ``params -> tree`` (it sees the params it is given, e.g. with
        ``optax.MaskedNode`` on leaves masked out); ``None`` means 1.0 everywhere.

    Returns:
      A stateless ``optax.GradientTransformation``; ``update`` needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import add_decoupled_weight_decay
      >>> params = {"mlp": jnp.ones((2, 2)), "attn": jnp.ones((2, 2))}
      >>> tx = add_decoupled_weight_decay(0.01, {"mlp": 2.0, "attn": 1.0})
      >>> updates, _ = tx.update(optax.tree.zeros_like(params), tx.init(params), params)
      >>> round(float(updates["mlp"][0, 0]), 6), round(float(updates["attn"][0, 0]), 6)
      (0.02, 0.01)

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019

      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024
    """
    _check_non_negative("weight_decay", weight_decay)

    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        if _is_number(weight_decay) and weight_decay == 0:
            return updates, state
        if params is None:
            raise ValueError(
                f"Muon weight decay ({weight_decay!r}) needs the current params: pass "
                "`params` to `update`.")
        mul = multiplier(params) if callable(multiplier) else multiplier
        if mul is None:
            mul = jax.tree.map(lambda _: 1.0, params)
        is_masked = lambda x: isinstance(x, optax.MaskedNode)

        def decay(u: jax.Array, p: jax.Array, w: jax.typing.ArrayLike) -> jax.Array:
            if is_masked(u):
                return u
            wd = weight_decay * jnp.asarray(w, jnp.float32)
            return (u.astype(jnp.float32) + wd * p.astype(jnp.float32)).astype(u.dtype)

        return jax.tree.map(decay, updates, params, mul, is_leaf=is_masked), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


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
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    labels: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformation:
    r"""Muon on matrices and matrix stacks, AdamW on every other leaf.

    An ``optax.partition`` of two groups, like ``optax.contrib.muon``:

    - ``"muon"``: ``chain(scale_by_muon(...), decoupled weight decay,
      scale_by_learning_rate(learning_rate))``, i.e. (SPEC §2.2)
      ``p ← p (1 - lr·wd·wd_mul) - lr·sqrt(max(1, fan_out/fan_in))·O``;
    - ``"adam"``: ``optax.adamw(adam_learning_rate, adam_b1, adam_b2, adam_eps,
      weight_decay=adam_weight_decay)``.

    Labels default to ``optax_snoo.labels.muon_adam_labels`` (hidden matrices and stacks to
    Muon; embeddings, head, norms, biases, scalars to Adam).

    Args:
      learning_rate: Muon learning rate (float >= 0 or schedule); record: 0.027-0.03 with
        the SPEC §2.5 cooldown.
      beta: Muon momentum or schedule (record: `muon_momentum_warmup`).
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
      adam_learning_rate: AdamW learning rate (default: ``learning_rate``).
      adam_b1: AdamW first-moment decay.
      adam_b2: AdamW second-moment decay.
      adam_eps: AdamW epsilon.
      adam_weight_decay: AdamW decoupled weight decay.
      labels: a tree of ``"muon"``/``"adam"`` strings with the params' structure, or a
        callable ``params -> tree``; overrides the default labelling.

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition``).

    Raises:
      ValueError: for a negative learning rate or weight decay, and everything
        `scale_by_muon` rejects; at init time for a 0-D/1-D leaf labelled ``"muon"``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import muon, muon_momentum_warmup
      >>> params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}
      >>> labels = {"w": "muon", "b": "adam"}
      >>> tx = muon(0.03, beta=muon_momentum_warmup(), weight_decay=0.01,
      ...           adam_learning_rate=3e-3, labels=labels)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    _check_non_negative("learning_rate", learning_rate)
    _check_non_negative("adam_learning_rate", adam_learning_rate)
    _check_non_negative("weight_decay", weight_decay)
    if labels is None:
        from optax_snoo._src.labels import muon_adam_labels

        labels = muon_adam_labels
    muon_tx = optax.chain(
        scale_by_muon(
            beta, coefficients=coefficients, ns_dtype=ns_dtype, nesterov=nesterov,
            bias_correction=bias_correction, matrix_axes=matrix_axes, smoothing=smoothing,
            smoothing_form=smoothing_form),
        add_decoupled_weight_decay(weight_decay, weight_decay_multiplier),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam_tx = optax.adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate,
        b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=adam_weight_decay)
    return optax.partition({"muon": muon_tx, "adam": adam_tx}, labels)
