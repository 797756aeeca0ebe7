"""Faults: non-finite steps, killed runs, damaged checkpoints, unwritable outputs, full disks.

Each test checks what the trainer did and that no checkpoint it had written was lost.
Tiny models on a small synthetic corpus, as in test_train.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import train
from train import config as tc
from train import data as td
from train.checkpoint import Checkpointer
from train.nonfinite import NonFiniteError
from train.optimizers import build_optimizer, learning_rate_schedule
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step

SENTENCES = ("the king and the queen walk to the castle . a fool sings of love and war . "
             "my lord , the night is long and the wind is cold .")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(SENTENCES.split(), size=6000)) + "\n"
    path = tmp_path_factory.mktemp("corpus") / "input.txt"
    path.write_text(text)
    return path


def tiny(corpus, out_dir, **overrides) -> tc.TrainConfig:
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        optimizer="snoo_adamw", snoo_k=3, learning_rate=1e-2, min_lr=1e-3, warmup_iters=2,
        max_iters=8, lr_decay_iters=8, eval_interval=4, eval_iters=2, log_interval=1,
        checkpoint_every=4, mesh_data=1, num_samples=0, progress=False,
        data=str(corpus), out_dir=str(out_dir))
    return dataclasses.replace(tc.TrainConfig(), **{**base, **overrides})


def train_losses(history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


# ----------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("poison", ["inputs", "targets"])
def test_nonfinite_step_leaves_state_unchanged(corpus, tmp_path, poison):
    """An out-of-vocabulary id gathers NaN (jnp.take fills): the step changes no state."""
    config = tiny(corpus, tmp_path)
    vocab = td.CharDataset.load(corpus).vocab_size
    tx, _ = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, vocab), tx, seed=0, mesh=mesh)
    step = make_train_step(model, tx, mesh=mesh, state_shardings=tree_shardings(state, mesh),
                           lr_schedule=learning_rate_schedule(config), snoo=True,
                           max_bad_steps=2)
    put = lambda x: put_batch(x, batch_sharding(mesh))
    rng = np.random.default_rng(0)
    xy = rng.integers(0, vocab, (2, 1, 8, 16)).astype(np.int32)
    state, metrics = step(state, put(xy[0]), put(xy[1]), False)  # one good step
    assert float(metrics["skipped"]) == 0.0
    before = jax.tree.map(lambda x: np.array(x, copy=True), state)
    bad = xy.copy()
    bad[0 if poison == "inputs" else 1, 0, 3, 5] = 10 * vocab
    for t in range(3):  # a sync step (Snoo's outer update would move its slow copy), twice
        state, metrics = step(state, put(bad[0]), put(bad[1]), True)
        assert not np.isfinite(float(metrics["loss"]) + float(metrics["grad_norm"]))
        assert float(metrics["skipped"]) == 1.0
        assert int(state["bad_steps"]) == t + 1 and int(state["skipped_steps"]) == t + 1
        after = {k: v for k, v in state.items() if k not in ("bad_steps", "skipped_steps")}
        jax.tree.map(np.testing.assert_array_equal, after,
                     {k: v for k, v in before.items() if k in after})
    # Latched: past max_bad_steps even a good batch is skipped (the host stops the run).
    state, metrics = step(state, put(xy[0]), put(xy[1]), False)
    assert float(metrics["skipped"]) == 1.0 and int(state["bad_steps"]) == 4


def test_run_skips_bad_steps_then_stops_keeping_the_last_good_checkpoint(
        corpus, tmp_path, monkeypatch):
    """Step 2 is poisoned (skipped, run goes on); steps >= 5 all are: stop after 2 in a row."""
    clean = td.CharDataset.batch

    def poisoned(self, split, step, **kw):
        x, y = clean(self, split, step, **kw)
        if split == "train" and (step == 2 or step >= 5):
            x = x.copy()
            x[0, 0, 0] = 10 * self.vocab_size
        return x, y

    monkeypatch.setattr(td.CharDataset, "batch", poisoned)
    config = tiny(corpus, tmp_path / "run", max_bad_steps=2)
    with pytest.raises(NonFiniteError, match=r"(?s)stopping at step 7: 2 consecutive.*"
                                             r"--max_bad_steps=2.*steps \[4\]"):
        train.run(config)
    lines = [json.loads(x)
             for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {h["step"]: h for h in lines if "loss" in h}
    assert [by_step[s]["skipped"] for s in range(1, 8)] == [0, 0, 1, 0, 0, 1, 1]
    assert [by_step[s]["skipped_steps"] for s in (3, 4, 6, 7)] == [1, 1, 2, 3]
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    assert ckpt.steps() == [4]  # nothing saved after the bad run; step 4 is whole
    meta = ckpt.restore_meta(4)
    assert meta["step"] == 4 and np.isfinite(meta["val_loss"])
    ckpt.close()
