"""Optimizer-state accounting (Malik 2026, arXiv 2607.19058): measured states equal the
paper's formula, on real and on `jax.eval_shape` states, and the paper's memory table is
reproduced without allocating its 6.78B-parameter model."""

import jax
import jax.numpy as jnp
import optax
import pytest

from optax_snoo import RolePolicy, skew_adam
from optax_snoo.memory import (
    adamw_state_bytes,
    muon_state_bytes,
    skew_adam_state_bytes,
    skew_adam_state_bytes_by_role,
    state_bytes,
    state_bytes_by_group,
)
from optax_snoo.rounding import stochastic_rounding

PARAMS = {"wte": jnp.zeros((10, 4)), "ln": jnp.zeros((4,)),
          "moe": {"experts": jnp.zeros((3, 4, 6)), "router": jnp.zeros((4, 3))}}


def test_formula_by_hand():
    """The paper's formula: 4·numel momentum (backbone) + 4·(R + C) per factored matrix (× E), or
    4·numel for a full second moment."""
    backbone = (4 * 40 + 4 * (10 + 4)) + (4 * 4 + 4 * 4)   # wte: m + factored; ln: m + full
    experts = 4 * 3 * (4 + 6)                              # no momentum, factored per expert
    router = 4 * 12                                        # no momentum, full
    assert skew_adam_state_bytes_by_role(PARAMS) == {
        "backbone": backbone, "experts": experts, "router": router}
    assert skew_adam_state_bytes(PARAMS) == backbone + experts + router
    assert skew_adam_state_bytes_by_role(PARAMS, policies="expert_momentum")["experts"] == (
        4 * 72 + experts)
    assert skew_adam_state_bytes_by_role(PARAMS, policies="factored_router")["router"] == (
        4 * (4 + 3))
    n = 40 + 4 + 72 + 12
    assert adamw_state_bytes(PARAMS) == 8 * n
    assert muon_state_bytes(PARAMS) == 4 * n


@pytest.mark.parametrize("policies", [None, "expert_momentum", "factored_router", "uniform",
                                      {"experts": RolePolicy(momentum=True, factored=False)}])
def test_measured_state_equals_formula(policies):
    tx = skew_adam(1e-3, policies=policies)
    predicted = skew_adam_state_bytes_by_role(PARAMS, policies=policies)
    real = tx.init(PARAMS)
    abstract = jax.eval_shape(tx.init, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS))
    for state in (real, abstract):
        assert state_bytes_by_group(state, statistics_only=True) == predicted
        assert state_bytes(state, statistics_only=True) == sum(predicted.values())
        # Everything else is int32 step counters: one per role's second-moment transform.
        assert state_bytes(state) == sum(predicted.values()) + 4 * len(predicted)


def test_counts_dtypes_keys_and_empty_nodes():
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    # Statistics stay float32 for bf16 params.
    assert state_bytes(skew_adam().init(bf16), statistics_only=True) == skew_adam_state_bytes(
        PARAMS)
    # optax's own states: adam = 8N + count; lion = 4N (+ count).
    assert state_bytes(optax.adamw(1e-3).init(PARAMS), statistics_only=True) == (
        adamw_state_bytes(PARAMS))
    assert state_bytes(optax.lion(1e-3).init(PARAMS), statistics_only=True) == (
        muon_state_bytes(PARAMS))
    assert state_bytes(optax.adamw(1e-3).init(PARAMS)) == adamw_state_bytes(PARAMS) + 4
    # PRNG state: the rounding transforms hold raw uint32 key data (8 bytes) and a count.
    rounding_state = stochastic_rounding().init(bf16)
    assert state_bytes(rounding_state) == 8 + 4
    assert state_bytes(rounding_state, statistics_only=True) == 0
    # Typed keys count their key data; MaskedNode, None and non-arrays count nothing.
    tree = {"key": jax.random.key(0), "m": optax.MaskedNode(), "n": None, "s": "text",
            "abstract": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)}
    assert state_bytes(tree) == 8 + 2 * 15
    assert state_bytes(jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 4))) == 32



