"""K-FAC in the trainer: `--optimizer=kfac`/`snoo_kfac`, statistics from the step, refresh
events against the planned refresh steps, warm start, accumulation, 8 devices vs 1.

Tiny models on a small synthetic corpus; the 8 CPU devices come from conftest.py.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import train
from benchmarks import hlo
from optax_snoo import kfac
from references.error import assert_as_accurate, float64, in_float64
from references.gpt64 import FLOAT64_DTYPES
from references.kfac import dense_factors64
from train import config as tc
from train.kfac_trainer import (
    grad_and_curvature_fn,
    kfac_curvature_fn,
    kfac_refresh_policy,
    kfac_schedule,
)
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, put_batch
from train.step import ModelDef
from trainer.support import step_setup

# Runs of the same config compile the same programs: cached for this module.
pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(corpus, tmp_path, **overrides) -> tc.TrainConfig:
    """A 12-step K-FAC run (both groups at 1e-2); `overrides` apply after, as flags after a
    preset (a new optimizer keeps the base's hyperparameters it reads)."""
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        optimizer="kfac", kfac_learning_rate=1e-2, adam_learning_rate=1e-2,
        final_lr_scale=0.1, warmup_iters=3, max_iters=12, lr_decay_iters=12, eval_interval=6,
        eval_iters=2, log_interval=5, checkpoint_every=100, mesh_data=1, num_samples=0,
        progress=False, bias=True, kfac_interval=3, kfac_first=1, kfac_damping=1e-2,
        vocab_multiple=8, data=str(corpus), out_dir=str(tmp_path / "run"))
    return tc.override(tc.override(tc.TrainConfig(), **base), **overrides)


def _events(result) -> list[dict]:
    path = result.out_dir / "refresh_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_run(config, result):
    evals = [h["val_loss"] for h in result.history if "val_loss" in h]
    assert evals[-1] < evals[0] - 0.3, evals
    rows = _events(result)
    planned = kfac.refresh_steps(kfac_refresh_policy(config), kfac_schedule(config),
                                 config.run.max_iters).tolist()
    assert len(planned) >= 2
    assert [r["step"] for r in rows] == planned
    assert [r["refresh"] for r in rows] == list(range(1, len(planned) + 1))
    lrs = [float(kfac_schedule(config)(s)) for s in planned]
    np.testing.assert_allclose([r["lr"] for r in rows], lrs, rtol=1e-6)
    for r in rows:
        assert 0 < r["a_eig_max"] < np.inf and r["a_eig_min"] <= r["a_eig_max"]
        assert 0 < r["g_eig_max"] < np.inf and r["g_eig_min"] <= r["g_eig_max"]
    assert (result.out_dir / "refresh_events.png").stat().st_size > 0


def test_kfac_run_loss_falls_and_logs_the_planned_refreshes(corpus, tmp_path):
    """Refresh every 3 steps from step 1, log every 5: rows are written from the counter,
    so refreshes between logging steps are not lost; warm start from 2 batches."""
    config = tiny(corpus, tmp_path, kfac_warm_start=2)
    assert build_optimizer(config).takes_curvature
    _check_run(config, train.run(config))


def test_snoo_kfac_with_lr_ratio_refreshes(corpus, tmp_path):
    config = tiny(corpus, tmp_path, optimizer="snoo_kfac", snoo_k=3, kfac_refresh="lr_ratio",
                  kfac_tau=0.3, kfac_interval=6, kfac_min_interval=2)
    _check_run(config, train.run(config))


def test_resumed_run_keeps_earlier_refresh_rows(corpus, tmp_path):
    config = tiny(corpus, tmp_path, max_iters=6, checkpoint_every=3, kfac_refresh="by_lr_phase",
                  kfac_phases="once,2,2,2")
    first = _events(train.run(config))
    resumed = _events(train.run(tc.override(config, max_iters=12, lr_decay_iters=12,
                                                    resume=True)))
    assert resumed[:len(first)] == first and len(resumed) > len(first)
    assert [r["refresh"] for r in resumed] == list(range(1, len(resumed) + 1))


def _curvature_setup(config):
    mesh, state, step, _, vocab_size = step_setup(config)  # the loop's step, as test_train
    return mesh, state, step, vocab_size


def _run_steps(config, steps):
    mesh, state, step, vocab_size = _curvature_setup(config)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        T = config.model.block_size
        xy = rng.integers(0, vocab_size, (2, 1, 8, T)).astype(np.int32)
        xy = xy.reshape(2, config.data.grad_accum, config.data.batch_size, T)
        state, metrics = step(state, put_batch(xy[0], batch_sharding(mesh)),
                              put_batch(xy[1], batch_sharding(mesh)))
        losses.append(np.asarray(metrics["loss"]))
    return np.stack(losses), state


