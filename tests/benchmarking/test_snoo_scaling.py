"""The Snoo-against-size study (`benchmarks.snoo_scaling`): the compute factor's
interpolation, the grid's runs, and the report and resume with a fake trainer."""

import dataclasses
import json

import pytest

from benchmarks import snoo_scaling as ss
from benchmarks import study


@pytest.mark.parametrize("target, expected", [
    (2.5, (1.25, "=")),     # half-way between the 1x (2.6) and the 1.5x run (2.4)
    (2.4, (1.5, "=")),      # exactly a run's loss
    (2.35, (1.75, "=")),    # between 1.5x and 2x
    (2.1, (2.0, ">=")),     # even the 2x run is above: a lower bound
    (2.6, (1.0, "<=")),     # the 1x run already reaches it
    (2.9, (1.0, "<=")),
])
def test_compute_factor_interpolates_between_the_bracketing_runs(target, expected):
    factor, kind = ss.compute_factor([1.0, 1.5, 2.0], [2.6, 2.4, 2.3], target)
    assert (round(factor, 9), kind) == expected


def test_compute_factor_takes_the_first_crossing_and_any_order():
    # a noisy, non-monotone curve given out of order: 2x (2.45) is worse than 1.5x (2.4)
    assert ss.compute_factor([2.0, 1.0, 1.5], [2.45, 2.6, 2.4], 2.42) == pytest.approx(
        (1.0 + 0.5 * (2.6 - 2.42) / 0.2, "="))


def _fake_loss(width, stack, seed, steps):
    """Loss falls with width and length; Snoo's paper setting gains 0.02 + 0.01 per seed."""
    loss = 3.0 - width / 1000 - steps / 10_000
    if stack.startswith("snoo_"):
        loss -= 0.02 + 0.01 * seed if "@" in stack else -0.001
    return loss


GRID = ss.ScalingGrid(widths=(32, 64), muon_widths=(64,), steps=100, seeds=2,
                      lengths=(1.5, 2.0), length_seeds=(1, 2), eval_interval=50)


def test_grid_lists_every_pair_setting_and_length():
    runs = GRID.runs()
    assert len(runs) == len(set(runs))
    # per width and seed: the inner stack and one Snoo run per setting, per pair
    assert len([r for r in runs if r[0] == 32]) == 2 * 3 + 2
    assert len([r for r in runs if r[0] == 64]) == 2 * 6 + 2 * 2
    assert (64, "snoo_muon" + ss.SNOO_SETTINGS["paper"], 1, 100) in runs
    assert (32, "adamw", 0, 200) in runs and (32, "adamw", 1, 200) not in runs
    assert (64, "adamw", 1, 150) in runs
    with pytest.raises(ValueError, match=r"length_seeds=\(1,\): expected one seed count"):
        ss.ScalingGrid(widths=(32, 64), length_seeds=(1,))


def test_report_and_resume_with_a_fake_trainer(tmp_path):
    calls = []

    def train(width, stack, seed, steps, grid):
        calls.append((width, stack, seed, steps))
        if len(calls) == 5 and not grid.preset.endswith("!"):
            raise KeyboardInterrupt  # the grid stops part-way
        return {"whole_val_loss": _fake_loss(width, stack, seed, steps), "val_loss": 0.0,
                "wall_s": 1.0, "tokens_per_sec": 1.0}

    with pytest.raises(KeyboardInterrupt):
        ss.run(GRID, command="test", directory=tmp_path, train=train, log=lambda _: None)
    partial = json.loads((tmp_path / "snoo_scaling.partial.json").read_text())
    assert len(partial["results"]) == 4
    calls.clear()
    grid = dataclasses.replace(GRID, length_seeds=(2, 2))  # a grown grid keeps its runs
    report = ss.run(grid, command="test", directory=tmp_path, log=lambda _: None,
                    train=lambda *a: train(*a[:4], ss.ScalingGrid(preset="x!")))
    assert len(calls) == len(grid.runs()) - 4  # the four finished runs were not repeated
    assert not (tmp_path / "snoo_scaling.partial.json").exists()

    saved = json.loads((tmp_path / "snoo_scaling.json").read_text())
    rows = {(r["width"], r["inner"], r["setting"]): r for r in saved["rows"]}
    assert len(rows) == 2 * 2 + 2
    paper = rows[(32, "adamw", "paper")]
    assert paper["diff_mean"] == pytest.approx(-0.025) and paper["p"] < 0.5
    # AdamW at 100/150/200 steps: 2.958, 2.953, 2.948; Snoo's mean 2.958 - 0.025 = 2.933
    assert paper["compute_factor"] == 2.0 and paper["factor_kind"] == ">="
    record = rows[(32, "adamw", "record")]
    assert record["diff_mean"] == pytest.approx(0.001) and record["p"] > 0.5
    assert (record["compute_factor"], record["factor_kind"]) == (1.0, "<=")
    assert rows[(64, "muon", "paper")]["compute_factor"] is None
    # per layer 12 n_embd^2 weights (no biases) and two LayerNorm scales, then the final one
    assert saved["params"]["32"] == 4 * (12 * 32 * 32 + 2 * 32) + 32
    text = report.read_text()
    assert "≥ 2.00" in text and "| 64 | " in text
    assert (tmp_path / "snoo_scaling.png").stat().st_size > 0
    # and the report is rewritten from its JSON alone
    (tmp_path / "snoo_scaling.md").unlink()
    assert ss.rewrite_report(tmp_path).read_text() == text
    # also from a JSON saved before the config's renames (`snoo_lr`)
    saved["results"] = {k.replace("snoo_learning_rate", "snoo_lr"): v
                        for k, v in saved["results"].items()}
    assert any("@snoo_lr=" in k for k in saved["results"])
    (tmp_path / "snoo_scaling.json").write_text(json.dumps(saved))
    assert ss.rewrite_report(tmp_path).read_text() == text


def test_study_cli_sends_the_suite_here_and_refuses_other_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(ss, "main", lambda **kw: seen.update(kw) or ["report"])
    assert study.main(["--suite=snoo_scaling", "--steps=30", "--seeds=2"]) == ["report"]
    assert (seen["steps"], seen["seeds"], seen["from_json"]) == (30, 2, False)
    with pytest.raises(SystemExit):
        study.main(["--suite=snoo_scaling", "--optimizers=adamw"])
