"""Track 3's recipes in the trainer: each `--optimizer` trains, and the run evaluates,
samples and restores the weights the optimizer's readout gives (`optax_snoo.eval_params`)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
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
    config = tiny_adamw(corpus, tmp_path, optimizer=name, max_iters=50, tie_embeddings=False)
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


@pytest.mark.parametrize("readout", ["reference_interpolation", "tail_velocity"])
def test_readout_of_each_late_readout(readout):
    """A reference interpolation or a tail velocity alone is a readout: evaluated, not
    the params (w: 0 -> -1 -> -2; -2 - 0.5 (-2 + 1) and -2 - 0.5 (-0.5))."""
    params = {"w": jnp.zeros((2, 2))}
    last = {"reference_interpolation": optax_snoo.reference_interpolation(1, 2, -0.5),
            "tail_velocity": optax_snoo.tail_velocity(1, 0.5, -0.5, 1.0)}[readout]
    tx = optax.chain(optax.sgd(1.0), last)
    opt_state = tx.init(params)
    for _ in range(2):
        updates, opt_state = tx.update({"w": jnp.ones((2, 2))}, opt_state, params)
        params = optax.apply_updates(params, updates)
    state = types.SimpleNamespace(params=params, opt_state=opt_state)
    np.testing.assert_array_equal(make_readout(opt_state)(state)["w"],
                                  {"reference_interpolation": -1.5,
                                   "tail_velocity": -1.75}[readout])


def test_run_evaluates_samples_and_restores_the_readout(corpus, tmp_path, monkeypatch):
    """A track3_record run ends inside its tail EMA: the logged val loss is the readout's,
    not the params', and `load_params` (sampling, `train.evaluate`) restores the readout.
    Its metrics.jsonl logs the record's PowerCool lr at every step."""
    # 9 steps, the recipe's fewest: the tail EMA averages updates 7 and 8.
    config = tiny_adamw(corpus, tmp_path, optimizer="track3_record", max_iters=9,
                        eval_interval=9, eval_iters=2, log_interval=1, num_samples=0,
                        progress=False, tie_embeddings=False)
    result = train.run(config)
    lrs = {h["step"]: h["lr"] for h in result.history if "lr" in h}
    # step s logs the lr of its update, number s - 1
    assert lrs == pytest.approx({s: power_cool_lr(s - 1, 9) for s in range(1, 10)}, rel=1e-6)
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


# The records' logged Muon lr at update t of a T-step run, float64, from the records' code
# (PowerCool's c from #44/#46's log, at its lr 0.0375 and 2900 steps).
RECORD_C, RECORD_STEPS = 3.3169534699576625e-06, 2900


def power_cool_lr(t, T, lr0=0.0375):
    """#44/#46's `_lr`, min(lr0, c·(T - t)^1.2), its c stretched to T steps."""
    return min(lr0, RECORD_C * (RECORD_STEPS / T) ** 1.2 * max(0.0, T - t) ** 1.2)


def stable_cooldown_lr(t, T, lr0, cooldown_frac):
    """The records' `set_hparams`: flat, then a line to 0 over the last cooldown_frac."""
    x = t / T
    return lr0 if x < 1 - cooldown_frac else lr0 * (1 - x) / cooldown_frac


#: name -> (the logged lr at update t of T, the updates t after which Snoo syncs).
LOGGED = {
    "track3_record": (power_cool_lr, lambda t: False),
    "track3_soap_muon": (power_cool_lr, lambda t: False),
    # #5, #13: the hyperball's relative step 0.018, linear to 0 over the run.
    "muonh": (lambda t, T: stable_cooldown_lr(t, T, 0.018, 1.0), lambda t: False),
    # #13: MuLoCo's outer step after every 30th update (sync="end").
    "muloco_normuonh": (lambda t, T: stable_cooldown_lr(t, T, 0.018, 1.0),
                        lambda t: t % 30 == 29),
    # #15: the MLP input group's 0.030 (the c_fc kernel's), flat for 30%.
    "track3_newton_muon": (lambda t, T: stable_cooldown_lr(t, T, 0.030, 0.7),
                           lambda t: False),
    # #36: 0.025, flat for 30%; its Snoo twin syncs at updates 0, 28, 56, ... (k=28).
    "track3_baseline": (lambda t, T: stable_cooldown_lr(t, T, 0.025, 0.7), lambda t: False),
    "snoo_track3_baseline": (lambda t, T: stable_cooldown_lr(t, T, 0.025, 0.7),
                             lambda t: t % 28 == 0),
}


@pytest.mark.parametrize("name", sorted(LOGGED))
def test_logged_lr_and_snoo_hint_at_every_step(name):
    """Over a whole 290-step run (a tenth of the records', so every step constant is
    rescaled), the logged lr is the record's formula at every update and Snoo's hint
    syncs exactly where the record does."""
    from train.config import TrainConfig, override
    T = 290
    spec = build_optimizer(override(TrainConfig(), optimizer=name, max_iters=T))
    lr, synced = LOGGED[name]
    steps = jnp.arange(T + 1, dtype=jnp.int32)  # the train step's int32 update count
    got = np.asarray(jax.jit(jax.vmap(spec.learning_rate))(steps), np.float64)
    want = np.array([lr(t, T) for t in range(T + 1)])
    # float32: x = t/T and c·r^1.2 each round a few times, at the scale of the peak.
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(got, want, rtol=8 * eps, atol=8 * eps * want.max())
    assert got[-1] == 0.0  # every record ends at 0
    assert [spec.update_kwargs(t).get("snoo_sync", False) for t in range(T)] == [
        synced(t) for t in range(T)]
    assert (spec.sync_period is not None) == any(synced(t) for t in range(T))


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
