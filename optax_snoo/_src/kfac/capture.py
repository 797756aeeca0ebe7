"""K-FAC layer statistics of any JAX model, read from the jaxpr of its loss.

`value_grad_and_stats` traces the loss once (``jax.make_jaxpr`` over the flattened
params), finds every ``dot_general`` one of whose operands is a params leaf (a *kernel*),
and re-evaluates the jaxpr with an interpreter that records the other operand ``x`` of
each such product and adds a zero perturbation ``p`` to its output ``y``. One backward
pass then gives the parameter gradients and ``∂L/∂p = ∂L/∂y`` for every layer (the
recipe of Martens & Grosse 2015 and kfac-jax's tracer, without layer tags).
This module is the public half; `optax_snoo._src.kfac.jaxpr_analysis` decides what is
captured (a plan per equation) and `optax_snoo._src.kfac.interpreter` runs the plan.

What counts as "a params leaf": the leaf itself, or the leaf through
``convert_element_type`` / ``copy`` / ``optimization_barrier`` / sharding constraints,
also across ``jit`` (``jnp.matmul`` and ``jnp.einsum`` are nested jits), ``closed_call``,
``remat`` and ``custom_jvp`` / ``custom_vjp`` boundaries. A ``custom_vjp`` (or
``custom_jvp``) call whose body is a single captured product, with ``x`` and the product
connected to the call's inputs and output through those pass-through ops only (a fast
hand-written matmul), is kept whole: ``x`` is read at the call's input and the call's
output is perturbed, so its custom backward still runs. Other calls with captured
products inside are inlined (their custom rules are not used).

Layouts. The ``dot_general`` dimension numbers give, on the kernel's side, batch axes
(a stack of independent layers, e.g. MoE experts ``E``), contracting axes (``d_in``) and
free axes (``d_out``), in any order and also through ``transpose`` (``x @ W.T`` on a
PyTorch-style ``(out, in)`` kernel): the statistics follow the product, and
`LayerStats.kernel_axes` (passed on as `LayerCurvature.kernel_axes`) records the
permutation of the kernel's axes to ``(*batch, *contracting, *free)``, so `scale_by_kfac`
preconditions the gradient in the kernel's own layout. ``nnx.Linear`` ``(in, out)``,
``nnx.Einsum`` kernels such as ``"btd,dnh->btnh"`` (``d_in = d``, ``d_out = n·h``) and
expert stacks ``(E, in, out)`` need no permutation. The ``x`` side may be in any layout.

Convolutions (``conv_general_dilated`` with a params-leaf kernel, ``nnx.Conv``; any
spatial rank, strides, padding, dilations) record the input and turn it into its patches
(``conv_general_dilated_patches``): ``d_in = in_channels · window``, one row per example
and output position (Grosse & Martens 2016). Grouped and depthwise convolutions
(``feature_group_count`` or ``batch_group_count`` > 1) are not captured.

A kernel read by several products in the same layout (weight sharing) gets all their
rows, concatenated (`LayerStats.uses`; K-FAC-expand, see `curvature_from_stats`).

Scanned layers (``jax.lax.scan`` / ``nnx.scan`` over a stacked params leaf passed as the
scan's ``xs``, as MaxText and levanter compile their layers): a product in the body
whose kernel is the iteration's slice is captured per layer, the scan re-run with the
perturbations as extra ``xs`` and the inputs as extra outputs; the statistics are
stacked ``(L, N, ·)`` (`LayerStats.scanned`) and the factors ``(L, d, d)``, preconditioned
as a stack like expert stacks.

Not captured, each named with its reason (a warning when ``layers=None``, an error
when the kernel is named in ``layers``): products inside ``while`` / ``cond`` bodies or
nested scans, a kernel a scan body reads whole (a constant of the loop), convolutions
inside a scan, a kernel used in different layouts, grouped convolutions, and a leaf
called ``kernel`` that reaches the loss only through other ops (``x @ (2 * W)``).
`describe` lists what is captured, and why not.

Statistics (`LayerStats`, keyed by the kernel's path, `optax_snoo._src.utils.
path_to_str`): ``inputs`` ``(*stack, N, d_in)`` and ``out_grads`` ``(*stack, N, d_out)``,
the ``N`` tokens being every free axis of ``x`` flattened in order (a convolution's
examples and output positions) (``B·T`` for a
``(B, T, d)`` input; the capacity slots ``C`` of an expert buffer ``(E, C, d)``), in the
dtypes the product saw. ``out_grads`` are the gradients of the loss as written: for a
mean over ``M`` tokens they are ``1/M`` of the per-token gradients (`layer_factors` and
`curvature_from_stats` rescale them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_snoo._src.kfac.description import Description
from optax_snoo._src.kfac.factors import LayerCurvature, layer_factors
from optax_snoo._src.kfac.interpreter import run_jaxpr
from optax_snoo._src.kfac.jaxpr_analysis import Site, trace_loss
from optax_snoo._src.utils import check_int_at_least

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One kernel's batch statistics from `value_grad_and_stats` (a pytree).

    Attributes:
      inputs: the layer inputs ``x`` (for a convolution, its input patches),
        ``(*stack, N, d_in)``.
      out_grads: ``∂L/∂y`` of the loss as written, ``(*stack, N, d_out)``.
      has_bias: whether the params tree has a bias sibling for this kernel (the leaf
        named ``"bias"`` next to it, of ``stack + d_out`` elements); static.
      kernel_axes: static: the kernel's axes in the order ``(*stack, *inputs,
        *outputs)`` that ``d_in`` and ``d_out`` flatten (`LayerCurvature.kernel_axes`);
        ``None`` when the kernel is stored in that order.
      locations: static: output positions per example that one kernel application
        repeats over (a convolution's spatial output size; 1 for a matmul).
      uses: static: number of products that read this kernel (weight sharing); their
        rows are concatenated along ``N``.
      scanned: static: the first stack axis is the layer axis of a stacked leaf a
        ``scan`` walks (one layer per iteration, each seeing all ``N`` tokens).
    """

    inputs: jax.Array
    out_grads: jax.Array
    has_bias: bool = False
    kernel_axes: tuple[int, ...] | None = None
    locations: int = 1
    uses: int = 1
    scanned: bool = False


