"""Weight averaging around an optimizer: EMA-Nesterov and the late-training readouts.

`ema_nesterov` (modded-nanogpt Track 3 records #39, #40) adds an EMA of the weights'
displacement, scaled by a lookahead coefficient, to the weights the gradient is taken
at. `tail_ema` (records #45, #46) keeps an EMA of the weights over the end of training,
blended into the weights only for evaluation; `reference_interpolation` (records #38,
#42) evaluates the weights moved toward (or away from) a copy taken at a fixed step;
`tail_velocity` (record #38) evaluates them moved along an EMA of their late updates.
All keep in their state what the weights to *evaluate* are;
`eval_params(params, opt_state)` finds every such state anywhere in an optimizer state
and returns those weights.

References:
  Jordan et al., `modded-nanogpt Track 3 (optimization) records #38, #39, #40, #42, #45,
  #46 <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.utils import (
    check_float_dtype,
    check_int_at_least,
    check_non_negative,
    check_unit_interval,
    concrete_real,
    path_names,
    state_dtype,
    value_at,
)

__all__ = ["EmaNesterovState", "ReferenceInterpolationState", "TailEmaState",
           "TailVelocityState", "ema_nesterov", "eval_params", "reference_interpolation",
           "tail_ema", "tail_velocity"]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


class EmaNesterovState(NamedTuple):
    """State of `ema_nesterov`.

    Attributes:
      count: number of updates so far (int32).
      lookahead: the coefficient ``β`` of the displacement EMA in the current params
        (float32 scalar, float64 for float64 params): the params are ``W + β·b``, the
        weights to evaluate ``W``.
      displacement: the EMA ``b`` of the evaluated weights' displacement per update.
      inner_state: the wrapped transformation's state.
    """

    count: jax.Array
    lookahead: jax.Array
    displacement: Any
    inner_state: Any


class TailEmaState(NamedTuple):
    """State of `tail_ema`.

    Attributes:
      count: number of updates so far (int32).
      blend: the weight ``λ`` of the EMA in the weights to evaluate (float32 scalar,
        float64 for float64 params; 0 until the EMA starts).
      ema: EMA of the params, float32 (float64 for float64 params; ``optax.MaskedNode`` on
        leaves not averaged).
    """

    count: jax.Array
    blend: jax.Array
    ema: Any


class ReferenceInterpolationState(NamedTuple):
    """State of `reference_interpolation`.

    Attributes:
      count: number of updates so far (int32).
      gamma: the coefficient ``γ`` of the weights' distance from the reference in the
        weights to evaluate (float32 scalar, float64 for float64 params; 0 until the
        readout starts).
      reference: the weights after update ``capture`` (zeros before), float32 (float64
        for float64 params; ``optax.MaskedNode`` on leaves not interpolated).
    """

    count: jax.Array
    gamma: jax.Array
    reference: Any


class TailVelocityState(NamedTuple):
    """State of `tail_velocity`.

    Attributes:
      count: number of updates so far (int32).
      gamma: the step ``γ`` along the velocity in the weights to evaluate (float32
        scalar, float64 for float64 params; 0 until the readout starts).
      max_ratio: the largest ``‖step‖/‖w‖`` of the evaluated step, per leaf (same dtype).
      velocity: the EMA of the weights' displacement per update since ``start``, float32
        (float64 for float64 params; ``optax.MaskedNode`` on leaves not moved).
    """

    count: jax.Array
    gamma: jax.Array
    max_ratio: jax.Array
    velocity: Any


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _leaf_mask(mask: Any, params: Any) -> Any:
    """``optax.masked``'s mask (a tree or prefix of bools, a callable, None: all) as one
    bool per params leaf."""
    m = mask(params) if callable(mask) else mask
    if m is None:
        return jax.tree.map(lambda _: True, params, is_leaf=_skipped)
    return jax.tree.map(lambda b, sub: jax.tree.map(lambda _: b, sub, is_leaf=_skipped),
                        m, params, is_leaf=lambda x: isinstance(x, bool))


def _copy_buffers(params: Any, mask: Any) -> Any:
    """A zero float32 (float64 for float64 params) buffer per masked-in leaf, an
    ``optax.MaskedNode`` for the others."""
    return jax.tree.map(
        lambda p, keep: p if _skipped(p) else (
            jnp.zeros_like(p, dtype=state_dtype(None, p)) if keep else optax.MaskedNode()),
        params, _leaf_mask(mask, params), is_leaf=_skipped)


def _compute_dtype(*arrays: Any) -> Any:
    """float32, or float64 when an operand is: a float64 run's arithmetic stays float64."""
    return functools.reduce(jnp.promote_types, [jnp.result_type(x) for x in arrays],
                            jnp.dtype(jnp.float32))


