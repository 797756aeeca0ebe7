"""Muown: each matrix as per-row gains times unit directions, the directions moved by a
Muon-style direction with a scheduled radius, the gains by Adam.

References:
  fhuebler and kcc-lion, `Muown <https://arxiv.org/abs/2605.10797>`_, 2026; modded-nanogpt
  Track 3 result #23 (`results/20260508_muown
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.newton_schulz import _check_matrix_axes, _normalized_axes
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_unit_interval,
    path_to_str,
    state_dtype,
    value_at,
)

__all__ = ["MuownState", "muown"]


class MuownState(NamedTuple):
    """State of `muown`.

    Attributes:
      count: number of updates so far (int32).
      gain: ``g``, each output neuron's gain (the leaf's shape with the fan_in axis of size
        1; float32, float64 for float64 params).
      radius0: ``r₀``, each direction's radius at init (shaped as ``gain``): where the
        V-norm schedule starts.
      gain_mu: Adam's first moment of the gains.
      gain_nu: Adam's second moment of the gains.
      inner_state: the direction's state.
    """

    count: jax.Array
    gain: Any
    radius0: Any
    gain_mu: Any
    gain_nu: Any
    inner_state: Any


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def muown(
    direction: optax.GradientTransformation,
    learning_rate: float | optax.Schedule,
    *,
    radius_target: float | Callable[[str], float] = 2.688,
    radius_steps: int = 3200,
    radius_power: float | None = None,
    gain_b1: float = 0.9,
    gain_b2: float = 0.95,
    gain_eps: float = 1e-8,
    zero_row_gain: float = 0.33**0.5,
    norm_eps: float = 1e-12,
    matrix_axes: tuple[int, int] = (-2, -1),
) -> optax.GradientTransformationExtraArgs:
    r"""Muown (modded-nanogpt Track 3 result #23): ``W = g · v/‖v‖`` per output neuron.

    Each matrix ``W`` (rows = output neurons: the lines along the fan_out axis, norms over
    the fan_in axis) is a gain ``g`` per row times a unit direction. At init
    ``g = r₀ = ‖W_i‖`` (``zero_row_gain`` for a zero row: the record zero-initialises its
    projections, whose rows then get that norm at the first update). With ``t`` the update
    count, ``η`` the learning rate and ``G`` the gradient::

        u = W / g;   r = r₀ + (R - r₀) s(clip((t-1)/(T-1), 0, 1))   # s(p) = p²(3 - 2p),
                                                                 # or p^q (radius_power)
        v = r u                                         # the direction at radius r
        G_g = Σ_in G ⊙ u;   G_v = (g/r) (G - u G_g)      # the gradients of g and of v
        O = direction(G_v)                              # e.g. Muon (Polar Express), scaled
        v' = v - η O
        g' = Adam(g, G_g; η, gain_b1, gain_b2, gain_eps)   # bias-corrected
        W' = g' v' / max(‖v'_i‖, norm_eps)

    and the update is ``W' - W``. The direction moves on the sphere of radius ``r``: a
    growing ``r`` (the V-norm schedule, ``R = radius_target``, ``T = radius_steps``)
    shrinks its angular step; the row norms are ``g``, trained by Adam. The record's
    ``direction`` is Muon with summed Nesterov momentum 0.95 (EMA momentum of ``G_v/(1-β)``
    is the same), Polar Express (12 iterations), shape scale ``0.2 sqrt(max(m, n))``
    (`scale_by_muon`'s ``shape_scale="consistent_rms"``).

    Args:
      direction: the transformation turning ``G_v`` into ``O`` (its updates are used as
        they are; no learning rate, no sign).
      learning_rate: ``η`` of both the directions and the gains, a float or a schedule.
      radius_target: ``R``, a float or a function of the leaf's path string
        (``"blocks/0/mlp/c_proj/kernel"``) giving it (#23: 2.688, times 10/3 on mlp.proj).
      radius_steps: ``T`` (#23: its 3200 training steps).
      radius_power: ``None``: the smoothstep ``s(p) = p²(3 - 2p)`` (#23); a number ``q > 0``:
        ``s(p) = p^q`` (#31: 0.9 over 3005 of its 3000 steps).
      gain_b1: Adam's first-moment decay for the gains (#23: 0.9).
      gain_b2: Adam's second-moment decay (#23: 0.95).
      gain_eps: Adam's epsilon (#23: 1e-8).
      zero_row_gain: the gain and radius of a zero row at init (#23: ``sqrt(0.33)``).
      norm_eps: the floor on row norms (#23: 1e-12).
      matrix_axes: ``(fan_in, fan_out)`` axes of every leaf (Flax ``(in, out)`` kernels:
        ``(-2, -1)``); other axes are a batch.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose updates are final (the learning
      rate applied); its state is a `MuownState`. ``update`` needs ``params``.

    Raises:
      ValueError: for a negative learning rate, betas outside [0, 1), a non-positive
        ``gain_eps``, ``zero_row_gain``, ``norm_eps`` or ``radius_target``,
        ``radius_steps < 1``, a non-positive ``radius_power``, bad ``matrix_axes``; at
        init, a leaf with fewer than two axes; at update, no params.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import muown, scale_by_muon
      >>> params = {"w": jnp.ones((8, 4)) * 0.1}
      >>> tx = muown(scale_by_muon(0.95, shape_scale="consistent_rms"), 0.0035,
      ...            radius_steps=100)
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((8, 4))}, state, params)
      >>> updates["w"].shape
      (8, 4)

    References:
      fhuebler and kcc-lion, `Muown <https://arxiv.org/abs/2605.10797>`_, 2026;
      modded-nanogpt Track 3 result #23 (`results/20260508_muown
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
      2026
    """
    check_non_negative("learning_rate", learning_rate)
    check_unit_interval("gain_b1", gain_b1)
    check_unit_interval("gain_b2", gain_b2)
    check_positive("gain_eps", gain_eps)
    check_positive("zero_row_gain", zero_row_gain)
    check_positive("norm_eps", norm_eps)
    check_int_at_least("radius_steps", radius_steps, 1)
    if radius_power is not None:
        check_positive("radius_power", radius_power)
    if not callable(radius_target):
        check_positive("radius_target", radius_target)
    if not isinstance(direction, optax.GradientTransformation):
        raise ValueError(f"direction must be an optax.GradientTransformation (e.g. "
                         f"scale_by_muon(...)), got {type(direction).__name__}.")
    axes = _check_matrix_axes(matrix_axes)
    target_of = radius_target if callable(radius_target) else (lambda _: radius_target)

    def row_axis(x: Any) -> int:
        if jnp.ndim(x) < 2:
            raise ValueError(f"muown: a leaf of shape {jnp.shape(x)} has no matrix axes; "
                             f"Muown's leaves are matrices (send the others to Adam).")
        return _normalized_axes(jnp.shape(x), axes)[0]  # norms run over fan_in

    def row_norm(x: jax.Array) -> jax.Array:
        return jnp.sqrt(jnp.sum(jnp.square(x), axis=row_axis(x), keepdims=True))

    def init_fn(params: optax.Params) -> MuownState:
        def gain(p):
            if _skipped(p):
                return p
            n = row_norm(p.astype(state_dtype(None, p)))
            return jnp.where(n <= norm_eps, zero_row_gain, jnp.maximum(n, norm_eps))

        g = jax.tree.map(gain, params, is_leaf=_skipped)
        # Each state leaf its own buffer: a trainer that donates the state refuses one
        # buffer twice.
        fresh = lambda make: jax.tree.map(lambda x: x if _skipped(x) else make(x), g,
                                          is_leaf=_skipped)
        return MuownState(jnp.zeros([], jnp.int32), g, fresh(jnp.copy),
                          fresh(jnp.zeros_like), fresh(jnp.zeros_like),
                          direction.init(params))

    def update_fn(updates: optax.Updates, state: MuownState, params: optax.Params | None = None,
                  **extra: Any) -> tuple[optax.Updates, MuownState]:
        if params is None:
            raise ValueError("muown: update needs params (the weights it recomposes).")
        count = state.count
        t = count.astype(jnp.result_type(float))
        p = jnp.clip((t - 1) / max(radius_steps - 1, 1), 0.0, 1.0) if radius_steps > 1 \
            else jnp.ones_like(t)
        progress = p * p * (3.0 - 2.0 * p) if radius_power is None else p**radius_power
        lr = value_at(learning_rate, count)
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_skipped)
        paths = [path_to_str(k) for k, _ in with_paths]
        leaves = [w for _, w in with_paths]
        grads = treedef.flatten_up_to(updates)
        gains, radii0 = treedef.flatten_up_to(state.gain), treedef.flatten_up_to(state.radius0)
        pre = []
        for path, w, grad, g, r0 in zip(paths, leaves, grads, gains, radii0, strict=True):
            if _skipped(w):
                pre.append(None)
                continue
            dt = g.dtype
            r = r0 + (target_of(path) - r0) * progress
            u = w.astype(dt) / g
            gg = jnp.sum(grad.astype(dt) * u, axis=row_axis(w), keepdims=True)
            gv = (g / r) * (grad.astype(dt) - u * gg)
            pre.append((u * r, gg, gv.astype(grad.dtype)))
        inner_in = treedef.unflatten([w if x is None else x[2]
                                      for w, x in zip(leaves, pre, strict=True)])
        directions, inner_state = direction.update(inner_in, state.inner_state, params, **extra)
        outs, new_g, new_mu, new_nu = [], [], [], []
        b1, b2 = gain_b1, gain_b2
        n = t + 1
        mus, nus = treedef.flatten_up_to(state.gain_mu), treedef.flatten_up_to(state.gain_nu)
        for w, x, o, g, mu, nu in zip(leaves, pre, treedef.flatten_up_to(directions), gains,
                                      mus, nus, strict=True):
            if x is None:
                outs.append(w), new_g.append(g), new_mu.append(mu), new_nu.append(nu)
                continue
            v, gg, _ = x
            dt = g.dtype
            v_new = v - lr * o.astype(dt)
            mu = b1 * mu + (1 - b1) * gg
            nu = b2 * nu + (1 - b2) * gg * gg
            step = (mu / (1 - b1**n)) / (jnp.sqrt(nu / (1 - b2**n)) + gain_eps)
            g = g - lr * step
            w_new = g * (v_new / jnp.maximum(row_norm(v_new), norm_eps))
            outs.append((w_new - w.astype(dt)).astype(w.dtype))
            new_g.append(g), new_mu.append(mu), new_nu.append(nu)
        unflat = treedef.unflatten
        return unflat(outs), MuownState(optax.safe_increment(count), unflat(new_g),
                                        state.radius0, unflat(new_mu), unflat(new_nu),
                                        inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
