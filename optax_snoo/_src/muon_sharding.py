"""Newton-Schulz on sharded params: the ``shard_map`` exchange of whole matrices to devices.

No collective runs inside the iteration; the plan it follows (groups, owners, layouts)
is computed in numpy by `optax_snoo._src.muon_plan`.

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

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.muon_plan import (
    Exchange,
    Group,
    Leaf,
    NewtonSchulzPlan,
    Placement,
    _assign,
    _Layout,
    _layout,
    _parts,
    _Slot,
    describe_leaf,
    place_leaves,
    plan_exchanges,
)
from optax_snoo._src.utils import path_to_str

__all__ = ["MatrixPrecondition", "OwnedPreconditionState", "OwnersWork", "apply_batched",
           "from_stack", "init_precondition", "orthogonalize_leaves", "orthogonalize_sharded",
           "owners_work", "to_stack"]


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
        and the new state; ``G`` the raw gradient, or a tuple of matrices of ``M``'s
        shape (the gradient and whatever else the transform reads per matrix, e.g. PSGD's
        probes; each travels to the owner beside ``M``); ``count`` the update count,
        ``flags`` a static numpy bool array of the batch's shape (each matrix's leaf
        flag).
      flags: ``(leaf paths, params treedef) -> list of bools``: a static per-leaf switch
        the transform reads (e.g. SOAP's trust gate), or None (all False).
      apply_stacks: ``(Ms, Gs, states, count, flags) -> (Ds, states)``: ``apply`` on
        several stacks at once (lists, one stack ``(..., out_k, in_k)`` per matrix shape,
        with its state and flags), for a transform that batches work across shapes
        (SOAP: one basis refresh per Gram size); None: ``apply`` once per stack.

    Every device hands all the matrices it preconditions in one call (`apply_batched`):
    those of one shape concatenated into one stack, so a precondition's work runs as
    one batched operation per shape, not one per leaf.
    """

    init: Callable[[int, int, int, Any], Any]
    apply: Callable[..., tuple[jax.Array, Any]]
    flags: Callable[[list[str], Any], list[bool]] | None = None
    apply_stacks: Callable[..., tuple[list[jax.Array], list[Any]]] | None = None


def _join(xs: Sequence[Any]) -> Any:
    """Pytrees of like structure concatenated along their leading axis."""
    return xs[0] if len(xs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *xs)


