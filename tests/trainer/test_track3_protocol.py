"""The trainer's Track-3 options: the file's evaluation cadence, the summed loss, the
#36 optimizer's groups, and a run on the sequential order with the val split's first
windows that resumes exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import train
from optax_snoo import recipes
from train import config as tc
from train.data import TokenDataset
from train.optimizers import TrainOptimizer, build_optimizer
from train.sharding import make_mesh, tree_shardings
from train.step import create_train_state, make_train_step

pytestmark = pytest.mark.usefixtures("compilation_cache")


def file_eval_steps(train_steps):
    """train_gpt_simple.py's validation steps, its loop as written."""
    steps = []
    for step in range(train_steps + 1):
        val_step_freq = 125 if step / train_steps < 0.9 else 25
        if step == train_steps or step % val_step_freq == 0:
            steps.append(step)
    return steps


@pytest.mark.parametrize("train_steps", [3250, 3000, 1000, 333])
def test_cadence_is_the_files(train_steps):
    run = tc.RunConfig(max_iters=train_steps, eval_interval=125, eval_interval_tail=25,
                       eval_tail_frac=0.1)
    assert [s for s in range(train_steps + 1) if run.is_cadence_step(s)] == file_eval_steps(
        train_steps)


def test_cadence_without_a_tail_is_every_interval_and_the_end():
    run = tc.RunConfig(max_iters=10, eval_interval=4)
    assert [s for s in range(11) if run.is_cadence_step(s)] == [0, 4, 8, 10]
    with pytest.raises(ValueError, match="eval_tail_frac=1.5"):
        tc.RunConfig(eval_tail_frac=1.5)
    with pytest.raises(ValueError, match="eval_interval_tail=0"):
        tc.RunConfig(eval_interval_tail=0)


def _state(n_devices=1):
    gpt = models.GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16,
                           dtype="float32")
    config = tc.override(tc.TrainConfig(), mesh_data=n_devices)
    mesh = make_mesh(config)
    tx = optax.with_extra_args_support(optax.sgd(1.0))
    model, state = create_train_state(gpt, tx, seed=0, mesh=mesh)
    spec = TrainOptimizer(tx, optax.constant_schedule(1.0))
    return model, state, spec, mesh


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_reduction_is_the_gradient_of_the_summed_token_loss(reduction):
    model, state, spec, mesh = _state()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, (2, 4, 8)).astype(np.int32)  # 2 micro-batches of 4 x 8
    y = rng.integers(0, 17, (2, 4, 8)).astype(np.int32)
    params = jax.tree.map(np.asarray, state.params)

    def summed(p):  # the file's F.cross_entropy(..., reduction="sum") over the step
        total = 0.0
        for a in range(2):
            logits = models.forward(model.merge(p), x[a])[0].astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            total += -jnp.take_along_axis(logp, y[a][..., None], -1).sum()
        return total

    expected = jax.grad(summed)(params)
    if reduction == "mean":
        expected = jax.tree.map(lambda g: g / x.size, expected)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh),
                           max_bad_steps=None, loss_reduction=reduction)
    new, metrics = step(state, x, y)
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6 * (x.size if
                                                                     reduction == "sum" else 1))
    # the logged loss is the mean either way
    assert float(metrics["loss"]) == pytest.approx(float(summed(params)) / x.size, rel=1e-5)


def test_loss_reduction_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="loss_reduction"):
        tc.override(tc.TrainConfig(), loss_reduction="max")
    model, _, spec, mesh = _state()
    kfac_like = TrainOptimizer(spec.tx, spec.learning_rate, grad_fn=lambda m, p: None)
    with pytest.raises(ValueError, match="loss_reduction='sum' needs plain gradients"):
        make_train_step(model, kfac_like, mesh=mesh, state_shardings=None,
                        loss_reduction="sum")