def _scalar_dtype(params: Any) -> Any:
    """The dtype of a state's scalar coefficient: float32, float64 for float64 params."""
    return _compute_dtype(*[p for p in jax.tree.leaves(params, is_leaf=_skipped)
                            if not _skipped(p)])


def _check_inner(name: str, inner: Any) -> None:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise ValueError(f"{name}: inner must be an optax.GradientTransformation (with init and "
                         f"update), got {type(inner).__name__}: {inner!r}")


def ema_nesterov(
    inner: optax.GradientTransformation,
    beta0: float = 0.3,
    gamma: float = 0.99,
    prefill: int = 300,
    stop: int = 1950,
    lr_ratio: ScalarOrSchedule = 1.0,
    *,
    buffer_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Wrap `inner` in EMA-Nesterov: take each gradient at a lookahead point.

    With ``W_t`` the weights after ``t`` updates, ``b`` an EMA of their displacement and
    ``β_t = β0·lr_ratio(t)`` while ``prefill <= t < stop`` (else 0), modded-nanogpt's
    ``EMA_Nesterov`` takes the gradient at the lookahead point ``Y_t = W_t + β_t·b_t``,
    lets the inner optimizer step from there (``W_{t+1} = Y_t + Δ_t``, the lookahead is
    not undone) and updates ``b_{t+1} = γ b_t + (1-γ)(W_{t+1} - W_t)``. Here the params
    are the lookahead point ``Y``, so the gradient given to ``update`` is the one the
    record uses, and the update is ``Δ_t + β_{t+1} b_{t+1}``. The weights to evaluate are
    ``W = Y - β·b`` (`eval_params`); they equal the params once ``β = 0``.

    Extra keyword arguments of ``update`` are forwarded to ``inner``.

    Args:
      inner: the inner optimizer (its update is computed at the lookahead point).
      beta0: lookahead step ``β0`` >= 0 (#40, #46: 0.3; #39: 0.6).
      gamma: EMA factor ``γ`` of the displacement in [0, 1) (0.99).
      prefill: first update count with a lookahead (300).
      stop: first update count without it again (#46: 2900 - 950 = 1950).
      lr_ratio: a float or a schedule of the update count ``t`` giving ``lr_t/lr_0``.
        The record reads the learning rate its schedule set on the *previous* step
        (``lr(t-1)/lr0``, and ``1`` at ``t = 0``): pass
        ``lambda t: sched(jnp.maximum(t - 1, 0)) / sched(0)`` to reproduce it.
      buffer_dtype: dtype of ``b`` (``None``: float32, or the param's dtype where wider,
        float64 for float64 params; the record keeps it in the param dtype).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state `EmaNesterovState`.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.ones(3)}
      >>> tx = optax_snoo.ema_nesterov(optax.sgd(0.1), beta0=0.5, prefill=1, stop=10)
      >>> state = tx.init(params)
      >>> for _ in range(3):
      ...     updates, state = tx.update({"w": jnp.ones(3)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> w = optax_snoo.eval_params(params, state)["w"]  # the weights to evaluate
      >>> bool(jnp.all(params["w"] < w))  # the lookahead point is ahead (downhill)
      True

    References:
      Jordan et al., `modded-nanogpt Track 3 records #39 and #40 (class EMA_Nesterov)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    _check_inner("ema_nesterov", inner)
    check_non_negative("ema_nesterov: beta0", beta0)
    check_unit_interval("ema_nesterov: gamma", gamma)
    check_int_at_least("ema_nesterov: prefill", prefill, 0)
    check_int_at_least("ema_nesterov: stop", stop, 0)
    check_non_negative("ema_nesterov: lr_ratio", lr_ratio)
    check_float_dtype("ema_nesterov: buffer_dtype", buffer_dtype, allow_none=True)
    inner = optax.with_extra_args_support(inner)

    def beta(t: jax.Array, dtype: Any) -> jax.Array:
        ratio = value_at(lr_ratio, t)
        active = (t >= prefill) & (t < stop)
        return jnp.where(active, beta0 * jnp.asarray(ratio, dtype), 0.0).astype(dtype)

    def init_fn(params):
        count = jnp.zeros([], jnp.int32)
        return EmaNesterovState(
            count=count, lookahead=beta(count, _scalar_dtype(params)),
            displacement=jax.tree.map(
                lambda p: p if _skipped(p) else jnp.zeros_like(
                    p, dtype=state_dtype(buffer_dtype, p)),
                params, is_leaf=_skipped),
            inner_state=inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        delta, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        count = optax.safe_increment(state.count)
        beta_now, beta_next = state.lookahead, beta(count, state.lookahead.dtype)

        def leaf(d, b):
            if _skipped(d):
                return d, b
            # W_{t+1} - W_t = β_t b_t + Δ_t: the lookahead stays in the weights.
            dt = _compute_dtype(d, b)
            bf = b.astype(dt)
            b_new = gamma * bf + (1.0 - gamma) * (beta_now * bf + d.astype(dt))
            return (d.astype(dt) + beta_next * b_new).astype(d.dtype), b_new.astype(b.dtype)

        pairs = jax.tree.map(leaf, delta, state.displacement, is_leaf=_skipped)
        is_pair = lambda x: type(x) is tuple
        new_updates = jax.tree.map(lambda x: x[0], pairs, is_leaf=is_pair)
        displacement = jax.tree.map(lambda x: x[1], pairs, is_leaf=is_pair)
        return new_updates, EmaNesterovState(count=count, lookahead=beta_next,
                                             displacement=displacement,
                                             inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def tail_ema(
    start: int,
    horizon: float = 150.0,
    blend: float = 0.6,
    end: int | None = None,
    *,
    mask: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformation:
    r"""Keep an EMA of the weights from update ``start`` on; evaluate a blend with it.

    A pass-through transformation (the update is unchanged) placed last in a chain: it
    sees the post-step weights ``w = params + update``. After update number ``start``
    it copies them, ``ema = w``; after each later update before ``end`` it moves
    ``ema ← ema + (w - ema)/horizon``. The weights to evaluate (`eval_params`) are
    ``(1 - blend)·w + blend·ema`` on the averaged leaves once the EMA exists, ``w``
    before and on the other leaves. Training never sees the EMA.

    #46 (evaluation-time readout): ``tail_ema(2400, 150, 0.6, end=2900, mask=<all but the
    token embedding>)``; #45 chose the horizon as ``(t_end - claim step)/power =
    (2900 - 2720)/1.2 = 150``.

    Args:
      start: the update count (>= 1) after which the EMA is initialised to the weights.
      horizon: ``τ`` >= 1: the EMA's coefficient is ``1/τ``.
      blend: ``λ`` in [0, 1], the EMA's weight in the evaluated weights.
      end: the update count from which the EMA stops moving (``None``: never).
      mask: which leaves to average, as ``optax.masked``'s mask: a tree of bools with the
        params' structure (or a prefix), or a callable ``params -> tree``; ``None``: all.

    Returns:
      An ``optax.GradientTransformation`` with state `TailEmaState`; ``update`` needs
      ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"embed": jnp.zeros(2), "w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.tail_ema(
      ...     start=2, horizon=2.0, blend=0.5, mask={"embed": False, "w": True}))
      >>> state = tx.init(params)
      >>> for _ in range(3):  # w: 0 -> -1 -> -2 (EMA = -2) -> -3 (EMA = -2.5)
      ...     updates, state = tx.update({"embed": jnp.ones(2), "w": jnp.ones(2)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> ev = optax_snoo.eval_params(params, state)
      >>> ev["w"].tolist(), ev["embed"].tolist()
      ([-2.75, -2.75], [-3.0, -3.0])

    References:
      Jordan et al., `modded-nanogpt Track 3 records #45 (maybe_update_tail_ema) and #46
      (tail-EMA readout)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    check_int_at_least("tail_ema: start", start, 1)
    if end is not None:
        check_int_at_least("tail_ema: end", end, start + 1)
    known_blend = concrete_real(blend)
    if callable(blend) or (known_blend is not None and not 0.0 <= known_blend <= 1.0):
        raise ValueError(f"tail_ema: blend must be a number in [0, 1], got {blend!r}")
    known = concrete_real(horizon)
    if callable(horizon) or (known is not None and known < 1):
        raise ValueError(f"tail_ema: horizon must be a number >= 1, got {horizon!r}")
    rate = 1.0 / horizon

    def init_fn(params):
        return TailEmaState(count=jnp.zeros([], jnp.int32),
                            blend=jnp.zeros([], _scalar_dtype(params)),
                            ema=_copy_buffers(params, mask))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("tail_ema: update needs params (the EMA is of params + updates)")
        count = optax.safe_increment(state.count)
        first = count == start
        moving = (count > start) if end is None else (count > start) & (count < end)

        def leaf(e, p, u):
            if _skipped(e):
                return e
            w = p.astype(e.dtype) + u.astype(e.dtype)
            return jnp.where(first, w, jnp.where(moving, e + (w - e) * rate, e))

        ema = jax.tree.map(leaf, state.ema, params, updates, is_leaf=_skipped)
        weight = jnp.where(count >= start, blend, 0.0).astype(state.blend.dtype)
        return updates, TailEmaState(count=count, blend=weight, ema=ema)

    return optax.GradientTransformation(init_fn, update_fn)


def reference_interpolation(
    capture: int,
    start: int,
    gamma: float = -0.075,
    *,
    mask: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformation:
    r"""Copy the weights at update ``capture``; evaluate ``w + γ(w - w_capture)`` later.

    A pass-through transformation (the update is unchanged) placed last in a chain: it
    sees the post-step weights ``w = params + update``. After update number ``capture``
    it keeps a copy ``ref = w``. From update ``start`` on, the weights to evaluate
    (`eval_params`) are ``w + γ·(w - ref)`` on the interpolated leaves: ``γ < 0`` moves
    them back toward the reference (``-γ`` of the way), ``γ > 0`` extrapolates past
    ``w`` away from it. Before ``start``, and on the other leaves, they are ``w``.
    Training never sees the reference: this changes what is evaluated and saved, not the
    training weights. (The records add ``γ(w - ref)`` to the weights in place for each
    validation and subtract it again after, which leaves them moved by the rounding of
    that sum, in the param dtype; ours leaves them untouched.)

    #42 (on #40's Aurora/EMA-Nesterov stack, claim at 2860 of a 2900-step schedule):
    ``reference_interpolation(2375, 2850, -0.075)`` on every parameter; #38 (claim at
    2900): ``reference_interpolation(2375, 2900, -0.075)``, evaluated after #38's tail
    velocity (`tail_velocity`, before this in the chain: `eval_params` applies readouts
    in the state's order). Inside `ema_nesterov`'s inner chain it sees (and evaluates)
    the weights without the lookahead, as the records' copy after ``EMA_Nesterov.step``;
    outside it, the lookahead point (the same in #42, where the lookahead ends at 1950).

    The reference is float32 (float64 for float64 params; one copy of the interpolated
    params in the state) and the readout is computed in it, then cast to the param's
    dtype; the records keep the copy and compute the readout in the param's dtype
    (bfloat16 for the token embedding).

    Args:
      capture: the update count (>= 1) after which the weights are copied.
      start: the update count (>= ``capture``) from which the interpolation is evaluated.
      gamma: ``γ``, a real number (#38, #42: -0.075, i.e. ``0.925 w + 0.075 ref``).
      mask: which leaves to interpolate, as ``optax.masked``'s mask: a tree of bools with
        the params' structure (or a prefix), or a callable ``params -> tree``; ``None``:
        all (the records: every parameter).

    Returns:
      An ``optax.GradientTransformation`` with state `ReferenceInterpolationState`;
      ``update`` needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0),
      ...                  optax_snoo.reference_interpolation(capture=1, start=3, gamma=-0.5))
      >>> state = tx.init(params)
      >>> for _ in range(3):  # w: 0 -> -1 (copied) -> -2 -> -3
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> optax_snoo.eval_params(params, state)["w"].tolist()  # -3 + (-0.5)(-3 - (-1))
      [-2.0, -2.0]

    References:
      Jordan et al., `modded-nanogpt Track 3 records #38 (results/20260520_tail_refinterp_2900,
      apply_ref_extrap_weights) and #42 (results/20260525_aurora_ema_ref, fixed reference
      interpolation)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    check_int_at_least("reference_interpolation: capture", capture, 1)
    check_int_at_least("reference_interpolation: start", start, capture)
    known = concrete_real(gamma)
    if callable(gamma) or (known is not None and not np.isfinite(known)):
        raise ValueError(f"reference_interpolation: gamma must be a finite number, got "
                         f"{gamma!r}")

    def init_fn(params):
        return ReferenceInterpolationState(count=jnp.zeros([], jnp.int32),
                                           gamma=jnp.zeros([], _scalar_dtype(params)),
                                           reference=_copy_buffers(params, mask))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("reference_interpolation: update needs params (the reference "
                             "is params + updates)")
        count = optax.safe_increment(state.count)

        def leaf(r, p, u):
            if _skipped(r):
                return r
            return jnp.where(count == capture, p.astype(r.dtype) + u.astype(r.dtype), r)

        reference = jax.tree.map(leaf, state.reference, params, updates, is_leaf=_skipped)
        weight = jnp.where(count >= start, gamma, 0.0).astype(state.gamma.dtype)
        return updates, ReferenceInterpolationState(count=count, gamma=weight,
                                                    reference=reference)

    return optax.GradientTransformation(init_fn, update_fn)


def tail_velocity(
    start: int,
    beta: float = 0.9,
    gamma: float = -6.0,
    max_ratio: float = 0.01,
    *,
    mask: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformation:
    r"""Keep an EMA of the weights' late updates; evaluate a step along it.

    A pass-through transformation (the update is unchanged) placed last in a chain: it
    sees the weights' displacement ``d_t = w_t - w_{t-1}`` of each update (``params +
    update`` rounded to the param's dtype, as ``optax.apply_updates`` stores it, minus
    ``params``). From update ``start`` on it keeps the velocity ``v`` (0 after update
    ``start``, then ``v ← β v + (1-β) d_t`` after each later update), and the weights to
    evaluate (`eval_params`) are, per leaf,

    ``w + γ·min(1, max_ratio·max(‖w‖, 1e-12)/max(‖v‖, 1e-12))·v``

    (Frobenius norms of the whole leaf): a step along the recent direction of travel
    (``γ < 0``: back along it), the velocity clipped to ``max_ratio`` of the weights'
    norm before ``γ`` scales it. Before
    ``start``, and on the other leaves, they are ``w``. Training never sees it: this
    changes what is evaluated and saved, not the training weights. (The record adds the
    step to the weights in place for each validation and subtracts it after, leaving
    them moved by that sum's rounding; ours leaves them untouched.)

    #38 (claim at 2900): ``tail_velocity(2500, 0.9, -6.0, 0.01, mask=<the hidden
    matrices>)``, then ``reference_interpolation(2375, 2900, -0.075)`` of the result on
    every parameter: put this one before it in the chain (`eval_params` applies readouts
    in the state's order, as the record applies the velocity, then the interpolation).

    The velocity is float32 (float64 for float64 params; one copy of the moved params
    in the state, where the record keeps two: the previous weights and the velocity) and
    the readout is computed in it, then cast to the param's dtype.

    Args:
      start: the update count (>= 1) after which the velocity starts (at 0).
      beta: ``β`` in [0, 1), the velocity's EMA factor.
      gamma: ``γ``, a real number: the step along ``v`` (#38: -6).
      max_ratio: the clip (> 0): ``v`` is scaled down to at most ``max_ratio·‖w‖``
        before ``γ`` multiplies it (#38: 0.01, so the step is at most 6% of ``‖w‖``).
      mask: which leaves to move, as ``optax.masked``'s mask: a tree of bools with the
        params' structure (or a prefix), or a callable ``params -> tree``; ``None``: all.

    Returns:
      An ``optax.GradientTransformation`` with state `TailVelocityState`; ``update``
      needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.full(4, 10.0)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.tail_velocity(
      ...     start=1, beta=0.5, gamma=-1.0, max_ratio=1.0))
      >>> state = tx.init(params)
      >>> for _ in range(3):  # w: 10 -> 9 -> 8 -> 7; v: 0 -> -0.5 -> -0.75
      ...     updates, state = tx.update({"w": jnp.ones(4)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> optax_snoo.eval_params(params, state)["w"].tolist()  # 7 - (-0.75)
      [7.75, 7.75, 7.75, 7.75]

    References:
      Jordan et al., `modded-nanogpt Track 3 record #38 (results/20260520_tail_refinterp_2900,
      update_tail_velocity, apply_tail_velocity_weights)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    check_int_at_least("tail_velocity: start", start, 1)
    check_unit_interval("tail_velocity: beta", beta)
    known = concrete_real(gamma)
    if callable(gamma) or (known is not None and not np.isfinite(known)):
        raise ValueError(f"tail_velocity: gamma must be a finite number, got {gamma!r}")
    known = concrete_real(max_ratio)
    if callable(max_ratio) or (known is not None and not (np.isfinite(known) and known > 0)):
        raise ValueError(f"tail_velocity: max_ratio must be a finite number > 0, got "
                         f"{max_ratio!r}")

    def init_fn(params):
        dtype = _scalar_dtype(params)
        return TailVelocityState(count=jnp.zeros([], jnp.int32), gamma=jnp.zeros([], dtype),
                                 max_ratio=jnp.asarray(max_ratio, dtype),
                                 velocity=_copy_buffers(params, mask))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("tail_velocity: update needs params (the velocity is of "
                             "params + updates - params)")
        count = optax.safe_increment(state.count)
        moving = count > start

        def leaf(v, p, u):
            if _skipped(v):
                return v
            moved = (p + u).astype(p.dtype)  # the weights as apply_updates stores them
            d = moved.astype(v.dtype) - p.astype(v.dtype)
            return jnp.where(moving, beta * v + (1.0 - beta) * d, v)

        velocity = jax.tree.map(leaf, state.velocity, params, updates, is_leaf=_skipped)
        weight = jnp.where(count >= start, gamma, 0.0).astype(state.gamma.dtype)
        return updates, TailVelocityState(
            count=count, gamma=weight,
            max_ratio=jnp.asarray(max_ratio, state.max_ratio.dtype), velocity=velocity)

    return optax.GradientTransformation(init_fn, update_fn)


_READOUTS = (EmaNesterovState, TailEmaState, ReferenceInterpolationState, TailVelocityState)
# #38's clamp of both norms in the velocity's clip.
_CLIP_EPS = 1e-12
# Each readout state's scalar fields (boxed by an nnx.Optimizer) and its tree of buffers.
_SCALARS = {EmaNesterovState: ("count", "lookahead"), TailEmaState: ("count", "blend"),
            ReferenceInterpolationState: ("count", "gamma"),
            TailVelocityState: ("count", "gamma", "max_ratio")}
_BUFFERS = {EmaNesterovState: "displacement", TailEmaState: "ema",
            ReferenceInterpolationState: "reference", TailVelocityState: "velocity"}


def _holds_value(x: Any) -> bool:
    """A box around one array (flax's ``Variable``: ``nnx.Param``, ``nnx.OptVariable``)."""
    return (not isinstance(x, tuple | list | Mapping | jax.Array | np.ndarray)
            and hasattr(type(x), "value"))


def _unbox(x: Any) -> Any:
    if not _holds_value(x):
        return x
    inner = jax.tree.leaves(x)
    if len(inner) > 1:
        raise ValueError(f"eval_params: a {type(x).__name__} holding {len(inner)} arrays, "
                         "expected one (a box of one array, as flax's nnx.Param)")
    # an nnx.Optimizer boxes a masked leaf's optax.MaskedNode too: an empty box is skipped
    return inner[0] if inner else optax.MaskedNode()


def _as_readout(x: Any) -> Any:
    """``x`` as a readout state, or None: the NamedTuple itself, or the mapping of its
    fields that ``nnx.state(optimizer, nnx.OptState)`` turns it into; boxed scalars
    unboxed."""
    if isinstance(x, _READOUTS):
        kind, fields = type(x), x._asdict()
    else:
        kind = next((k for k in _READOUTS if isinstance(x, Mapping)
                     and set(x.keys()) == set(k._fields)), None)
        if kind is None:
            return None
        fields = dict(x)
    return kind(**{k: _unbox(v) if k in _SCALARS[kind] else v for k, v in fields.items()})


def _by_path(tree: Any) -> list[tuple[tuple, Any]]:
    """(path, leaf) for each array of ``tree``, boxes unboxed and skipped leaves kept, the
    path as `path_names` reads it: a dict, an ``nnx.State`` or attributes read alike."""
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: _skipped(x) or _holds_value(x))[0]:
        out.append((path_names(path), _unbox(node)))
    return out


def _broadcast(scalar: jax.Array, like: jax.Array) -> jax.Array:
    # Under `over_replicas` the scalar carries the leading replica axis.
    return jnp.reshape(scalar, jnp.shape(scalar) + (1,) * (jnp.ndim(like) - jnp.ndim(scalar)))


def _apply(params: Any, state: Any) -> Any:
    tree = getattr(state, _BUFFERS[type(state)])
    extras = {path: e for path, e in _by_path(tree) if not _skipped(e)}
    entries = [(path, p) for path, p in _by_path(params) if not _skipped(p)]
    name = type(state).__name__
    unmatched = sorted(set(extras) - {path for path, _ in entries})
    if unmatched:
        raise ValueError(
            f"eval_params: the optimizer state's {name} averages leaves the params do not "
            f"have: {['/'.join(path) for path in unmatched[:4]]}"
            f"{' ...' if len(unmatched) > 4 else ''}; pass the params the optimizer updates "
            "(a Flax model's nnx.state(model, nnx.Param))")

    def leaf(path, p):
        extra = extras.get(path)
        if extra is None:
            return p
        if jnp.shape(extra) != jnp.shape(p):
            raise ValueError(f"eval_params: {'/'.join(path)} has shape "
                             f"{jnp.shape(p)} in the params but {jnp.shape(extra)} in the "
                             f"optimizer state's {name}")
        pf = p.astype(_compute_dtype(p, extra))
        if isinstance(state, EmaNesterovState):
            out = pf - _broadcast(state.lookahead, pf) * extra.astype(pf.dtype)
        elif isinstance(state, TailEmaState):
            out = pf + _broadcast(state.blend, pf) * (extra - pf)
        elif isinstance(state, TailVelocityState):
            v = extra.astype(pf.dtype)
            # the leaf's own norms (under over_replicas: each replica's)
            axes = tuple(range(jnp.ndim(state.gamma), jnp.ndim(pf)))
            norm = lambda x: jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=axes,
                                                          keepdims=True)), _CLIP_EPS)
            ratio = _broadcast(state.max_ratio, pf).astype(pf.dtype)
            clip = jnp.minimum(ratio * norm(pf) / norm(v), 1.0)
            out = pf + _broadcast(state.gamma, pf) * clip * v
        else:
            out = pf + _broadcast(state.gamma, pf) * (pf - extra)
        return out.astype(p.dtype)

    # the params' own tree (a box's one array is its only leaf), so the caller's types return
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(entries):
        raise ValueError("eval_params: params must be a pytree of arrays (or of boxes "
                         f"holding one array each, as flax's nnx.Param), got {type(params)}")
    return jax.tree.unflatten(treedef, [leaf(path, p) for path, p in entries])


def eval_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """The weights to evaluate: `params` with every readout in `opt_state` applied.

    Finds every `EmaNesterovState`, `TailEmaState`, `TailVelocityState` and
    `ReferenceInterpolationState` in ``opt_state`` (inside a chain, a partition,
    ``optax.MultiSteps``, ``optax.inject_hyperparams``, `snoo`, ...) in depth-first
    order (an outer wrapper before what it wraps, a chain's transforms in order) and
    applies each to the result of the ones before: the EMA-Nesterov lookahead is removed
    (``W = Y - β·b``), the tail EMA blended in (``(1 - λ)·w + λ·ema``), the tail
    velocity stepped along (``w + γ·clip·v``), the reference interpolated
    (``w + γ(w - ref)``). Leaves a state does not cover (another partition group, a
    masked leaf) are returned as they are. With no such state it returns ``params``,
    so a trainer can always evaluate and checkpoint ``eval_params(params, opt_state)``.
    jit-compatible; the params are not modified.

    Params and state are matched leaf by leaf on their paths, so the containers may differ:
    with Flax, ``eval_params(nnx.state(model, nnx.Param), opt.opt_state)``, or
    ``nnx.state(opt, nnx.OptState)`` (which turns each state into a mapping of its
    fields), or their ``nnx.to_pure_dict``, all give the same weights, as an
    ``nnx.State`` of ``nnx.Param`` for ``nnx.update(model, ...)`` (an object holding one
    array in ``.value``, as a flax ``Variable``, is read as that array).

    Args:
      params: the params the optimizer updates: any pytree of arrays, or of boxes of one
        array each (an ``nnx.State`` of ``nnx.Param``).
      opt_state: the whole optimizer state, as ``optax`` gives it, an
        ``nnx.Optimizer``'s ``opt_state``, its ``nnx.state(opt, nnx.OptState)``, or that
        state's pure dict.

    Returns:
      A tree like ``params`` (same structure, boxes and dtypes).

    Raises:
      ValueError: a readout averages a leaf the params do not have (``params`` is not
        the tree the optimizer updates), or a leaf's shape differs between the two.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.ones(2)}
      >>> state = optax.sgd(0.1).init(params)
      >>> optax_snoo.eval_params(params, state)["w"].tolist()  # no readout: the params
      [1.0, 1.0]

    References:
      Jordan et al., `modded-nanogpt Track 3 records #38, #40, #42 and #46
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: _as_readout(x) is not None):
        state = _as_readout(node)
        if isinstance(state, EmaNesterovState):
            params = eval_params(_apply(params, state), state.inner_state)
        elif state is not None:
            params = _apply(params, state)
    return params
