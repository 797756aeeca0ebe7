"""Newton-Schulz on sharded params: whole matrices to devices, no collectives in the loop.

Left to the SPMD partitioner, a Newton-Schulz iteration on a row- or column-sharded matrix
splits the matmul FLOPs but gathers the whole matrix for each of its three products in
every iteration. The plan here instead gives each device whole matrices:

1. every Muon leaf becomes a stack ``(B, rows, cols)`` with ``rows <= cols`` (matrix axes
   moved last, transposed when tall, as the single-device iteration does; square
   matrices whose shardings are each other's transpose join the larger of the two groups
   transposed, and are transposed back on their device once whole, so every matrix
   iterates in its own orientation (``NS(Xᵀ) = NS(X)ᵀ`` in real arithmetic only: the
   transposed products round differently, 2e-6 relative in float32 on 512x512, 1.5% in
   bfloat16);
2. stacks with the same shape and the same sharding of their matrix axes are
   concatenated into one group and padded with zero matrices to a multiple of the device
   count N (a zero matrix orthogonalises to zero);
3. in one ``jax.shard_map`` over the group's own sharding, each device keeps its slice
   of the stack along the mesh axes that replicate the matrices (a local slice), and one
   all-to-all over the axes that split the matrices trades pieces, so that every device
   holds ``S/N`` whole matrices (the flattened mesh: axes splitting the stack, then
   replicating axes, then row axes, then column axes);
4. the batched iteration runs on them, so the loop holds no collective;
5. the all-to-all is reversed and, where axes replicate the matrices, the slices are
   all-gathered (every replica needs every result); the stack is sliced into the
   leaves, constrained to each leaf's sharding.

Per device and step, with ``s`` its padded share of the group's params and ``K`` the
size of the replicating axes: ``s/K`` in, ``s/K`` back, plus ``s`` gathered when
``K > 1``: at most 2x the share.

Transfers are in the iteration dtype (the iteration casts to it first, and its output
is exactly representable in it), so bfloat16 Newton-Schulz moves half the bytes of
float32.
Per device, the FLOPs are ``ceil(S/N)`` matrices of each group: at most one matrix per
group above ``total / N``.

Leaves of unknown sharding (the update traced under ``jax.jit`` with Auto mesh axes, and
``init`` never saw concrete arrays: it ran under ``jax.jit`` / ``jax.eval_shape``, or
``optax.inject_hyperparams`` rebuilt the transform) are planned on a mesh given by the
caller (``mesh=`` or the ``jax.set_mesh`` context) as if their stack's rows (the shorter
matrix axis) were split over all its devices, FSDP's layout: shard_map's in and out specs
say so, XLA inserts the conversion from (and back to) wherever the leaves actually live
(none when they are laid out so), and the plan above runs. Splitting the stack axis
instead would be free going in but not coming out: XLA turns a slice of a stack split
over devices into a row-sharded leaf by replicating the whole stack (measured: 16x the
share). Leaves whose rows do not divide by the device count keep the per-leaf path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.sharding import axes_of, concrete_sharding, is_split, spec_entries
from optax_snoo._src.utils import path_to_str

__all__ = ["Group", "NewtonSchulzPlan", "Placement", "describe_leaf", "from_stack",
           "orthogonalize_leaves", "orthogonalize_sharded", "place_leaves", "plan_groups",
           "to_stack"]


@dataclasses.dataclass(frozen=True)
class NewtonSchulzPlan:
    """Where Muon's leaves live, decided once, for `scale_by_muon(newton_schulz_plan=)`.

    Under ``jax.jit`` on Auto mesh axes an update sees tracers whose type carries no
    sharding, so the plan says where each leaf lives. Build it with
    `NewtonSchulzPlan.from_params` from the params (concrete arrays, or
    `jax.ShapeDtypeStruct` s carrying shardings), or from a tree of their
    `NamedSharding` s (the ``out_shardings`` a jitted init is given), or as
    ``NewtonSchulzPlan(mesh=mesh)`` to split every leaf of
    unknown sharding over ``mesh`` as FSDP lays it out (rows over all devices).

    Attributes:
      shardings: leaf path (``"blocks/0/attn/c_q/kernel"``, see
        `optax_snoo.labels`) -> the leaf's `NamedSharding`, or None for a leaf that stays
        whole (replicated, or on one device). A leaf not listed has unknown sharding.
      mesh: the mesh to split leaves of unknown sharding over; None: the ``jax.set_mesh``
        context of the update, if any (else the partitioner decides for them).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import NewtonSchulzPlan, scale_by_muon
      >>> params = {"w": jnp.ones((8, 16))}
      >>> plan = NewtonSchulzPlan.from_params(params)
      >>> plan.shardings  # one device: the leaf stays whole
      {'w': None}
      >>> tx = scale_by_muon(newton_schulz_plan=plan)
    """

    shardings: Mapping[str, NamedSharding | None] = dataclasses.field(default_factory=dict)
    mesh: Any = None

    @classmethod
    def from_params(cls, params: Any, mesh: Any = None) -> NewtonSchulzPlan:
        """The plan of `params`' leaves, read from their shardings.

        Args:
          params: the params (arrays, or `jax.ShapeDtypeStruct` s with shardings), or a
            tree of their `NamedSharding` s, with the params' paths.
          mesh: the mesh for leaves the plan does not list (see `NewtonSchulzPlan`).
        """
        return cls({path_to_str(path): _sharding_of(x)
                    for path, x in jax.tree_util.tree_leaves_with_path(params)}, mesh)


def _sharding_of(x: Any) -> NamedSharding | None:
    """A leaf's sharding on a multi-device mesh: the leaf may be the sharding itself."""
    if isinstance(x, NamedSharding):
        return x if x.mesh.size > 1 else None
    return concrete_sharding(x)


