"""The library's schedules against float64 transcriptions of their sources: PowerCool
(Track 3 #20, #46's `_lr`) and its rescaling to other run lengths and rates, Muon's momentum
(#30, #44, #46's `_muon_mu_at_step`), the records' stable cooldown (`set_hparams`) and
nanoGPT's warm-up + cosine (`get_lr`), at every step of a run and at the boundaries: the
first step, the end of the warm-up, the start of the cool-down, the last step and past the
end."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_snoo import (
    logistic_schedule,
    muon_momentum_schedule,
    muon_momentum_warmup,
    nanogpt_cosine_schedule,
    power_cool,
    power_cool_scaled,
    stable_cooldown_schedule,
)
from references.error import assert_as_accurate, program_text

# Track 3 record #20 / #46 PowerCool constants (power 1.2), copied from the record's log.
MUON_C, EMBED_C, HEAD_C, OTHER_C = (3.3169534699576625e-06, 4.976805410800738e-05,
                                    5.184172302917436e-07, 1.6589351369335795e-06)


def record_lr(step, initial_lr, power_c, t_end, power=1.2):
    """The record's `_lr`, in float64."""
    return min(initial_lr, power_c * max(0.0, t_end - step) ** power)


def record_mu(step, train_steps, warmup, cooldown, mu_min=0.85, mu_max=0.95, tail_end=None):
    """The record's `_muon_mu_at_step` (#46's, with TAIL_MU_END), held at its end past T."""
    tail_end = mu_min if tail_end is None else tail_end
    step = min(step, train_steps)
    cd_start = train_steps - cooldown
    if step < warmup:
        return mu_min + step / max(warmup, 1) * (mu_max - mu_min)
    if step > cd_start:
        return mu_max - (step - cd_start) / max(cooldown, 1) * (mu_max - tail_end)
    return mu_max


def values(schedule, steps):
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32)), np.float64)


@pytest.mark.parametrize("lr0, c, t_end", [(0.0375, MUON_C, 2900), (0.3, EMBED_C, 2900),
                                           (1 / 320, HEAD_C, 3105), (0.01, OTHER_C, 3105)])
def test_power_cool_matches_the_records_lr_at_every_step(lr0, c, t_end):
    steps = np.arange(0, t_end + 50)
    got = values(power_cool(lr0, c=c, t_end=t_end), steps)
    want = np.array([record_lr(t, lr0, c, t_end) for t in steps])
    # float32 arithmetic; relative to each value, down to the last nonzero step.
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    flat_end = t_end - (lr0 / c) ** (1 / 1.2)  # where c (t_end - t)^1.2 = lr0 (#46: 1487)
    assert np.all(got[steps < flat_end - 0.5] == np.float32(lr0))
    assert np.all(got[steps > flat_end + 0.5] < lr0)
    assert got[t_end - 1] > 0 and got[t_end] == 0 and np.all(got[t_end:] == 0)


def test_power_cool_record_46_boundaries():
    """#46: Muon's flat part ends at 513.6 (step 513 flat, 514 not), the Adam groups' at
    1487.0 (step 1487 is lr0 up to rounding, 1488 below)."""
    muon = power_cool(0.0375, c=MUON_C, t_end=2900)
    embed = power_cool(0.3, c=EMBED_C, t_end=2900)
    assert float(muon(513)) == np.float32(0.0375) and float(muon(514)) < 0.0375
    assert float(embed(1486)) == np.float32(0.3) and float(embed(1488)) < 0.3
    assert float(embed(1487)) == pytest.approx(0.3, rel=1e-6)
    np.testing.assert_allclose(float(muon(2690)), record_lr(2690, 0.0375, MUON_C, 2900),
                               rtol=1e-6)


