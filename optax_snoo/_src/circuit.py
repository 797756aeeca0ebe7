"""Circuit-Muon's OV coupling: per-head partner scalars and a trace-only gauge rebalance
on each attention layer's value/output pair (modded-nanogpt Track 3 result #41).

Through one head ``h`` the residual-to-residual map is ``M_h = W_O,h W_V,h`` (the head's
rows of the value projection, its columns of the output projection). The transform takes
the two legs' update directions ``dV, dO`` (e.g. Muon's orthogonalised momenta) and, per
layer, with ``hd`` the head width and ``lam`` the damping:

1. partner scalars from the current weights (no state, no parameters):
   ``s_V[h] = 1 / sqrt(||W_V,h||^2 / hd + lam)``, ``s_O[h]`` likewise;
2. partner post-whitening that keeps each leg's total norm: ``dV_h *= s_O[h]``,
   ``dO_h *= s_V[h]``, then ``dV *= ||dV_before|| / ||dV||`` (one factor for all heads) and
   the same for ``dO``;
3. the trace-only gauge rebalance: ``x_h = (<W_V,h, dV_h> - <W_O,h, dO_h>) /
   (||W_V,h||^2 + ||W_O,h||^2 + 2 hd lam)``, ``dV_h -= x_h W_V,h``, ``dO_h += x_h W_O,h``.

Step 3 moves the update along the gauge orbit ``(W_V, W_O) -> (r W_V, W_O / r)`` of each
head (under which ``M_h`` is unchanged) so that, to first order, the step does not change
the per-head trace gap ``||W_V,h||^2 - ||W_O,h||^2`` (damped by ``2 hd lam``). It changes
the update only: the weights move by whatever the rest of the chain makes of it.

Reference: liyang2019, modded-nanogpt Track 3 result #41, Circuit-Muon
(records/track_3_optimization/results/20260523_circuit_muon;
https://github.com/KellerJordan/modded-nanogpt/pull/311), 2026.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.labels import by_path
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    path_to_str,
    state_dtype,
)

__all__ = ["OVHeads", "circuit_ov_heads", "scale_by_circuit_ov"]

_ROLES = ("value", "output")
# The record's guard on its norms and denominators (circuit_muon's clamp_min(1e-12)).
_TINY = 1e-12


class OVHeads(NamedTuple):
    """How one parameter leaf holds the value or output heads of an attention layer.

    The leaf is a matrix, or a stack of matrices over leading axes (a scanned model's
    layers, each its own circuit). Head ``h`` occupies entries ``[h * hd, (h + 1) * hd)``
    of ``axis``, one of the last two, ``hd = shape[axis] // num_heads``; its block is
    those entries times the whole other matrix axis. A Flax value kernel ``(D, N*hd)``
    has ``axis=-1``, an output kernel ``(N*hd, D)`` ``axis=-2`` (PyTorch's ``(out, in)``
    weights: -2 and -1).

    Attributes:
      layer: the attention layer's name; a layer's value and output leaves share it.
      role: ``"value"`` or ``"output"``.
      num_heads: heads stored in this leaf.
      axis: the axis holding the heads (one of the last two).
    """

    layer: str
    role: str
    num_heads: int
    axis: int = -1


HeadsTree = Any  # a tree with the params' structure, leaves `OVHeads` or None


def _is_heads_leaf(x: Any) -> bool:
    return x is None or isinstance(x, OVHeads)


def _pairs(marked: list[tuple[str, OVHeads | None, tuple[int, ...]]]
           ) -> dict[str, tuple[int, int]]:
    """``{layer: (value index, output index)}`` of the marked leaves, checked."""
    found: dict[str, dict[str, list[int]]] = {}
    for i, (path, h, shape) in enumerate(marked):
        if h is None:
            continue
        if h.role not in _ROLES:
            raise ValueError(f"OVHeads of {path!r}: role must be one of {_ROLES}, got "
                             f"{h.role!r}.")
        check_int_at_least(f"OVHeads.num_heads of {path!r}", h.num_heads, 1)
        if len(shape) < 2:
            raise ValueError(f"OVHeads of {path!r}: the leaf must be a matrix (or a stack "
                             f"of matrices), got shape {shape}.")
        if not -len(shape) <= h.axis < len(shape) or h.axis % len(shape) < len(shape) - 2:
            raise ValueError(f"OVHeads of {path!r}: axis={h.axis} must be one of the last "
                             f"two axes of a parameter of shape {shape}.")
        if shape[h.axis] % h.num_heads:
            raise ValueError(f"OVHeads of {path!r}: num_heads={h.num_heads} does not divide "
                             f"axis {h.axis} of size {shape[h.axis]} (shape {shape}).")
        found.setdefault(h.layer, {"value": [], "output": []})[h.role].append(i)
    pairs = {}
    for layer, by_role in found.items():
        for role in _ROLES:
            if len(by_role[role]) != 1:
                raise ValueError(f"Circuit OV layer {layer!r} has {len(by_role[role])} "
                                 f"{role} leaves; expected exactly one value and one output "
                                 f"leaf per layer.")
        (v,), (o,) = by_role["value"], by_role["output"]
        (pv, hv, sv), (po, ho, so) = marked[v], marked[o]
        if sv[:-2] != so[:-2]:
            raise ValueError(f"Circuit OV layer {layer!r}: the value leaf {pv!r} {sv} and "
                             f"the output leaf {po!r} {so} stack different leading axes.")
        if hv.num_heads != ho.num_heads or sv[hv.axis] != so[ho.axis]:
            raise ValueError(f"Circuit OV layer {layer!r}: the value leaf {pv!r} holds "
                             f"{hv.num_heads} heads in {sv[hv.axis]} entries and the output "
                             f"leaf {po!r} {ho.num_heads} in {so[ho.axis]}; each head needs "
                             f"one value and one output block of the same width.")
        pairs[layer] = (v, o)
    return pairs


def _heads_last(h: OVHeads, ndim: int) -> bool:
    return h.axis % ndim == ndim - 1


def _by_head(x: jax.Array, h: OVHeads) -> jax.Array:
    """``(..., H, hd, D)``: head ``n``'s block at ``[..., n, :, :]``."""
    if _heads_last(h, x.ndim):
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape(*x.shape[:-2], h.num_heads, -1, x.shape[-1])


