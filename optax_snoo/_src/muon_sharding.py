"""Newton-Schulz on sharded params: whole matrices to devices, no collectives in the loop.

Left to the SPMD partitioner, a Newton-Schulz iteration on a row- or column-sharded matrix
splits the matmul FLOPs but gathers the whole matrix for each of its three products in
every iteration. The plan here instead gives each device whole matrices:

1. every Muon leaf becomes a stack ``(B, rows, cols)`` with ``rows <= cols`` (matrix axes
   moved last, transposed when tall, as the single-device iteration does; square
   matrices whose shardings are each other's transpose join the larger of the two groups
   transposed, and are transposed back on their device once whole, so every matrix
   iterates in its own orientation (``NS(Xᵀ) = NS(X)ᵀ`` in real arithmetic only: the
   transposed products round differently; figures in docs/muon.md);
2. stacks with the same shape and the same sharding of their matrix axes are
   concatenated into one group;
3. groups whose matrices are split over the same mesh axes (rows or columns, any
   shape, expert stacks of any count) share one assignment of whole matrices to
   devices ("owners", `plan_exchanges`): largest first, each matrix to the device whose
   load (Newton-Schulz FLOPs or bytes, each relative to its mean) grows least;
4. in one ``jax.shard_map`` per such exchange, each device lays out, for every owner,
   its pieces of that owner's matrices side by side (zero-padded to the largest
   owner's length), and one all-to-all over the piece axes delivers to every owner all
   pieces of its matrices (devices along the axes that replicate the matrices serve
   the owners of their own replica);
5. each owner reassembles its matrices and runs the batched iteration per shape on
   them (a ``lax.switch`` on the owner's index picks its code where owners hold
   different sets of shapes), so the loop holds no collective;
6. the all-to-all is reversed and, where axes replicate the matrices, the results are
   all-gathered (every replica needs every result); the stacks are cut into the
   leaves, constrained to each leaf's sharding.

Per device and step, with ``m`` the elements of the largest owner's matrices and ``K``
the size of the replicating axes: ``m`` in, ``m`` back, plus ``K m`` gathered when
``K > 1``. Where same-shape groups are multiples of the device count every owner holds
exactly its share (2x the share in all, in float32); otherwise an owner holds at most
about one matrix more than its share, and never less than the largest matrix: whole
matrices cost at least ``2 max(largest matrix, share)`` per device. Stacks split on
their stack axis (experts over a mesh axis) are assigned within each slice, every
slice alike, so their matrices never leave the slice.

Transfers are in the iteration dtype (the iteration casts to it first, and its output
is exactly representable in it), so bfloat16 Newton-Schulz moves half the bytes of
float32.
Per device, the FLOPs are those of the largest owner's matrices: at most about one
matrix above ``total / N``.

Leaves of unknown sharding (the update traced under ``jax.jit`` with Auto mesh axes, and
``init`` never saw concrete arrays: it ran under ``jax.jit`` / ``jax.eval_shape``, or
``optax.inject_hyperparams`` rebuilt the transform) are planned on a mesh given by the
caller (``mesh=`` or the ``jax.set_mesh`` context) as if their stack's rows (the shorter
matrix axis) were split over all its devices, FSDP's layout: shard_map's in and out specs
say so, XLA inserts the conversion from (and back to) wherever the leaves actually live
(none when they are laid out so), and the plan above runs. Splitting the stack axis
instead would be free going in but not coming out: XLA turns a slice of a stack split
over devices into a row-sharded leaf by replicating the whole stack (figures in
docs/muon.md). Leaves whose rows do not divide by the device count keep the per-leaf path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.sharding import axes_of, concrete_sharding, is_split, spec_entries
from optax_snoo._src.utils import path_to_str

__all__ = ["Exchange", "Group", "MatrixPrecondition", "NewtonSchulzPlan",
           "OwnedPreconditionState", "Placement", "describe_leaf", "from_stack",
           "init_precondition", "newton_schulz_flops", "orthogonalize_leaves",
           "orthogonalize_sharded", "place_leaves", "plan_exchanges", "plan_groups",
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


class MatrixPrecondition(NamedTuple):
    """A precondition that is a function of each matrix alone (its Newton-Schulz input
    ``M``, its raw gradient ``G`` and its own state), so that under the sharded plan the
    device owning a matrix runs it, on the whole matrix, beside the iteration.

    Matrices are in the ``(fan_out, fan_in)`` layout, batched: ``(..., out, in)``.

    Attributes:
      init: ``(batch, out, in, dtype) -> state``: the state of ``batch`` matrices (a
        pytree of arrays, each with the leading axis ``batch``); ``dtype`` is the
        param's.
      apply: ``(M, G, state, count, flags) -> (D, state)``: the matrices to orthogonalise
        and the new state; ``count`` the update count, ``flags`` a static numpy bool
        array of the batch's shape (each matrix's leaf flag).
      flags: ``(leaf paths, params treedef) -> list of bools``: a static per-leaf switch
        the transform reads (e.g. SOAP's trust gate), or None (all False).
    """

    init: Callable[[int, int, int, Any], Any]
    apply: Callable[..., tuple[jax.Array, Any]]
    flags: Callable[[list[str], Any], list[bool]] | None = None


class OwnedPreconditionState(NamedTuple):
    """State of a `MatrixPrecondition` inside `scale_by_muon`.

    Attributes:
      leaves: per leaf, the state of its matrices ``(*batch, ...)`` where the leaf keeps
        the per-leaf path, ``optax.EmptyState()`` where its matrices go to owners.
      owned: per exchange of the sharded plan, the states of every owner's matrices,
        flattened side by side, ``(owners, length)``, each row on its owner.
    """

    leaves: Any
    owned: tuple[jax.Array, ...] = ()


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


def _assign(shapes: Sequence[tuple[int, ...]], axes: Sequence[tuple[int, int]],
            placements: Sequence[Placement], mesh: Any, split: bool
            ) -> tuple[Any, list[Group], list[int]]:
    """Which leaves go to owners: ``(mesh to split over, groups, local leaves)``. Init
    and update both ask, so that an owner's precondition state lies where it is used."""
    shardings = [p.sharding for p in placements]
    unknown = [p.unknown for p in placements]
    spread = _split_mesh(shardings, unknown, mesh) if split else None
    if spread is None:
        return None, [], list(range(len(shapes)))
    # Leaves of unknown sharding are split only over a mesh the caller named.
    named = mesh is not None or not jax.sharding.get_abstract_mesh().empty
    groups, local = plan_groups(shapes, axes, shardings, spread.size, unknown=unknown,
                                mesh=spread if named else None)
    return spread, groups, local


def orthogonalize_leaves(xs: Sequence[jax.Array], axes: Sequence[tuple[int, int]],
                         placements: Sequence[Placement], *,
                         newton_schulz: Callable[[jax.Array], jax.Array], ns_dtype: Any,
                         mesh: Any = None, split: bool = True,
                         precondition: MatrixPrecondition | None = None,
                         grads: Sequence[jax.Array] = (), leaf_states: Sequence[Any] = (),
                         owned: Sequence[jax.Array] = (), count: jax.Array | None = None,
                         flags: Sequence[bool] = (),
                         ) -> tuple[list[jax.Array], list[Any], tuple[jax.Array, ...]]:
    """Newton-Schulz on every leaf, each on the path its placement allows, after an
    optional per-matrix precondition.

    - Leaves split over a mesh (and, when ``mesh`` or the ``jax.set_mesh`` context names
      one, leaves of unknown sharding): whole matrices to devices (`plan_groups`,
      `orthogonalize_sharded`), no collective inside the iteration; a ``precondition``
      runs on the owner too, its state kept there.
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
      precondition: applied to every matrix before its iteration; None: none.
      grads: the raw gradients (with ``precondition``).
      leaf_states: per leaf, its precondition state from `init_precondition` (with
        ``precondition``; empty where the leaf goes to owners).
      owned: the owners' precondition states from `init_precondition`.
      count: the update count (with ``precondition``).
      flags: per leaf, from `MatrixPrecondition.flags`.

    Returns:
      The orthogonalised leaves, in order, and the precondition's new per-leaf and
      owner states (``[]`` and ``()`` without one).
    """
    shardings = [p.sharding for p in placements]
    spread, groups, local = _assign([x.shape for x in xs], axes, placements, mesh, split)
    xs, new_leaves = list(xs), list(leaf_states)
    if precondition is not None:
        flags = list(flags) or [False] * len(xs)
        _check_owned(owned, groups, spread)
        for i in local:
            xs[i], new_leaves[i] = _precondition_leaf(precondition, xs[i], grads[i],
                                                      leaf_states[i], axes[i], count, flags[i])
    # Stacked where no partitioner splits them: whole leaves, replicated leaves of a split
    # mesh and, with no mesh anywhere, leaves of unknown sharding (taken to be on one
    # device, jit's common case); else a leaf of unknown sharding keeps its own iteration.
    assume_whole = split and spread is None
    stack = [i for i in local if placements[i].whole or shardings[i] is not None
             or (assume_whole and placements[i].unknown)]
    out = _stacked(xs, stack, axes, newton_schulz)
    out.update({i: _one_leaf(xs[i], axes[i], newton_schulz) for i in local if i not in out})
    new_owned: tuple[jax.Array, ...] = ()
    if groups:
        pre = None if precondition is None else _OwnerPrecondition(
            precondition, list(grads), tuple(owned), count, flags)
        results, new_owned = orthogonalize_sharded(xs, groups, spread, shardings,
                                                   newton_schulz, ns_dtype, precondition=pre)
        out.update(results)
    return [out[i] for i in range(len(xs))], new_leaves, new_owned


class _OwnerPrecondition(NamedTuple):
    """What the owners need to run a `MatrixPrecondition`."""

    transform: MatrixPrecondition
    grads: list[jax.Array]
    owned: tuple[jax.Array, ...]
    count: jax.Array
    flags: list[bool]


def _to_record(x: jax.Array, axes: tuple[int, int]) -> jax.Array:
    """A leaf's matrices as ``(..., fan_out, fan_in)``."""
    return jnp.moveaxis(x, (axes[1], axes[0]), (-2, -1))


def _from_record(x: jax.Array, axes: tuple[int, int]) -> jax.Array:
    return jnp.moveaxis(x, (-2, -1), (axes[1], axes[0]))


def _precondition_leaf(pre: MatrixPrecondition, x: jax.Array, g: jax.Array, state: Any,
                       axes: tuple[int, int], count: jax.Array, flag: bool
                       ) -> tuple[jax.Array, Any]:
    """The per-leaf path: the leaf's matrices preconditioned where they lie."""
    m = _to_record(x, axes)
    d, state = pre.apply(m, _to_record(g, axes).astype(m.dtype), state, count,
                         np.full(m.shape[:-2], flag))
    return _from_record(d, axes), state


def init_precondition(pre: MatrixPrecondition, leaves: Sequence[Any],
                      axes: Sequence[tuple[int, int]], placements: Sequence[Placement], *,
                      mesh: Any = None, split: bool = True, flags: Sequence[bool] = ()
                      ) -> tuple[list[Any], tuple[jax.Array, ...]]:
    """The state of a `MatrixPrecondition` laid out as `orthogonalize_leaves` will use it:
    per leaf where the leaf keeps the per-leaf path, on the owners for the sharded plan.

    Args:
      pre: the precondition.
      leaves: Muon's leaves (the params, flattened).
      axes: each leaf's normalised ``(fan_in, fan_out)`` axes.
      placements: from `place_leaves` on the params.
      mesh: as in `orthogonalize_leaves`.
      split: as in `orthogonalize_leaves`.
      flags: per leaf, from `MatrixPrecondition.flags`.

    Returns:
      Per leaf its state (``optax.EmptyState()`` where it goes to owners), and per
      exchange the owners' flat states (`OwnedPreconditionState`).
    """
    shapes = [tuple(jnp.shape(p)) for p in leaves]
    spread, groups, local = _assign(shapes, axes, placements, mesh, split)
    per_leaf: list[Any] = [optax.EmptyState() for _ in leaves]
    for i in local:
        (fan_in, fan_out), shape = axes[i], shapes[i]
        batch = tuple(n for a, n in enumerate(shape) if a not in axes[i])
        state = pre.init(math.prod(batch), shape[fan_out], shape[fan_in],
                         jnp.result_type(leaves[i]))
        per_leaf[i] = jax.tree.map(lambda s, b=batch: s.reshape(*b, *s.shape[1:]), state)
    owned = []
    dtype = _state_dtype([jnp.result_type(p) for p in leaves])
    for ex in plan_exchanges(groups, spread) if groups else []:
        lay = _layout(ex, spread, with_orientation=True, flags=flags)
        rows = []
        for owned_runs in lay.runs:
            parts = []
            for r in owned_runs:
                out, inn = _record_shape(ex.groups[r.group], r.transpose)
                parts += [jnp.ravel(s).astype(dtype) for s in jax.tree.leaves(
                    pre.init(len(r.matrices), out, inn, dtype))]
            rows.append(parts)
        length = max(sum(p.size for p in row) for row in rows)
        table = jnp.stack([jnp.concatenate(
            [*row, jnp.zeros(length - sum(p.size for p in row), dtype)]) for row in rows])
        table = jnp.tile(table, (_stack_slices(ex, spread), 1))
        owned.append(_place(table, NamedSharding(spread, _owner_spec(ex))))
    return per_leaf, tuple(owned)


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def _state_dtype(dtypes: Sequence[Any]) -> Any:
    """One dtype for the owners' flat state: float32, float64 when a leaf is."""
    return jnp.result_type(jnp.float32, *[jnp.promote_types(d, jnp.float32) for d in dtypes])


def _stack_slices(ex: Exchange, mesh: Any) -> int:
    return math.prod(mesh.shape[a] for a in ex.stack)


def _owner_spec(ex: Exchange) -> P:
    """Row ``(slice * K + k) * P + p`` on the device of that slice, replica and piece."""
    return P((*ex.stack, *ex.rep, *ex.pieces), None)


def _record_shape(group: Group, transpose: bool) -> tuple[int, int]:
    """(fan_out, fan_in) of a group's matrix stored transposed or not: a stack holds
    ``(fan_in, fan_out)`` unless its leaf was transposed into it."""
    return (group.rows, group.cols) if transpose else (group.cols, group.rows)


def _check_owned(owned: Sequence[jax.Array], groups: Sequence[Group], mesh: Any) -> None:
    """The state must have been laid out by the same plan the update runs."""
    n = len(plan_exchanges(groups, mesh)) if groups else 0
    if len(owned) != n:
        raise ValueError(
            f"The precondition state was laid out for {len(owned)} owner exchange(s) "
            f"but this update plans {n}: init and update must see the same shardings (pass "
            f"newton_schulz_plan=NewtonSchulzPlan.from_params(params) to scale_by_muon).")


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
    """Stacks of one shape and one sharding of ``(B, rows, cols)``."""

    rows: int
    cols: int
    spec: tuple[Any, Any, Any]
    leaves: tuple[Leaf, ...]

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
      ``(groups, local)``: groups of same-shape, same-sharding stacks (`plan_exchanges`
      assigns their matrices to devices), and the indices of the leaves that keep the
      per-leaf iteration (unsharded, or of unknown sharding without a mesh).
    """
    buckets: dict[tuple[Any, ...], list[Leaf]] = {}
    local = []
    unknown = tuple(unknown) or (False,) * len(shapes)
    spread = None if mesh is None else tuple(
        a for a, n in mesh.shape.items() if n > 1)
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
    groups = [Group(rows, cols, spec, tuple(members))
              for (rows, cols, spec), members in buckets.items()]
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


class Exchange(NamedTuple):
    """Groups whose matrices are split over the same mesh axes, with one assignment of
    their whole matrices to devices ("owners") across all their shapes.

    Owner ``o = k * P + p`` is the device at index ``k`` of the replicating axes and ``p``
    of the piece axes (both flattened in mesh order; ``P`` devices hold the pieces of one
    matrix, ``K`` copies of them replicate it). Where axes split the stacks themselves,
    each slice of the stacks has its own ``K * P`` owners, assigned alike.
    """

    stack: tuple[str, ...]       # mesh axes splitting the stacks, as their spec names them
    pieces: tuple[str, ...]      # mesh axes splitting the matrices, in mesh order
    rep: tuple[str, ...]         # the other mesh axes of size > 1, in mesh order
    groups: tuple[Group, ...]
    # per owner, its matrices in order: (group, part of the group (`_parts`), matrix of
    # the part's slice of its stack)
    owners: tuple[tuple[tuple[int, int, int], ...], ...]

    def offsets(self, mesh: Any) -> tuple[dict[tuple[int, int, int], tuple[int, int]], int]:
        """``{matrix: (owner, offset)}`` in a piece-holder's flat payload, and the payload
        length per owner (the largest owner's; the others are zero-padded)."""
        where, longest = {}, 0
        for o, owned in enumerate(self.owners):
            off = 0
            for item in owned:
                where[item] = (o, off)
                off += _piece_size(self.groups[item[0]], mesh)
            longest = max(longest, off)
        return where, longest


def _parts(group: Group, mesh: Any) -> list[tuple[Leaf, ...]]:
    """The leaves of `group` as the exchange takes them: concatenated into one stack
    (free, the stack axis is whole on every device), or one by one where the stack axis
    is split (concatenating would move matrices between the slices)."""
    return ([(leaf,) for leaf in group.leaves] if _split_axes(group.spec[0], mesh)
            else [group.leaves])


def _split_axes(entry: Any, mesh: Any) -> tuple[str, ...]:
    sizes = mesh.shape
    return tuple(a for a in axes_of(entry) if sizes[a] > 1)


def _piece_grid(group: Group, mesh: Any) -> tuple[int, int]:
    """(R, C): how many pieces the rows and the columns of a matrix are split into."""
    sizes = mesh.shape
    return (math.prod(sizes[a] for a in _split_axes(group.spec[1], mesh)),
            math.prod(sizes[a] for a in _split_axes(group.spec[2], mesh)))


def _piece_size(group: Group, mesh: Any) -> int:
    n_r, n_c = _piece_grid(group, mesh)
    return (group.rows // n_r) * (group.cols // n_c)


def newton_schulz_flops(rows: int, cols: int, iterations: int = 5) -> int:
    """Matmul FLOPs of the iteration on one ``rows x cols`` matrix (rows <= cols):
    ``X Xᵀ``, ``A A`` and ``B X`` per iteration."""
    return iterations * (4 * rows * rows * cols + 2 * rows ** 3)


def plan_exchanges(groups: Sequence[Group], mesh: Any) -> list[Exchange]:
    """Assign the whole matrices of `groups` to devices, one assignment per way of
    splitting them.

    Groups whose stacks are split over the same mesh axes and whose matrices are split
    over the same mesh axes (rows or columns, either, any shape: FSDP's and tensor
    parallelism's leaves, expert stacks of any count) form one `Exchange`. Their
    matrices, largest first, each go to the owner whose heavier relative load
    (Newton-Schulz FLOPs or bytes, each over its mean) grows least, ties to the lowest
    index: the longest-processing-time rule (Graham, "Bounds on multiprocessing timing
    anomalies", SIAM J. Appl. Math., 1969). Same-shape groups of a multiple of N
    matrices so give every owner exactly its share; otherwise an owner holds at most
    about one matrix more than its share, instead of every group padded to a multiple
    of N. Stacks split over the mesh are assigned within their slice (every slice alike).

    Args:
      groups: from `plan_groups`.
      mesh: the mesh of their shardings.

    Returns:
      The exchanges, each covering some of `groups`.
    """
    sizes = mesh.shape
    classes: dict[tuple[tuple[str, ...], tuple[str, ...]], list[Group]] = {}
    for group in groups:
        split = set(_split_axes(group.spec[1], mesh) + _split_axes(group.spec[2], mesh))
        key = (_split_axes(group.spec[0], mesh), tuple(a for a in mesh.axis_names if a in split))
        classes.setdefault(key, []).append(group)
    exchanges = []
    for (stack, pieces), members in classes.items():
        rep = tuple(a for a in mesh.axis_names
                    if a not in pieces and a not in stack and sizes[a] > 1)
        n_owners = math.prod(sizes[a] for a in pieces + rep)
        n_stack = math.prod(sizes[a] for a in stack)
        items = [(g, j, i) for g, group in enumerate(members)
                 for j, part in enumerate(_parts(group, mesh))
                 for i in range(sum(leaf.batch for leaf in part) // n_stack)]
        flops = [newton_schulz_flops(group.rows, group.cols) for group in members]
        size = [group.rows * group.cols for group in members]
        mean_f = sum(flops[g] for g, _, _ in items) / n_owners
        mean_b = sum(size[g] for g, _, _ in items) / n_owners
        items.sort(key=lambda it: -(flops[it[0]] / mean_f + size[it[0]] / mean_b))
        load_f, load_b = [0.0] * n_owners, [0.0] * n_owners
        owned: list[list[tuple[int, int, int]]] = [[] for _ in range(n_owners)]
        for item in items:
            g = item[0]
            o = min(range(n_owners), key=lambda o: (
                max((load_f[o] + flops[g]) / mean_f, (load_b[o] + size[g]) / mean_b), o))
            load_f[o] += flops[g]
            load_b[o] += size[g]
            owned[o].append(item)
        exchanges.append(Exchange(stack, pieces, rep, tuple(members),
                                  tuple(map(tuple, owned))))
    return exchanges


def _chunk_order(group: Group, pieces: tuple[str, ...], mesh: Any) -> np.ndarray:
    """For each piece of a matrix, (row block, column block) in row-major order, the
    index along `pieces` (flattened in that order) of the device holding it."""
    sizes = mesh.shape
    row_axes, col_axes = _split_axes(group.spec[1], mesh), _split_axes(group.spec[2], mesh)
    order = []
    for pr in np.ndindex(*[sizes[a] for a in row_axes]):
        for pc in np.ndindex(*[sizes[a] for a in col_axes]):
            at = dict(zip(row_axes + col_axes, pr + pc, strict=True))
            order.append(int(np.ravel_multi_index([at[a] for a in pieces],
                                                  [sizes[a] for a in pieces])))
    return np.asarray(order)


class _Run(NamedTuple):
    """Consecutive matrices of one owner that move and iterate as one slice."""

    group: int                # index in `Exchange.groups`
    part: int                 # index in the group's `_parts`
    flip: bool                # a square stored transposed: it iterates transposed back
    matrices: list[int]       # indices in the part's slice of its stack
    transpose: bool = False   # stored (fan_out, fan_in) (tracked for a precondition)
    flag: bool = False        # the leaf's `MatrixPrecondition.flags` entry


class _Slot(NamedTuple):
    """One run as an owner's code sees it: its group's shape, orientation and count."""

    group: int
    flip: bool
    count: int
    transpose: bool = False
    flag: bool = False


def _runs(ex: Exchange, kinds: Mapping[tuple[int, int], list[tuple[bool, bool, bool]]]
          ) -> list[list[_Run]]:
    """Each owner's matrices as runs of consecutive items alike (``kinds``: per matrix of
    a part, its (flip, transpose, flag)), so that a run moves and iterates as one slice
    (LPT deals a group's matrices round-robin: one strided slice per owner and group)."""
    out = []
    for owned in ex.owners:
        runs: list[_Run] = []
        for g, j, i in owned:
            flip, transpose, flag = kinds[(g, j)][i]
            last = runs[-1] if runs else None
            if last is not None and (last.group, last.part, last.flip, last.transpose,
                                     last.flag) == (g, j, flip, transpose, flag):
                last.matrices.append(i)
            else:
                runs.append(_Run(g, j, flip, [i], transpose, flag))
        out.append(runs)
    return out


def _pick(stack: jax.Array, index: Sequence[int]) -> jax.Array:
    """``stack[index]``, as a (strided) slice where the indices are evenly spaced."""
    step = index[1] - index[0] if len(index) > 1 else 1
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(index)):
        return stack[index[0]:index[-1] + 1:step]
    return stack[np.asarray(index)]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What every device knows of an `Exchange` before it runs (all static)."""

    n_pieces: int                         # P: devices holding the pieces of one matrix
    n_replicas: int                       # K: copies of those devices
    length: int                           # payload elements per owner (zero-padded)
    grids: list[tuple[int, int]]          # per group: (R, C) pieces per matrix
    blocks: list[tuple[int, int]]         # per group: one piece's (rows, cols)
    orders: list[np.ndarray]              # per group: `_chunk_order`
    inputs: dict[tuple[int, int], int]    # (group, part) -> shard_map operand
    runs: list[list[_Run]]                # per owner
    profiles: list[tuple[_Slot, ...]]     # the distinct slot lists owners hold
    profile_of: np.ndarray                # per owner: its index in `profiles`


def _layout(ex: Exchange, mesh: Any, with_orientation: bool = False,
            flags: Sequence[bool] = ()) -> _Layout:
    """``with_orientation``: runs also split by orientation (a precondition reads each
    matrix as (fan_out, fan_in)) and by the leaves' ``flags`` (indexed by `Leaf.index`)."""
    sizes = mesh.shape
    _, length = ex.offsets(mesh)
    grids = [_piece_grid(g, mesh) for g in ex.groups]
    parts = [_parts(group, mesh) for group in ex.groups]
    inputs = {(g, j): n for n, (g, j) in enumerate(
        (g, j) for g in range(len(ex.groups)) for j in range(len(parts[g])))}
    # Squares stored transposed (joined to their transpose's group) iterate transposed back.
    n_stack = math.prod(sizes[a] for a in ex.stack)
    kinds = {}
    for g, j in inputs:
        kind = []
        for leaf in parts[g][j]:
            flip = leaf.transpose and leaf.rows == leaf.cols
            transpose = leaf.transpose if with_orientation else flip
            flag = bool(flags[leaf.index]) if with_orientation and flags else False
            kind += [(flip, transpose, flag)] * (leaf.batch // n_stack)
        kinds[(g, j)] = kind
    runs = _runs(ex, kinds)
    keys = [tuple(_Slot(r.group, r.flip, len(r.matrices), r.transpose, r.flag) for r in owned)
            for owned in runs]
    profiles = sorted(set(keys))
    return _Layout(
        n_pieces=math.prod(sizes[a] for a in ex.pieces),
        n_replicas=math.prod(sizes[a] for a in ex.rep), length=length, grids=grids,
        blocks=[(g.rows // r, g.cols // c) for g, (r, c) in zip(ex.groups, grids, strict=True)],
        orders=[_chunk_order(g, ex.pieces, mesh) for g in ex.groups], inputs=inputs,
        runs=runs, profiles=profiles,
        profile_of=np.asarray([profiles.index(key) for key in keys], np.int32))


def _payload(parts: list[jax.Array], rows: int, length: int, wire: Any) -> jax.Array:
    """``(rows, length)``: the parts flattened side by side, zero-padded."""
    parts = [p.reshape(rows, -1) for p in parts]
    used = sum(p.shape[1] for p in parts)
    if used < length or not parts:
        parts.append(jnp.zeros((rows, length - used), wire))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _trade(ex: Exchange, v: jax.Array) -> jax.Array:
    """One all-to-all over the piece axes (its own inverse); none where the stacks are
    split only on their stack axis (every device holds whole matrices)."""
    return jax.lax.all_to_all(v, ex.pieces, 0, 0, tiled=True) if ex.pieces else v


def _gather_pieces(ex: Exchange, lay: _Layout, stacks: Sequence[Sequence[jax.Array]],
                   wire: Any) -> tuple[jax.Array, jax.Array | int]:
    """Step 4: every owner receives all pieces of its matrices, ``(P, length)`` per list
    of ``stacks`` (the momentum, and the raw gradient for a precondition) side by side;
    also returns this device's index along the replicating axes."""
    # Every owner's row: my pieces of its matrices, in its order (replicas hold the same
    # pieces; each sends only the rows of its own replica's owners).
    table = jnp.stack([jnp.concatenate([
        _payload([_pick(arrays[lay.inputs[(r.group, r.part)]], r.matrices) for r in owned],
                 1, lay.length, wire)[0] for arrays in stacks])
        for owned in lay.runs]).reshape(lay.n_replicas, lay.n_pieces, -1)
    replica = jax.lax.axis_index(ex.rep) if ex.rep else 0
    mine = jax.lax.dynamic_index_in_dim(table, replica, 0, keepdims=False)
    return _trade(ex, mine), replica


def _assemble(lay: _Layout, profile: tuple[_Slot, ...], x: jax.Array) -> list[jax.Array]:
    """An owner's matrices ``(count, rows, cols)`` per slot, from their pieces ``x``."""
    mats, off = [], 0
    for slot in profile:  # (pieces, count, ...) -> (count, rows, cols)
        (n_r, n_c), (rb, cb) = lay.grids[slot.group], lay.blocks[slot.group]
        size = slot.count * rb * cb
        chunks = (x[:, off:off + size].reshape(lay.n_pieces, slot.count, rb, cb)
                  [lay.orders[slot.group]])
        off += size
        mats.append(chunks.reshape(n_r, n_c, slot.count, rb, cb).transpose(2, 0, 3, 1, 4)
                    .reshape(slot.count, n_r * rb, n_c * cb))
    return mats


class _OwnerStep(NamedTuple):
    """A `MatrixPrecondition` as the owners run it."""

    transform: MatrixPrecondition
    count: jax.Array
    dtype: Any          # of the flat state and of the matrices on the way in
    wire: Any           # the unsigned int the matrices travel as on the way in
    length: int         # flat state elements per owner


def _precondition_owned(step: _OwnerStep, lay: _Layout, profile: tuple[_Slot, ...],
                        x: jax.Array, state: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """The precondition on an owner's whole matrices (momentum and raw gradient side by
    side in ``x``), each in (fan_out, fan_in) layout, with its flat ``state`` row."""
    m, g = (jax.lax.bitcast_convert_type(v, step.dtype)
            for v in (x[:, :lay.length], x[:, lay.length:]))
    outs, news, off = [], [], 0
    for slot, mm, gg in zip(profile, _assemble(lay, profile, m), _assemble(lay, profile, g),
                            strict=True):
        rows, cols = mm.shape[1:]
        out_n, in_n = (rows, cols) if slot.transpose else (cols, rows)
        like = jax.eval_shape(functools.partial(step.transform.init, slot.count, out_n, in_n,
                                                step.dtype))
        leaves, treedef = jax.tree.flatten(like)
        pieces = []
        for leaf in leaves:
            pieces.append(state[0, off:off + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
            off += leaf.size
        rec = (lambda v: v) if slot.transpose else (lambda v: jnp.swapaxes(v, -1, -2))
        d, new = step.transform.apply(rec(mm), rec(gg), treedef.unflatten(pieces), step.count,
                                      np.full((slot.count,), slot.flag))
        outs.append(rec(d))
        news += [jnp.ravel(v).astype(step.dtype) for v in jax.tree.leaves(new)]
    used = sum(v.size for v in news)
    if used < step.length or not news:
        news.append(jnp.zeros(step.length - used, step.dtype))
    return outs, jnp.concatenate(news)[None]


def _iterate_owned(lay: _Layout, profile: tuple[_Slot, ...], x: jax.Array,
                   state: jax.Array | None = None, *,
                   newton_schulz: Callable[[jax.Array], jax.Array], ns_dtype: Any,
                   wire: Any, step: _OwnerStep | None = None
                   ) -> tuple[jax.Array, jax.Array | None]:
    """Step 5: an owner's matrices reassembled from their pieces ``x`` (preconditioned
    first with ``step``, its flat ``state`` updated), one batched iteration per shape,
    and the results cut back into pieces, ``(P, length)``."""
    if step is None:
        mats = [jax.lax.bitcast_convert_type(v, ns_dtype) for v in _assemble(lay, profile, x)]
    else:
        mats, state = _precondition_owned(step, lay, profile, x, state)
    outs: list[Any] = [None] * len(profile)
    same_shape: dict[tuple[int, int, bool], list[int]] = {}
    for k, slot in enumerate(profile):
        same_shape.setdefault((*mats[k].shape[1:], slot.flip), []).append(k)
    for (_, _, flip), ks in same_shape.items():
        v = [mats[k] for k in ks]
        v = (v[0] if len(v) == 1 else jnp.concatenate(v)).astype(ns_dtype)
        v = jnp.swapaxes(v, -1, -2) if flip else v
        v = newton_schulz(v)
        v = jnp.swapaxes(v, -1, -2) if flip else v
        v = jax.lax.bitcast_convert_type(v.astype(ns_dtype), wire)
        start = 0
        for k in ks:
            outs[k] = v[start:start + profile[k].count]
            start += profile[k].count
    back = []
    for slot, out in zip(profile, outs, strict=True):
        (n_r, n_c), (rb, cb) = lay.grids[slot.group], lay.blocks[slot.group]
        chunks = out.reshape(slot.count, n_r, rb, n_c, cb).transpose(1, 3, 0, 2, 4)
        back.append(chunks.reshape(lay.n_pieces, slot.count, rb, cb)
                    [np.argsort(lay.orders[slot.group])])
    return _payload(back, lay.n_pieces, lay.length, wire), state


def _scatter_back(ex: Exchange, lay: _Layout, y: jax.Array) -> tuple[jax.Array, ...]:
    """Step 6: the pieces back to their holders (and all-gathered over the replicating
    axes), cut into each part's local block, in the part's order."""
    y = _trade(ex, y)
    y = jax.lax.all_gather(y, ex.rep, axis=0, tiled=False) if ex.rep else y[None]
    y = y.reshape(lay.n_replicas * lay.n_pieces, lay.length)
    found: dict[tuple[int, int], list[tuple[list[int], jax.Array]]] = {}
    for owner, owned in enumerate(lay.runs):
        off = 0
        for r in owned:
            rb, cb = lay.blocks[r.group]
            size = len(r.matrices) * rb * cb
            found.setdefault((r.group, r.part), []).append(
                (r.matrices, y[owner, off:off + size].reshape(len(r.matrices), rb, cb)))
            off += size
    outs = []
    for key in lay.inputs:
        index = np.concatenate([i for i, _ in found[key]])
        out = jnp.concatenate([v for _, v in found[key]])
        order = np.argsort(index)
        outs.append(out if (order == np.arange(len(order))).all() else out[order])
    return tuple(outs)


def _exchange_body(ex: Exchange, mesh: Any, newton_schulz: Callable[[jax.Array], jax.Array],
                   ns_dtype: Any, wire: Any, step: _OwnerStep | None = None,
                   flags: Sequence[bool] = ()) -> Callable[..., tuple[jax.Array, ...]]:
    """The per-device body of an `Exchange`, on each part's local block
    ``(B/H, rows/R, cols/C)``: the pieces of every owner's matrices to that owner (one
    all-to-all over the piece axes), the owner's own iteration (a `lax.switch` on its
    index among the distinct lists of shapes owners hold; none where all hold the same),
    the pieces back (one all-to-all) and, where axes replicate the matrices, one
    all-gather of the results. The code is the same in every slice of the stacks.

    With a precondition ``step`` the operands are the momentum's blocks, the raw
    gradient's blocks and the owners' flat state; both matrices travel in the same
    all-to-all, the owner preconditions them before its iteration and returns its state.
    """
    lay = _layout(ex, mesh, with_orientation=step is not None, flags=flags)
    branches = [functools.partial(_iterate_owned, lay, profile, newton_schulz=newton_schulz,
                                  ns_dtype=ns_dtype, wire=wire, step=step)
                for profile in lay.profiles]
    n_in = len(lay.inputs)

    def body(*operands: jax.Array) -> tuple[jax.Array, ...]:
        if step is None:
            lists, state = [operands], None
        else:
            lists, state = [operands[:n_in], operands[n_in:2 * n_in]], operands[2 * n_in]
        x, replica = _gather_pieces(ex, lay, lists, step.wire if step else wire)
        if len(branches) == 1:
            y, state = branches[0](x, state)
        else:
            owner = replica * lay.n_pieces + (jax.lax.axis_index(ex.pieces) if ex.pieces
                                              else 0)
            y, state = jax.lax.switch(jnp.asarray(lay.profile_of)[owner], branches, x, state)
        outs = _scatter_back(ex, lay, y)
        return outs if step is None else (*outs, state)

    return body


def _stacks(leaves: Sequence[jax.Array], parts: Sequence[tuple[Group, tuple[Leaf, ...]]],
            specs: Sequence[P], mesh: Any, dtype: Any, bits: Any) -> list[jax.Array]:
    """Each part's leaves as one stack in ``dtype``, carried as the unsigned ``bits``."""
    out = []
    for (_, part), spec in zip(parts, specs, strict=True):
        stack = [to_stack(leaves[leaf.index], leaf).astype(dtype) for leaf in part]
        stack = stack[0] if len(stack) == 1 else jnp.concatenate(stack, axis=0)
        out.append(jax.lax.with_sharding_constraint(
            jax.lax.bitcast_convert_type(stack, bits), NamedSharding(mesh, spec)))
    return out


def orthogonalize_sharded(
    xs: Sequence[jax.Array],
    groups: Sequence[Group],
    mesh: Any,
    shardings: Sequence[NamedSharding | None],
    newton_schulz: Callable[[jax.Array], jax.Array],
    ns_dtype: Any,
    precondition: _OwnerPrecondition | None = None,
) -> tuple[dict[int, jax.Array], tuple[jax.Array, ...]]:
    """Orthogonalise the leaves of `groups`, each device its own whole matrices.

    Args:
      xs: all leaves (float32), indexed by `Leaf.index`.
      groups: from `plan_groups`.
      mesh: the mesh of the leaves' shardings.
      shardings: each leaf's sharding (the result is constrained to it).
      newton_schulz: the batched iteration on ``(S, rows, cols)``, rows <= cols.
      ns_dtype: the iteration dtype (the transfers use it).
      precondition: a `MatrixPrecondition` to run on the owners first, with the raw
        gradients, the owners' states and the count; None: none.

    Returns:
      ``{leaf index: orthogonalised leaf}`` in float32 (float64 for a float64
      iteration), for the leaves of `groups`, and the owners' new precondition states.
    """
    out_dtype = jnp.promote_types(ns_dtype, jnp.float32)
    ns_dtype = jnp.dtype(ns_dtype)
    # The transfers carry the bits of ns_dtype values as unsigned ints: XLA would move a
    # float convert across the collective and send float32.
    wire = jnp.dtype(f"uint{8 * ns_dtype.itemsize}")
    results, owned = {}, []
    for n, ex in enumerate(plan_exchanges(groups, mesh)):
        parts = [(group, part) for group in ex.groups for part in _parts(group, mesh)]
        specs = tuple(P(*group.spec) for group, _ in parts)
        step, flags, in_dtype = None, (), ns_dtype
        if precondition is not None:
            # The precondition reads the momentum and the gradient as the single-device
            # path does: in the state's dtype (float32), not the iteration's.
            table = precondition.owned[n]
            in_dtype = table.dtype
            step = _OwnerStep(precondition.transform, precondition.count, in_dtype,
                              jnp.dtype(f"uint{8 * in_dtype.itemsize}"), table.shape[1])
            flags = precondition.flags

        operands = _stacks(xs, parts, specs, mesh, in_dtype, step.wire if step else wire)
        owner_spec = _owner_spec(ex)
        if step is not None:
            operands += _stacks(precondition.grads, parts, specs, mesh, in_dtype, step.wire)
            operands.append(precondition.owned[n])
        body = jax.shard_map(_exchange_body(ex, mesh, newton_schulz, ns_dtype, wire, step,
                                            flags),
                             mesh=mesh,
                             in_specs=(*specs, *specs, owner_spec) if step else specs,
                             out_specs=(*specs, owner_spec) if step else specs,
                             # the all-gather over the replicating axes makes the
                             # result replicated there; the checker cannot infer it
                             check_vma=False)
        outs = body(*operands)
        if step is not None:
            outs, state = outs[:-1], outs[-1]
            owned.append(state)
        for (_, part), out in zip(parts, outs, strict=True):
            out = jax.lax.bitcast_convert_type(out, ns_dtype).astype(out_dtype)
            start = 0
            for leaf in part:
                y = from_stack(out[start:start + leaf.batch], leaf)
                start += leaf.batch
                if shardings[leaf.index] is not None:
                    y = jax.lax.with_sharding_constraint(y, shardings[leaf.index])
                results[leaf.index] = y
    return results, tuple(owned)
