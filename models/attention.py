"""Causal self-attention with grouped-query heads and an optional key/value cache."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig
from models.layers import Dense, residual_std


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
    copying it.

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
        self, x_BTD: jax.Array, cache: KVCache | None = None, pos: jax.Array | int = 0
    ) -> tuple[jax.Array, KVCache | None]:
        """Attend causally.

        Args:
          x_BTD: layer input (normalised residual stream).
          cache: ``None`` to attend within ``x_BTD`` only; otherwise the keys and values
            of earlier positions: the new ones are written at ``[pos, pos + T)`` and the
            queries attend to every cached position up to their own.
          pos: position of ``x_BTD[:, 0]`` (only used with a cache).

        Returns:
          ``(y_BTD, cache)``: the output (compute dtype) and the updated cache (``None``
          without one).
        """
        B, T, _ = x_BTD.shape
        q_BTNH = self.c_q(x_BTD).reshape(B, T, self.n_head, self.head_dim)
        k_BTKH = self.c_k(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BTKH = self.c_v(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        if cache is None:
            y_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True)
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
