"""The attention implementation (`GPTConfig.attention`): chosen by backend, the same
function whichever runs, a compute choice a run may change when it resumes. CPU only:
cuDNN is checked where it is refused."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import models
import train
from references.error import (
    assert_as_accurate,
    float64,
    in_float64,
    relative_error,
    run_in_float64,
)
from references.gpt64 import FLOAT64_DTYPES, float64_config
from train import config as tc
from train.sample import load_params

pytestmark = pytest.mark.usefixtures("compilation_cache")


def test_auto_is_handwritten_on_cpu_and_with_max_logits_and_xla_off_gpus():
    auto = models.GPTConfig()  # float32 would make cuDNN refuse before any compile
    assert models.resolve_attention(auto) == "handwritten"  # the tests' backend is CPU
    assert models.resolve_attention(auto, platform="cpu") == "handwritten"
    assert models.resolve_attention(auto, platform="tpu") == "xla"
    assert models.resolve_attention(auto, platform="tpu", max_logits=True) == "handwritten"
    fp32 = models.GPTConfig(dtype="float32")
    assert models.resolve_attention(fp32, platform="gpu") == "xla"  # cuDNN: bf16/fp16 only
    for name in ("handwritten", "xla"):
        assert models.resolve_attention(models.GPTConfig(attention=name)) == name


@pytest.mark.parametrize("name, max_logits, message", [
    ("cudnn", False, "attention='cudnn' is not available: cuDNN flash attention runs on "
                     "NVIDIA GPUs, and the devices here are cpu; use attention='auto' or 'xla'"),
    ("xla", True, "attention='xla' cannot return the max logits QK-clip reads"),
    ("cudnn", True, "attention='cudnn' cannot return the max logits QK-clip reads"),
])
def test_an_implementation_that_cannot_run_is_refused_in_one_line(name, max_logits, message):
    with pytest.raises(ValueError) as err:
        models.resolve_attention(models.GPTConfig(attention=name), max_logits=max_logits)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    model = models.GPT(models.GPTConfig(n_layer=1, attention=name), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention="):  # the model checks it too
        models.forward(model, jnp.zeros((1, 8), jnp.int32), max_logits=max_logits)


def _logits_loss_and_grads(config: models.GPTConfig, tokens_BT):
    """Logits, then the next-token loss and its gradients, of a GPT of seed 0."""
    graphdef, params = nnx.split(models.GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
    logits = lambda params: models.forward(nnx.merge(graphdef, params), tokens_BT[:, :-1])[0]
    loss = lambda params: optax.softmax_cross_entropy_with_integer_labels(
        logits(params), tokens_BT[:, 1:]).mean()
    return jax.jit(logits)(params), jax.jit(jax.value_and_grad(loss))(params)


#: How far a bf16 model's results may be from the float64 model's (relative, Frobenius)
#: for it to be that model's computation: bf16's 8-bit mantissa is 4e-3 a rounding.
BF16_SAME = 0.05


@pytest.mark.parametrize("n_kv_head", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_equals_handwritten_in_forward_and_gradients(n_kv_head, dtype):
    """The same parameters (same seed), the same function: logits, loss and every
    gradient of each implementation are as accurate as the other's against the float64
    model (float32 to float32's rounding, bf16 to bf16's)."""
    base = models.GPTConfig(n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64,
                            block_size=32, vocab_size=65, dtype=dtype)
    tokens_BT = jax.random.randint(jax.random.key(1), (3, 33), 0, 65)
    handwritten = _logits_loss_and_grads(dataclasses.replace(base, attention="handwritten"),
                                         tokens_BT)
    xla = _logits_loss_and_grads(dataclasses.replace(base, attention="xla"), tokens_BT)
    # float64 through autodiff (attention="xla"), not through the hand-written VJP
    exact = run_in_float64(lambda: _logits_loss_and_grads(
        float64_config(dataclasses.replace(base, attention="xla")), tokens_BT))
    same = {"float32": {}, "bfloat16": {"same": BF16_SAME}}[dtype]
    assert_as_accurate(xla, handwritten, exact, what="xla", **same)
    assert_as_accurate(handwritten, xla, exact, what="handwritten", **same)
    if dtype == "bfloat16":  # the bf16 programs round as bf16 does, not as float32
        assert relative_error(handwritten[0], exact[0]) > 1e-4


@pytest.mark.parametrize("name", ["handwritten", "xla"])
def test_the_key_value_cache_decodes_as_the_full_forward_pass(name):
    config = models.GPTConfig(n_layer=1, n_kv_head=2, block_size=16, dtype="float32",
                              attention=name)
    model = models.GPT(config, rngs=nnx.Rngs(0))
    tokens_BT = jax.random.randint(jax.random.key(2), (2, 12), 0, 65)

    def decode_and_full(model):
        prompt, cache = model.decode(tokens_BT[:, :8], model.init_cache(2), 0)
        last, _ = model.decode(tokens_BT[:, 8:], cache, 8)
        return jnp.concatenate([prompt, last], 1), model(tokens_BT, dropless=True)

    decoded, full = decode_and_full(model)
    # Two float32 programs (cached, full): as accurate as the full one, against float64.
    exact = run_in_float64(lambda: decode_and_full(models.GPT(float64_config(config),
                                                              rngs=nnx.Rngs(0)))[1])
    assert_as_accurate(decoded, full, exact)


def test_attention_is_a_compute_choice_a_resumed_run_may_change(corpus, tmp_path):
    """A run resumed with another --attention continues it: allowed, its final params as
    accurate as the uninterrupted run's against that run in float64 (two float32
    programs), and config.json records the implementation that ran."""
    config = tc.override(
        tc.TrainConfig(), n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8,
        dtype="float32", optimizer="adamw", learning_rate=1e-2, final_lr_scale=0.1,
        warmup_iters=2, max_iters=8, lr_decay_iters=8, eval_interval=2, eval_iters=1,
        log_interval=1, checkpoint_every=2, mesh_data=1, num_samples=0, progress=False,
        data=str(corpus))
    whole = train.run(tc.override(config, out_dir=str(tmp_path / "whole")))
    out = tmp_path / "resumed"
    train.run(tc.override(config, out_dir=str(out), max_iters=4))
    assert json.loads((out / "config.json").read_text())["model"]["attention"] == "handwritten"
    resumed = train.run(tc.override(config, out_dir=str(out), resume=True, attention="xla"))
    assert json.loads((out / "config.json").read_text())["model"]["attention"] == "xla"
    losses = lambda history: {h["step"]: h["loss"] for h in history if "loss" in h and
                              h["step"] > 4}
    assert losses(resumed.history).keys() == losses(whole.history).keys() == {5, 6, 7, 8}
    with in_float64():
        train.run(tc.override(config, out_dir=str(tmp_path / "float64"), **FLOAT64_DTYPES))
        exact = float64(load_params(tmp_path / "float64", 8)[1])
    assert_as_accurate(load_params(out, 8)[1], load_params(tmp_path / "whole", 8)[1], exact)


def test_attention_is_not_compared_on_resume():
    from train.checkpoint import check_compatible

    saved = tc.flat_dict(tc.override(tc.TrainConfig(), attention="handwritten"))
    assert "attention" not in tc.group_fields("model")
    check_compatible(saved, tc.flat_dict(tc.override(tc.TrainConfig(), attention="xla")))
