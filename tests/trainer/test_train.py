"""The trainer: config/CLI, data, schedules, the jitted step, sharding, checkpoints, resume.

Tiny models on a small synthetic corpus (so the tests need no download); the 8 CPU
devices come from conftest.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import urllib.error

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import models
import train
from optax_snoo.labels import path_to_str
from references.error import assert_as_accurate
from train import config as tc
from train import data as td
from train.__main__ import main
from train.checkpoint import Checkpointer, check_compatible
from train.evaluate import evaluate_split
from train.evaluate import main as evaluate_main
from train.metrics import flops_per_token
from train.optimizers import OPTIMIZERS, build_optimizer
from train.sample import load_model
from train.sample import main as sample_main
from train.sharding import batch_sharding, mesh_shape, put_batch
from train.step import (
    CPU_COMPILER_OPTIONS,
    compiler_options,
)
from trainer.support import float64_train_steps, random_batches, step_setup, tiny, train_steps

# Runs of the same config compile the same programs: cached for this module.
pytestmark = pytest.mark.usefixtures("compilation_cache")


def train_losses(result) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in result.history if "loss" in h}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted 8-step run on one device (Snoo k=3 around AdamW)."""
    config = tiny(corpus, tmp_path_factory.mktemp("ref"), num_samples=1, sample_max_new_tokens=6)
    return config, train.run(config)


# ----------------------------------------------------------------------------- training


