"""The plan of Muon's sharded Newton-Schulz, in numpy and Python: no collectives.

Where each leaf lives (`NewtonSchulzPlan`, `place_leaves`), which leaves go to owners
(`_assign`), the leaves as stacks of one shape and sharding (`plan_groups`), the
assignment of their whole matrices to devices (`plan_exchanges`) and what every device
knows of an exchange before it runs (`_layout`). `optax_snoo._src.muon_sharding` runs the
plan (the ``jax.shard_map`` exchange); the steps are described there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.sharding import axes_of, concrete_sharding, is_split, spec_entries
from optax_snoo._src.utils import path_to_str

__all__ = ["Exchange", "Group", "Leaf", "NewtonSchulzPlan", "Placement", "describe_leaf",
           "newton_schulz_flops", "place_leaves", "plan_exchanges", "plan_groups"]


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
