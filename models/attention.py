"""Causal self-attention with grouped-query heads and an optional key/value cache."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig
from models.layers import Dense, input_bias, input_std, residual_std, rms_norm, sow


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True)`` with a
    hand-written VJP.

    Called outside differentiation it is that call (softmax in float32, grouped-query
    heads when ``K < N``; in float64 the same function written out in float64, as that
    call's softmax is float32 whatever its inputs). Under differentiation the forward pass
    is the same math written in the backward's layouts (tested against that call), saving
    the float32 log-sum-exp. The backward pass is FlashAttention's (without tiling):
    ``P = softmax(S)`` recomputed from the saved log-sum-exp, ``dV = Pᵀ dO``,
    ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))``, ``dQ = dS K / sqrt(H)``,
    ``dK = dSᵀ Q / sqrt(H)`` (``scale`` for ``1/sqrt(H)`` when given), every product
    accumulated in float32 (float64 for float64 inputs); in bf16 it is as
    accurate as autodiff. The XLA implementation works on arrays with a unit axis (its
    ``vmap`` over the query groups), whose reductions XLA:CPU's YNNPACK runs much slower
    than the same reduction without that axis, and its ``P V`` product is not in a form
    XLA:CPU runs on bf16 kernels (figures in benchmarks/README.md); here the group axis
    only exists when ``K < N``.

    Args:
      q_BTNH: queries ``(B, T, N, H)``.
      k_BSKH: keys ``(B, T, K, H)`` with ``N % K == 0``.
      v_BSKH: values, shaped like the keys.
      scale: the factor of ``q . k`` in the logits; ``None`` is ``1/sqrt(H)``.

    Returns:
      The attention output ``(B, T, N, H)`` in the queries' dtype.

    References:
      Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
      IO-Awareness", https://arxiv.org/abs/2205.14135, 2022 (the backward pass, Alg. 4).
    """
    return _causal_attention(q_BTNH, k_BSKH, v_BSKH, _scale(q_BTNH, scale))


def _scale(q_BTNH: jax.Array, scale: float | None) -> float:
    return 1.0 / math.sqrt(q_BTNH.shape[-1]) if scale is None else float(scale)


def _accumulation(q_BTNH: jax.Array) -> jnp.dtype:
    """float32, or float64 for float64 queries: the dtype of the logits and the softmax."""
    return jnp.promote_types(jnp.float32, q_BTNH.dtype)