def test_tiny_run_loss_falls_and_writes_outputs(reference):
    config, result = reference
    evals = [h for h in result.history if "val_loss" in h]
    assert [h["step"] for h in evals] == [0, 4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
    assert result.final["val_loss"] == evals[-1]["val_loss"]
    losses = train_losses(result)
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    out = result.out_dir
    vocab_size = td.open_dataset(config.data.path).vocab_size  # set from the corpus
    assert tc.config_from_dict(json.loads((out / "config.json").read_text())) == (
        dataclasses.replace(config, model=tc.model_config(config, vocab_size)))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == result.history
    assert {"loss", "grad_norm", "lr", "aux_loss", "tokens_per_sec"} <= set(lines[1])
    assert "mfu" not in lines[1]  # no peak FLOP/s for CPUs
    assert (out / "loss.png").stat().st_size > 0
    # Every sampled id is a real character (padding is masked), so a sample re-encodes to
    # the prompt plus exactly sample_max_new_tokens ids, whichever ids were drawn.
    data = td.open_dataset(config.data.path)
    assert tc.model_config(config, data.vocab_size).vocab_size > data.vocab_size  # padded
    sample = (out / "samples.txt").read_text()[:-1]
    assert len(data.tokenizer.encode(sample)) == (len(config.sample.start)
                                                  + config.sample.max_new_tokens)


def test_sample_cli_restores_the_final_model(reference, capsys):
    config, result = reference
    assert sample_main(["--out_dir", str(result.out_dir), "--seed", str(config.run.seed)]) == 0
    printed = capsys.readouterr().out
    assert printed.split("\n---------------\n")[0] == (
        result.out_dir / "samples.txt").read_text()[:-1]


def test_evaluate_cli_is_the_mean_loss_over_every_val_window(reference, corpus, capsys):
    config, result = reference
    model, _, _ = load_model(result.out_dir)
    data = td.open_dataset(corpus)
    ids = data.split("val").shards[0].array
    windows = list(data.sequential_windows("val", config.model.block_size, batch_size=10**9))
    inputs, targets = windows[0]
    logits = np.asarray(models.forward(model, jnp.asarray(inputs))[0], np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    expected = float(np.mean(log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))
    for batch_size in (7, len(inputs), 1000):  # a remainder batch; one batch; fewer windows
        r = evaluate_split(result.out_dir, batch_size=batch_size)
        assert r["windows"] == len(inputs) == (len(ids) - 1) // config.model.block_size
        assert r["step"] == config.run.max_iters
        np.testing.assert_allclose(r["loss"], expected, rtol=1e-5)
    assert evaluate_main(["--out_dir", str(result.out_dir), "--split=train"]) == 0
    assert capsys.readouterr().out.startswith("train loss ")


def test_evaluate_refuses_a_corpus_with_another_vocabulary(reference, tmp_path):
    _, result = reference
    other = tmp_path / "other.txt"
    other.write_text("abc" * 1000)
    with pytest.raises(ValueError, match="a vocabulary of 3 characters"):
        evaluate_split(result.out_dir, data=str(other))
    with pytest.raises(ValueError, match="split='test'"):
        evaluate_split(result.out_dir, split="test")
    with pytest.raises(ValueError, match="batch_size=0"):
        evaluate_split(result.out_dir, batch_size=0)


def test_resume_continues_exactly(reference, corpus, tmp_path):
    config, result = reference
    first = tc.override(config, out_dir=str(tmp_path / "run"), max_iters=4)
    half = train.run(first)  # checkpoint at 4, mid Snoo period (k=3)
    assert train_losses(half) == {s: v for s, v in train_losses(result).items() if s <= 4}
    resumed = train.run(tc.override(first, max_iters=8, resume=True))
    expected = {s: v for s, v in train_losses(result).items() if s > 4}
    assert train_losses(resumed) == expected  # exact: the same batches, state and program
    assert resumed.final["val_loss"] == result.final["val_loss"]

    # A config that changes the model or optimizer cannot resume; the error names it.
    with pytest.raises(ValueError, match=r"n_embd: checkpoint has 32, this run has 64"):
        train.run(tc.override(first, max_iters=8, resume=True, n_embd=64))
    # A fresh run never writes over existing checkpoints.
    with pytest.raises(FileExistsError, match="--resume"):
        train.run(tc.override(first, max_iters=8))


def test_snoo_static_hint_matches_in_jit_decision(corpus, tmp_path):
    """The host's static sync hint (two compiled variants) equals Snoo's in-jit `lax.cond`:
    two differently fused float32 programs, so the losses and every float of the state
    are as accurate as the in-jit run's against the float64 run (a sync at a wrong step
    would move the params by ~lr); counts and keys equal."""
    config = tiny(corpus, tmp_path)  # the reference run's config: Snoo k=3 around AdamW
    assert step_setup(config)[3].sync_period == 3
    hinted, in_jit = (train_steps(config, 7, hinted=h) for h in (True, False))
    # The float64 run is the peer's program (in-jit), so a bug of either path shows.
    assert_as_accurate(hinted, in_jit, float64_train_steps(config, 7, hinted=False))


def _schedule(compiled) -> list[str]:
    """The compiled module's instructions in their scheduled order (names only)."""
    return re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = ", compiled.as_text(), re.MULTILINE)


def test_cpu_step_compiles_with_the_memory_optimized_schedule(corpus, tmp_path, monkeypatch):
    """The trainer's CPU programs carry `CPU_COMPILER_OPTIONS`; the schedule changes only
    the order of the kernels, so with the CPU emitters users run (conftest turns them off
    for speed) the state is bitwise that of XLA's default schedule."""
    config = tiny(corpus, tmp_path, dtype="bfloat16", n_embd=64)
    mesh, state, step, _, vocab_size = step_setup(config)
    assert compiler_options(mesh) == CPU_COMPILER_OPTIONS
    xy = [put_batch(a, batch_sharding(mesh)) for a in random_batches(config, 1, vocab_size)[0]]
    lowered = step.lower(state, *xy)
    assert _schedule(lowered.compile()) == _schedule(
        lowered.compile(compiler_options=CPU_COMPILER_OPTIONS))
    users = {"xla_cpu_use_fusion_emitters": True}
    ours = lowered.compile(compiler_options={**CPU_COMPILER_OPTIONS, **users})
    default = lowered.compile(
        compiler_options={"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT", **users})
    assert _schedule(ours) != _schedule(default)
    copy = jax.tree.map(jnp.copy, state)  # the step donates its state
    for _ in range(3):
        state, _ = ours(state, *xy)
        copy, _ = default(copy, *xy)
    jax.tree.map(np.testing.assert_array_equal, state, copy)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_DEFAULT")
    assert compiler_options(mesh) is None  # the user's flag wins


def test_gradient_accumulation_equals_big_batch(corpus, tmp_path):
    """Two micro-batches of 4 rows are the batch of 8: the losses, gradient norms and
    params as accurate as the one big batch's against the float64 run."""
    big = tiny(corpus, tmp_path, batch_size=8, grad_accum=1)
    small = tc.override(big, batch_size=4, grad_accum=2)
    batches = random_batches(big, 4, td.open_dataset(corpus).vocab_size)
    (m_small, s_small), (m_big, s_big) = (train_steps(c, batches=batches, hinted=False)
                                          for c in (small, big))
    m_ref, s_ref = float64_train_steps(big, batches=batches, hinted=False)
    assert_as_accurate((m_small, s_small.params), (m_big, s_big.params), (m_ref, s_ref.params))


def test_eight_devices_match_one_and_stay_sharded(corpus, tmp_path):
    """data=2, fsdp=2, tensor=2 follows the 1-device trajectory; state keeps its shardings."""
    assert len(jax.devices()) == 8
    one = tiny(corpus, tmp_path)
    eight = tc.override(one, mesh_data=2, mesh_fsdp=2, mesh_tensor=2)
    # Two float32 programs (the 8-device one reduces over devices): every float of its
    # losses and state as accurate as the 1-device run's against the float64 run.
    (m8, state), (m1, s1) = (train_steps(c, 4, hinted=False, on_host=False)
                             for c in (eight, one))
    assert_as_accurate((m8, jax.device_get(state)), (m1, jax.device_get(s1)),
                       float64_train_steps(one, 4, hinted=False))

    name = "blocks/0/mlp/c_fc/kernel"
    mirrors = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
               if path_to_str(path).endswith(name)]
    assert len(mirrors) >= 4  # the param, Snoo's slow copy and momentum, Adam's mu and nu
    assert all(leaf.sharding.spec == P("fsdp", "tensor") for leaf in mirrors)
    assert state.step.sharding.spec == P()

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(4, state, {"step": 4}, val_loss=1.0)
    ckpt.wait()
    for like in (state, s1):  # restore sharded, and resharded onto one device
        restored, _ = ckpt.restore(4, like=like)
        jax.tree.map(np.testing.assert_array_equal, restored, state)
        same = jax.tree.map(lambda r, x: r.sharding.is_equivalent_to(x.sharding, r.ndim),
                            restored, like)
        assert all(jax.tree.leaves(same))
    ckpt.close()


# ----------------------------------------------------------------------------- schedules


def nanogpt_lr(it, lr, min_lr, warmup, decay):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup)))
    return min_lr + coeff * (lr - min_lr)


