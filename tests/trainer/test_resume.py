"""Resume and checkpoint retention: history, plots and disk across `--resume`.

Tiny models on the small synthetic corpus of conftest.py, as in test_train.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

import train
from train import config as tc
from train.checkpoint import Checkpointer

pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(corpus, out_dir, **overrides) -> tc.TrainConfig:
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        optimizer="adamw", learning_rate=1e-2, final_lr_scale=0.1, warmup_iters=2,
        max_iters=8, lr_decay_iters=10, eval_interval=4, eval_iters=2, log_interval=1,
        checkpoint_every=4, mesh_data=1, num_samples=0, progress=False,
        data=str(corpus), out_dir=str(out_dir))
    return tc.override(tc.TrainConfig(), **{**base, **overrides})


def logged(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_retention_across_resumes_keeps_the_latest_two_and_the_oldest_best(tmp_path):
    """Each resume opens a new manager on the same folder; the best (lowest val loss) is
    the very first step, and more steps are written than kept."""
    state = {"w": jnp.arange(4.0)}
    runs = [[(10, 1.0), (20, 3.0), (30, 2.5)], [(40, 2.0), (50, 4.0)], [(60, 1.5), (70, 5.0)]]
    kept = []
    for run in runs:
        ckpt = Checkpointer(tmp_path / "ckpt")
        for step, val_loss in run:
            ckpt.save(step, state, {"step": step}, val_loss=val_loss)
        ckpt.close()
        kept.append(Checkpointer(tmp_path / "ckpt", read_only=True).steps())
    assert kept == [[10, 20, 30], [10, 40, 50], [10, 60, 70]]


def test_resumed_run_deletes_the_earlier_runs_checkpoints(corpus, tmp_path, capsys):
    """The issue's case scaled down: 6 steps, then resumed to 10, a checkpoint every 2.
    A resume that moves the schedule's end says so in one line; one that keeps it, not."""
    config = tiny(corpus, tmp_path / "run", max_iters=6, checkpoint_every=2, eval_interval=2)
    train.run(config)
    train.run(tc.override(config, max_iters=10, resume=True))  # the cosine still ends at 10
    assert "warning" not in capsys.readouterr().err
    train.run(tc.override(config, max_iters=12, resume=True, lr_decay_iters=None))
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning")]
    assert len(warned) == 1 and "schedules now end at step 12, not 10" in warned[0], warned
    val = {h["step"]: h["val_loss"] for h in logged(tmp_path / "run") if "val_loss" in h}
    best = min((s for s in val if s > 0), key=val.get)
    assert Checkpointer(tmp_path / "run" / "checkpoints").steps() == sorted({best, 10, 12})


def test_resume_plots_and_summarises_the_whole_run(corpus, tmp_path):
    """loss.png of a run resumed half-way (and of a finished run resumed again) is the
    uninterrupted run's, byte for byte; so are the final losses."""
    # the same run name (out_dir's last part, in the plot's title) in two folders
    whole = train.run(tiny(corpus, tmp_path / "whole" / "run"))
    half = tiny(corpus, tmp_path / "half" / "run", max_iters=4)
    train.run(half)
    resumed = train.run(tc.override(half, max_iters=8, resume=True))
    again = train.run(tc.override(half, max_iters=8, resume=True))  # nothing to do
    png = lambda name: (tmp_path / name / "run" / "loss.png").read_bytes()
    assert png("half") == png("whole")
    keys = ("step", "val_loss", "best_val_loss", "train_loss")
    for result in (resumed, again):
        assert {k: result.final[k] for k in keys} == {k: whole.final[k] for k in keys}
    assert again.history == []  # this invocation logged nothing


def test_final_step_is_checkpointed_and_logged_off_the_intervals(corpus, tmp_path):
    config = tiny(corpus, tmp_path / "run", max_iters=10, checkpoint_every=4,
                  eval_interval=4, log_interval=3)
    result = train.run(config)
    rows = logged(tmp_path / "run")
    assert [h["step"] for h in rows if "loss" in h] == [3, 6, 9, 10]
    assert [h["step"] for h in rows if "val_loss" in h] == [0, 4, 8, 10]
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True)
    assert ckpt.steps()[-2:] == [8, 10]
    assert ckpt.restore_meta(10)["step"] == 10
    assert result.final["step"] == 10

    # no step: refused before anything is written (it once compiled and saved step 0)
    zero = tiny(corpus, tmp_path / "zero", max_iters=0)
    with pytest.raises(ValueError, match=r"^--max_iters=0: --optimizer=adamw needs at least 1 "
                                         r"step"):
        train.run(zero)
    assert not (tmp_path / "zero").exists()
