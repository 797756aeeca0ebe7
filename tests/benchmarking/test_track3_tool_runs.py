"""`python -m benchmarks.track3` as a user meets it: which runs it reuses, where it writes,
what it refuses before the first run, what its statistics say of degenerate pairs, and
the target on its plot and on the trainer's `loss.png`.

Most tests replace the trainer process by a fake (`benchmarks.track3.launch`) that
resolves its command line with the trainer's own `parse_args` and writes the files a run
writes, its val loss a function of the whole config (so any option that differs gives
another curve) and of `step / max_iters` (a run's own cooldown). One test trains a tiny
real run through the tool, and one a tiny real run in-process for `loss.png`.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import track3 as t3
from repository import ROOT
from train import config as tc
from train import loop, metrics
from train.loop import step_actions

#: A short twin run for the fake trainer: evaluations at 0, 5, 10, 15 and 18, 19, 20.
SHORT = ["--set", "max_iters=20", "--set", "eval_interval=5", "--set", "eval_interval_tail=1"]
#: An optimizer hyperparameter every Track 3 recipe reads (the journey of the issue).
LR_OPTION = "muon_learning_rate=0.1"


def fake_loss(config: tc.TrainConfig, step: int) -> float:
    """A falling curve that ends its cooldown at the run's own last step, shifted by a
    digest of every option but where the outputs go (another option: another curve)."""
    keyed = {k: v for k, v in tc.flat_dict(config).items() if k not in t3.UNKEYED}
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode())
    shift = int(digest.hexdigest()[:6], 16) / 16 ** 6 * 0.01
    return 3.0 - 0.5 * step / config.run.max_iters + shift


def fake_launch(calls: list) -> object:
    """A stand-in for `benchmarks.track3.launch` that appends each run's trainer
    arguments to `calls` and writes the files of a run."""

    def launch(cmd):
        argv = list(cmd[list(cmd).index("train") + 1:])
        calls.append(argv)
        config = tc.parse_args(argv)
        out = Path(config.run.out_dir)
        out.mkdir(parents=True)  # the tool empties a folder before a run: it must not exist
        (out / "config.json").write_text(json.dumps(tc.config_to_dict(config)))
        steps = [s for s in range(config.run.max_iters + 1)
                 if step_actions(s, start=0, run=config.run).evaluate]
        rows = [{"step": s, "train_loss": 0.0, "val_loss": fake_loss(config, s)}
                for s in steps]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return launch


@pytest.fixture
def trainer(monkeypatch):
    """The fake trainer: returns the list of the trainer argument lists it was run with."""
    calls = []
    monkeypatch.setattr(t3, "launch", fake_launch(calls))
    return calls


def tool(tmp_path, *args, seeds=3):
    """`main` with the runs and the report in `tmp_path`; returns (status, report)."""
    out = tmp_path / "report"
    status = t3.main([f"--runs_dir={tmp_path / 'runs'}", f"--out={out}", f"--seeds={seeds}",
                      *SHORT, *args])
    report = json.loads(out.with_suffix(".json").read_text()) if status == 0 else None
    return status, report


def seed_folders(report, label):
    return sorted(Path(report["runs"][label]["folder"]).glob("seed*"))


# ----------------------------------------------------------------------- reuse by key


def test_a_changed_option_trains_its_own_runs_and_the_same_one_reuses(trainer, tmp_path):
    status, first = tool(tmp_path)
    assert status == 0 and len(trainer) == 6  # two optimizers x three seeds
    assert tool(tmp_path)[0] == 0 and len(trainer) == 6  # the same request: all reused
    trainer.clear()
    status, changed = tool(tmp_path, "--set", LR_OPTION)
    assert status == 0 and len(trainer) == 6
    assert all(f"--{LR_OPTION}" in argv for argv in trainer)
    for label in ("track3_baseline", "snoo_track3_baseline"):
        old, new = first["optimizers"][label], changed["optimizers"][label]
        assert new["final_mean"] != old["final_mean"]  # the new runs' curves, not the old
        assert first["runs"][label]["folder"] != changed["runs"][label]["folder"]


def test_a_shorter_run_is_trained_with_its_own_cooldown_not_cut_from_a_longer(trainer,
                                                                              tmp_path):
    assert tool(tmp_path)[0] == 0
    trainer.clear()
    status, short = tool(tmp_path, "--set", "max_iters=10")
    assert status == 0 and len(trainer) == 6
    base = short["optimizers"]["track3_baseline"]
    assert base["steps"][-1] == 10
    # the fake's 10-step run ends its cooldown at step 10: 3.0 - 0.5 + shift, within
    # [2.5, 2.51]; step 10 of the 20-step run is 2.75 + shift
    assert 2.5 <= base["final_mean"] <= 2.51


def test_run_folders_are_named_by_their_key_and_hold_it(trainer, tmp_path):
    status, report = tool(tmp_path, "--seeds_for=snoo_track3_baseline:1")
    assert status == 0
    base = report["runs"]["track3_baseline"]
    folders = seed_folders(report, "track3_baseline")
    assert [f.name for f in folders] == ["seed0", "seed1", "seed2"]
    assert Path(base["folder"]).parent.parent == tmp_path / "runs" / "track3_cpu"
    keys = [json.loads((f / t3.KEY_FILE).read_text()) for f in folders]
    config = keys[0]["config"]
    assert config["run"]["max_iters"] == 20 and config["run"]["seed"] == 0
    assert [k["config"]["run"]["seed"] for k in keys] == [0, 1, 2]
    assert "out_dir" not in config["run"] and "progress" not in config["run"]
    assert set(keys[0]) == {"config", "data", "code"}
    # the default corpus, by content: the shipped tiny shakespeare
    (corpus,) = keys[0]["data"]["files"]
    assert corpus["sha256"] == hashlib.sha256(
        (ROOT / "data" / "tinyshakespeare" / "input.txt").read_bytes()).hexdigest()
    assert len(base["key_hash"]) == 12
    other = Path(report["runs"]["snoo_track3_baseline"]["folder"])
    assert other.parent.name == "snoo_track3_baseline" and other != Path(base["folder"])


def test_a_missing_or_different_key_file_is_trained_again_and_rerun_forces(trainer,
                                                                            tmp_path):
    status, report = tool(tmp_path, "--optimizers=track3_baseline")
    assert status == 0
    seed0, seed1, _ = seed_folders(report, "track3_baseline")
    (seed0 / t3.KEY_FILE).unlink()
    key = json.loads((seed1 / t3.KEY_FILE).read_text())
    key["code"]["sources"] = "0" * 64
    (seed1 / t3.KEY_FILE).write_text(json.dumps(key))
    trainer.clear()
    assert tool(tmp_path, "--optimizers=track3_baseline")[0] == 0
    assert sorted(a for argv in trainer for a in argv if a.startswith("--seed=")) == [
        "--seed=0", "--seed=1"]
    trainer.clear()
    assert tool(tmp_path, "--optimizers=track3_baseline", "--rerun")[0] == 0
    assert len(trainer) == 3


def test_the_data_and_the_code_are_part_of_the_key(trainer, tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question. " * 400)
    args = ("--optimizers=track3_baseline", f"--set=data={text}")
    assert tool(tmp_path, *args)[0] == 0 and len(trainer) == 3
    text.write_text("to be or not to be, that is the question! " * 400)  # same size
    assert tool(tmp_path, *args)[0] == 0 and len(trainer) == 6
    real = t3.code_version()
    monkeypatch.setattr(t3, "code_version", lambda: {**real, "sources": "f" * 64})
    assert tool(tmp_path, *args)[0] == 0 and len(trainer) == 9


def test_code_version_hashes_the_sources_content_not_their_caches(tmp_path):
    for name in t3.SOURCE_DIRS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.py").write_text(f"x = '{name}'\n")
    first = t3.code_version(tmp_path)["sources"]
    (tmp_path / "train" / "__pycache__").mkdir()
    (tmp_path / "train" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert t3.code_version(tmp_path)["sources"] == first
    (tmp_path / "models" / "a.py").write_text("x = 'changed'\n")
    assert t3.code_version(tmp_path)["sources"] != first
    assert t3.code_version(tmp_path)["libraries"]["jax"]


def test_reuse_report_gives_curves_only_for_the_same_config(trainer, tmp_path):
    status, report = tool(tmp_path)
    assert status == 0
    trainer.clear()
    again = tmp_path / "again"
    assert t3.main([f"--runs_dir={tmp_path / 'fresh_runs'}", f"--out={again}", "--seeds=3",
                    *SHORT, f"--reuse_report={tmp_path / 'report.json'}"]) == 0
    assert trainer == []
    assert json.loads(again.with_suffix(".json").read_text())["optimizers"] == report[
        "optimizers"]
    status = t3.main([f"--runs_dir={tmp_path / 'fresh_runs'}", f"--out={again}", "--seeds=3",
                      *SHORT, "--set_for=track3_baseline:batch_size=4",
                      "--set_for=snoo_track3_baseline:batch_size=4",
                      f"--reuse_report={tmp_path / 'report.json'}"])
    assert status == 0 and len(trainer) == 6  # other labels: nothing to reuse
    trainer.clear()
    # the config differs: refused before any run
    assert t3.main([f"--runs_dir={tmp_path / 'fresh_runs'}", f"--out={again}", "--seeds=3",
                    *SHORT, "--set", "eval_iters=3",
                    f"--reuse_report={tmp_path / 'report.json'}"]) == 2
    assert trainer == []
    # a report without run keys (an older one): its --set options and evaluation steps
    old = {k: v for k, v in report.items() if k != "runs"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    reuse_old = [f"--runs_dir={tmp_path / 'fresh_runs'}", f"--out={again}", "--seeds=3",
                 *SHORT, f"--reuse_report={tmp_path / 'old.json'}"]
    assert t3.main(reuse_old) == 0 and trainer == []
    base = old["optimizers"]["track3_baseline"]
    base["steps"] = [*base["steps"][:-1], 21]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert t3.main(reuse_old) == 2 and trainer == []


def test_reuse_report_is_repeatable_and_refuses_a_run_two_reports_hold_differently(
        trainer, tmp_path, capsys):
    """Two reports, each holding one optimizer's runs, give every curve together (no run
    trained, the same summary, each named in the report); a run in both with the same
    curve is taken once, with another curve it is refused."""
    status, report = tool(tmp_path)
    assert status == 0
    trainer.clear()
    labels = list(report["optimizers"])
    assert len(labels) == 2
    parts = []
    for i, label in enumerate(labels):
        part = {**report, "optimizers": {label: report["optimizers"][label]}}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    again = tmp_path / "again"
    both = [f"--runs_dir={tmp_path / 'fresh_runs'}", f"--out={again}", "--seeds=3", *SHORT]
    assert t3.main([*both, *(f"--reuse_report={p}" for p in parts)]) == 0
    assert trainer == []
    joined = json.loads(again.with_suffix(".json").read_text())
    assert joined["optimizers"] == report["optimizers"]
    assert [r["labels"] for r in joined["reused_from"]] == [[label] for label in labels]
    whole = f"--reuse_report={tmp_path / 'report.json'}"
    assert t3.main([*both, f"--reuse_report={parts[0]}", whole]) == 0 and trainer == []
    assert json.loads(again.with_suffix(".json").read_text())["optimizers"] == report[
        "optimizers"]
    moved = json.loads(parts[0].read_text())
    moved["optimizers"][labels[0]]["losses"][0][-1] += 1e-4
    parts[0].write_text(json.dumps(moved))
    capsys.readouterr()
    status = t3.main([*both, f"--reuse_report={parts[0]}", whole])
    err = capsys.readouterr().err
    assert status == 2 and trainer == []
    assert (f"{labels[0]} seed 0 is also in --reuse_report={parts[0]} with another curve"
            in err), err


# --------------------------------------------------------------------- the report's home


def test_the_default_report_is_not_the_committed_results(trainer, tmp_path, monkeypatch):
    committed = ROOT / "benchmarks" / "results"
    before = {p.name: p.read_bytes() for p in committed.glob("track3_cpu.*")}
    monkeypatch.chdir(tmp_path)
    assert t3.main(["--runs_dir=runs", "--seeds=3", *SHORT]) == 0
    report = tmp_path / "out" / "track3_reports" / "track3_cpu"
    assert {p.suffix for p in report.parent.glob("track3_cpu.*")} == {".json", ".md", ".png"}
    assert {p.name: p.read_bytes() for p in committed.glob("track3_cpu.*")} == before
    assert t3.parser().get_default("out") is None  # resolved to out/track3_reports/PRESET


# ------------------------------------------------------ mistakes: refused before any run


@pytest.mark.parametrize("args, named", [
    (["--optimizers=track3_baseline,nonexistent"], "nonexistent"),
    (["--optimizers=track3_baseline,track3_baseline"], "track3_baseline"),
    (["--optimizers=track3_baseline,muloco_normuonh"], "--init=hyperball"),
    (["--seeds=0"], "--seeds=0"),
    (["--seeds=abc"], "'abc'"),
    (["--seeds=1"], "--sigma"),
    (["--seeds=2"], "at least 3"),
    (["--sigma=-1"], "--sigma=-1"),
    (["--slope_frac=0"], "--slope_frac=0"),
    (["--slope_frac=0.01"], "two evaluations"),
    (["--set", "learnin_rate=0.1"], "learnin_rate"),
    (["--set", "max_iters"], "max_iters"),
    (["--set", "max_iters=many"], "many"),
    (["--set", "seed=4"], "--seeds"),
    (["--set", "out_dir=elsewhere"], "--runs_dir"),
    (["--set", "data=/no/such/corpus.txt"], "/no/such/corpus.txt"),
    (["--set_for=nonexistent:init=nanogpt"], "nonexistent"),
    (["--set_for=track3_baseline:bogus_key=1"], "bogus_key"),
    (["--seeds_for=track3_baseline:x"], "track3_baseline:x"),
    (["--seeds_for=track3_baseline:2"], "at least 3"),
    (["--reuse_report=missing.json"], "missing.json"),
    (["--step_time=missing.json"], "missing.json"),
    (["--preset=track4"], "track4"),
    (["--out=FILE/report"], "FILE"),
])
def test_mistakes_are_refused_in_one_line_before_any_run(trainer, tmp_path, capsys, args,
                                                         named):
    (tmp_path / "FILE").write_text("a file, not a folder")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    assert t3.main([f"--runs_dir={tmp_path / 'runs'}", f"--out={tmp_path / 'r'}", *SHORT,
                    *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert trainer == [] and not list((tmp_path / "runs").rglob("*.jsonl"))


def test_a_failed_run_ends_the_tool_in_one_line_and_is_never_reused(tmp_path, monkeypatch,
                                                                    capsys):
    def failing(cmd):
        out = Path(next(a for a in cmd if a.startswith("--out_dir="))[len("--out_dir="):])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 20, "val_loss": 1.0}\n')
        return subprocess.CompletedProcess(cmd, 2, "", "error: the step cannot fit\n")

    monkeypatch.setattr(t3, "launch", failing)
    assert tool(tmp_path)[0] == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the step cannot fit" in err and "train.log" in err
    (folder,) = (tmp_path / "runs").rglob("seed0")
    assert not (folder / t3.KEY_FILE).exists()  # its metrics reach step 20, yet:
    calls = []
    monkeypatch.setattr(t3, "launch", fake_launch(calls))
    assert tool(tmp_path)[0] == 0 and len(calls) == 6


def test_one_seed_with_a_given_sigma_is_accepted(trainer, tmp_path):
    status, report = tool(tmp_path, "--sigma=0.01", seeds=1)
    assert status == 0 and len(trainer) == 2 and report["sigma"] == 0.01


def test_help_is_sentences_with_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        t3.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "reused only when" in text and "exit status 2" in text
    for action in t3.parser()._actions:
        assert action.help[0].isupper() and action.help.rstrip().endswith((".", ")")), action
        if "--help" not in action.option_strings:
            assert "(default: " in action.help, action.option_strings


# --------------------------------------------------------------------------- statistics


def test_a_paired_test_of_equal_differences_gives_no_p():
    same = t3.paired_t_test({0: 1.0, 1: 2.0, 2: 4.0}, {0: 1.5, 1: 2.5, 2: 4.5})
    assert same["t"] is None and same["p"] is None
    assert same["note"] == "all differences equal" and same["mean_diff"] == 0.5
    # equal up to the rounding of the subtraction: 0.3 - 0.1 != 0.9 - 0.7 in float64
    assert 0.3 - 0.1 != 0.9 - 0.7
    rounded = t3.paired_t_test({0: 0.1, 1: 0.7}, {0: 0.3, 1: 0.9})
    assert rounded["p"] is None and rounded["note"] == "all differences equal"
    # a real spread still gives a test
    spread = t3.paired_t_test({0: 1.0, 1: 2.0, 2: 4.0}, {0: 1.5, 1: 2.5, 2: 4.6})
    assert spread["p"] is not None and 0 < spread["p"] < 1 and spread["note"] is None
    assert t3.paired_t_test({0: 1.0}, {0: 2.0})["note"] == "fewer than two pairs"


def test_the_report_says_when_all_differences_are_equal(tmp_path):
    steps = [0, 50, 80, 90, 100]
    curves = {"base": {s: {t: 3.0 - t / 100 + 0.01 * s for t in steps} for s in range(3)},
              "shifted": {s: {t: 2.9 - t / 100 + 0.01 * s for t in steps} for s in range(3)}}
    summary = t3.summarize(curves)
    final = summary["paired"]["shifted"]["final_loss"]
    assert final["p"] is None and final["note"] == "all differences equal"
    t3.write_report(summary, tmp_path / "r", "equal")
    md = (tmp_path / "r.md").read_text()
    assert "n/a (all differences equal)" in md
    assert json.loads((tmp_path / "r.json").read_text())["paired"]["shifted"][
        "final_loss"]["p"] is None


def test_sigma_from_fewer_than_three_seeds_is_refused_unless_given():
    curves = {"base": {s: {0: 3.0, 100: 2.0 + 0.01 * s} for s in range(2)}}
    with pytest.raises(ValueError, match="at least 3 baseline seeds, got 2"):
        t3.summarize(curves, slope_frac=1.0)
    assert t3.summarize(curves, sigma=0.01, slope_frac=1.0)["sigma"] == 0.01
    curves["base"][2] = {0: 3.0, 100: 2.05}
    assert t3.summarize(curves, slope_frac=1.0)["sigma"] == pytest.approx(
        np.std([2.0, 2.01, 2.05], ddof=1))


# ---------------------------------------------------------------------------- the plots


def _target_lines(ax, value):
    return [line for line in ax.get_lines()
            if np.allclose(line.get_ydata(), value) and len(set(line.get_xdata())) == 2
            and f"{value:g}"[:4] in line.get_label()]


def test_the_report_plot_draws_the_labelled_target_in_both_panels():
    steps = [0, 50, 80, 90, 100]
    curves = {name: {s: {t: 3.0 - t / 100 + shift + 0.01 * s * s for t in steps}
                     for s in range(3)} for name, shift in (("base", 0.0), ("new", -0.02))}
    summary = t3.summarize(curves)
    target = summary["target"]
    fig = t3.plot_report(summary, "title")
    whole, tail = fig.axes
    for ax in (whole, tail):
        (line,) = _target_lines(ax, target)
        assert line.get_label() == f"target {target:.3f}"
        assert line.get_label() in [t.get_text() for t in ax.get_legend().get_texts()]
        low, high = ax.get_ylim()
        assert low < target < high
    assert tail.get_title() == "second half"


def test_the_trainer_knows_track_3s_target_on_its_task_only():
    # records/track_3_optimization/README.md: a mean val loss below 3.28
    track3 = tc.get_preset("track3")
    assert metrics.loss_target(track3, 50257).value == 3.28
    other_recipe = tc.override(track3, optimizer="snoo_track3_baseline", max_iters=2000)
    assert metrics.loss_target(other_recipe, 50257).value == 3.28
    assert metrics.loss_target(track3, 65) is None  # the network on characters
    assert metrics.loss_target(tc.override(track3, n_layer=6), 50257) is None
    assert metrics.loss_target(tc.get_preset("track3_cpu"), 65) is None  # no fixed target


def test_loss_png_draws_the_target_of_the_runs_task(tmp_path, monkeypatch):
    """A tiny run whose task is given a target: the loop's `loss.png` draws it."""
    monkeypatch.setitem(tc.PRESETS, "tiny_task", dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, val_tokens=256, batch_size=8,
        mesh_data=1, dtype="float32", optimizer="adamw", max_iters=2, eval_interval=1,
        checkpoint_every=2, num_samples=0, progress=False))
    monkeypatch.setattr(metrics, "LOSS_TARGETS",
                        (metrics.LossTarget(4.125, "Tiny", "tiny_task", 65),))
    figures = []

    def plot(*args, **kwargs):
        figures.append(metrics.plot_losses(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(loop, "plot_losses", plot)
    loop.run(tc.override(tc.get_preset("tiny_task"), out_dir=str(tmp_path / "run")))
    (fig,) = figures
    (line,) = _target_lines(fig.axes[0], 4.125)
    assert line.get_label() == "Tiny target 4.125"
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0


# -------------------------------------------------------------- one real run, end to end


def test_a_real_run_is_keyed_then_reused(tmp_path, monkeypatch):
    tiny = ["n_layer=1", "n_embd=32", "n_head=2", "block_size=16", "batch_size=2",
            "grad_accum=1", "mesh_data=1", "max_iters=4", "eval_interval=2",
            "eval_interval_tail=1", "eval_tail_frac=0.5", "val_tokens=64",
            "checkpoint_every=4"]
    args = [f"--runs_dir={tmp_path / 'runs'}", f"--out={tmp_path / 'report'}",
            "--optimizers=track3_baseline", "--seeds=1", "--sigma=0.01", "--slope_frac=0.5",
            *(f"--set={kv}" for kv in tiny)]
    assert t3.main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    (folder,) = seed_folders(report, "track3_baseline")
    key = json.loads((folder / t3.KEY_FILE).read_text())
    assert key["config"]["run"]["max_iters"] == 4 and key["config"]["model"]["n_embd"] == 32
    curve = t3.read_curve(folder / "metrics.jsonl")
    assert sorted(curve) == [0, 2, 3, 4] and all(math.isfinite(v) for v in curve.values())

    def no_run(cmd):
        raise AssertionError(f"reran {cmd}")

    monkeypatch.setattr(t3, "launch", no_run)
    assert t3.main(args) == 0
    assert json.loads((tmp_path / "report.json").read_text())["wall_s"] == {
        "track3_baseline/0": None}


# ------------------------------------------------------------------ Track 3's table


def test_the_table_runs_every_registered_row_with_its_networks_options(trainer, tmp_path):
    """`--table`: every recipe of TRACK3_TABLE the registry has, #36 first, the hyperball
    rows with their records' init; the report's table holds Track 3's steps beside the
    twin's figures and the rank correlation."""
    from optax_snoo import recipes

    status, report = tool(tmp_path, "--table", seeds=3)
    assert status == 0
    table = [n for n in t3.TRACK3_TABLE if n in recipes.REGISTRY]
    labels = list(report["optimizers"])
    assert [label.split("[")[0] for label in labels] == table and table[0] == "track3_baseline"
    assert "adamh[init=hyperball]" in labels and "muonh[init=hyperball]" in labels
    assert "track3_dynmuon[gradient_scale=0.00048828125]" in labels  # 1/2048, the twin's
    assert len(trainer) == 3 * len(table)
    rows = report["table"]["rows"]
    assert {n: r["track3_steps"] for n, r in rows.items()}["track3_record"] == 2690
    assert report["table"]["spearman_final_loss"] is not None
    markdown = (tmp_path / "report.md").read_text()
    assert "Track 3's table on the twin" in markdown and "Spearman" in markdown


def test_the_table_gives_dynmuon_the_runs_own_gradient_scale():
    """DynMuon's power map is not scale-free: its gradient_scale (the record's 1/(8*64*1024),
    the mean token's gradient from the summed loss) is one over the run's tokens per step
    on the twin (8 sequences x 2 micro-batches x 128 tokens), 1 with the mean loss, the
    record's own on the record's shape; other rows get their network's options only."""
    assert t3.table_options("track3_dynmuon", "track3_cpu") == ["gradient_scale=0.00048828125"]
    assert t3.table_options("track3_dynmuon", "track3_cpu", ["--batch_size=4"]) == [
        "gradient_scale=0.0009765625"]  # 1/(4 x 2 x 128)
    assert t3.table_options("track3_dynmuon", "track3_cpu", ["--loss_reduction=mean"]) == [
        "gradient_scale=1.0"]
    assert t3.table_options("track3_dynmuon", "track3") == []
    assert t3.table_options("track3_aurora_proj", "track3_cpu") == ["init=cgi"]
    assert t3.table_options("track3_baseline", "track3_cpu") == []


def test_the_tables_rank_correlation():
    """Spearman's rho of Track 3's steps with the twin's: +1 for the same order, -1 for the
    reverse; a row without a result ranks last."""
    def summary(finals, results):
        return {"optimizers": {f"r{i}": {"final_mean": f, "result_step": r, "steps": [0, 100]}
                               for i, (f, r) in enumerate(zip(finals, results, strict=True))}}
    names = {"r0": "track3_record", "r1": "track3_soap_muon_record", "r2": "track3_baseline",
             "r3": "track3_adam"}  # Track 3: 2690 < 2750 < 3250 < 5625
    same = t3.track3_table(summary([1.80, 1.82, 1.88, 1.95], [60, 70, 90, None]), names)
    assert same["spearman_final_loss"] == pytest.approx(1.0)
    assert same["spearman_result_step"] == pytest.approx(1.0)  # None ranks last (101)
    reverse = t3.track3_table(summary([1.95, 1.88, 1.82, 1.80], [None, 90, 70, 60]), names)
    assert reverse["spearman_final_loss"] == pytest.approx(-1.0)
    assert reverse["spearman_result_step"] == pytest.approx(-1.0)
    assert t3.spearman([1, 2], [2, 1]) is None


def test_the_table_plot_puts_each_row_at_its_track3_steps_and_twin_loss(tmp_path):
    """One point per row at (Track 3's steps, the twin's final mean), its std as the error
    bar and its row number beside it; rho in the title; written beside the report."""
    steps = [0, 50, 80, 90, 100]
    curves = {name: {s: {t: 3.0 - t / 100 + shift + 0.01 * s for t in steps} for s in range(3)}
              for name, shift in (("track3_baseline", 0.0), ("track3_adam", 0.2),
                                  ("track3_record", -0.05))}
    summary = t3.summarize(curves)
    summary["table"] = t3.track3_table(summary, {n: n for n in curves})
    fig = t3.plot_table(summary)
    (ax,) = fig.axes
    points = {(float(c.lines[0].get_xdata()[0]), round(float(c.lines[0].get_ydata()[0]), 9))
              for c in ax.containers}  # each errorbar's (data line, caps, bar lines)
    assert points == {(3250.0, round(summary["optimizers"]["track3_baseline"]["final_mean"], 9)),
                      (5625.0, round(summary["optimizers"]["track3_adam"]["final_mean"], 9)),
                      (2690.0, round(summary["optimizers"]["track3_record"]["final_mean"], 9))}
    assert {t.get_text() for t in ax.texts} == {"#36", "#2", "#46"}
    assert ax.get_title() == "Track 3's table on the twin: Spearman's rho +1.00"
    bars = ax.containers[0].lines[2][0]  # the baseline's
    low, high = bars.get_segments()[0][:, 1]
    assert high - low == pytest.approx(2 * summary["optimizers"]["track3_baseline"]["final_std"])
    t3.write_report(summary, tmp_path / "r", "table")
    assert (tmp_path / "r_table.png").stat().st_size > 0


def _step_time(flops: bool) -> dict:
    rows = {"base": (100.0, 1.0, 10.0), "shifted": (150.0, 1.5, 12.5)}
    out = {"date": "d", "cpu": "cpu", "bf16_flags": "none", "load": [[1.0], [2.0]],
           "rounds": 2, "steps": 1, "optimizers": {}}
    for name, (ms, ratio, gflop) in rows.items():
        r = {"options": [], "ms_per_step": ms, "ratio": ratio, "ratio_range": [ratio, ratio]}
        if flops:
            r.update(gflop=gflop, gflop_eigh=2 * gflop, floor=gflop / 10.0)
        out["optimizers"][name] = r
    return out


@pytest.mark.parametrize("flops", [False, True])
def test_the_reports_step_time_table_shows_the_flop_floor_when_measured(tmp_path, flops):
    steps = [0, 50, 80, 90, 100]
    curves = {"base": {s: {t: 3.0 - t / 100 + 0.01 * s for t in steps} for s in range(3)},
              "shifted": {s: {t: 2.9 - t / 100 + 0.02 * s for t in steps} for s in range(3)}}
    summary = t3.summarize(curves)
    summary["step_time"] = _step_time(flops)
    t3.write_report(summary, tmp_path / "r", "step time")
    rows = [line for line in (tmp_path / "r.md").read_text().splitlines()
            if line.startswith("| shifted | - | 150 |")]
    assert rows == [("| shifted | - | 150 | 1.50 | 1.50-1.50 |"
                     + (" 12.50 (25.00) | 1.25 |" if flops else ""))]


def test_step_flops_counts_a_compiled_programs_dots_and_a_refresh_by_eigh():
    """`track3_step_time.step_flops` on a step shaped as the trainer's: a guard that skips
    or updates, the update one 32x64 @ 64x16 dot and its Gram, and an eigh of the 16x16
    Gram in one branch of a refresh conditional: the step without eigh counts the dots
    (2 m n k) and no eigh, the step refreshing by eigh adds `benchmarks.hlo`'s 9 n³."""
    import jax
    import jax.numpy as jnp

    from benchmarks.track3_step_time import step_flops

    def update(a, b, refresh):
        c = a @ b
        gram = c.T @ c
        return c, jax.lax.cond(refresh, lambda g: jnp.linalg.eigh(g)[1], lambda g: g, gram)

    def f(a, b, refresh, ok):
        skip = lambda a, b, r: (jnp.zeros((32, 16)), jnp.zeros((16, 16)))
        return jax.lax.cond(ok, update, skip, a, b, refresh)

    args = (jnp.ones((32, 64)), jnp.ones((64, 16)), True, True)
    r = step_flops(jax.jit(f).lower(*args).compile().as_text())
    dots = 2 * 32 * 64 * 16 + 2 * 16 * 16 * 32
    assert dots <= r["gflop"] * 1e9 < dots + 32 * 64 * 4  # and some elementwise work
    assert r["gflop_eigh_part"] * 1e9 == 9 * 16 ** 3
    assert r["gflop_eigh"] * 1e9 >= r["gflop"] * 1e9 + 9 * 16 ** 3


def test_step_flops_counts_an_eigh_every_step_inside_a_guard():
    """A step whose update runs `eigh` every time, inside a skip-or-update conditional
    (the trainer's non-finite guard): its steady step is the update with the eigh, not
    the skip branch."""
    import jax
    import jax.numpy as jnp

    from benchmarks.track3_step_time import step_flops

    def f(a, ok):
        gram = a.T @ a
        return jax.lax.cond(ok, lambda g: jnp.linalg.eigh(g)[1] @ g, lambda g: g, gram)

    r = step_flops(jax.jit(f).lower(jnp.ones((32, 16)), True).compile().as_text())
    assert r["gflop"] == r["gflop_eigh"]
    assert r["gflop"] * 1e9 >= 2 * 16 * 16 * 32 + 9 * 16 ** 3 + 2 * 16 ** 3
