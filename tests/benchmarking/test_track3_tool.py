"""The Track-3 protocol's statistics (benchmarks/track3.py) against the figures of
modded-nanogpt's records/track_3_optimization/README.md."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import track3 as t3


def test_threshold_is_the_benchmarks_z_times_sigma():
    # 0.004 = one-sided p < 0.001 with sigma 0.0013
    assert t3.threshold(t3.BENCHMARK_SIGMA) == pytest.approx(0.004, abs=2e-5)
    assert abs(t3.Z_999 - 3.0902) < 1e-4
    with pytest.raises(ValueError, match="sigma=0"):
        t3.threshold(0)


def test_one_sample_rule_reproduces_the_readme_examples():
    c = t3.BENCHMARK_THRESHOLD
    # "1 run < 3.276" and "n = 4: mean < 3.278" pass at the boundary
    assert t3.one_sample_score([3.2759], 3.28) >= c
    assert t3.one_sample_score([3.2761], 3.28) < c
    assert t3.one_sample_score([3.2779] * 4, 3.28) >= c
    assert t3.one_sample_score([3.2781] * 4, 3.28) < c
    # #36: mean 3.2787 over n = 10
    assert t3.one_sample_score([3.2787] * 10, 3.28) == pytest.approx(0.0013 * math.sqrt(10))


def test_first_significant_step_is_the_same_step_for_every_seed():
    steps = [100, 200, 300]
    losses = [[3.40, 3.279, 3.270], [3.41, 3.2795, 3.271], [3.39, 3.2775, 3.272]]
    # at 200: mean 3.27867, (3.28 - mean) sqrt(3) = 0.0023 < 0.004; at 300: 0.0173
    assert t3.first_significant_step(steps, losses, 3.28, 0.004) == 300
    assert t3.first_significant_step(steps, losses, 3.28, 0.002) == 200
    assert t3.first_significant_step(steps, losses, 3.2, 0.004) is None
    with pytest.raises(ValueError, match=r"expected \(seeds, 3\)"):
        t3.first_significant_step(steps, [[1.0, 2.0]], 3.28, 0.004)


def test_pairwise_rule_with_the_benchmarks_step_term():
    # 200 fewer steps are worth 0.009 of loss (#12: +0.0091)
    assert t3.pairwise_score((3.2787, 10, 3250), (3.2787, 10, 3050), 0.0045) == pytest.approx(
        0.009 / math.sqrt(0.2))
    # the same loss in the same steps is no improvement, and the rule is antisymmetric
    assert t3.pairwise_score((3.2787, 10, 3250), (3.2787, 10, 3250), 0.0045) == 0
    a, b = (3.2787, 10, 3250), (3.2779, 8, 3150)
    assert t3.pairwise_score(a, b, 0.0045) == pytest.approx(-t3.pairwise_score(b, a, 0.0045))


def test_loss_per_100_steps_and_target():
    steps = np.arange(0, 500, 25)
    assert t3.loss_per_100_steps(steps, 4.0 - 0.00045 * steps) == pytest.approx(0.045)
    # #36's final mean 3.2787 over n = 10 with c = 0.004 needs 3.2787 + 0.004/sqrt(10) =
    # 3.27996: rounded up, the benchmark's own target
    assert t3.target_from_baseline([3.2787] * 10, 0.004) == 3.28
    assert t3.target_from_baseline([3.2790] * 10, 0.004) == 3.281
    assert t3.target_from_baseline([1.5000] * 4, 0.004) == 1.502


def test_summarize_end_to_end_on_synthetic_curves():
    rng = np.random.default_rng(0)
    steps = [*range(0, 301, 25), 275, 280, 285, 290, 295]
    steps = sorted(set(steps))

    def curve(shift, seed):
        noise = rng.normal(0, 0.002)
        return {s: 2.0 + 1.5 * math.exp(-s / 60) - 0.0005 * s + shift + noise for s in steps}

    curves = {"base": {s: curve(0, s) for s in range(4)},
              "fast": {s: curve(-0.02, s) for s in range(4)}}
    out = t3.summarize(curves)
    base, fast = out["optimizers"]["base"], out["optimizers"]["fast"]
    assert out["sigma"] == pytest.approx(np.std([curves["base"][s][300] for s in range(4)],
                                                ddof=1))
    assert base["result_step"] == 300  # the target is set so the baseline passes at its end
    assert fast["result_step"] < 300
    window = [s for s in steps if s >= 240]  # the last 20%
    clean = [1.5 * math.exp(-s / 60) - 0.0005 * s for s in window]
    assert out["slope_window"] == [250, 300]  # the first evaluation in it
    assert out["per_100_steps"] == pytest.approx(-100 * np.polyfit(window, clean, 1)[0],
                                                 abs=0.01)
    (pair,) = out["pairs"]
    assert pair["at"] == "result" and pair["better"] and not pair["old_better"]
    # a slower optimizer that never passes: compared at the last step
    curves["slow"] = {s: curve(0.05, s) for s in range(4)}
    out = t3.summarize(curves)
    assert out["optimizers"]["slow"]["result_step"] is None
    last = [p for p in out["pairs"] if p["new"] == "slow"]
    assert [p["at"] for p in last] == ["final", "final"] and all(p["old_better"] for p in last)


def test_steps_to_target_is_each_runs_first_step_at_or_below_it():
    assert t3.steps_to_target([0, 25, 50], [3.0, 1.90, 1.85], 1.90) == 25
    assert t3.steps_to_target([0, 25, 50], [3.0, 1.95, 1.91], 1.90) is None


def test_paired_t_test_against_the_closed_form_of_two_degrees_of_freedom():
    # three pairs: df = 2, where Student's two-sided p is 1 - |t| / sqrt(2 + t^2)
    base = {0: 1.88, 1: 1.86, 2: 1.87, 3: 1.90}
    other = {0: 1.85, 1: 1.84, 2: 1.86, 4: 1.70}  # seeds 3 and 4 are unpaired
    diff = np.array([-0.03, -0.02, -0.01])
    t = diff.mean() / (diff.std(ddof=1) / math.sqrt(3))
    out = t3.paired_t_test(base, other)
    assert out["n"] == 3 and out["seeds"] == [0, 1, 2]
    assert out["mean_diff"] == pytest.approx(-0.02)
    assert out["t"] == pytest.approx(t) and t == pytest.approx(-2 * math.sqrt(3))
    assert out["p"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t))
    # a seed without a value (no steps to the target) drops out of the pairs
    steps = t3.paired_t_test({0: 300, 1: 295, 2: None}, {0: 280, 1: 270, 2: 250})
    assert steps["n"] == 2 and steps["mean_diff"] == pytest.approx(-22.5)
    assert t3.paired_t_test({0: 1.0}, {0: 2.0})["p"] is None  # one pair: no test
    same = t3.paired_t_test({0: 1.0, 1: 2.0}, {0: 1.5, 1: 2.5})  # constant difference
    assert same["t"] is None and same["p"] is None  # no test, not a certainty
    assert same["note"] == "all differences equal"


def test_summarize_pairs_each_optimizer_with_the_baseline_by_seed():
    steps = [0, 100, 200]
    curves = {"base": {s: {0: 3.0, 100: 2.0, 200: 1.90 + 0.01 * s} for s in range(3)},
              "new": {s: {0: 3.0, 100: 1.80 + 0.01 * s, 200: 1.85 + 0.012 * s}
                      for s in range(3)}}
    out = t3.summarize(curves, slope_frac=0.6)
    paired = out["paired"]["new"]
    assert list(out["paired"]) == ["new"]
    assert paired["final_loss"]["mean_diff"] == pytest.approx(-0.05 + 0.002)
    assert out["optimizers"]["new"]["seed_steps_to_target"] == {0: 100, 1: 100, 2: 100}
    base_steps = [t3.steps_to_target(steps, [curves["base"][s][t] for t in steps],
                                     out["target"]) for s in range(3)]
    assert out["optimizers"]["base"]["seed_steps_to_target"] == dict(enumerate(base_steps))
    assert base_steps == [200] * 3 and paired["steps_to_target"]["mean_diff"] == -100


def test_per_optimizer_options():
    assert t3.per_optimizer_options(["b:init=nanogpt", "b:seed=1"], ["a", "b"]) == {
        "b": ["--init=nanogpt", "--seed=1"]}
    with pytest.raises(ValueError, match="OPTIMIZER:KEY=VALUE"):
        t3.per_optimizer_options(["c:init=nanogpt"], ["a", "b"])