class Placement(NamedTuple):
    """What is known at update time about where one leaf lives."""

    sharding: NamedSharding | None   # the leaf's sharding when split over a mesh
    whole: bool                      # known to stay whole (one device, or replicated)
    unknown: bool                    # nothing known: a tracer the plan does not list


def place_leaves(plan: NewtonSchulzPlan, paths: Sequence[str],
                 arrays: Sequence[Sequence[Any]]) -> list[Placement]:
    """Each leaf's `Placement`, from its arrays (gradient, momentum...) and the plan.

    Concrete arrays (and tracers on Explicit axes) say where they are; other tracers
    take the plan's entry for their path. Leaves split over another mesh than the first
    one found keep the per-leaf path (one mesh per plan).
    """
    known = plan.shardings
    single = jax.device_count() == 1
    out = []
    for path, xs in zip(paths, arrays, strict=True):
        own = next((s for s in map(concrete_sharding, xs) if s is not None), None)
        traced = any(isinstance(x, jax.core.Tracer) for x in xs)
        if own is not None or not traced:
            out.append(Placement(own, own is None, False))
        elif path in known:
            out.append(Placement(known[path], known[path] is None, False))
        else:
            out.append(Placement(None, single, not single))
    meshes = [p.sharding.mesh for p in out if p.sharding is not None]
    return [p._replace(sharding=None) if p.sharding is not None and p.sharding.mesh != meshes[0]
            else p for p in out]


