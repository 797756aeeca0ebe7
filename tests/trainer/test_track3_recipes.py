"""Track 3's recipes in the trainer: each `--optimizer` trains, and the run evaluates,
samples and restores the weights the optimizer's readout gives (`optax_snoo.eval_params`)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_snoo
import train
from train import sample
from train.data import open_dataset
from train.optimizers import build_optimizer
from train.sample import load_params
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import make_eval_step, make_readout
from trainer.support import model_setup, tiny_adamw

RECIPES = ("track3_record", "track3_soap_muon", "muonh", "muloco_normuonh",
           "track3_newton_muon")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains(corpus, tmp_path, name):
    """Five steps on one batch: the loss is finite and falls."""
    config = tiny_adamw(corpus, tmp_path, optimizer=name, max_iters=50)
    mesh, _, state, step = model_setup(config)
    spec = build_optimizer(config)
    xy = np.random.default_rng(0).integers(0, 32, (2, 1, 4, 8)).astype(np.int32)
    batch = [put_batch(a, batch_sharding(mesh)) for a in xy]
    losses = []
    for t in range(5):
        state, metrics = step(state, *batch, **spec.update_kwargs(t))
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)


def test_readout_is_zero_cost_without_a_wrapper():
    params = {"w": jnp.ones((2, 2))}
    state = types.SimpleNamespace(params=params, opt_state=optax_snoo.muon(0.1).init(params))
    assert make_readout(state.opt_state)(state) is state.params


def test_run_evaluates_samples_and_restores_the_readout(corpus, tmp_path, monkeypatch):
    """A track3_record run ends inside its tail EMA: the logged val loss is the readout's,
    not the params', and `load_params` (sampling, `train.evaluate`) restores the readout."""
    config = tiny_adamw(corpus, tmp_path, optimizer="track3_record", max_iters=8, eval_interval=8,
                   eval_iters=2, log_interval=8, num_samples=0, progress=False)
    result = train.run(config)
    logged = [h["val_loss"] for h in result.history if "val_loss" in h][-1]
    seen = {}

    def spy(opt_state):  # keeps the restored train state the readout is applied to
        readout = make_readout(opt_state)
        return lambda state: seen.setdefault("state", state) and readout(state)

    monkeypatch.setattr(sample, "make_readout", spy)
    model, restored, _ = load_params(config.run.out_dir)
    monkeypatch.undo()
    raw = seen["state"]
    expected = optax_snoo.eval_params(raw.params, raw.opt_state)
    jax.tree.map(np.testing.assert_array_equal, restored, expected)
    x, y = open_dataset(config.data.path).eval_batches(
        "val", num_batches=2, batch_size=4, block_size=8, seed=config.run.seed)
    mesh = make_mesh(config)
    evaluate = make_eval_step(model, mesh=mesh, params_shardings=tree_shardings(restored, mesh))
    loss = lambda p: float(evaluate(p, jnp.asarray(x), jnp.asarray(y)))
    assert loss(restored) == pytest.approx(logged, rel=1e-6)
    assert abs(loss(raw.params) - logged) > 1e-6  # the readout made a difference


@pytest.mark.parametrize("name, lr0, sync", [("track3_record", 0.0375, None),
                                              ("track3_soap_muon", 0.0375, None),
                                              ("muonh", 0.018, None),
                                              ("muloco_normuonh", 0.018, (29, 59)),
                                              ("track3_newton_muon", 0.030, None)])
def test_logged_lr_and_snoo_hint(name, lr0, sync):
    """The logged lr is the recipe's Muon lr over `max_iters`; MuLoCo's hint syncs after
    every 30th update (sync='end')."""
    from train.config import TrainConfig, override
    spec = build_optimizer(override(TrainConfig(), optimizer=name, max_iters=60))
    assert float(spec.learning_rate(0)) == pytest.approx(lr0)
    assert float(spec.learning_rate(60)) == 0.0
    synced = [t for t in range(60) if spec.update_kwargs(t).get("snoo_sync")]
    assert synced == ([] if sync is None else list(sync))


@pytest.mark.parametrize("name", ["muonh", "muloco_normuonh"])
def test_the_hyperball_refuses_the_files_zero_projections(name):
    """On the hyperball a zero matrix never moves: `init='track3'` is refused in one line
    that names the records' init; with it the optimizer builds."""
    from train.config import get_preset, override
    config = override(get_preset("track3_cpu"), optimizer=name)
    with pytest.raises(ValueError, match=rf"^--optimizer={name} keeps every hidden matrix .*"
                                         r"use --init=hyperball"):
        build_optimizer(config)
    assert build_optimizer(override(config, init="hyperball")).tx is not None


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_for_the_benchmarks_network(name):
    """Each recipe on the `track3` preset (the file's 162M-parameter GPT), abstractly:
    its state initialises and an update traces to the params' shapes, so a GPU run of
    the real benchmark starts with it."""
    from flax import nnx

    import models
    from train import config as tc
    hyperball = {"init": "hyperball"} if name in ("muonh", "muloco_normuonh") else {}
    config = tc.override(tc.get_preset("track3"), optimizer=name, **hyperball)
    gpt = tc.model_config(config, 50257)
    params = jax.eval_shape(lambda: nnx.to_pure_dict(
        nnx.split(models.GPT(gpt, rngs=nnx.Rngs(0)), nnx.Param, ...)[1]))
    assert sum(x.size for x in jax.tree.leaves(params)) > 160e6
    spec = build_optimizer(config)
    state = jax.eval_shape(spec.tx.init, params)
    if spec.grad_fn is None:  # Newton-Muon's update also takes its statistics
        updates, _ = jax.eval_shape(
            lambda g, s, p: spec.tx.update(g, s, p, **spec.update_kwargs(0)),
            params, state, params)
        assert all(jax.tree.leaves(jax.tree.map(lambda u, p: u.shape == p.shape, updates,
                                                params)))