def test_power_cool_flat_until_is_the_polynomial_schedule_after_the_flat_part():
    lr0, t_end, flat_until = 0.02, 1000, 400
    ours = power_cool(lr0, flat_until=flat_until, t_end=t_end)
    steps = np.arange(0, t_end + 20)
    want = np.array([min(lr0, lr0 * max(0.0, (t_end - t) / (t_end - flat_until)) ** 1.2)
                     for t in steps])
    got = values(ours, steps)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    theirs = values(optax.polynomial_schedule(lr0, 0.0, 1.2, t_end - flat_until, flat_until),
                    steps)
    # The same function, as accurate as optax's float32 program of it against float64
    # (optax's 1 - (t - begin)/steps loses float32 digits near t_end, and from t_end on
    # can be NaN under jit: XLA computes (t - begin)/steps as (t - begin)·(1/steps), so
    # the base is -1.2e-7 there and a real power of it is NaN).
    assert_as_accurate(got[:t_end], theirs[:t_end], want[:t_end])
    assert not got[t_end:].any()


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of c and flat_until"),
    ({"c": 1e-6, "flat_until": 10}, "exactly one of c and flat_until"),
    ({"c": -1.0}, r"c must be > 0, got -1\.0"),
    ({"flat_until": 100}, r"flat_until must be in \[0, t_end=100\), got 100"),
    ({"c": 1e-6, "t_end": 0}, "t_end must be an int >= 1, got 0"),
    ({"c": 1e-6, "power": 0.0}, r"power must be > 0, got 0\.0"),
])
def test_power_cool_bad_input(kwargs, match):
    args = {"t_end": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        power_cool(0.01, **args)


@pytest.mark.parametrize("total, warmup, cooldown, end", [(3020, 300, 100, None),
                                                          (2900, 300, 200, None),
                                                          (2900, 300, 200, 0.9),
                                                          (500, 0, 100, None),
                                                          (500, 250, 250, None)])
def test_muon_momentum_schedule_matches_the_records_mu_at_every_step(total, warmup, cooldown,
                                                                    end):
    steps = np.arange(0, total + 30)
    got = values(muon_momentum_schedule(0.85, 0.95, warmup=warmup, cooldown=cooldown,
                                        total=total, end=end), steps)
    want = np.array([record_mu(t, total, warmup, cooldown, tail_end=end) for t in steps])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    tail = 0.85 if end is None else end
    boundaries = {0: 0.85 if warmup else 0.95, warmup: 0.95, total - cooldown: 0.95,
                  total - 1: 0.95 - (0.95 - tail) * (cooldown - 1) / cooldown,
                  total: tail, total + 29: tail}
    for t, mu in boundaries.items():
        assert got[t] == pytest.approx(mu, abs=1e-7), t


def test_muon_momentum_warmup_is_the_schedule_without_cooldown():
    steps = np.arange(0, 400)
    warm = values(muon_momentum_warmup(0.85, 0.95, 300), steps)
    # One program, so bit for bit one schedule.
    lowered = [jax.jit(jax.vmap(f)).lower(jnp.asarray(steps, jnp.int32)) for f in
               (muon_momentum_warmup(0.85, 0.95, 300), muon_momentum_schedule(warmup=300))]
    assert program_text(lowered[0]) == program_text(lowered[1])
    np.testing.assert_array_equal(warm, values(muon_momentum_schedule(warmup=300), steps))
    np.testing.assert_allclose(warm, [0.85 + 0.10 * min(t / 300, 1) for t in steps], atol=1e-7)


@pytest.mark.parametrize("kwargs, match", [
    ({"cooldown": 200}, "cooldown=200 needs total"),
    ({"cooldown": 200, "total": 400}, "total must be an int >= 500, got 400"),
    ({"warmup": -1}, "warmup must be an int >= 0, got -1"),
    ({"peak": 1.0}, r"peak must be in \[0, 1\), got 1\.0"),
    ({"end": -0.1, "cooldown": 1, "total": 400}, r"end must be in \[0, 1\)"),
])
def test_muon_momentum_schedule_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        muon_momentum_schedule(**kwargs)


# ---- power_cool_scaled: a record's PowerCool at another length and rate -----------------


@pytest.mark.parametrize("lr0, total", [(0.0375, 2900), (0.075, 2900), (0.0375, 290),
                                        (0.01, 1450)])
def test_power_cool_scaled_keeps_the_records_flat_fraction(lr0, total):
    """Muon's record PowerCool (0.0375, c at 2900 steps) for a run of ``total`` at ``lr0``:
    ``lr0/0.0375`` times the record's schedule at the record's step ``t·2900/total``, so the
    flat part ends at the same fraction of the run (the record's: step 513 of 2900)."""
    lr = power_cool_scaled(lr0, c=MUON_C, lr0_record=0.0375, record_steps=2900,
                           total_steps=total)
    steps = np.arange(0, total + 5)
    want = np.array([lr0 / 0.0375 * record_lr(t * 2900 / total, 0.0375, MUON_C, 2900)
                     for t in steps])
    np.testing.assert_allclose(values(lr, steps), want, rtol=2e-6, atol=0)
    flat_end = 2900 - (0.0375 / MUON_C) ** (1 / 1.2)  # the record's: 513.6 of 2900
    flat = values(lr, steps) == np.float32(lr0)
    assert np.all(flat[steps < flat_end * total / 2900 - 0.5])
    assert not np.any(flat[steps > flat_end * total / 2900 + 0.5])


def test_power_cool_scaled_with_an_end_past_the_run():
    """``t_end`` past the run (#43: 2850 updates of a PowerCool ending at 2950): the same
    ``c_N`` as a run of ``total_steps``, reaching 0 at ``t_end``; at the record's length the
    record's ``min(lr0, c (t_end - t)^1.2)``."""
    lr = power_cool_scaled(0.0375, c=MUON_C, lr0_record=0.0375, record_steps=2850,
                           total_steps=2850, t_end=2950)
    steps = np.array([0, 1000, 2848, 2950, 2960])
    want = [record_lr(t, 0.0375, MUON_C, 2950) for t in steps]
    np.testing.assert_allclose(values(lr, steps), want, rtol=2e-6, atol=0)
    half = power_cool_scaled(0.0375, c=MUON_C, lr0_record=0.0375, record_steps=2850,
                             total_steps=1425, t_end=1475)
    np.testing.assert_allclose(values(half, steps // 2), np.array(want), rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="t_end must be an int >= 1, got 0"):
        power_cool_scaled(0.01, c=MUON_C, lr0_record=0.01, record_steps=2900, total_steps=10,
                          t_end=0)


def test_power_cool_scaled_bad_input():
    with pytest.raises(ValueError, match=r"lr0_record must be > 0, got 0\.0"):
        power_cool_scaled(0.01, c=MUON_C, lr0_record=0.0, record_steps=2900, total_steps=10)
    with pytest.raises(ValueError, match="total_steps must be an int >= 1, got 0"):
        power_cool_scaled(0.01, c=MUON_C, lr0_record=0.01, record_steps=2900, total_steps=0)


# ---- the records' stable cooldown and nanoGPT's cosine -----------------------------------


def record_multiplier(t, total, cooldown_frac, final):
    """modded-nanogpt's `get_lr`/`set_hparams` multiplier: 1, then linear to ``final``."""
    x = t / total
    return 1.0 if x < 1 - cooldown_frac else (1 - x) / cooldown_frac * (1 - final) + final


@pytest.mark.parametrize("cooldown_frac, final", [(0.7, 0.0), (0.7, 0.01), (1.0, 0.1)])
def test_stable_cooldown_matches_the_records(cooldown_frac, final):
    total = 5640
    steps = np.arange(0, total + 1, 7)
    got = values(stable_cooldown_schedule(0.03, total, cooldown_frac, final), steps)
    want = np.array([0.03 * record_multiplier(t, total, cooldown_frac, final) for t in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    assert float(stable_cooldown_schedule(0.03, total, cooldown_frac, final)(total)) == (
        pytest.approx(0.03 * final, abs=1e-9))


def record_eta(progress, cooldown_frac, power, floor):
    """Track 3 #27's ``_eta`` (train_gpt_simple_soaph.py:520-525) = #25's ``set_hparams``
    (train_gpt_simple_klsoap_h_lr_power_decay.py:422-433), in float64."""
    if progress < 1.0 - cooldown_frac:
        return 1.0
    x = max(0.0, (1.0 - progress) / cooldown_frac)
    return floor + (1.0 - floor) * x ** power


@pytest.mark.parametrize("total, cooldown_frac, power, floor", [
    (3200, 1.0, 1.25, 0.0), (3125, 1.0, 1.5, 0.017), (3125, 0.4, 1.5, 0.04)])
def test_stable_cooldown_power_matches_the_records_eta(total, cooldown_frac, power, floor):
    # #27 trains 3125 steps on a 3200-step schedule, #25 3040 on 3125: past the end too.
    steps = np.concatenate([np.arange(0, total + 1, 7), [total - 1, total, total + 40]])
    sched = stable_cooldown_schedule(0.018, total, cooldown_frac, floor, power=power)
    got = values(sched, steps)
    want = np.array([0.018 * record_eta(t / total, cooldown_frac, power, floor)
                     for t in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    ({"power": 0.0}, "power must be > 0"),
    ({"total_steps": 0}, "total_steps must be an int >= 1, got 0"),
    ({"total_steps": True}, "total_steps must be an int >= 1, got True"),
    ({"cooldown_frac": 0.0}, r"cooldown_frac must be in \(0, 1\]"),
    ({"final_lr_scale": 2.0}, r"final_lr_scale must be in \[0, 1\]"),
])
def test_stable_cooldown_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stable_cooldown_schedule(**{"peak_value": 0.1, "total_steps": 100, **kwargs})


def nanogpt_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's `get_lr` (train.py), in float64."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("warmup, decay, final", [(100, 2000, 0.1), (0, 500, 0.0),
                                                  (10, 60, 0.5)])
def test_nanogpt_cosine_matches_get_lr(warmup, decay, final):
    steps = np.arange(0, decay + 30)
    got = values(nanogpt_cosine_schedule(1e-3, warmup_steps=warmup, decay_steps=decay,
                                         final_lr_scale=final), steps)
    want = np.array([nanogpt_lr(t, 1e-3, warmup, decay, 1e-3 * final) for t in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)


def test_nanogpt_cosine_without_a_cosine_is_warmup_then_floor():
    """decay_steps <= warmup_steps: nanoGPT warms up, then holds min_lr."""
    steps = np.arange(0, 30)
    got = values(nanogpt_cosine_schedule(1e-3, warmup_steps=10, decay_steps=10), steps)
    want = np.array([1e-3 * (t + 1) / 11 if t < 10 else 1e-4 for t in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_logistic_schedule_is_dynmuons_power_at_every_step():
    """Track 3 #28's `get_dynmuon_p(step, total_steps, 0.25, -0.25, 0.04, 0.04)`, written
    out (train_gpt_simple_dynmuon.py:468-472)."""
    p = jax.jit(logistic_schedule(0.25, -0.25, 3200))
    for step in (0, 1, 64, 127, 128, 129, 500, 3199):
        u = (step / 3200 - 0.04) / 0.04
        expected = -0.25 + 0.5 * (1.0 / (1.0 + math.exp(u)))
        assert abs(float(p(step)) - expected) <= 4e-8, step  # float32 of a value < 0.25
    other = logistic_schedule(1.0, 0.0, 100, midpoint_frac=0.5, width_frac=0.1)
    assert float(other(50)) == 0.5 and float(other(100)) < 0.01 < 0.99 < float(other(0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_steps=0), "total_steps must be an int >= 1"),
    (dict(width_frac=0.0), "width_frac must be > 0, got 0.0")])
def test_logistic_schedule_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        logistic_schedule(0.25, -0.25, **({"total_steps": 10} | kwargs))