def _from_heads(x: jax.Array, h: OVHeads, shape: tuple[int, ...]) -> jax.Array:
    x = x.reshape(*x.shape[:-3], -1, x.shape[-1])
    return jnp.swapaxes(x, -1, -2) if _heads_last(h, len(shape)) else x


def circuit_ov_update(u_v: jax.Array, u_o: jax.Array, w_v: jax.Array, w_o: jax.Array,
                      heads_v: OVHeads, heads_o: OVHeads, damping: Any
                      ) -> tuple[jax.Array, jax.Array]:
    """One layer's coupled directions ``(dV', dO')`` (the module docstring's steps 1-3),
    computed in float32 (float64 for float64 inputs) and cast to the updates' dtypes."""
    dt = jnp.promote_types(state_dtype(None, w_v), state_dtype(None, u_v))
    wv, wo = _by_head(w_v.astype(dt), heads_v), _by_head(w_o.astype(dt), heads_o)
    uv, uo = _by_head(u_v.astype(dt), heads_v), _by_head(u_o.astype(dt), heads_o)
    hd = wv.shape[-2]
    lam = jnp.asarray(damping, dt)
    per_head = lambda a, b: jnp.sum(a * b, axis=(-2, -1), keepdims=True)  # (..., H, 1, 1)
    # each layer's norm over all its heads
    norm = lambda a: jnp.sqrt(jnp.sum(a * a, axis=(-3, -2, -1), keepdims=True))
    sq_v, sq_o = per_head(wv, wv), per_head(wo, wo)
    s_v = jax.lax.rsqrt(jnp.maximum(sq_v / hd + lam, _TINY))
    s_o = jax.lax.rsqrt(jnp.maximum(sq_o / hd + lam, _TINY))
    n_v, n_o = norm(uv), norm(uo)
    uv, uo = uv * s_o, uo * s_v  # each leg by its partner's scalar
    uv = uv * (n_v / jnp.maximum(norm(uv), _TINY))
    uo = uo * (n_o / jnp.maximum(norm(uo), _TINY))
    x = ((per_head(wv, uv) - per_head(wo, uo))
         / jnp.maximum(sq_v + sq_o + 2.0 * hd * lam, _TINY))
    uv, uo = uv - x * wv, uo + x * wo
    return (_from_heads(uv, heads_v, w_v.shape).astype(u_v.dtype),
            _from_heads(uo, heads_o, w_o.shape).astype(u_o.dtype))


