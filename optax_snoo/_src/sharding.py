"""Reading shardings: the helpers Muon's and K-FAC's device plans share.

A leaf's `NamedSharding` is known for a concrete array (its ``.sharding``), for an
abstract one (`jax.ShapeDtypeStruct` with a sharding) and, under ``jax.jit``, for a
tracer only when its mesh axes are Explicit (the spec is then part of its type).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

__all__ = ["axes_of", "concrete_sharding", "is_split", "spec_entries"]


def concrete_sharding(x: Any) -> NamedSharding | None:
    """The `NamedSharding` of ``x`` on a multi-device mesh, else None.

    ``x`` may be a concrete array, a `jax.ShapeDtypeStruct` carrying a sharding, or a
    tracer (whose type carries a spec only on Explicit mesh axes).
    """
    if isinstance(x, jax.core.Tracer):
        try:
            sharding = jax.typeof(x).sharding
        except (AttributeError, TypeError):
            return None
        spec_axes = [a for a in getattr(sharding, "spec", ()) if a is not None]
        if not spec_axes or not isinstance(sharding, NamedSharding):
            return None
        return sharding if sharding.mesh.size > 1 else None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding
    return None


def spec_entries(sharding: NamedSharding, ndim: int) -> tuple[Any, ...]:
    """The sharding's spec padded with None to ``ndim`` entries."""
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def is_split(entries: Sequence[Any], mesh: Any) -> bool:
    """Whether some entry of a spec splits its axis (names a mesh axis of size > 1)."""
    sizes = mesh.shape
    return any(sizes[a] > 1 for e in entries for a in axes_of(e))