def _compared(run):
    """What two K-FAC runs of one computation must share: the losses, the params and the
    factor EMAs (the cached inverses' eigenvectors have arbitrary signs), on the host."""
    losses, state = run
    is_state = lambda x: isinstance(x, kfac.ScaleByKfacState)
    (kfac_state,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_state)
                     if is_state(s)]
    return jax.device_get((losses, state.params, kfac_state.factors))


def _float64_steps(config, steps):
    """`_run_steps` of `config` in float64 (every model dtype, jax's x64 inside only), as
    `_compared`: K-FAC computes its factors in float32 whatever the inputs, so theirs
    are one float32 rounding a step of the float64 statistics."""
    with in_float64():
        return float64(_compared(_run_steps(tc.override(config, **FLOAT64_DTYPES), steps)))


def _assert_as_accurate(got, peer, ref):
    """`got`'s losses, params and factor EMAs as accurate as `peer`'s against the float64
    run, and the same refresh count."""
    assert_as_accurate(_compared(got), _compared(peer), ref)
    assert kfac.refresh_events(got[1].opt_state)[0]["refresh"] == kfac.refresh_events(
        peer[1].opt_state)[0]["refresh"]


def test_stats_every_reduces_the_factors_only_on_statistics_steps(corpus, tmp_path):
    """fsdp over 8 devices, --kfac_stats_every=4: the statistics arrive by reduce-scatter
    (the whole factors' bytes, no all-reduce of them) in the branch of statistics steps,
    each device keeps 1/8 of every factor EMA, and the other steps skip the collective."""
    config = tiny(corpus, tmp_path, bias=False, mesh_fsdp=8, kfac_stats_every=4)
    mesh, state, step, _, _ = step_setup(config)
    x = put_batch(np.zeros((1, 8, config.model.block_size), np.int32), batch_sharding(mesh))
    compiled = step.lower(state, x, x).compile()
    text = compiled.as_text()
    is_state = lambda s: isinstance(s, kfac.ScaleByKfacState)
    factors = [s.factors for s in jax.tree.leaves(state.opt_state, is_leaf=is_state)
               if is_state(s)]
    factor_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(factors))
    costs = [hlo.analyze(text, eigh_branch=False, cheapest=c) for c in (False, True)]
    scattered, skipped = (c.by_kind.get("reduce-scatter", 0) for c in costs)
    # Not all of factor_bytes: XLA reduces equal factors once (c_q, c_k and c_v share
    # their input, so their A).
    assert factor_bytes / 2 < scattered <= factor_bytes and skipped == 0
    # No all-reduce of the factors: only the update's scalars differ between the branches.
    assert costs[0].by_kind["all-reduce"] - costs[1].by_kind["all-reduce"] <= 256
    # Each device holds 1/8 of the factors, before the step and after it.
    out_factors = [s.factors for s in jax.tree.leaves(
        compiled.output_shardings[0].opt_state, is_leaf=is_state) if is_state(s)]
    for leaf, out in zip(jax.tree.leaves(factors), jax.tree.leaves(out_factors), strict=True):
        for sharding in (leaf.sharding, out):
            assert math.prod(sharding.shard_shape(leaf.shape)) * 8 == leaf.size


def test_eight_devices_match_one(corpus, tmp_path):
    """data=2, fsdp=2, tensor=2: the statistics are over the global batch (reduce-scattered,
    each factor's rows split over data x fsdp), so the trajectory (through two refreshes)
    is the 1-device one."""
    # No biases here (as in test_train): the key bias has an exactly zero gradient (softmax
    # ignores a per-query constant), so its (Adam-grafted) updates are rounding noise that
    # differs between programs.
    one = tiny(corpus, tmp_path, bias=False)
    runs = {n: _run_steps(config, 5) for n, config in (
        (1, one), (8, tc.override(one, mesh_data=2, mesh_fsdp=2, mesh_tensor=2)))}
    # Two float32 programs (the 8-device one reduce-scatters): as accurate as the 1-device.
    _assert_as_accurate(runs[8], runs[1], _float64_steps(one, 5))
    state = runs[8][1]
    events = kfac.refresh_events(state.opt_state)
    assert events[0]["refresh"] == 2  # steps 1 and 4
    factors = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
               if "factors" in jax.tree_util.keystr(path)]
    # Rows split over data x fsdp (4 devices), replicated over the tensor axis.
    assert factors and all(
        math.prod(f.sharding.shard_shape(f.shape)) * 4 == f.size for f in factors)


def test_accumulation_averages_the_statistics(corpus, tmp_path):
    big = tiny(corpus, tmp_path, bias=False)  # see test_eight_devices_match_one
    small = tc.override(big, batch_size=4, grad_accum=2)
    # Two float32 programs (two micro-batches, one batch): as accurate as the big batch.
    _assert_as_accurate(_run_steps(small, 3), _run_steps(big, 3), _float64_steps(big, 3))


