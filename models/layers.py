"""Building blocks of the GPT: embedding, dense layer, LayerNorm/RMSNorm, dropout, MLP.

Every parameter is an ``nnx.Param`` with ``out_sharding`` logical axis names (see
:mod:`models.sharding`). Matrices are stored ``(in, out)`` and named ``kernel``.

MoE blocks record their auxiliary losses (``nnx.Intermediate`` ``"aux_loss"``) for
:func:`nnx.capture` only while a capture is active (:func:`sow`; flax 0.12.8's
``Module.sow`` outside a capture would instead add new Variables to the module and change
its state tree).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig

INIT_STD = 0.02  # nanoGPT's std for every matrix and embedding
#: ``F.rms_norm(eps=None)``'s epsilon: ATen's ``rms_norm`` (layer_norm.cpp) computes float32,
#: bfloat16 and float16 inputs in float32 with ``numeric_limits<float>::epsilon()`` = 2^-23.
RMS_EPS = float(jnp.finfo(jnp.float32).eps)


def _capturing(module: nnx.Module) -> bool:
    # `nnx.capture` sets `__captures__` on every module while the wrapped call runs.
    return hasattr(module, "__captures__")


def sow(module: nnx.Module, variable_type: type[nnx.Variable], name: str, value) -> None:
    """``module.sow(...)`` inside an ``nnx.capture``; a no-op outside one."""
    if _capturing(module):
        module.sow(variable_type, name, value)


def _eager_sharding() -> bool:
    # Flax shards annotated Variables as they are created ("eager sharding"), which needs
    # a mesh; without one the annotations are kept as metadata only.
    return nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty


class Uniform(NamedTuple):
    """An init draw ``U(-bound, bound)`` (PyTorch's ``nn.Linear`` default has bound
    ``1/sqrt(fan_in)`` for the weight and the bias)."""

    bound: float


#: A parameter's init: a normal's std, a `Uniform`, or ``None`` for zeros.
Init = float | Uniform | None


def param(
    key: jax.Array | None,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    dtype: jnp.dtype,
    std: Init,
) -> nnx.Param:
    """A parameter drawn from ``N(0, std^2)`` (``U(-b, b)`` for ``std=Uniform(b)``, zeros
    when ``std`` is None), with logical axes. Drawn in float32 whatever ``dtype``, so a
    float64 model of a seed holds its float32 model's values exactly.

    The parameter is sharded on creation when a mesh is set (``jax.set_mesh``; map the
    logical names with ``nnx.logical_axis_rules``); with no mesh it is created unsharded
    and ``names`` are only recorded as ``out_sharding`` metadata.
    """
    if std is None:
        value = jnp.zeros(shape, dtype)
    elif isinstance(std, Uniform):
        value = jax.random.uniform(key, shape, jnp.float32, -std.bound, std.bound).astype(dtype)
    else:
        value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=_eager_sharding())


class Embed(nnx.Module):
    """A lookup table ``embedding`` ``(num, dim)``, init ``N(0, std^2)``.

    Args:
      num: number of rows (vocabulary or positions).
      dim: row width.
      names: logical axis names of the table.
      param_dtype: parameter dtype.
      std: init std (nanoGPT's 0.02 by default).
      rngs: random streams (``params`` is used).
    """

    def __init__(
        self,
        num: int,
        dim: int,
        *,
        names: tuple[str | None, str | None],
        param_dtype: jnp.dtype,
        std: float = INIT_STD,
        rngs: nnx.Rngs,
    ):
        self.embedding = param(rngs.params(), (num, dim), names, param_dtype, std)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)


def _row_major_transpose(a_MN: jax.Array) -> jax.Array:
    """``a.T`` written out as a row-major copy (XLA would otherwise fold it into a dot).

    The copy goes through a leading unit axis, not a flat vector: XLA:CPU runs the flat
    form as a generic loop, about 4x slower (benchmarks/README.md).
    """
    a_1NM = jax.lax.optimization_barrier(a_MN.T.reshape(1, *a_MN.shape[::-1]))
    return a_1NM.reshape(a_MN.shape[::-1])


def _canonical_dot(a_MK: jax.Array, b: jax.Array, transpose_b: bool = False) -> jax.Array:
    """``a @ b`` (or ``a @ bᵀ``) in float32 from bf16, in a form XLA:CPU runs on bf16 kernels.

    Those are ``a @ b`` and ``a @ bᵀ`` on row-major matrices (a transposed ``a`` is
    computed in float32). The barriers stop XLA's simplifier from folding a transpose
    of an operand or of the result into the dot after it has decided the dot's
    precision: a transposed bf16 dot has no CPU kernel at all (``Unsupported element
    type for DotThunk``).
    """
    a_MK, b = jax.lax.optimization_barrier((a_MK, b))
    contract = ((1,), (1,)) if transpose_b else ((1,), (0,))
    return jax.lax.optimization_barrier(jax.lax.dot_general(
        a_MK, b, (contract, ((), ())), preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16_dot(x_MK: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    return _canonical_dot(x_MK, w, transpose_w)


def _bf16_dot_fwd(x_MK, w, transpose_w):
    return _bf16_dot(x_MK, w, transpose_w), (x_MK, w)


def _bf16_dot_bwd(transpose_w, residuals, g_MN):
    x_MK, w = residuals
    g_MN = g_MN.astype(jnp.bfloat16)
    T = _row_major_transpose
    if transpose_w:  # w is (N, K)
        dx_MK = _canonical_dot(g_MN, w)
        dw = _canonical_dot(T(g_MN), x_MK)
    else:  # w is (K, N)
        dx_MK = _canonical_dot(g_MN, w, transpose_b=True)
        dw = _canonical_dot(T(x_MK), g_MN)
    return dx_MK.astype(x_MK.dtype), dw.astype(w.dtype)


_bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def _use_cpu_bf16_dot(x: jax.Array, w: jax.Array) -> bool:
    return (x.dtype == w.dtype == jnp.bfloat16 and x.ndim == w.ndim == 2
            and jax.default_backend() == "cpu")


def matmul(x: jax.Array, w_IO: jax.Array, *, transpose_w: bool = False,
           preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """``x @ w_IO`` (or ``x @ w_OI.T``) over the last axis of ``x``, as one 2-D product.

    Flattening the leading axes first matters on CPU: XLA lowers the weight gradient of
    a 3-D ``x @ w`` (a contraction over two axes) to a slower kernel than the 2-D one
    (figures in benchmarks/README.md, "Trainer step throughput").

    bf16 on the CPU backend: XLA:CPU runs a bf16 dot on its bf16 kernels (AMX /
    AVX512-BF16 through YNNPACK) only when it accumulates in float32, both operands are
    row-major matrices and the left one is not transposed; anything else it computes in
    float32 after converting the operands (several times slower). Here the forward
    and both backward products (a custom VJP) are written in that form, with a
    transposed left operand copied out explicitly; the math is the usual mixed precision
    (bf16 inputs, float32 accumulation, the output gradient rounded to bf16).

    Args:
      x: input ``(..., I)``.
      w_IO: matrix ``(I, O)``, or ``(O, I)`` with ``transpose_w``.
      transpose_w: multiply by the transpose of ``w_IO`` (the tied LM head).
      preferred_element_type: accumulation/output dtype (default: that of the inputs).

    Returns:
      ``(..., O)``.
    """
    x_MI = x.reshape(-1, x.shape[-1])
    out_dtype = preferred_element_type or jnp.result_type(x, w_IO)
    if _use_cpu_bf16_dot(x_MI, w_IO):
        y = _bf16_dot(x_MI, w_IO, transpose_w).astype(out_dtype)
    else:
        y = jnp.matmul(x_MI, w_IO.T if transpose_w else w_IO,
                       preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Dense(nnx.Module):
    """``y = x @ kernel (+ bias)``, computed in ``dtype``.

    Args:
      d_in: input width.
      d_out: output width.
      names: logical axis names of ``kernel`` (``(in, out)``).
      dtype: compute dtype; inputs and the kernel are cast to it.
      param_dtype: parameter dtype.
      bias: whether to add a bias.
      std: the kernel's init (`Init`: a normal's std, a `Uniform`, ``None`` for zeros).
      bias_init: the bias's init (zeros by default).
      rngs: random streams (``params`` is used).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        names: tuple[str | None, str | None],
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        bias: bool,
        std: Init = INIT_STD,
        bias_init: Init = None,
        rngs: nnx.Rngs,
    ):
        self.kernel = param(rngs.params(), (d_in, d_out), names, param_dtype, std)
        # A key only for a drawn bias, so that zero-bias inits keep their random streams.
        key = rngs.params() if bias and bias_init is not None else None
        self.bias = param(key, (d_out,), names[1:], param_dtype, bias_init) if bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = matmul(x, self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis (statistics in ``dtype``, eps 1e-5 as PyTorch).

    Args:
      dim: normalised width.
      bias: whether to add a learned bias.
      param_dtype: parameter dtype.
      dtype: dtype of the statistics and the output (float32; float64 in a float64 model).
    """

    def __init__(self, dim: int, *, bias: bool, param_dtype: jnp.dtype,
                 dtype: jnp.dtype = jnp.float32):
        self.scale = nnx.Param(
            jnp.ones((dim,), param_dtype), out_sharding=(None,), eager_sharding=_eager_sharding()
        )
        self.bias = param(None, (dim,), (None,), param_dtype, None) if bias else None
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...].astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def rms_norm(x: jax.Array, eps: float = RMS_EPS, dtype: jnp.dtype | None = None) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, in ``dtype`` (no gain, no centring).

    Args:
      x: input ``(..., D)``.
      eps: added to the mean square (default PyTorch's ``F.rms_norm(eps=None)``: 2^-23,
        also in float64, where it stays the float32 model's function).
      dtype: dtype of the computation; ``None`` is ``promote_types(float32, x.dtype)``
        (float32, float64 for a float64 ``x``).

    Returns:
      The normalised ``x`` in ``dtype``.
    """
    x = x.astype(jnp.promote_types(jnp.float32, x.dtype) if dtype is None else dtype)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: ``rms_norm(x) * scale (+ bias)``, in ``dtype``.

    The gain is named ``scale`` as LayerNorm's, so both kinds have the same parameter
    paths. eps is PyTorch's default for ``F.rms_norm`` (:data:`RMS_EPS`, 2^-23).

    Args:
      dim: normalised width.
      bias: whether to add a learned bias.
      param_dtype: parameter dtype.
      dtype: dtype of the computation and the output (float32; float64 in a float64 model).

    References:
      Zhang and Sennrich, "Root Mean Square Layer Normalization",
      https://arxiv.org/abs/1910.07467, 2019.
    """

    def __init__(self, dim: int, *, bias: bool, param_dtype: jnp.dtype,
                 dtype: jnp.dtype = jnp.float32):
        self.scale = nnx.Param(
            jnp.ones((dim,), param_dtype), out_sharding=(None,), eager_sharding=_eager_sharding()
        )
        self.bias = param(None, (dim,), (None,), param_dtype, None) if bias else None
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_norm(x, dtype=self.dtype) * self.scale[...].astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def norm(config: GPTConfig, dim: int) -> LayerNorm | RMSNorm:
    """The norm ``config.norm`` names, with a bias when ``config.has_norm_bias``."""
    kind = RMSNorm if config.norm == "rmsnorm" else LayerNorm
    return kind(dim, bias=config.has_norm_bias, param_dtype=config.params_dtype,
                dtype=config.accumulation_dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``key`` is ``None`` or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    # float32 draws whatever jax's x64 mode: a float64 model drops what its float32 model does
    keep = jax.random.bernoulli(key, jnp.float32(1.0 - rate), x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, ``x/2 * (1 + erf(x/sqrt(2)))`` (PyTorch's ``nn.GELU()``), in float32
    (float64 for a float64 ``x``).

    ``jax.nn.gelu(approximate=False)`` computes the same function through ``erfc``,
    which XLA:CPU expands into a much longer polynomial (the whole nanoGPT CPU-recipe
    step was 13% slower with it).
    """
    x32 = x.astype(jnp.promote_types(jnp.float32, x.dtype))
    return (0.5 * x32 * (1.0 + jax.lax.erf(x32 * (1.0 / math.sqrt(2.0))))).astype(x.dtype)


#: ``init="hyperball"``'s multipliers on PyTorch's default bound ``1/sqrt(fan_in)``, by
#: matrix (modded-nanogpt Track 3 #5/#8/#13); q/k/v keep 1.
HYPERBALL_SCALE = {"fc": 1.5, "attn_proj": 1.25, "mlp_proj": 3.0}


def residual_std(config: GPTConfig, fan_in: int, matrix: str) -> Init:
    """Init of a residual output projection (``matrix``: ``"attn_proj"`` or
    ``"mlp_proj"``): nanoGPT's ``N(0, (0.02 / sqrt(2 n_layer))^2)``, zeros for
    ``init="track3"``, ``"cgi"`` and ``"depth_fc"``,
    ``Uniform(HYPERBALL_SCALE[matrix] / sqrt(fan_in))`` for ``init="hyperball"``."""
    if config.init == "hyperball":
        return Uniform(HYPERBALL_SCALE[matrix] / math.sqrt(fan_in))
    return (None if config.init in ("track3", "cgi", "depth_fc")
            else INIT_STD / math.sqrt(2 * config.n_layer))


def input_std(config: GPTConfig, fan_in: int, matrix: str = "qkv") -> Init:
    """Init of a matrix reading the residual stream (``matrix``: ``"qkv"`` or ``"fc"``,
    the latter also the gate): nanoGPT's ``N(0, 0.02^2)``, ``N(0, 0.33 / fan_in)`` for
    ``init="track3"``, ``Uniform(HYPERBALL_SCALE.get(matrix, 1) / sqrt(fan_in))`` for
    ``init="hyperball"``, ``Uniform(1 / sqrt(fan_in))`` for ``"cgi"`` and ``"depth_fc"``."""
    if config.init == "hyperball":
        return Uniform(HYPERBALL_SCALE.get(matrix, 1.0) / math.sqrt(fan_in))
    if config.init in ("cgi", "depth_fc"):  # #30, #42: nn.Linear's (fc depth-scaled later)
        return Uniform(1 / math.sqrt(fan_in))
    return math.sqrt(0.33 / fan_in) if config.init == "track3" else INIT_STD


def input_bias(config: GPTConfig, fan_in: int) -> Init:
    """Init of the bias of a matrix reading the residual stream: zeros, or PyTorch's
    default ``Uniform(1 / sqrt(fan_in))`` for ``init="hyperball"`` and ``"cgi"`` (output
    projections' biases are zero in every init; #42's ``"depth_fc"`` zeroes these too)."""
    return Uniform(1 / math.sqrt(fan_in)) if config.init in ("hyperball", "cgi") else None


def embed_std(config: GPTConfig) -> float:
    """Init std of the embedding tables: nanoGPT's 0.02, or 1 (PyTorch's ``nn.Embedding``)
    for ``init="track3"``, ``"hyperball"`` and ``"cgi"``."""
    return INIT_STD if config.init == "nanogpt" else 1.0


def head_std(config: GPTConfig) -> float | None:
    """Init std of the untied LM head: nanoGPT's 0.02, or ``None`` (zeros) for
    ``init="track3"``, ``"hyperball"`` and ``"cgi"``."""
    return INIT_STD if config.init == "nanogpt" else None


class MLP(nnx.Module):
    """Dense feed-forward block: GELU or ReLU² (``c_fc``, ``c_proj``), or SwiGLU (+ ``c_gate``).

    GELU is the exact (erf) one, as nanoGPT's ``nn.GELU()``; ReLU² is ``relu(x)^2``
    (modded-nanogpt's). SwiGLU computes ``c_proj(silu(c_gate x) * c_fc x)``.

    Args:
      config: the model configuration (``mlp``, ``hidden``, ``bias``, dtypes).
      rngs: random streams.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        D, F = config.n_embd, config.hidden
        kw = dict(dtype=config.compute_dtype, param_dtype=config.params_dtype, bias=config.bias)
        std, bias = input_std(config, D, "fc"), input_bias(config, D)
        self.c_fc = Dense(D, F, names=("embed", "mlp"), std=std, bias_init=bias, rngs=rngs,
                          **kw)
        self.c_gate = (
            Dense(D, F, names=("embed", "mlp"), std=std, bias_init=bias, rngs=rngs, **kw)
            if config.mlp == "swiglu" else None
        )
        self.c_proj = Dense(
            F, D, names=("mlp", "embed"), std=residual_std(config, F, "mlp_proj"), rngs=rngs,
            **kw
        )
        self.relu2 = config.mlp == "relu2"

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = self.c_fc(x_BTD)
        if self.c_gate is not None:
            h_BTF = jax.nn.silu(self.c_gate(x_BTD)) * h_BTF
        elif self.relu2:
            h_BTF = jnp.square(jax.nn.relu(h_BTF))
        else:
            h_BTF = gelu(h_BTF)
        return self.c_proj(h_BTF)