def scale_by_circuit_ov(
    heads: HeadsTree | Callable[[optax.Params], HeadsTree],
    damping: float = 1e-3,
) -> optax.GradientTransformationExtraArgs:
    """Circuit-Muon's OV coupling of each attention layer's value and output updates.

    Per layer and head: partner post-whitening by the other leg's scalar
    ``1 / sqrt(||W_h||^2 / hd + damping)`` with each leg's total norm kept, then the
    trace-only gauge rebalance ``dV_h -= x_h W_V,h``, ``dO_h += x_h W_O,h`` (the module
    docstring has the formulas). Stateless; the partner scalars are functions of the
    current weights, not parameters or optimizer state. It changes the update only.

    Place it where record #41 does: after the transform that makes each leg's direction
    (Muon's orthogonalisation and what follows it) and before the step-size controls
    (`optax_snoo.radius_steps`: the radial brake, the u/w floor, the lr, the radius pin).
    The map is odd and homogeneous of degree 1 in the two updates together, so a plain
    learning rate may come before or after it. Leaves not marked by ``heads`` keep their
    update exactly.

    Differences from the record: its directions are bfloat16 (Newton-Schulz output), so
    its per-head products and the renormalisation round to bfloat16; here the whole
    computation is float32 (float64 for float64 params) and cast back to the update's
    dtype once. The record's ``1e-12`` guards on the norms and denominators are kept.

    Args:
      heads: a tree with the params' structure whose leaves are `OVHeads` (a leaf holding
        one layer's value or output heads) or ``None`` (left alone), or a function
        ``params -> tree`` such as `circuit_ov_heads`. Each marked layer needs exactly one
        value and one output matrix (or two stacks over the same leading axes, each
        matrix its own circuit), with the same heads of the same width (grouped-query
        value projections, with fewer value than output heads, are not supported).
      damping: ``lam`` >= 0, the floor on each head's ``||W_h||^2 / hd`` (record #41:
        1e-3, its ``CIRCUIT_OV_DAMPING``); bounds the partner scalars at a zero-initialised
        output projection (``1 / sqrt(lam)``).

    Returns:
      An `optax.GradientTransformationExtraArgs` (stateless); ``update`` needs ``params``.

    Raises:
      ValueError: at construction for ``damping < 0``; at ``init``/trace time for a heads
        tree that does not match the params, a marked leaf with fewer than two axes or
        its heads outside the last two, value and output stacks of different leading
        axes, a layer
        without exactly one value and one output leaf, ``num_heads`` not dividing the
        heads' axis, or value and output heads of different counts or widths; at
        ``update`` without ``params``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import circuit_ov_heads, scale_by_circuit_ov
      >>> k = jax.random.split(jax.random.key(0), 4)
      >>> params = {"attn": {"c_v": {"kernel": jax.random.normal(k[0], (8, 8))},
      ...                    "c_proj": {"kernel": jax.random.normal(k[1], (8, 8))}}}
      >>> u = {"attn": {"c_v": {"kernel": jax.random.normal(k[2], (8, 8))},
      ...               "c_proj": {"kernel": jax.random.normal(k[3], (8, 8))}}}
      >>> tx = scale_by_circuit_ov(circuit_ov_heads(num_heads=2), damping=0.0)
      >>> d, _ = tx.update(u, tx.init(params), params)
      >>> # without damping the step keeps each head's trace gap to first order
      >>> wv, wo = params["attn"]["c_v"]["kernel"], params["attn"]["c_proj"]["kernel"]
      >>> dv, do = d["attn"]["c_v"]["kernel"], d["attn"]["c_proj"]["kernel"]
      >>> gap = ((wv * dv).reshape(8, 2, 4).sum((0, 2))
      ...        - (wo * do).reshape(2, 4, 8).sum((1, 2)))
      >>> bool(jnp.allclose(gap, 0.0, atol=1e-4))
      True

    References:
      liyang2019, `modded-nanogpt Track 3 result #41, Circuit-Muon
      (records/track_3_optimization/results/20260523_circuit_muon, its log's circuit_muon;
      PR 311) <https://github.com/KellerJordan/modded-nanogpt/pull/311>`_, 2026.
    """
    if callable(damping):
        raise ValueError(f"damping must be a number (not a schedule), got {damping!r}.")
    check_non_negative("damping", damping)

    def marked_leaves(params: optax.Params) -> list[tuple[str, OVHeads | None, tuple]]:
        tree = heads(params) if callable(heads) else heads
        paths_leaves, treedef = jax.tree.flatten_with_path(params)
        try:
            heads_leaves = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"scale_by_circuit_ov: heads must have the params' structure "
                             f"(leaves OVHeads or None): {err}") from None
        out = []
        for (path, p), h in zip(paths_leaves, heads_leaves, strict=True):
            if not _is_heads_leaf(h):
                raise ValueError(f"scale_by_circuit_ov: heads of {path_to_str(path)!r} must "
                                 f"be an OVHeads or None, got {h!r}.")
            out.append((path_to_str(path), h, tuple(p.shape)))
        return out

    def init_fn(params):
        _pairs(marked_leaves(params))
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scale_by_circuit_ov needs params (its scalars and gauge "
                             "direction are the current weights).")
        marked = marked_leaves(params)
        pairs = _pairs(marked)
        u_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        new = list(u_leaves)
        for v, o in pairs.values():
            new[v], new[o] = circuit_ov_update(u_leaves[v], u_leaves[o], p_leaves[v],
                                               p_leaves[o], marked[v][1], marked[o][1],
                                               damping)
        return jax.tree.unflatten(treedef, new), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def circuit_ov_heads(
    num_heads: int,
    *,
    value: str = r"attn/c_v/kernel$",
    output: str = r"attn/c_proj/kernel$",
    value_axis: int = -1,
    output_axis: int = -2,
) -> Callable[[optax.Params], HeadsTree]:
    """The `OVHeads` tree of a model whose value and output kernels are found by path.

    Each leaf's path is written as ``"blocks/0/attn/c_v/kernel"``
    (`optax_snoo.labels.path_to_str`); ``value`` and ``output`` are regular expressions
    searched in it, and a leaf's layer is the part of its path before the match, so a
    layer's two leaves pair when their prefixes agree (record #41 paired ``<block>.attn.v``
    with ``<block>.attn.proj`` the same way). The defaults fit this repository's models
    (Flax kernels ``(D, N*hd)`` and ``(N*hd, D)``, or their stacks over a scanned model's
    layers); for PyTorch-layout ``(out, in)`` weights use ``value_axis=-2,
    output_axis=-1``.

    Args:
      num_heads: heads of every matched layer (value and output alike).
      value: regex of the value kernels.
      output: regex of the output kernels (keep it from matching an MLP's ``c_proj``).
      value_axis: the axis holding the heads in a value kernel.
      output_axis: the axis holding the heads in an output kernel.

    Returns:
      A function ``params -> heads tree`` for `scale_by_circuit_ov`.

    Raises:
      ValueError: at construction for a bad pattern or head count; when called, if no
        leaf matches ``value``.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"attn": {"c_v": {"kernel": jnp.zeros((8, 8))},
      ...                    "c_proj": {"kernel": jnp.zeros((8, 8))}}}
      >>> circuit_ov_heads(2)(params)["attn"]["c_proj"]["kernel"]
      OVHeads(layer='', role='output', num_heads=2, axis=-2)

    References:
      liyang2019, `modded-nanogpt Track 3 result #41, Circuit-Muon
      (records/track_3_optimization/results/20260523_circuit_muon; PR 311)
      <https://github.com/KellerJordan/modded-nanogpt/pull/311>`_, 2026.
    """
    check_int_at_least("num_heads", num_heads, 1)
    try:
        rules = by_path([(value, ("value", value_axis)), (output, ("output", output_axis))],
                        default=None, what="circuit_ov_heads pattern")
    except ValueError as err:
        raise ValueError(f"circuit_ov_heads: invalid pattern: {err}") from None

    def heads_fn(params: optax.Params) -> HeadsTree:
        tree = rules.by_prefix(params, lambda layer, role_axis: OVHeads(
            layer, role_axis[0], num_heads, role_axis[1]))
        if not any(isinstance(h, OVHeads) and h.role == "value"
                   for h in jax.tree.leaves(tree, is_leaf=_is_heads_leaf)):
            raise ValueError(f"circuit_ov_heads: no parameter path matches the value pattern "
                             f"{value!r}.")
        return tree

    return heads_fn