def apply_batched(pre: MatrixPrecondition, Ms: Sequence[jax.Array], Gs: Sequence[jax.Array],
                  states: Sequence[Any], count: jax.Array, flags: Sequence[np.ndarray]
                  ) -> tuple[list[jax.Array], list[Any]]:
    """``pre`` on batches of matrices ``(*batch_k, out_k, in_k)``, each with its state
    (leaves ``(*batch_k, ...)``) and flags (numpy bools of shape ``batch_k``): the batches
    of one matrix shape concatenated into one stack ``(B, out, in)`` (a shape only one
    batch has stays as it is), one ``apply`` per shape (or one ``apply_stacks`` over all
    the shapes), the results cut back into the batches."""
    if not Ms:  # an owner without matrices
        return [], []
    shapes: dict[tuple[Any, ...], list[int]] = {}
    for k, m in enumerate(Ms):  # by shape and dtypes (a float64 leaf keeps its own)
        key = (*m.shape[-2:], m.dtype, *(g.dtype for g in jax.tree.leaves(Gs[k])),
               *(x.dtype for x in jax.tree.leaves(states[k])))
        shapes.setdefault(key, []).append(k)
    flat = lambda x, b: x.reshape(math.prod(b), *x.shape[len(b):])
    stacks = []
    for ks in shapes.values():
        if len(ks) == 1:  # a shape of its own: as it is
            stacks.append((Ms[ks[0]], Gs[ks[0]], states[ks[0]], flags[ks[0]]))
            continue
        batch = [Ms[k].shape[:-2] for k in ks]
        stacks.append((
            _join([flat(Ms[k], b) for k, b in zip(ks, batch, strict=True)]),
            _join([jax.tree.map(lambda x, b=b: flat(x, b), Gs[k])
                   for k, b in zip(ks, batch, strict=True)]),
            _join([jax.tree.map(lambda x, b=b: flat(x, b), states[k])
                   for k, b in zip(ks, batch, strict=True)]),
            np.concatenate([np.asarray(flags[k], bool).reshape(-1) for k in ks])))
    ms, gs, sts, fs = (list(z) for z in zip(*stacks, strict=True))
    if pre.apply_stacks is not None:
        Ds, news = pre.apply_stacks(ms, gs, sts, count, fs)
    else:
        Ds, news = map(list, zip(*map(pre.apply, ms, gs, sts, [count] * len(ms), fs),
                                 strict=True))
    out_d: list[Any] = [None] * len(Ms)
    out_s: list[Any] = [None] * len(Ms)
    for ks, D, new in zip(shapes.values(), Ds, news, strict=True):
        if len(ks) == 1:
            out_d[ks[0]], out_s[ks[0]] = D, new
            continue
        start = 0
        for k in ks:
            batch = Ms[k].shape[:-2]
            n = math.prod(batch)
            cut = lambda x, b=batch, s=start, n=n: x[s:s + n].reshape(*b, *x.shape[1:])
            out_d[k], out_s[k] = cut(D), jax.tree.map(cut, new)
            start += n
    return out_d, out_s


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
      grads: the raw gradients (with ``precondition``), or per leaf a tuple of arrays of
        its shape (`MatrixPrecondition.apply`'s ``G``).
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
        if local:
            done = _precondition_leaves(precondition, [xs[i] for i in local],
                                        [grads[i] for i in local],
                                        [leaf_states[i] for i in local],
                                        [axes[i] for i in local], count,
                                        [flags[i] for i in local])
            for i, (x, st) in zip(local, done, strict=True):
                xs[i], new_leaves[i] = x, st
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


def _precondition_leaves(pre: MatrixPrecondition, xs: Sequence[jax.Array],
                         gs: Sequence[jax.Array], states: Sequence[Any],
                         axes: Sequence[tuple[int, int]], count: jax.Array,
                         flags: Sequence[bool]) -> list[tuple[jax.Array, Any]]:
    """The per-leaf path: the leaves' matrices preconditioned where they lie, in one
    `apply_batched` (one stack per matrix shape)."""
    ms = [_to_record(x, a) for x, a in zip(xs, axes, strict=True)]
    record = lambda g, a, m: jax.tree.map(lambda x: _to_record(x, a).astype(m.dtype), g)
    ds, states = apply_batched(
        pre, ms, [record(g, a, m) for g, a, m in zip(gs, axes, ms, strict=True)], states,
        count, [np.full(m.shape[:-2], f) for m, f in zip(ms, flags, strict=True)])
    return [(_from_record(d, a), st) for d, a, st in zip(ds, axes, states, strict=True)]


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


def _pick(stack: jax.Array, index: Sequence[int]) -> jax.Array:
    """``stack[index]``, as a (strided) slice where the indices are evenly spaced."""
    step = index[1] - index[0] if len(index) > 1 else 1
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(index)):
        return stack[index[0]:index[-1] + 1:step]
    return stack[np.asarray(index)]


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
    grad_tree: Any = jax.tree.structure(0)  # of ``G``: the raw gradient alone, or a tuple


