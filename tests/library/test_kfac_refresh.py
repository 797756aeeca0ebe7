"""Refresh policies against plain-Python oracles on a warmup + cosine schedule.

The schedule mirrors the source article's setting: 20k steps, 2000 warm-up steps, cosine
decay to 0. `refresh_steps` (the same jitted policy code the transform runs) must list
exactly the steps the oracle lists.
"""

import itertools

import numpy as np
import optax
import pytest

from optax_snoo.kfac import by_lr_phase, every, lr_ratio, policy_step, refresh_steps

TOTAL, WARMUP, PEAK = 20_000, 2_000, 3e-4
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL, end_value=0.0)


def _lrs(schedule=SCHEDULE, total=TOTAL):
    """The schedule's float32 values as Python floats (what the jitted policy sees)."""
    return [float(v) for v in np.asarray(schedule(np.arange(total)), np.float32)]


LRS = _lrs()


def oracle_every(interval, first, total=TOTAL):
    return [t for t in range(total) if t >= first and (t - first) % interval == 0]


def oracle_phase(lrs, warmup, peak, intervals, peak_tol, tail_fraction):
    out, last = [], None
    for t, lr in enumerate(lrs):
        if t < warmup:
            phase = "warmup"
        elif lr <= tail_fraction * peak:
            phase = "tail"
        elif lr >= (1 - peak_tol) * peak:
            phase = "peak"
        else:
            phase = "decay"
        n = intervals[phase]
        if n is None:
            continue
        if (n == "once" and last is None) or (n != "once" and (last is None or t - last >= n)):
            out.append(t)
            last = t
    return out


def oracle_ratio(lrs, tau, max_interval, min_interval, warmup):
    out, last, last_lr = [], None, None
    for t, lr in enumerate(lrs):
        if t < warmup:
            continue
        if last is None:
            fire = True
        else:
            since = t - last
            moved = abs(lr / last_lr - 1) > tau if last_lr > 0 else lr > 0
            fire = since >= min_interval and (
                moved or (max_interval is not None and since >= max_interval))
        if fire:
            out.append(t)
            last, last_lr = t, lr
    return out


def test_fixed_interval_first_at_100_gives_199_refreshes():
    steps = refresh_steps(every(100), SCHEDULE, TOTAL)
    assert steps.tolist() == oracle_every(100, 100)
    assert len(steps) == 199 and steps[0] == 100 and steps[-1] == 19_900


def test_fixed_interval_first_after_warmup_gives_180_refreshes():
    steps = refresh_steps(every(100, first=WARMUP), SCHEDULE, TOTAL)
    assert steps.tolist() == oracle_every(100, WARMUP)
    assert len(steps) == 180 and steps[0] == WARMUP


def test_fixed_interval_first_zero_and_schedule_not_needed():
    assert refresh_steps(every(7, first=0), None, 30).tolist() == [0, 7, 14, 21, 28]
    assert refresh_steps(every(1), None, 4).tolist() == [1, 2, 3]


@pytest.mark.parametrize("intervals", [
    {"warmup": None, "peak": 150, "decay": 300, "tail": 600},       # segmented defaults
    {"warmup": "once", "peak": 100, "decay": 250, "tail": None},
    {"warmup": 500, "peak": 150, "decay": 300, "tail": 600},
])
def test_by_lr_phase_matches_oracle(intervals):
    policy = by_lr_phase(PEAK, warmup_steps=WARMUP, intervals=intervals, peak_tol=0.05,
                         tail_fraction=0.1)
    steps = refresh_steps(policy, SCHEDULE, TOTAL).tolist()
    assert steps == oracle_phase(LRS, WARMUP, PEAK, intervals, 0.05, 0.1)
    assert steps, "no refresh at all"


def test_by_lr_phase_segmented_shape():
    """No refresh in warm-up, the first right after it, then gaps that grow with the phase."""
    policy = by_lr_phase(PEAK, warmup_steps=WARMUP)
    steps = refresh_steps(policy, SCHEDULE, TOTAL)
    assert steps[0] == WARMUP
    gaps = np.diff(steps)
    phases = np.asarray(policy.phase(steps[1:], np.asarray(LRS, np.float32)[steps[1:]]))
    assert set(gaps[phases == 1]) == {150}
    assert set(gaps[phases == 2]) <= {300, 450}            # 450: a peak refresh + 300
    assert set(gaps[phases == 3]) <= {600, 900}
    assert 40 <= len(steps) <= 100, len(steps)