def test_strided_statistics_average_to_the_full_ones():
    """Over `stride` consecutive steps the offsets cover every position once, so the mean
    of the strided factors is the full-batch factors (with M the loss's token count)."""
    config = models.GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, bias=True,
                              tie_embeddings=False, dtype="float32")
    model = models.GPT(config, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
    x = jax.random.randint(jax.random.key(1), (3, 8), 0, 32)

    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, x, y):
        logits, aux, _ = models.forward(nnx.merge(graphdef, params, rest), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + aux

    _, _, stats = kfac.value_grad_and_stats(loss_fn, params, x, x)
    full = kfac_curvature_fn(params).from_stats(stats, jnp.int32(0))
    assert "blocks/0/attn/c_q/kernel" in full and "lm_head/kernel" not in full
    assert full["blocks/0/mlp/c_fc/kernel"].a.shape == (17, 17)  # bias coordinate
    layers = kfac_curvature_fn(params).layers  # what value_grad_and_stats captures
    assert set(layers) == set(full) and not any(path.endswith("/bias") for path in layers)
    strided = kfac_curvature_fn(params, 4)
    mean = jax.tree.map(lambda *c: sum(c) / 4, *[strided.from_stats(stats, jnp.int32(t))
                                                 for t in range(4)])
    # Two float32 sums of the same products: as accurate as the full ones, against float64.
    layer_stats = {path: stats[path] for path in layers}
    assert_as_accurate(mean, full, dense_factors64(layer_stats, x.size))
    with pytest.raises(ValueError, match="must divide the token count 24"):
        kfac_curvature_fn(params, 5).from_stats(stats, jnp.int32(0))
    with pytest.raises(ValueError, match="kfac_stats_stride"):
        kfac_curvature_fn(params, 0)
    # --kfac_stats_every=2: factors on even steps only (offset step // 2), zeros between.
    grad_fn = jax.jit(grad_and_curvature_fn(ModelDef(graphdef, rest, config), strided, 2))
    for step in (2, 3):
        got = grad_fn(params, x, x, None, jnp.int32(step))[1][1]["curvature"]
        want = strided.from_stats(stats, jnp.int32(1))
        if step == 3:  # exact: no statistics, zeros
            jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(jnp.zeros_like, want))
            continue
        # The step's own capture (jitted) and the eager one: two float32 programs.
        assert_as_accurate(got, want, dense_factors64(layer_stats, x.size, 4, 1))


def test_kfac_options_are_checked(corpus, tmp_path):
    with pytest.raises(ValueError, match="kfac_refresh"):
        tiny(corpus, tmp_path, kfac_refresh="sometimes")
    with pytest.raises(ValueError, match="kfac_phases"):
        build_optimizer(tiny(corpus, tmp_path, kfac_refresh="by_lr_phase", kfac_phases="1,2"))
    with pytest.raises(ValueError, match="interval"):
        build_optimizer(tiny(corpus, tmp_path, kfac_interval=0))
    with pytest.raises(ValueError, match="kfac_warm_start"):
        build_optimizer(tiny(corpus, tmp_path, kfac_warm_start=-1))
    assert not build_optimizer(tiny(corpus, tmp_path, optimizer="adamw")).takes_curvature


def test_kfac_on_moe_experts_run(corpus, tmp_path):
    """--kfac_experts: the MoE expert stacks are in the K-FAC group (per-expert factors in
    its state) and the run trains and refreshes as planned."""
    config = tiny(corpus, tmp_path, n_layer=2, moe_every=2, n_experts=4, kfac_experts=True)
    result = train.run(config)
    _check_run(config, result)
    _, state, _, _ = _curvature_setup(config)
    (k_state,) = kfac.kfac_states(state.opt_state)
    experts = k_state.factors["blocks"]["1"]["moe"]["experts"]
    assert experts["w_fc"].a.shape == (4, 32, 32) and experts["w_proj"].g.shape == (4, 32, 32)


def test_kfac_run_on_a_data_mesh_splits_the_refresh(corpus, tmp_path):
    """On a 4-device data mesh the run trains and refreshes as planned, and in the
    compiled step each device decomposes its share of the factors only."""
    config = tiny(corpus, tmp_path, mesh_data=4)
    _check_run(config, train.run(config))
    from benchmarks import hlo

    mesh, state, step, _ = _curvature_setup(config)
    x = put_batch(np.zeros((1, 8, 16), np.int32), batch_sharding(mesh))
    refresh = hlo.analyze(step.lower(state, x, x).compile().as_text(), eigh_branch=True)
    # 1 layer, bias: A of c_q, c_k, c_v, c_proj, c_fc (33) and c_proj (129); G (32) x5, 128.
    assert refresh.eigh == {32: 2, 33: 2, 128: 1, 129: 1}
    assert refresh.counts["all-gather"] >= 8