def _stacked(xs: Sequence[jax.Array], indices: Sequence[int], axes: Sequence[tuple[int, int]],
             newton_schulz: Callable[[jax.Array], jax.Array]) -> dict[int, jax.Array]:
    """`newton_schulz` on the leaves ``xs[indices]``, one batched iteration per shape.

    Each leaf becomes a stack ``(B, rows, cols)`` with ``rows <= cols`` (tall matrices
    transposed, exact since ``NS(Xᵀ) = NS(X)ᵀ``), same-shape stacks are concatenated and
    the results cut back into the leaves: one batched product per shape instead of one
    per matrix (benchmarks/README.md, "Trainer step throughput").
    """
    buckets: dict[tuple[int, int], list[Leaf]] = {}
    for i in indices:
        shape = tuple(xs[i].shape)
        leaf = describe_leaf(i, shape, axes[i], (None,) * len(shape))
        buckets.setdefault((leaf.rows, leaf.cols), []).append(leaf)
    out = {}
    for leaves in buckets.values():
        parts = [to_stack(xs[leaf.index], leaf) for leaf in leaves]
        o = newton_schulz(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
        start = 0
        for leaf in leaves:
            out[leaf.index] = from_stack(o[start:start + leaf.batch], leaf)
            start += leaf.batch
    return out


def _one_leaf(x: jax.Array, axes: tuple[int, int],
              newton_schulz: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The iteration on one leaf as it lies: the partitioner decides for it."""
    x = jnp.moveaxis(x, axes, (-2, -1))
    return jnp.moveaxis(newton_schulz(x), (-2, -1), axes)


def orthogonalize_leaves(xs: Sequence[jax.Array], axes: Sequence[tuple[int, int]],
                         placements: Sequence[Placement], *,
                         newton_schulz: Callable[[jax.Array], jax.Array], ns_dtype: Any,
                         mesh: Any = None, split: bool = True) -> list[jax.Array]:
    """Newton-Schulz on every leaf, each on the path its placement allows.

    - Leaves split over a mesh (and, when ``mesh`` or the ``jax.set_mesh`` context names
      one, leaves of unknown sharding): whole matrices to devices (`plan_groups`,
      `orthogonalize_sharded`), no collective inside the iteration.
    - Leaves known to stay whole, and leaves of unknown sharding when there is no mesh
      to split over: stacked by shape, one batched iteration per shape.
    - The rest (unknown sharding whose rows do not divide over the mesh, or
      ``split=False``): one iteration per leaf, left to the partitioner.

    Args:
      xs: the leaves (float32), matrix axes anywhere.
      axes: each leaf's normalised ``(fan_in, fan_out)`` axes.
      placements: from `place_leaves`.
      newton_schulz: the batched iteration on ``(..., rows, cols)``.
      ns_dtype: the iteration dtype (the transfers use it).
      mesh: the mesh for leaves of unknown sharding (None: the context's).
      split: whether to split over devices at all (``scale_by_muon``'s
        ``shard_newton_schulz``).

    Returns:
      The orthogonalised leaves, in order.
    """
    shardings = [p.sharding for p in placements]
    unknown = [p.unknown for p in placements]
    groups, local = [], list(range(len(xs)))
    spread = _split_mesh(shardings, unknown, mesh) if split else None
    if spread is not None:
        # Leaves of unknown sharding are split only over a mesh the caller named.
        named = mesh is not None or not jax.sharding.get_abstract_mesh().empty
        groups, local = plan_groups([x.shape for x in xs], axes, shardings, spread.size,
                                    unknown=unknown, mesh=spread if named else None)
    # Stacked where no partitioner splits them: whole leaves, replicated leaves of a split
    # mesh and, with no mesh anywhere, leaves of unknown sharding (taken to be on one
    # device, jit's common case); else a leaf of unknown sharding keeps its own iteration.
    assume_whole = split and spread is None
    stack = [i for i in local if placements[i].whole or shardings[i] is not None
             or (assume_whole and placements[i].unknown)]
    out = _stacked(xs, stack, axes, newton_schulz)
    out.update({i: _one_leaf(xs[i], axes[i], newton_schulz) for i in local if i not in out})
    if groups:
        out.update(orthogonalize_sharded(xs, groups, spread, shardings, newton_schulz, ns_dtype))
    return [out[i] for i in range(len(xs))]


def _split_mesh(shardings: Sequence[NamedSharding | None], unknown: Sequence[bool],
                mesh: Any) -> Any:
    """The mesh to split over: the known shardings' mesh; else, for leaves of unknown
    sharding, `mesh` or the context's; None when there is nothing to split over."""
    known = next((s.mesh for s in shardings if s is not None), None)
    if known is not None or not any(unknown):
        return known
    spread = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    return None if spread.empty or spread.size == 1 else spread


class Leaf(NamedTuple):
    """How one leaf becomes a stack ``(B, rows, cols)`` with rows <= cols."""

    index: int
    shape: tuple[int, ...]       # the leaf's shape
    axes: tuple[int, int]        # (fan_in axis, fan_out axis) of the leaf
    transpose: bool              # the matrix is transposed in the stack
    batch: int                   # B, the product of the leaf's other axes
    rows: int
    cols: int
    spec: tuple[Any, Any, Any]   # sharding of (B, rows, cols)


class Group(NamedTuple):
    """Same-shape stacks concatenated along their stack axis, padded to ``size``."""

    rows: int
    cols: int
    spec: tuple[Any, Any, Any]
    leaves: tuple[Leaf, ...]
    size: int                    # padded stack length, a multiple of the device count

    @property
    def count(self) -> int:
        return sum(leaf.batch for leaf in self.leaves)


def describe_leaf(index: int, shape: tuple[int, ...], axes: tuple[int, int],
                  entries: tuple[Any, ...]) -> Leaf:
    fan_in, fan_out = axes
    batch_axes = [a for a in range(len(shape)) if a not in axes]
    rows, cols = shape[fan_in], shape[fan_out]
    spec_r, spec_c = entries[fan_in], entries[fan_out]
    batch_entries = [entries[a] for a in batch_axes]
    # One sharded batch axis keeps its sharding in the stack; several are merged.
    spec_b = batch_entries[0] if len(batch_entries) == 1 else None
    transpose = rows > cols
    if transpose:
        rows, cols, spec_r, spec_c = cols, rows, spec_c, spec_r
    return Leaf(index, shape, axes, transpose, math.prod(shape[a] for a in batch_axes),
                rows, cols, (spec_b, spec_r, spec_c))


def _order(entry: Any) -> str:
    """A total order on spec entries (None first), to break ties deterministically."""
    return "" if entry is None else repr(entry)


def _merge_transposed_squares(buckets: dict[tuple[Any, ...], list[Leaf]]) -> None:
    """Move each square bucket whose matrix sharding is the transpose of a larger one's
    into it (its leaves transposed), so both orientations make one group."""
    for key in sorted(buckets, key=lambda k: (len(buckets[k]), _order(k[2]))):
        rows, cols, (spec_b, spec_r, spec_c) = key
        other = (rows, cols, (spec_b, spec_c, spec_r))
        if rows != cols or spec_r == spec_c or other not in buckets or key not in buckets:
            continue
        if (len(buckets[key]), _order(key[2])) > (len(buckets[other]), _order(other[2])):
            continue
        buckets[other] += [leaf._replace(transpose=not leaf.transpose, spec=other[2])
                           for leaf in buckets.pop(key)]


def plan_groups(shapes: Sequence[tuple[int, ...]], axes: Sequence[tuple[int, int]],
                shardings: Sequence[NamedSharding | None], num_devices: int, *,
                unknown: Sequence[bool] = (), mesh: Any = None
                ) -> tuple[list[Group], list[int]]:
    """Group the sharded leaves for `orthogonalize_sharded`.

    Args:
      shapes: each leaf's shape.
      axes: each leaf's normalised (fan_in, fan_out) axes.
      shardings: each leaf's `NamedSharding`, or None (unsharded, or unknown).
      num_devices: the number of devices of the mesh (N).
      unknown: per leaf, whether its sharding is unknown (default: none is).
      mesh: the mesh to split the stacks of unknown sharding over (whole matrices, the
        stack axis over all its axes of size > 1); None: they keep the per-leaf path.

    Returns:
      ``(groups, local)``: groups of same-shape, same-sharding stacks, each padded to a
      multiple of N, and the indices of the leaves that keep the per-leaf iteration
      (unsharded, or of unknown sharding without a mesh).
    """
    buckets: dict[tuple[Any, ...], list[Leaf]] = {}
    local = []
    unknown = tuple(unknown) or (False,) * len(shapes)
    spread = None if mesh is None else tuple(
        a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if n > 1)
    for i, (shape, ax, sharding) in enumerate(zip(shapes, axes, shardings, strict=True)):
        entries = None if sharding is None else spec_entries(sharding, len(shape))
        if unknown[i] and spread:
            # Assume FSDP's layout: the stack's rows (the shorter axis) over all devices.
            row_axis = ax[1] if shape[ax[0]] > shape[ax[1]] else ax[0]
            if shape[row_axis] % num_devices == 0:
                entries = tuple(spread if a == row_axis else None for a in range(len(shape)))
                sharding = NamedSharding(mesh, P(*entries))
        if entries is None or not is_split(entries, sharding.mesh):
            local.append(i)
            continue
        leaf = describe_leaf(i, tuple(shape), ax, entries)
        buckets.setdefault((leaf.rows, leaf.cols, leaf.spec), []).append(leaf)
    _merge_transposed_squares(buckets)
    groups = []
    for (rows, cols, spec), members in buckets.items():
        count = sum(m.batch for m in members)
        size = -(-count // num_devices) * num_devices
        groups.append(Group(rows, cols, spec, tuple(members), size))
    return groups, local


def to_stack(x: jax.Array, leaf: Leaf) -> jax.Array:
    x = jnp.moveaxis(x, leaf.axes, (-2, -1))
    if leaf.transpose:
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape((leaf.batch, leaf.rows, leaf.cols))


def from_stack(x: jax.Array, leaf: Leaf) -> jax.Array:
    fan_in, fan_out = leaf.axes
    moved = [d for a, d in enumerate(leaf.shape) if a not in leaf.axes]
    mat = (leaf.shape[fan_in], leaf.shape[fan_out])
    x = x.reshape((*moved, *(mat[::-1] if leaf.transpose else mat)))
    if leaf.transpose:
        x = jnp.swapaxes(x, -1, -2)
    return jnp.moveaxis(x, (-2, -1), leaf.axes)


def _local_newton_schulz(mesh: Any, spec: tuple[Any, Any, Any],
                         newton_schulz: Callable[[jax.Array], jax.Array], ns_dtype: Any,
                         wire: Any) -> Callable[[jax.Array], jax.Array]:
    """The per-device body for a stack of sharding ``spec``: whole matrices in, the
    iteration, pieces back, with explicit collectives.

    Each device holds a ``(S/H, rows/R, cols/C)`` block (H, R, C: the sizes of the mesh
    axes splitting the stack, the rows and the columns; the other axes, of total size
    K, replicate it). It keeps its K-th slice of the stack (a local slice), swaps
    pieces with the R*C devices holding the other pieces of the same matrices (one
    all-to-all), so that it holds ``S/(H K R C)`` whole matrices, runs the iteration,
    swaps back (one all-to-all) and gathers the slices over the replicating axes (one
    all-gather; none where nothing replicates).
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    used = axes_of(spec[0]) + axes_of(spec[1]) + axes_of(spec[2])
    rep = tuple(a for a in mesh.axis_names if a not in used and sizes[a] > 1)
    row_axes = tuple(a for a in axes_of(spec[1]) if sizes[a] > 1)
    col_axes = tuple(a for a in axes_of(spec[2]) if sizes[a] > 1)
    n_rep = math.prod(sizes[a] for a in rep)
    n_r, n_c = math.prod(sizes[a] for a in row_axes), math.prod(sizes[a] for a in col_axes)
    pieces = row_axes + col_axes

    def body(bits: jax.Array, flip: jax.Array) -> jax.Array:
        if rep:
            n = bits.shape[0] // n_rep
            bits = jax.lax.dynamic_slice_in_dim(bits, jax.lax.axis_index(rep) * n, n, 0)
            flip = jax.lax.dynamic_slice_in_dim(flip, jax.lax.axis_index(rep) * n, n, 0)
        s, rb, cb = bits.shape[0] // (n_r * n_c), bits.shape[1], bits.shape[2]
        if pieces:  # chunk j of my stack goes to piece-holder j; I get my chunk's pieces
            bits = jax.lax.all_to_all(bits, pieces, 0, 0, tiled=True)
            bits = bits.reshape(n_r, n_c, s, rb, cb).transpose(2, 0, 3, 1, 4)
            bits = bits.reshape(s, n_r * rb, n_c * cb)
            flip = jax.lax.dynamic_slice_in_dim(flip, jax.lax.axis_index(pieces) * s, s, 0)
        x = jax.lax.bitcast_convert_type(bits, ns_dtype)
        if x.shape[-1] == x.shape[-2]:  # squares stored transposed iterate as they are
            orient = lambda v: jnp.where(flip[:, None, None], jnp.swapaxes(v, -1, -2), v)
            x = orient(newton_schulz(orient(x)))
        else:
            x = newton_schulz(x)
        bits = jax.lax.bitcast_convert_type(x.astype(ns_dtype), wire)
        if pieces:
            bits = bits.reshape(s, n_r, rb, n_c, cb).transpose(1, 3, 0, 2, 4)
            bits = bits.reshape(n_r * n_c * s, rb, cb)
            bits = jax.lax.all_to_all(bits, pieces, 0, 0, tiled=True)
        if rep:
            bits = jax.lax.all_gather(bits, rep, axis=0, tiled=True)
        return bits

    return body


def orthogonalize_sharded(
    xs: Sequence[jax.Array],
    groups: Sequence[Group],
    mesh: Any,
    shardings: Sequence[NamedSharding | None],
    newton_schulz: Callable[[jax.Array], jax.Array],
    ns_dtype: Any,
) -> dict[int, jax.Array]:
    """Orthogonalise the leaves of `groups`, each device its own whole matrices.

    Args:
      xs: all leaves (float32), indexed by `Leaf.index`.
      groups: from `plan_groups`.
      mesh: the mesh of the leaves' shardings.
      shardings: each leaf's sharding (the result is constrained to it).
      newton_schulz: the batched iteration on ``(S, rows, cols)``, rows <= cols.
      ns_dtype: the iteration dtype (the transfers use it).

    Returns:
      ``{leaf index: orthogonalised leaf}`` in float32 (float64 for a float64
      iteration), for the leaves of `groups`.
    """
    out_dtype = jnp.promote_types(ns_dtype, jnp.float32)
    ns_dtype = jnp.dtype(ns_dtype)
    # The transfers carry the bits of ns_dtype values as unsigned ints: XLA would move a
    # float convert across the collective and send float32.
    wire = jnp.dtype(f"uint{8 * ns_dtype.itemsize}")
    results = {}
    for group in groups:
        spec = P(*group.spec)
        body = jax.shard_map(_local_newton_schulz(mesh, group.spec, newton_schulz, ns_dtype,
                                                  wire),
                             mesh=mesh, in_specs=(spec, P(group.spec[0])), out_specs=spec,
                             # the all-gather over the replicating axes makes the
                             # result replicated there; the checker cannot infer it
                             check_vma=False)
        parts = [to_stack(xs[leaf.index], leaf).astype(ns_dtype) for leaf in group.leaves]
        pad = group.size - group.count
        if pad:
            parts.append(jnp.zeros((pad, group.rows, group.cols), ns_dtype))
        stack = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        stack = jax.lax.with_sharding_constraint(jax.lax.bitcast_convert_type(stack, wire),
                                                 NamedSharding(mesh, spec))
        # Which matrices of the stack are stored transposed (static; padding is not).
        flip = np.repeat([leaf.transpose for leaf in group.leaves] + [False],
                         [leaf.batch for leaf in group.leaves] + [pad])
        out = jax.lax.bitcast_convert_type(body(stack, jnp.asarray(flip)), ns_dtype
                                           ).astype(out_dtype)
        start = 0
        for leaf in group.leaves:
            y = from_stack(out[start:start + leaf.batch], leaf)
            start += leaf.batch
            if shardings[leaf.index] is not None:
                y = jax.lax.with_sharding_constraint(y, shardings[leaf.index])
            results[leaf.index] = y
    return results
