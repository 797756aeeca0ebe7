"""The optimizer registry: what each `TrainOptimizer` says (logged lr = applied lr, Snoo's
hint, the decay mask, rounding), and what the train step does with it (dropout keys per
micro-batch, the non-finite latch)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import optax_snoo
import train
from optax_snoo import MuonState, recipes
from optax_snoo import kfac as kfac_lib
from train import config as tc
from train.config import get_preset, override, parse_args
from train.nonfinite import update_if_finite
from train.optimizers import OPTIMIZERS, build_optimizer
from train.sharding import batch_sharding, put_batch
from train.state import TrainState
from trainer.support import model_setup, tiny_adamw

PARAMS = {"blocks": {"0": {"mlp": {"c_fc": {"kernel": jnp.ones((8, 16))}}}},
          "ln_f": {"scale": jnp.ones(8)}, "wte": {"embedding": jnp.ones((5, 8))},
          "lm_head": {"kernel": jnp.ones((8, 5))}}  # the records' recipes require a head
KERNEL = ("blocks", "0", "mlp", "c_fc", "kernel")


def _muon_states(state):
    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MuonState))
            if isinstance(s, MuonState)]


@pytest.mark.parametrize("name", ["muon", "snoo_muon"])
def test_muon_smoothing_flag_adds_the_buffer(name):
    base = override(get_preset("shakespeare_char_cpu"), optimizer=name)
    off, = _muon_states(build_optimizer(base).tx.init(PARAMS))
    on, = _muon_states(build_optimizer(override(base, muon_smoothing=0.2)).tx.init(PARAMS))
    assert isinstance(off.smooth, optax.EmptyState)
    kernel = on.smooth["blocks"]["0"]["mlp"]["c_fc"]["kernel"]
    assert kernel.shape == (8, 16) and kernel.dtype == jnp.float32


def test_muon_smoothing_from_the_command_line():
    assert parse_args(["--muon_smoothing=0.2"]).optimizer.table.muon_smoothing == 0.2
    with pytest.raises(ValueError, match="smoothing"):
        build_optimizer(parse_args(["--optimizer=muon", "--muon_smoothing=1.5"]))


# --------------------------------------------------------------------- the spec object


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _curvature(params):
    """Batch K-FAC factors of the one hidden kernel of PARAMS (what the step passes)."""
    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.normal(size=(2, 3, n)), jnp.float32) for n in (8, 16))
    return {"blocks/0/mlp/c_fc/kernel": kfac_lib.layer_factors(x, dy, False)}


# Each recipe's peak-lr hyperparameter of the group a hidden kernel (mlp/c_fc) belongs to.
MAIN_LR = {"muon": "muon_learning_rate", "snoo_muon": "muon_learning_rate",
           "normuon": "muon_learning_rate", "snoo_normuon": "muon_learning_rate",
           "skew_adam": "learning_rate", "snoo_skew_adam": "learning_rate",
           "adafactor": "learning_rate", "kfac": "kfac_learning_rate",
           "snoo_kfac": "kfac_learning_rate", "adamw": "learning_rate",
           "snoo_adamw": "learning_rate", "newton_muon": "muon_learning_rate",
           "modded_nanogpt": "muon_learning_rate", "modded_nanogpt_muon": "muon_learning_rate",
           "track3_baseline": "muon_learning_rate",
           "snoo_track3_baseline": "muon_learning_rate", "track3_record": "muon_learning_rate",
           "track3_soap_muon": "muon_learning_rate", "muonh": "muon_learning_rate",
           "muloco_normuonh": "muon_learning_rate",
           "track3_newton_muon": "mlp_fc_learning_rate",
           "track3_adam": "matrix_learning_rate", "adamh": "matrix_learning_rate",
           "track3_muon_squared": "muon_learning_rate",
           "track3_soap_muon_record": "muon_learning_rate",
           "track3_normuon_floor": "muon_learning_rate", "track3_contra_muon": "muon_learning_rate",
           "track3_aurora": "muon_learning_rate", "track3_dynmuon": "muon_learning_rate",
           "track3_pmuon": "muon_learning_rate",
           "track3_sinksoap": "muon_learning_rate",
           "track3_contra_soft_muon": "muon_learning_rate", "track3_soda": "muon_learning_rate",
           "track3_muown": "muon_learning_rate",
           "track3_contra_normuown": "muon_learning_rate",
           "track3_spectral_descent": "muon_learning_rate",
           "track3_psgd": "psgd_learning_rate", "track3_soaph": "soap_learning_rate",
           "track3_klsoap": "soap_learning_rate",
           "track3_klsoap_power_decay": "soap_learning_rate",
           "track3_shampoo": "shampoo_learning_rate",
           "track3_shampoo_pinv": "shampoo_learning_rate",
           "track3_aurora_proj": "muon_learning_rate", "track3_rre": "muon_learning_rate",
           "track3_tail_refinterp": "muon_learning_rate",
           "track3_ema_nesterov_aurora": "muon_learning_rate",
           "track3_aurora_ema_ref": "muon_learning_rate",
           "track3_circuit_muon": "muon_learning_rate",
           "track3_tail_phase_readout": "muon_learning_rate"}
#: The recipes whose hidden update is not the lr times a direction: the hyperball keeps
#: each matrix's norm, #46's radius controls (brake, RowFloor, pin) scale the step, Muown
#: recomposes gains and unit directions.
NOT_LINEAR_IN_LR = ("muonh", "muloco_normuonh", "track3_record", "adamh",
                    "track3_soap_muon_record", "track3_psgd", "track3_soaph",
                    "track3_klsoap", "track3_klsoap_power_decay", "track3_muown",
                    "track3_contra_normuown", "track3_aurora_proj", "track3_rre",
                    "track3_tail_refinterp", "track3_ema_nesterov_aurora",
                    "track3_aurora_ema_ref", "track3_circuit_muon",
                    "track3_tail_phase_readout")
#: KL-SOAP's first update only builds its statistics (a zero update): their second is read.
FIRST_UPDATE_BUILDS = ("track3_klsoap", "track3_klsoap_power_decay")
#: Flat lr at update 0 and no decay, where the recipe has these settings.
FLAT_START = dict(schedule="stable_cooldown", learning_rate=1e-3, muon_weight_decay=0.0,
                  weight_decay=0.0, adam_weight_decay=0.0, qkv_weight_decay=0.0,
                  mlp_fc_weight_decay=0.0, warmup_steps=0)


@pytest.mark.parametrize("name", sorted(MAIN_LR))
def test_logged_lr_is_the_applied_lr_of_the_main_group(name):
    """The logged `lr` follows the main group's peak (not AdamW's), and that peak is the
    one applied: doubling it doubles the update of a hidden kernel."""
    assert set(MAIN_LR) == set(OPTIMIZERS)
    names = OPTIMIZERS[name].hyperparameters.names()
    flat = {k: v for k, v in FLAT_START.items() if k in names and k != MAIN_LR[name]}
    base = override(tc.TrainConfig(), optimizer=name, max_iters=100, grad_clip=0.0,
                    n_head=HEADS, **flat)
    # Circuit-Muon (#41) couples an attention's value and output: the tree with them.
    params = GPT_TREE if "num_heads" in OPTIMIZERS[name].options else PARAMS
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                         params)
    kernel_updates = []
    for peak in (3e-3, 6e-3):
        spec = build_optimizer(override(base, **{MAIN_LR[name]: peak}))
        assert float(spec.learning_rate(0)) == pytest.approx(peak), name  # flat: lr(0) = peak
        extra = ({"curvature": _curvature(params), "input_covariance": None}
                 if spec.takes_curvature else {})
        state = spec.tx.init(params)
        if name in FIRST_UPDATE_BUILDS:
            _, state = spec.tx.update(grads, state, params, **spec.update_kwargs(0), **extra)
        updates, _ = spec.tx.update(grads, state, params,
                                    **spec.update_kwargs(1), **extra)  # no Snoo sync at 1
        kernel_updates.append(_get(updates, KERNEL))
    assert float(jnp.abs(kernel_updates[0]).max()) > 0, name
    if name in NOT_LINEAR_IN_LR:
        assert not np.allclose(kernel_updates[1], kernel_updates[0]), name
        return
    # One program at two learning rates (2x exactly in float32): the direction is the
    # same bits, so the updates differ only by the last roundings: lr·O (once in each,
    # eps/2 of |u| each) and, in a stack that forms W - lr·O and returns its difference
    # from W, that subtraction (eps/2 of |W| in each; 2 |u_1| = |u_2|).
    eps = float(np.finfo(np.float32).eps)
    atol = 2 * eps * float(jnp.abs(_get(params, KERNEL)).max())
    np.testing.assert_allclose(kernel_updates[1], 2 * kernel_updates[0], rtol=2 * eps,
                               atol=atol, err_msg=name)


def test_track3_baseline_is_the_recipe():
    """`--optimizer=track3_baseline` with the `track3` presets' values is
    `recipes.track3_baseline(max_iters)`, logging Muon's scheduled lr (record #36: 0.025,
    flat for 30%, then linear to 0)."""
    config = override(tc.TrainConfig(), **tc._TRACK3_RECIPE, max_iters=50)
    spec = build_optimizer(config)
    assert spec.sync_period is None
    assert [float(spec.learning_rate(t)) for t in (0, 14, 50)] == pytest.approx(
        [0.025, 0.025, 0.0])
    params = {**PARAMS, "lm_head": {"kernel": jnp.ones((8, 5))}}
    grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                         params)
    recipe = recipes.track3_baseline(50)
    ours, _ = spec.tx.update(grads, spec.tx.init(params), params)
    theirs, _ = recipe.update(grads, recipe.init(params), params)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_snoo_hint_comes_from_the_spec_only():
    spec = build_optimizer(override(tc.TrainConfig(), optimizer="snoo_muon", snoo_k=3))
    assert spec.sync_period == 3 and not spec.takes_curvature
    assert [spec.update_kwargs(t)["snoo_sync"] for t in range(7)] == [
        True, False, False, True, False, False, True]
    assert build_optimizer(override(tc.TrainConfig(), optimizer="muon")).update_kwargs(0) == {}


def test_adamw_decays_matrices_only():
    """nanoGPT's mask: with a zero gradient the update is the decay alone, -lr·wd·p on the
    >= 2-D leaves and 0 on norms and biases."""
    spec = build_optimizer(override(tc.TrainConfig(), optimizer="adamw", grad_clip=0.0,
                                    weight_decay=0.1, schedule="stable_cooldown"))
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    updates, _ = spec.tx.update(zeros, spec.tx.init(PARAMS), PARAMS)
    lr = float(spec.learning_rate(0))
    np.testing.assert_array_equal(updates["ln_f"]["scale"], 0.0)
    np.testing.assert_allclose(_get(updates, KERNEL), -lr * 0.1, rtol=1e-6)
    np.testing.assert_allclose(updates["wte"]["embedding"], -lr * 0.1, rtol=1e-6)


@dataclasses.dataclass(frozen=True)
class _SgdHyperparameters(recipes.Hyperparameters):
    learning_rate: float = recipes.hyperparameter(0.05, "SGD's constant lr", check="positive")


def test_register_a_new_recipe(corpus, tmp_path):
    """A registered recipe is a name on the command line, its hyperparameters flags; the
    loop needs nothing else."""

    def sgd(table, total_steps):
        lr = optax.constant_schedule(table.learning_rate)
        return recipes.Stack(optax.with_extra_args_support(optax.sgd(lr)), lr)

    recipe = recipes.Recipe("test_sgd", _SgdHyperparameters, sgd, summary="plain SGD")
    recipes.register(recipe)
    try:
        with pytest.raises(ValueError, match="already registered"):
            recipes.register(recipe)
        assert OPTIMIZERS["test_sgd"] is recipe
        config = override(tc.TrainConfig(), optimizer="test_sgd", n_layer=1, n_head=2,
                          n_embd=16, block_size=8, batch_size=4, max_iters=3, eval_interval=3,
                          eval_iters=1, log_interval=1, num_samples=0, progress=False,
                          mesh_data=1, dtype="float32", data=str(corpus),
                          out_dir=str(tmp_path / "run"))
        result = train.run(config)
        assert [h["lr"] for h in result.history if "lr" in h] == pytest.approx([0.05] * 3)
        assert parse_args(["--optimizer=test_sgd", "--learning_rate=0.2"]).optimizer.table == (
            _SgdHyperparameters(0.2))
    finally:
        del recipes.REGISTRY["test_sgd"]


# --------------------------------------------------------------------- the train step


def test_each_micro_batch_gets_its_own_dropout_mask(corpus, tmp_path):
    """dropout > 0, grad_accum = 2, the same tokens twice: the loss is the mean over two
    different masks, those of keys `split(fold_in(rng, step), 2)`."""
    config = tiny_adamw(corpus, tmp_path, dropout=0.5, grad_accum=2)
    mesh, model, state, step = model_setup(config)
    rng = np.random.default_rng(0)
    xy = rng.integers(0, 32, (2, 1, 4, 8)).astype(np.int32)
    xy = np.concatenate([xy, xy], axis=1)  # (2, A=2, B, T): identical micro-batches
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    gpt = model.merge(jax.device_get(state.params))
    ce = [float(optax.softmax_cross_entropy_with_integer_labels(
        models.forward(gpt, jnp.asarray(xy[0, a]), dropout_key=k)[0], xy[1, a]).mean())
        for a, k in enumerate(jax.random.split(key, 2))]
    assert ce[0] != pytest.approx(ce[1], rel=1e-4)  # the two masks differ
    _, metrics = step(state, put_batch(xy[0], batch_sharding(mesh)),
                      put_batch(xy[1], batch_sharding(mesh)))
    assert float(metrics["loss"]) == pytest.approx(np.mean(ce), rel=1e-5)


def test_latch_skips_finite_steps_after_max_bad_steps():
    """After `max_bad_steps` bad steps in a row, a finite step is skipped too (latched);
    before the limit a finite step applies and resets the run of bad steps."""
    state = TrainState.start({"w": jnp.ones(2)}, (), seed=0)
    update = lambda s: s._replace(params={"w": s.params["w"] + 1.0})
    nan, one = jnp.float32(jnp.nan), jnp.float32(1.0)
    step = jax.jit(lambda s, loss: update_if_finite(s, update, loss, one, max_bad_steps=2))
    state, flags = step(state, nan)
    state, flags = step(state, one)  # one bad step: below the limit, so it applies
    assert (float(state.params["w"][0]), int(state.bad_steps), float(flags["skipped"])) == (
        2.0, 0, 0.0)
    for _ in range(2):
        state, _ = step(state, nan)
    assert int(state.bad_steps) == 2
    state, flags = step(state, one)  # finite, but latched
    assert (float(state.params["w"][0]), float(flags["skipped"]), int(state.bad_steps),
            int(state.skipped_steps)) == (2.0, 1.0, 3, 4)


# --------------------------------------------------------------------- one recipe, one home

#: A small GPT-shaped tree: every group the recipes have (embedding, untied head, hidden
#: matrices with biases, the attention's value and output, a norm gain).
GPT_TREE = {
    "wte": {"embedding": jnp.linspace(-1, 1, 9 * 8).reshape(9, 8)},
    "lm_head": {"kernel": jnp.linspace(1, -1, 8 * 9).reshape(8, 9)},
    "ln_f": {"scale": jnp.ones(8)},
    "blocks": {"0": {
        "attn": {"c_q": {"kernel": jnp.eye(8) + 0.1, "bias": jnp.zeros(8)},
                 "c_v": {"kernel": jnp.eye(8) + 0.2, "bias": jnp.zeros(8)},
                 "c_proj": {"kernel": jnp.eye(8) - 0.1, "bias": jnp.full(8, 0.1)}},
        "mlp": {"c_fc": {"kernel": jnp.linspace(-0.5, 0.5, 8 * 32).reshape(8, 32),
                         "bias": jnp.zeros(32)},
                "c_proj": {"kernel": jnp.linspace(0.5, -0.5, 32 * 8).reshape(32, 8),
                           "bias": jnp.zeros(8)}}}}}
#: The attention heads of these trees' 8-wide `c_v`/`c_proj` (the trainer's `--n_head`).
HEADS = 4
#: The placement options the trainer sets on one device (train.optimizers): K-FAC's
#: statistics axes, Newton-Muon's MLP input in blocks of n_embd, its shared inputs,
#: Circuit-Muon's heads.
TRAINER_OPTIONS = dict(stats_axes=("data", "fsdp"), block_size=8,
                       shared_inputs=recipes.NEWTON_MUON_SHARED_INPUTS, num_heads=HEADS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_trainer_runs_the_librarys_recipe(name):
    """`--optimizer=NAME` is `optax_snoo.recipes.get(NAME)(max_iters, **hyperparameters)`
    after the same clipping: the same update, bit for bit, over three steps (Snoo syncing
    every 2), moving every leaf by a finite amount, from a state whose leaves are distinct
    buffers; and the logged lr is the recipe's at every step."""
    recipe = recipes.get(name)
    names = recipe.hyperparameters.names()
    given = {MAIN_LR[name]: 1.5 * getattr(recipe.defaults, MAIN_LR[name])}
    if "snoo_k" in names:
        given["snoo_k"] = 2
    steps = 30
    config = override(tc.TrainConfig(), optimizer=name, max_iters=steps, grad_clip=0.5,
                      n_embd=8, n_head=HEADS, **given)
    assert config.optimizer.hyperparameters == given
    spec = build_optimizer(config)
    options = {k: v for k, v in TRAINER_OPTIONS.items() if k in recipe.options}
    stack = recipe.stack(steps, **given, **options)
    theirs = optax.chain(optax.clip_by_global_norm(0.5), recipe(steps, **given, **options))
    extra = {arg: None for arg in stack.update_args}  # before any statistics (as at step 0)
    ours_state, their_state = spec.tx.init(GPT_TREE), theirs.init(GPT_TREE)
    # Each state leaf its own buffer: the trainer's step donates the state, and one buffer
    # in two places is refused at run time (muown's and RRE's state once were).
    buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(ours_state)
               if isinstance(x, jax.Array) and x.size]
    assert len(buffers) == len(set(buffers)), name
    params = GPT_TREE
    for t in range(3):
        grads = jax.tree.map(lambda p, t=t: jnp.cos(jnp.arange(p.size, dtype=p.dtype) + t
                                                    ).reshape(p.shape), params)
        hint = spec.update_kwargs(t)
        assert hint == ({"snoo_sync": optax_snoo.snoo_is_sync_step(t, 2, stack.sync_phase)}
                        if "snoo_k" in names else {})
        ours, ours_state = spec.tx.update(grads, ours_state, params, **hint, **extra)
        mine, their_state = theirs.update(grads, their_state, params, **hint, **extra)
        jax.tree.map(np.testing.assert_array_equal, ours, mine)
        assert float(optax.tree.norm(ours)) > 0, name
        params = optax.apply_updates(params, ours)
    # After the warm-ups' first steps (a record's may start at a learning rate of 0), every
    # leaf moves, by a finite amount.
    assert all(bool(jnp.all(jnp.isfinite(u))) and float(jnp.abs(u).max()) > 0
               for u in jax.tree.leaves(ours)), name
    count = jnp.arange(steps + 1, dtype=jnp.int32)
    np.testing.assert_array_equal(jax.vmap(spec.learning_rate)(count),
                                  jax.vmap(stack.learning_rate)(count))
    assert (spec.sync_period, spec.sync_phase, spec.readout) == (
        stack.sync_every, stack.sync_phase, stack.readout)


def test_modded_nanogpt_trains_from_the_trainer(corpus, tmp_path):
    """The GPT-2 Medium record's optimizer (Snoo around Muon, its Adam groups) is a trainer
    recipe: a few steps of `--optimizer=modded_nanogpt` on the tiny GPT lower the loss."""
    config = tiny_adamw(corpus, tmp_path, optimizer="modded_nanogpt", tie_embeddings=False,
                        max_iters=8, eval_interval=8, eval_iters=1, log_interval=1,
                        num_samples=0, progress=False, snoo_k=4)
    result = train.run(config)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert len(losses) == 8 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert build_optimizer(config).sync_period == 4
