"""The GPT configuration: one frozen dataclass, validated on construction.

Each field carries a one-line help and, for strings, its allowed values in its metadata
(`"help"`, `"choices"`): what `python -m train --help` shows for the model's keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

MLP_KINDS = ("gelu", "swiglu")
#: How attention is computed (``GPTConfig.attention``; see :func:`models.resolve_attention`).
ATTENTION_KINDS = ("auto", "handwritten", "xla", "cudnn")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_BOOLS = ("bias", "tie_embeddings", "scan_layers")
_REALS = ("dropout", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with its one-line help and, for strings, its allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _swiglu_hidden(n_embd: int) -> int:
    """LLaMA's rule: 8/3 of the width (a 4x GELU MLP's parameter count), up to a multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a GPT (dense or mixture-of-experts).

    The defaults are nanoGPT's CPU recipe for character-level Shakespeare (4 layers,
    4 heads, width 128, block 64, vocabulary 65).

    Attributes:
        vocab_size: number of token ids.
        block_size: longest sequence (number of learned positions).
        n_layer: number of transformer blocks.
        n_head: number of query heads.
        n_kv_head: number of key/value heads (grouped-query attention); ``None`` means
            ``n_head`` (plain multi-head attention). Must divide ``n_head``.
        n_embd: model width; must be a multiple of ``n_head``.
        mlp: ``"gelu"`` (``c_proj(gelu(c_fc x))``) or ``"swiglu"``
            (``c_proj(silu(c_gate x) * c_fc x)``).
        mlp_hidden: hidden width of the dense MLP. ``None`` means ``4 * n_embd`` for
            ``"gelu"`` and ``8/3 * n_embd`` rounded up to a multiple of 64 for ``"swiglu"``
            (LLaMA's choice: about the parameter count of a 4x GELU MLP; 384 for width 128).
        bias: whether dense layers and LayerNorms have biases.
        dropout: dropout rate on the embeddings and on each residual branch (used only
            when the model is called with a ``dropout_key``).
        tie_embeddings: whether the output head reuses ``wte`` (no ``lm_head`` parameter).
        dtype: compute dtype name for matmuls and activations. Logits, losses, LayerNorm
            statistics, the softmax of attention and the router are always float32, and so
            is the residual stream.
        param_dtype: dtype name of the parameters (the router kernel is float32 always).
        moe_every: 0 for a dense model; ``N`` makes block ``i`` a mixture-of-experts block
            when ``(i + 1) % N == 0`` (so ``N = 1``: every block, ``N = 2``: blocks 1, 3, ...).
        n_experts: experts per MoE block.
        top_k: experts each token is routed to.
        expert_hidden: hidden width of each expert; ``None`` means the dense MLP's width.
        capacity_factor: per-expert capacity is
            ``ceil(capacity_factor * tokens * top_k / n_experts)`` token slots; tokens beyond
            it are dropped for that expert (see :mod:`models.moe`).
        aux_loss_coef: coefficient of the Switch load-balancing loss (equals the
            coefficient under uniform routing).
        z_loss_coef: coefficient of the router z-loss ``mean(logsumexp(logits)^2)``.
        attention: how attention is computed, not what (every kind gives the same function
            and parameters): ``"handwritten"`` (:func:`models.causal_attention`, a
            hand-written backward pass; the fastest on XLA:CPU and the one that returns
            QK-clip's max logits), ``"xla"`` (autodiff of ``jax.nn.dot_product_attention``),
            ``"cudnn"`` (its fused cuDNN flash attention: NVIDIA GPUs, bf16/fp16) or
            ``"auto"`` (by backend: :func:`models.resolve_attention`).
        scan_layers: build the blocks as one stack (every block parameter gets a leading
            layer axis ``(n_layer, ...)``, logical name ``"layers"``, replicated) and run
            them with ``jax.lax.scan``, so the block is traced and compiled once, not
            ``n_layer`` times (as MaxText and levanter do). The same function as the
            unrolled model for the same per-layer weights (:func:`models.stack_blocks`
            converts; initialised from per-layer splits of the seed, so not the unrolled
            model's draws); dense models only (every block must be the same), without
            ``max_logits``.
    """

    vocab_size: int = _field(65, "number of token ids (the trainer sets it from the corpus)")
    block_size: int = _field(64, "context length T in tokens")
    n_layer: int = _field(4, "transformer blocks L")
    n_head: int = _field(4, "attention heads H")
    n_kv_head: int | None = _field(None, "key/value heads (None = n_head)")
    n_embd: int = _field(128, "residual width D")
    mlp: str = _field("gelu", "MLP kind", choices=MLP_KINDS)
    mlp_hidden: int | None = _field(None, "MLP hidden width (None = model default)")
    bias: bool = _field(False, "biases in linear layers and norms")
    dropout: float = _field(0.0, "dropout rate while training")
    tie_embeddings: bool = _field(True, "share the token embedding with the LM head")
    dtype: str = _field("bfloat16", "compute dtype (params stay in param_dtype)",
                        choices=FLOAT_DTYPES)
    param_dtype: str = _field("float32", "parameter dtype", choices=FLOAT_DTYPES)
    moe_every: int = _field(0, "every k-th block is mixture-of-experts (0 = dense)")
    n_experts: int = _field(8, "experts per MoE block")
    top_k: int = _field(2, "experts per token")
    expert_hidden: int | None = _field(None, "expert MLP width (None = default)")
    capacity_factor: float = _field(1.25, "MoE expert capacity factor")
    aux_loss_coef: float = _field(0.01, "MoE load-balancing loss coefficient")
    z_loss_coef: float = _field(0.0, "MoE router z-loss coefficient")
    attention: str = _field("auto", "attention implementation (auto: handwritten on CPU, "
                            "cudnn on a GPU where it fits, else xla; a compute choice: a run "
                            "may resume with another)", choices=ATTENTION_KINDS)
    scan_layers: bool = _field(False, "stack the blocks (params (n_layer, ...)) and run them "
                               "with jax.lax.scan: compiles one block (dense models only)")

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")

        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        for name in _REALS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"GPTConfig.{name} must be a float, got {value!r}.")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive(name)
        for name in ("n_experts", "top_k"):
            positive(name)
        for name in ("n_kv_head", "mlp_hidden", "expert_hidden"):
            if getattr(self, name) is not None:
                positive(name)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be a multiple of n_head={self.n_head}."
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}."
            )
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"GPTConfig.mlp must be one of {MLP_KINDS}, got {self.mlp!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"GPTConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}."
            )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in FLOAT_DTYPES:
                raise ValueError(f"GPTConfig.{name} must be one of {FLOAT_DTYPES}, got {value!r}.")
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int):
            raise ValueError(f"GPTConfig.moe_every must be an int >= 0, got {self.moe_every!r}.")
        if not 0 <= self.moe_every <= self.n_layer:
            raise ValueError(
                f"GPTConfig.moe_every must be in [0, n_layer={self.n_layer}] (0 = dense), "
                f"got {self.moe_every!r}."
            )
        if self.scan_layers and self.moe_every:
            raise ValueError(
                f"GPTConfig.scan_layers=True needs identical blocks: moe_every must be 0 "
                f"(dense), got {self.moe_every!r}."
            )
        if self.top_k > self.n_experts:
            raise ValueError(
                f"GPTConfig.top_k={self.top_k} must be <= n_experts={self.n_experts}."
            )
        if not self.capacity_factor > 0:
            raise ValueError(
                f"GPTConfig.capacity_factor must be > 0, got {self.capacity_factor!r}."
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"GPTConfig.{name} must be >= 0, got {value!r}.")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_head``, or ``n_head`` when unset)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        """Resolved hidden width of the dense MLP."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 4 * self.n_embd if self.mlp == "gelu" else _swiglu_hidden(self.n_embd)

    @property
    def expert_hidden_dim(self) -> int:
        """Resolved hidden width of one expert."""
        return self.hidden if self.expert_hidden is None else self.expert_hidden

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``dtype`` as a numpy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        """``param_dtype`` as a numpy dtype."""
        return jnp.dtype(self.param_dtype)

    def is_moe_block(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is a mixture-of-experts block."""
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0

    def expert_capacity(self, num_tokens: int) -> int:
        """Token slots per expert for a batch of ``num_tokens`` tokens (at most ``num_tokens``)."""
        slots = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.n_experts)
        return max(1, min(num_tokens, slots))
