"""Moves of the training weights after each step: the SODA pull toward the initial weights.

These are pass-through transformations placed last in a chain (or in the chain of one
`optax.partition` group, or under `optax.masked`): they see the params ``p`` and the update
``u`` the rest of the chain computed from ``p``, and return ``u`` plus a move of the
post-step weights. Unlike the readouts of `optax_snoo.averaging` (`tail_ema`), which only
change the weights a trainer evaluates, these move the weights training continues from,
as the records' code does; `optax_snoo.eval_params` returns the params unchanged for them.

`pull_to_init` (modded-nanogpt Track 3 result #32) mixes the weights toward their initial
values with weight ``λ_t = s(t)/(t+2)``.

References:
  wakamex, `modded-nanogpt Track 3 result #32: SODA fade (results/20260518_soda_fade_3000_n9)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import check_non_negative, state_dtype, value_at

__all__ = ["PullToInitState", "pull_to_init"]

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
    return p if _skipped(p) else jnp.asarray(p, state_dtype(None, p))


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