def test_cosine_schedule_is_nanogpts_get_lr():
    config = tc.override(tc.TrainConfig(), optimizer="adamw", learning_rate=1e-3,
                         final_lr_scale=0.1, warmup_iters=100, max_iters=2000)
    schedule = build_optimizer(config).learning_rate
    for it in [0, 1, 50, 99, 100, 101, 700, 1999, 2000, 2500]:
        assert float(schedule(it)) == pytest.approx(nanogpt_lr(it, 1e-3, 1e-4, 100, 2000),
                                                    rel=1e-5), it
    # Muon's logged lr: its own peak on the same schedule, floored at the same fraction.
    muon = build_optimizer(tc.override(config, optimizer="muon", muon_learning_rate=0.02))
    assert float(muon.learning_rate(2000)) == pytest.approx(0.002, rel=1e-5)
    short = build_optimizer(tc.override(config, max_iters=50)).learning_rate
    assert float(short(10)) == pytest.approx(1e-3 * 11 / 101, rel=1e-5)
    assert float(short(200)) == pytest.approx(1e-4, rel=1e-5)


def test_stable_cooldown_schedule_is_the_records():
    config = tc.override(tc.TrainConfig(), optimizer="adamw", schedule="stable_cooldown",
                         max_iters=100, cooldown_frac=0.7, final_lr_scale=0.01,
                         learning_rate=2e-3)
    schedule = build_optimizer(config).learning_rate
    for t in [0, 10, 29, 30, 65, 99, 100]:
        x = t / 100
        mult = 1.0 if x < 0.3 else (1 - x) / 0.7 * (1 - 0.01) + 0.01
        assert float(schedule(t)) == pytest.approx(2e-3 * mult, rel=1e-5), t


# ----------------------------------------------------------------------------- config / CLI


