"""Grafting: one transformation's direction with another's per-leaf norm."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class GraftState(NamedTuple):
    """State of `graft`: the two inner states.

    Attributes:
      magnitude: state of the transformation that sets the norm.
      direction: state of the transformation that sets the direction.
    """

    magnitude: optax.OptState
    direction: optax.OptState


def graft(magnitude: optax.GradientTransformation,
          direction: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    r"""Per leaf, ``direction``'s update rescaled to the norm of ``magnitude``'s update.

    Both transformations receive the same incoming updates (and all extra arguments);
    the output leaf is ``d · ‖m‖ / ‖d‖`` (Frobenius norms in float32; 0 where ``‖d‖ = 0``),
    in the dtype of ``d``.

    Args:
      magnitude: e.g. ``optax.scale_by_adam(b1=0.0)`` (Adam grafting) or
        ``optax.identity()`` (SGD grafting).
      direction: e.g. `optax_snoo.kfac.scale_by_kfac`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state `GraftState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.kfac import graft
      >>> tx = graft(optax.scale(2.0), optax.scale_by_sign())
      >>> u, _ = tx.update({"w": jnp.array([3.0, -4.0])}, tx.init(None))
      >>> u["w"].tolist()
      [7.071067810058594, -7.071067810058594]

    References:
      Agarwal et al., `Disentangling Adaptive Gradient Methods from Learning Rates
      <https://arxiv.org/abs/2002.11803>`_, 2020
    """
    magnitude = optax.with_extra_args_support(magnitude)
    direction = optax.with_extra_args_support(direction)

    def init_fn(params):
        return GraftState(magnitude=magnitude.init(params), direction=direction.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        m_updates, m_state = magnitude.update(updates, state.magnitude, params, **extra_args)
        d_updates, d_state = direction.update(updates, state.direction, params, **extra_args)

        def rescale(m, d):
            # Summed over all axes in place: flattening a column-split matrix first would
            # gather it whole on every device.
            m_norm = jnp.sqrt(jnp.sum(jnp.square(m.astype(jnp.float32))))
            d_norm = jnp.sqrt(jnp.sum(jnp.square(d.astype(jnp.float32))))
            ratio = jnp.where(d_norm > 0, m_norm / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)
            return (d.astype(jnp.float32) * ratio).astype(d.dtype)

        return jax.tree.map(rescale, m_updates, d_updates), GraftState(m_state, d_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
