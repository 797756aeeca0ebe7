"""Causal self-attention with grouped-query heads and an optional key/value cache."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig
from models.layers import Dense, residual_std, sow


@jax.custom_vjp
def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` with a hand-written VJP.

    Called outside differentiation it is that call (softmax in float32, grouped-query
    heads when ``K < N``). Under differentiation the forward pass is the same math
    written in the backward's layouts (tested against that call), saving the float32
    log-sum-exp. The backward pass is FlashAttention's (without tiling): ``P = softmax(S)``
    recomputed from the saved log-sum-exp, ``dV = Pᵀ dO``,
    ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))``, ``dQ = dS K / sqrt(H)``,
    ``dK = dSᵀ Q / sqrt(H)``, every product accumulated in float32; in bf16 it is as
    accurate as autodiff. The XLA implementation works on arrays with a unit axis (its
    ``vmap`` over the query groups), whose reductions XLA:CPU's YNNPACK runs much slower
    than the same reduction without that axis, and its ``P V`` product is not in a form
    XLA:CPU runs on bf16 kernels (figures in benchmarks/README.md); here the group axis
    only exists when ``K < N``.

    Args:
      q_BTNH: queries ``(B, T, N, H)``.
      k_BSKH: keys ``(B, T, K, H)`` with ``N % K == 0``.
      v_BSKH: values, shaped like the keys.

    Returns:
      The attention output ``(B, T, N, H)`` in the queries' dtype.

    References:
      Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
      IO-Awareness", https://arxiv.org/abs/2205.14135, 2022 (the backward pass, Alg. 4).
    """
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True)


def _groups(q_BTNH: jax.Array, k_BSKH: jax.Array) -> tuple[str, tuple[int, ...]]:
    """Query heads as K groups of G: the einsum letter of the group axis and the shape.

    Without grouping (G == 1) the group axis is left out: XLA:CPU's reductions over
    arrays with a unit axis are what made autodiff slow.
    """
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    return ("g", (B, T, K, N // K)) if N > K else ("", (B, T, K))


def _attend(q_BTNH, k_BSKH, v_BSKH):
    """The forward pass in the backward's layouts (no unit axis, every product a bf16 one
    on XLA:CPU): the output, the float32 log-sum-exp as the backward reads it, and the
    float32 logits ``(B, K[, G], T, S)`` with the non-causal ones at ``-inf``."""
    B, T, N, H = q_BTNH.shape
    g, grouped = _groups(q_BTNH, k_BSKH)
    q = q_BTNH.reshape(*grouped, H)
    s = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", q, k_BSKH,
                   preferred_element_type=jnp.float32) * (1.0 / math.sqrt(H))
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / total).astype(v_BSKH.dtype)
    out = jnp.einsum(f"bk{g}ts,bskh->btk{g}h", p, v_BSKH, preferred_element_type=jnp.float32)
    lse = (m + jnp.log(total))[..., 0]
    return out.reshape(B, T, N, H).astype(q_BTNH.dtype), lse, s


def _max_per_query_head(s, num_heads):
    """The largest causal logit of each query head, ``(N,)``: query head ``n = j*G + i``
    is group ``i`` of key head ``j``, as in ``_groups``."""
    return jnp.max(s, axis=(0, *range(s.ndim - 2, s.ndim))).reshape(num_heads)


def _causal_attention_fwd(q_BTNH, k_BSKH, v_BSKH):
    out, lse, _ = _attend(q_BTNH, k_BSKH, v_BSKH)
    return out, (q_BTNH, k_BSKH, v_BSKH, lse)


def _causal_attention_bwd(residuals, dout_BTNH):
    q_BTNH, k_BSKH, v_BSKH, lse = residuals
    B, T, N, H = q_BTNH.shape
    g, grouped = _groups(q_BTNH, k_BSKH)
    q, do = q_BTNH.reshape(*grouped, H), dout_BTNH.reshape(*grouped, H)
    f32 = dict(preferred_element_type=jnp.float32)
    scale = 1.0 / math.sqrt(H)
    s = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", q, k_BSKH, **f32) * scale
    p = jnp.where(jnp.tril(jnp.ones((T, T), bool)), jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum(f"bk{g}ts,btk{g}h->bskh", p.astype(v_BSKH.dtype), do, **f32)
    dp = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", do, v_BSKH, **f32)
    ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q_BTNH.dtype)
    dq = jnp.einsum(f"bk{g}ts,bskh->btk{g}h", ds, k_BSKH, **f32).reshape(B, T, N, H)
    dk = jnp.einsum(f"bk{g}ts,btk{g}h->bskh", ds, q, **f32)
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


