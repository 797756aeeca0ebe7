"""Small helpers shared by every transformation: key paths and argument checks."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_float_dtype", "check_int_at_least", "check_non_negative", "check_positive",
           "check_unit_interval", "concrete_real", "is_integer", "is_real", "path_names",
           "path_to_str", "state_dtype", "value_at"]


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


def state_dtype(dtype: Any, like: Any) -> jnp.dtype:
    """The dtype of an optimizer statistic kept for ``like`` (a param, or a dtype).

    ``dtype`` when given; ``None``: float32 widened to ``like``'s dtype, so statistics are
    float32 for bfloat16, float16 and float32 params (the library's default) and float64
    for float64 params (a float64 run is float64 throughout).
    """
    if dtype is not None:
        return jnp.dtype(dtype)
    # canonical: float32 again where x64 is off (a numpy float64 param stays float32)
    return jax.dtypes.canonicalize_dtype(jnp.promote_types(jnp.result_type(like), jnp.float32))


def value_at(value: Any, count: Any) -> Any:
    """A hyperparameter at update ``count``: ``value(count)`` for a schedule (any callable),
    else ``value`` itself (a number or an array, as optax's ``ScalarOrSchedule``)."""
    return value(count) if callable(value) else value


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


# One rule for every constructor: a value known now (`concrete_real`: a number or a
# concrete scalar array, such as `optax.inject_hyperparams` hands a factory) is checked;
# a schedule or a tracer passes, since its values are only known later. With
# ``allow_none=True`` a ``None`` passes and the message says that ``None`` is allowed.


def _or_none(allow_none: bool) -> str:
    return " or None" if allow_none else ""


def check_unit_interval(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` (when known now) lies in [0, 1)."""
    if value is None and allow_none:
        return
    v = concrete_real(value)
    if v is not None and not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1){_or_none(allow_none)}, got {value!r}.")


def check_non_negative(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` (when known now) is >= 0."""
    if value is None and allow_none:
        return
    v = concrete_real(value)
    if v is not None and not v >= 0:  # NaN fails too
        raise ValueError(f"{name} must be >= 0 (a float or a schedule){_or_none(allow_none)}, "
                         f"got {value!r}.")


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` (when known now) is > 0."""
    if value is None and allow_none:
        return
    v = concrete_real(value)
    if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0{_or_none(allow_none)}, got {value!r}.")


def check_int_at_least(name: str, value: Any, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a Python int (not a bool) >= ``minimum``."""
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def check_float_dtype(name: str, dtype: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``dtype`` is a floating dtype."""
    if dtype is None and allow_none:
        return
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.bfloat16)"
                         f"{_or_none(allow_none)}, got {dtype!r}.")