def _softmax_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *,
                      scale: float | None, mask_TS: jax.Array | None = None,
                      implementation: str | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` (causal without ``mask_TS``), or for float64
    inputs the same function written out in float64 (jax's softmax is float32 whatever
    the inputs), differentiated by autodiff either way."""
    if _accumulation(q_BTNH) == jnp.float32:
        return jax.nn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=mask_TS is None,
            mask=None if mask_TS is None else mask_TS[None, None],
            implementation=implementation)
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    if mask_TS is None:
        mask_TS = jnp.tril(jnp.ones((T, S), bool))
    groups = q_BTNH.shape[2] // k_BSKH.shape[2]
    k_BSNH, v_BSNH = (jnp.repeat(a, groups, axis=2) for a in (k_BSKH, v_BSKH))
    s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) * _scale(q_BTNH, scale)
    p_BNTS = jax.nn.softmax(jnp.where(mask_TS, s_BNTS, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH).astype(q_BTNH.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _causal_attention(q_BTNH, k_BSKH, v_BSKH, scale):
    return _softmax_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale)


def _groups(q_BTNH: jax.Array, k_BSKH: jax.Array) -> tuple[str, tuple[int, ...]]:
    """Query heads as K groups of G: the einsum letter of the group axis and the shape.

    Without grouping (G == 1) the group axis is left out: XLA:CPU's reductions over
    arrays with a unit axis are what made autodiff slow.
    """
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    return ("g", (B, T, K, N // K)) if N > K else ("", (B, T, K))


def _attend(q_BTNH, k_BSKH, v_BSKH, scale):
    """The forward pass in the backward's layouts (no unit axis, every product a bf16 one
    on XLA:CPU): the output, the float32 log-sum-exp as the backward reads it, and the
    float32 logits ``(B, K[, G], T, S)`` with the non-causal ones at ``-inf`` (float64
    for float64 inputs)."""
    B, T, N, H = q_BTNH.shape
    g, grouped = _groups(q_BTNH, k_BSKH)
    q = q_BTNH.reshape(*grouped, H)
    acc = _accumulation(q_BTNH)
    s = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", q, k_BSKH,
                   preferred_element_type=acc) * scale
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / total).astype(v_BSKH.dtype)
    out = jnp.einsum(f"bk{g}ts,bskh->btk{g}h", p, v_BSKH, preferred_element_type=acc)
    lse = (m + jnp.log(total))[..., 0]
    return out.reshape(B, T, N, H).astype(q_BTNH.dtype), lse, s


def _max_per_query_head(s, num_heads):
    """The largest causal logit of each query head, ``(N,)``: query head ``n = j*G + i``
    is group ``i`` of key head ``j``, as in ``_groups``."""
    return jnp.max(s, axis=(0, *range(s.ndim - 2, s.ndim))).reshape(num_heads)


def _causal_attention_fwd(q_BTNH, k_BSKH, v_BSKH, scale):
    out, lse, _ = _attend(q_BTNH, k_BSKH, v_BSKH, scale)
    return out, (q_BTNH, k_BSKH, v_BSKH, lse)


def _causal_attention_bwd(scale, residuals, dout_BTNH):
    q_BTNH, k_BSKH, v_BSKH, lse = residuals
    B, T, N, H = q_BTNH.shape
    g, grouped = _groups(q_BTNH, k_BSKH)
    q, do = q_BTNH.reshape(*grouped, H), dout_BTNH.reshape(*grouped, H)
    f32 = dict(preferred_element_type=_accumulation(q_BTNH))
    s = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", q, k_BSKH, **f32) * scale
    p = jnp.where(jnp.tril(jnp.ones((T, T), bool)), jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum(f"bk{g}ts,btk{g}h->bskh", p.astype(v_BSKH.dtype), do, **f32)
    dp = jnp.einsum(f"btk{g}h,bskh->bk{g}ts", do, v_BSKH, **f32)
    ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q_BTNH.dtype)
    dq = jnp.einsum(f"bk{g}ts,bskh->btk{g}h", ds, k_BSKH, **f32).reshape(B, T, N, H)
    dk = jnp.einsum(f"bk{g}ts,btk{g}h->bskh", ds, q, **f32)
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype)


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def causal_attention_and_max_logits(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                                    scale: float | None = None
                                    ) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_attention` and each query head's largest pre-softmax logit.

    The logits ``q . k * scale`` (``scale`` default ``1/sqrt(H)``; float32, causal
    positions only) are the ones the
    softmax reads, so their maximum over the batch and the positions costs one reduction
    and no second pass; it is what QK-clip (``optax_snoo.scale_by_qk_clip``) bounds. The
    backward pass is :func:`causal_attention`'s; the maximum's cotangent is ignored (it is
    a measurement, not part of the loss).

    Args:
      q_BTNH: queries ``(B, T, N, H)``.
      k_BSKH: keys ``(B, T, K, H)`` with ``N % K == 0``.
      v_BSKH: values, shaped like the keys.
      scale: the factor of ``q . k`` in the logits; ``None`` is ``1/sqrt(H)``.

    Returns:
      ``(out_BTNH, max_logits_N)``: the attention output in the queries' dtype and the
      float32 maximum logit of each query head.

    References:
      Kimi Team, "Kimi K2: Open Agentic Intelligence", https://arxiv.org/abs/2507.20534,
      2025 (QK-clip reads the per-head max logit of the forward pass).
    """
    return _with_max_logits(q_BTNH, k_BSKH, v_BSKH, _scale(q_BTNH, scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _with_max_logits(q_BTNH, k_BSKH, v_BSKH, scale):
    out, _, s = _attend(q_BTNH, k_BSKH, v_BSKH, scale)
    return out, _max_per_query_head(s, q_BTNH.shape[2])


def _with_max_logits_fwd(q_BTNH, k_BSKH, v_BSKH, scale):
    out, lse, s = _attend(q_BTNH, k_BSKH, v_BSKH, scale)
    return (out, _max_per_query_head(s, q_BTNH.shape[2])), (q_BTNH, k_BSKH, v_BSKH, lse)


def _with_max_logits_bwd(scale, residuals, cotangents):
    dout_BTNH, _ = cotangents
    return _causal_attention_bwd(scale, residuals, dout_BTNH)


_with_max_logits.defvjp(_with_max_logits_fwd, _with_max_logits_bwd)


def cudnn_attention_error(config: GPTConfig, platform: str, seq_len: int | None = None
                          ) -> str | None:
    """Why cuDNN's flash attention cannot compute ``config``'s attention on ``platform``,
    or ``None`` when it can.

    On a GPU the answer comes from compiling the forward and backward pass of one
    sequence with ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (shapes
    only, cached per shape): jax refuses there a cuDNN it does not find or too old, a
    GPU's compute capability, a dtype or a head width that cuDNN does not support.

    Args:
      config: the model configuration (dtype, heads, head width, ``block_size``).
      platform: the devices' platform (``"cpu"``, ``"gpu"``, ``"tpu"``).
      seq_len: tokens per sequence (default ``config.block_size``).

    Returns:
      ``None``, or one line saying why not.
    """
    if platform != "gpu":
        return f"cuDNN flash attention runs on NVIDIA GPUs, and the devices here are {platform}"
    if config.dtype not in ("bfloat16", "float16"):
        return f"cuDNN flash attention needs dtype bfloat16 or float16, not {config.dtype}"
    return _cudnn_compile_error(seq_len or config.block_size, config.n_head, config.kv_heads,
                                config.head_dim, config.dtype)


@functools.cache
def _cudnn_compile_error(T: int, N: int, K: int, H: int, dtype: str) -> str | None:
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.dtype(dtype))

    def loss(q_BTNH, k_BSKH, v_BSKH):
        out = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                           implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    except Exception as err:  # NotImplementedError, RuntimeError, ValueError, XLA's own
        lines = str(err).strip().splitlines() or [type(err).__name__]
        return (f"cuDNN does not run {N} query heads ({K} key/value) of width {H} over {T} "
                f"tokens in {dtype}: {lines[0][:200]}")
    return None


def resolve_attention(config: GPTConfig, *, platform: str | None = None,
                      max_logits: bool = False, seq_len: int | None = None) -> str:
    """The attention implementation that computes ``config``'s model on ``platform``.

    ``"auto"`` resolves by backend: ``"handwritten"`` (:func:`causal_attention`) on CPU,
    where its backward pass is faster than autodiff (figures in benchmarks/README.md),
    and whenever ``max_logits`` is asked (only its forward pass returns them); on a GPU
    ``"cudnn"`` where cuDNN runs the config (:func:`cudnn_attention_error`), else
    ``"xla"``; ``"xla"`` on other backends. An explicit name is checked: ``"cudnn"``
    where it cannot run, or ``"xla"``/``"cudnn"`` with ``max_logits``, raise.

    Args:
      config: the model configuration (its ``attention``, dtype and heads).
      platform: the devices' platform; default ``jax.default_backend()``.
      max_logits: each head's max logit is needed too (QK-clip).
      seq_len: tokens per sequence (default ``config.block_size``).

    Returns:
      ``"handwritten"``, ``"xla"`` or ``"cudnn"``.

    Raises:
      ValueError: an explicit name that cannot run here, saying why.

    Example:
      >>> import models
      >>> models.resolve_attention(models.GPTConfig(), platform="cpu")
      'handwritten'
    """
    name, platform = config.attention, platform or jax.default_backend()
    if max_logits and name in ("xla", "cudnn"):
        raise ValueError(f"attention={name!r} cannot return the max logits QK-clip reads "
                         "(only the handwritten forward pass does); use attention='auto' "
                         "or 'handwritten'")
    if name == "cudnn" and (why := cudnn_attention_error(config, platform, seq_len)):
        raise ValueError(f"attention='cudnn' is not available: {why}; use attention='auto' "
                         "or 'xla'")
    if name != "auto":
        return name
    if platform == "cpu" or max_logits:
        return "handwritten"
    if platform == "gpu" and cudnn_attention_error(config, platform, seq_len) is None:
        return "cudnn"
    return "xla"


def half_truncated_frequencies(head_dim: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """modded-nanogpt's rotary frequencies: ``head_dim/4`` of ``(1/1024)^(j/(head_dim/4 - 1))``
    (``torch.linspace(0, 1, head_dim/4)`` exponents), then ``head_dim/4`` zeros.

    Args:
      head_dim: width of one head, a multiple of 4.
      dtype: float32 (the file's), or float64 for a float64 model.

    Returns:
      ``(head_dim/2,)`` angular frequencies in ``dtype``, one per rotated pair.
    """
    quarter = head_dim // 4
    exponents = jnp.linspace(0.0, 1.0, quarter, dtype=dtype)
    return jnp.concatenate([(1.0 / 1024.0) ** exponents, jnp.zeros((quarter,), dtype)])


def rotate_half_truncated(x_BTNH: jax.Array, pos_T: jax.Array) -> jax.Array:
    """modded-nanogpt's half-truncated rotary embedding of ``x`` at positions ``pos_T``.

    Pairs ``(x1, x2) = (x[:H/2], x[H/2:])`` turn by ``-theta`` (theta = position x
    frequency, :func:`half_truncated_frequencies`): ``y1 = x1 cos + x2 sin``,
    ``y2 = -x1 sin + x2 cos``, in float32 (float64 for a float64 ``x``); the pairs of zero
    frequency pass unchanged.

    Args:
      x_BTNH: queries or keys ``(B, T, N, H)``.
      pos_T: position of each of the ``T`` tokens.

    Returns:
      The rotated ``x`` in its dtype.

    References:
      Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
      https://arxiv.org/abs/2104.09864, 2021; modded-nanogpt ``Rotary`` (Track 3,
      https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization).
    """
    H, acc = x_BTNH.shape[-1], jnp.promote_types(jnp.float32, x_BTNH.dtype)
    theta_TF = jnp.asarray(pos_T, acc)[:, None] * half_truncated_frequencies(H, acc)[None]
    cos, sin = jnp.cos(theta_TF)[:, None], jnp.sin(theta_TF)[:, None]  # (T, 1, H/2)
    x1, x2 = jnp.split(x_BTNH.astype(acc), 2, axis=-1)
    y = jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)
    return y.astype(x_BTNH.dtype)


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
    copying it. Without a cache it is computed as ``config.attention`` names
    (:func:`resolve_attention`): by default on CPU its gradient comes from
    :func:`causal_attention`'s hand-written backward pass, on a GPU from cuDNN's fused
    flash attention where it runs. Options of ``config``: ``qk_norm`` (a parameter-free
    RMS norm of each head's q and k), ``rotary`` (:func:`rotate_half_truncated` of q and k
    at their positions, after the norm; the cache holds rotated keys) and ``attn_scale``
    (the logit scale on every path, QK-clip's max logits included).

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
        kw.update(std=input_std(config, D), bias_init=input_bias(config, D), rngs=rngs)
        self.c_q = Dense(D, N * H, names=("embed", "heads"), **kw)
        self.c_k = Dense(D, K * H, names=("embed", "kv"), **kw)
        self.c_v = Dense(D, K * H, names=("embed", "kv"), **kw)
        kw.update(std=residual_std(config, N * H, "attn_proj"), bias_init=None)
        self.c_proj = Dense(N * H, D, names=("heads", "embed"), **kw)
        self.n_head, self.n_kv_head, self.head_dim = N, K, H
        self.config = config

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
            from the same pass (:func:`causal_attention_and_max_logits`, so
            ``config.attention`` must be ``"auto"`` or ``"handwritten"``); not with a cache.

        Returns:
          ``(y_BTD, cache)``: the output (compute dtype) and the updated cache (``None``
          without one).
        """
        B, T, _ = x_BTD.shape
        q_BTNH = self.c_q(x_BTD).reshape(B, T, self.n_head, self.head_dim)
        k_BTKH = self.c_k(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BTKH = self.c_v(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        cfg = self.config
        if cfg.qk_norm:  # float32, rounded to the compute dtype as F.rms_norm does
            q_BTNH = rms_norm(q_BTNH).astype(q_BTNH.dtype)
            k_BTKH = rms_norm(k_BTKH).astype(k_BTKH.dtype)
        if cfg.rotary == "half_truncated":
            pos_T = pos + jnp.arange(T)
            q_BTNH = rotate_half_truncated(q_BTNH, pos_T)
            k_BTKH = rotate_half_truncated(k_BTKH, pos_T)
        scale = cfg.attn_scale
        if max_logits and cache is not None:
            raise ValueError("max_logits=True is for training without a key/value cache")
        if cache is None:
            attention = resolve_attention(self.config, max_logits=max_logits, seq_len=T)
        if max_logits:
            y_BTNH, max_logits_N = causal_attention_and_max_logits(q_BTNH, k_BTKH, v_BTKH,
                                                                   scale)
            sow(self, nnx.Intermediate, "max_logits", max_logits_N)
        elif cache is None and attention == "handwritten":
            y_BTNH = causal_attention(q_BTNH, k_BTKH, v_BTKH, scale)
        elif cache is None:
            y_BTNH = _softmax_attention(q_BTNH, k_BTKH, v_BTKH, scale=scale,
                                       implementation=attention)
        else:
            start = (0, pos, 0, 0)
            k_BSKH = jax.lax.dynamic_update_slice(cache.k, k_BTKH.astype(cache.k.dtype), start)
            v_BSKH = jax.lax.dynamic_update_slice(cache.v, v_BTKH.astype(cache.v.dtype), start)
            cache = KVCache(k_BSKH, v_BSKH)
            S = k_BSKH.shape[1]
            mask_TS = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]
            y_BTNH = _softmax_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale,
                                       mask_TS=mask_TS)
        return self.c_proj(y_BTNH.reshape(B, T, self.n_head * self.head_dim)), cache