def test_presets_and_overrides():
    default = tc.parse_args([])
    assert default == tc.get_preset("shakespeare_char_cpu")
    flat = tc.flat_dict(default)
    assert [flat[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                              "max_iters", "optimizer", "adam_learning_rate", "final_lr_scale",
                              "warmup_iters", "adam_b2", "dropout")] == [
        4, 4, 128, 64, 12, 2000, "snoo_muon", 1e-3, 0.1, 100, 0.99, 0.0]
    gpu = tc.get_preset("shakespeare_char")
    assert (gpu.model.n_layer, gpu.model.n_embd, gpu.model.block_size, gpu.data.batch_size,
            gpu.model.dropout, gpu.run.max_iters) == (6, 384, 256, 64, 0.2, 5000)
    assert tc.get_preset("moe_tiny").model.moe_every == 2
    assert tc.get_preset("gpt2_small").model.n_embd == 768
    config = tc.parse_args(["--optimizer", "adamw", "--max_iters=7", "--preset=moe_tiny",
                            "--resume", "--lr_decay_iters=None", "--sample_start=a\\nb",
                            "--learning-rate=3e-4", "--bias=true"])
    assert (config.optimizer.name, config.run.max_iters, config.model.moe_every,
            config.run.resume, config.optimizer.table.lr_decay_iters, config.sample.start,
            config.optimizer.table.learning_rate, config.model.bias) == (
                "adamw", 7, 2, True, None, "a\nb", 3e-4, True)
    assert tc.config_from_dict(tc.config_to_dict(config)) == config
    assert tc.config_from_dict(tc.flat_dict(config)) == config  # older checkpoints: flat
    # Every flat key names one field; the model's are GPTConfig's (no second copy); the
    # optimizer's hyperparameters are the recipe's, not keys of the trainer.
    assert len(tc.KEYS) == len(set(tc.KEYS.values())) == 69
    assert not set(tc.KEYS) & set(OPTIMIZERS["adamw"].hyperparameters.names())
    assert {name for g, name in tc.KEYS.values() if g == "model"} == {
        f.name for f in dataclasses.fields(models.GPTConfig)} - {"vocab_size"}
    assert tc.parse_args(["--dtype=float16"]).model.dtype == "float16"  # as GPTConfig says
    gpt = tc.model_config(config, 65)
    assert gpt.vocab_size == 65 and gpt.moe_every == 2
    assert tc.model_config(default, 65).vocab_size == 65  # nanoGPT's CPU recipe: no padding
    assert tc.model_config(default, 50257).vocab_size == 50304  # nanoGPT's GPT-2 padding
    with pytest.raises(ValueError, match="mesh_tensor=2 does not divide the vocabulary of 65 "
                                         r"\(--vocab_multiple=None\); pass --vocab_multiple=2"):
        tc.model_config(tc.override(default, mesh_tensor=2), 65)
    assert tc.model_config(tc.override(default, vocab_multiple=8), 65).vocab_size == 72
    assert tc.model_config(tc.get_preset("gpt2_small"), 65).vocab_size == 128
    assert tc.model_config(tc.get_preset("gpt2_medium_fineweb"), 50257).vocab_size == 50304


@pytest.mark.parametrize("argv, message", [
    (["--n_layers=3"], r"unknown key --n_layers \(did you mean --n_layer"),
    (["--n_layer=three"], r"--n_layer='three': expected int"),
    (["--dropout=high"], r"--dropout='high': expected float"),
    (["--resume=maybe"], r"--resume='maybe': expected bool"),
    (["--preset=tiny_gpu"], r"unknown preset 'tiny_gpu'.*Presets: \["),
    (["--schedule=linear"], r"schedule='linear': expected one of \['cosine'"),
    (["--optimizer=adamw", "--kfac_mode=pi"], r"--kfac_mode is not read by --optimizer=adamw"),
    (["--mesh_data=0"], r"mesh_data=0"),
    (["max_iters=3"], r"expected --key=value"),
])
def test_cli_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        tc.parse_args(argv)


