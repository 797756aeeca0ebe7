"""Moves of the training weights after each step: the SODA pull toward the initial weights,
capped RRE extrapolation and delta pulses.

They are pass-through transformations placed last in a chain (or in the chain of one
`optax.partition` group, or under `optax.masked`): they see the params ``p`` and the update
``u`` the rest of the chain computed from ``p``, and return ``u`` plus a move of the
post-step weights. Unlike the readouts of `optax_snoo.averaging` (`tail_ema`), which only
change the weights a trainer evaluates, these move the weights training continues from,
as the records' code does; `optax_snoo.eval_params` returns the params unchanged for them.

`pull_to_init` (modded-nanogpt Track 3 result #32) mixes the weights toward their initial
values with weight ``λ_t = s(t)/(t+2)``. `rre_extrapolation` (result #34) keeps the last
few post-step weights late in training and, every few steps, moves the weights by a damped
reduced-rank-extrapolation step computed from them, capped relative to the weights' norm.
`delta_pulses` (result #43's BroadDelta and TrailDelta) moves the weights every few steps
by a multiple of their change since the last pulse.

References:
  wakamex, `modded-nanogpt Track 3 result #32: SODA fade (results/20260518_soda_fade_3000_n9)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026.
  tomoqt, `modded-nanogpt Track 3 result #34: capped RRE extrapolation
  (results/20260520_rre_extrapolation_pr300_2925)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026.
  Jesse Clark (jn2clark), `modded-nanogpt Track 3 result #43: tail phase readout
  (results/20260529_tail_phase_readout_2850) <https://github.com/KellerJordan/modded-nanogpt/pull/318>`_,
  2026.
  Sidi, Ford and Smith, `Acceleration of convergence of vector sequences
  <https://doi.org/10.1137/0723013>`_, SIAM J. Numer. Anal. 23(1), 1986 (RRE).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import (
    check_non_negative,
    concrete_real,
    is_integer,
    state_dtype,
    value_at,
)

__all__ = ["DeltaPulsesState", "PullToInitState", "RreExtrapolationState", "delta_pulses",
           "pull_to_init", "rre_extrapolation"]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _compute_dtype(*arrays: Any) -> Any:
    """float32, or float64 when an operand is: a float64 run's arithmetic stays float64."""
    return functools.reduce(jnp.promote_types, [jnp.result_type(x) for x in arrays],
                            jnp.dtype(jnp.float32))


def _live(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree, is_leaf=_skipped) if not _skipped(x)]


def _scalar_dtype(params: Any) -> Any:
    """float32, float64 for float64 params: the dtype of a state's scalars and sums."""
    return _compute_dtype(*_live(params))


def _copy(p: Any) -> Any:
    # a new buffer: an anchor aliasing a float32 param would be donated twice by a trainer
    # that donates params and state
    return p if _skipped(p) else jnp.array(p, state_dtype(None, p), copy=True)


class PullToInitState(NamedTuple):
    """State of `pull_to_init`.

    Attributes:
      count: number of updates so far (int32).
      anchor: the params given to ``init`` (float32, float64 for float64 params;
        ``optax.MaskedNode`` on leaves under ``optax.masked``'s mask).
    """

    count: jax.Array
    anchor: Any


