"""Schedules of modded-nanogpt's Track 3 records: PowerCool and Muon's momentum.

`power_cool` is the learning rate of record #20 onwards, ``min(lr0, c·(t_end - t)^p)``;
`muon_momentum_schedule` is Muon's momentum warm-up and cool-down of records #30 and
#44 onwards. Both are callables of the update count, as optax schedules are.

References:
  Jordan et al., `modded-nanogpt Track 3 (optimization) records #20, #30, #44, #46
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import check_int_at_least, check_positive, check_unit_interval

__all__ = ["muon_momentum_schedule", "power_cool"]


def power_cool(
    lr0: float,
    *,
    t_end: int,
    c: float | None = None,
    flat_until: float | None = None,
    power: float = 1.2,
) -> optax.Schedule:
    r"""PowerCool: flat at ``lr0``, then a power law that reaches 0 at ``t_end``.

    ``lr(t) = min(lr0, c·max(0, t_end - t)^power)``, exactly the ``_lr`` of modded-nanogpt
    Track 3 record #20 (PowerCool, from PR #287) and every record after it that uses it
    (``t`` is the update count: the record calls it with the 0-based step index). The
    flat part ends at ``flat_until = t_end - (lr0/c)^(1/power)``; give either ``c`` (the
    record's constants) or ``flat_until``. After the flat part the schedule is
    ``optax.polynomial_schedule(lr0, 0.0, power, transition_steps=t_end - flat_until,
    transition_begin=flat_until)``; it is computed as the record writes it, because
    ``polynomial_schedule`` forms ``1 - (t - begin)/steps``, which loses float32 digits
    as ``t`` nears ``t_end``, can be NaN from ``t_end`` on under ``jit`` with a
    non-integer power (XLA divides by multiplying by ``1/steps``, leaving the base a
    rounding below 0), and clips a negative ``transition_begin`` to 0.

    Record values (``power=1.2``): Muon ``lr0=0.0375, c=3.3170e-6``; Adam embedding
    ``0.3, 4.9768e-5``; head ``1/320, 5.1842e-7``; other 1-D ``0.01, 1.6589e-6``;
    ``t_end`` 3105 (#20), 2900 (#44, #46).

    Args:
      lr0: the flat learning rate (> 0).
      t_end: the update count where the learning rate reaches 0 (>= 1).
      c: the power law's constant (> 0); not with ``flat_until``.
      flat_until: the update count where the flat part ends, in ``[0, t_end)``; not
        with ``c``.
      power: the power law's exponent (> 0).

    Returns:
      A schedule: ``count -> learning rate`` (float32; float64 under ``jax_enable_x64``).

    Raises:
      ValueError: neither or both of ``c`` and ``flat_until``, or a value out of range.

    Example:
      >>> from optax_snoo import power_cool
      >>> lr = power_cool(0.0375, c=3.3169534699576625e-06, t_end=2900)
      >>> round(float(lr(0)), 4), round(float(lr(2690)), 5), float(lr(2900))
      (0.0375, 0.00203, 0.0)

    References:
      Jordan et al., `modded-nanogpt Track 3 record #20 (PowerCool, PR #287)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_positive("lr0", lr0)
    check_int_at_least("t_end", t_end, 1)
    check_positive("power", power)
    if (c is None) == (flat_until is None):
        raise ValueError(f"power_cool: give exactly one of c and flat_until, got c={c!r}, "
                         f"flat_until={flat_until!r}.")
    if c is None:
        if not 0 <= flat_until < t_end:
            raise ValueError(f"power_cool: flat_until must be in [0, t_end={t_end}), got "
                             f"{flat_until!r}.")
        c = lr0 / (t_end - flat_until) ** power
    check_positive("c", c)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        # float64 under x64: a float64 run's learning rate is not rounded to float32
        remaining = jnp.maximum(t_end - jnp.asarray(count, jnp.result_type(float)), 0.0)
        return jnp.minimum(lr0, c * remaining**power)

    return schedule


def muon_momentum_schedule(
    start: float = 0.85,
    peak: float = 0.95,
    *,
    warmup: int = 300,
    cooldown: int = 0,
    total: int | None = None,
    end: float | None = None,
) -> optax.Schedule:
    r"""Muon's momentum: linear warm-up ``start -> peak``, then a linear cool-down.

    With ``W = warmup``, ``C = cooldown`` and ``T = total``::

        μ(t) = start + (peak - start)·t/W          t < W
        μ(t) = peak                                W <= t <= T - C
        μ(t) = peak - (peak - end)·(t - (T-C))/C   T - C < t <= T
        μ(t) = end                                 t > T

    the ``_muon_mu_at_step`` of modded-nanogpt's Track 3 records (#30: ``C = 100``;
    #44, #46: ``C = 200``, ``T = 2900``; ``end`` is record #46's ``TAIL_MU_END``,
    ``start`` by default), held at ``end`` past ``T`` (the records never step there).
    Built from ``optax.linear_schedule`` pieces joined by ``optax.join_schedules``.
    ``cooldown=0`` (and no ``total``) is the warm-up alone, `muon_momentum_warmup`.

    Args:
      start: momentum at update 0, in [0, 1).
      peak: momentum after the warm-up, in [0, 1).
      warmup: warm-up length ``W`` (>= 0).
      cooldown: cool-down length ``C`` (>= 0), at the end of ``total``.
      total: ``T``, the update count where the cool-down ends (>= ``warmup + cooldown``);
        needed when ``cooldown > 0``.
      end: momentum at ``T`` (default ``start``), in [0, 1).

    Returns:
      A schedule: ``count -> momentum``, to pass as Muon's ``beta`` (float32; float64
      under ``jax_enable_x64``).

    Raises:
      ValueError: a momentum outside [0, 1), a negative length, a cool-down without
        ``total``, or ``total < warmup + cooldown``.

    Example:
      >>> from optax_snoo import muon_momentum_schedule
      >>> mu = muon_momentum_schedule(0.85, 0.95, warmup=300, cooldown=200, total=2900)
      >>> [round(float(mu(t)), 4) for t in (0, 150, 300, 2700, 2800, 2900)]
      [0.85, 0.9, 0.95, 0.95, 0.9, 0.85]

    References:
      Jordan et al., `modded-nanogpt Track 3 records #30 and #44 (_muon_mu_at_step)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    end = start if end is None else end
    for name, value in (("start", start), ("peak", peak), ("end", end)):
        check_unit_interval(name, value)
    check_int_at_least("warmup", warmup, 0)
    check_int_at_least("cooldown", cooldown, 0)
    if cooldown > 0 and total is None:
        raise ValueError(f"muon_momentum_schedule: cooldown={cooldown} needs total (the "
                         "update count where the cool-down ends).")
    if total is not None:
        check_int_at_least("total", total, warmup + cooldown)
    pieces: list[optax.Schedule] = []
    boundaries: list[int] = []
    if warmup > 0:
        pieces.append(optax.linear_schedule(start, peak, warmup))
        boundaries.append(warmup)
    pieces.append(optax.constant_schedule(peak))
    if cooldown > 0:
        pieces.append(optax.linear_schedule(peak, end, cooldown))
        boundaries.append(total - cooldown)
    joined = optax.join_schedules(pieces, boundaries) if boundaries else pieces[0]

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        # optax divides the integer count in its inexact dtype: an int32 count gives
        # float32 even under x64, so the count is widened to int64 there (float64 values)
        count = jnp.asarray(count)
        if jnp.issubdtype(count.dtype, jnp.integer):
            count = count.astype(jnp.result_type(int))
        return joined(count)

    return schedule
