"""Radius steps: the learning-rate step of modded-nanogpt Track 3's hidden matrices.

Records #5 (MuonH), #9 (u/w floor), #29 (radial brake and radius pin; #38 ramps the brake
and floor late) and #46 (RowFloor, cautious weight decay after the pin) of
modded-nanogpt's optimization track act on the *radius* ``‖W‖`` of each hidden matrix.
None of them is additive in the learning rate (the pin rescales the post-step weight,
the hyperball's step is relative to ``‖W‖``), so
they are one transform, `radius_steps`, that takes the learning rate and produces the
final update. It stands where ``optax.scale_by_learning_rate`` would:
``chain(scale_by_muon(...), radius_steps(lr, ...))``.

References:
  Jordan et al., `modded-nanogpt Track 3 (optimization) records #5, #9, #29, #38, #46
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.newton_schulz import _check_matrix_axes, _normalized_axes
from optax_snoo._src.utils import check_non_negative, concrete_real, state_dtype, value_at
from optax_snoo._src.weight_decay import cautious_mask

__all__ = ["RadiusStepsState", "radius_steps"]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]

# The records' clamps: ‖W‖² in the brake, norms in the floor and pin, norms in MuonH.
_BRAKE_EPS = 1e-12
_NORM_EPS = 1e-8
_HYPERBALL_EPS = 1e-10


class RadiusStepsState(NamedTuple):
    """State of `radius_steps`.

    Attributes:
      count: number of updates so far (int32), the learning-rate schedule's argument.
      initial_radius: with ``pin="initial"``, each matrix's Frobenius norm at ``init``
        (float32, float64 for float64 params; shape of the leaf with the two matrix axes
        kept as size 1); otherwise
        ``optax.EmptyState()``.
    """

    count: jax.Array
    initial_radius: Any


def _skipped(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def radius_steps(
    learning_rate: ScalarOrSchedule,
    *,
    brake: ScalarOrSchedule | None = 0.5,
    floor: ScalarOrSchedule | None = 0.3825,
    floor_per: str = "fan_out",
    pin: str | None = "first_order",
    cautious_weight_decay: ScalarOrSchedule = 0.025,
    matrix_axes: tuple[int, int] = (-2, -1),
    hyperball_eps: str = "clamp",
) -> optax.GradientTransformation:
    r"""The step ``W ← W - lr·O`` of a hidden matrix, with Track 3's radius controls.

    Put it in place of ``optax.scale_by_learning_rate``: it receives the direction ``O``
    (e.g. Muon's orthogonalised momentum; the step descends along ``-O``) and returns
    the final update ``W_new - W``. Per matrix (``matrix_axes`` = ``(fan_in, fan_out)``;
    other axes are a batch, as an expert stack), with ``‖·‖`` the Frobenius norm and
    ``⟨·,·⟩`` its inner product, in float32 (float64 for float64 params) and in this
    order:

    1. radial brake (``brake=s``, #29): ``c = ⟨O,W⟩/max(‖W‖², 1e-12)``; the radial part
       ``cW`` is multiplied by ``s`` where the step moves ``W`` outward (``c < 0``):
       ``O ← O - cW + s·cW``; inward radial parts are kept.
    2. update floor (``floor=t``, #9, #46): ``floor_per="matrix"``: if
       ``‖O‖ < t·‖W‖``, ``O ← O·t‖W‖/‖O‖`` (a relative step ``‖ΔW‖/‖W‖ >= t·lr``);
       ``floor_per="fan_out"`` (#46's RowFloor: a PyTorch "row" is an output neuron, a
       fan-out index of a Flax ``(in, out)`` kernel): each neuron's slice
       ``O_j ← O_j·max(1, t‖W_j‖/‖O_j‖)``, no renormalisation. Norms clamped at 1e-8.
    3. the step and the radius pin:

       - ``pin="first_order"`` (#29): ``r* = max(‖W‖ - lr⟨O,W⟩/‖W‖, 1e-8)``, the
         radius the step would give to first order; ``W' = W - lr·O`` is rescaled to
         norm ``r*`` (the finite tangential growth ``lr²‖O_⊥‖²/2‖W‖`` is removed);
       - ``pin="initial"``, the hyperball (MuonH #5, NorMuonH #8, AdamH #4): with
         ``R = ‖W₀‖`` recorded at ``init``, ``W' = W - lr·R·O/max(‖O‖, 1e-10)`` and
         ``W' ← W'·R/max(‖W'‖, 1e-10)``: a step of relative size ``lr`` on the sphere
         of the initial radius (a zero matrix stays zero). ``floor`` must be None;
       - ``pin="current"``: the same step with ``R = ‖W‖``, the radius the matrix has
         now (#5's ``scale_invariant_update_`` as written): the same as ``"initial"``
         unless something else changes ``‖W‖``, as MuLoCo's outer step does (#13);
       - ``pin=None``: ``W' = W - lr·O``.
    4. cautious weight decay after the pin (``cautious_weight_decay=λ``, #46):
       ``W' ← W'·(1 - lr·λ·m)`` with ``m = 1[O·W > 0]`` from the final ``O`` and the
       pre-step ``W`` (the coordinates the step already shrinks). The pin removes any
       decay applied before it; this one survives as a change of shape.
       (`add_decoupled_weight_decay` with ``cautious=True`` is the before-the-step form.)

    #46's Muon group is ``radius_steps(lr)`` (the defaults); #29's is
    ``radius_steps(lr, floor_per="matrix", cautious_weight_decay=0.0)``; MuonH's is
    ``radius_steps(lr, brake=None, floor=None, pin="initial", cautious_weight_decay=0.0)``.
    #38 ramps the brake and the floor late in training (schedules of the update count):
    ``radius_steps(lr, brake=optax.linear_schedule(0.5, 0.4, 500, 2400),
    floor=optax.linear_schedule(0.3825, 0.4, 400, 2400), floor_per="matrix",
    cautious_weight_decay=0.0)``.

    Args:
      learning_rate: ``lr``, a float >= 0 or a schedule of the update count.
      brake: factor on the outward radial component, a float >= 0 or a schedule of the
        update count (``None``: no brake; 1.0 is the same).
      floor: the floor target ``t`` on ``‖O‖/‖W‖``, a float >= 0 or a schedule of the
        update count (``None``: no floor).
      floor_per: ``"matrix"`` (the scalar floor of #9) or ``"fan_out"`` (RowFloor, #46).
      pin: ``"first_order"``, ``"initial"`` (the hyperball), ``"current"`` (the hyperball
        at the present radius) or ``None``.
      cautious_weight_decay: ``λ`` of the post-pin decay, a float >= 0 or a schedule of
        the update count (0: none).
      matrix_axes: ``(fan_in axis, fan_out axis)`` of every leaf, as in `scale_by_muon`.
      hyperball_eps: how the hyperball pins guard ``‖O‖`` and ``‖W'‖``: ``"clamp"``,
        ``max(·, 1e-10)`` (#4, #5, #8), or ``"add"``, ``· + 1e-10`` (#33's PSGD).

    Returns:
      An ``optax.GradientTransformation`` with state `RadiusStepsState`; ``update`` needs
      ``params``. Every leaf must have at least two axes (put 1-D parameters in another
      ``optax.partition`` group); ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for a negative learning rate, brake, floor or decay, an unknown
        ``floor_per`` or ``pin``, a floor with ``pin="initial"``, bad ``matrix_axes``; at
        ``init``/``update`` for a leaf with fewer than two axes or missing ``params``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import radius_steps, scale_by_muon
      >>> params = {"w": jnp.eye(4)}
      >>> tx = optax.chain(scale_by_muon(), radius_steps(0.05, pin="initial", brake=None,
      ...                                                floor=None, cautious_weight_decay=0.0))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.arange(16.0).reshape(4, 4)}
      >>> for _ in range(3):
      ...     updates, state = tx.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> round(float(jnp.linalg.norm(params["w"])), 5)  # the hyperball keeps ‖W₀‖ = 2
      2.0

    References:
      Jordan et al., `modded-nanogpt Track 3 records #5 (MuonH), #9 (u/w floor), #29
      (radial brake, radius pin), #38 (the brake and floor ramped late), #46 (RowFloor,
      post-pin cautious weight decay)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
      Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_, 2025.
    """
    check_non_negative("radius_steps: learning_rate", learning_rate)
    check_non_negative("radius_steps: brake", brake, allow_none=True)
    check_non_negative("radius_steps: floor", floor, allow_none=True)
    check_non_negative("radius_steps: cautious_weight_decay", cautious_weight_decay)
    if floor_per not in ("matrix", "fan_out"):
        raise ValueError(
            f"radius_steps: floor_per must be 'matrix' or 'fan_out', got {floor_per!r}")
    if pin not in ("first_order", "initial", "current", None):
        raise ValueError(f"radius_steps: pin must be 'first_order', 'initial', 'current' or "
                         f"None, got {pin!r}")
    if hyperball_eps not in ("clamp", "add"):
        raise ValueError(f"radius_steps: hyperball_eps must be 'clamp' or 'add', got "
                         f"{hyperball_eps!r}")
    if pin in ("initial", "current") and floor is not None:
        raise ValueError(
            f"radius_steps: floor={floor!r} has no effect with pin={pin!r} (the hyperball's "
            "step has relative size lr); pass floor=None")
    axes = _check_matrix_axes(matrix_axes)
    decays = concrete_real(cautious_weight_decay) != 0.0

    def leaf_axes(x: jax.Array) -> tuple[int, int]:
        return _normalized_axes(x.shape, axes)

    def init_fn(params: optax.Params) -> RadiusStepsState:
        def radius(p):
            if _skipped(p):
                return p
            return jnp.sqrt(jnp.sum(jnp.square(p.astype(state_dtype(None, p))),
                                    axis=leaf_axes(p), keepdims=True))

        for p in jax.tree.leaves(params, is_leaf=_skipped):
            if not _skipped(p):
                leaf_axes(p)
        initial = (jax.tree.map(radius, params, is_leaf=_skipped) if pin == "initial"
                   else optax.EmptyState())
        return RadiusStepsState(count=jnp.zeros([], jnp.int32), initial_radius=initial)

    def step(o: jax.Array, w: jax.Array, r0: Any, lr: jax.Array, wd: jax.Array,
             brake: Any, floor: Any) -> jax.Array:
        ax = leaf_axes(w)
        dt = jnp.promote_types(state_dtype(None, o), state_dtype(None, w))
        of, wf = o.astype(dt), w.astype(dt)
        # the schedules' values in the leaf's arithmetic (float64 ones are not rounded)
        lr, wd = jnp.asarray(lr, dt), jnp.asarray(wd, dt)
        brake = None if brake is None else jnp.asarray(brake, dt)
        floor = None if floor is None else jnp.asarray(floor, dt)

        def inner(x, y):
            return jnp.sum(x * y, axis=ax, keepdims=True)

        def norm(x, axis=ax):
            return jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))

        w_norm = norm(wf)
        if brake is not None:
            c = inner(of, wf) / jnp.maximum(jnp.square(w_norm), _BRAKE_EPS)
            # The step is -lr·O, so c < 0 is an outward radial move.
            of = of + (jnp.where(c < 0, brake, 1.0) - 1.0) * c * wf
        if pin in ("initial", "current"):
            r0 = w_norm if pin == "current" else r0
            guard = ((lambda n: n + _HYPERBALL_EPS) if hyperball_eps == "add"
                     else (lambda n: jnp.maximum(n, _HYPERBALL_EPS)))
            new = wf - lr * r0 * of / guard(norm(of))
            new = new * (r0 / guard(norm(new)))
        else:
            w_c = jnp.maximum(w_norm, _NORM_EPS)
            if floor is not None:
                per = ax if floor_per == "matrix" else ax[0]
                w_ref = w_c if floor_per == "matrix" else jnp.maximum(norm(wf, per), _NORM_EPS)
                o_ref = jnp.maximum(norm(of, per), _NORM_EPS)
                of = of * jnp.maximum(floor * w_ref / o_ref, 1.0)
            new = wf - lr * of
            if pin == "first_order":
                target = jnp.maximum(w_c - lr * inner(of, wf) / w_c, _NORM_EPS)
                new = new * (target / jnp.maximum(norm(new), _NORM_EPS))
        if decays:
            new = new * (1.0 - lr * wd * cautious_mask(of, wf, strict=True))
        return (new - wf).astype(o.dtype)

    def update_fn(updates: optax.Updates, state: RadiusStepsState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, RadiusStepsState]:
        if params is None:
            raise ValueError("radius_steps: update needs params (the radius is ‖params‖)")
        count = state.count
        lr = jnp.asarray(value_at(learning_rate, count))
        wd = jnp.asarray(value_at(cautious_weight_decay, count))
        brake_t = None if brake is None else jnp.asarray(value_at(brake, count))
        floor_t = None if floor is None else jnp.asarray(value_at(floor, count))

        def leaf(o, w, r0=None):
            return o if _skipped(o) else step(o, w, r0, lr, wd, brake_t, floor_t)

        if pin == "initial":
            new = jax.tree.map(leaf, updates, params, state.initial_radius, is_leaf=_skipped)
        else:
            new = jax.tree.map(leaf, updates, params, is_leaf=_skipped)
        return new, RadiusStepsState(count=optax.safe_increment(count),
                                     initial_radius=state.initial_radius)

    return optax.GradientTransformation(init_fn, update_fn)