def pull_to_init(strength: ScalarOrSchedule = 1.0) -> optax.GradientTransformation:
    r"""Mix the post-step weights toward their initial values (SODA's anchor correction).

    With ``a`` the params given to ``init``, ``t`` the number of updates before this one
    and ``u`` the incoming update (computed by the rest of the chain from ``p``),
    the update becomes

    .. math::

        u + \lambda_t (a - p),\qquad
        \lambda_t = \min\!\bigl(\max\!\bigl(s(t)/(t+2),\,0\bigr),\,1\bigr),

    so ``p ← (1 - λ_t) p + λ_t a + u``: modded-nanogpt Track 3 result #32's ``Muon.step``
    does ``p.mul_(1 - lam).add_(anchor, alpha=lam)`` and then ``p.add_(update,
    alpha=-lr)``, with the update (and its u/w floor, which reads ``‖p‖``) computed before
    the mix, as here. ``1/(t+2)`` is dual averaging's weight of the starting point; the
    strength ``s(t)`` fades it. This moves the training weights (not a readout: there is
    nothing for `eval_params` to apply).

    #32 (on #20's hidden matrices, the Muon group only): ``s(t) = 1`` before update 2000,
    ``½(1 + cos(π (t - 2000)/750))`` from 2000 to 2750, ``0`` from 2750 on:
    ``pull_to_init(optax.join_schedules([optax.constant_schedule(1.0),
    optax.cosine_decay_schedule(1.0, 750)], [2000]))``.

    Differences from the record: the record keeps its anchor in the param dtype (float32
    there) and rounds ``p`` after the mix and again after the update; here the anchor is
    float32 (float64 for float64 params; a bfloat16 initial value is exact in it) and the
    move is added to the update, which is rounded once when applied.

    Args:
      strength: ``s``, a number >= 0 or a schedule of the update count ``t`` (#32: 1,
        faded as above).

    Returns:
      An ``optax.GradientTransformation`` with state `PullToInitState`; ``update`` needs
      ``params``. To pull only some leaves, wrap it in ``optax.masked`` (or put it in one
      group of ``optax.partition``).

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.pull_to_init(1.0))
      >>> state = tx.init(params)
      >>> for _ in range(3):  # w: 0 -> -1 -> (2/3)(-1) - 1 -> (3/4)(-5/3) - 1
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> [round(x, 4) for x in params["w"].tolist()]
      [-2.25, -2.25]

    References:
      wakamex, `modded-nanogpt Track 3 result #32, SODA fade at 3000 steps
      (results/20260518_soda_fade_3000_n9: Muon.step's soda_anchor, soda_fade_multiplier)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    check_non_negative("pull_to_init: strength", strength)

    def init_fn(params):
        return PullToInitState(count=jnp.zeros([], jnp.int32),
                               anchor=jax.tree.map(_copy, params, is_leaf=_skipped))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("pull_to_init: update needs params (the pull is toward the "
                             "initial weights from the current ones)")
        dtype = _scalar_dtype(state.anchor)
        t = state.count
        s = jnp.asarray(value_at(strength, t), dtype)
        lam = jnp.clip(s / (t + 2).astype(dtype), 0.0, 1.0)

        def leaf(a, p, u):
            if _skipped(a):
                return u
            dt = _compute_dtype(a, p, u)
            return (u.astype(dt) + lam.astype(dt) * (a.astype(dt) - p.astype(dt))
                    ).astype(u.dtype)

        new = jax.tree.map(leaf, state.anchor, params, updates, is_leaf=_skipped)
        return new, PullToInitState(count=optax.safe_increment(t), anchor=state.anchor)

    return optax.GradientTransformation(init_fn, update_fn)


class RreExtrapolationState(NamedTuple):
    """State of `rre_extrapolation`.

    Attributes:
      count: number of updates so far (int32).
      filled: how many of ``iterates`` are kept weights (int32, 0 to ``history``): the last
        ``filled``, oldest first.
      iterates: ``history`` trees like the params (float32, float64 for float64 params;
        ``optax.MaskedNode`` on leaves under ``optax.masked``'s mask): the last post-step
        weights, the newest last.
    """

    count: jax.Array
    filled: jax.Array
    iterates: tuple


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"rre_extrapolation: {name} must be an integer >= {minimum}, "
                         f"got {value!r}")


def rre_extrapolation(
    start: int,
    stop: int | None = None,
    every: int = 5,
    history: int = 4,
    damping: float = 0.875,
    max_relative: float = 1e-3,
    regularization: float = 1e-6,
) -> optax.GradientTransformation:
    r"""Every few steps late in training, jump to a damped, capped RRE extrapolation of the
    last weights (modded-nanogpt Track 3 result #34).

    A pass-through placed last in a chain: with ``t`` the number of updates including this
    one and ``w = p + u`` the post-step weights, while ``start <= t <= stop`` it keeps
    ``w`` among the last ``history`` weights; when ``t`` is a multiple of ``every`` and
    ``history`` weights ``x_0, ..., x_k`` (``k = history - 1``, the newest last) are kept,
    it moves the weights to

    .. math::

        U_i = x_{i+1} - x_i,\quad G = U U^\top + \rho I,\quad
        \rho = r\,\max(\operatorname{tr} G, 0)/k + 10^{-10},\quad
        c = G^{-1}\mathbf 1 / \mathbf 1^\top G^{-1}\mathbf 1,\\
        \gamma_i = \textstyle\sum_{j \ge i} c_j,\qquad
        \delta = -d\,\textstyle\sum_i \gamma_i U_i,\qquad
        \delta \leftarrow \delta\,\min\bigl(1,\ m\,\max(\lVert x_k\rVert, 10^{-12})
        / \lVert\delta\rVert\bigr),

    ``x_k + δ``, and keeps only that point (the next extrapolation needs ``history - 1``
    more steps). All the leaves the transform sees are one vector (#34 extrapolates its
    whole Muon group, the hidden matrices, at once): ``G``, the norms and the cap are over
    all of them. A non-finite extrapolation (or ``|Σ G^{-1}1| < 1e-12``) leaves the
    weights where they are, as the record does. Elsewhere the update passes unchanged.
    This moves the training weights (not a readout: `eval_params` returns the params);
    the inner optimizer's momentum is kept (#34: ``extrap_reset_momentum = False``).

    The move is the record's ``rre_extrapolate`` as written. Since ``Σ_i γ_i U_i =
    Σ_j c_j (x_{j+1} - x_0)``, its point ``x_k - Σ_i γ_i U_i`` is ``x_0 + x_k - s'`` with
    ``s' = Σ_j c_j x_{j+1}``, Sidi's reduced-rank extrapolation of the limit (up to the
    residual ``Σ_j c_j U_j`` that ``c`` minimises), so ``δ = d (x_0 - s')`` points from
    that limit back toward the oldest kept weights: on weights converging geometrically
    to ``s`` the undamped point is ``x_0 + x_k - s``, behind ``x_0``; on weights drifting
    at a constant velocity ``v`` it is ``x_k - 2v`` (textbook RRE's point too). Kept as
    the record has it, the result's own code. With #34's cap ``m = 10^{-3}`` each move is
    at most 0.1% of the weights' norm; the cap binds at #34's first moves (its log's
    ``extrap_rel`` is 1.000e-03 up to step 2870, then falls to 6.7e-04 at 2925).

    #34 (on #30's stack, hidden matrices only): ``rre_extrapolation(start=2820,
    stop=2925, every=5, history=4, damping=0.875, max_relative=1e-3)``: 21 moves, at
    updates 2825, 2830, ..., 2925, the claim step.

    Differences from the record: the record solves ``G c = 1`` with ``torch.linalg.solve``
    and falls back to the unmoved weights if it raises; here a singular ``G`` (only
    possible with ``regularization = 0``) gives non-finite coefficients and the same
    fallback. The sums are over the leaves in the tree's order, not one concatenated
    vector: equal up to float32 rounding.

    Args:
      start: the first update count (>= 1) whose weights are kept.
      stop: the last update count that keeps weights and may extrapolate (``None``: no
        end).
      every: extrapolate at update counts that are multiples of ``every`` (>= 1).
      history: how many weights an extrapolation uses (>= 3).
      damping: ``d`` > 0, the fraction of the extrapolation taken (#34: 0.875).
      max_relative: ``m`` >= 0, the cap on ``‖δ‖/‖x_k‖`` (0: no cap).
      regularization: ``r`` >= 0, the ridge on ``G`` relative to its mean diagonal.

    Returns:
      An ``optax.GradientTransformation`` with state `RreExtrapolationState`
      (``history`` float32 copies of the params); ``update`` needs ``params``. To
      extrapolate only some leaves, wrap it in ``optax.masked`` or put it in one group of
      ``optax.partition``.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.rre_extrapolation(
      ...     start=1, every=4, history=4, damping=1.0, max_relative=0.0))
      >>> state = tx.init(params)
      >>> for _ in range(4):  # w: -1, -1.5, -1.75, -1.875, halving steps toward -2
      ...     g = {"w": jnp.ones(2) * 0.5 ** (state[1].count.astype(jnp.float32))}
      ...     updates, state = tx.update(g, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> # the record's move: x_0 + x_3 - (limit) = -1 - 1.875 + 2
      >>> [round(x, 3) for x in params["w"].tolist()]
      [-0.875, -0.875]

    References:
      tomoqt, `modded-nanogpt Track 3 result #34, capped RRE extrapolation
      (results/20260520_rre_extrapolation_pr300_2925: rre_extrapolate,
      Muon._maybe_extrapolate)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
      Sidi, Ford and Smith, `Acceleration of convergence of vector sequences
      <https://doi.org/10.1137/0723013>`_, SIAM J. Numer. Anal. 23(1), 1986.
    """
    _check_count("start", start, 1)
    if stop is not None:
        _check_count("stop", stop, start)
    _check_count("every", every, 1)
    _check_count("history", history, 3)
    # a value known now is checked; an array of inject_hyperparams' state passes
    for name, value, positive in (("damping", damping, True),
                                  ("max_relative", max_relative, False),
                                  ("regularization", regularization, False)):
        known = concrete_real(value)
        if callable(value) or (known is not None and (known <= 0 if positive else known < 0)):
            raise ValueError(f"rre_extrapolation: {name} must be a number "
                             f"{'> 0' if positive else '>= 0'}, got {value!r}")
    k = history - 1

    def init_fn(params):
        # one tree per slot: a tuple of one tree repeated is one buffer in several places,
        # which a trainer donating its state would donate twice
        zeros = lambda: jax.tree.map(
            lambda p: p if _skipped(p) else jnp.zeros_like(p, dtype=state_dtype(None, p)),
            params, is_leaf=_skipped)
        return RreExtrapolationState(count=jnp.zeros([], jnp.int32),
                                     filled=jnp.zeros([], jnp.int32),
                                     iterates=tuple(zeros() for _ in range(history)))

    def leaves(tree):
        return jax.tree.leaves(tree, is_leaf=_skipped)

    def move(iterates):
        """δ per leaf from the kept weights (all ``history`` of them)."""
        dtype = _scalar_dtype(iterates[-1])
        xs = [[x.astype(dtype) for x in leaves(it) if not _skipped(x)] for it in iterates]
        diffs = [[b - a for a, b in zip(xs[i], xs[i + 1], strict=True)] for i in range(k)]
        dot = lambda a, b: sum((jnp.vdot(x, y) for x, y in zip(a, b, strict=True)),
                               jnp.zeros([], dtype))
        gram = jnp.stack([jnp.stack([dot(diffs[i], diffs[j]) for j in range(k)])
                          for i in range(k)])
        rho = regularization * jnp.maximum(jnp.trace(gram), 0.0) / k + 1e-10
        coeffs = jnp.linalg.solve(gram + rho * jnp.eye(k, dtype=dtype), jnp.ones(k, dtype))
        total = jnp.sum(coeffs)
        ok = jnp.isfinite(total) & (jnp.abs(total) >= 1e-12)
        gamma = jnp.cumsum((coeffs / total)[::-1])[::-1]
        delta = [-damping * sum(gamma[i] * diffs[i][j] for i in range(k))
                 for j in range(len(xs[-1]))]
        ok &= jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for d in delta]))
        norm = lambda v: jnp.sqrt(dot(v, v))
        rel = norm(delta) / jnp.maximum(norm(xs[-1]), 1e-12)
        cap = jnp.asarray(max_relative, dtype)
        scale = jnp.where((cap > 0) & (rel > cap), cap / jnp.maximum(rel, 1e-12), 1.0)
        scale = jnp.where(ok, scale, 0.0).astype(dtype)
        it = iter(delta)
        return jax.tree.map(lambda x: x if _skipped(x) else scale * next(it),
                            iterates[-1], is_leaf=_skipped)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("rre_extrapolation: update needs params (it keeps the "
                             "post-step weights params + updates)")
        t = optax.safe_increment(state.count)
        active = t >= start if stop is None else (t >= start) & (t <= stop)
        # The weights after this step, as optax.apply_updates leaves them.
        post = jax.tree.map(
            lambda p, u, x: x if _skipped(x) else
            jnp.asarray(p + u).astype(p.dtype).astype(x.dtype),
            params, updates, state.iterates[0], is_leaf=_skipped)

        def keep(iterates, filled):
            return (*iterates[1:], post), jnp.minimum(filled + 1, history)

        iterates, filled = jax.lax.cond(active, keep, lambda i, f: (i, f),
                                        state.iterates, state.filled)
        due = active & (t % every == 0) & (filled == history)

        def jump(iterates, filled):
            delta = move(iterates)
            moved = jax.tree.map(lambda x, d: x if _skipped(x) else x + d.astype(x.dtype),
                                 iterates[-1], delta, is_leaf=_skipped)
            return delta, (*iterates[:-1], moved), jnp.ones_like(filled)

        def stay(iterates, filled):
            zero = jax.tree.map(lambda x: x if _skipped(x) else jnp.zeros_like(x),
                                iterates[-1], is_leaf=_skipped)
            return zero, iterates, filled

        delta, iterates, filled = jax.lax.cond(due, jump, stay, iterates, filled)
        new = jax.tree.map(
            lambda u, d: u if _skipped(d) else
            (u.astype(_compute_dtype(u, d)) + d).astype(u.dtype),
            updates, delta, is_leaf=_skipped)
        return new, RreExtrapolationState(count=t, filled=filled, iterates=iterates)

    return optax.GradientTransformation(init_fn, update_fn)


class DeltaPulsesState(NamedTuple):
    """State of `delta_pulses`.

    Attributes:
      count: number of updates so far (int32).
      reference: the weights after update ``start`` or after the last pulse, moved
        (float32, float64 for float64 params; zeros before ``start``; ``optax.MaskedNode``
        on leaves under ``optax.masked``'s mask).
      momentum: the last pulse's ``Δ`` (same dtypes), or ``None`` when ``momentum`` was 0
        at ``init``.
    """

    count: jax.Array
    reference: Any
    momentum: Any


def delta_pulses(
    start: int,
    every: int,
    gammas: float | tuple[float, ...],
    stop: int | None = None,
    momentum: float = 0.0,
) -> optax.GradientTransformation:
    r"""Every ``every`` updates from ``start``, move the weights by ``γ_k`` times their change
    since the previous pulse (modded-nanogpt Track 3 result #43's TrailDelta and BroadDelta).

    A pass-through placed last in a chain: with ``t`` the number of updates including this
    one and ``w = p + u`` the post-step weights, after update ``start`` it keeps
    ``r = w``; after each update ``t = start + k·every`` (``k = 1, 2, …``, ``t <= stop``)
    it moves the weights by

    .. math::

        \Delta_k = (w - r) + \beta\,\Delta_{k-1},\qquad
        w \leftarrow w + \gamma_k \Delta_k,\qquad r \leftarrow w
        \quad(\Delta_0 = 0),

    with ``γ_k`` the ``k``-th of ``gammas`` (the last one repeated). ``γ < 0`` pulls the
    weights back along their recent path. Each leaf moves by its own ``Δ`` (no norms
    across leaves). This moves the training weights (not a readout: `eval_params`
    returns the params); the inner optimizer's state is left as it is, as the record's
    pulses leave its Adam and Muon moments and its EMA-Nesterov buffers.

    #43 (on #41's stack): TrailDelta on every parameter but the token embedding,
    ``delta_pulses(2650, 100, (-0.04, -0.12), stop=2850, momentum=1.0)``: pulses after
    updates 2750 and 2850 (the last, so the second moves the final weights); BroadDelta
    on the hidden matrices other than attention's V and O, ``delta_pulses(2000, 400,
    -0.005, stop=2400)``: one pulse after update 2400 by ``-0.005 (w_2400 - w_2000)``.
    In a chain the order is the record's: TrailDelta, then BroadDelta, then anything
    that copies the weights at the same update (#43's phase readout, its final readout's
    anchor).

    Differences from the record: its references and momenta are copies in the param
    dtype (bfloat16 for the token embedding, outside #43's scopes) and it moves ``p`` in
    place; here they are float32 (float64 for float64 params) and the move is added to
    the update, rounded once when applied. The record's optional cap on a pulse's size
    (``TRAIL_DELTA_MAX_MOVE_RATIO``, 0 in #43) is left out.

    Args:
      start: the update count (>= 1) after which the weights are first copied.
      every: updates between pulses (>= 1); the first pulse follows update
        ``start + every``.
      gammas: ``γ_k``, a number or a tuple of numbers (the last repeated): #43's
        TrailDelta ``(-0.04, -0.12)``, BroadDelta ``-0.005``.
      stop: the last update count that may pulse (``None``: no end).
      momentum: ``β`` >= 0, the previous ``Δ``'s weight in the next (#43's TrailDelta:
        1.0; 0 keeps no buffer).

    Returns:
      An ``optax.GradientTransformation`` with state `DeltaPulsesState`; ``update`` needs
      ``params``. To move only some leaves, wrap it in ``optax.masked`` (or put it in one
      group of ``optax.partition``).

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.delta_pulses(start=1, every=2,
      ...                                                          gammas=-0.5))
      >>> state = tx.init(params)
      >>> for _ in range(3):  # w: -1 (copied), -2, -3 -> pulse: -3 - 0.5 (-3 - (-1))
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"].tolist()
      [-2.0, -2.0]

    References:
      Jesse Clark (jn2clark), `modded-nanogpt Track 3 result #43, tail phase readout
      (results/20260529_tail_phase_readout_2850: maybe_apply_trail_delta_step,
      maybe_capture_broad_delta, maybe_apply_broad_delta)
      <https://github.com/KellerJordan/modded-nanogpt/pull/318>`_, 2026.
    """
    _check_pulses_count("start", start, 1)
    _check_pulses_count("every", every, 1)
    if stop is not None:
        _check_pulses_count("stop", stop, start)
    gamma_list = gammas if isinstance(gammas, tuple | list) else (gammas,)
    if not gamma_list or any(callable(g) or (concrete_real(g) is None and not isinstance(
            g, jax.Array)) for g in gamma_list):
        raise ValueError(f"delta_pulses: gammas must be a number or a non-empty tuple of "
                         f"numbers, got {gammas!r}")
    known = concrete_real(momentum)
    if callable(momentum) or (known is not None and not known >= 0):
        raise ValueError(f"delta_pulses: momentum must be a number >= 0, got {momentum!r}")

    def init_fn(params):
        def zeros():  # each buffer its own: a trainer donates the state
            return jax.tree.map(
                lambda p: p if _skipped(p) else jnp.zeros_like(p, dtype=state_dtype(None, p)),
                params, is_leaf=_skipped)
        # a known 0 keeps no buffer; an array (inject_hyperparams) keeps one
        return DeltaPulsesState(count=jnp.zeros([], jnp.int32), reference=zeros(),
                                momentum=None if known == 0 else zeros())

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("delta_pulses: update needs params (it copies and moves the "
                             "post-step weights params + updates)")
        t = optax.safe_increment(state.count)
        dtype = _scalar_dtype(state.reference)
        since = t - start
        due = (since > 0) & (since % every == 0)
        if stop is not None:
            due &= t <= stop
        k = jnp.clip(since // every - 1, 0, len(gamma_list) - 1)
        gamma = jnp.stack([jnp.asarray(g, dtype) for g in gamma_list])[k]
        beta = jnp.asarray(momentum, dtype)

        refs, treedef = jax.tree.flatten(state.reference, is_leaf=_skipped)
        moms = ([None] * len(refs) if state.momentum is None
                else treedef.flatten_up_to(state.momentum))
        new_u, new_r, new_m = [], [], []
        for r, m, p, u in zip(refs, moms, treedef.flatten_up_to(params),
                              treedef.flatten_up_to(updates), strict=True):
            if _skipped(r):
                new_u.append(u), new_r.append(r), new_m.append(m)
                continue
            w = p.astype(r.dtype) + u.astype(r.dtype)
            delta = w - r if m is None else w - r + beta * m
            move = jnp.where(due, gamma * delta, 0.0).astype(r.dtype)
            new_u.append((u.astype(_compute_dtype(u, r)) + move).astype(u.dtype))
            new_r.append(jnp.where((t == start) | due, w + move, r))
            new_m.append(None if m is None else jnp.where(due, delta, m))
        tree = lambda leaves: jax.tree.unflatten(treedef, leaves)
        momenta = None if state.momentum is None else tree(new_m)
        return tree(new_u), DeltaPulsesState(count=t, reference=tree(new_r), momentum=momenta)

    return optax.GradientTransformation(init_fn, update_fn)


def _check_pulses_count(name: str, value: Any, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"delta_pulses: {name} must be an integer >= {minimum}, "
                         f"got {value!r}")
