"""When to recompute the K-FAC inverses: refresh policies on the learning-rate curve.

The factor EMAs update every step; the eigendecompositions are recomputed only
on refresh steps, and where those fall on the learning-rate curve matters as much as how
often. A policy is a pure function evaluated inside ``jit`` on every update::

    policy(step, lr, last_step, last_lr) -> bool scalar

``step`` is the update count (from 0), ``lr`` the learning rate of this update,
``last_step``/``last_lr`` those of the latest refresh (``last_step = -1`` before the
first). `policy_step` advances that carry and is shared by `scale_by_kfac` and by the
host helper `refresh_steps`, so a plan printed from `refresh_steps` is exactly where the
transform refreshes (given statistics from the first update on).

Policies: `every` (fixed interval with a chosen first step), `by_lr_phase` (interval per
phase of the schedule: warmup, peak, decay, tail) and `lr_ratio` (refresh when the
learning rate moved by more than a fraction since the last refresh). Any callable with
the signature above works too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.utils import check_int_at_least, is_integer, is_real, value_at

RefreshPolicy = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
#: The phases of the learning-rate schedule that `by_lr_phase` tells apart, in order:
#: ``("warmup", "peak", "decay", "tail")``.
PHASES = ("warmup", "peak", "decay", "tail")
DEFAULT_PHASE_INTERVALS: dict[str, int | str | None] = {
    "warmup": None, "peak": 150, "decay": 300, "tail": 600}


def _check_int(name: str, value: Any, minimum: int) -> int:
    check_int_at_least(name, value, minimum)
    return int(value)


def _check_fraction(name: str, value: Any, low: float, high: float) -> float:
    if not is_real(value) or not low < value < high:
        raise ValueError(f"{name} must be a float in ({low}, {high}), got {value!r}.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Every:
    """Refresh at ``first, first + interval, first + 2·interval, …`` (see `every`)."""

    interval: int
    first: int
    needs_lr = False

    def __call__(self, step, lr, last_step, last_lr):
        del lr, last_step, last_lr
        return (step >= self.first) & ((step - self.first) % self.interval == 0)


def every(interval: int, first: int | None = None) -> Every:
    """Fixed-interval refresh policy.

    Refreshes at steps ``first + k·interval`` for k = 0, 1, …; nothing before ``first``.
    ``first = interval`` (the default) is the common "first refresh after one interval";
    ``first = warmup_steps`` puts the first refresh at the end of the warm-up;
    ``first = 0`` refreshes at the very first update (pair it with `warm_start`, or the
    first inverse comes from one batch).

    Args:
      interval: steps between refreshes, >= 1.
      first: step of the first refresh, >= 0 (default: ``interval``).

    Returns:
      An `Every` policy.

    Raises:
      ValueError: a non-integer or out-of-range argument.

    Example:
      >>> from optax_snoo.kfac import every, refresh_steps
      >>> refresh_steps(every(100, first=2000), None, 20_000).size
      180

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015
    """
    interval = _check_int("interval", interval, 1)
    first = interval if first is None else _check_int("first", first, 0)
    return Every(interval=interval, first=first)


@dataclasses.dataclass(frozen=True)
class ByLrPhase:
    """Interval per phase of the learning-rate schedule (see `by_lr_phase`)."""

    peak_lr: float
    warmup_steps: int
    intervals: tuple[int | str | None, ...]   # in PHASES order
    peak_tol: float
    tail_fraction: float
    needs_lr = True

    def phase(self, step: jax.Array, lr: jax.Array) -> jax.Array:
        """Phase index into `PHASES` (0 warmup, 1 peak, 2 decay, 3 tail) of (step, lr)."""
        lr = jnp.asarray(lr, jnp.float32)
        return jnp.where(
            step < self.warmup_steps, 0,
            jnp.where(lr <= self.tail_fraction * self.peak_lr, 3,
                      jnp.where(lr >= (1.0 - self.peak_tol) * self.peak_lr, 1, 2)))

    def __call__(self, step, lr, last_step, last_lr):
        del last_lr
        phase = self.phase(step, lr)
        never_refreshed = last_step < 0
        decisions = []
        for interval in self.intervals:
            if interval is None:
                decisions.append(jnp.zeros((), bool))
            elif interval == "once":
                decisions.append(never_refreshed)
            else:
                decisions.append(never_refreshed | (step - last_step >= interval))
        return jnp.select([phase == i for i in range(len(PHASES))], decisions, False)


def by_lr_phase(
    peak_lr: float,
    *,
    warmup_steps: int = 0,
    intervals: Mapping[str, int | str | None] | None = None,
    peak_tol: float = 0.05,
    tail_fraction: float = 0.1,
) -> ByLrPhase:
    """Segmented policy: a refresh interval per phase of the LR schedule.

    The phase of an update is decided from its step and learning rate, in this order:

    - ``"warmup"``: ``step < warmup_steps``;
    - ``"tail"``: ``lr <= tail_fraction · peak_lr`` (the low-LR end);
    - ``"peak"``: ``lr >= (1 - peak_tol) · peak_lr`` (at or near the peak, e.g. the
      stable part of a warmup-stable-decay schedule, or the top of a cosine);
    - ``"decay"``: everything else.

    In a phase with interval ``n`` the policy refreshes when nothing was refreshed yet or
    when ``step - last_step >= n`` (so entering the peak phase after a refresh-free
    warm-up refreshes at once). ``None`` never refreshes in that phase; ``"once"``
    refreshes only if nothing was refreshed before (e.g. for the warm-up).

    Args:
      peak_lr: the schedule's peak learning rate (> 0).
      warmup_steps: length of the warm-up (>= 0).
      intervals: per-phase intervals (keys among ``"warmup"``, ``"peak"``, ``"decay"``,
        ``"tail"``; values an int >= 1, ``"once"`` or ``None``); missing keys take the
        defaults ``{"warmup": None, "peak": 150, "decay": 300, "tail": 600}``.
      peak_tol: relative band below ``peak_lr`` that still counts as peak, in (0, 1).
      tail_fraction: LR fraction of the peak below which the tail starts, in
        (0, 1 - peak_tol).

    Returns:
      A `ByLrPhase` policy (its ``phase(step, lr)`` method labels steps for plots).

    Raises:
      ValueError: unknown phase names, bad intervals or fractions.

    Example:
      >>> import optax
      >>> from optax_snoo.kfac import by_lr_phase, refresh_steps
      >>> sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 200, 2000)
      >>> policy = by_lr_phase(1e-3, warmup_steps=200, intervals={"peak": 50})
      >>> refresh_steps(policy, sched, 2000)[:3].tolist()
      [200, 250, 300]

    References:
      Pauloski et al., `KAISA: An Adaptive Second-Order Optimizer Framework for Deep
      Neural Networks <https://arxiv.org/abs/2107.01739>`_, 2021 (K-FAC update intervals
      that grow when the learning rate decays)
    """
    if not is_real(peak_lr) or not peak_lr > 0:
        raise ValueError(f"peak_lr must be a float > 0, got {peak_lr!r}.")
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    peak_tol = _check_fraction("peak_tol", peak_tol, 0.0, 1.0)
    tail_fraction = _check_fraction("tail_fraction", tail_fraction, 0.0, 1.0 - peak_tol)
    merged = dict(DEFAULT_PHASE_INTERVALS)
    for name, value in (intervals or {}).items():
        if name not in PHASES:
            raise ValueError(f"Unknown phase {name!r} in intervals; expected keys among "
                             f"{PHASES}.")
        if not (value is None or value == "once" or (is_integer(value) and value >= 1)):
            raise ValueError(f"intervals[{name!r}] must be an int >= 1, 'once' or None, "
                             f"got {value!r}.")
        merged[name] = value
    return ByLrPhase(peak_lr=float(peak_lr), warmup_steps=warmup_steps,
                     intervals=tuple(merged[p] for p in PHASES), peak_tol=peak_tol,
                     tail_fraction=tail_fraction)


@dataclasses.dataclass(frozen=True)
class LrRatio:
    """Refresh when the learning rate moved enough (see `lr_ratio`)."""

    threshold: float
    max_interval: int | None
    min_interval: int
    warmup_steps: int
    needs_lr = True

    def __call__(self, step, lr, last_step, last_lr):
        lr = jnp.asarray(lr, jnp.float32)
        last_lr = jnp.asarray(last_lr, jnp.float32)
        since = step - last_step
        moved = jnp.abs(lr - last_lr) > self.threshold * jnp.abs(last_lr)
        if self.max_interval is not None:
            moved = moved | (since >= self.max_interval)
        due = (last_step < 0) | ((since >= self.min_interval) & moved)
        return (step >= self.warmup_steps) & due


def lr_ratio(
    threshold: float = 0.15,
    *,
    max_interval: int | None = None,
    min_interval: int = 1,
    warmup_steps: int = 0,
) -> LrRatio:
    """LR-ratio trigger.

    Refreshes when ``|lr / lr_at_last_refresh - 1| > threshold`` (computed as
    ``|lr - last_lr| > threshold · |last_lr|``, so a refresh at ``lr = 0`` triggers at the
    next nonzero lr) or when ``step - last_step >= max_interval``, but never sooner than
    ``min_interval`` after the previous refresh, and never before ``warmup_steps`` (0: no
    warm-up skip). The first allowed step refreshes when nothing was refreshed yet.

    Args:
      threshold: relative LR change τ that triggers a refresh (> 0; 0.1-0.2 typical).
      max_interval: refresh at least this often (>= 1), or None for no bound.
      min_interval: at least this many steps between refreshes (>= 1).
      warmup_steps: no refresh before this step (>= 0).

    Returns:
      An `LrRatio` policy.

    Raises:
      ValueError: out-of-range arguments (including ``max_interval < min_interval``).

    Example:
      >>> import optax
      >>> from optax_snoo.kfac import lr_ratio, refresh_steps
      >>> sched = optax.linear_schedule(1.0, 0.1, 1000)
      >>> refresh_steps(lr_ratio(0.5), sched, 1000)[:3].tolist()
      [0, 556, 834]

    References:
      Osawa et al., `Large-Scale Distributed Second-Order Optimization Using
      Kronecker-Factored Approximate Curvature for Deep Convolutional Neural Networks
      <https://arxiv.org/abs/1811.12019>`_, 2019 (refresh when the statistics change)
    """
    if not is_real(threshold) or not threshold > 0:
        raise ValueError(f"threshold must be a float > 0, got {threshold!r}.")
    min_interval = _check_int("min_interval", min_interval, 1)
    if max_interval is not None:
        max_interval = _check_int("max_interval", max_interval, 1)
        if max_interval < min_interval:
            raise ValueError(f"max_interval ({max_interval}) must be >= min_interval "
                             f"({min_interval}).")
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    return LrRatio(threshold=float(threshold), max_interval=max_interval,
                   min_interval=min_interval, warmup_steps=warmup_steps)


def needs_learning_rate(policy: RefreshPolicy) -> bool:
    """Whether ``policy`` reads the learning rate (True for unknown callables)."""
    return bool(getattr(policy, "needs_lr", True))


def policy_step(
    policy: RefreshPolicy,
    step: jax.Array,
    lr: jax.Array,
    last_step: jax.Array,
    last_lr: jax.Array,
    *,
    allowed: jax.Array | bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Evaluate ``policy`` at one update and advance the (last_step, last_lr) carry.

    Args:
      policy: a refresh policy.
      step: int32 update count.
      lr: float32 learning rate of this update.
      last_step: step of the latest refresh, -1 if none.
      last_lr: learning rate at the latest refresh.
      allowed: extra gate (`scale_by_kfac` passes "some statistics were accumulated").

    Returns:
      ``(refresh, last_step, last_lr)``: a bool scalar and the updated carry.
    """
    step = jnp.asarray(step, jnp.int32)
    lr = jnp.asarray(lr, jnp.float32)
    refresh = jnp.asarray(policy(step, lr, last_step, last_lr), bool) & allowed
    return (refresh, jnp.where(refresh, step, last_step).astype(jnp.int32),
            jnp.where(refresh, lr, last_lr).astype(jnp.float32))