jax.tree_util.register_dataclass(
    LayerStats, data_fields=["inputs", "out_grads"],
    meta_fields=["has_bias", "kernel_axes", "locations", "uses", "scanned"])



def _standard(site: Site, x: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` (a convolution's input patches) ``(*stack, N, d_in)`` and ``dy``
    ``(*stack, N, d_out)`` of one product."""
    # A scanned site's records lead with the layer axis: the first stack axis.
    lead = (lambda axes: (0, *(a + 1 for a in axes))) if site.scanned else tuple
    if site.kind == "conv":
        x = jax.lax.conv_general_dilated_patches(x, precision=_HIGHEST, **site.conv)
        x = jnp.transpose(x, site.out_perm)
    else:
        x = jnp.transpose(x, lead((*site.x_batch, *site.x_free, *site.x_contract)))
    x = x.reshape(*site.stack, -1, site.d_in)
    dy = jnp.transpose(dy, lead(site.out_perm)).reshape(*site.stack, -1, site.d_out)
    return x, dy


def _bias_sibling(path: str, shapes: dict[str, tuple[int, ...]], site: Site,
                  bias_name: str) -> bool:
    names = path.split("/")
    bias = "/".join([*names[:-1], bias_name])
    shape = shapes.get(bias)
    return (bias != path and shape is not None and tuple(shape[:len(site.stack)]) == site.stack
            and math.prod(shape[len(site.stack):]) == site.d_out)


def value_grad_and_stats(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    has_aux: bool = False,
    layers: Collection[str] | None = None,
    bias_name: str = "bias",
) -> tuple[Any, Any, dict[str, LayerStats]]:
    r"""Loss, gradients and K-FAC statistics of every layer, in one backward pass.

    Works on any JAX loss: the layers are found in the jaxpr of
    ``loss_fn(params, *args)`` (see the module docstring for what is captured), so a
    Flax NNX model of ``nnx.Linear`` / ``nnx.Einsum`` / ``nnx.Conv`` layers, a plain-JAX
    model, PyTorch-layout ``(out, in)`` kernels, shared kernels or expert stacks need no
    changes. `describe` says what it captures. ``args`` are closed over (Python values stay static).

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (a float scalar), or ``(loss, aux)``
        with ``has_aux``.
      params: the parameters (any pytree of arrays).
      *args: the other arguments of ``loss_fn`` (batch, targets, PRNG key...).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      layers: paths (``"dense/kernel"``, the `optax_snoo._src.utils.path_to_str` of the
        leaf) of the kernels to capture; ``None``: every supported kernel (unsupported
        ones are skipped with a warning). A named kernel that is not found or not
        supported raises.
      bias_name: key of a kernel's bias sibling (sets `LayerStats.has_bias`).

    Returns:
      ``(value, grads, stats)``: ``value`` as ``loss_fn`` returns it; ``grads`` the
      gradient of the loss (tree of ``params``); ``stats`` a dict from kernel path to
      `LayerStats`. Feed K-FAC with `curvature_from_stats`.

    Raises:
      ValueError: a kernel named in ``layers`` that cannot be captured, with the reason
        (a while/cond body, uses in different layouts, a grouped convolution, no matmul
        or convolution reads it as its kernel).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import kfac
      >>> params = {"l1": {"kernel": jnp.ones((4, 8)) / 4, "bias": jnp.zeros(8)},
      ...           "l2": {"kernel": jnp.ones((8, 3)) / 8}}
      >>> def loss_fn(p, x, y):
      ...   h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
      ...   return optax.softmax_cross_entropy_with_integer_labels(
      ...       h @ p["l2"]["kernel"], y).mean()
      >>> x, y = jnp.ones((2, 5, 4)), jnp.zeros((2, 5), jnp.int32)
      >>> loss, grads, stats = kfac.value_grad_and_stats(loss_fn, params, x, y)
      >>> stats["l1/kernel"].inputs.shape, stats["l1/kernel"].has_bias
      ((10, 4), True)
      >>> tx = kfac.kfac(0.1, refresh=kfac.every(1, first=0))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params,
      ...                            curvature=kfac.curvature_from_stats(stats))

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015

      Botev and Martens, `KFAC-JAX <https://github.com/google-deepmind/kfac-jax>`_, 2022
      (the jaxpr tracer this follows)

      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016
    """
    trace = trace_loss(loss_fn, params, args, layers, "value_grad_and_stats")
    if trace.skipped:
        lines = "; ".join(f"{p}: {why}" for p, why in sorted(trace.skipped.items()))
        if layers is not None:
            raise ValueError(f"value_grad_and_stats cannot capture {lines}.")
        warnings.warn(f"value_grad_and_stats: not captured (K-FAC statistics skipped, "
                      f"these kernels get no curvature): {lines}.", stacklevel=2)
    analysis, jaxpr, plan = trace.analysis, trace.closed.jaxpr, trace.plan
    leaves = jax.tree_util.tree_leaves(params)
    perts = [jnp.zeros(s.pert_shape, s.out_aval.dtype) for s in analysis.sites]
    consts = list(trace.closed.consts)

    def total(leaves, perts):
        records = [None] * len(analysis.sites)
        out = run_jaxpr(jaxpr, consts, leaves, plan, perts, records)
        value = jax.tree_util.tree_unflatten(trace.out_tree, out)
        loss = value[0] if has_aux else value
        return loss, (value, records)

    (_, (value, records)), (grads, dys) = jax.value_and_grad(
        total, argnums=(0, 1), has_aux=True)(leaves, perts)
    stats = {}
    for path, sites in trace.captured.items():
        xs, dys_ = zip(*(_standard(s, records[s.index], dys[s.index]) for s in sites),
                       strict=True)
        s = sites[0]
        stats[path] = LayerStats(
            inputs=jnp.concatenate(xs, axis=-2) if len(xs) > 1 else xs[0],
            out_grads=jnp.concatenate(dys_, axis=-2) if len(dys_) > 1 else dys_[0],
            has_bias=_bias_sibling(path, trace.shapes, s, bias_name),
            kernel_axes=s.kernel_axes, locations=s.locations, uses=len(sites),
            scanned=s.scanned)
    return value, jax.tree_util.tree_unflatten(trace.treedef, grads), stats



def describe(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    layers: Collection[str] | None = None,
    bias_name: str = "bias",
) -> Description:
    r"""What K-FAC's capture makes of each params leaf: a kernel's kind, or why not.

    Traces ``loss_fn(params, *args)`` as `value_grad_and_stats` does (no computation:
    ``params`` and ``args`` may be ``jax.ShapeDtypeStruct``) and describes every leaf:

    - a captured kernel: ``"dense"`` or ``"conv"`` with ``d_in``/``d_out``, then any of
      ``"scanned stack (L,)"``, ``"expert stack (E,)"``, ``"transposed"`` (stored in
      another axis order than ``(*stack, *in, *out)``: `LayerCurvature.kernel_axes`),
      ``"shared by k products"``, ``"with bias b"``, and ``"also read by gather"``
      when other ops read it too (their share of its gradient is preconditioned with
      these factors);
    - a kernel that will not be preconditioned: ``"skipped: <why>"`` (the reasons
      `value_grad_and_stats` warns or raises with);
    - any other leaf: ``"first-order: read by <ops>"`` (or ``"unused"``).

    Args:
      loss_fn: ``loss_fn(params, *args)``, as for `value_grad_and_stats`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the other arguments of ``loss_fn``.
      layers: kernel paths to capture (``None``: every one), as for
        `value_grad_and_stats`.
      bias_name: key of a kernel's bias sibling.

    Returns:
      A dict from each leaf's path (in leaf order) to its description, which prints as
      a table (`Description`).

    Raises:
      ValueError: ``layers`` naming a path that is not a params leaf.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from optax_snoo import kfac
      >>> p = {"c": {"kernel": jnp.ones((3, 3, 1, 4)), "bias": jnp.zeros(4)},
      ...      "head": {"kernel": jnp.ones((2, 4 * 36))}}          # PyTorch (out, in)
      >>> def loss_fn(p, x):
      ...   h = jax.lax.conv_general_dilated(x, p["c"]["kernel"], (1, 1), "VALID",
      ...       dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["c"]["bias"]
      ...   return jnp.mean(h.reshape(len(x), -1) @ p["head"]["kernel"].T)
      >>> print(kfac.describe(loss_fn, p, jnp.ones((2, 8, 8, 1))))
      leaf         K-FAC
      c/bias       bias of c/kernel
      c/kernel     conv, d_in 9, d_out 4, 36 locations, kernel axes (2, 0, 1, 3), with bias c/bias
      head/kernel  dense, d_in 144, d_out 2, transposed (1, 0)
      2 kernels preconditioned, 0 skipped, 1 other leaf (biases go with their kernel)

    References:
      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016
    """
    trace = trace_loss(loss_fn, params, args, layers, "describe")
    out, biases = {}, {}
    for path, sites in trace.captured.items():
        s = sites[0]
        words = [s.kind, f"d_in {s.d_in}", f"d_out {s.d_out}"]
        if s.kind == "conv":
            words.append(f"{s.locations} locations")
        if s.scanned:
            words.append(f"scanned stack ({s.stack[0]},)")
        if s.stack[s.scanned:]:
            words.append(f"expert stack {s.stack[s.scanned:]}")
        if s.kernel_axes is not None:
            words.append(f"{'transposed' if s.kind == 'dense' else 'kernel axes'} "
                         f"{s.kernel_axes}")
        if len(sites) > 1:
            words.append(f"shared by {len(sites)} products")
        if _bias_sibling(path, trace.shapes, s, bias_name):
            bias = "/".join([*path.split("/")[:-1], bias_name])
            biases[bias] = path
            words.append(f"with bias {bias}")
        reads = trace.analysis.others.get(trace.paths.index(path))
        if reads:
            words.append(f"also read by {', '.join(sorted(reads))}")
        out[path] = ", ".join(words)
    for i, path in enumerate(trace.paths):
        if path in out:
            continue
        if path in trace.skipped:
            out[path] = f"skipped: {trace.skipped[path]}"
        elif path in biases:
            out[path] = f"bias of {biases[path]}"
        else:
            reads = sorted(trace.analysis.others.get(i, ()))
            out[path] = f"first-order: read by {', '.join(reads)}" if reads else "unused"
    return Description({path: out[path] for path in trace.paths})


def _every_nth(a: jax.Array, stride: int, offset: int | jax.Array) -> jax.Array:
    """Tokens ``offset, offset + stride, ...`` of ``a`` ``(..., N, d)``."""
    a = a.reshape(*a.shape[:-2], a.shape[-2] // stride, stride, a.shape[-1])
    return jax.lax.dynamic_index_in_dim(a, offset, axis=a.ndim - 2, keepdims=False)


def curvature_from_stats(
    stats: dict[str, LayerStats],
    *,
    num_tokens: int | jax.Array | None = None,
    token_stride: int = 1,
    token_offset: int | jax.Array = 0,
    scatter_axes: Sequence[str] | None = None,
) -> dict[str, LayerCurvature]:
    r"""The ``curvature=`` argument of `kfac` / `scale_by_kfac` from captured statistics.

    For each layer, `layer_factors` of its inputs and output gradients (with the bias
    coordinate when `LayerStats.has_bias`): ``A = Σ x̃ x̃ᵀ / n`` and ``G = Σ g gᵀ / n``
    with ``g = M ∂L/∂y``. Stacked layers (MoE experts, ``(E, C, ·)``) get per-expert
    factors from each expert's own tokens: a slot whose input row is all zeros is an
    empty slot (zero-padded dispatch buffers) and is not counted.

    A convolution (``S = LayerStats.locations`` output positions per example) follows
    Grosse & Martens (KFC) and kfac-jax's ``Conv2DTwoKroneckerFactored``: ``A`` and
    ``G`` are means over examples and positions, and ``G`` carries KFC's factor ``S``
    (kfac-jax's ``fixed_scale``): ``G = S·M²·mean(dy dyᵀ)``. A kernel shared by ``k``
    products (``LayerStats.uses``) follows K-FAC-expand (Eschenhagen et al. 2023): its
    uses count as more tokens of one layer, ``A`` the mean over all of them and ``G``
    the sum of the uses' own ``G`` (``k·M²·mean(dy dyᵀ)``).

    Args:
      stats: from `value_grad_and_stats`.
      num_tokens: ``M``, the number of terms the mean loss averages over (tokens for a
        language model, examples for an image classifier). Default: each layer's own
        ``N / (locations · uses)``, the tokens of a dense layer or the examples of a
        convolution (right when the loss is the mean over those); required when
        ``stats`` holds a stacked layer.
      token_stride: use every ``token_stride``-th token only (cheaper factors; over
        ``token_stride`` steps with ``token_offset = step % token_stride`` every token is
        used once). ``N`` must be divisible by it. Stacked layers use all their slots
        (each expert already sees a fraction of the tokens).
      token_offset: first token used (``0 <= offset < token_stride``), may be traced.
      scatter_axes: the mesh axes splitting the tokens: dense factors come back with
        their rows split over them by one reduce-scatter (`layer_factors`), for
        `scale_by_kfac` with the same ``stats_axes``. None: as the partitioner places them.

    Returns:
      A dict from kernel path to `LayerCurvature` (float32, with the kernel's
      ``kernel_axes``).

    Raises:
      ValueError: a stacked layer without ``num_tokens``, a bad ``token_stride`` or one
        that does not divide a layer's token count.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import LayerStats, curvature_from_stats
      >>> s = {"l/kernel": LayerStats(jnp.ones((6, 4)), jnp.full((6, 2), 1 / 6))}
      >>> c = curvature_from_stats(s)
      >>> c["l/kernel"].a.shape, float(c["l/kernel"].g[0, 0])
      ((4, 4), 1.0)

    References:
      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016

      Eschenhagen et al., `Kronecker-Factored Approximate Curvature for Modern Neural
      Network Architectures <https://arxiv.org/abs/2311.00636>`_, 2023
    """
    check_int_at_least("token_stride", token_stride, 1)
    out = {}
    for path, s in stats.items():
        x, dy = s.inputs, s.out_grads
        layers_only = s.scanned and x.ndim == 3   # (L, N, d): every layer sees every token
        stacked = x.ndim > 2 and not layers_only
        n = x.shape[-2]
        if stacked and num_tokens is None:
            raise ValueError(
                f"curvature_from_stats: {path} is a stack of layers {x.shape[:-2]} (e.g. "
                "MoE experts): pass num_tokens, the number of tokens the mean loss averages "
                "over, which the expert slots do not determine.")
        # KFC's |T| and K-FAC-expand's sum over uses: G = uses·locations·M²·mean(dy dyᵀ).
        repeats = s.uses * s.locations
        m = n // repeats if num_tokens is None else num_tokens
        m = m * math.sqrt(repeats) if repeats > 1 else m
        if token_stride > 1 and not stacked:
            if n % token_stride:
                raise ValueError(f"token_stride={token_stride} must divide the token count "
                                 f"{n} of {path}.")

            x, dy = (_every_nth(a, token_stride, token_offset) for a in (x, dy))
        if stacked:
            lead = x.shape[:-2]
            x3 = x.reshape(-1, *x.shape[-2:])
            dy3 = dy.reshape(-1, *dy.shape[-2:])
            mask = jnp.any(x3 != 0, axis=-1)
            f = layer_factors(x3, dy3, s.has_bias, mask=mask, num_tokens=m, stacked=True)
            f = LayerCurvature(f.a.reshape(*lead, *f.a.shape[1:]),
                               f.g.reshape(*lead, *f.g.shape[1:]))
        elif layers_only:
            f = jax.vmap(functools.partial(layer_factors, has_bias=s.has_bias,
                                           num_tokens=m))(x, dy)
        else:
            f = layer_factors(x, dy, s.has_bias, num_tokens=m, scatter_axes=scatter_axes)
        out[path] = LayerCurvature(f.a, f.g, s.kernel_axes)
    return out
