"""Which leaves K-FAC preconditions: key paths, layer blocks and curvature matching.

A preconditioned layer is a kernel leaf named by its key path (`optax_snoo._src.utils.
path_names`: ``("l1", "kernel")``, nnx ``.value`` dropped, keys split on "/"), with an
optional bias sibling. `resolve_blocks` matches factor shapes ``(*stack, d_in', d_in')`` /
``(*stack, d_out, d_out)`` to those leaves (static Python, at trace time) and raises a
`ValueError` naming the layer on any inconsistency.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.kfac.factors import LayerCurvature
from optax_snoo._src.utils import path_names

Names = tuple[str, ...]

def label(names: Names) -> str:
    return "/".join(names) or "<root>"


def is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def flatten_params(tree: Any) -> tuple[list[tuple[Names, Any]], Any]:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)
    return [(path_names(path), leaf) for path, leaf in pairs], treedef


def flatten_curvature(tree: Any, what: str) -> dict[Names, LayerCurvature]:
    """Path -> LayerCurvature for a curvature tree (``None`` entries are skipped)."""
    pairs = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or isinstance(x, LayerCurvature))[0]
    out = {}
    for path, leaf in pairs:
        if leaf is None:
            continue
        if not isinstance(leaf, LayerCurvature):
            raise ValueError(
                f"{what}: expected a LayerCurvature(a, g) (or None) at the path of each "
                f"preconditioned kernel, found {type(leaf).__name__} at {label(path_names(path))}.")
        out[path_names(path)] = leaf
    return out


def nested(items: dict[Names, Any]) -> dict:
    root: dict = {}
    for names, value in items.items():
        node = root
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = value
    return root


def flatten_nested(tree: dict, cls: type | tuple[type, ...]) -> dict[Names, Any]:
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, cls))[0]
    return {path_names(path): leaf for path, leaf in pairs}


# ------------------------------------------------------------------------------ blocks
@dataclasses.dataclass(frozen=True)
class Block:
    """Where a preconditioned layer sits in the flat leaves (static, Python)."""

    names: Names
    kernel: int
    bias: int | None
    stack: tuple[int, ...]
    d_in: int
    d_out: int
    a_shape: tuple[int, ...]
    g_shape: tuple[int, ...]
    kernel_axes: tuple[int, ...] | None = None  # `LayerCurvature.kernel_axes`


def to_layer(kernel: jax.Array, axes: tuple[int, ...] | None) -> jax.Array:
    """A kernel (or its gradient) in the ``(*stack, *inputs, *outputs)`` axis order."""
    return kernel if axes is None else jnp.transpose(kernel, axes)


def from_layer(x: jax.Array, axes: tuple[int, ...] | None, shape: tuple[int, ...]
               ) -> jax.Array:
    """The inverse of `to_layer`: ``x`` (any shape of the same size) back to ``shape``."""
    if axes is None:
        return jnp.reshape(x, shape)
    x = jnp.reshape(x, tuple(shape[a] for a in axes))
    return jnp.transpose(x, tuple(int(i) for i in np.argsort(axes)))


def resolve_blocks(specs: dict[Names, tuple], entries: list[tuple[Names, Any]],
                   bias_name: str) -> list[Block]:
    """Match factor shapes ``(a_shape, g_shape[, kernel_axes])`` to kernel (and bias)
    leaves; ValueError on any inconsistency."""
    index = {names: i for i, (names, leaf) in enumerate(entries) if not is_masked(leaf)}
    blocks, claimed = [], {}
    for names, (a_shape, g_shape, *rest) in sorted(specs.items()):
        axes = rest[0] if rest else None
        where = label(names)
        if names not in index:
            raise ValueError(f"K-FAC layer {where}: no such parameter in the params tree.")
        k_shape = tuple(np.shape(entries[index[names]][1]))
        if axes is not None:
            if sorted(axes) != list(range(len(k_shape))):
                raise ValueError(f"K-FAC layer {where}: kernel_axes {axes} is not a "
                                 f"permutation of the axes of the kernel {k_shape}.")
            k_shape = tuple(k_shape[a] for a in axes)
        a_shape, g_shape = tuple(a_shape), tuple(g_shape)
        stack = a_shape[:-2]
        if (len(a_shape) < 2 or len(g_shape) < 2 or a_shape[-1] != a_shape[-2]
                or g_shape[-1] != g_shape[-2] or g_shape[:-2] != stack
                or k_shape[:len(stack)] != stack):
            raise ValueError(
                f"K-FAC layer {where}: factors a {a_shape} and g {g_shape} must be "
                f"(*stack, d, d) with the same stack axes leading the kernel {k_shape}.")
        rest = k_shape[len(stack):]
        size, a_dim, d_out = math.prod(rest), a_shape[-1], g_shape[-1]
        if size == a_dim * d_out:
            d_in, bias = a_dim, None
        elif size == (a_dim - 1) * d_out:
            d_in = a_dim - 1
            bias_names = (*names[:-1], bias_name)
            if bias_names not in index:
                raise ValueError(
                    f"K-FAC layer {where}: factor a {a_shape} includes a bias coordinate but "
                    f"there is no sibling leaf {label(bias_names)} (in this group).")
            b_shape = tuple(np.shape(entries[index[bias_names]][1]))
            if b_shape[:len(stack)] != stack or math.prod(b_shape[len(stack):]) != d_out:
                raise ValueError(
                    f"K-FAC layer {where}: bias {label(bias_names)} has shape {b_shape}, "
                    f"expected {stack} followed by axes of total size {d_out}.")
            if bias_names in claimed:
                raise ValueError(f"K-FAC: bias {label(bias_names)} is claimed by two "
                                 f"kernels, {claimed[bias_names]} and {where}.")
            claimed[bias_names] = where
            bias = index[bias_names]
        else:
            raise ValueError(
                f"K-FAC layer {where}: kernel {k_shape} does not fit factors a {a_shape}, "
                f"g {g_shape}: expected {d_out}·{a_dim} (no bias) or {d_out}·{a_dim - 1} "
                "(bias) elements per stacked layer.")
        prefix_sizes = {math.prod(rest[:j]) for j in range(len(rest) + 1)}
        if d_in not in prefix_sizes:
            raise ValueError(
                f"K-FAC layer {where}: the kernel axes {rest} cannot be split into leading "
                f"axes of size {d_in} (inputs) and trailing axes of size {d_out} (outputs).")
        blocks.append(Block(names, index[names], bias, stack, d_in, d_out, a_shape, g_shape,
                            None if axes is None else tuple(axes)))
    return blocks


def default_specs(entries: list[tuple[Names, Any]], bias_name: str):
    shapes = {names: np.shape(leaf) for names, leaf in entries if not is_masked(leaf)}
    specs = {}
    for names, shape in shapes.items():
        if names and names[-1] == "kernel" and len(shape) == 2:
            d_in, d_out = shape
            has_bias = shapes.get((*names[:-1], bias_name)) == (d_out,)
            a_dim = d_in + 1 if has_bias else d_in
            specs[names] = ((a_dim, a_dim), (d_out, d_out))
    return specs


def template_specs(layers: Any, entries: list[tuple[Names, Any]]):
    masked = {names for names, leaf in entries if is_masked(leaf)}
    return {names: (tuple(np.shape(c.a)), tuple(np.shape(c.g)), c.kernel_axes)
            for names, c in flatten_curvature(layers, "layers").items()
            if names not in masked}


def match_curvature(curvature: Any, blocks: list[Block],
                     entries: list[tuple[Names, Any]]) -> list[LayerCurvature]:
    given = flatten_curvature(curvature, "curvature")
    by_name = {b.names: b for b in blocks}
    masked = {names for names, leaf in entries if is_masked(leaf)}
    params = {names for names, leaf in entries if not is_masked(leaf)}
    for names in given:
        if names in by_name or names in masked:
            continue
        if names in params:
            raise ValueError(
                f"curvature given for {label(names)}, which this K-FAC transform does not "
                "precondition (pass layers=... to choose the layers).")
        raise ValueError(f"curvature given for {label(names)}: no such parameter.")
    out = []
    for b in blocks:
        if b.names not in given:
            raise ValueError(
                f"curvature has no LayerCurvature for the K-FAC layer {label(b.names)}, "
                "which this transform preconditions: the statistics did not capture it "
                "(kfac.describe(loss_fn, params, *batch) says why; value_grad_and_stats("
                "..., layers=[...]) raises then), or layers= names a kernel it should not.")
        c = given[b.names]
        if tuple(np.shape(c.a)) != b.a_shape or tuple(np.shape(c.g)) != b.g_shape:
            raise ValueError(
                f"curvature for {label(b.names)}: a {np.shape(c.a)} and g {np.shape(c.g)}, "
                f"expected {b.a_shape} and {b.g_shape} (for captured kernels, build layers= "
                "with jax.eval_shape of curvature_from_stats).")
        if c.kernel_axes != b.kernel_axes:
            raise ValueError(
                f"curvature for {label(b.names)} follows the kernel axes {c.kernel_axes}, "
                f"the transform was initialised with {b.kernel_axes} (None: the kernel's "
                "own order): build layers= with jax.eval_shape of curvature_from_stats.")
        out.append(LayerCurvature(jnp.asarray(c.a, jnp.float32), jnp.asarray(c.g, jnp.float32),
                                  b.kernel_axes))
    return out


def layers_from_params(params: Any, paths: Any = None, *, bias_name: str = "bias") -> dict:
    """A `scale_by_kfac` ``layers`` template from the params' shapes.

    Each named kernel is read as ``(*stack, d_in, d_out)``: its last two axes are the
    layer, any leading axes a stack of independent layers (MoE experts ``(E, d_in,
    d_out)``); a bias sibling of ``stack + (d_out,)`` elements adds the homogeneous
    coordinate. (For kernels whose ``d_in`` or ``d_out`` spans several axes, e.g.
    ``nnx.Einsum``, use ``jax.eval_shape(curvature_from_stats, stats)`` instead.)

    Args:
      params: the params (arrays or ``ShapeDtypeStruct``; masked leaves are skipped).
      paths: kernel paths (``"blocks/0/moe/experts/w_fc"``) to include; default: every
        leaf named ``"kernel"`` with at least two axes.
      bias_name: key of a kernel's bias sibling.

    Returns:
      ``{path: LayerCurvature(a, g)}`` of ``jax.ShapeDtypeStruct`` (float32).

    Raises:
      ValueError: a path that is not a params leaf, or a leaf with fewer than two axes.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import layers_from_params
      >>> p = {"experts": {"w": jnp.zeros((4, 8, 16))}, "d": {"kernel": jnp.zeros((8, 3)),
      ...      "bias": jnp.zeros(3)}}
      >>> t = layers_from_params(p, ["experts/w", "d/kernel"])
      >>> t["experts/w"].a.shape, t["experts/w"].g.shape, t["d/kernel"].a.shape
      ((4, 8, 8), (4, 16, 16), (9, 9))
    """
    entries, _ = flatten_params(params)
    shapes = {label(n): tuple(np.shape(leaf)) for n, leaf in entries if not is_masked(leaf)}
    masked = {label(n) for n, leaf in entries if is_masked(leaf)}
    if paths is None:
        wanted = [p for p, s in shapes.items() if p.split("/")[-1] == "kernel" and len(s) >= 2]
    else:
        wanted = [p for p in paths if p not in masked]
    out = {}
    for path in wanted:
        if path not in shapes:
            raise ValueError(f"layers_from_params: {path} is not a params leaf.")
        shape = shapes[path]
        if len(shape) < 2:
            raise ValueError(f"layers_from_params: {path} has shape {shape}; expected "
                             "(*stack, d_in, d_out).")
        *stack, d_in, d_out = shape
        bias = shapes.get("/".join([*path.split("/")[:-1], bias_name]))
        has_bias = (bias is not None and tuple(bias[:len(stack)]) == tuple(stack)
                    and math.prod(bias[len(stack):]) == d_out)
        a = d_in + int(has_bias)
        f32 = jnp.float32
        out[path] = LayerCurvature(jax.ShapeDtypeStruct((*stack, a, a), f32),
                                   jax.ShapeDtypeStruct((*stack, d_out, d_out), f32))
    return out
