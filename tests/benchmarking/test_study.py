"""The study's statistics (`benchmarks.study`, `benchmarks.study_tools`): Welch's one-sided
t-test against Student-t table values, steps-to-target interpolation, and stack parsing."""

import math
import statistics

import pytest

from benchmarks import study
from benchmarks.study import inner_stack, steps_to_target
from benchmarks.study_tools import (
    ALIASES,
    paired_one_sided,
    renamed_stack,
    stack_config,
    welch_one_sided,
)
from train import config as tc


def _pair_with_t(t: float, n: int = 5):
    """Two samples of size n with equal variances whose Welch statistic is `t`."""
    base = [-2.0, -1.0, 0.0, 1.0, 2.0][:n]
    se = math.sqrt(2 * statistics.variance(base) / n)
    return [x + t * se for x in base], base


@pytest.mark.parametrize("t, p", [(-1.860, 0.05), (-2.896, 0.01), (-1.397, 0.10),
                                  (0.0, 0.5), (1.860, 0.95)])
def test_welch_matches_student_t_table(t, p):
    # Equal sizes (5) and variances: Welch's degrees of freedom are 2(n - 1) = 8.
    a, b = _pair_with_t(t)
    t_hat, p_hat = welch_one_sided(a, b)
    assert t_hat == pytest.approx(t, abs=1e-9)
    assert p_hat == pytest.approx(p, abs=2e-4)


def test_welch_unequal_variances_is_symmetric_and_monotone():
    a, b = [1.0, 1.2, 0.9, 1.1], [1.5, 1.4, 1.9, 1.3, 1.6, 1.45]
    _, p_less = welch_one_sided(a, b)
    _, p_more = welch_one_sided(b, a)
    assert p_less + p_more == pytest.approx(1.0, abs=1e-6)
    assert p_less < 0.01 < 0.99 < p_more
    _, p_closer = welch_one_sided([x + 0.3 for x in a], b)
    assert p_less < p_closer


def test_welch_needs_two_seeds():
    with pytest.raises(ValueError, match=">= 2 seeds"):
        welch_one_sided([1.0], [1.0, 2.0])


@pytest.mark.parametrize("t, p", [(-2.132, 0.05), (-3.747, 0.01), (0.0, 0.5), (2.132, 0.95)])
def test_paired_matches_student_t_table_with_n_minus_1_degrees(t, p):
    # Five pairs: 4 degrees of freedom. b has a large spread that the pairing cancels.
    d = [-2.0, -1.0, 0.0, 1.0, 2.0]
    shift = t * statistics.stdev(d) / math.sqrt(len(d))
    b = [10.0, -3.0, 7.0, 0.5, 4.0]
    a = [y + x + shift for x, y in zip(d, b, strict=True)]
    t_hat, p_hat = paired_one_sided(a, b)
    assert t_hat == pytest.approx(t, abs=1e-9)
    assert p_hat == pytest.approx(p, abs=2e-4)
    if t < 0:  # unpaired, the spread of b hides the shift
        assert welch_one_sided(a, b)[1] > 0.15 > p


def test_paired_needs_matching_pairs():
    with pytest.raises(ValueError, match=">= 2 pairs"):
        paired_one_sided([1.0, 2.0], [1.0, 2.0, 3.0])


def test_steps_to_target_interpolates_between_evaluations():
    curve = [(0, 4.0), (100, 2.0), (200, 1.5), (300, 1.4)]
    assert steps_to_target(curve, 1.75) == pytest.approx(150.0)
    assert steps_to_target(curve, 2.0) == pytest.approx(100.0)
    assert steps_to_target(curve, 1.4) == pytest.approx(300.0)
    assert steps_to_target(curve, 1.0) is None


