"""modded-nanogpt Track 3's network (``train_gpt_simple.py``'s ``GPT``) as options of our GPT.

The reference is a float64 numpy port of the file's forward pass, written from the file
(https://github.com/KellerJordan/modded-nanogpt/blob/master/records/track_3_optimization/
train_gpt_simple.py), reading the file's ``state_dict`` layout (``(out, in)`` weights); our
model gets the same weights through ``models.from_torch``. The weights are random and
non-zero (the file's init zeroes every ``proj``, which would hide the attention and MLP
outputs and the head).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from optax_snoo import kfac
from references.error import assert_as_accurate, run_in_float64
from references.track3_constants import R42

L, D, HEAD, V, T, B = 2, 256, 64, 300, 32, 2
F32 = dict(dtype="float32", param_dtype="float32", embed_dtype=None, residual_dtype="float32")
TORCH_EPS = float(np.finfo(np.float32).eps)  # F.rms_norm(eps=None) on float32/bf16 inputs


def config(head_dim: int = HEAD, **overrides) -> models.GPTConfig:
    return models.track3_config(n_layer=L, n_embd=D, head_dim=head_dim, vocab_size=V,
                                block_size=T, **{**F32, **overrides})


def random_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """A ``train_gpt_simple.py`` state_dict (its names and (out, in) layout), every tensor
    random: weights N(0, 1/fan_in) (the head 3x larger so the soft-cap bites), biases
    N(0, 0.1^2), gains 1 + N(0, 0.1^2), embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    sd = {"embed.weight": rng.normal(size=(V, D)),
          "norm1.gains": 1 + 0.1 * rng.normal(size=D), "norm2.gains": 1 + 0.1 * rng.normal(size=D),
          "proj.weight": 3 * rng.normal(size=(V, D)) / np.sqrt(D),
          "proj.bias": 0.1 * rng.normal(size=V)}
    shapes = {"attn.q": (D, D), "attn.k": (D, D), "attn.v": (D, D), "attn.proj": (D, D),
              "mlp.fc": (4 * D, D), "mlp.proj": (D, 4 * D)}
    for i in range(L):
        for norm in ("norm1", "norm2"):
            sd[f"blocks.{i}.{norm}.gains"] = 1 + 0.1 * rng.normal(size=D)
        for name, (out, fan_in) in shapes.items():
            sd[f"blocks.{i}.{name}.weight"] = rng.normal(size=(out, fan_in)) / np.sqrt(fan_in)
            sd[f"blocks.{i}.{name}.bias"] = 0.1 * rng.normal(size=out)
    return {k: v.astype(np.float32) for k, v in sd.items()}


# ------------------------------------------------------------- the file, in float64 numpy


def rms_norm_ref(x, gains=None):
    # F.rms_norm(x, (x.size(-1),), weight=gains): eps=None is float32's machine epsilon
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + TORCH_EPS)
    return y if gains is None else y * gains


