"""Newton-Muon in the trainer (`--optimizer=newton_muon`): the loss falls on the tiny
config, and the input covariances the step captures on a refresh step are those of that
step's batch and params (one factor for q/k/v, the MLP's 4x wider input in 4 blocks)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import models
import optax_snoo
import train
from optax_snoo import kfac
from train import config as tc
from train.kfac_trainer import newton_muon_layers
from train.sharding import batch_sharding, put_batch
from train.step import create_train_state, cross_entropy
from trainer.support import random_batches, step_setup

pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(corpus, tmp_path, **overrides) -> tc.TrainConfig:
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        optimizer="newton_muon", adam_learning_rate=1e-2, muon_learning_rate=0.02,
        final_lr_scale=0.1, warmup_iters=3, max_iters=12, lr_decay_iters=12, eval_interval=6,
        eval_iters=2, log_interval=6, checkpoint_every=100, mesh_data=1, num_samples=0,
        progress=False, bias=True, newton_refresh_every=3, vocab_multiple=8, data=str(corpus),
        out_dir=str(tmp_path / "run"))
    return tc.override(tc.TrainConfig(), **{**base, **overrides})


def _preconditioner_state(state):
    is_state = lambda x: isinstance(x, optax_snoo.InputCovarianceState)
    (found,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_state)
                if is_state(s)]
    return found


def test_newton_muon_run_loss_falls(corpus, tmp_path):
    result = train.run(tiny(corpus, tmp_path))
    evals = [h["val_loss"] for h in result.history if "val_loss" in h]
    assert evals[-1] < evals[0] - 0.3, evals


def test_refresh_step_reads_its_own_batch(corpus, tmp_path):
    config = tiny(corpus, tmp_path)
    mesh, state, step, _, vocab_size = step_setup(config)
    batches = random_batches(config, 3, vocab_size)
    put = lambda x: put_batch(x, batch_sharding(mesh))
    for xy in batches[:2]:
        state, _ = step(state, put(xy[0]), put(xy[1]))
    assert int(_preconditioner_state(state).refreshes) == 0
    params, (inputs, targets) = state.params, batches[2]
    model, _ = create_train_state(tc.model_config(config, vocab_size), optax.identity(),
                                  seed=0, mesh=mesh)

    def loss_fn(p):   # the trainer's loss, written out
        logits, aux, _ = models.forward(model.merge(p), inputs[0])
        return cross_entropy(logits, targets[0]) + aux

    layers = newton_muon_layers(params)
    assert all("c_k" not in p and "c_v" not in p for p in layers)
    _, _, stats = jax.jit(lambda p: kfac.value_grad_and_stats(loss_fn, p, layers=layers))(params)
    k = optax_snoo.input_covariance_from_stats(stats)
    state, _ = step(state, put(inputs), put(targets))      # update 2: the first refresh
    pre = _preconditioner_state(state)                     # (the step donates `params`)
    assert int(pre.refreshes) == 1
    covariances = {"/".join(path): c for path, c in _flat(pre.covariances)}
    assert sorted(covariances) == sorted(layers)
    for path, c in covariances.items():
        blocks = c.shape[-3]
        want = np.asarray(k[path], np.float64)
        b = want.shape[-1] // blocks
        want = np.stack([want[i * b:(i + 1) * b, i * b:(i + 1) * b] for i in range(blocks)])
        want = 0.95 * 1e-3 * np.eye(b) + 0.05 * want
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-7, err_msg=path)
    assert covariances["blocks/0/mlp/c_proj/kernel"].shape == (4, 32, 32)


def _flat(tree):
    return [(tuple(str(k.key) for k in path), x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