def learning_rate_at(learning_rate: optax.ScalarOrSchedule | None,
                     step: jax.Array) -> jax.Array:
    """``learning_rate(step)`` for a schedule, the value for a constant, 0 for None."""
    return jnp.asarray(0.0 if learning_rate is None else value_at(learning_rate, step),
                       jnp.float32)


def refresh_steps(
    policy: RefreshPolicy,
    learning_rate: optax.ScalarOrSchedule | None,
    total_steps: int,
) -> np.ndarray:
    """List the steps where ``policy`` refreshes over ``total_steps`` updates (host helper).

    Runs the same `policy_step` as `scale_by_kfac` in a ``lax.scan`` over steps
    ``0 … total_steps-1`` with ``lr = learning_rate(step)``: use it for plans, plots and
    tests.

    Args:
      policy: a refresh policy.
      learning_rate: the LR schedule (or a constant); may be None if the policy does not
        read the learning rate.
      total_steps: number of updates (>= 0).

    Returns:
      Sorted int64 numpy array of refresh steps.

    Raises:
      ValueError: ``total_steps`` negative, or an LR-reading policy without a schedule.

    Example:
      >>> from optax_snoo.kfac import every, refresh_steps
      >>> refresh_steps(every(3, first=0), None, 10).tolist()
      [0, 3, 6, 9]
    """
    total_steps = _check_int("total_steps", total_steps, 0)
    if learning_rate is None and needs_learning_rate(policy):
        raise ValueError(f"{policy!r} reads the learning rate: pass the LR schedule.")

    def body(carry, step):
        last_step, last_lr = carry
        lr = learning_rate_at(learning_rate, step)
        refresh, last_step, last_lr = policy_step(policy, step, lr, last_step, last_lr)
        return (last_step, last_lr), refresh

    init = (jnp.array(-1, jnp.int32), jnp.array(0.0, jnp.float32))
    _, flags = jax.jit(lambda steps: jax.lax.scan(body, init, steps))(
        jnp.arange(total_steps, dtype=jnp.int32))
    return np.flatnonzero(np.asarray(flags))
