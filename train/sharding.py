"""The device mesh `("data", "fsdp", "tensor")` and the shardings of state and batches.

With `--mesh_diloco=M` > 1 the mesh is `("diloco", "data", "fsdp", "tensor")`: M DiLoCo
replicas, each a `(data, fsdp, tensor)` mesh of its own; params and optimizer state carry
a leading replica axis over `diloco`, and batches split their rows over all of
`("diloco", "data", "fsdp")` (each replica its own rows).

Parameters are sharded by their logical axis names (`models.logical_rules`: `embed` over
`fsdp`; `mlp`, `heads`, `kv`, `vocab` over `tensor`); optimizer-state leaves created from
sharded parameters inherit those shardings; every other leaf (counts, scalars, RNG) is
replicated. Batches `(A, B, T)` split their batch axis over `("data", "fsdp")`.

Example:
  >>> from train.config import TrainConfig, override
  >>> mesh = make_mesh(override(TrainConfig(), mesh_data=1))
  >>> mesh.axis_names
  ('data', 'fsdp', 'tensor')

References:
  Xu et al., "GSPMD: General and Scalable Parallelization for ML Computation Graphs",
  https://arxiv.org/abs/2105.04663, 2021.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train.config import TrainConfig

__all__ = [
    "MESH_AXES",
    "REPLICA_AXIS",
    "batch_sharding",
    "check_batch_size",
    "make_mesh",
    "mesh_shape",
    "process_rows",
    "put_batch",
    "replica_axis",
    "replica_zero",
    "replicated",
    "tree_shardings",
]

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
REPLICA_AXIS = "diloco"


def mesh_shape(config: TrainConfig, num_devices: int) -> tuple[int, int, int]:
    """Axis sizes from `config.mesh` (`--mesh_data/fsdp/tensor`); a -1 takes the devices
    the others leave.

    Raises:
      ValueError: if the sizes need more devices than `num_devices`, or -1 cannot fill
        evenly.
    """
    sizes = list(config.mesh.sizes)
    flags = " ".join(f"--mesh_{axis}={size}" for axis, size in zip(MESH_AXES, sizes, strict=True))
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(f"{flags}: the fixed axes' product {fixed} does not divide "
                             f"the {_count(num_devices, 'device')}, so -1 cannot fill them")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) > num_devices:
        raise ValueError(f"{flags}: the mesh needs {_count(math.prod(sizes), 'device')}; "
                         f"{num_devices} available")
    return tuple(sizes)


def make_mesh(config: TrainConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `("data", "fsdp", "tensor")` mesh (Auto axes) over the first devices needed;
    with `--mesh_diloco=M` > 1, `("diloco", "data", "fsdp", "tensor")`, each replica's
    axes sized from its `devices / M` devices.

    Raises:
      ValueError: if the devices do not split into M replicas of the asked axes.
    """
    devices = list(jax.devices() if devices is None else devices)
    replicas = config.mesh.diloco
    if replicas == 1:
        shape = mesh_shape(config, len(devices))
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                             devices=devices[:math.prod(shape)])
    if len(devices) % replicas:
        raise ValueError(f"--mesh_diloco={replicas}: {len(devices)} devices do not split into "
                         f"{replicas} replicas")
    shape = (replicas, *mesh_shape(config, len(devices) // replicas))
    return jax.make_mesh(shape, (REPLICA_AXIS, *MESH_AXES), axis_types=(AxisType.Auto,) * 4,
                         devices=devices[:math.prod(shape)])


def replica_axis(mesh: Mesh) -> int:
    """The number of DiLoCo replicas of `mesh` (1 without a `diloco` axis)."""
    return mesh.shape.get(REPLICA_AXIS, 1)


def replica_zero(shardings: Any, mesh: Mesh) -> tuple[Any, Any]:
    """`(take, shardings0)`: `take(tree)` is replica 0 of a replica-stacked tree sharded
    as `shardings` (each leaf `x[0]`, jitted, laid out as `shardings0`: the leaf's spec
    without its `diloco` axis). Without a `diloco` axis, the identity and `shardings`."""
    if replica_axis(mesh) == 1:
        return (lambda tree: tree), shardings
    out = jax.tree.map(lambda s: NamedSharding(mesh, P(*s.spec[1:])), shardings)
    return jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree), out_shardings=out), out


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that keeps a full copy on every device of `mesh`."""
    return NamedSharding(mesh, P())


def _batch_axes(mesh: Mesh) -> tuple[str, ...]:
    return (REPLICA_AXIS, *BATCH_AXES) if REPLICA_AXIS in mesh.axis_names else BATCH_AXES


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of `(A, B, T)` token arrays: B over `("data", "fsdp")` (and first
    `diloco`: replica r holds the r-th block of B / M rows)."""
    return NamedSharding(mesh, P(None, _batch_axes(mesh), None))


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """Each leaf's own `NamedSharding` on `mesh`, or replicated when it has none there."""

    def sharding(x):
        s = getattr(x, "sharding", None)
        return s if isinstance(s, NamedSharding) and s.mesh == mesh else replicated(mesh)

    return jax.tree.map(sharding, tree)


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
    """Raise unless `batch_size` splits evenly over the mesh's data-parallel devices (the
    product of its `diloco`, `data` and `fsdp` axes): each holds its own rows.

    Raises:
      ValueError: naming the batch size, the device count and the nearest that work.
    """
    axes = _batch_axes(mesh)
    ways = math.prod(mesh.shape[a] for a in axes)
    if batch_size % ways:
        below, above = batch_size // ways * ways, (batch_size // ways + 1) * ways
        fits = " or ".join(f"--batch_size={b}" for b in (below, above) if b > 0)
        raise ValueError(f"--batch_size={batch_size} does not divide over the "
                         f"{_count(ways, 'data-parallel device')} (mesh "
                         f"{'*'.join(axes)}={ways}; each holds its own rows): expected a "
                         f"multiple of {ways}, e.g. {fits}, or a mesh with fewer "
                         "data-parallel devices (--mesh_data, --mesh_fsdp)")