@pytest.mark.parametrize("values, message", [
    ({"n_layer": 0}, r"GPTConfig.n_layer must be a positive int, got 0"),
    ({"bias": "yes"}, r"bias='yes': expected bool"),
    ({"snoo_k": 0}, r"snoo_k=0: expected an integer >= 1"),
    ({"optimizer": "kfac", "kfac_mode": "exact"},
     r"kfac_mode='exact': expected one of \['pi', 'eigen'\]"),
    ({"nope": 1}, r"unknown key --nope"),
])
def test_override_validates_each_group(values, message):
    with pytest.raises(ValueError, match=message):
        tc.override(tc.TrainConfig(), **values)


def test_unknown_optimizer_fails_before_any_work(tmp_path, capsys):
    message = r"recipe 'adamx' is unknown \(did you mean adamw.*the recipes are adafactor, "
    with pytest.raises(ValueError, match=message):
        train.run(tc.override(tc.TrainConfig(), optimizer="adamx", out_dir=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()
    assert main(["--optimizer=adamx"]) == 2
    assert "recipe 'adamx' is unknown" in capsys.readouterr().err


def test_main_help_and_error_exit(capsys):
    assert main(["--help", "--preset=gpt2_small"]) == 0
    text = capsys.readouterr().out
    for key in tc.KEYS:
        assert f"--{key} " in text
    assert "default 768" in text and "adamw" in text and "snoo_muon" in text
    assert main(["--n_embed=64"]) == 2
    assert "did you mean --n_embd" in capsys.readouterr().err


def test_async_checkpoint_is_safe_from_donation(tmp_path):
    """The train step donates the state right after an asynchronous save starts."""
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32), "step": jnp.int32(3)}
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, {"step": 3}, val_loss=1.0)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    state = bump(state)
    with pytest.raises(FileExistsError):
        ckpt.save(3, state, {"step": 3})
    ckpt.wait()
    restored, meta = ckpt.restore(3, like=state)
    jax.tree.map(np.testing.assert_array_equal, restored, expected)
    assert meta == {"step": 3}
    ckpt.close()


def test_config_mismatch_message():
    saved = tc.flat_dict(tc.TrainConfig())
    check_compatible(saved, {**saved, "max_iters": 5, "out_dir": "x"})  # run fields may change
    with pytest.raises(ValueError, match=r"(?s)2 field\(s\).*n_layer: checkpoint has 4, this run "
                                         r"has 6.*optimizer: checkpoint has 'snoo_muon'"):
        check_compatible(saved, {**saved, "n_layer": 6, "optimizer": "adamw"})


def test_a_key_added_since_the_checkpoint_compares_at_its_default():
    """A checkpoint written before a key existed trained at the key's default: it resumes
    at that default and refuses any other value."""
    current = tc.flat_dict(tc.TrainConfig())
    older = {k: v for k, v in current.items() if k not in ("qk_clip_tau", "muon_smoothing")}
    check_compatible(older, current)
    with pytest.raises(ValueError, match="qk_clip_tau: checkpoint has 0.0, this run has 50.0"):
        check_compatible(older, {**current, "qk_clip_tau": 50.0})
    # A recipe's hyperparameter: the checkpoint trained at the recipe's default.
    with pytest.raises(ValueError, match="muon_smoothing: checkpoint has None, this run has 0.5"):
        check_compatible(older, {**current, "muon_smoothing": 0.5})


def test_a_checkpoint_resumes_only_at_its_hyperparameters():
    """Every hyperparameter the recipe reads must match; the schedule's shape may move, as
    max_iters may (the loop warns about the lr)."""
    saved = tc.flat_dict(tc.TrainConfig())
    check_compatible(saved, tc.flat_dict(tc.override(tc.TrainConfig(), lr_decay_iters=50)))
    with pytest.raises(ValueError, match=r"1 field\(s\): muon_learning_rate: checkpoint has "
                                         r"0.02, this run has 0.3"):
        check_compatible(saved, tc.flat_dict(tc.override(tc.TrainConfig(),
                                                          muon_learning_rate=0.3)))
    with pytest.raises(ValueError, match="snoo_k: checkpoint has 28, this run has 4"):
        check_compatible(saved, tc.flat_dict(tc.override(tc.TrainConfig(), snoo_k=4)))


# ----------------------------------------------------------------------------- data


