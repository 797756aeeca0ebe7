"""Kronecker factors of a dense layer (or a stack of expert layers) from one batch.

Martens & Grosse (2015, arXiv:1503.05671), §3. For ``y = x W (+ b)`` with a Flax kernel
``W`` of shape ``(d_in, d_out)``, over the M tokens of a batch (every leading axis
flattened; tokens are independent examples), L the mean loss and ``g_i = M · ∂L/∂y_i``:

- ``A = (1/M) Σ x̃_i x̃_iᵀ`` with ``x̃ = [x; 1]`` when the layer has a bias, else ``x``;
- ``G = (1/M) Σ g_i g_iᵀ``.

The caller passes ``out_grads = ∂L/∂y`` (the per-token output gradients *of the mean loss*,
as ``jax.grad`` returns them for a zero perturbation added to the layer output) and
`layer_factors` multiplies them by M. The factors are computed in float32 whatever the
input dtype. The curvature of the layer is ``F ≈ A ⊗ G``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LayerCurvature:
    """The two Kronecker factors of one layer, or of a stack of layers (experts).

    This is both what `layer_factors` returns (batch statistics) and what
    `optax_snoo.kfac.scale_by_kfac` keeps in its state (their moving averages). A pytree
    with children ``(a, g)`` (unpacks and indexes as the pair ``(a, g)``).

    Attributes:
      a: input factor, ``(*stack, d_in [+1], d_in [+1])``; the last row/column is the
        homogeneous (bias) coordinate when the layer has a bias.
      g: output-gradient factor, ``(*stack, d_out, d_out)``.
      kernel_axes: static: the kernel's axes in the order ``(*stack, *inputs, *outputs)``
        the factors follow (a permutation of ``range(kernel.ndim)``), for kernels stored
        in another layout: ``(1, 0)`` for a PyTorch-style ``(out, in)`` kernel used as
        ``x @ W.T``, ``(2, 0, 1, 3)`` for a Flax ``(H, W, in, out)`` convolution kernel.
        ``None``: already in that order (``nnx.Linear``'s ``(in, out)``).
    """

    a: jax.Array
    g: jax.Array
    kernel_axes: tuple[int, ...] | None = None

    # Read as the pair it was (a NamedTuple) before it carried kernel_axes.
    def __iter__(self):
        return iter((self.a, self.g))

    def __getitem__(self, i):
        return (self.a, self.g)[i]

    def __len__(self):
        return 2


jax.tree_util.register_dataclass(LayerCurvature, data_fields=["a", "g"],
                                 meta_fields=["kernel_axes"])


def factor_spec(shape: Sequence[int], mesh: Any, axes: Sequence[str] | None) -> P:
    """Where a factor ``(*stack, d, d)`` lives on ``mesh``: its rows split over ``axes``.

    The batch (token) axes of the mesh: each device then keeps ``1/N`` of every factor
    and the statistics arrive there by one reduce-scatter (`layer_factors`'s
    ``scatter_axes``). Axes absent from ``mesh`` or of size 1 are dropped; replicated
    (``P()``) when none is left, without a mesh, or when ``d`` does not divide by the
    product of their sizes.

    Args:
      shape: the factor's shape ``(*stack, d, d)``.
      mesh: a ``jax.sharding.Mesh`` or abstract mesh, or None.
      axes: the mesh axes splitting the batch, e.g. ``("data", "fsdp")``.

    Returns:
      The factor's ``PartitionSpec``.

    Example:
      >>> import jax
      >>> from optax_snoo.kfac import factor_spec
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> factor_spec((8, 8), mesh, ("data",))     # one device: nothing to split
      P()

    References:
      Osawa et al., `Large-Scale Distributed Second-Order Optimization Using
      Kronecker-Factored Approximate Curvature for Deep Convolutional Neural Networks
      <https://arxiv.org/abs/1811.12019>`_, 2019 (factors reduce-scattered to the
      devices that own them)
    """
    if not axes or mesh is None or mesh.empty or len(shape) < 2:
        return P()
    sizes = mesh.shape
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
    if not axes or shape[-2] % math.prod(sizes[a] for a in axes):
        return P()
    return P(*[None] * (len(shape) - 2), axes, None)


def _with_bias_coordinate(x: jax.Array) -> jax.Array:
    return jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype)], axis=-1)


def layer_factors(
    inputs: jax.Array,
    out_grads: jax.Array,
    has_bias: bool = False,
    *,
    mask: jax.Array | None = None,
    num_tokens: jax.Array | float | None = None,
    stacked: bool = False,
    scatter_axes: Sequence[str] | None = None,
) -> LayerCurvature:
    r"""Batch Kronecker factors ``(A, G)`` of a dense layer or of a stack of experts.

    **Dense** (``stacked=False``): ``inputs`` is ``(..., d_in)`` and ``out_grads``
    ``(..., d_out)`` with the same leading axes (e.g. ``(B, T, ·)``); every leading
    position is a token. With ``m_i`` the mask (1 by default), ``n = Σ m_i`` and
    ``g_i = num_tokens · out_grads_i``::

        A = Σ m_i x̃_i x̃_iᵀ / n        G = Σ m_i g_i g_iᵀ / n

    ``num_tokens`` defaults to ``n``: the number of tokens the mean loss averages over,
    which makes ``g_i`` the gradient of token i's own loss.

    **Expert stack** (``stacked=True``): ``inputs`` is ``(E, C, d_in)`` and ``out_grads``
    ``(E, C, d_out)`` (``C`` the capacity slots, or any number of leading token axes after
    ``E``); ``mask`` ``(E, C)`` marks the slots that hold a routed token. Each expert gets
    its own factors from its own tokens (``n_e = Σ_c m_ec``; an expert that received no
    token gets zero factors). ``num_tokens`` is then required: it is the M of the mean
    loss (the tokens of the whole batch), which the routed slots do not determine. Pass
    the mask for zero-padded dispatch buffers: without it an empty slot counts as a token
    (diluting both factors, and adding to the bias coordinate of ``A``).

    Args:
      inputs: the layer inputs ``x`` (any float dtype).
      out_grads: ``∂L/∂y`` for the mean loss L, same leading shape as ``inputs``.
      has_bias: append the homogeneous coordinate, so ``A`` is ``(d_in+1, d_in+1)`` and
        preconditions ``[W; b]``.
      mask: optional 0/1 (or boolean) weights over the leading (token) axes, e.g. padding;
        masked tokens contribute nothing to either factor.
      num_tokens: the M of ``g_i = M · ∂L/∂y_i`` (scale applied to ``out_grads``); a
        Python number or a scalar array.
      stacked: the first axis indexes independent layers (experts).
      scatter_axes: the mesh axes (of the ``jax.set_mesh`` context) that split the
        tokens, e.g. ``("data", "fsdp")``. A dense factor without bias or mask whose
        rows divide by their devices (`factor_spec`) is then summed over each device's
        own tokens and reduce-scattered (``jax.lax.psum_scatter`` in a
        ``jax.shard_map``): it comes back with its rows split over them, the layout
        `scale_by_kfac` keeps its EMA in with the same ``stats_axes``. Others are reduced
        as the partitioner places them (an all-reduce). None: no shard_map.

    Returns:
      `LayerCurvature` ``(a, g)`` in float32: ``a`` ``(d_in', d_in')`` and ``g``
      ``(d_out, d_out)``, with a leading ``E`` axis when ``stacked``.

    Raises:
      ValueError: mismatched leading shapes, a mask of the wrong shape, or a stacked call
        without ``num_tokens``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import layer_factors
      >>> x = jnp.ones((2, 3, 4))                 # (B, T, d_in)
      >>> dy = jnp.full((2, 3, 5), 1.0 / 6)       # ∂(mean loss)/∂y, (B, T, d_out)
      >>> a, g = layer_factors(x, dy, has_bias=True)
      >>> a.shape, g.shape, float(g[0, 0])
      ((5, 5), (5, 5), 1.0)

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015

      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for convolution
      layers <https://arxiv.org/abs/1602.01407>`_, 2016
    """
    if inputs.shape[:-1] != out_grads.shape[:-1]:
        raise ValueError(
            f"inputs {inputs.shape} and out_grads {out_grads.shape} must share their leading "
            "(token) axes: expected (..., d_in) and (..., d_out).")
    lead = inputs.shape[:-1]
    if stacked:
        if len(lead) < 2:
            raise ValueError(
                f"stacked=True expects inputs (E, C, d_in), got shape {inputs.shape}.")
        if num_tokens is None:
            raise ValueError(
                "stacked=True needs num_tokens: the number of tokens the mean loss averages "
                "over (the M of g = M·∂L/∂y), which the expert slots do not determine.")
    if mask is not None and tuple(mask.shape) != lead:
        raise ValueError(f"mask has shape {mask.shape}, expected the leading shape {lead}.")

    if not stacked and mask is None:
        return _dense_factors(inputs, out_grads, has_bias, num_tokens,
                              None if has_bias else scatter_axes)
    num_experts = lead[0] if stacked else 1
    x = inputs.astype(jnp.float32).reshape(num_experts, -1, inputs.shape[-1])
    dy = out_grads.astype(jnp.float32).reshape(num_experts, -1, out_grads.shape[-1])
    if mask is None:
        weights = jnp.ones(x.shape[:2], jnp.float32)
    else:
        weights = mask.astype(jnp.float32).reshape(num_experts, -1)
    count = jnp.sum(weights, axis=1)                                   # (E,)
    scale = count if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
    if has_bias:
        x = _with_bias_coordinate(x)
    g = dy * jnp.reshape(scale, (-1, 1, 1))
    inv_count = (1.0 / jnp.maximum(count, 1.0))[:, None, None]
    a = jnp.einsum("ecm,ecn->emn", x * weights[..., None], x, precision=_HIGHEST) * inv_count
    gg = jnp.einsum("ecm,ecn->emn", g * weights[..., None], g, precision=_HIGHEST) * inv_count
    if not stacked:
        a, gg = a[0], gg[0]
    return LayerCurvature(a=a, g=gg)


def _gram(x_NM: jax.Array, scatter_axes: Sequence[str] | None = None) -> jax.Array:
    """``xᵀx`` of a 2-D ``(N, M)`` array in one matrix product, accumulated in float32.

    Contracting the leading (token) axis of both operands is the layout of a weight
    gradient, so no transpose is materialised; bf16 products are exact in float32.

    bf16 on the CPU backend (not under a mesh): ``xᵀ`` is copied out row-major behind
    optimisation barriers, the same exact products and float32 sums in the form the CPU's
    bf16 kernels take. Under a mesh (``jax.set_mesh``) the plain product is used, since
    flattening a token-sharded ``xᵀ`` would gather it, where the plain product reduces
    ``(d, d)`` partial sums instead.
    """
    mesh = jax.sharding.get_abstract_mesh()
    spec = factor_spec((x_NM.shape[1],) * 2, mesh, scatter_axes)
    axes = spec[0] if spec != P() else ()
    axes = axes if isinstance(axes, tuple) else (axes,)   # (P normalises a 1-tuple)
    if axes and x_NM.shape[0] % math.prod(mesh.shape[a] for a in axes) == 0:
        # Each device's own tokens' partial sum, reduce-scattered into its rows: (N-1)/N
        # of the factor on the wire instead of an all-reduce's 2(N-1)/N, and 1/N kept.
        local = lambda x: jax.lax.psum_scatter(_gram(x), axes, scatter_dimension=0,
                                               tiled=True)
        return jax.shard_map(local, in_specs=P(axes, None), out_specs=spec,
                             check_vma=False)(x_NM)
    # Why the copy on CPU, and what it measured: docs/design.md, "Implementation notes".
    if (x_NM.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"
            and jax.sharding.get_abstract_mesh().empty):
        x_MN = jax.lax.optimization_barrier(x_NM.T.reshape(-1)).reshape(x_NM.shape[::-1])
        x_MN, x_NM = jax.lax.optimization_barrier((x_MN, x_NM))
        return jax.lax.optimization_barrier(
            jnp.matmul(x_MN, x_NM, preferred_element_type=jnp.float32))
    return jax.lax.dot_general(x_NM, x_NM, (((0,), (0,)), ((), ())), precision=_HIGHEST,
                               preferred_element_type=jnp.float32)


def _dense_factors(inputs: jax.Array, out_grads: jax.Array, has_bias: bool,
                   num_tokens: jax.Array | float | None,
                   scatter_axes: Sequence[str] | None = None) -> LayerCurvature:
    """The unmasked dense case with one product per factor: the bias row/column of ``A``
    is the mean input (no ``[x; 1]`` copy), and ``G``'s scale ``M²/n`` is applied to the
    ``(d_out, d_out)`` result instead of the ``(n, d_out)`` gradients."""
    x = inputs.reshape(-1, inputs.shape[-1])
    dy = out_grads.reshape(-1, out_grads.shape[-1])
    n = x.shape[0]
    if n == 0:
        return LayerCurvature(
            a=jnp.zeros((x.shape[1] + has_bias,) * 2, jnp.float32),
            g=jnp.zeros((dy.shape[1],) * 2, jnp.float32))
    a = _gram(x, scatter_axes) / n
    if has_bias:
        mean = jnp.sum(x, axis=0, dtype=jnp.float32) / n
        a = jnp.block([[a, mean[:, None]], [mean[None, :], jnp.ones((1, 1), jnp.float32)]])
    scale = float(n) if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
    return LayerCurvature(a=a, g=_gram(dy, scatter_axes) * (scale * scale / n))