def _count(n: int, noun: str) -> str:
    """`"1 device"`, `"8 devices"`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of a `(A, batch_size, T)` batch that this process's devices hold.

    Raises:
      ValueError: if the batch does not divide over the mesh, or this process's rows are
        not one contiguous range (a mesh whose batch axes interleave processes).
    """
    check_batch_size(batch_size, sharding.mesh)
    indices = sharding.addressable_devices_indices_map((1, batch_size, 1)).values()
    rows = sorted({(i[1].start or 0, batch_size if i[1].stop is None else i[1].stop)
                   for i in indices})
    if any(a[1] != b[0] for a, b in itertools.pairwise(rows)):
        raise ValueError(f"process {jax.process_index()} holds batch rows {rows}: expected one "
                         "contiguous range; order the mesh devices by process")
    return slice(rows[0][0], rows[-1][1])


def put_batch(x: np.ndarray, sharding: NamedSharding, batch_size: int | None = None
              ) -> jax.Array:
    """Place a host batch `(A, B, T)` on the mesh.

    Args:
      x: the whole global batch (the same on every process), or, with `batch_size`, only
        this process's rows `process_rows(sharding, batch_size)` of it.
      sharding: `batch_sharding(mesh)`.
      batch_size: the global batch size when `x` holds one process's rows.

    Raises:
      ValueError: if the batch axis does not divide over `("data", "fsdp")`.
    """
    if batch_size is not None:
        check_batch_size(batch_size, sharding.mesh)
        shape = (x.shape[0], batch_size, *x.shape[2:])
        return jax.make_array_from_process_local_data(sharding, x, shape)
    check_batch_size(x.shape[1], sharding.mesh)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