def test_stack_config_applies_overrides_and_aliases(tmp_path):
    config = stack_config("shakespeare_char_cpu", "snoo_muon@snoo_k=7@snoo_learning_rate=0.5",
                          seed=3, steps=40, eval_interval=10, out_dir=str(tmp_path))
    flat = tc.flat_dict(config)
    assert [flat[k] for k in ("optimizer", "snoo_k", "snoo_learning_rate")] == [
        "snoo_muon", 7, 0.5]
    assert [flat[k] for k in ("seed", "max_iters", "eval_interval")] == [3, 40, 10]
    smooth = stack_config("shakespeare_char_cpu", "snoo_muon_smooth", seed=0, steps=1,
                          eval_interval=1, out_dir=str(tmp_path))
    assert ALIASES["snoo_muon_smooth"].startswith("snoo_muon@")
    assert (smooth.optimizer.name, smooth.optimizer.table.muon_smoothing) == ("snoo_muon", 0.2)
    # Preset overrides apply to every stack; the cosine always ends at the run's last step.
    gpu = stack_config("gpt2_small@warmup_iters=20@eval_iters=10", "muon@muon_learning_rate=0.03",
                       seed=0, steps=150, eval_interval=50, out_dir=str(tmp_path))
    table = gpu.optimizer.table
    assert (gpu.model.n_layer, table.warmup_iters, gpu.run.eval_iters,
            table.muon_learning_rate) == (12, 20, 10, 0.03)
    assert table.lr_decay_iters is None  # the preset's 5000: a 150-step run at peak
    # a stack without a cosine (its own schedule, or stable_cooldown) has no end to reset
    record = stack_config("shakespeare_char_cpu", "track3_baseline", seed=0, steps=40,
                          eval_interval=10, out_dir=str(tmp_path))
    assert "lr_decay_iters" not in record.optimizer.resolved()
    cooled = stack_config("gpt2_small", "muon@schedule=stable_cooldown", seed=0, steps=40,
                          eval_interval=10, out_dir=str(tmp_path))
    assert cooled.optimizer.table.schedule == "stable_cooldown"
    # the stacks of results saved before the config's renames
    assert renamed_stack("snoo_skewadam@snoo_lr=0.5@snoo_k=7") == (
        "snoo_skew_adam@snoo_learning_rate=0.5@snoo_k=7")
    with pytest.raises(ValueError, match="--snoo_lr was renamed --snoo_learning_rate"):
        stack_config("shakespeare_char_cpu", "snoo_muon@snoo_lr=0.5", seed=0, steps=1,
                     eval_interval=1, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="snoo_kk"):
        stack_config("shakespeare_char_cpu", "snoo_muon@snoo_kk=7", seed=0, steps=1,
                     eval_interval=1, out_dir=str(tmp_path))


def test_inner_stack_names_the_wrapped_optimizer_when_it_is_in_the_grid():
    grid = ["adamw", "muon", "snoo_muon", "snoo_muon_smooth", "snoo_kfac"]
    assert inner_stack("snoo_muon", grid) == "muon"
    assert inner_stack("snoo_muon@snoo_k=7", grid) == "muon"
    assert inner_stack("snoo_muon_smooth", grid) == "muon"
    assert inner_stack("snoo_kfac", grid) is None  # kfac is not in the grid
    assert inner_stack("muon", grid) is None


def test_default_study_shares_runs_between_suites_and_tests_snoo_against_its_inner(
        monkeypatch, tmp_path):
    trained = []

    def fake_train_one(preset, stack, *, seed, steps, eval_interval):
        trained.append((preset, stack, seed, steps))
        final = 2.0 - 0.1 * stack.startswith("snoo") + 0.01 * seed
        curve = [(0, 4.0), (steps, final)]
        return {"seed": seed, "val_loss": final, "curve": curve, "wall_s": 1.0,
                "tokens_per_sec": 100.0, "aux_loss": None}

    monkeypatch.setattr(study, "train_one", fake_train_one)
    monkeypatch.setattr(study, "optimizer_state_bytes", lambda config: 1024)
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    monkeypatch.setattr(study, "SUITES", {
        "a": study.Suite("shakespeare_char_cpu", ("muon", "snoo_muon"), 2, 10, 5),
        "b": study.Suite("shakespeare_char_cpu", ("muon", "snoo_muon@snoo_k=7"), 2, 10, 5)})
    monkeypatch.setattr(study, "DEFAULT_SUITES", ("a", "b"))
    cache_dir = study.jax.config.jax_compilation_cache_dir
    reports = study.main([])
    assert study.jax.config.jax_compilation_cache_dir == cache_dir  # restored
    assert [r.name for r in reports] == ["a.md", "b.md"]
    # muon's two seeds are trained once for both suites.
    assert sorted(trained) == sorted(
        [("shakespeare_char_cpu", s, seed, 10) for s in ("muon", "snoo_muon", "snoo_muon@snoo_k=7")
         for seed in (0, 1)])
    row = next(r for r in (tmp_path / "a.md").read_text().splitlines()
               if r.startswith("| snoo_muon "))
    assert "muon: " in row and "paired 0.0000" in row  # lower than muon on both seeds
    # The report is regenerable from its JSON, with the machine line of the run.
    before = (tmp_path / "a.md").read_text()
    (tmp_path / "a.md").unlink()
    study.main(["--from_json", "--suite=a"])
    assert (tmp_path / "a.md").read_text() == before
