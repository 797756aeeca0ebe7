"""The GPT configuration: one frozen dataclass, validated on construction.

Each field carries a one-line help and, for strings, its allowed values in its metadata
(`"help"`, `"choices"`): what `python -m train --help` shows for the model's keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

MLP_KINDS = ("gelu", "swiglu", "relu2")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "none")
ROTARY_KINDS = ("none", "half_truncated")
#: Initialisations (``GPTConfig.init``): nanoGPT's, or modded-nanogpt Track 3's
#: ``train_gpt_simple.py``'s.
INIT_KINDS = ("nanogpt", "track3", "hyperball", "cgi", "depth_fc")
#: How attention is computed (``GPTConfig.attention``; see :func:`models.resolve_attention`).
ATTENTION_KINDS = ("auto", "handwritten", "xla", "cudnn")
#: ``"float64"`` needs jax's 64-bit mode (``jax.config.update("jax_enable_x64", True)``):
#: a float64 model computes the float32 model's function, e.g. as its float64 reference.
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
_DTYPE_FIELDS = ("dtype", "param_dtype", "embed_dtype", "residual_dtype")
_BOOLS = ("bias", "tie_embeddings", "scan_layers", "embed_norm", "qk_norm", "lm_head_bias")
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
        mlp: ``"gelu"`` (``c_proj(gelu(c_fc x))``), ``"swiglu"``
            (``c_proj(silu(c_gate x) * c_fc x)``) or ``"relu2"`` (``c_proj(relu(c_fc x)^2)``,
            modded-nanogpt's ReLU²).
        mlp_hidden: hidden width of the dense MLP. ``None`` means ``4 * n_embd`` for
            ``"gelu"``/``"relu2"`` and ``8/3 * n_embd`` rounded up to a multiple of 64 for
            ``"swiglu"``
            (LLaMA's choice: about the parameter count of a 4x GELU MLP; 384 for width 128).
        bias: whether dense layers (and, unless ``norm_bias`` says otherwise, the norms)
            have biases. Never the LM head (``lm_head_bias``) nor the MoE router.
        norm_bias: whether the norms have a learned bias; ``None`` follows ``bias``.
        norm: ``"layernorm"`` (mean-centred, eps 1e-5, as ``torch.nn.LayerNorm``) or
            ``"rmsnorm"`` (``x / sqrt(mean(x^2) + eps) * gain``, no centring, eps the float32
            machine epsilon 2^-23, which is what PyTorch's ``F.rms_norm(eps=None)`` uses for
            float32, bfloat16 and float16 inputs).
        embed_norm: a norm (of kind ``norm``, parameters ``ln_embed``) directly on the token
            embedding, before the first block.
        position: ``"learned"`` (a ``wpe`` table added to the token embedding) or ``"none"``.
        rotary: ``"none"`` or ``"half_truncated"``: modded-nanogpt's rotary embedding of
            queries and keys, ``head_dim / 4`` frequencies ``(1/1024)^(j / (head_dim/4 - 1))``
            then ``head_dim / 4`` zero frequencies, pairs ``(x[i], x[i + head_dim/2])``,
            ``y1 = x1 cos + x2 sin``, ``y2 = -x1 sin + x2 cos`` (in ``accumulation_dtype``);
            ``head_dim`` must be a multiple of 4.
        qk_norm: a parameter-free RMS norm (eps as ``norm="rmsnorm"``) of each head's query
            and key, before the rotary embedding.
        attn_scale: the factor of ``q . k`` in the attention logits; ``None`` is
            ``1/sqrt(head_dim)`` (modded-nanogpt Track 3 uses 0.12).
        lm_head_bias: a bias on the untied LM head (``tie_embeddings=False`` only).
        logit_softcap: ``c`` of the logit soft-cap ``c z / sqrt(z^2 + c^2)`` (in
            ``accumulation_dtype``, after the head); ``None`` for none.
        init: ``"nanogpt"`` (described on :class:`models.GPT`) or ``"track3"``
            (``train_gpt_simple.py``'s: input matrices ``q/k/v``, ``fc`` (and ``gate``)
            ``N(0, 0.33 / fan_in)``, every output projection and the LM head zero, biases
            zero, embeddings ``N(0, 1)``, gains one; MoE experts, which the file does not
            have, keep ``N(0, 0.02)`` inputs with zero output projections), or
            ``"hyperball"`` (Track 3 #5, #8 and #13's, for optimizers that keep each
            matrix on its initial sphere: PyTorch's ``nn.Linear`` default
            ``U(±1/sqrt(fan_in))`` for q/k/v and their biases, times 1.5 for ``fc``
            (and ``gate``; their biases unscaled), 1.25 for the attention ``proj``, 3
            for the MLP's ``proj``; output-projection biases and the LM head zero;
            embeddings ``N(0, 1)``, gains one; MoE experts, which the records do not
            have: ``N(0, 0.02)`` inputs, ``proj`` as the MLP's), or ``"cgi"`` (Track 3
            #30's: PyTorch's ``nn.Linear`` default ``U(±1/sqrt(fan_in))`` for q/k/v/fc
            (and ``gate``) and their biases, block ``l``'s ``fc`` times
            ``1 - 0.3 l/(n_layer-1)`` (depth-scaled), every output projection, its bias
            and the LM head zero, embeddings ``N(0, 1)``, and the channel-gain split of
            each block's two norms: ``ln_1`` gains ``1 - 0.14 s``, ``ln_2`` gains
            ``1 + 0.14 s`` with one Rademacher ``s`` per channel and block; the other
            gains one; MoE experts, which #30 does not have: ``N(0, 0.02)`` inputs,
            zero projections, no depth scale), or ``"depth_fc"`` (Track 3 #42's: #30's
            with its gain split off, every gain one, and every bias zero: PyTorch's
            ``U(±1/sqrt(fan_in))`` for q/k/v/fc without their biases, the depth-scaled
            ``fc``, zero projections and head, embeddings ``N(0, 1)``; MoE experts as
            ``"cgi"``'s).
        embed_dtype: dtype name of the token (and position) embedding tables; ``None`` means
            ``param_dtype`` (modded-nanogpt stores its embedding in bfloat16).
        residual_dtype: dtype name of the residual stream between blocks (``"float32"``, or
            ``"bfloat16"`` as modded-nanogpt, whose stream follows its bf16 embedding).
        dropout: dropout rate on the embeddings and on each residual branch (used only
            when the model is called with a ``dropout_key``).
        tie_embeddings: whether the output head reuses ``wte`` (no ``lm_head`` parameter).
        dtype: compute dtype name for matmuls and activations. Logits, losses, norm
            statistics, the softmax of attention, the rotary angles and the router are
            computed in ``accumulation_dtype`` (float32, float64 for a float64 ``dtype``),
            and the residual stream is ``residual_dtype``. ``"float64"`` (in any dtype
            field) needs jax's 64-bit mode, ``jax.config.update("jax_enable_x64", True)``:
            a float64 model computes the float32 model's function (the same eps, the same
            parameters of a seed), more exactly.
        param_dtype: dtype name of the parameters (the router kernel is float32, float64
            with float64 parameters).
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
    norm: str = _field("layernorm", "norm kind", choices=NORM_KINDS)
    norm_bias: bool | None = _field(None, "biases in the norms (None = as bias)")
    embed_norm: bool = _field(False, "a norm directly after the token embedding")
    position: str = _field("learned", "position embedding added to the tokens",
                           choices=POSITION_KINDS)
    rotary: str = _field("none", "rotary embedding of queries and keys", choices=ROTARY_KINDS)
    qk_norm: bool = _field(False, "parameter-free RMS norm of each head's q and k")
    attn_scale: float | None = _field(None, "attention logit scale (None = 1/sqrt(head_dim))")
    lm_head_bias: bool = _field(False, "a bias on the untied LM head")
    logit_softcap: float | None = _field(None, "logit soft-cap c: c z / sqrt(z^2 + c^2)")
    init: str = _field("nanogpt", "parameter initialisation", choices=INIT_KINDS)
    embed_dtype: str | None = _field(None, "embedding table dtype (None = param_dtype)",
                                     choices=FLOAT_DTYPES)
    residual_dtype: str = _field("float32", "residual stream dtype", choices=FLOAT_DTYPES)

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
        for name, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS),
                            ("position", POSITION_KINDS), ("rotary", ROTARY_KINDS),
                            ("init", INIT_KINDS), ("residual_dtype", FLOAT_DTYPES)):
            if getattr(self, name) not in kinds:
                raise ValueError(
                    f"GPTConfig.{name} must be one of {kinds}, got {getattr(self, name)!r}.")
        if self.embed_dtype is not None and self.embed_dtype not in FLOAT_DTYPES:
            raise ValueError(f"GPTConfig.embed_dtype must be None or one of {FLOAT_DTYPES}, "
                             f"got {self.embed_dtype!r}.")
        if self.norm_bias is not None and not isinstance(self.norm_bias, bool):
            raise ValueError(f"GPTConfig.norm_bias must be None or a bool, got {self.norm_bias!r}.")
        for name in ("attn_scale", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not value > 0):
                raise ValueError(f"GPTConfig.{name} must be None or a float > 0, got {value!r}.")
        if self.lm_head_bias and self.tie_embeddings:
            raise ValueError("GPTConfig.lm_head_bias=True needs an untied head "
                             "(tie_embeddings=False).")
        if self.rotary != "none" and self.head_dim % 4:
            raise ValueError(f"GPTConfig.rotary={self.rotary!r} needs head_dim (n_embd / n_head) "
                             f"a multiple of 4, got {self.head_dim}.")
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
        self.check_float64()
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
        return _swiglu_hidden(self.n_embd) if self.mlp == "swiglu" else 4 * self.n_embd

    @property
    def expert_hidden_dim(self) -> int:
        """Resolved hidden width of one expert."""
        return self.hidden if self.expert_hidden is None else self.expert_hidden

    @property
    def has_norm_bias(self) -> bool:
        """Whether the norms have biases (``norm_bias``, or ``bias`` when it is ``None``)."""
        return self.bias if self.norm_bias is None else self.norm_bias

    @property
    def embeddings_dtype(self) -> jnp.dtype:
        """``embed_dtype`` (or ``param_dtype``) as a numpy dtype."""
        return jnp.dtype(self.embed_dtype or self.param_dtype)

    @property
    def stream_dtype(self) -> jnp.dtype:
        """``residual_dtype`` as a numpy dtype."""
        return jnp.dtype(self.residual_dtype)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``dtype`` as a numpy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def accumulation_dtype(self) -> jnp.dtype:
        """What the model computes in float32 whatever ``dtype`` is, for accuracy (softmax
        and log-sum-exp, norm statistics, rotary angles, logits and their soft-cap, the
        router): ``jnp.promote_types(float32, dtype)``, so float64 for a float64 model."""
        return jnp.promote_types(jnp.float32, self.compute_dtype)

    def check_float64(self) -> None:
        """Raise unless jax's 64-bit mode is on where a dtype field is ``"float64"`` (jax
        would otherwise silently compute in float32).

        Raises:
          ValueError: one line naming the field and how to turn the mode on.
        """
        wide = [name for name in _DTYPE_FIELDS if getattr(self, name) == "float64"]
        if wide and not jax.config.jax_enable_x64:
            raise ValueError(
                f"GPTConfig.{wide[0]}='float64' needs jax's 64-bit mode: call "
                'jax.config.update("jax_enable_x64", True) first (or set JAX_ENABLE_X64=1).')

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


def track3_config(
    n_layer: int = 12,
    n_embd: int = 768,
    head_dim: int = 128,
    vocab_size: int = 50304,
    block_size: int = 1024,
    dtype: str = "bfloat16",
    param_dtype: str = "float32",
    embed_dtype: str | None = "bfloat16",
    residual_dtype: str = "bfloat16",
    **overrides: Any,
) -> GPTConfig:
    """The network of modded-nanogpt's optimizer benchmark (Track 3), as a :class:`GPTConfig`.

    ``train_gpt_simple.py``'s ``GPT`` (result #36): RMSNorm with learned gains and no bias
    in the blocks, directly after the token embedding and before the head; no learned
    positions; its half-truncated rotary embedding after a parameter-free RMS norm of each
    head's q and k; attention scale 0.12; a ReLU² MLP of width ``4 n_embd``; biases on every
    linear layer including the untied LM head; the logit soft-cap ``15 z / sqrt(z^2 + 225)``;
    its initialisation (``init="track3"``). The defaults are the file's shape (12 x 768,
    6 heads of 128, vocabulary 50304, context 1024, about 162.4M parameters) and precision
    (bf16 matmuls, a bf16 embedding table and a bf16 residual stream; other parameters
    float32). The file sums the token losses (``reduction="sum"``): the logits are the
    same either way, the reduction is the trainer's choice.

    Args:
      n_layer: number of blocks.
      n_embd: model width; a multiple of ``head_dim``.
      head_dim: width of one head (``n_head = n_embd / head_dim``); a multiple of 4.
      vocab_size: number of token ids.
      block_size: longest sequence.
      dtype: compute dtype name.
      param_dtype: parameter dtype name (except the embedding's).
      embed_dtype: dtype name of the token embedding table (``None``: ``param_dtype``).
      residual_dtype: dtype name of the residual stream.
      **overrides: any other :class:`GPTConfig` field (``scan_layers``, ``attention``, ...).

    Returns:
      The configuration.

    Raises:
      ValueError: ``n_embd`` not a multiple of ``head_dim``, or an invalid field.

    Example:
      >>> import models
      >>> cfg = models.track3_config()
      >>> cfg.n_head, cfg.head_dim, cfg.hidden, cfg.norm, cfg.rotary
      (6, 128, 3072, 'rmsnorm', 'half_truncated')

    References:
      Jordan et al., modded-nanogpt Track 3 (optimization), ``train_gpt_simple.py``,
      https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
      2026.
    """
    for name, value in (("n_embd", n_embd), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"track3_config: {name} must be a positive int, got {value!r}.")
    if n_embd % head_dim:
        raise ValueError(f"track3_config: n_embd={n_embd} must be a multiple of "
                         f"head_dim={head_dim}.")
    fields = dict(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
        n_head=n_embd // head_dim, n_embd=n_embd, mlp="relu2", bias=True, norm_bias=False,
        dropout=0.0, tie_embeddings=False, dtype=dtype, param_dtype=param_dtype,
        norm="rmsnorm", embed_norm=True, position="none", rotary="half_truncated",
        qk_norm=True, attn_scale=0.12, lm_head_bias=True, logit_softcap=15.0, init="track3",
        embed_dtype=embed_dtype, residual_dtype=residual_dtype,
    )
    return GPTConfig(**{**fields, **overrides})
