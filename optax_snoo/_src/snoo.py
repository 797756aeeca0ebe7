"""Snoo: a sparse Nesterov outer optimizer wrapped around any optax transformation.

Every `k` steps (at t = 0, k, 2k, ...) the inner optimizer's displacement since the last
sync, `slow - fast`, is taken as a pseudo-gradient for Nesterov SGD on a slow copy of the
params kept in the optimizer state; the params jump to the new slow weights. In between,
the inner optimizer runs alone.

References:
  Kallusky et al, `Snoo: sparse Nesterov outer optimizer, modded-nanogpt GPT-2 Medium
  record <https://github.com/KellerJordan/modded-nanogpt/pull/128>`_, 2025.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import check_int_at_least, check_non_negative, check_unit_interval

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]

__all__ = ["SnooState", "skip_update", "snoo", "snoo_is_sync_step"]


class SnooState(NamedTuple):
    """State of `snoo`.

    Attributes:
      count: number of updates so far (int32).
      slow: the slow weights, a copy of the params at the last sync (`slow_dtype`).
      momentum: the outer Nesterov buffer (`slow_dtype`).
      inner_state: the wrapped transformation's state.
    """

    count: jax.Array
    slow: Any
    momentum: Any
    inner_state: Any


def snoo_is_sync_step(step: int, k: int) -> bool:
    """Whether update number `step` (counting from 0) is a Snoo sync step."""
    return step % k == 0


def _is_snoo_state(x: Any) -> bool:
    return isinstance(x, SnooState)


def skip_update(opt_state: optax.OptState) -> optax.OptState:
    """The optimizer state after an update that was skipped (e.g. a non-finite gradient).

    A trainer that drops an update keeps the params and the optimizer state as they were,
    except that every `SnooState` in `opt_state` (at any depth: inside a chain, a
    partition, or wrapping another Snoo) advances its `count` by one. The skipped update
    thus keeps its slot in Snoo's period: a sync that falls on it is dropped and the next
    one comes `k` updates later, so `count` stays equal to the trainer's step and the host
    can compute every sync hint as `snoo_is_sync_step(step, k)` without reading the
    device. Other states (Adam's moments and counts included) are returned unchanged.

    Args:
      opt_state: any optimizer state.

    Returns:
      A state of the same structure, dtypes and shapes, jit-compatible (e.g. the
      "skip" branch of a `jax.lax.cond`).

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.ones(3)}
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
      ...                  optax_snoo.snoo(optax.sgd(0.1), k=4))
      >>> state = optax_snoo.skip_update(tx.init(params))
      >>> int(state[1].count)
      1

    References:
      Optax, `optax.apply_if_finite
      <https://optax.readthedocs.io/en/latest/api/optimizer_wrappers.html>`_ (which
      instead leaves every count unchanged), 2024.
    """
    def advance(x):
        if not _is_snoo_state(x):
            return x
        return x._replace(count=optax.safe_increment(x.count),
                          inner_state=skip_update(x.inner_state))

    return jax.tree.map(advance, opt_state, is_leaf=_is_snoo_state)


def _validate(inner: Any, learning_rate: Any, momentum: Any, k: Any) -> None:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise ValueError(
            f"snoo: inner must be an optax.GradientTransformation (with init and update), "
            f"got {type(inner).__name__}: {inner!r}")
    check_int_at_least("snoo: k", k, 1)
    check_non_negative("snoo: learning_rate", learning_rate)
    check_unit_interval("snoo: momentum", momentum)


def snoo(
    inner: optax.GradientTransformation,
    learning_rate: ScalarOrSchedule = 0.68,
    momentum: ScalarOrSchedule = 0.37,
    k: int = 28,
    *,
    slow_dtype: Any = "float32",
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` in Snoo, the sparse Nesterov outer optimizer.

    Each update first runs `inner` (`u`; fast weights `f = p + u`). On sync steps
    (`count % k == 0`, so the very first update syncs) the pseudo-gradient `d = slow - f`
    drives PyTorch-style Nesterov SGD on the slow weights:
    `b = μ b + d; slow = slow - η (d + μ b)`, and the returned update moves the params to
    `slow`. Otherwise the update is `u`. The inner state is never reset. The params stay an
    ordinary pytree (the slow copy lives in the state, unlike `optax.lookahead`).

    Extra keyword arguments of `update` are forwarded to `inner`, except `snoo_sync`: a
    static Python bool telling `update` whether this call is a sync step. With it, only
    that branch is traced, so a trainer can compile a sync and a no-sync step and choose
    between them on the host (`snoo_is_sync_step(step, k)`); without it (`None`), the
    choice is made inside the computation. A wrong hint gives a wrong trajectory.
    Without the hint, the sync branch (a `lax.cond` that writes only the slow weights and
    momentum) computes `inner`'s update a second time, from the same inputs, so the
    update of every other step stays one elementwise pass; `inner` thus runs twice on sync
    steps (host callbacks inside it fire twice there).

    Args:
      inner: the inner optimizer, e.g. `optax.partition({...muon..., ...adamw...})`.
      learning_rate: outer step size η, a float or a schedule of the outer-step count
        (the number of syncs before this one).
      momentum: outer Nesterov momentum μ in [0, 1), a float or a schedule of the
        outer-step count.
      k: sync period (integer >= 1).
      slow_dtype: dtype of the slow weights and outer momentum (float32 even for bf16
        params). Any dtype-like; the default is the string `"float32"` rather than
        `jnp.float32` because `optax.inject_hyperparams` takes callables for schedules.

    Returns:
      An `optax.GradientTransformationExtraArgs` with state `SnooState`. `update` needs
      `params`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import snoo
      >>> params = {"w": jnp.ones((2, 3))}
      >>> tx = snoo(optax.adamw(3e-4), learning_rate=0.68, momentum=0.37, k=28)
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.full((2, 3), 0.5)}
      >>> updates, state = tx.update(grads, state, params, snoo_sync=True)
      >>> params = optax.apply_updates(params, updates)
      >>> int(state.count), params["w"].shape
      (1, (2, 3))

    References:
      Kallusky et al, `Snoo: sparse Nesterov outer optimizer, modded-nanogpt GPT-2 Medium
      record <https://github.com/KellerJordan/modded-nanogpt/pull/128>`_, 2025.
    """
    _validate(inner, learning_rate, momentum, k)
    slow_dtype = jnp.dtype(slow_dtype)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # A real copy: on float32 params `astype` would alias the params, and a train step
        # donating params and state would then donate one buffer twice.
        slow = jax.tree.map(lambda p: jnp.array(p, dtype=slow_dtype, copy=True), params)
        return SnooState(
            count=jnp.zeros([], jnp.int32),
            slow=slow,
            momentum=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=slow_dtype), params),
            inner_state=inner.init(params),
        )

    def outer_step(slow, buf, params, inner_updates, eta, mu):
        """Nesterov SGD on the slow weights with pseudo-gradient slow - (params + u)."""

        def leaf(s, b, p, u):
            d = s - (p.astype(slow_dtype) + u.astype(slow_dtype))
            b = (mu * b + d).astype(slow_dtype)
            return (s - eta * (d + mu * b)).astype(slow_dtype), b

        out = jax.tree.map(leaf, slow, buf, params, inner_updates)
        is_pair = lambda x: type(x) is tuple
        return tuple(jax.tree.map(lambda o, i=i: o[i], out, is_leaf=is_pair) for i in range(2))

    def jump(slow, params, inner_updates):
        """The update that moves the params to the slow weights."""
        return jax.tree.map(lambda s, p, u: (s - p.astype(slow_dtype)).astype(u.dtype),
                            slow, params, inner_updates)

    def update_fn(updates, state, params=None, *, snoo_sync: bool | None = None, **extra_args):
        if params is None:
            raise ValueError("snoo: update needs params (the fast weights) to form slow - fast")
        if snoo_sync is not None and not isinstance(snoo_sync, bool):
            raise ValueError(
                f"snoo: snoo_sync must be a static Python bool or None, got {snoo_sync!r}")
        outer_count = state.count // k
        eta = learning_rate(outer_count) if callable(learning_rate) else learning_rate
        mu = momentum(outer_count) if callable(momentum) else momentum
        slow, buf = state.slow, state.momentum

        if snoo_sync is not None:
            inner_updates, inner_state = inner.update(
                updates, state.inner_state, params, **extra_args)
            if snoo_sync:
                slow, buf = outer_step(slow, buf, params, inner_updates, eta, mu)
                inner_updates = jump(slow, params, inner_updates)
            return inner_updates, SnooState(
                count=optax.safe_increment(state.count), slow=slow, momentum=buf,
                inner_state=inner_state)

        # Plain path. The conditional writes only slow and momentum, in place; its sync
        # branch recomputes the inner update from the old inner state (once per k steps)
        # rather than taking it as an operand, which would make XLA materialise it on every
        # step. The scalar `order` (1.0 from either branch) scales the gradients given to
        # the inner update below: x * 1.0 == x exactly, and the data dependency makes the
        # inner update run after the conditional, so it may overwrite the inner state
        # buffers in place instead of XLA copying them for the conditional to read.
        is_sync = state.count % k == 0

        def sync_branch(operand):
            u, _ = inner.update(updates, state.inner_state, params, **extra_args)
            return (*outer_step(*operand, params, u, eta, mu), jnp.ones([], jnp.float32))

        def no_sync_branch(operand):
            return (*operand, jnp.ones([], jnp.float32))

        slow, buf, order = jax.lax.cond(is_sync, sync_branch, no_sync_branch, (slow, buf))
        ordered = jax.tree.map(
            lambda g: g * order.astype(g.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g,
            updates)
        inner_updates, inner_state = inner.update(
            ordered, state.inner_state, params, **extra_args)
        # A select between two values that are there anyway (the inner update, fused into
        # its elementwise producer, and slow - params, one extra read of slow): no branch
        # is computed for nothing.
        new_updates = jax.tree.map(
            lambda j, u: jnp.where(is_sync, j, u), jump(slow, params, inner_updates),
            inner_updates)
        return new_updates, SnooState(
            count=optax.safe_increment(state.count), slow=slow, momentum=buf,
            inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