def test_low_precision_statistics_count():
    """bf16 and float8 leaves are statistics too (numpy's issubdtype says they are not
    floating): optax.adamw on bf16 params keeps bf16 moments, 2 + 2 bytes per parameter."""
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    n = sum(x.size for x in jax.tree.leaves(PARAMS))
    for state in (optax.adamw(1e-3).init(bf16), jax.eval_shape(optax.adamw(1e-3).init, bf16)):
        assert state_bytes(state, statistics_only=True) == 4 * n
    fp8 = {"m": jax.ShapeDtypeStruct((3, 5), jnp.float8_e4m3fn),
           "c": jax.ShapeDtypeStruct((2,), jnp.complex64)}
    assert state_bytes(fp8, statistics_only=True) == 15 + 16


def test_groups_through_wrappers():
    tx = optax.MultiSteps(optax.inject_hyperparams(skew_adam)(learning_rate=1e-3), 2)
    state = tx.init(PARAMS)
    assert state_bytes_by_group(state, statistics_only=True) == (
        skew_adam_state_bytes_by_role(PARAMS))
    with pytest.raises(ValueError, match="PartitionState"):
        state_bytes_by_group(optax.adamw(1e-3).init(PARAMS))


def paper_model():
    """The SkewAdam paper's 6.78B MoE (its memory table), as shapes only: 2 blocks, d 4096, GQA with
    8 KV heads of 128, LayerNorm with bias, block 0 dense SwiGLU (ff 4096), block 1 with 128
    SwiGLU experts and a 128x4096 router, tied embeddings (vocab 50304), 256 positions."""
    d, ff, n_exp, vocab = 4096, 4096, 128, 50304
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    ln = lambda: {"scale": s(d), "bias": s(d)}
    attn = lambda: {"q": s(d, d), "k": s(d, 1024), "v": s(d, 1024), "o": s(d, d)}
    return {
        "wte": s(vocab, d), "wpe": s(256, d), "ln_f": ln(),
        "h0": {"ln1": ln(), "ln2": ln(), "attn": attn(),
               "mlp": {"w1": s(d, ff), "w2": s(ff, d), "w3": s(d, ff)}},
        "h1": {"ln1": ln(), "ln2": ln(), "attn": attn(),
               "moe": {"router": s(n_exp, d),
                       "experts": {"w1": s(n_exp, d, ff), "w2": s(n_exp, ff, d),
                                   "w3": s(n_exp, d, ff)}}},
    }


def test_reproduces_the_papers_memory_table():
    params = paper_model()
    n = sum(x.size for x in jax.tree.leaves(params))
    assert round(n / 1e6, 2) == 6784.33
    gib = lambda b: round(b / 2**30, 2)
    assert gib(adamw_state_bytes(params)) == 50.55
    assert gib(muon_state_bytes(params)) == 25.27
    assert gib(skew_adam_state_bytes(params)) == 1.29
    assert gib(skew_adam_state_bytes(params, policies="expert_momentum")) == 25.29
    assert gib(skew_adam_state_bytes(params, policies="factored_router")) == 1.28
    assert gib(skew_adam_state_bytes(params, policies="uniform")) == 25.29
    # The README's tier breakdown: backbone momentum 1.27 GiB, experts 12.6 MB, router 2.1 MB.
    by_role = skew_adam_state_bytes_by_role(params)
    assert round(by_role["experts"] / 1e6, 1) == 12.6
    assert round(by_role["router"] / 1e6, 1) == 2.1
    backbone_n = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                     if "experts" not in jax.tree_util.keystr(p)
                     and "router" not in jax.tree_util.keystr(p))
    assert round(backbone_n / n, 3) == 0.050
    assert gib(4 * backbone_n) == 1.27
    # The real optimizer state of that model, traced but never allocated, has that size.
    state = jax.eval_shape(skew_adam().init, params)
    assert state_bytes_by_group(state, statistics_only=True) == by_role


def test_memory_uses_only_public_skew_adam_names():
    import ast
    import inspect

    import optax_snoo._src.memory as memory_src
    tree = ast.parse(inspect.getsource(memory_src))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module and node.module.endswith("skew_adam") for alias in node.names]
    assert names and not [n for n in names if n.startswith("_")], names
