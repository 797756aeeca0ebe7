"""Tests of the Flax NNX GPT (models/).

Config, parameter names/axes/init, attention (GQA), MLPs, MoE routing and losses,
generation with a key/value cache. Small float32 configs, so most
comparisons are exact or within 1e-5; references are numpy (float64) re-implementations
of the documented formulas. Compilation dominates the run time, so the tests share two
model configs (DENSE, MOE), cached models and jitted functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import models
from models import moe as moe_lib
from models.layers import dropout, matmul
from references.error import (
    EPS32,
    FACTOR,
    SAME_COMPUTATION,
    ULPS,
    assert_as_accurate,
    float64,
    in_float64,
    relative_error,
    run_in_float64,
)
from references.gpt64 import FLOAT64_DTYPES, float64_model

# GQA (4 query heads share 2 key/value heads), tied GELU MLP.
DENSE = models.GPTConfig(
    vocab_size=16, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    dropout=0.5, dtype="float32",
)
# Block 1 is MoE (4 SwiGLU experts, top-2); capacity 0.75 always drops assignments
# (24 slots for 32 assignments at 16 tokens); untied head; router z-loss.
MOE = dataclasses.replace(
    DENSE, moe_every=2, n_experts=4, top_k=2, capacity_factor=0.75, mlp="swiglu",
    tie_embeddings=False, z_loss_coef=1e-3, dropout=0.0,
)


@functools.cache
def _cached(config: models.GPTConfig) -> models.GPT:
    return models.GPT(config, rngs=nnx.Rngs(0))


def build(config: models.GPTConfig) -> models.GPT:
    """A fresh copy of the (cached) model of `config`, safe to modify."""
    return nnx.clone(_cached(config))


def flat_params(tree) -> dict[str, nnx.Variable]:
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree, nnx.Param)
    return {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


# Test inputs come from numpy: every jax.random call on a new shape costs a compilation.
def tokens(shape=(3, 16), seed=0, vocab=DENSE.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def normal(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def xent(logits_BTV, aux_loss, targets_BT):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    return ce.mean() + aux_loss


@nnx.jit
def jit_forward(model, tokens_BT):
    logits, aux, stats = models.forward(model, tokens_BT)
    assert stats is None
    return logits, aux


jit_route = jax.jit(moe_lib.route, static_argnums=(1, 2))
jit_balance = jax.jit(moe_lib.load_balance_loss)
jit_sample = jax.jit(models.sample_token)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("vocab_size", dict(vocab_size=0)),
        ("n_layer", dict(n_layer=2.5)),
        ("n_embd", dict(n_embd=30)),
        ("n_kv_head", dict(n_kv_head=3)),
        ("n_kv_head", dict(n_kv_head=0)),
        ("mlp", dict(mlp="relu")),
        ("mlp_hidden", dict(mlp_hidden=0)),
        ("dropout", dict(dropout=1.0)),
        ("dtype", dict(dtype="int8")),
        ("param_dtype", dict(param_dtype="float64")),
        ("moe_every", dict(moe_every=5)),
        ("moe_every", dict(moe_every=-1)),
        ("n_experts", dict(n_experts=0)),
        ("top_k", dict(top_k=9)),
        ("expert_hidden", dict(expert_hidden=-4)),
        ("capacity_factor", dict(capacity_factor=0.0)),
        ("aux_loss_coef", dict(aux_loss_coef=-0.1)),
        ("z_loss_coef", dict(z_loss_coef=-1.0)),
    ],
)
def test_config_rejects_bad_values(field, overrides):
    with pytest.raises(ValueError, match=field):
        models.GPTConfig(**overrides)


@pytest.mark.parametrize("field", sorted(FLOAT64_DTYPES))
def test_float64_is_refused_without_x64_in_one_line(field):
    with pytest.raises(ValueError) as err:
        models.GPTConfig(**{field: "float64"})
    assert str(err.value) == (
        f"GPTConfig.{field}='float64' needs jax's 64-bit mode: call "
        'jax.config.update("jax_enable_x64", True) first (or set JAX_ENABLE_X64=1).')
    with in_float64():
        cfg = models.GPTConfig(**{field: "float64"})
        config64 = dataclasses.replace(DENSE, **FLOAT64_DTYPES)
        model64 = models.GPT(config64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="64-bit mode"):  # built under x64, traced without
        model64(tokens())
    assert cfg.accumulation_dtype == (jnp.float64 if field == "dtype" else jnp.float32)


TRACK3_SMALL = models.track3_config(n_layer=2, n_embd=32, head_dim=8, vocab_size=16,
                                    block_size=16, dtype="float32", embed_dtype="float32",
                                    residual_dtype="float32")


@pytest.mark.parametrize("cfg", [DENSE, MOE, TRACK3_SMALL], ids=["dense", "moe", "track3"])
def test_a_float64_model_computes_the_float32_models_function_in_float64(cfg):
    """Under x64 a float64 model of a seed holds its float32 model's parameters exactly,
    computes nothing in a narrower dtype (loss and gradients, decoding; the softmax,
    norms, rotary angles, soft-cap, router; only dropout draws its float32 mask) and is
    the float32 model's function, with dropout: the float32 results are within float32's
    rounding of it (SAME_COMPUTATION), which makes it the reference of two float32
    programs of the model."""
    model, x = _cached(cfg), tokens(seed=6)
    dropout_key = jax.random.key(4) if cfg.dropout else None

    def run(model, x, key=dropout_key):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params):
            logits, aux, _ = models.forward(nnx.merge(graphdef, params), x[:, :-1],
                                            dropout_key=key)
            return xent(logits, aux, x[:, 1:]), logits

        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        decoded, cache = model.decode(x[:, :5], model.init_cache(3), 0)
        return value, logits, grads, decoded, cache

    got = jax.tree.map(np.asarray, nnx.jit(run)(model, x))
    with in_float64():
        model64 = models.GPT(dataclasses.replace(cfg, **FLOAT64_DTYPES), rngs=nnx.Rngs(0))
        jaxpr = str(jax.make_jaxpr(lambda x: run(model64, x, None))(x))
        ref = float64(nnx.jit(run)(model64, x))
        params64 = nnx.to_pure_dict(nnx.state(model64, nnx.Param))
    assert not set(re.findall(r"\b(f32|bf16|f16)\[", jaxpr))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float64), b),
                 params, params64)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref),
                            strict=True):
        assert r.dtype == np.float64, jax.tree_util.keystr(path)
        if np.linalg.norm(r) > 0:  # track3's zero output projections have zero gradients
            assert relative_error(g, r) < SAME_COMPUTATION, (jax.tree_util.keystr(path),
                                                             relative_error(g, r))


def test_config_derived_values():
    cfg = models.GPTConfig()
    assert (cfg.hidden, cfg.kv_heads, cfg.head_dim, cfg.expert_hidden_dim) == (512, 4, 32, 512)
    assert models.GPTConfig(mlp="swiglu").hidden == 384  # 8/3 * 128 = 341.3 -> 384
    assert models.GPTConfig(mlp="swiglu", n_embd=96, n_head=4).hidden == 256
    moe = models.GPTConfig(moe_every=2, expert_hidden=64)
    assert [moe.is_moe_block(i) for i in range(4)] == [False, True, False, True]
    assert moe.expert_hidden_dim == 64
    assert moe.expert_capacity(768) == math.ceil(1.25 * 768 * 2 / 8) == 240
    assert models.GPTConfig(capacity_factor=100.0).expert_capacity(10) == 10
    assert dict(models.logical_rules())["embed"] == "fsdp"
    assert set(dict(models.logical_rules())) == set(models.LOGICAL_AXES)


# ----------------------------------------------------------------------------- parameters


def expected_paths(cfg: models.GPTConfig) -> set[str]:
    paths = {"wte/embedding", "wpe/embedding", "ln_f/scale"}
    for i in range(cfg.n_layer):
        b = f"blocks/{i}"
        paths |= {f"{b}/ln_1/scale", f"{b}/ln_2/scale"}
        paths |= {f"{b}/attn/{n}/kernel" for n in ("c_q", "c_k", "c_v", "c_proj")}
        if cfg.is_moe_block(i):
            paths |= {f"{b}/moe/router/kernel", f"{b}/moe/experts/w_fc", f"{b}/moe/experts/w_proj"}
            if cfg.mlp == "swiglu":
                paths.add(f"{b}/moe/experts/w_gate")
        else:
            mats = ("c_fc", "c_gate", "c_proj") if cfg.mlp == "swiglu" else ("c_fc", "c_proj")
            paths |= {f"{b}/mlp/{n}/kernel" for n in mats}
    if not cfg.tie_embeddings:
        paths.add("lm_head/kernel")
    if cfg.bias:  # every dense layer and LayerNorm except the router and the head
        paths |= {
            p.rsplit("/", 1)[0] + "/bias"
            for p in paths
            if p.endswith(("/kernel", "/scale")) and "router" not in p and "lm_head" not in p
        }
    return paths


EXTRA = dataclasses.replace(MOE, bias=True, param_dtype="bfloat16", expert_hidden=48, n_kv_head=1)


@pytest.mark.parametrize("cfg", [DENSE, MOE, EXTRA], ids=["dense", "moe", "bias_bf16_mqa"])
def test_param_names_shapes_and_logical_axes(cfg):
    params = flat_params(build(cfg))
    assert set(params) == expected_paths(cfg)
    D, E, H, F = cfg.n_embd, cfg.n_experts, cfg.head_dim, cfg.expert_hidden_dim
    for path, var in params.items():
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.ndim, path
        assert all(n is None or n in models.LOGICAL_AXES for n in names), (path, names)
        if path.endswith("kernel"):
            assert var.ndim == 2, path
        assert var.dtype == (jnp.float32 if "router" in path else cfg.params_dtype), path
        if path.endswith("bias"):
            np.testing.assert_array_equal(var[...], 0.0)
    assert params["blocks/0/attn/c_q/kernel"].shape == (D, cfg.n_head * H)
    assert params["blocks/0/attn/c_k/kernel"].shape == (D, cfg.kv_heads * H)
    assert params["blocks/0/attn/c_v/kernel"].shape == (D, cfg.kv_heads * H)
    assert params["wte/embedding"].get_metadata()["out_sharding"] == ("vocab", "embed")
    if cfg.moe_every:
        assert params["blocks/1/moe/router/kernel"].shape == (D, E)
        assert params["blocks/1/moe/experts/w_fc"].shape == (E, D, F)
        assert params["blocks/1/moe/experts/w_gate"].shape == (E, D, F)
        assert params["blocks/1/moe/experts/w_proj"].shape == (E, F, D)
        assert params["blocks/1/moe/experts/w_fc"].get_metadata()["out_sharding"] == (
            "expert", "embed", "expert_mlp"
        )


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_init_statistics(cfg):
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)  # 0.01: a factor 2 from the others
    for path, var in flat_params(_cached(cfg)).items():
        x = np.asarray(var[...], np.float64)
        if path.endswith("scale"):
            np.testing.assert_array_equal(x, 1.0)
            continue
        std = resid if path.endswith(("c_proj/kernel", "w_proj")) else 0.02
        # the std estimate of n samples has relative standard error 1/sqrt(2n)
        assert abs(x.std() / std - 1) < 4 / math.sqrt(2 * x.size), (path, x.std(), std)
        assert abs(x.mean()) < 4 * std / math.sqrt(x.size), path


def test_tied_head_reads_wte():
    tok = jnp.zeros((3, 16), jnp.int32)  # only row 0 of wte is looked up
    for cfg in (DENSE, MOE):
        model = build(cfg)
        tie = cfg.tie_embeddings
        assert (model.lm_head is None) == tie
        before, _ = jit_forward(model, tok)
        model.wte.embedding[...] = model.wte.embedding[...].at[5].add(1.0)
        after, _ = jit_forward(model, tok)
        changed = np.flatnonzero(np.any(np.asarray(after != before), axis=(0, 1)))
        # tied: only the logit of token 5 moves (row 5 is its output embedding)
        assert changed.tolist() == ([5] if tie else [])


def test_sharded_parameters_and_forward():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    for rules, w_fc_spec in [
        (models.logical_rules(), (None, "fsdp", "tensor")),
        (models.logical_rules(expert_axis="tensor"), ("tensor", "fsdp", None)),
    ]:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
            _, abstract = nnx.get_abstract_model(lambda: models.GPT(MOE, rngs=nnx.Rngs(0)), mesh)
        spec = {p: tuple(v.sharding.spec) for p, v in flat_params(abstract).items()}
        assert spec["blocks/0/mlp/c_fc/kernel"] == ("fsdp", "tensor")
        assert spec["blocks/0/attn/c_proj/kernel"] == ("tensor", "fsdp")
        assert spec["wte/embedding"] == ("tensor", "fsdp")
        assert spec["lm_head/kernel"] == ("fsdp", "tensor")
        assert spec["ln_f/scale"] == (None,)
        assert spec["blocks/1/moe/experts/w_fc"] == w_fc_spec
    model = build(MOE)
    with nnx.logical_axis_rules(models.logical_rules()):
        shardings = nnx.get_named_sharding(nnx.state(model), mesh)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    assert tuple(model.blocks[0].mlp.c_fc.kernel[...].sharding.spec) == ("fsdp", "tensor")
    x = tokens()
    with jax.set_mesh(mesh):
        logits, aux = jit_forward(model, x)
    ref_logits, ref_aux = jit_forward(_cached(MOE), x)
    # Two float32 programs (sharded and not): as accurate as the unsharded one, in float64.
    exact = run_in_float64(lambda: jit_forward(float64_model(_cached(MOE)), x))
    assert_as_accurate((logits, aux), (ref_logits, ref_aux), exact)


# ----------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense_gqa", "moe_with_drops"])
def test_causality(cfg):
    model = _cached(cfg)
    x = tokens(seed=1)
    base, _ = jit_forward(model, x)
    for t in (3, 9):
        x2 = x.at[:, t].set((x[:, t] + 1) % cfg.vocab_size)
        logits, _ = jit_forward(model, x2)
        np.testing.assert_array_equal(logits[:, :t], base[:, :t])
        assert np.all(np.any(np.asarray(logits[:, t] != base[:, t]), axis=-1))


def attention_reference(attn: models.CausalSelfAttention, x_BTD: np.ndarray) -> np.ndarray:
    w = {
        n: np.asarray(getattr(attn, n).kernel[...], np.float64)
        for n in ("c_q", "c_k", "c_v", "c_proj")
    }
    B, T, _ = x_BTD.shape
    N, K, H = attn.n_head, attn.n_kv_head, attn.head_dim
    q = (x_BTD @ w["c_q"]).reshape(B, T, N, H)
    k = (x_BTD @ w["c_k"]).reshape(B, T, K, H)
    v = (x_BTD @ w["c_v"]).reshape(B, T, K, H)
    out = np.zeros((B, T, N, H))
    for n in range(N):
        kv = n // (N // K)  # query head n shares key/value head n // group
        s = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, kv]) / math.sqrt(H)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, n] = np.einsum("bts,bsh->bth", p, v[:, :, kv])
    return out.reshape(B, T, N * H) @ w["c_proj"]


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_attention_matches_reference_with_gqa(n_kv_head):
    cfg = dataclasses.replace(DENSE, n_kv_head=n_kv_head)
    attn = models.CausalSelfAttention(cfg, rngs=nnx.Rngs(3))
    assert attn.c_k.kernel.shape == (32, n_kv_head * 8)
    x = normal((2, 7, 32))
    y, cache = nnx.jit(lambda attn, x: attn(x))(attn, jnp.asarray(x, jnp.float32))
    assert cache is None
    np.testing.assert_allclose(y, attention_reference(attn, x), atol=1e-5)


def attention64(q_BTNH, k_BSKH, v_BSKH):
    """Causal softmax attention written out, for the float64 references (under x64):
    `jax.nn.dot_product_attention` computes its softmax in float32 whatever its inputs."""
    groups = q_BTNH.shape[2] // k_BSKH.shape[2]
    k, v = (jnp.repeat(a, groups, axis=2) for a in (k_BSKH, v_BSKH))
    T, H = q_BTNH.shape[1], q_BTNH.shape[3]
    s = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k) / np.sqrt(H)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_causal_attention_vjp_equals_autodiff_of_the_xla_attention(n_head, n_kv_head, dtype):
    """The hand-written backward pass equals JAX's autodiff through
    `jax.nn.dot_product_attention` (float32, computed from the same inputs), with GQA."""
    B, T, H = 2, 13, 8
    rng = np.random.default_rng(n_head * 10 + n_kv_head)
    q, k, v = (rng.normal(size=(B, T, n, H)) for n in (n_head, n_kv_head, n_kv_head))
    w = jnp.asarray(rng.normal(size=(B, T, n_head, H)), jnp.float32)
    args = [jnp.asarray(a, dtype) for a in (q, k, v)]
    ours = lambda q, k, v: jnp.sum(models.causal_attention(q, k, v).astype(jnp.float32) * w)
    xla = lambda q, k, v, w=w: jnp.sum(
        jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(w.dtype) * w)
    value, grads = jax.jit(jax.value_and_grad(ours, (0, 1, 2)))(*args)
    ref_value, ref_grads = jax.value_and_grad(xla, (0, 1, 2))(
        *(a.astype(jnp.float32) for a in args))
    for g, a in zip(grads, args, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
    if dtype == "float32":  # two float32 programs: as accurate as autodiff, against float64
        exact = run_in_float64(lambda q, k, v, w: jax.value_and_grad(
            lambda q, k, v: jnp.sum(attention64(q, k, v) * w), (0, 1, 2))(q, k, v), *args, w)
        assert_as_accurate((value, grads), (ref_value, ref_grads), exact)
        return
    tol = 2e-2  # bf16: the inputs' 8-bit mantissa
    np.testing.assert_allclose(value, ref_value, rtol=tol)
    for g, r in zip(grads, ref_grads, strict=True):
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, r / scale, atol=tol)
    if dtype == "bfloat16":  # as accurate as autodiff of the same bf16 computation
        autodiff = jax.grad(xla, (0, 1, 2))(*args)
        for g, auto, r in zip(grads, autodiff, ref_grads, strict=True):
            err = lambda x, r=r: float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
            assert err(g) <= 1.5 * err(auto), (err(g), err(auto))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (4, 1)])
def test_causal_attention_forward_under_differentiation_equals_the_xla_attention(
        n_head, n_kv_head, dtype):
    """The forward pass `causal_attention` runs under differentiation (its own, in the
    backward's layouts) equals `jax.nn.dot_product_attention` in the same dtype: float32
    to rounding, bf16 within one bf16 ulp of the largest output."""
    B, T, H = 2, 13, 8
    rng = np.random.default_rng(n_head + n_kv_head)
    args = [jnp.asarray(rng.normal(size=(B, T, n, H)), dtype)
            for n in (n_head, n_kv_head, n_kv_head)]
    ours = jax.jit(lambda *a: jax.vjp(models.causal_attention, *a)[0])(*args)
    ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(*args)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if dtype == "float32":  # two float32 programs: as accurate as XLA's, against float64
        exact = run_in_float64(attention64, *args)
        assert_as_accurate(ours, ref, exact)
        return
    ref = np.asarray(ref, np.float32)
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref,
                               atol=2.0**-7 * np.max(np.abs(ref)), rtol=0)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_mlp_formula(kind):
    mlp = models.MLP(dataclasses.replace(DENSE, mlp=kind, bias=True), rngs=nnx.Rngs(0))
    for i, layer in enumerate((mlp.c_fc, mlp.c_proj, mlp.c_gate)):
        if layer is not None:
            layer.bias[...] = jnp.asarray(normal(layer.bias.shape, seed=i))
    x = normal((3, 32), seed=9).astype(np.float64)
    w = lambda layer: (np.asarray(layer.kernel[...], np.float64), np.asarray(layer.bias[...]))
    (w1, b1), (w2, b2) = w(mlp.c_fc), w(mlp.c_proj)
    h = x @ w1 + b1
    if kind == "gelu":  # exact (erf) GELU
        h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    else:
        wg, bg = w(mlp.c_gate)
        g = x @ wg + bg
        h = g / (1 + np.exp(-g)) * h
    y = nnx.jit(lambda mlp, x: mlp(x))(mlp, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(y, h @ w2 + b2, atol=1e-5)


def test_forward_outputs_and_no_state_change():
    dense, moe = build(DENSE), build(MOE)
    trees = [jax.tree.structure(nnx.state(m)) for m in (dense, moe)]
    x = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        logits, aux = jit_forward(dense, x)
        moe_logits, moe_aux = jit_forward(moe, x)
        # A direct call (outside nnx.capture) sows nothing and does not warn.
        direct = nnx.eval_shape(lambda m, x: m(x), moe, x)
    assert aux.dtype == jnp.float32 and aux.shape == () and float(aux) == 0.0
    assert logits.dtype == jnp.float32 and logits.shape == (3, 16, DENSE.vocab_size)
    assert float(moe_aux) > 0.0
    assert direct.shape == moe_logits.shape
    assert [jax.tree.structure(nnx.state(m)) for m in (dense, moe)] == trees


def test_bf16_compute_close_to_float32():
    x = tokens()
    logits, aux = jit_forward(build(dataclasses.replace(MOE, dtype="bfloat16")), x)
    ref_logits, ref_aux = jit_forward(_cached(MOE), x)
    assert logits.dtype == jnp.float32 and aux.dtype == jnp.float32
    np.testing.assert_allclose(logits, ref_logits, atol=0.05)
    np.testing.assert_allclose(aux, ref_aux, rtol=0.05)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_bf16_matmul_and_its_gradients(transpose_w):
    # bf16 inputs, float32 accumulation; the output gradient is rounded to bf16 first.
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
    x = bf16(normal((2, 24, 16), seed=1))
    w = bf16(normal((40, 16) if transpose_w else (16, 40), seed=2))
    g = bf16(normal((2, 24, 40), seed=3))
    w_IO = w.T if transpose_w else w

    def loss(x, w):
        y = matmul(x, w, transpose_w=transpose_w, preferred_element_type=jnp.float32)
        return jnp.sum(y * jnp.asarray(g, jnp.float32)), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    assert y.dtype == jnp.float32 and dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(y, x @ w_IO, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, bf16(g @ w_IO.T), rtol=1e-2, atol=1e-6)
    dw_ref = np.einsum("bmi,bmo->io", x, g)
    np.testing.assert_allclose(dw, bf16(dw_ref.T if transpose_w else dw_ref), rtol=1e-2, atol=1e-6)


def test_bf16_matmul_of_transposed_operands():
    # XLA folds such transposes into the dot; a transposed bf16 dot has no CPU kernel.
    x = jnp.asarray(normal((16, 24), seed=0), jnp.bfloat16)
    w = jnp.asarray(normal((40, 16), seed=1), jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(jnp.square(matmul(x.T, w.T, preferred_element_type=jnp.float32).T))

    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    x64, w64 = (np.asarray(a, np.float64) for a in (x, w))
    np.testing.assert_allclose(value, np.sum(np.square(x64.T @ w64.T)), rtol=1e-5)
    assert [g.shape for g in grads] == [x.shape, w.shape]


def test_dropout():
    model, x = _cached(DENSE), tokens()
    call = nnx.jit(lambda model, x, key: model(x, dropout_key=key))
    plain, _ = jit_forward(model, x)
    a, b = call(model, x, jax.random.key(0)), call(model, x, jax.random.key(1))
    assert not np.allclose(a, plain) and not np.allclose(a, b)
    np.testing.assert_array_equal(call(model, x, jax.random.key(0)), a)
    h = jnp.ones((1000,))
    assert dropout(h, 0.0, jax.random.key(0)) is h and dropout(h, 0.5, None) is h
    kept = np.asarray(dropout(h, 0.25, jax.random.key(0)))
    assert set(np.unique(kept)) == {0.0, np.float32(1 / 0.75)} and abs(kept.mean() - 1) < 0.1
    with pytest.raises(ValueError, match="block_size"):
        model(tokens((1, DENSE.block_size + 1)))


# ----------------------------------------------------------------------------- MoE


def route_reference(logits_BTE, top_k, capacity):
    """The documented policy, written as a loop: priority (time, choice, sequence)."""
    B, T, E = logits_BTE.shape
    z = logits_BTE.astype(np.float64)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
    gates = np.take_along_axis(probs, order, -1)
    if top_k > 1:
        gates /= gates.sum(-1, keepdims=True)
    keep = np.zeros((B, T, top_k), bool)
    count = np.zeros(E, int)
    for t in range(T):
        for k in range(top_k):
            for b in range(B):
                e = order[b, t, k]
                keep[b, t, k] = count[e] < capacity
                count[e] += 1
    return probs, order, gates, keep


@pytest.mark.parametrize("B, T, E, K, C", [(2, 6, 4, 2, 3), (3, 5, 6, 3, 2), (2, 8, 5, 1, 4)])
def test_route_top_k_and_capacity_match_reference(B, T, E, K, C):
    logits = normal((B, T, E), seed=B + T, scale=2.0)
    r = jit_route(jnp.asarray(logits), K, C)
    probs, order, gates, keep = route_reference(logits, K, C)
    N = B * T
    np.testing.assert_allclose(r.probs, probs.reshape(N, E), rtol=1e-5)
    np.testing.assert_array_equal(r.experts, order.reshape(N, K))  # the k largest, in order
    np.testing.assert_allclose(r.gates, np.where(keep, gates, 0).reshape(N, K), rtol=1e-5)
    assert 0 < keep.sum() < N * K  # some assignments kept, some dropped
    keep = keep.reshape(N, K)
    slots = np.asarray(r.slots)
    np.testing.assert_array_equal(slots == E * C, ~keep)
    assert r.slot_tokens.shape == (E, C)  # C < N: no expert sees every token
    slot_tokens = np.asarray(r.slot_tokens).reshape(-1)
    for n, k in zip(*np.nonzero(keep), strict=True):
        assert slot_tokens[slots[n, k]] == n and slots[n, k] // C == order.reshape(N, K)[n, k]
    assert np.sum(slot_tokens < N) == keep.sum()  # every other slot is empty


def test_route_priority_is_time_then_choice_then_sequence():
    # b0 prefers expert 0 then 1, b1 prefers 1 then 0; capacity 3 per expert.
    logits = jnp.array([[[2.0, 1.0]] * 2, [[1.0, 2.0]] * 2])  # (B=2, T=2, E=2)
    r = jit_route(logits, 2, 3)
    # t0: first choices (b0->e0, b1->e1), then second choices (b0->e1, b1->e0);
    # t1: first choices fit (rank 2), second choices overflow.
    np.testing.assert_array_equal(np.asarray(r.gates) > 0, [[1, 1], [1, 0], [1, 1], [1, 0]])


def test_top1_gate_is_router_probability():
    logits = jnp.asarray(normal((1, 6, 4)))
    r = jit_route(logits, 1, 6)
    np.testing.assert_allclose(r.gates[:, 0], jnp.max(jax.nn.softmax(logits[0]), -1), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda z: moe_lib.route(z, 1, 6).gates.sum()))(logits)
    assert np.all(np.abs(np.asarray(grad)).sum(-1) > 0)  # the router learns from the gates


def test_moe_block_matches_per_token_reference():
    block = _cached(MOE).blocks[1].moe
    x = jnp.asarray(normal((2, 8, 32), seed=2))
    N, C = 16, MOE.expert_capacity(16)
    assert C == 6 < N  # each expert sees at most 6 of the 16 tokens
    y, r = nnx.jit(
        lambda block, x: (block(x), moe_lib.route(block.router(x), MOE.top_k, C))
    )(block, x)
    w = {
        n: np.asarray(getattr(block.experts, n)[...], np.float64)
        for n in ("w_fc", "w_gate", "w_proj")
    }
    x_ND = np.asarray(x, np.float64).reshape(N, 32)
    ref = np.zeros_like(x_ND)
    gates, experts = np.asarray(r.gates, np.float64), np.asarray(r.experts)
    for n in range(N):
        for k in range(MOE.top_k):
            e = experts[n, k]
            g = x_ND[n] @ w["w_gate"][e]
            h = g / (1 + np.exp(-g)) * (x_ND[n] @ w["w_fc"][e])
            ref[n] += gates[n, k] * (h @ w["w_proj"][e])
    assert np.sum(gates == 0) >= 2 * N - 4 * C  # dropped assignments contribute nothing
    np.testing.assert_allclose(np.asarray(y).reshape(N, 32), ref, atol=1e-6)


def test_aux_loss_under_uniform_routing():
    model = build(MOE)
    router = model.blocks[1].moe.router.kernel
    router[...] = jnp.zeros_like(router[...])
    _, aux = jit_forward(model, tokens())
    # load balance = its coefficient; z-loss = coef * log(E)^2 (uniform: lse = log E)
    expected = MOE.aux_loss_coef + MOE.z_loss_coef * math.log(MOE.n_experts) ** 2
    np.testing.assert_allclose(aux, expected, rtol=1e-6)


def test_aux_losses_match_formulas():
    logits = normal((2, 6, 4), seed=5, scale=3.0)
    r = jit_route(jnp.asarray(logits), 2, 3)  # capacity drops do not change the loss
    probs, order, _, _ = route_reference(logits, 2, 3)
    f = np.bincount(order.reshape(-1), minlength=4) / order.size
    balance = 4 * np.sum(f * probs.reshape(-1, 4).mean(0))
    np.testing.assert_allclose(jit_balance(r.probs, r.experts), balance, rtol=1e-5)
    z = logits.astype(np.float64).reshape(-1, 4)
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(jax.jit(moe_lib.router_z_loss)(z), np.mean(lse**2), rtol=1e-5)
    assert balance > 1.0  # skewed routing costs more than uniform routing


# ----------------------------------------------------------------------------- generation


def test_decode_with_cache_matches_full_forward():
    model, x = _cached(DENSE), tokens(seed=3)  # grouped-query attention
    full, _ = jit_forward(model, x)
    decode = nnx.jit(lambda m, x, cache, pos: m.decode(x, cache, pos))
    cache = model.init_cache(3)
    assert cache[0].k.shape == (3, DENSE.block_size, DENSE.kv_heads, DENSE.head_dim)
    logits, cache = decode(model, x[:, :5], cache, 0)
    pieces = [logits]
    for t in range(5, 16):
        logits, cache = decode(model, x[:, t : t + 1], cache, t)
        pieces.append(logits)
    # Two float32 programs (cached, full): as accurate as the full one, in float64.
    exact = run_in_float64(lambda: jit_forward(float64_model(model), x)[0])
    assert_as_accurate(jnp.concatenate(pieces, axis=1), full, exact)


def nanogpt_generate(logits_fn, model, prompt, n, temperature, top_k, rng):
    """nanoGPT's loop: keep the last block_size tokens, run the model, sample the last one.

    The context is right-padded to block_size so one compilation serves every step
    (causality, tested above, makes the padding irrelevant).
    """
    S = model.config.block_size
    idx = np.asarray(prompt)
    for i in range(n):
        context = idx[:, -S:]
        logits = logits_fn(model, np.pad(context, ((0, 0), (0, S - context.shape[1]))))
        last = logits[:, context.shape[1] - 1]
        tok = jit_sample(last, jax.random.fold_in(rng, i), temperature, top_k)
        idx = np.concatenate([idx, np.asarray(tok)[:, None]], axis=1)
    return idx


def assert_samples_as_float64(logits_fn, model, sequence, T0, temperature, top_k, rng):
    """Each new token of `sequence` is what the float64 model samples from the same
    context (its last block_size tokens; step i's key `fold_in(rng, i)`), wherever float32
    rounding cannot change that choice.

    A float32 program's logits there are taken to be within `slack` of the float64 ones
    (max abs): FACTOR x the float32 full forward's own error there (`logits_fn`, nanoGPT's
    loop) + ULPS ulps of the largest logit (the cached programs are bounded by it in
    test_decode_with_cache_matches_full_forward). Sampling is the argmax of
    ``logit / temperature + Gumbel noise`` (jax.random.categorical's float32 noise of that
    key) over the top-k logits (the logit itself when greedy): a choice is decided when
    no other kept candidate comes within twice the slack of the best score, and no logit
    within twice the slack of the top-k cut. Undecided (near-tie) steps may take either.
    """
    S, n = model.config.block_size, sequence.shape[1] - T0
    with in_float64():
        model64 = float64_model(model)
    decided = []
    for i in range(n):
        context = np.asarray(sequence[:, :T0 + i])[:, -S:]
        padded = np.pad(context, ((0, 0), (0, S - context.shape[1])))
        last = context.shape[1] - 1
        l32 = np.asarray(logits_fn(model, padded)[:, last], np.float64)
        with in_float64():
            l64 = np.asarray(logits_fn(model64, padded)[:, last])
        slack = (FACTOR * np.abs(l32 - l64).max(-1)
                 + ULPS * EPS32 * np.abs(l64).max(-1))[:, None]
        ranked = -np.sort(-l64, axis=-1)
        kept, cut_clear = np.ones_like(l64, bool), np.ones(len(l64), bool)
        if top_k is not None and top_k < l64.shape[-1]:
            kept = l64 >= ranked[:, top_k - 1:top_k]
            cut_clear = ranked[:, top_k - 1] - ranked[:, top_k] > 2 * slack[:, 0]
        if temperature > 0:
            noise = np.asarray(jax.random.gumbel(jax.random.fold_in(rng, i), l64.shape,
                                                 jnp.float32), np.float64)
            score = l64 / temperature + noise
            slack = slack / temperature + ULPS * EPS32 * np.abs(score).max(-1)[:, None]
        else:
            score = l64
        score = np.where(kept, score, -np.inf)
        best, second = (-np.sort(-score, axis=-1))[:, :2].T
        want = np.argmax(score, axis=-1)
        clear = cut_clear & (best - second > 2 * slack[:, 0])
        np.testing.assert_array_equal(np.asarray(sequence[:, T0 + i])[clear], want[clear],
                                      err_msg=f"new token {i}")
        decided.append(clear)
    assert np.mean(decided) > 0.5, decided  # near-ties are rare: the check is not vacuous


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_cached_generation_matches_nanogpt_loop(cfg):
    """generate's cached scan and nanoGPT's loop of full forward passes are two float32
    programs of one computation: each samples, at every step not at a near-tie, what the
    float64 model samples from the same context with the same key."""
    model, rng = _cached(cfg), jax.random.key(11)
    # dense: 12 + 6 > block_size 16, so five steps come from the cache and the last one
    # from a shifted window; MoE: 4 + 6 tokens, all from the cache (blocks run dropless).
    prompt = tokens((3, 4 if cfg.moe_every else 12), seed=4)
    T0 = prompt.shape[1]
    kw = dict(temperature=0.8, top_k=5, rng=rng)
    cached = models.generate(model, prompt, 6, **kw)
    assert cached.shape == (3, T0 + 6) and cached.dtype == jnp.int32
    np.testing.assert_array_equal(cached[:, :T0], prompt)
    if cfg.moe_every:
        logits_fn = nnx.jit(lambda m, x: m(x, dropless=True))
    else:
        logits_fn = lambda m, x: jit_forward(m, x)[0]
    check = functools.partial(assert_samples_as_float64, logits_fn, model, T0=T0, rng=rng)
    check(cached, temperature=0.8, top_k=5)
    check(nanogpt_generate(logits_fn, model, prompt, 6, **kw), temperature=0.8, top_k=5)
    if cfg.moe_every == 0:
        check(models.generate(model, prompt, 6, use_cache=False, **kw), temperature=0.8,
              top_k=5)
        # temperature and top_k are traced: these reuse the compilation above
        greedy = models.generate(model, prompt, 6, temperature=0.0, rng=rng)
        top1 = models.generate(model, prompt, 6, temperature=1.0, top_k=1, rng=rng)
        # exact: one compiled program, the argmax of the same logits either way
        np.testing.assert_array_equal(greedy, top1)
        check(greedy, temperature=0.0, top_k=None)
        check(nanogpt_generate(logits_fn, model, prompt, 6, 0.0, None, rng), temperature=0.0,
              top_k=None)
        assert not np.array_equal(greedy, cached)


def test_sample_token_top_k_and_temperature():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    sample = jax.jit(jax.vmap(lambda k, t: models.sample_token(logits, k, t, 2), (0, None)))
    keys = jax.random.split(jax.random.key(0), 4000)
    freq = np.bincount(np.asarray(sample(keys, 1.0)).reshape(-1), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    # temperature 0.5 squares the probabilities: 9:16 between the two kept tokens
    freq = np.bincount(np.asarray(sample(keys, 0.5)).reshape(-1), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0, 0, 9 / 25, 16 / 25], atol=0.03)
    assert int(jit_sample(logits, jax.random.key(0), 0.0, None)[0]) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=DENSE.vocab_size + 1), "top_k"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs, match):
    args = dict(max_new_tokens=2, rng=jax.random.key(0)) | kwargs
    with pytest.raises(ValueError, match=match):
        models.generate(_cached(DENSE), tokens((1, 2)), **args)
