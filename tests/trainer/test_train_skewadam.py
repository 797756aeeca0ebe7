"""The trainer with SkewAdam (Malik, arXiv 2607.19058, 2026): `skew_adam` and `snoo_skew_adam`
on a tiny MoE GPT, bf16 params with the rounding transforms, and the per-role state the run
actually holds."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
import train
from optax_snoo import POLICY_PRESETS, ScaleBySecondMomentState, ScaleBySkewAdamState, recipes
from optax_snoo.labels import path_to_str
from optax_snoo.memory import skew_adam_state_bytes_by_role, state_bytes_by_group
from references.error import assert_as_accurate, float64, in_float64
from references.gpt64 import FLOAT64_DTYPES
from train import config as tc
from train import data as td
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step

WORDS = ("the", "king", "and", "the", "queen", "walk", "to", "the", "castle", ".", "a", "fool",
         "sings", "of", "love", "and", "war", ".")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "input.txt"
    path.write_text(" ".join(rng.choice(WORDS, size=4000)) + "\n")
    return path


def tiny_moe(corpus, tmp_path, **overrides) -> tc.TrainConfig:
    """Two blocks, the second a 4-expert MoE; bf16 params with stochastic rounding."""
    base = dict(
        n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8, moe_every=2,
        n_experts=4, top_k=2, expert_hidden=32, dtype="float32", param_dtype="bfloat16",
        optimizer="skew_adam", rounding="stochastic", learning_rate=1e-2, final_lr_scale=0.1,
        warmup_iters=2, max_iters=10, lr_decay_iters=10, eval_interval=5, eval_iters=2,
        log_interval=1, checkpoint_every=10, mesh_data=1, num_samples=0, progress=False,
        data=str(corpus), out_dir=str(tmp_path / "run"))
    # as flags after a preset: another optimizer keeps the base's hyperparameters it has
    return tc.override(tc.override(tc.TrainConfig(), **base), **overrides)


def setup(config):
    """The state and jitted step that `train.run` builds for `config`, and the data."""
    data = td.open_dataset(config.data.path)
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, data.vocab_size), spec.tx,
                                      seed=config.run.seed, mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh))
    put = lambda x: put_batch(x, batch_sharding(mesh))

    def batch(t):
        x, y = data.batch("train", t, batch_size=config.data.batch_size,
                          block_size=config.model.block_size, grad_accum=1,
                          seed=config.run.seed)
        return put(x), put(y)

    return state, step, spec, batch


def test_skew_adam_bf16_moe_run_loss_falls(corpus, tmp_path):
    config = tiny_moe(corpus, tmp_path)
    result = train.run(config)
    evals = [h for h in result.history if "val_loss" in h]
    assert [h["step"] for h in evals] == [0, 5, 10]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
    assert all(np.isfinite(h["aux_loss"]) for h in result.history if "aux_loss" in h)


def test_bf16_params_stay_bf16_and_state_has_the_roles(corpus, tmp_path):
    config = tiny_moe(corpus, tmp_path)
    state, step, _, batch = setup(config)
    params0 = jax.tree.map(np.asarray, state.params)  # the step donates the state
    dtypes = {path_to_str(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(params0)}
    # The model keeps its router kernel in float32 (a float32 master weight the rounding
    # passes through); every other parameter, LayerNorm scales included, is bf16.
    assert {k for k, d in dtypes.items() if d == jnp.float32} == {"blocks/1/moe/router/kernel"}
    assert {d for k, d in dtypes.items() if "router" not in k} == {jnp.dtype(jnp.bfloat16)}

    opt_state = state.opt_state
    # Measured statistics equal the paper's formula per role (float32 whatever the params).
    assert state_bytes_by_group(opt_state, statistics_only=True) == (
        skew_adam_state_bytes_by_role(params0))
    parts = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.PartitionState)) if isinstance(x, optax.PartitionState)]
    assert len(parts) == 1
    inner = {role: s.inner_state[0] for role, s in parts[0].inner_states.items()}
    assert isinstance(inner["backbone"], ScaleBySkewAdamState)      # momentum
    assert isinstance(inner["experts"], ScaleBySecondMomentState)   # none
    assert isinstance(inner["router"], ScaleBySecondMomentState)
    experts = inner["experts"].v_row["blocks"][1]["moe"]["experts"]
    assert experts["w_fc"].shape == (4, 32) and experts["w_fc"].dtype == jnp.float32
    router = inner["router"].v["blocks"][1]["moe"]["router"]["kernel"]
    assert router.shape == (32, 4)                                    # full, not factored

    for t in range(3):
        state, _ = step(state, *batch(t))
    params = state.params
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype, params, params0)
    assert all(jax.tree.leaves(same))
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), params, params0)
    assert all(jax.tree.leaves(changed))


def test_stochastic_rounding_keeps_steps_below_half_a_bf16_unit(corpus, tmp_path):
    """With an lr far below bf16's resolution, round-to-nearest loses most of the step;
    stochastic rounding keeps it in expectation: the total displacement of a bf16 matrix
    matches the float32 run's."""
    moved = {}
    for dtype, rounding in (("float32", "none"), ("bfloat16", "none"),
                            ("bfloat16", "stochastic")):
        config = tiny_moe(corpus, tmp_path, param_dtype=dtype, rounding=rounding,
                          learning_rate=1e-5, warmup_iters=0, weight_decay=0.0)
        state, step, _, batch = setup(config)
        kernel = lambda s: np.asarray(s.params["blocks"][0]["mlp"]["c_fc"]["kernel"],
                                      np.float64)
        w0 = kernel(state)
        state, _ = step(state, *batch(0))
        moved[dtype, rounding] = float(np.sum(np.abs(kernel(state) - w0)))
    exact = moved["float32", "none"]
    assert moved["bfloat16", "none"] < 0.5 * exact, moved
    assert 0.8 * exact < moved["bfloat16", "stochastic"] < 1.25 * exact, moved