@pytest.mark.parametrize("tau, max_interval, min_interval", [
    (0.15, None, 1), (0.15, 200, 50), (0.1, 500, 100),
])
def test_lr_ratio_matches_oracle(tau, max_interval, min_interval):
    policy = lr_ratio(tau, max_interval=max_interval, min_interval=min_interval,
                      warmup_steps=WARMUP)
    steps = refresh_steps(policy, SCHEDULE, TOTAL).tolist()
    assert steps == oracle_ratio(LRS, tau, max_interval, min_interval, WARMUP)
    assert steps[0] == WARMUP
    assert all(b - a >= min_interval for a, b in itertools.pairwise(steps))
    if max_interval is not None:
        assert all(b - a <= max_interval for a, b in itertools.pairwise(steps))


def test_lr_ratio_refreshes_more_where_the_lr_moves_faster():
    """τ = 0.15 without a step bound: a refresh each time the LR moved 15% — sparse at the
    top of the cosine, dense near its end (log-spaced in the LR)."""
    steps = refresh_steps(lr_ratio(0.15, warmup_steps=WARMUP), SCHEDULE, TOTAL)
    lrs = np.asarray(LRS)[steps]
    ratios = lrs[1:] / lrs[:-1]
    assert np.all(ratios < 0.85 + 1e-6)
    assert np.diff(steps)[0] > np.diff(steps)[-1]


def test_lr_ratio_without_warmup_skip_fires_during_warmup():
    # τ = 0.1537, not 0.15: on the linear warm-up lr ∝ step, so 0.15 puts exact ties
    # (lr / lr_last = 1.15 at integer steps) where 1 ulp decides.
    steps = refresh_steps(lr_ratio(0.1537, min_interval=10), SCHEDULE, TOTAL).tolist()
    assert steps[0] == 0
    assert steps == oracle_ratio(LRS, 0.1537, None, 10, 0)
    assert sum(s < WARMUP for s in steps) > 5


def test_custom_callable_policy():
    def on_lr_drop(step, lr, last_step, last_lr):
        return (last_step < 0) | (lr < 0.4 * last_lr)
    # lr = 0.5^(t/10) falls below 0.4·lr_last after 10·log(0.4)/log(0.5) = 13.2 steps.
    sched = optax.exponential_decay(1.0, transition_steps=10, decay_rate=0.5)
    assert refresh_steps(on_lr_drop, sched, 40).tolist() == [0, 14, 28]


def test_policy_step_advances_the_carry_only_when_it_refreshes():
    refresh, last_step, last_lr = policy_step(every(5, first=0), 10, 0.3, 5, 0.1)
    assert bool(refresh) and int(last_step) == 10 and float(last_lr) == pytest.approx(0.3)
    refresh, last_step, last_lr = policy_step(every(5, first=0), 11, 0.3, 10, 0.3)
    assert not bool(refresh) and int(last_step) == 10
    refresh, last_step, _ = policy_step(every(5, first=0), 15, 0.3, 10, 0.3, allowed=False)
    assert not bool(refresh) and int(last_step) == 10


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="interval"):
        every(0)
    with pytest.raises(ValueError, match="first"):
        every(10, first=-1)
    with pytest.raises(ValueError, match="interval"):
        every(2.5)
    with pytest.raises(ValueError, match="peak_lr"):
        by_lr_phase(0.0)
    with pytest.raises(ValueError, match="Unknown phase"):
        by_lr_phase(1.0, intervals={"cooldown": 10})
    with pytest.raises(ValueError, match="intervals"):
        by_lr_phase(1.0, intervals={"peak": 0})
    with pytest.raises(ValueError, match="tail_fraction"):
        by_lr_phase(1.0, peak_tol=0.5, tail_fraction=0.6)
    with pytest.raises(ValueError, match="threshold"):
        lr_ratio(0.0)
    with pytest.raises(ValueError, match="max_interval"):
        lr_ratio(0.1, max_interval=5, min_interval=10)
    with pytest.raises(ValueError, match="learning rate"):
        refresh_steps(lr_ratio(0.1), None, 10)
    with pytest.raises(ValueError, match="total_steps"):
        refresh_steps(every(2), None, -1)
