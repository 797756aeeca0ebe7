"""Snoo, the Step-K Nesterov Outer Optimizer, wrapped around any optax transformation.

(The modded-nanogpt record that introduced it called it the "sparse Nesterov outer
optimizer"; the paper's name is used here.)

Every `k` steps (at t = 0, k, 2k, ...) the inner optimizer's displacement since the last
sync, `slow - fast`, is taken as a pseudo-gradient for Nesterov SGD on a slow copy of the
params kept in the optimizer state; the params jump to the new slow weights. In between,
the inner optimizer runs alone.

With `replica_axis`, Snoo is one worker of DiLoCo: the pseudo-gradient is averaged over the
replicas on sync steps only, so inner steps exchange nothing across replicas. `diloco`
runs it over a tree whose leaves carry a leading replica axis.

References:
  Kallusky et al, `SNOO: Step-K Nesterov Outer Optimizer
  <https://arxiv.org/abs/2510.15830>`_, 2025.
  Kallusky et al, `modded-nanogpt GPT-2 Medium record
  <https://github.com/KellerJordan/modded-nanogpt/pull/128>`_, 2025.
  Douillard et al, `DiLoCo: Distributed Low-Communication Training of Language Models
  <https://arxiv.org/abs/2311.08105>`_, 2023.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import (
    check_float_dtype,
    check_int_at_least,
    check_non_negative,
    check_unit_interval,
    state_dtype,
    value_at,
)

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]

__all__ = ["SnooState", "diloco", "over_replicas", "skip_update", "snoo", "snoo_is_sync_step"]


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


_SYNC_PHASES = {"start": 0, "end": 1}


def _check_sync(sync: Any) -> int:
    if sync not in _SYNC_PHASES:
        raise ValueError(f"snoo: sync must be 'start' or 'end', got {sync!r}")
    return _SYNC_PHASES[sync]


def snoo_is_sync_step(step: int, k: int, sync: str = "start") -> bool:
    """Whether update number `step` (counting from 0) is a Snoo sync step.

    ``sync="start"``: updates 0, k, 2k, ...; ``sync="end"``: updates k-1, 2k-1, ... (after
    every k-th update, as MuLoCo).
    """
    return (step + _check_sync(sync)) % k == 0


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


def _check_replica_axis(replica_axis: Any) -> None:
    ok = replica_axis is None or (isinstance(replica_axis, str) and replica_axis) or (
        isinstance(replica_axis, tuple) and replica_axis
        and all(isinstance(a, str) and a for a in replica_axis))
    if not ok:
        raise ValueError(f"snoo: replica_axis must be None, an axis name (str) or a tuple of "
                         f"axis names, got {replica_axis!r}")


def _check_axis_bound(replica_axis: str | tuple[str, ...]) -> None:
    """Raise at trace time when `replica_axis` names no axis of the surrounding map."""
    for name in (replica_axis,) if isinstance(replica_axis, str) else replica_axis:
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"snoo: replica_axis={name!r} is not an axis of the surrounding map; call "
                f"update inside jax.vmap(..., axis_name={name!r}) (optax_snoo.diloco does), "
                f"jax.shard_map over a mesh with that axis, or jax.pmap") from None


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
    slow_dtype: Any = None,
    replica_axis: str | tuple[str, ...] | None = None,
    sync: str = "start",
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` in Snoo, the Step-K Nesterov Outer Optimizer.

    Each update first runs `inner` (`u`; fast weights `f = p + u`). On sync steps
    (`count % k == 0`, so the very first update syncs; with `sync="end"`,
    `(count + 1) % k == 0`: after every k-th update) the pseudo-gradient `d = slow - f`
    drives PyTorch-style Nesterov SGD on the slow weights:
    `b = μ b + d; slow = slow - η (d + μ b)`, and the returned update moves the params to
    `slow`. Otherwise the update is `u`. The inner state is never reset. The params stay an
    ordinary pytree (the slow copy lives in the state, unlike `optax.lookahead`).

    With `sync="end"`, `learning_rate=0.7, momentum=0.5, k=30` this is MuLoCo's outer
    Nesterov (modded-nanogpt Track 3 record #13, `NesterovOuterOptimizer`:
    `u = μu + ηΔ; W = snapshot - μu - ηΔ`, the same rule with `u = η·b` for a constant η),
    except that the slow weights and the buffer are float32 here for bf16 params
    (`slow_dtype`), in the param dtype there.

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
      slow_dtype: dtype of the slow weights and outer momentum; `None`: float32 (even
        for bf16 params), or the param's dtype where wider (float64 for float64 params).
        Any dtype-like; pass a string (`"float32"`) rather than `jnp.float32` under
        `optax.inject_hyperparams`, which takes callables for schedules.
      replica_axis: None (one worker), or the name of a mapped axis over DiLoCo replicas
        (`jax.vmap(..., axis_name=)`, `jax.shard_map`, `jax.pmap`): on sync steps only,
        `d` is replaced by its mean over that axis (`jax.lax.pmean`, one all-reduce of
        each device's share of the params), so every replica takes the same outer step
        and starts again from the same slow weights. Under `jax.vmap`, keep `count`
        unmapped (as `diloco` does): a mapped count turns the sync conditional into a
        select that would run the all-reduce on every step.
      sync: `"start"` (sync at updates 0, k, 2k, ...: the Snoo record) or `"end"` (after
        updates k, 2k, ...: updates k-1, 2k-1, ... counting from 0, as MuLoCo; a run of
        a multiple of k updates then ends on a sync).

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
      Kallusky et al, `SNOO: Step-K Nesterov Outer Optimizer
      <https://arxiv.org/abs/2510.15830>`_, 2025.
      Kallusky et al, `modded-nanogpt GPT-2 Medium record
      <https://github.com/KellerJordan/modded-nanogpt/pull/128>`_, 2025.
      Jordan et al., `modded-nanogpt Track 3 record #13 (MuLoCo-NorMuonH)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    _validate(inner, learning_rate, momentum, k)
    _check_replica_axis(replica_axis)
    phase = _check_sync(sync)
    check_float_dtype("snoo: slow_dtype", slow_dtype, allow_none=True)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # A real copy: on float32 params `astype` would alias the params, and a train step
        # donating params and state would then donate one buffer twice.
        slow = jax.tree.map(
            lambda p: jnp.array(p, dtype=state_dtype(slow_dtype, p), copy=True), params)
        return SnooState(
            count=jnp.zeros([], jnp.int32),
            slow=slow,
            momentum=jax.tree.map(lambda s: jnp.zeros_like(s), slow),
            inner_state=inner.init(params),
        )

    def outer_step(slow, buf, params, inner_updates, eta, mu):
        """Nesterov SGD on the slow weights with pseudo-gradient slow - (params + u)."""

        def leaf(s, b, p, u):
            d = s - (p.astype(s.dtype) + u.astype(s.dtype))
            return nesterov(s, b, d)

        def nesterov(s, b, d):  # in the slow weights' own dtype (the state keeps it)
            b = (mu * b + d).astype(s.dtype)
            return (s - eta * (d + mu * b)).astype(s.dtype), b

        if replica_axis is None:
            out = jax.tree.map(leaf, slow, buf, params, inner_updates)
        else:
            # DiLoCo: the replicas' mean pseudo-gradient, one all-reduce of the whole tree.
            d = jax.tree.map(lambda s, p, u: s - (p.astype(s.dtype) + u.astype(s.dtype)),
                             slow, params, inner_updates)
            out = jax.tree.map(nesterov, slow, buf, jax.lax.pmean(d, replica_axis))
        is_pair = lambda x: type(x) is tuple
        return tuple(jax.tree.map(lambda o, i=i: o[i], out, is_leaf=is_pair) for i in range(2))

    def jump(slow, params, inner_updates):
        """The update that moves the params to the slow weights."""
        return jax.tree.map(lambda s, p, u: (s - p.astype(s.dtype)).astype(u.dtype),
                            slow, params, inner_updates)

    def update_fn(updates, state, params=None, *, snoo_sync: bool | None = None, **extra_args):
        if params is None:
            raise ValueError("snoo: update needs params (the fast weights) to form slow - fast")
        if snoo_sync is not None and not isinstance(snoo_sync, bool):
            raise ValueError(
                f"snoo: snoo_sync must be a static Python bool or None, got {snoo_sync!r}")
        if replica_axis is not None:
            _check_axis_bound(replica_axis)
        # The number of syncs before this one (the schedules' argument; read on sync steps).
        outer_count = jnp.maximum((state.count + phase) // k - phase, 0)
        eta, mu = value_at(learning_rate, outer_count), value_at(momentum, outer_count)
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
        is_sync = (state.count + phase) % k == 0

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


def _is_count(x: Any) -> bool:
    return jnp.ndim(x) == 0 and jnp.issubdtype(jnp.result_type(x), jnp.integer)


def _replica_axes(state: Any) -> Any:
    """vmap axes of a state over replicas: the integer scalars (step counts, Snoo's
    included) once for all replicas, every other leaf on axis 0."""
    return jax.tree.map(lambda x: None if _is_count(x) else 0, state)


def _num_replicas(tree: Any, what: str) -> int:
    leaves = jax.tree.leaves(tree)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(f"over_replicas: every leaf of {what} must have the same leading replica "
                         f"axis (M, ...); got shapes {shapes}")
    return sizes.pop()


def over_replicas(tx: optax.GradientTransformation, axis_name: str = "diloco", *,
                  spmd_axis_name: str | None = None) -> optax.GradientTransformationExtraArgs:
    """Run `tx` on every replica of replica-stacked trees, under `jax.vmap(axis_name=)`.

    Params, updates and state leaves carry a leading replica axis `(M, ...)`, except the
    state's integer scalars (step counts), kept once for all replicas: every replica takes
    the same steps, and a Snoo sync stays a conditional (a mapped count would make it a
    select that runs the replicas' all-reduce on every step). A Snoo inside `tx` with
    `replica_axis=axis_name` makes this DiLoCo (`diloco`); elsewhere in `tx` replicas
    exchange nothing. `update` takes Snoo's static `snoo_sync`; other extra arguments are
    mapped over their leading axis.

    Args:
      tx: the per-replica transformation, e.g. `optax.chain(clip, snoo(...,
        replica_axis="diloco"))`.
      axis_name: the replica axis's name inside the map.
      spmd_axis_name: the mesh axis the replica axis is sharded over, if any: sharding
        constraints inside `tx` then keep the replicas on it (`jax.vmap`'s argument).

    Returns:
      An `optax.GradientTransformationExtraArgs` over replica-stacked trees.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> tx = optax_snoo.over_replicas(optax.adam(0.1))
      >>> state = tx.init({"w": jnp.zeros((4, 3))})  # 4 replicas of a 3-vector
      >>> state[0].count.shape, state[0].mu["w"].shape
      ((), (4, 3))

    References:
      Douillard et al, `DiLoCo: Distributed Low-Communication Training of Language Models
      <https://arxiv.org/abs/2311.08105>`_, 2023.
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"over_replicas: axis_name must be a non-empty str, got {axis_name!r}")
    tx = optax.with_extra_args_support(tx)

    def init_fn(params):
        _num_replicas(params, "params")
        one = jax.eval_shape(tx.init, jax.tree.map(lambda x: x[0], params))
        return jax.vmap(tx.init, out_axes=_replica_axes(one), axis_name=axis_name,
                        spmd_axis_name=spmd_axis_name)(params)

    def update_fn(updates, state, params=None, *, snoo_sync: bool | None = None,
                  **extra_args):
        if params is None:
            raise ValueError("over_replicas: update needs params (each replica's fast weights)")
        m = _num_replicas(params, "params")
        if _num_replicas(updates, "updates") != m:
            raise ValueError(f"over_replicas: updates have {_num_replicas(updates, 'updates')} "
                             f"replicas, params {m}")
        axes = _replica_axes(state)

        hint = {} if snoo_sync is None else {"snoo_sync": snoo_sync}

        def one(u, s, p, extra):
            return tx.update(u, s, p, **hint, **extra)

        try:
            return jax.vmap(one, in_axes=(0, axes, 0, 0), out_axes=(0, axes),
                            axis_name=axis_name, spmd_axis_name=spmd_axis_name)(
                updates, state, params, extra_args)
        except ValueError as e:
            if "out_axes" not in str(e):
                raise
            raise ValueError(
                "over_replicas: an integer scalar of the state (a step count) depends on "
                "each replica's data (optax.apply_if_finite's do); every replica must take "
                "the same steps (skip one with optax_snoo.skip_update on all replicas)") from e

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def diloco(
    inner: optax.GradientTransformation,
    learning_rate: ScalarOrSchedule = 0.68,
    momentum: ScalarOrSchedule = 0.37,
    k: int = 28,
    *,
    slow_dtype: Any = None,
    axis_name: str = "diloco",
    sync: str = "start",
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo: M replicas of `snoo(inner)` that average their pseudo-gradients on sync steps.

    Params, gradients and updates carry a leading replica axis `(M, ...)`: replica `r`
    trains `params[r]` on its own data with its own inner state, and exchanges nothing with
    the others until a sync step (`count % k == 0`), where the pseudo-gradients
    `slow - fast` are averaged over the replicas (`snoo(..., replica_axis=axis_name)`
    under `jax.vmap(..., axis_name=axis_name)`) and the one outer Nesterov step moves every
    replica to the same new slow weights. Under `jax.jit`, shard the leading axis over a
    mesh axis (`P("diloco", ...)`): inner steps then compile to no collective across that
    axis and a sync step to one all-reduce of each device's share of the params. With
    M = 1 this is `snoo(inner, ...)` on `params[0]`, bit for bit. (Streaming DiLoCo's
    fragments synchronised at staggered steps are not implemented.)

    The state's leaves carry the replica axis too (the slow weights and outer momentum,
    equal on every replica, included), except its integer scalars (step counts: Snoo's
    and the inner optimizer's), kept once for all replicas: so the sync stays a
    conditional that runs the all-reduce once per `k` steps (a mapped count would make it a
    select, running it every step), and M = 1 is `snoo` bit for bit.
    `update` takes Snoo's static `snoo_sync` hint; other extra arguments are mapped over
    their leading axis.

    Args:
      inner: each replica's inner optimizer (its state is per replica).
      learning_rate: outer step size η (float or schedule of the outer-step count).
      momentum: outer Nesterov momentum μ in [0, 1) (float or schedule).
      k: sync period H (integer >= 1).
      slow_dtype: dtype of the slow weights and outer momentum (`None`: as `snoo`'s).
      axis_name: the name of the replica axis inside the map.
      sync: `"start"` or `"end"`: when the syncs fall, as in `snoo`.

    Returns:
      An `optax.GradientTransformationExtraArgs` over replica-stacked trees. `update`
      needs `params`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.ones((2, 3))}  # two replicas of a 3-vector
      >>> tx = optax_snoo.diloco(optax.sgd(0.1), k=4)
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([[1.0, 1, 1], [3, 3, 3]])}  # each replica its own data
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)  # t = 0 syncs: equal replicas
      >>> bool(jnp.all(params["w"][0] == params["w"][1])), int(state.count)
      (True, 1)

    References:
      Douillard et al, `DiLoCo: Distributed Low-Communication Training of Language Models
      <https://arxiv.org/abs/2311.08105>`_, 2023.
      Kallusky et al, `SNOO: Step-K Nesterov Outer Optimizer
      <https://arxiv.org/abs/2510.15830>`_, 2025.
      Douillard et al, `Streaming DiLoCo with overlapping communication
      <https://arxiv.org/abs/2501.18512>`_, 2025.
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"diloco: axis_name must be a non-empty str, got {axis_name!r}")
    return over_replicas(snoo(inner, learning_rate, momentum, k, slow_dtype=slow_dtype,
                              replica_axis=axis_name, sync=sync), axis_name)
