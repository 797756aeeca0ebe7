"""Host-side K-FAC helpers for trainers: find the K-FAC states, read refresh events,
seed the factors before training (warm start)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_snoo._src.kfac.blocks import flatten_curvature, flatten_nested, label, nested
from optax_snoo._src.kfac.factors import LayerCurvature
from optax_snoo._src.kfac.transform import KfacRefreshEvent, ScaleByKfacState


def _is_state(x: Any) -> bool:
    return isinstance(x, ScaleByKfacState)


def kfac_states(opt_state: Any) -> list[ScaleByKfacState]:
    """Every `ScaleByKfacState` inside an optimizer state, in tree order.

    Works through ``chain``, ``partition``, ``masked``, ``inject_hyperparams``, Snoo and
    ``nnx.Optimizer``'s state (any pytree holding the K-FAC state as a node); traceable, so
    a train step can return ``kfac_states(opt_state)[0].event`` with its metrics.

    Args:
      opt_state: any optimizer state.

    Returns:
      The K-FAC states found (possibly none).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.kfac import kfac_states, scale_by_kfac
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), scale_by_kfac())
      >>> len(kfac_states(tx.init({"l": {"kernel": jnp.ones((2, 2))}})))
      1
    """
    return [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]


def _host_scalar(x: Any) -> Any:
    """A scalar leaf on host; nnx.Optimizer wraps state leaves in Variables (get_value)."""
    getter = getattr(x, "get_value", None)
    return np.asarray(getter() if callable(getter) else x).item()


def event_row(event: KfacRefreshEvent) -> dict[str, Any]:
    """One refresh event as a host dict (a row of a trainer's refresh log).

    Args:
      event: a `KfacRefreshEvent` (device arrays, numpy values after ``jax.device_get``,
        or nnx Variables).

    Returns:
      ``{"refresh", "step", "lr", "a_eig_max", "a_eig_min", "g_eig_max", "g_eig_min",
      "num_clipped"}`` as Python ints and floats: the number of refreshes so far, the
      update count and learning rate of the latest one, the extreme raw eigenvalues of the
      A and G factors over all layers, and how many eigenvalues were floored.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import event_row, scale_by_kfac
      >>> state = scale_by_kfac().init({"l": {"kernel": jnp.ones((2, 2))}})
      >>> event_row(state.event)["step"]
      -1
    """
    e = event
    return {"refresh": int(_host_scalar(e.count)), "step": int(_host_scalar(e.step)),
            "lr": float(_host_scalar(e.learning_rate)),
            "a_eig_max": float(_host_scalar(e.a_max)),
            "a_eig_min": float(_host_scalar(e.a_min)),
            "g_eig_max": float(_host_scalar(e.g_max)),
            "g_eig_min": float(_host_scalar(e.g_min)),
            "num_clipped": int(_host_scalar(e.num_clipped))}


def refresh_events(opt_state: Any) -> list[dict[str, Any]]:
    """The latest refresh of every K-FAC transform in an optimizer state, as host dicts.

    Args:
      opt_state: any optimizer state (chain, partition, snoo, nnx.Optimizer's state...).

    Returns:
      One `event_row` per `ScaleByKfacState` found (tree order). A trainer writes a row
      when ``refresh`` grows.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import refresh_events, scale_by_kfac
      >>> state = scale_by_kfac().init({"l": {"kernel": jnp.ones((2, 2))}})
      >>> refresh_events(state)[0]["refresh"]
      0
    """
    return [event_row(s.event) for s in kfac_states(opt_state)]


def estimate_factors(curvature_batches: Sequence[Any]) -> Any:
    """Average several batches' curvature trees (same structure): the warm-start estimate.

    Args:
      curvature_batches: a non-empty sequence of curvature trees (see `scale_by_kfac`).

    Returns:
      A curvature tree of the same structure with the mean factors (float32).

    Raises:
      ValueError: an empty sequence or trees of different structure.
    """
    batches = list(curvature_batches)
    if not batches:
        raise ValueError("estimate_factors needs at least one curvature batch.")
    structures = {jax.tree.structure(b) for b in batches}
    if len(structures) != 1:
        raise ValueError("estimate_factors: the curvature batches have different structures.")
    return jax.tree.map(lambda *xs: sum(jnp.asarray(x, jnp.float32) for x in xs) / len(xs),
                        *batches)


def warm_start(opt_state: Any, curvature_batches: Sequence[Any]) -> Any:
    """Seed the K-FAC factors from a few batches before training .

    Every `ScaleByKfacState` in ``opt_state`` gets, for each of its layers, the mean of
    the batches' factors (`estimate_factors`) and an EMA weight equal to the number of
    batches (the estimate counts as that many equally weighted batches; later batches
    enter with weight ``1/w`` as usual). The update count, cached inverses and refresh
    event are unchanged: with a policy that refreshes at step 0 (``every(n, first=0)``)
    the first inverse then comes from these batches plus the first training batch rather
    than from one warm-up batch. Entries of the batches for layers of no K-FAC state are
    ignored (they may belong to another optimizer group).

    Args:
      opt_state: an optimizer state containing one or more `ScaleByKfacState`.
      curvature_batches: curvature trees from `layer_factors` on a few batches (e.g.
        forward/backward passes without updates).

    Returns:
      ``opt_state`` with the factors replaced.

    Raises:
      ValueError: no K-FAC state found, or a K-FAC layer missing from the batches.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import LayerCurvature, scale_by_kfac, warm_start
      >>> state = scale_by_kfac().init({"l": {"kernel": jnp.ones((2, 2))}})
      >>> c = {"l": {"kernel": LayerCurvature(jnp.eye(2), jnp.eye(2))}}
      >>> float(warm_start(state, [c, c]).factor_weight)
      2.0
    """
    batches = list(curvature_batches)
    estimate = flatten_curvature(estimate_factors(batches), "curvature_batches")
    if not kfac_states(opt_state):
        raise ValueError("warm_start: no ScaleByKfacState in opt_state.")

    def seed(s):
        if not isinstance(s, ScaleByKfacState):
            return s
        old = flatten_nested(s.factors, LayerCurvature)
        new = {}
        for names, f in old.items():
            if names not in estimate:
                raise ValueError(f"warm_start: the curvature batches have no entry for the "
                                 f"K-FAC layer {label(names)}.")
            c = estimate[names]
            if c.a.shape != f.a.shape or c.g.shape != f.g.shape:
                raise ValueError(
                    f"warm_start: {label(names)} has a {c.a.shape}, g {c.g.shape}; "
                    f"expected {f.a.shape} and {f.g.shape}.")
            new[names] = LayerCurvature(c.a.astype(f.a.dtype), c.g.astype(f.g.dtype),
                                        f.kernel_axes)
        return s._replace(factors=nested(new),
                          factor_weight=jnp.asarray(len(batches), s.factor_weight.dtype))

    return jax.tree.map(seed, opt_state, is_leaf=lambda x: isinstance(x, ScaleByKfacState))
