"""Small helpers shared by every transformation: key paths and argument checks."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["concrete_real", "is_integer", "is_real", "path_names", "path_to_str"]


def path_names(path: Sequence[Any]) -> tuple[str, ...]:
    """A pytree key path as a tuple of strings, the one rule every module uses.

    Dict keys, attribute names, sequence indices and flattened indices become strings;
    the ``.value`` attribute of a Flax NNX variable is dropped, so an ``nnx.State`` leaf
    reads like the module attribute it came from; keys containing ``"/"`` are split, so
    ``{"l1": {"kernel": x}}`` and ``{"l1/kernel": x}`` name the same leaf.
    """
    names: list[str] = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            if key.name == "value":
                continue
            part = key.name
        elif isinstance(key, jax.tree_util.DictKey):
            part = str(key.key)
        elif isinstance(key, jax.tree_util.SequenceKey):
            part = str(key.idx)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            part = str(key.key)
        else:
            part = str(key)
        names.extend(part.split("/"))
    return tuple(names)


def path_to_str(path: Sequence[Any]) -> str:
    """A pytree key path written as ``"blocks/0/attn/c_q/kernel"`` (see `path_names`)."""
    return "/".join(path_names(path))


def is_real(x: Any) -> bool:
    """Whether ``x`` is a concrete real number (not a bool, an array or a schedule)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_integer(x: Any) -> bool:
    """Whether ``x`` is a concrete integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def concrete_real(x: Any) -> float | None:
    """``x`` as a float when its value is known now, else ``None``.

    Known: a real number (`is_real`) or a concrete scalar array, e.g. the hyperparameter
    arrays `optax.inject_hyperparams` hands to a factory at ``init``. Unknown: tracers
    (inside ``jit``), schedules and other callables, non-scalar arrays, bools. Use it to
    validate an argument that may also arrive as an array, without reading a tracer.
    """
    if is_real(x):
        return float(x)
    if (isinstance(x, jax.Array | np.ndarray) and not isinstance(x, jax.core.Tracer)
            and x.shape == () and jnp.issubdtype(x.dtype, jnp.number)
            and not jnp.issubdtype(x.dtype, jnp.complexfloating)):
        return float(x)
    return None
