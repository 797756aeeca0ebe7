"""Decoupled weight decay: one transform for Muon, the AdamW groups and SkewAdam.

`add_decoupled_weight_decay` adds ``wd·mul·p`` to the incoming update, with a per-leaf
multiplier ``mul``, an optional optax-style mask and an optional cautious mask (decay
only where the update and the weight agree in sign). It goes between the direction and
the learning rate, ``chain(direction, add_decoupled_weight_decay(wd), scale_by_learning_rate(lr))``,
so the decay is multiplied by the (scheduled) learning rate:
``p ← p - lr·(u + wd·mul·p)``.

References:
  Loshchilov and Hutter, `Decoupled Weight Decay Regularization
  <https://arxiv.org/abs/1711.05101>`_, 2019

  Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_, 2025
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import check_non_negative, is_real, state_dtype, value_at

__all__ = ["DecoupledWeightDecayState", "add_decoupled_weight_decay", "cautious_mask"]


class DecoupledWeightDecayState(NamedTuple):
    """State of `add_decoupled_weight_decay` when the weight decay is a schedule.

    Attributes:
      count: the number of updates so far, the schedule's argument (int32).
    """

    count: jax.Array


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def cautious_mask(update: jax.Array, param: jax.Array, *, strict: bool = False) -> jax.Array:
    """Where cautious weight decay acts: ``u·p >= 0`` (``u·p > 0`` when ``strict``).

    ``update`` is the descent direction (the step is ``p - lr·u``), so ``u·p > 0`` is where
    the step already shrinks ``|p|``. The test reads the signs, so it does not underflow
    for tiny ``u·p``. Used before the step by `add_decoupled_weight_decay` (``>=``, as
    modded-nanogpt's Muon group) and after the radius pin by `radius_steps` (``>``, as
    modded-nanogpt Track 3 record #46).

    Args:
      update: the update (any float dtype).
      param: the weight, same shape.
      strict: ``>`` instead of ``>=``.

    Returns:
      A boolean array of the broadcast shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import cautious_mask
      >>> cautious_mask(jnp.array([1.0, -1.0, 0.0]), jnp.array([2.0, 2.0, 2.0])).tolist()
      [True, False, True]
      >>> cautious_mask(jnp.array([1.0, -1.0, 0.0]), jnp.ones(3), strict=True).tolist()
      [True, False, False]

    References:
      Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_, 2025
    """
    agree = jnp.sign(update) * jnp.sign(param)
    return agree > 0 if strict else agree >= 0


def add_decoupled_weight_decay(
    weight_decay: optax.ScalarOrSchedule,
    multiplier: optax.Params | Callable[[optax.Params], Any] | None = None,
    *,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    cautious: bool = False,
) -> optax.GradientTransformation:
    r"""Add ``weight_decay · multiplier · p`` to each update (decoupled weight decay).

    Put it between the direction and ``optax.scale_by_learning_rate(lr)`` so that the
    decay is multiplied by the (scheduled) learning rate, as in AdamW and modded-nanogpt's
    Muon: ``p ← p - lr·(u + wd·mul·p) = p (1 - lr·wd·mul) - lr·u``. Compared with
    ``optax.add_decayed_weights`` it

    - takes a per-leaf factor ``mul`` (the record's ``wd_mul``: 2.0 on MLP weights);
    - skips ``optax.MaskedNode`` (and ``None``) leaves, so it works inside
      ``optax.partition``/``optax.masked`` without a mask of its own;
    - forms ``wd·mul·p`` and the sum in float32 (float64 for float64 params or updates)
      and casts the sum to the update dtype, so
      bf16 params do not round the decay term to bf16 before it joins the update (with
      float32 updates and params the numbers are those of ``optax.add_decayed_weights``);
    - optionally decays cautiously (``cautious=True``): only where the update and the
      weight agree in sign,

      .. math::
        u \leftarrow u + wd \cdot mul \cdot p \cdot \mathbb{1}[u \cdot p \ge 0],

      where ``u`` is the incoming update (the descent direction before the learning
      rate). Where they disagree, the update already moves ``p`` towards 0 and decay
      would only add to it; Chen et al. show the masked decay keeps the loss the
      optimizer minimises unchanged (standard decay implicitly adds a penalty) while
      keeping decay's regularising effect. The mask uses ``>= 0``: an entry where the
      update or the weight is exactly 0 is decayed (``wd·p`` there is 0 when ``p`` is).
      modded-nanogpt's Muon group uses the same ``(grad·p) >= 0``; its Adam group uses
      ``(update·p) > 0``, which differs only where the update is exactly 0. The sign
      test reads the signs, so it does not underflow for tiny ``u·p``.

    Args:
      weight_decay: the decay rate: a float >= 0, a traced array (e.g. under
        ``optax.inject_hyperparams``), or a schedule of the update count (then the state
        holds that count; otherwise the state is empty). A Python 0 makes the transform a
        no-op that needs no params.
      multiplier: per-leaf factors: a tree of floats with the params' structure, or a
        callable ``params -> tree`` (it sees the params it is given, e.g. with
        ``optax.MaskedNode`` on leaves masked out); ``None`` means 1.0 everywhere.
      mask: as in ``optax.add_decayed_weights``: a tree of bools with the params'
        structure (or a prefix of it), or a callable ``params -> tree``; ``True`` leaves are
        decayed, the others left alone. ``None`` decays every leaf.
      cautious: decay only where ``u·p >= 0`` (see above).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params`` (unless
      ``weight_decay`` is a Python 0). Its state is ``optax.EmptyState()`` for a float or
      an array, `DecoupledWeightDecayState` for a schedule (wrapped in
      ``optax.MaskedState`` when ``mask`` is given).

    Raises:
      ValueError: for a negative ``weight_decay`` (a number or a concrete array), and at
        ``update`` time when ``params`` are missing.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import add_decoupled_weight_decay
      >>> params = {"mlp": jnp.ones((2, 2)), "attn": jnp.ones((2, 2))}
      >>> tx = add_decoupled_weight_decay(0.01, {"mlp": 2.0, "attn": 1.0})
      >>> updates, _ = tx.update(optax.tree.zeros_like(params), tx.init(params), params)
      >>> round(float(updates["mlp"][0, 0]), 6), round(float(updates["attn"][0, 0]), 6)
      (0.02, 0.01)
      >>> cautious = add_decoupled_weight_decay(0.01, cautious=True)
      >>> u = {"mlp": -jnp.ones((2, 2)), "attn": jnp.ones((2, 2))}  # mlp: u·p < 0
      >>> updates, _ = cautious.update(u, cautious.init(params), params)
      >>> float(updates["mlp"][0, 0]), round(float(updates["attn"][0, 0]), 6)
      (-1.0, 1.01)

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019

      Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_, 2025

      Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_ (``train_gpt.py``,
      ``NorMuonAndAdam._cautious_wd_and_update_inplace``), 2024-2025
    """
    check_non_negative("weight_decay", weight_decay)
    scheduled = callable(weight_decay)

    def init_fn(params: optax.Params) -> optax.OptState:
        del params
        if scheduled:
            return DecoupledWeightDecayState(count=jnp.zeros([], jnp.int32))
        return optax.EmptyState()

    def update_fn(updates: optax.Updates, state: optax.OptState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.OptState]:
        if is_real(weight_decay) and weight_decay == 0:
            return updates, state
        if params is None:
            raise ValueError(
                f"add_decoupled_weight_decay (weight_decay={weight_decay!r}) needs the "
                "current params: pass `params` to `update`.")
        if scheduled:
            wd = jnp.asarray(value_at(weight_decay, state.count))
            state = DecoupledWeightDecayState(count=optax.safe_increment(state.count))
        else:
            wd = jnp.asarray(weight_decay)

        def decay(u: jax.Array, p: jax.Array, m: Any = None) -> jax.Array:
            if _skipped(u):
                return u
            dt = jnp.promote_types(state_dtype(None, u), state_dtype(None, p))
            rate = wd.astype(dt) if m is None else wd.astype(dt) * jnp.asarray(m, dt)
            term = rate * p.astype(dt)
            if cautious:
                term = jnp.where(cautious_mask(u, p), term, 0.0)
            return (u.astype(dt) + term).astype(u.dtype)

        mul = multiplier(params) if callable(multiplier) else multiplier
        if mul is None:
            new = jax.tree.map(decay, updates, params, is_leaf=_skipped)
        else:
            new = jax.tree.map(decay, updates, params, mul, is_leaf=_skipped)
        return new, state

    tx = optax.GradientTransformation(init_fn, update_fn)
    return tx if mask is None else optax.masked(tx, mask)