def _precondition_owned(step: _OwnerStep, lay: _Layout, profile: tuple[_Slot, ...],
                        x: jax.Array, state: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """The precondition on an owner's whole matrices (momentum and the leaves of ``G``
    side by side in ``x``), each in (fan_out, fan_in) layout, with its flat ``state``
    row."""
    m, *g = (jax.lax.bitcast_convert_type(x[:, k * lay.length:(k + 1) * lay.length],
                                          step.dtype)
             for k in range(1 + step.grad_tree.num_leaves))
    ms, gs, states, off = [], [], [], 0
    recs = [(lambda v: v) if slot.transpose else (lambda v: jnp.swapaxes(v, -1, -2))
            for slot in profile]
    g_slots = zip(*(_assemble(lay, profile, v) for v in g), strict=True)
    for slot, rec, mm, gg in zip(profile, recs, _assemble(lay, profile, m), g_slots,
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
        ms.append(rec(mm))
        gs.append(step.grad_tree.unflatten([rec(v) for v in gg]))
        states.append(treedef.unflatten(pieces))
    # All of the owner's matrices in one call: one stack per shape.
    ds, new_states = apply_batched(step.transform, ms, gs, states, step.count,
                                   [np.full((slot.count,), slot.flag) for slot in profile])
    outs = [rec(d) for rec, d in zip(recs, ds, strict=True)]
    news = [jnp.ravel(v).astype(step.dtype) for new in new_states for v in jax.tree.leaves(new)]
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

    With a precondition ``step`` the operands are the momentum's blocks, the blocks of
    each leaf of ``G`` (the raw gradient, or a tuple) and the owners' flat state; all the
    matrices travel in the same all-to-all, the owner preconditions them before its
    iteration and returns its state.
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
            n_lists = 1 + step.grad_tree.num_leaves
            lists = [operands[k * n_in:(k + 1) * n_in] for k in range(n_lists)]
            state = operands[n_lists * n_in]
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
        gradients (or tuples of arrays), the owners' states and the count; None: none.

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
        step, flags, in_dtype, n_lists = None, (), ns_dtype, 1
        if precondition is not None:
            # The precondition reads the momentum and the gradient as the single-device
            # path does: in the state's dtype (float32), not the iteration's.
            table = precondition.owned[n]
            in_dtype = table.dtype
            grad_tree = jax.tree.structure(precondition.grads[ex.groups[0].leaves[0].index])
            step = _OwnerStep(precondition.transform, precondition.count, in_dtype,
                              jnp.dtype(f"uint{8 * in_dtype.itemsize}"), table.shape[1],
                              grad_tree)
            flags, n_lists = precondition.flags, 1 + grad_tree.num_leaves

        operands = _stacks(xs, parts, specs, mesh, in_dtype, step.wire if step else wire)
        owner_spec = _owner_spec(ex)
        if step is not None:
            by_leaf = [jax.tree.leaves(g) for g in precondition.grads]
            for k in range(n_lists - 1):  # each leaf of G: one more list of blocks
                operands += _stacks([g[k] for g in by_leaf], parts, specs, mesh,
                                    in_dtype, step.wire)
            operands.append(precondition.owned[n])
        body = jax.shard_map(_exchange_body(ex, mesh, newton_schulz, ns_dtype, wire, step,
                                            flags),
                             mesh=mesh,
                             in_specs=(*specs * n_lists, owner_spec) if step else specs,
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


def _unchanged(x: jax.Array) -> jax.Array:
    """The stand-in for Newton-Schulz where none follows the precondition: the matrices
    unchanged."""
    return x


class OwnersWork(NamedTuple):
    """A `MatrixPrecondition` that is a whole transform's per-matrix work (SOAP's, Shampoo's,
    PSGD Kron's), run on each matrix's owner by the exchange with no Newton-Schulz after
    it: each whole matrix's inputs go to its owner in one all-to-all, the owner keeps that
    matrix's state, the direction comes back in a second (`orthogonalize_leaves`).

    Build it with `owners_work`; `axes` are every leaf's ``(fan_in, fan_out)`` axes as the
    exchange reads them (negative counts from the end)."""

    precondition: MatrixPrecondition
    axes: tuple[int, int]
    plan: NewtonSchulzPlan
    mesh: Any
    split: bool

    def leaf_axes(self, x: Any) -> tuple[int, int]:
        """Leaf `x`'s ``(fan_in, fan_out)`` axes, non-negative."""
        nd = jnp.ndim(x)
        return self.axes[0] % nd, self.axes[1] % nd

    def init(self, params: Any) -> tuple[list[Any], Any, tuple[jax.Array, ...]]:
        """`(per-leaf states, the params' treedef, the owners' states)` for `params`."""
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths, leaves = [path_to_str(p) for p, _ in with_paths], [p for _, p in with_paths]
        per_leaf, owned = init_precondition(
            self.precondition, leaves, [self.leaf_axes(p) for p in leaves],
            place_leaves(self.plan, paths, [[p] for p in leaves]), mesh=self.mesh,
            split=self.split)
        return per_leaf, treedef, owned

    def run(self, xs: Sequence[jax.Array], paths: Sequence[str],
            located: Sequence[Sequence[Any]], *, grads: Sequence[Any],
            leaf_states: Sequence[Any], owned: tuple[jax.Array, ...], count: jax.Array,
            dtype: Any) -> tuple[list[jax.Array], list[Any], tuple[jax.Array, ...]]:
        """`(directions, per-leaf states, owners' states)` of the precondition on `xs`.

        Args:
          xs: the matrices each leaf sends (its moment).
          paths: the leaves' paths (`path_to_str`).
          located: per leaf, arrays that say where it lies (gradient, moment).
          grads, leaf_states, owned, count: as in `orthogonalize_leaves`.
          dtype: the dtype the owners compute in.
        """
        return orthogonalize_leaves(
            xs, [self.leaf_axes(x) for x in xs], place_leaves(self.plan, paths, located),
            newton_schulz=_unchanged, ns_dtype=dtype, mesh=self.mesh, split=self.split,
            precondition=self.precondition, grads=grads, leaf_states=leaf_states,
            owned=owned, count=count)


def owners_work(name: str, precondition: MatrixPrecondition, axes: tuple[int, int], *,
                newton_schulz_plan: NewtonSchulzPlan | None, mesh: Any,
                shard_matrices: bool) -> OwnersWork:
    """`OwnersWork` for transform `name` on leaves' ``(fan_in, fan_out)`` `axes`, its
    ``newton_schulz_plan`` checked (one line naming `name` and the expected type); the
    plan's mesh unless `mesh` is given."""
    if newton_schulz_plan is not None and not isinstance(newton_schulz_plan, NewtonSchulzPlan):
        raise ValueError(f"{name}: newton_schulz_plan must be a NewtonSchulzPlan (e.g. "
                         f"NewtonSchulzPlan.from_params(params)), got {newton_schulz_plan!r}.")
    plan = newton_schulz_plan or NewtonSchulzPlan()
    return OwnersWork(precondition, axes, plan, mesh if mesh is not None else plan.mesh,
                      shard_matrices)