@jax.custom_vjp
def causal_attention_and_max_logits(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array
                                    ) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_attention` and each query head's largest pre-softmax logit.

    The logits ``q . k / sqrt(H)`` (float32, causal positions only) are the ones the
    softmax reads, so their maximum over the batch and the positions costs one reduction
    and no second pass; it is what QK-clip (``optax_snoo.scale_by_qk_clip``) bounds. The
    backward pass is :func:`causal_attention`'s; the maximum's cotangent is ignored (it is
    a measurement, not part of the loss).

    Args:
      q_BTNH: queries ``(B, T, N, H)``.
      k_BSKH: keys ``(B, T, K, H)`` with ``N % K == 0``.
      v_BSKH: values, shaped like the keys.

    Returns:
      ``(out_BTNH, max_logits_N)``: the attention output in the queries' dtype and the
      float32 maximum logit of each query head.

    References:
      Kimi Team, "Kimi K2: Open Agentic Intelligence", https://arxiv.org/abs/2507.20534,
      2025 (QK-clip reads the per-head max logit of the forward pass).
    """
    out, _, s = _attend(q_BTNH, k_BSKH, v_BSKH)
    return out, _max_per_query_head(s, q_BTNH.shape[2])


def _with_max_logits_fwd(q_BTNH, k_BSKH, v_BSKH):
    out, lse, s = _attend(q_BTNH, k_BSKH, v_BSKH)
    return (out, _max_per_query_head(s, q_BTNH.shape[2])), (q_BTNH, k_BSKH, v_BSKH, lse)


def _with_max_logits_bwd(residuals, cotangents):
    dout_BTNH, _ = cotangents
    return _causal_attention_bwd(residuals, dout_BTNH)


causal_attention_and_max_logits.defvjp(_with_max_logits_fwd, _with_max_logits_bwd)


class KVCache(NamedTuple):
    """Keys and values of one attention layer for positions ``[0, S)``.

    Attributes:
      k: keys ``(batch, max_len, n_kv_head, head_dim)``, compute dtype.
      v: values, same shape.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: GPTConfig, batch_size: int, max_len: int) -> KVCache:
        """An empty cache of ``max_len`` positions."""
        shape = (batch_size, max_len, config.kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, config.compute_dtype), jnp.zeros(shape, config.compute_dtype))


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; ``n_kv_head < n_head`` gives grouped-query attention.

    Projections ``c_q`` ``(D, N*H)``, ``c_k`` and ``c_v`` ``(D, K*H)``, ``c_proj``
    ``(N*H, D)``; the attention itself is ``jax.nn.dot_product_attention`` (softmax in
    float32), which shares each key/value head among ``N/K`` query heads without
    copying it; without a cache its gradient comes from :func:`causal_attention`'s
    hand-written backward pass.

    Args:
      config: the model configuration.
      rngs: random streams.

    References:
      Vaswani et al., "Attention Is All You Need", https://arxiv.org/abs/1706.03762, 2017.
      Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from
      Multi-Head Checkpoints", https://arxiv.org/abs/2305.13245, 2023.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        D, N, K, H = config.n_embd, config.n_head, config.kv_heads, config.head_dim
        kw = dict(dtype=config.compute_dtype, param_dtype=config.params_dtype, bias=config.bias)
        self.c_q = Dense(D, N * H, names=("embed", "heads"), rngs=rngs, **kw)
        self.c_k = Dense(D, K * H, names=("embed", "kv"), rngs=rngs, **kw)
        self.c_v = Dense(D, K * H, names=("embed", "kv"), rngs=rngs, **kw)
        self.c_proj = Dense(
            N * H, D, names=("heads", "embed"), std=residual_std(config), rngs=rngs, **kw
        )
        self.n_head, self.n_kv_head, self.head_dim = N, K, H

    def __call__(
        self, x_BTD: jax.Array, cache: KVCache | None = None, pos: jax.Array | int = 0,
        *, max_logits: bool = False,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attend causally.

        Args:
          x_BTD: layer input (normalised residual stream).
          cache: ``None`` to attend within ``x_BTD`` only; otherwise the keys and values
            of earlier positions: the new ones are written at ``[pos, pos + T)`` and the
            queries attend to every cached position up to their own.
          pos: position of ``x_BTD[:, 0]`` (only used with a cache).
          max_logits: also sow (``nnx.Intermediate`` ``"max_logits"``, inside an
            ``nnx.capture``) each query head's largest pre-softmax logit ``(N,)`` float32,
            from the same pass (:func:`causal_attention_and_max_logits`); not with a cache.

        Returns:
          ``(y_BTD, cache)``: the output (compute dtype) and the updated cache (``None``
          without one).
        """
        B, T, _ = x_BTD.shape
        q_BTNH = self.c_q(x_BTD).reshape(B, T, self.n_head, self.head_dim)
        k_BTKH = self.c_k(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BTKH = self.c_v(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        if max_logits and cache is not None:
            raise ValueError("max_logits=True is for training without a key/value cache")
        if max_logits:
            y_BTNH, max_logits_N = causal_attention_and_max_logits(q_BTNH, k_BTKH, v_BTKH)
            sow(self, nnx.Intermediate, "max_logits", max_logits_N)
        elif cache is None:
            y_BTNH = causal_attention(q_BTNH, k_BTKH, v_BTKH)
        else:
            start = (0, pos, 0, 0)
            k_BSKH = jax.lax.dynamic_update_slice(cache.k, k_BTKH.astype(cache.k.dtype), start)
            v_BSKH = jax.lax.dynamic_update_slice(cache.v, v_BTKH.astype(cache.v.dtype), start)
            cache = KVCache(k_BSKH, v_BSKH)
            S = k_BSKH.shape[1]
            mask_TS = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]
            y_BTNH = jax.nn.dot_product_attention(
                q_BTNH, k_BSKH, v_BSKH, mask=mask_TS[None, None]
            )
        return self.c_proj(y_BTNH.reshape(B, T, self.n_head * self.head_dim)), cache
