"""Flax NNX GPT (dense and mixture-of-experts) with sharding annotations.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import models
  >>> model = models.GPT(models.GPTConfig(n_layer=2), rngs=nnx.Rngs(0))
  >>> logits, aux_loss, _ = models.forward(model, jnp.zeros((2, 16), jnp.int32))
"""

from models.attention import (
    CausalSelfAttention,
    KVCache,
    causal_attention,
    cudnn_attention_error,
    resolve_attention,
)
from models.config import GPTConfig, track3_config
from models.generate import generate, sample_token
from models.gpt import GPT, Block, forward, stack_blocks
from models.layers import MLP, Dense, LayerNorm, RMSNorm
from models.moe import Experts, MoE, Routing, load_balance_loss, route, router_z_loss
from models.sharding import LOGICAL_AXES, logical_rules
from models.torch_weights import from_torch, to_torch

__all__ = [
    "GPT",
    "LOGICAL_AXES",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Dense",
    "Experts",
    "GPTConfig",
    "KVCache",
    "LayerNorm",
    "MoE",
    "RMSNorm",
    "Routing",
    "causal_attention",
    "cudnn_attention_error",
    "forward",
    "from_torch",
    "generate",
    "load_balance_loss",
    "logical_rules",
    "resolve_attention",
    "route",
    "router_z_loss",
    "sample_token",
    "stack_blocks",
    "to_torch",
    "track3_config",
]