def rotary_ref(x_BTHD):
    """``Rotary.forward``: (1/1024)**linspace(0, 1, hd/4), then hd/4 zeros; chunk(2)."""
    hd = x_BTHD.shape[-1]
    freq = np.concatenate([(1 / 1024) ** np.linspace(0, 1, hd // 4), np.zeros(hd // 4)])
    theta = np.outer(np.arange(x_BTHD.shape[1]), freq)[None, :, None, :]
    cos, sin = np.cos(theta), np.sin(theta)
    x1, x2 = x_BTHD[..., :hd // 2], x_BTHD[..., hd // 2:]
    return np.concatenate([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], axis=3)


def linear_ref(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def attention_ref(x, sd, prefix, head_dim, max_logits=None):
    Bx, Tx, _ = x.shape
    q, k, v = (linear_ref(x, sd, f"{prefix}.{n}").reshape(Bx, Tx, -1, head_dim)
               for n in ("q", "k", "v"))
    q, k = rotary_ref(rms_norm_ref(q)), rotary_ref(rms_norm_ref(k))
    s = np.einsum("bthd,bshd->bhts", q, k) * 0.12
    s = np.where(np.tril(np.ones((Tx, Tx), bool)), s, -np.inf)
    if max_logits is not None:
        max_logits[prefix] = s.max(axis=(0, 2, 3))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = np.einsum("bhts,bshd->bthd", p, v).reshape(Bx, Tx, -1)
    return linear_ref(y, sd, f"{prefix}.proj")


def logits_ref(sd, tokens, head_dim=HEAD, max_logits=None):
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = rms_norm_ref(sd["embed.weight"][tokens], sd["norm1.gains"])
    for i in range(L):
        b = f"blocks.{i}"
        x = x + attention_ref(rms_norm_ref(x, sd[f"{b}.norm1.gains"]), sd, f"{b}.attn",
                              head_dim, max_logits)
        h = np.maximum(linear_ref(rms_norm_ref(x, sd[f"{b}.norm2.gains"]), sd, f"{b}.mlp.fc"), 0)
        x = x + linear_ref(h * h, sd, f"{b}.mlp.proj")
    logits = linear_ref(rms_norm_ref(x, sd["norm2.gains"]), sd, "proj")
    return 15 * logits / np.sqrt(logits * logits + 15 ** 2)


def summed_ce(logits, targets):
    """F.cross_entropy(..., reduction="sum"), numpy or jax arrays."""
    xp = np if isinstance(logits, np.ndarray) else jnp
    m = logits.max(-1, keepdims=True)
    lse = (m + xp.log(xp.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    picked = xp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (lse - picked).sum()


@functools.cache
def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def loss_of(model) -> float:
    tokens, targets = batch()
    return float(summed_ce(model(jnp.asarray(tokens)), jnp.asarray(targets)))


@functools.cache
def reference_logits(head_dim: int = HEAD) -> np.ndarray:
    """The file's logits of `batch()` in float64 (`random_state_dict()`'s weights)."""
    return logits_ref(random_state_dict(), batch()[0], head_dim)


@functools.cache
def reference_loss(head_dim: int = HEAD) -> float:
    return float(summed_ce(reference_logits(head_dim), batch()[1]))


def logits_of(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(batch()[0])))


# ------------------------------------------------------------------------ the forward pass


@pytest.mark.parametrize("head_dim", [128, 32])
def test_forward_equals_the_file_in_float64(head_dim):
    """Summed loss to 1e-5 relative (float32 compute); heads of 128 as the file, and of 32
    (8 frequencies + 8 zeros)."""
    model = models.from_torch(random_state_dict(), config(head_dim))
    ours, ref = loss_of(model), reference_loss(head_dim)
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


# Each of the file's differences from our default GPT, set back to our default: the loss
# must no longer match the file's. Parameters the flipped model has and the file does not
# (wpe, norm biases) are random, as a trained model's would be.
DIFFERENCES = {
    "rmsnorm (not layernorm)": dict(norm="layernorm"),
    "norm after the embedding": dict(embed_norm=False),
    "no learned positions": dict(position="learned"),
    "half-truncated rotary": dict(rotary="none"),
    "qk-norm": dict(qk_norm=False),
    "attention scale 0.12": dict(attn_scale=None),
    "relu2 mlp": dict(mlp="gelu"),
    "linear biases": dict(bias=False),
    "no norm biases": dict(norm_bias=None),
    "lm-head bias": dict(lm_head_bias=False),
    "logit soft-cap": dict(logit_softcap=None),
    "untied head": dict(tie_embeddings=True, lm_head_bias=False),
}


def _with_file_weights(cfg: models.GPTConfig) -> models.GPT:
    """A GPT of ``cfg`` holding the file's weights where it has the same parameter, every
    other parameter N(0, 0.1^2) (a zero bias would hide a norm-bias option)."""
    source = nnx.to_flat_state(nnx.state(models.from_torch(random_state_dict(), config()),
                                         nnx.Param))
    source = {path: v.get_value() for path, v in source}
    model = models.GPT(cfg, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    key = jax.random.key(4)
    for path, var in nnx.to_flat_state(state):
        key, sub = jax.random.split(key)
        value = var.get_value()
        if path in source and source[path].shape == value.shape:
            var.set_value(source[path])
        else:
            var.set_value(0.1 * jax.random.normal(sub, value.shape, value.dtype))
    nnx.update(model, state)
    return model


def test_the_flip_helper_keeps_the_file_function_when_nothing_is_flipped():
    ours, ref = loss_of(_with_file_weights(config())), reference_loss()
    assert abs(ours - ref) <= 1e-5 * abs(ref)


@pytest.mark.parametrize("difference", sorted(DIFFERENCES))
def test_every_difference_from_our_default_gpt_is_needed(difference):
    flipped = config(**DIFFERENCES[difference])
    for name in DIFFERENCES[difference]:
        assert getattr(flipped, name) == getattr(models.GPTConfig(), name)  # our default
    ours, ref = loss_of(_with_file_weights(flipped)), reference_loss()
    assert abs(ours - ref) > 1e-4 * abs(ref), (difference, ours, ref)  # 10x the match tolerance


def test_rms_norm_uses_pytorchs_default_epsilon():
    """eps = 2^-23 (ATen: numeric_limits<opmath_t>::epsilon(), float for fp32/bf16): at a
    mean square of 1e-6 eps 1e-6 or 1e-5 would be visible, 2^-23 is what the file gets."""
    x = 1e-3 * np.random.default_rng(0).normal(size=(4, D)).astype(np.float32)
    norm = models.RMSNorm(D, bias=False, param_dtype=jnp.float32)
    got = np.asarray(norm(jnp.asarray(x)))
    np.testing.assert_allclose(got, rms_norm_ref(x.astype(np.float64)), rtol=2e-6)
    for other in (1e-6, 1e-5):
        wrong = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + other)
        assert not np.allclose(got, wrong, rtol=1e-3)


def test_rotary_frequencies_are_the_files():
    freq = np.asarray(models.attention.half_truncated_frequencies(128))
    j = np.arange(32)
    np.testing.assert_allclose(freq[:32], (1 / 1024) ** (j / 31), rtol=1e-6)
    assert freq[0] == 1.0 and np.all(freq[32:] == 0) and freq.shape == (64,)
    assert models.attention.half_truncated_frequencies(4).tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------- init and config


def _matrices_and_biases(state_dict):
    """The file's state dict less its rotary buffer, after checking what every Track 3
    init shares: gains one, the embedding N(0, 1)."""
    rest = {}
    for name, value in state_dict.items():
        if "rotary" in name:
            continue
        if name.endswith("gains"):
            assert np.all(value == 1), name
        elif name == "embed.weight":
            assert abs(value.mean()) < 0.01 and abs(value.std() - 1) < 0.01
        else:
            rest[name] = value
    return rest


def test_the_files_init():
    """q/k/v/fc weights N(0, 0.33/fan_in); every proj and the head zero; biases zero;
    embedding N(0, 1); gains one (train_gpt_simple.py's init loop)."""
    cfg = models.track3_config(n_layer=2, n_embd=512, head_dim=128, vocab_size=1024,
                               block_size=T)
    sd = models.to_torch(models.GPT(cfg, rngs=nnx.Rngs(0)), cfg)
    for name, value in _matrices_and_biases(sd).items():
        if name.endswith(("bias",)) or "proj" in name:
            assert not value.any(), name
        else:
            fan_in = value.shape[1]
            assert name.endswith((".q.weight", ".k.weight", ".v.weight", ".fc.weight")), name
            assert abs(value.mean()) < 0.05 * np.sqrt(0.33 / fan_in)
            assert abs(value.std() / np.sqrt(0.33 / fan_in) - 1) < 0.02, name
    assert models.GPT(cfg, rngs=nnx.Rngs(0)).wte.embedding.dtype == jnp.bfloat16
    nanogpt = models.GPT(dataclasses.replace(cfg, init="nanogpt"), rngs=nnx.Rngs(0))
    assert nanogpt.blocks[0].mlp.c_proj.kernel[...].any()  # the option is what zeroes them


def test_the_hyperball_records_init():
    """Track 3 #5/#8/#13 (``init="hyperball"``): PyTorch's ``nn.Linear`` default
    ``U(±1/sqrt(fan_in))`` on q/k/v and every input bias; x1.5 on fc, x1.25 on attn.proj,
    x3 on mlp.proj; every proj bias and the head zero; embedding N(0, 1); gains one
    (the records' init loop, in the file's names)."""
    cfg = dataclasses.replace(models.track3_config(
        n_layer=2, n_embd=256, head_dim=64, vocab_size=1024, block_size=T), init="hyperball")
    scale = {".q.weight": 1.0, ".k.weight": 1.0, ".v.weight": 1.0, ".fc.weight": 1.5,
             "attn.proj.weight": 1.25, "mlp.proj.weight": 3.0}
    sd = models.to_torch(models.GPT(cfg, rngs=nnx.Rngs(0)), cfg)
    for name, value in _matrices_and_biases(sd).items():
        value = np.asarray(value, np.float64)
        if name in ("proj.weight", "proj.bias") or name.endswith(".proj.bias"):
            assert not value.any(), name
        else:
            # (out, in) weights, and biases with the bound of their weight's fan_in
            key = next((k for k in scale if name.endswith(k)), None)
            weight = sd[name.replace(".bias", ".weight")]
            bound = (scale[key] if key else 1.0) / np.sqrt(weight.shape[1])
            assert key or name.endswith(("q.bias", "k.bias", "v.bias", "fc.bias")), name
            assert np.abs(value).max() <= bound, name
            assert np.abs(value).max() > 0.97 * bound, name  # uniform: fills its interval
            assert abs(value.std() / (bound / np.sqrt(3)) - 1) < 0.1, name


def test_track3_config_is_the_files_shape_and_refuses_bad_options():
    cfg = models.track3_config()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.hidden, cfg.vocab_size, cfg.block_size,
            cfg.head_dim) == (12, 6, 768, 3072, 50304, 1024, 128)
    params = nnx.state(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # the file's GPT(50304, 12, 768): embed, head + bias, 12 x (4 attn + fc + proj linears
    # with biases, 2 gains), 2 gains
    linear = lambda i, o: i * o + o
    block = 4 * linear(768, 768) + linear(768, 3072) + linear(3072, 768) + 2 * 768
    assert n == 50304 * 768 + linear(768, 50304) + 12 * block + 2 * 768
    with pytest.raises(ValueError, match="n_embd=100 must be a multiple of head_dim=64"):
        models.track3_config(n_embd=100, head_dim=64)
    with pytest.raises(ValueError, match="lm_head_bias=True needs an untied head"):
        models.track3_config(tie_embeddings=True)
    with pytest.raises(ValueError, match="head_dim .* a multiple of 4, got 6"):
        models.GPTConfig(n_embd=12, n_head=2, rotary="half_truncated")
    with pytest.raises(ValueError, match=r"GPTConfig.norm must be one of \('layernorm', "
                                         r"'rmsnorm'\), got 'batchnorm'"):
        models.GPTConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="attn_scale must be None or a float > 0, got 0"):
        models.GPTConfig(attn_scale=0)


# --------------------------------------------------------------- weights in and out


def test_to_torch_inverts_from_torch():
    sd = random_state_dict()
    back = models.to_torch(models.from_torch(sd, config()), config())
    rotary = {k for k in back if "rotary" in k}
    assert set(back) - rotary == set(sd) and len(rotary) == L
    for name, value in sd.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
        assert back[name].flags.c_contiguous and back[name].dtype == np.float32
    # the buffers the file's state_dict holds are accepted (and checked) on the way in
    again = models.to_torch(models.from_torch({"_orig_mod." + k: v for k, v in back.items()},
                                              config()), config())
    assert all(np.array_equal(again[k], back[k]) for k in back)


def test_from_torch_names_what_is_wrong():
    sd = random_state_dict()
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.q.bias'\]"):
        models.from_torch({k: v for k, v in sd.items() if k != "blocks.0.attn.q.bias"},
                          config())
    with pytest.raises(ValueError, match=r"not in this config's model \['blocks.2.mlp.fc.bias'"
                                         r", 'lm_head.weight'\]"):
        models.from_torch({**sd, "lm_head.weight": sd["proj.weight"],
                           "blocks.2.mlp.fc.bias": sd["blocks.0.mlp.fc.bias"]}, config())
    with pytest.raises(ValueError, match=r"blocks.1.mlp.fc.weight has shape \(1024, 255\), "
                                         r"expected \(1024, 256\) for blocks/1/mlp/c_fc/kernel"):
        models.from_torch({**sd, "blocks.1.mlp.fc.weight": np.zeros((1024, 255))}, config())
    with pytest.raises(ValueError,
                       match=r"our parameters with no PyTorch name \['wpe/embedding'\]"):
        models.from_torch(sd, config(position="learned"))
    with pytest.raises(ValueError, match="not the half-truncated rotary's frequencies"):
        models.from_torch({**sd, "blocks.0.attn.rotary.angular_freq": np.ones(32)}, config())
    with pytest.raises(ValueError, match=r"no PyTorch name for \['wpe/embedding'\]"):
        models.to_torch(models.GPT(config(position="learned"), rngs=nnx.Rngs(0)),
                        config(position="learned"))


# ---------------------------------------------------------- composing with the rest


def test_scan_layers_attention_paths_and_decode_compute_the_same_function():
    """Scanned layers, XLA's attention and the cached decode are other float32 programs
    of the default model's logits: each as accurate as it against the file in float64."""
    sd, (tokens, _) = random_state_dict(), batch()
    exact = reference_logits()
    default = logits_of(models.from_torch(sd, config()))
    scanned = models.from_torch(sd, config(scan_layers=True))
    assert scanned.blocks.attn.c_q.kernel.shape == (L, D, D)
    assert_as_accurate(logits_of(scanned), default, exact, what="scan_layers")
    assert_as_accurate(logits_of(models.from_torch(sd, config(attention="xla"))), default,
                       exact, what="attention=xla")
    back = models.to_torch(scanned, config(scan_layers=True))
    assert all(np.array_equal(back[k], v) for k, v in sd.items())
    # the key/value cache holds rotated keys: decoding the last token sees the same logits
    model = models.from_torch(sd, config())
    full = model(jnp.asarray(tokens))
    cache = model.init_cache(B)
    _, cache = model.decode(jnp.asarray(tokens[:, :-1]), cache, 0)
    last, _ = model.decode(jnp.asarray(tokens[:, -1:]), cache, T - 1)
    assert_as_accurate(last[:, 0], full[:, -1], exact[:, -1], what="decode")


def test_sharded_by_the_logical_rules_computes_the_same_loss():
    """Every new parameter carries logical axes (the head's bias is sharded as the
    vocabulary); the forward on a (data 2, fsdp 2, tensor 2) mesh is the unsharded one."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    model = models.from_torch(random_state_dict(), config())
    unsharded = logits_of(model)
    with nnx.logical_axis_rules(models.logical_rules()):
        shardings = nnx.get_named_sharding(nnx.state(model), mesh)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    spec = lambda x: tuple(x[...].sharding.spec)
    assert spec(model.lm_head.bias) == ("tensor",) and spec(model.ln_embed.scale) == (None,)
    assert spec(model.blocks[0].attn.c_q.bias) == ("tensor",)
    with jax.set_mesh(mesh):
        logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(batch()[0]))
    # Split matmuls sum in another order: as accurate as the unsharded program.
    assert_as_accurate(logits, unsharded, reference_logits(), what="sharded")


def test_handwritten_backward_uses_the_attention_scale():
    """``causal_attention(..., scale=0.12)``: the value and the hand-written VJP against
    autodiff of ``jax.nn.dot_product_attention(scale=0.12)``."""
    q, k, v, w = jax.random.normal(jax.random.key(0), (4, B, 8, 2, 16))
    ref_fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.12, is_causal=True)
    out = lambda f, w=w: lambda q, k, v: jnp.sum(f(q, k, v) * w)
    scaled = functools.partial(models.causal_attention, scale=0.12)
    ours = jax.jit(jax.value_and_grad(out(scaled), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(out(ref_fn), argnums=(0, 1, 2)))(q, k, v)
    # Two float32 programs of one value and gradient: as accurate as autodiff's.
    exact = run_in_float64(lambda q, k, v, w: jax.value_and_grad(
        out(ref_fn, w), argnums=(0, 1, 2))(q, k, v), q, k, v, w)
    assert_as_accurate(ours, ref, exact)
    default = jax.jit(jax.grad(out(models.causal_attention)))(q, k, v)
    assert not np.allclose(default, ours[1][0], rtol=1e-3)  # the scale reaches the backward


def test_qk_clip_max_logits_are_the_files_scaled_rotated_logits():
    sd, (tokens, _) = random_state_dict(), batch()
    expected = {}
    logits_ref(sd, tokens, HEAD, max_logits=expected)
    _, _, got = models.forward(models.from_torch(sd, config()), jnp.asarray(tokens),
                               max_logits=True)
    assert sorted(got) == [f"blocks/{i}/attn" for i in range(L)]
    for i in range(L):
        np.testing.assert_allclose(got[f"blocks/{i}/attn"], expected[f"blocks.{i}.attn"],
                                   rtol=1e-5)


def test_kfac_capture_sees_every_dense_layer_with_its_bias():
    cfg = config()
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    params = nnx.to_pure_dict(params)
    tokens, targets = (jnp.asarray(a) for a in batch())

    def loss_fn(p, tokens, targets):
        state = nnx.state(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        nnx.replace_by_pure_dict(state, p)
        return summed_ce(nnx.merge(graphdef, state)(tokens), targets)

    described = kfac.describe(loss_fn, params, tokens, targets)
    dense = {path for path, what in described.items()
             if what.startswith("dense") and "with bias" in what}
    layers = [f"blocks/{i}/{m}/kernel" for i in range(L)
              for m in ("attn/c_q", "attn/c_k", "attn/c_v", "attn/c_proj", "mlp/c_fc",
                        "mlp/c_proj")]
    assert dense == {*layers, "lm_head/kernel"}, described


# -------------------------------------------------------------------------- precision


def test_the_files_bf16_precision_runs_close_to_float64():
    """bf16 matmuls, bf16 embedding table and residual stream (the file's precision): the
    summed loss within 0.1% of the float64 reference (2e-5 measured); float32 residual beside
    it."""
    sd, ref = random_state_dict(), reference_loss()
    file_precision = models.track3_config(n_layer=L, n_embd=D, head_dim=HEAD, vocab_size=V,
                                          block_size=T)
    model = models.from_torch(sd, file_precision)
    assert model.wte.embedding.dtype == jnp.bfloat16
    assert model.blocks[0].attn.c_q.kernel.dtype == jnp.float32
    bf16 = loss_of(model)
    f32_stream = loss_of(models.from_torch(sd, dataclasses.replace(
        file_precision, residual_dtype="float32", embed_dtype=None)))
    assert abs(bf16 - ref) < 1e-3 * ref and abs(f32_stream - ref) < 1e-3 * ref
    assert bf16 != f32_stream  # the option changes the computation


@pytest.mark.parametrize("scan", [False, True])
def test_the_cgi_records_init(scan):
    """Track 3 #30 (``init="cgi"``): nn.Linear's default ``U(±1/sqrt(fan_in))`` on q/k/v/fc
    and their biases, block l's fc times ``1 - 0.3 l/(L-1)`` (log:800-806), every proj
    (weight and bias) and the head zero, embedding N(0, 1), and each block's gains
    ``1 ∓ 0.14 s`` with one Rademacher s per channel shared by its two norms (log:809-815),
    the final norm's gains one; unrolled or stacked blocks alike."""
    n_layer = 3
    cfg = dataclasses.replace(models.track3_config(
        n_layer=n_layer, n_embd=256, head_dim=64, vocab_size=1024, block_size=T), init="cgi",
        scan_layers=scan)
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    blocks = params["blocks"]
    block = (lambda i: jax.tree.map(lambda x: x[i], blocks)) if scan else (lambda i: blocks[i])
    assert not np.asarray(params["lm_head"]["kernel"]).any()
    assert np.all(np.asarray(params["ln_f"]["scale"]) == 1)
    for i in range(n_layer):
        b = jax.tree.map(lambda x: np.asarray(x, np.float64), block(i))
        for name in ("c_q", "c_k", "c_v"):
            for leaf in ("kernel", "bias"):
                x, bound = b["attn"][name][leaf], 1 / np.sqrt(256)
                assert bound * 0.97 < np.abs(x).max() <= bound, (i, name, leaf)
        depth = 1 - 0.30 * i / (n_layer - 1)
        fc = b["mlp"]["c_fc"]["kernel"]
        assert depth * 0.97 / 16 < np.abs(fc).max() <= depth / 16, (i, np.abs(fc).max())
        assert abs(fc.std() / (depth / 16 / np.sqrt(3)) - 1) < 0.05
        for proj in (b["attn"]["c_proj"], b["mlp"]["c_proj"]):
            assert not any(np.asarray(v).any() for v in proj.values())
        s = (1 - b["ln_1"]["scale"]) / 0.14
        np.testing.assert_allclose(np.abs(s), 1, rtol=1e-6)
        np.testing.assert_allclose(b["ln_2"]["scale"], 1 + 0.14 * s, rtol=1e-6)
        assert 0.3 < np.mean(s > 0) < 0.7, i  # both signs, about evenly


def _record_name(path: str) -> str:
    """Our parameter path as Track 3's PyTorch name (``blocks.0.attn.q.weight``)."""
    for ours, theirs in (("wte/embedding", "embed.weight"), ("lm_head/", "proj."),
                         ("ln_embed/scale", "norm1.gains"), ("ln_f/scale", "norm2.gains"),
                         ("ln_1/scale", "norm1.gains"),
                         ("ln_2/scale", "norm2.gains"), ("/c_", "/"), ("kernel", "weight"),
                         ("/", ".")):
        path = path.replace(ours, theirs)
    return path


@pytest.mark.parametrize("scan", [False, True])
def test_the_depth_fc_records_init(scan):
    """Track 3 #42 (``init="depth_fc"``), leaf by leaf by the record's names as its script
    initialises each (script:648-658; its constants `references.track3_constants.R42`):
    every parameter whose name holds ``proj`` zero (the projections, their biases, the
    head), every other bias zero, block l's ``fc`` times ``1 - 0.3 l/(L-1)``, the rest
    nn.Linear's ``U(±1/sqrt(fan_in))`` (q/k/v), nn.Embedding's N(0, 1) and RMSNorm's
    ones (``CGI_ALPHA = 0``)."""
    assert R42.cgi_alpha == 0 and R42.zero_biases  # the gains one, every bias zero
    n_layer = 3
    cfg = dataclasses.replace(models.track3_config(
        n_layer=n_layer, n_embd=256, head_dim=64, vocab_size=1024, block_size=T),
        init="depth_fc", scan_layers=scan)
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    if scan:  # one leaf per layer, as the record's blocks.N names
        params = {**params, "blocks": {i: jax.tree.map(lambda x, i=i: x[i], params["blocks"])
                                       for i in range(n_layer)}}
    seen, names = set(), []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _record_name("/".join(str(getattr(k, "key", k)) for k in path))
        names.append(name)
        x = np.asarray(x, np.float64)
        if "proj" in name or name.endswith("bias"):
            rule = "zero"
            assert not x.any(), name
        elif name.endswith("gains"):
            rule = "one"
            assert np.all(x == 1), name
        elif name == "embed.weight":
            rule = "normal"
            assert abs(x.std() - 1) < 0.02 and abs(x.mean()) < 0.02, name
        else:
            layer = int(name.split(".")[1])
            scale = (1 - R42.fc_depth_alpha * layer / (n_layer - 1)
                     if name.endswith("mlp.fc.weight") else 1)
            rule, bound = "uniform", scale / np.sqrt(256)
            assert bound * 0.97 < np.abs(x).max() <= bound * (1 + 1e-6), name
            assert abs(x.std() / (bound / np.sqrt(3)) - 1) < 0.05, name
        seen.add((name.split(".")[-2] if name.startswith("blocks") else name, rule))
    assert {rule for _, rule in seen} == {"zero", "one", "normal", "uniform"}
    assert len(names) == len(set(names)) == 5 + 14 * n_layer, names  # the record's
    assert ("fc", "uniform") in seen and ("norm1", "one") in seen, seen
