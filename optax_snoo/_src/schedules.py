"""The library's schedules, each a callable of the update count as optax's are.

- `nanogpt_cosine_schedule`: nanoGPT's ``get_lr`` (linear warm-up, cosine to a floor);
- `stable_cooldown_schedule`: modded-nanogpt's records' flat-then-linear learning rate;
- `power_cool`: Track 3's PowerCool (record #20 onwards), ``min(lr0, c·(t_end - t)^p)``,
  and `power_cool_scaled`, a record's PowerCool stretched to another run length;
- `muon_momentum_schedule`: Muon's momentum warm-up and cool-down (records #30, #44 on),
  and `muon_momentum_warmup`, the warm-up alone (the GPT-2 Medium record's);
- `trust_gate_floor`, `trust_gate_cap`: the bounds of SOAP-Muon's trust gate (#16, #44, #46).

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

__all__ = ["logistic_schedule", "muon_momentum_schedule", "muon_momentum_warmup",
           "nanogpt_cosine_schedule", "power_cool", "power_cool_scaled",
           "stable_cooldown_schedule", "trust_gate_cap", "trust_gate_floor"]


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
    return wide_count(joined)


def wide_count(schedule: optax.Schedule) -> optax.Schedule:
    """``schedule`` called with an integer count widened to Python's int dtype (int64
    under x64): optax's schedules divide the count in its own inexact dtype, so an int32
    count (optax's and our states') gives float32 values even under x64."""

    def widened(count: jax.typing.ArrayLike) -> jax.Array:
        count = jnp.asarray(count)
        if jnp.issubdtype(count.dtype, jnp.integer):
            count = count.astype(jnp.result_type(int))
        return schedule(count)

    return widened


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
      >>> from optax_snoo import muon_momentum_warmup
      >>> beta = muon_momentum_warmup()
      >>> round(float(beta(150)), 4)
      0.9

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


def stable_cooldown_schedule(peak_value: float, total_steps: int, cooldown_frac: float = 0.7,
                             final_lr_scale: float = 0.0, *, warmup_steps: int = 0,
                             power: float = 1.0) -> optax.Schedule:
    """Constant, then a linear (or power-law) cooldown over the last `cooldown_frac`.

    The multiplier at step `t` of `T` is 1 while `t/T < 1 - cooldown_frac`, then
    `(1 - t/T) / cooldown_frac * (1 - final_lr_scale) + final_lr_scale`; with a warm-up,
    times `min(1, (t + 1) / warmup_steps)` (Track 3 #2's `set_hparams`). With
    `power != 1` the cooldown is `f + (1 - f)·max(0, (1 - t/T)/cooldown_frac)^power`
    (`f = final_lr_scale`; Track 3 #27's `_eta`: 1.25 over 3200 steps of a 3125-step run;
    #25's: 1.5 with floors 0.017 and 0.04), which stays at `f` after `T`.

    Args:
      peak_value: the learning rate before the cooldown.
      total_steps: `T`, the number of training steps (>= 1).
      cooldown_frac: fraction of `T` spent cooling down, in (0, 1].
      final_lr_scale: multiplier reached at `t = T` (record: 0 in PR #128, 0.01 later).
      warmup_steps: length of a linear warm-up from `peak/warmup_steps` (0: none).
      power: the cooldown's exponent (> 0; 1: linear).

    Returns:
      A schedule `step -> learning rate`.

    Example:
      >>> from optax_snoo import stable_cooldown_schedule
      >>> sched = stable_cooldown_schedule(0.03, 1000)
      >>> round(float(sched(0)), 6), float(sched(1000))
      (0.03, 0.0)

    References:
      Jordan et al, `modded-nanogpt <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
    """
    check_int_at_least("total_steps", total_steps, 1)
    check_int_at_least("warmup_steps", warmup_steps, 0)
    if not 0 < cooldown_frac <= 1:
        raise ValueError(f"cooldown_frac must be in (0, 1], got {cooldown_frac!r}")
    if not 0 <= final_lr_scale <= 1:
        raise ValueError(f"final_lr_scale must be in [0, 1], got {final_lr_scale!r}")
    check_positive("power", power)

    def schedule(count):
        t = jnp.asarray(count, jnp.result_type(float))  # float64 under x64
        x = t / total_steps
        if power == 1.0:
            cooling = (1 - x) / cooldown_frac * (1 - final_lr_scale) + final_lr_scale
        else:  # clamped: a fractional power of a negative base is NaN
            base = jnp.maximum((1 - x) / cooldown_frac, 0.0)
            cooling = final_lr_scale + (1 - final_lr_scale) * base ** power
        lr = peak_value * jnp.where(x < 1 - cooldown_frac, 1.0, cooling)
        return lr if warmup_steps == 0 else lr * jnp.minimum(1.0, (t + 1) / warmup_steps)

    return schedule


def logistic_schedule(init_value: float, end_value: float, total_steps: int, *,
                      midpoint_frac: float = 0.04, width_frac: float = 0.04) -> optax.Schedule:
    """A logistic step from ``init_value`` to ``end_value``, centred at a fraction of the run.

    ``v(t) = end + (init - end) / (1 + exp((t/T - midpoint_frac) / width_frac))``, ``t`` the
    update count and ``T`` ``total_steps``: DynMuon's spectral power ``p_t`` (modded-nanogpt
    Track 3 result #28's ``get_dynmuon_p``: 0.25 to -0.25 with midpoint and width 0.04, so
    ``v(0) = end + 0.731 (init - end)``, about 0.116 there).

    Args:
      init_value: the value long before the midpoint.
      end_value: the value long after it.
      total_steps: ``T`` (>= 1).
      midpoint_frac: where the value is half-way, as a fraction of ``T``.
      width_frac: the logistic's width as a fraction of ``T`` (> 0).

    Returns:
      A schedule ``step -> value``.

    Example:
      >>> from optax_snoo import logistic_schedule
      >>> p = logistic_schedule(0.25, -0.25, 3200)
      >>> round(float(p(0)), 4), round(float(p(128)), 4), round(float(p(3200)), 4)
      (0.1155, 0.0, -0.25)
    """
    check_int_at_least("total_steps", total_steps, 1)
    if not width_frac > 0:
        raise ValueError(f"width_frac must be > 0, got {width_frac!r}")

    def schedule(count):
        t = jnp.asarray(count, jnp.result_type(float))  # float64 under x64
        return end_value + (init_value - end_value) / (
            1 + jnp.exp((t / total_steps - midpoint_frac) / width_frac))

    return schedule


def nanogpt_cosine_schedule(peak_value: float, *, warmup_steps: int, decay_steps: int,
                            final_lr_scale: float = 0.1) -> optax.Schedule:
    """nanoGPT's learning rate: linear warm-up, cosine decay to a floor, then the floor.

    ``peak·(t+1)/(warmup+1)`` for ``t < warmup_steps``, then a half cosine from ``peak``
    at ``warmup_steps`` to ``peak·final_lr_scale`` at ``decay_steps``, then that floor
    (nanoGPT's ``get_lr`` with ``min_lr = peak·final_lr_scale``). With ``decay_steps <=
    warmup_steps`` it is the warm-up, then the floor, as nanoGPT's. optax's linear warm-up
    from ``peak/(w+1)`` equals nanoGPT's ``peak·(t+1)/(w+1)`` exactly.

    Args:
      peak_value: the learning rate after the warm-up (>= 0).
      warmup_steps: warm-up length (>= 0).
      decay_steps: the step where the cosine reaches the floor (>= 0).
      final_lr_scale: the floor as a fraction of ``peak_value``, in [0, 1].

    Returns:
      A schedule `step -> learning rate`.

    Example:
      >>> from optax_snoo import nanogpt_cosine_schedule
      >>> lr = nanogpt_cosine_schedule(1e-3, warmup_steps=100, decay_steps=2000)
      >>> [round(float(lr(t)), 6) for t in (0, 100, 2000, 5000)]
      [1e-05, 0.001, 0.0001, 0.0001]

    References:
      Karpathy, `nanoGPT (train.py, get_lr) <https://github.com/karpathy/nanoGPT>`_, 2023.
    """
    check_int_at_least("warmup_steps", warmup_steps, 0)
    check_int_at_least("decay_steps", decay_steps, 0)
    if not 0 <= final_lr_scale <= 1:
        raise ValueError(f"final_lr_scale must be in [0, 1], got {final_lr_scale!r}")
    end = peak_value * final_lr_scale
    start = peak_value / (warmup_steps + 1)
    if decay_steps <= warmup_steps:
        return optax.join_schedules([optax.linear_schedule(start, peak_value, warmup_steps),
                                     optax.constant_schedule(end)], [warmup_steps])
    return optax.warmup_cosine_decay_schedule(
        init_value=start, peak_value=peak_value, warmup_steps=warmup_steps,
        decay_steps=decay_steps, end_value=end)


def power_cool_scaled(lr0: float, *, c: float, lr0_record: float, record_steps: int,
                      total_steps: int, power: float = 1.2,
                      t_end: int | None = None) -> optax.Schedule:
    r"""A record's PowerCool (``c`` at ``lr0_record`` and ``t_end = record_steps``) for a
    run of ``total_steps`` at a flat rate ``lr0``, its flat part ending at the same
    fraction of the run.

    PowerCool's flat part ends at ``t_end - (lr0/c)^(1/power)``; with
    ``c_N = c·(lr0/lr0_record)·(record_steps/N)^power`` and ``t_end = N`` it ends at
    ``N/record_steps`` times the record's step, whatever ``lr0``.

    A record whose ``t_end`` lies past its run's last update (#43: 2850 updates of a
    PowerCool ending at 2950) gives its run's length as ``record_steps`` and the
    ``t_end`` scaled to this run as ``t_end``: the same ``c_N``, reaching 0 there.

    Args:
      lr0: the run's flat learning rate (> 0).
      c: the record's constant (> 0).
      lr0_record: the record's flat rate the constant belongs to (> 0).
      record_steps: the record's ``t_end`` (>= 1), or its run's length with ``t_end``.
      total_steps: the run's ``t_end`` (>= 1), or its length with ``t_end``.
      power: the exponent (record: 1.2).
      t_end: where the learning rate reaches 0 (>= 1); ``None``: ``total_steps``.

    Returns:
      `power_cool` with those constants.

    Example:
      >>> from optax_snoo import power_cool_scaled
      >>> lr = power_cool_scaled(0.075, c=3.3169534699576625e-06, lr0_record=0.0375,
      ...                        record_steps=2900, total_steps=290)
      >>> round(float(lr(0)), 4), float(lr(290))
      (0.075, 0.0)

    References:
      Jordan et al., `modded-nanogpt Track 3 record #20 (PowerCool, PR #287)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_positive("lr0_record", lr0_record)
    check_int_at_least("record_steps", record_steps, 1)
    check_int_at_least("total_steps", total_steps, 1)
    scale = (lr0 / lr0_record) * (record_steps / total_steps) ** power
    return power_cool(lr0, c=c * scale, t_end=total_steps if t_end is None else t_end,
                      power=power)


def trust_gate_floor(floor: float = 0.45, fade_start: int = 1375,
                     fade_end: int = 1625) -> optax.Schedule:
    """The trust gate's lower bound of records #16/#44/#46: ``floor`` until ``fade_start``,
    then linearly to 0 at ``fade_end`` (a step at ``fade_start`` when
    ``fade_end <= fade_start``), 0 after.

    Args:
      floor: the early floor (record: 0.45).
      fade_start: update count where the fade begins (record: 1375).
      fade_end: update count where the floor reaches 0 (record: 1625).

    Returns:
      A schedule of the update count.

    Example:
      >>> from optax_snoo import trust_gate_floor
      >>> [round(float(trust_gate_floor()(t)), 3) for t in (0, 1500, 1625)]
      [0.45, 0.225, 0.0]
    """
    check_unit_interval("floor", floor)
    check_int_at_least("fade_start", fade_start, 0)
    check_int_at_least("fade_end", fade_end, 0)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.asarray(count).astype(jnp.result_type(float))  # float64 under x64
        if fade_end <= fade_start:
            return jnp.where(t >= fade_end, 0.0, floor)
        frac = jnp.clip((fade_end - t) / (fade_end - fade_start), 0.0, 1.0)
        return floor * frac

    return schedule


def trust_gate_cap(cap: float = 0.85, until: int = 1625) -> optax.Schedule:
    """The trust gate's upper bound of records #16/#44/#46: ``cap`` before ``until``,
    1 from ``until`` on.

    Args:
      cap: the early cap (record: 0.85).
      until: update count from which the gate is uncapped (record: 1625, the end of the
        floor's fade).

    Returns:
      A schedule of the update count.

    Example:
      >>> from optax_snoo import trust_gate_cap
      >>> [round(float(trust_gate_cap()(t)), 3) for t in (0, 1625)]
      [0.85, 1.0]
    """
    check_unit_interval("cap", cap)
    check_int_at_least("until", until, 0)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        return jnp.where(jnp.asarray(count) < until, cap, 1.0)

    return schedule
