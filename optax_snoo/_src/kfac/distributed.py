"""The K-FAC refresh of all layers at once, split over the devices of a mesh.

A refresh eigendecomposes every factor: ``A`` and ``G`` of every layer, one matrix per
expert of a stack. `refresh_all` gathers the factors into groups of equal size
``(K, d, d)`` (all layers and experts together), and, on a mesh of ``N`` devices, pads
each group to a multiple of ``N`` and splits its stack axis over all the mesh's devices
(``jax.shard_map``): each device runs ``eigh`` (and, in ``"pi"`` mode, builds the damped
inverse ``Q diag(1/(s + shift)) Qᵀ``) on its ``K/N`` matrices only, then one
``all_gather`` per group makes the results replicated again. Per device that is the
total work divided by ``N``, plus at most one padded matrix per group. Without a mesh (or
with one device) the same grouped computation runs locally. The math is
`precondition.refresh_stack` (per matrix: the eigenvalue floor, the pi inverse, the
XLA:CPU one-matrix-at-a-time workaround) and `precondition.assemble_inverse` (the
`EigenInverse` scale), the same functions `optax_snoo.kfac.refresh_inverse` runs for one
layer.

The factors arrive replicated, or with their rows split over the batch axes
(`scale_by_kfac(stats_axes=...)`): the stack is made replicated first (an all-gather
of the row-split factors, on refresh steps only), then each device slices its share. kfac-jax splits
its inverse computations over (pmap) devices in the same way.

`precondition_split` applies a cached inverse to a gradient split over the same mesh
without gathering it: a product contracting the gradient's columns runs with its rows
split over all devices, one contracting its rows with its columns split, and the
partitioner moves the gradient between the two layouts with an all-to-all (each device
sends and receives its share), where replicated inverses and a sharded gradient would
otherwise gather the whole gradient on every device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.kfac.factors import LayerCurvature
from optax_snoo._src.kfac.precondition import (
    EigenInverse,
    PiInverse,
    SpectrumStats,
    assemble_inverse,
    check_mode,
    damping_shifts,
    refresh_stack,
)
from optax_snoo._src.sharding import axes_of, spec_entries

_HIGHEST = jax.lax.Precision.HIGHEST


def refresh_group(mats: jax.Array, shifts: jax.Array, mode: str, floor_abs: float,
                  floor_rel: float, mesh: Any = None) -> tuple[jax.Array, ...]:
    """Refresh ``K`` equal-size matrices ``(K, d, d)``, split over ``mesh`` if given.

    Returns ``(out, s, stats)``: ``out`` ``(K, d, d)`` the eigenvectors (eigen) or damped
    inverses (pi), ``s`` ``(K, d)`` the floored eigenvalues, ``stats`` ``(K, 3)`` the raw
    max, min and number of floored eigenvalues of each matrix; all replicated.
    """
    if mesh is None or mesh.size == 1:
        return refresh_stack(mats, shifts, mode, floor_abs, floor_rel)
    n, k = mesh.size, mats.shape[0]
    pad = -k % n
    if pad:
        eye = jnp.broadcast_to(jnp.eye(mats.shape[-1], dtype=mats.dtype),
                               (pad, *mats.shape[1:]))
        mats = jnp.concatenate([mats, eye])
        shifts = jnp.concatenate([shifts, jnp.ones((pad,), shifts.dtype)])
    axes = tuple(mesh.axis_names)

    def body(mats, shifts):
        out = refresh_stack(mats, shifts, mode, floor_abs, floor_rel)
        return tuple(jax.lax.all_gather(x, axes, tiled=True) for x in out)

    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        mats, shifts = jax.reshard(mats, P(axes)), jax.reshard(shifts, P(axes))
    else:
        # Replicated going in (each device then slices its share locally), so the
        # partitioner does not shard the concatenation and gather it back.
        mats, shifts = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
                        for x in (mats, shifts))
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(),
                        check_vma=False)(mats, shifts)
    return tuple(x[:k] for x in out)


def refresh_all(
    factors: list[LayerCurvature],
    damping: jax.Array | float,
    mode: str = "pi",
    eig_floor_abs: float = 1e-8,
    eig_floor_rel: float = 1e-6,
    mesh: Any = None,
) -> tuple[list[EigenInverse | PiInverse], list[SpectrumStats]]:
    """`refresh_inverse` of every layer, grouped by factor size, split over ``mesh``.

    Args:
      factors: the layers' factors, ``a`` ``(*stack, da, da)``, ``g`` ``(*stack, dg, dg)``.
      damping: λ >= 0.
      mode: ``"pi"`` or ``"eigen"``.
      eig_floor_abs: absolute eigenvalue floor.
      eig_floor_rel: floor relative to each matrix's own largest eigenvalue.
      mesh: a ``jax.sharding.Mesh`` (or abstract mesh) to split the eigendecompositions
        over all its devices; ``None``: every matrix here.

    Returns:
      ``(inverses, stats)``: per layer the `PiInverse` / `EigenInverse` and
      `SpectrumStats` that `refresh_inverse` returns for it.
    """
    check_mode(mode)
    damping = jnp.asarray(damping, jnp.float32)
    # Every matrix: (layer, "a"/"g", its flattened stack), with its damping shift.
    groups: dict[int, list[tuple[int, str, jax.Array, jax.Array]]] = {}
    for i, f in enumerate(factors):
        a, g = f.a.astype(jnp.float32), f.g.astype(jnp.float32)
        for kind, m, shift in zip("ag", (a, g), damping_shifts(a, g, damping), strict=True):
            d = m.shape[-1]
            stack = math.prod(m.shape[:-2])
            shift = jnp.broadcast_to(shift, m.shape[:-2]).reshape(stack)
            groups.setdefault(d, []).append((i, kind, m.reshape(stack, d, d), shift))
    results: dict[tuple[int, str], tuple[jax.Array, ...]] = {}
    for d in sorted(groups):
        members = groups[d]
        mats = jnp.concatenate([m for _, _, m, _ in members])
        shifts = jnp.concatenate([s for _, _, _, s in members])
        out = refresh_group(mats, shifts, mode, eig_floor_abs, eig_floor_rel, mesh)
        start = 0
        for i, kind, m, _ in members:
            results[(i, kind)] = tuple(x[start:start + m.shape[0]] for x in out)
            start += m.shape[0]
    pairs = [assemble_inverse(results[(i, "a")], results[(i, "g")], f.a.shape, f.g.shape,
                              damping, mode) for i, f in enumerate(factors)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def split_layouts(sharding: Any, d_in: int, d_out: int) -> tuple[P, P, P] | None:
    """The layouts `precondition_split` moves a 2-D kernel's gradient through.

    With ``s_in``, ``s_out`` the mesh axes splitting the kernel's rows and columns, ``rest``
    the others (all of size > 1) and ``order = s_in + s_out + rest``: ``rows`` splits the
    ``(d_in, d_out)`` matrix's rows over ``order``, ``cols`` its columns over ``order``, and
    ``mid`` is the kernel's own sharding with ``rest`` added to its columns (a local
    slice of it). Each of ``rows`` and ``cols`` is one all-to-all from ``mid`` and from
    each other (the same device order), which the partitioner finds; it does not find a
    direct move from a layout that replicates over ``rest``.

    Returns:
      ``(rows, cols, mid)``; None when the kernel is not split at all (a replicated
      gradient is cheaper to precondition where it is) or a dimension does not divide
      by the device count.
    """
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    sizes = mesh.shape
    big = lambda axes: tuple(a for a in axes if sizes[a] > 1)
    spec = spec_entries(sharding, 2)
    s_in, s_out = big(axes_of(spec[0])), big(axes_of(spec[1]))
    if not s_in + s_out:
        return None
    rest = big(a for a in mesh.axis_names if a not in axes_of(spec[0]) + axes_of(spec[1]))
    order = s_in + s_out + rest
    n = math.prod(sizes[a] for a in order)
    if d_in % n or d_out % n:
        return None
    return P(order, None), P(None, order), P(s_in or None, (s_out + rest) or None)


def precondition_split(inverse: EigenInverse | PiInverse, grad_w: jax.Array,
                       grad_b: jax.Array | None, sharding: NamedSharding,
                       layouts: tuple[P, P, P]) -> tuple[jax.Array, jax.Array | None]:
    """`apply_inverse` on ``[grad_w; grad_bᵀ]``, each product where its contraction is whole.

    pi: ``Â⁻¹ (X Ĝ⁻¹)``; eigen: ``(Q_A [(Q_Aᵀ (X Q_G)) ⊙ S]) Q_Gᵀ`` (the products of
    `apply_inverse`, associated so that a column product comes first). ``X M`` runs in the
    ``rows`` layout (the bias row, a vector, replicated), the products on the left in the
    ``cols`` layout (`split_layouts`): an all-to-all into the first, one between them
    (two in eigen mode) and one back, each moving a device's share, then an all-gather
    over the axes that replicate the kernel; no gathered gradient.

    Args:
      inverse: the layer's cached inverse (no stack axes; replicated).
      grad_w: the kernel gradient ``(d_in, d_out)``, float32.
      grad_b: the bias gradient ``(d_out,)`` when the factors include it, else None.
      sharding: the kernel's sharding (the result's).
      layouts: `split_layouts` of it.

    Returns:
      ``(out_w, out_b)``: the preconditioned kernel and bias gradients (float32).
    """
    mesh = sharding.mesh
    explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

    def put(spec: Any) -> Any:
        target = spec if isinstance(spec, NamedSharding) else NamedSharding(mesh, spec)
        if explicit:
            return lambda x: jax.reshard(x, target)
        return lambda x: jax.lax.with_sharding_constraint(x, target)

    rows, cols, mid = (put(spec) for spec in layouts)
    whole, own = put(P()), put(sharding)
    mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)
    d_in = grad_w.shape[0]
    w = rows(mid(grad_w))
    b = None if grad_b is None else whole(grad_b[None, :])

    def times(m: jax.Array) -> jax.Array:
        """``X m`` in the cols layout: each row block where it lives, then joined."""
        out = cols(rows(mm(w, m)))
        if b is None:
            return out
        return cols(jnp.concatenate([out, cols(mm(b, m))], axis=0))

    if isinstance(inverse, EigenInverse):
        x = times(inverse.q_g)
        v = cols(mm(inverse.q_a, cols(mm(inverse.q_a.T, x) * inverse.scale)))
        # (a slice constrained where it is taken: else the partitioner moves the whole
        # matrix first and then shifts rows between neighbours to slice it)
        out_w = rows(mm(rows(cols(v[:d_in])), inverse.q_g.T))
        out_b = None if b is None else mm(whole(v[d_in:]), inverse.q_g.T)[0]
    else:
        y = cols(mm(inverse.a_inv, times(inverse.g_inv)))
        out_w, out_b = cols(y[:d_in]), (None if b is None else y[d_in])
    return own(mid(out_w)), out_b
