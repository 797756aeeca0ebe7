"""The trainer with DiLoCo replicas (`--mesh_diloco`): exact resume, what the compiled
step moves across replicas, and the refusals. Tiny models on conftest.py's corpus."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

import train
from benchmarks import diloco as bench
from train import config as tc
from train.evaluate import evaluate_split
from train.optimizers import build_optimizer
from train.sharding import make_mesh
from train.step import create_train_state
from trainer.support import tiny as train_tiny

pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(corpus, out_dir, **overrides) -> tc.TrainConfig:
    """`support.tiny`'s run as two DiLoCo replicas of 2 fsdp devices each."""
    base = dict(lr_decay_iters=10, mesh_diloco=2, mesh_fsdp=2, vocab_multiple=None,
                out_dir=str(out_dir))
    return train_tiny(corpus, Path(out_dir), **{**base, **overrides})


def losses(out: Path) -> list[tuple]:
    return [(h["step"], h.get("loss"), h.get("val_loss"))
            for h in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_two_replicas_resume_exactly(corpus, tmp_path):
    """4 steps, then --resume to 8 (a checkpoint mid-period: syncs at 0, 3, 6), logs the
    same losses bit for bit as 8 steps in one go; a resume with another replica count is
    refused in one line."""
    whole = train.run(tiny(corpus, tmp_path / "whole"))
    half = tiny(corpus, tmp_path / "half", max_iters=4)
    train.run(half)
    resumed = train.run(tc.override(half, max_iters=8, resume=True))
    assert losses(tmp_path / "half") == losses(tmp_path / "whole")
    assert resumed.final["val_loss"] == whole.final["val_loss"]
    # The one-device tools restore the replicas and take replica 0, as the run evaluates.
    assert math.isfinite(evaluate_split(tmp_path / "whole", eval_tokens=256)["loss"])
    with pytest.raises(ValueError, match=r"it trained --mesh_diloco=2 replicas, this run "
                                         r"asks for --mesh_diloco=1"):
        train.run(tc.override(half, max_iters=10, resume=True, mesh_diloco=1, mesh_fsdp=1))


def test_compiled_step_moves_two_scalars_between_syncs(corpus):
    """(diloco=2, fsdp=4): a no-sync step's only cross-replica collective is the loss and
    grad norm (two float32 scalars); a sync step adds the pseudo-gradient's all-reduce,
    each device's share of the params (a quarter of one replica's); every optimizer-state
    leaf but the counts is laid out per replica."""
    config = tiny(corpus, "unused", mesh_fsdp=4)
    cost, params = bench.trainer_step_costs(config, block=4)
    assert cost[False][0] == 8
    assert cost[True][0] == params / 4 + 8
    config = dataclasses.replace(config, model=tc.model_config(config, 64))
    _, state = create_train_state(config.model, build_optimizer(config).replica_tx, seed=0,
                                  mesh=make_mesh(config))
    for leaf in jax.tree.leaves(state.opt_state):
        assert leaf.ndim == 0 or leaf.sharding.spec[0] == "diloco"


def test_refusals(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"--mesh_diloco=2: DiLoCo needs an optimizer wrapped "
                                         r"in Snoo .*; got --optimizer=adamw"):
        build_optimizer(tiny(corpus, tmp_path, optimizer="adamw"))
    with pytest.raises(ValueError, match="--mesh_diloco=3: 8 devices do not split into 3"):
        make_mesh(tiny(corpus, tmp_path, mesh_diloco=3))
    with pytest.raises(ValueError, match=r"--batch_size=6 does not divide over the 4 "
                                         r"data-parallel devices \(mesh diloco\*data\*fsdp=4"):
        train.run(tiny(corpus, tmp_path / "odd", batch_size=6))
    with pytest.raises(ValueError, match="mesh_diloco=0: expected a positive integer"):
        tiny(corpus, tmp_path, mesh_diloco=0)