def test_data_is_deterministic_in_seed_and_step(corpus):
    data = td.open_dataset(corpus)
    text = corpus.read_text()
    assert data.tokenizer.chars == "".join(sorted(set(text)))
    train_ids, val_ids = (data.split(s).shards[0].array for s in ("train", "val"))
    assert len(train_ids) == int(len(text) * 0.9)
    assert data.tokenizer.decode(np.concatenate([train_ids, val_ids])) == text
    kw = dict(batch_size=4, block_size=16, seed=3)
    x1, y1 = data.batch("train", 7, **kw)
    x2, _ = data.batch("train", 7, **kw)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[..., 1:], y1[..., :-1])
    assert not np.array_equal(x1, data.batch("train", 8, **kw)[0])
    assert not np.array_equal(x1, data.batch("train", 7, **{**kw, "seed": 4})[0])
    xa, _ = data.batch("train", 7, grad_accum=2, **{**kw, "batch_size": 2})
    np.testing.assert_array_equal(xa.reshape(1, 4, 16), x1)
    ev1, ev2 = (data.eval_batches("val", num_batches=3, **kw)[0] for _ in range(2))
    assert ev1.shape == (3, 4, 16)
    np.testing.assert_array_equal(ev1, ev2)
    with pytest.raises(ValueError, match="split='test'"):
        data.batch("test", 0, **kw)


def test_corpus_not_found_says_where_to_put_it(tmp_path):
    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    missing = [tmp_path / "a" / "input.txt"]
    with pytest.raises(FileNotFoundError) as err:
        td.find_corpus(search=missing, cache_dir=tmp_path / "cache", opener=offline)
    message = str(err.value)
    assert str(missing[0]) in message and str(tmp_path / "cache" / "input.txt") in message
    assert "--data=PATH" in message and td.TINYSHAKESPEARE_SHA256 in message
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        td.open_dataset(tmp_path / "nope.txt")

    payload = b"to be or not to be\n"
    served = lambda url, timeout: io.BytesIO(payload)
    with pytest.raises(FileNotFoundError, match="sha256"):
        td.find_corpus(search=missing, cache_dir=tmp_path / "cache", opener=served)
    assert not (tmp_path / "cache" / "input.txt").exists()
    import hashlib

    good = td.find_corpus(search=missing, cache_dir=tmp_path / "cache", opener=served,
                          sha256=hashlib.sha256(payload).hexdigest())
    assert good.read_bytes() == payload


# ----------------------------------------------------------------------------- mesh, MFU


def test_mesh_shape_fill_and_errors():
    cfg = lambda **values: tc.override(tc.TrainConfig(), **values)
    assert mesh_shape(cfg(mesh_data=-1, mesh_fsdp=2, mesh_tensor=1), 8) == (4, 2, 1)
    assert mesh_shape(cfg(mesh_data=1, mesh_fsdp=1, mesh_tensor=1), 8) == (1, 1, 1)
    with pytest.raises(ValueError, match="--mesh_data=4 --mesh_fsdp=4 --mesh_tensor=1: the mesh "
                                         "needs 16 devices; 8 available"):
        mesh_shape(cfg(mesh_data=4, mesh_fsdp=4), 8)
    with pytest.raises(ValueError, match="fixed axes. product 3 does not divide the 8 devices"):
        mesh_shape(cfg(mesh_data=-1, mesh_fsdp=3), 8)
    with pytest.raises(ValueError, match="at most one"):
        cfg(mesh_data=-1, mesh_fsdp=-1)


def test_flops_per_token_is_nanogpts_formula():
    import models

    gpt = models.GPTConfig(vocab_size=72, block_size=16, n_layer=2, n_head=2, n_embd=32)
    params = {"wte": {"embedding": np.zeros((72, 32))}, "wpe": {"embedding": np.zeros((16, 32))},
              "blocks": {0: {"moe": {"experts": {"w_fc": np.zeros((8, 32, 64))}}},
                         1: {"mlp": {"c_fc": {"kernel": np.zeros((32, 128))}}}}}
    n = 72 * 32 + (2 / 8) * 8 * 32 * 64 + 32 * 128  # no position table; experts at top_k/E
    assert flops_per_token(params, gpt) == pytest.approx(6 * n + 12 * 2 * 2 * 16 * 16)