@pytest.mark.parametrize("rounding", ["stochastic", "dithered"])
def test_rounding_acts_on_the_float32_update(rounding):
    """`--rounding` with `skew_adam` rounds p + u from SkewAdam's float32 update u (the
    paper's step 5): the same as that rounding transform applied by hand to the update the float32
    stack computes for the same values. Appended after SkewAdam's cast it would round
    p + bf16(u) instead."""
    rng = np.random.default_rng(0)
    p32 = {"mlp": {"kernel": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)},
           "moe": {"experts": jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)}}
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)  # the same values
    grads = [jax.tree.map(lambda x, t=t: jnp.asarray(
        np.random.default_rng(t).normal(size=x.shape), jnp.float32), p32) for t in range(3)]
    config = tc.override(tc.TrainConfig(), optimizer="skew_adam", learning_rate=3e-2,
                                 warmup_iters=0, max_iters=10, seed=3)
    tx = build_optimizer(tc.override(config, rounding=rounding)).tx
    ref_tx = build_optimizer(tc.override(config, rounding="none")).tx
    rounder = {"stochastic": optax_snoo.stochastic_rounding,
               "dithered": optax_snoo.dithered_rounding}[rounding](key=config.run.seed)
    state, ref_state, rounder_state = tx.init(p16), ref_tx.init(p32), rounder.init(p16)
    params = p16
    for g in grads:
        updates, state = tx.update(g, state, params)
        u32, ref_state = ref_tx.update(
            g, ref_state, jax.tree.map(lambda x: x.astype(jnp.float32), params))
        assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(u32))
        expected_updates, rounder_state = rounder.update(u32, rounder_state, params)
        new = optax.apply_updates(params, updates)
        expected = optax.apply_updates(params, expected_updates)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                                np.asarray(b, np.float32)),
                     new, expected)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new))
        params = new


def test_snoo_skew_adam_fast_path_matches_in_jit_decision(corpus, tmp_path):
    """The static hint and the in-jit choice are two float32 programs: the losses and
    every float of the state as accurate as the in-jit run's against it in float64
    (SkewAdam keeps its momentum in float32 there too: one rounding of it a step)."""
    config = tiny_moe(corpus, tmp_path, optimizer="snoo_skew_adam", param_dtype="float32",
                      rounding="none", snoo_k=3)

    def run(hint, config=config):
        state, step, spec, batch = setup(config)
        assert spec.sync_period == 3
        losses = []
        for t in range(7):
            state, metrics = step(state, *batch(t), **(spec.update_kwargs(t) if hint else {}))
            losses.append(np.asarray(metrics["loss"]))
        return np.stack(losses), jax.device_get(state)

    hinted, in_jit = run(True), run(False)
    with in_float64():
        ref = float64(run(False, tc.override(config, **FLOAT64_DTYPES)))
    assert_as_accurate(hinted, in_jit, ref)
    assert hinted[0][-1] < hinted[0][0]


def test_config_choices_and_errors():
    fields = {f.name: f for f in dataclasses.fields(recipes.skew_adam.hyperparameters)}
    assert set(fields["policies"].metadata["choices"]) == set(POLICY_PRESETS)
    config = tc.parse_args(["--optimizer=skew_adam", "--policies=expert_momentum",
                            "--param_dtype=bfloat16", "--rounding=dithered"])
    assert (config.optimizer.table.policies, config.optimizer.rounding) == (
        "expert_momentum", "dithered")
    with pytest.raises(ValueError, match="rounding='nearest'"):
        tc.parse_args(["--rounding=nearest"])
    with pytest.raises(ValueError, match="policies='tiered'"):
        tc.parse_args(["--optimizer=skew_adam", "--policies=tiered"])
    with pytest.raises(ValueError, match="weight_decay=-1.0: expected a finite number >= 0"):
        tc.override(tc.TrainConfig(), optimizer="skew_adam", weight_decay=-1.0)
