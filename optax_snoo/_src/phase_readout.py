"""The normalized orthogonal phase readout (modded-nanogpt Track 3 result #43): evaluate the
final weights moved along the part of their last velocity change that is orthogonal to
the velocity.

A readout in `optax_snoo.eval_params`' sense: it changes the weights a trainer evaluates
and saves after the last update, never the weights training continues from. Its readout
point lives in a `optax_snoo.TailEmaState` (blend 1 after update ``end``, 0 otherwise), so
`eval_params` applies it with the library's other readouts, in the chain's order.

Reference: Jesse Clark (jn2clark), modded-nanogpt Track 3 result #43, tail phase readout
(records/track_3_optimization/results/20260529_tail_phase_readout_2850;
https://github.com/KellerJordan/modded-nanogpt/pull/318), 2026.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.averaging import TailEmaState
from optax_snoo._src.utils import concrete_real, is_integer, state_dtype

__all__ = ["PhaseReadoutState", "phase_readout"]

# The record's guards: on ||v||^2 in the projection, added to ||phase|| in the rescale.
_VELOCITY_SQ_FLOOR = 1e-20
_PHASE_NORM_EPS = 1e-12


class PhaseReadoutState(NamedTuple):
    """State of `phase_readout`.

    Attributes:
      count: number of updates so far (int32).
      first: the weights after update ``t0`` (float32, float64 for float64 params; zeros
        before; ``optax.MaskedNode`` on leaves under ``optax.masked``'s mask).
      readout: a `TailEmaState` whose ``ema`` holds the weights after update ``t1`` until
        update ``end``, then the readout point; its ``blend`` is 1 after update ``end``
        (``eval_params`` evaluates the point) and 0 otherwise (the params).
    """

    count: jax.Array
    first: Any
    readout: TailEmaState


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _readout_point(w: jax.Array, theta0: jax.Array, theta1: jax.Array, kappa: Any,
                   velocity_weight: Any, orthogonal: bool, normalize: bool) -> jax.Array:
    """``w + γ v + κ φ`` for one leaf (the record's per-tensor formula)."""
    prev = theta1 - theta0
    v = w - theta1
    phase = v - prev
    if orthogonal:
        c = jnp.sum(phase * v) / jnp.maximum(jnp.sum(v * v), _VELOCITY_SQ_FLOOR)
        phase = phase - c * v
    if normalize:
        phase = phase * (jnp.linalg.norm(v) / (jnp.linalg.norm(phase) + _PHASE_NORM_EPS))
    dt = w.dtype
    return w + jnp.asarray(velocity_weight, dt) * v + jnp.asarray(kappa, dt) * phase


def phase_readout(
    t0: int,
    t1: int,
    end: int,
    kappa: float = 0.01,
    *,
    velocity_weight: float = 0.0,
    orthogonal: bool = True,
    normalize: bool = True,
) -> optax.GradientTransformation:
    r"""Copy the weights after updates ``t0`` and ``t1``; evaluate the weights after update
    ``end`` moved along their velocity change's part orthogonal to the velocity.

    A pass-through transformation (the update is unchanged) placed last in a chain: it
    sees the post-step weights ``w = params + update``, keeps ``θ0`` (after update
    ``t0``) and ``θ1`` (after ``t1``), and after update ``end`` computes, per leaf,

    .. math::

        d = \theta_1 - \theta_0,\quad v = w - \theta_1,\quad a = v - d,\quad
        \varphi = a - \frac{\langle a, v\rangle}{\max(\lVert v\rVert^2, 10^{-20})}\,v,\quad
        \varphi \leftarrow \varphi\,\frac{\lVert v\rVert}{\lVert\varphi\rVert + 10^{-12}},

    and the weights to evaluate (`eval_params`) after that update are
    ``w + γ v + κ φ``: ``φ`` is the change of the velocity between the two windows with
    its component along the current velocity removed, rescaled to the velocity's norm.
    Before update ``end``, after it, and on other leaves they are ``w``. This changes
    what is evaluated and saved, not the training weights (the record moves its weights
    at its last validation, after its last update, and trains no further).

    #43 (on #41's stack, on the hidden matrices other than attention's V and O, the
    last of its 2850 updates): ``phase_readout(2650, 2750, 2850, kappa=0.01)`` (its
    ``PHASE_READOUT_GAMMA`` 0, ``MODE=orthogonal``, ``NORMALIZE_PHASE=1``). In a chain
    it comes after #43's TrailDelta (`optax_snoo.delta_pulses`: its ``θ1`` and ``w`` are
    the weights after the pulses at 2750 and 2850), and before the final readout toward
    the step-2400 anchor (``w ← w + 0.08 (anchor - w)`` on all but the token embedding,
    applied to this readout's result: `eval_params` applies readouts in the chain's
    order).

    Differences from the record: the copies and the readout are float32 (float64 for
    float64 params) where the record keeps them in the param dtype (float32 for #43's
    hidden matrices), and the readout point is cast to the param dtype by `eval_params`.
    The record's per-step velocities (``PHASE_READOUT_PER_STEP``) and move cap
    (``PHASE_READOUT_MAX_MOVE_RATIO``), both off in #43, are left out.

    Args:
      t0: the update count (>= 1) after which ``θ0`` is copied.
      t1: the update count (> ``t0``) after which ``θ1`` is copied.
      end: the update count (>= ``t1``) whose weights are read out (the run's last).
      kappa: ``κ``, the step along ``φ`` (#43: 0.01).
      velocity_weight: ``γ``, the step along ``v`` (#43: 0).
      orthogonal: remove ``φ``'s component along ``v`` (#43: True; False: ``φ = a``).
      normalize: rescale ``φ`` to ``‖v‖`` (#43: True).

    Returns:
      An ``optax.GradientTransformation`` with state `PhaseReadoutState` (two copies of
      the read-out params); ``update`` needs ``params``. To read out only some leaves,
      wrap it in ``optax.masked`` (or put it in one group of ``optax.partition``).

    Raises:
      ValueError: at construction, update counts out of order or not integers, or a
        ``kappa``/``velocity_weight`` that is not a finite number.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(optax.sgd(1.0), optax_snoo.phase_readout(1, 2, 3, kappa=0.5))
      >>> state = tx.init(params)
      >>> for g in ([1.0, 0.0], [1.0, 1.0], [1.0, 3.0]):  # w: (-1,0), (-2,-1), (-3,-4)
      ...     updates, state = tx.update({"w": jnp.array(g)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> # v = (-1,-3), a = v - (-1,-1) = (0,-2), phi = a - 0.6 v = (0.6,-0.2), x5: (3,-1)
      >>> [round(x, 3) for x in optax_snoo.eval_params(params, state)["w"].tolist()]
      [-1.5, -4.5]

    References:
      Jesse Clark (jn2clark), `modded-nanogpt Track 3 result #43, tail phase readout
      (results/20260529_tail_phase_readout_2850: maybe_capture_phase_readout_anchor,
      maybe_apply_phase_readout) <https://github.com/KellerJordan/modded-nanogpt/pull/318>`_,
      2026.
    """
    for name, value, minimum in (("t0", t0, 1), ("t1", t1, t0 + 1 if is_integer(t0) else 1),
                                 ("end", end, t1 if is_integer(t1) else 1)):
        if not is_integer(value) or value < minimum:
            raise ValueError(f"phase_readout: {name} must be an integer >= {minimum}, got "
                             f"{value!r} (t0 < t1 <= end)")
    for name, value in (("kappa", kappa), ("velocity_weight", velocity_weight)):
        known = concrete_real(value)
        if callable(value) or (known is not None and not abs(known) < float("inf")):
            raise ValueError(f"phase_readout: {name} must be a finite number, got {value!r}")

    def init_fn(params):
        def zeros():  # each buffer its own: a trainer donates the state
            return jax.tree.map(
                lambda p: p if _skipped(p) else jnp.zeros_like(p, dtype=state_dtype(None, p)),
                params, is_leaf=_skipped)
        live = [p for p in jax.tree.leaves(params, is_leaf=_skipped) if not _skipped(p)]
        blend_dtype = jnp.result_type(jnp.float32, *live) if live else jnp.float32
        blend_dtype = jax.dtypes.canonicalize_dtype(blend_dtype)
        return PhaseReadoutState(
            count=jnp.zeros([], jnp.int32), first=zeros(),
            readout=TailEmaState(count=jnp.zeros([], jnp.int32),
                                 blend=jnp.zeros([], blend_dtype), ema=zeros()))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("phase_readout: update needs params (it reads out the "
                             "post-step weights params + updates)")
        t = optax.safe_increment(state.count)

        def leaf(f, e, p, u):
            if _skipped(f):
                return f, e
            w = p.astype(f.dtype) + u.astype(f.dtype)
            first = jnp.where(t == t0, w, f)
            second = jnp.where(t == t1, w, e)  # θ1 until the readout replaces it
            read = lambda w, a, b: _readout_point(w, a, b, kappa, velocity_weight, orthogonal,
                                                  normalize)
            point = jax.lax.cond(t == end, read, lambda w, a, b: w, w, first, second)
            return first, jnp.where(t == end, point, second)

        firsts, treedef = jax.tree.flatten(state.first, is_leaf=_skipped)
        pairs = [leaf(f, e, p, u) for f, e, p, u in zip(
            firsts, treedef.flatten_up_to(state.readout.ema), treedef.flatten_up_to(params),
            treedef.flatten_up_to(updates), strict=True)]
        blend = jnp.where(t == end, 1.0, 0.0).astype(state.readout.blend.dtype)
        readout = TailEmaState(count=t, blend=blend,
                               ema=jax.tree.unflatten(treedef, [e for _, e in pairs]))
        return updates, PhaseReadoutState(
            count=t, first=jax.tree.unflatten(treedef, [f for f, _ in pairs]),
            readout=readout)

    return optax.GradientTransformation(init_fn, update_fn)