def test_track3_optimizer_groups_and_one_step_of_each_adamw_group():
    params = {"wte": {"embedding": jnp.full((5, 4), 0.5)},
              "lm_head": {"kernel": jnp.full((4, 5), 0.5), "bias": jnp.full((5,), 0.5)},
              "ln_f": {"scale": jnp.ones(4)},
              "blocks": {0: {"attn": {"c_q": {"kernel": jnp.eye(4), "bias": jnp.zeros(4)}}}}}
    # The record's groups: every 1-D parameter (the head's bias too), embedding, head.
    assert recipes.describe("track3_baseline", params) == {
        "blocks/0/attn/c_q/bias": "vectors", "blocks/0/attn/c_q/kernel": "muon",
        "lm_head/bias": "vectors", "lm_head/kernel": "head", "ln_f/scale": "vectors",
        "wte/embedding": "embed"}
    config = tc.get_preset("track3_cpu")
    spec = build_optimizer(config)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1) * jnp.arange(1, p.size + 1).reshape(
        p.shape), params)
    state = spec.tx.init(params)
    p = params
    # (group lr, the leaf): the embedding, the head's kernel, its bias and a gain
    leaves = {"embed": (0.7, ("wte", "embedding")), "head": (0.004, ("lm_head", "kernel")),
              "head bias": (0.015, ("lm_head", "bias")), "gain": (0.015, ("ln_f", "scale"))}
    get = lambda tree, path: np.asarray(tree[path[0]][path[1]], np.float64)
    ref = {k: get(params, path) for k, (_, path) in leaves.items()}
    m = {k: np.zeros_like(r) for k, r in ref.items()}
    v = {k: np.zeros_like(r) for k, r in ref.items()}
    for t in range(1, 4):  # torch.optim.AdamW, written out (flat lr: 3 < 30% of 300)
        updates, state = spec.tx.update(grads, state, p)
        p = optax.apply_updates(p, updates)
        for k, (lr, path) in leaves.items():
            g = get(grads, path)
            ref[k] = ref[k] * (1 - lr * 0.001)
            m[k] = 0.8 * m[k] + 0.2 * g
            v[k] = 0.95 * v[k] + 0.05 * g * g
            denom = np.sqrt(v[k]) / np.sqrt(1 - 0.95 ** t) + 1e-10
            ref[k] = ref[k] - lr / (1 - 0.8 ** t) * m[k] / denom
            np.testing.assert_allclose(get(p, path), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _tiny(corpus, out_dir, **overrides):
    base = dict(tc.PRESETS["track3_cpu"])
    base.update(dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, grad_accum=2,
                dtype="float32", max_iters=8, eval_interval=4, eval_interval_tail=1,
                eval_tail_frac=0.25, val_tokens=8 * 16 * 2, eval_iters=1, log_interval=1,
                checkpoint_every=4, mesh_data=1, progress=False, data=str(corpus),
                out_dir=str(out_dir)), **overrides)
    return tc.override(tc.TrainConfig(), **base)


def _logged(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_sequential_run_evaluates_the_first_val_windows_and_resumes_exactly(
        corpus, tmp_path, monkeypatch):
    whole = train.run(_tiny(corpus, tmp_path / "whole"))
    evals = [h["step"] for h in _logged(tmp_path / "whole") if "val_loss" in h]
    assert evals == [0, 4, 6, 7, 8]  # every 4, every step in the last 25%, the end
    # Stopped reading step 6's batch (the recipe's schedule is the run's: same max_iters).
    clean = TokenDataset.sequential_batch

    def failing(self, split, step, **kw):
        if split == "train" and step == 6:
            raise RuntimeError("stopped at step 6")
        return clean(self, split, step, **kw)

    monkeypatch.setattr(TokenDataset, "sequential_batch", failing)
    half = _tiny(corpus, tmp_path / "half")
    with pytest.raises(RuntimeError, match="stopped at step 6"):
        train.run(half)
    monkeypatch.undo()
    resumed = train.run(tc.override(half, resume=True))
    assert resumed.history[0]["step"] > 4  # it resumed from the checkpoint at 4
    losses = lambda out: {h["step"]: h["loss"] for h in _logged(out) if "loss" in h}
    assert losses(tmp_path / "half") == losses(tmp_path / "whole")  # the same batches
    assert resumed.final["val_loss"] == whole.final["val_loss"]
    # the val loss is the mean over the split's first 256 tokens as windows of 16
    data = TokenDataset.from_text(Path(corpus).read_text())
    x, _ = data.first_windows("val", num_tokens=256, batch_size=8, block_size=16)
    assert x.shape == (2, 8, 16)


def test_track3_presets_hold_the_files_values():
    full, twin = tc.get_preset("track3"), tc.get_preset("track3_cpu")
    d, r, m = full.data, full.run, full.model
    assert d.batch_size * d.grad_accum * m.block_size == 8 * 64 * 1024  # 524,288 tokens
    assert (r.max_iters, r.val_tokens, d.order, full.optimizer.loss_reduction) == (
        3250, 20 * 524288, "sequential", "sum")
    assert [s for s in range(3251) if r.is_cadence_step(s)] == file_eval_steps(3250)
    resolved = lambda config, vocab: dataclasses.replace(tc.model_config(config, vocab),
                                                         attention="auto")
    assert resolved(full, 50257) == models.track3_config(vocab_size=50304)
    for config in (full, twin):  # the #36 recipe on both, at its own constants
        o, t = config.optimizer, config.optimizer.table
        assert (o.name, o.grad_clip, o.hyperparameters) == ("track3_baseline", 0.0, {})
        assert (t.muon_learning_rate, t.muon_weight_decay, t.muon_momentum) == (
            0.025, 0.05, 0.95)
        assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
                t.adam_b1, t.adam_b2, t.adam_eps, t.adam_weight_decay) == (
                    0.7, 0.004, 0.015, 0.8, 0.95, 1e-10, 0.001)
        # flat for 30%, then linear to 0 at the run's end
        lr, steps = build_optimizer(config).learning_rate, config.run.max_iters
        assert [float(lr(t)) for t in (0, int(0.3 * steps) - 1, steps)] == pytest.approx(
            [0.025, 0.025, 0.0])
        assert float(lr(int(0.65 * steps))) == pytest.approx(0.0125, rel=1e-3)
    assert resolved(twin, 65) == models.track3_config(n_layer=4, n_embd=128, head_dim=32,
                                                      vocab_size=65, block_size=128)
    # one pass of the shipped characters holds the twin's steps
    assert twin.run.max_iters <= (1_003_854 - 2) // (8 * 2 * 128)
