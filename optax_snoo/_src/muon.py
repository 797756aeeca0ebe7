"""Muon's direction: `scale_by_muon` (momentum, orthogonalisation, shape scale) and its state.

`scale_by_muon` is the direction (momentum, Newton-Schulz orthogonalisation, optional
NorMuon normalisation, update smoothing, shape scale), `MuonState` its state and
`muon_momentum_warmup` the record's momentum warm-up. The iteration and its coefficient
presets are in `optax_snoo._src.newton_schulz`, the whole-tree optimizer `muon` (Muon on
matrices and matrix stacks, AdamW groups on the rest) in `optax_snoo._src.muon_adam`,
`scale_by_normuon` and `normuon` in `optax_snoo._src.normuon`. On sharded params the
iteration runs on whole matrices assigned to devices (see `scale_by_muon`'s
``shard_newton_schulz``; `optax_snoo._src.muon_plan` and `optax_snoo._src.muon_sharding`).

Differences from `optax.contrib.muon` (optax 0.2.8), here and in `muon`, all deliberate:

- the momentum is not bias-corrected by default (modded-nanogpt); `bias_correction=True`
  reproduces optax's corrected momentum and Nesterov step exactly;
- the iteration runs in `ns_dtype` (bfloat16 by default, as in the record), not in the
  gradient dtype, and the momentum is kept in float32 for bf16/f16/f32 params (float64
  for float64 params);
- leaves with more than two axes are stacks of matrices (`matrix_axes` names the two
  matrix axes), so MoE expert weights `(E, in, out)` get Muon instead of silently going
  to Adam;
- weight decay takes a per-leaf multiplier (the record's `wd_mul`);
- the AdamW group does not use Nesterov momentum unless `adam_nesterov=True` (optax's
  `muon(nesterov=True)` applies Nesterov to both groups; ours keeps AdamW plain, as the
  record does);
- on sharded params each device orthogonalises whole matrices of its own
  (`shard_newton_schulz`); optax leaves the iteration to the partitioner.

References:
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024

  Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
  <https://github.com/KellerJordan/modded-nanogpt>`_ (records), 2024-2025

  Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_,
  2025 (Moonlight; the consistent-RMS shape scale)

  Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their Application to
  the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.muon_plan import NewtonSchulzPlan, place_leaves
from optax_snoo._src.muon_sharding import (
    MatrixPrecondition,
    OwnedPreconditionState,
    _unchanged,
    init_precondition,
    orthogonalize_leaves,
)
from optax_snoo._src.newton_schulz import (
    Coefficients,
    _check_matrix_axes,
    _check_ns_normalization,
    _newton_schulz,
    _normalized_axes,
    _resolve_coefficients,
    gram_frobenius_norm,
    leverage_balanced,
    soft_polar,
)
from optax_snoo._src.newton_schulz import tempered_polar as tempered
from optax_snoo._src.utils import (
    check_float_dtype,
    check_non_negative,
    check_positive,
    check_unit_interval,
    concrete_real,
    path_to_str,
    state_dtype,
    value_at,
)

SMOOTHING_FORMS = ("ema", "nesterov")
SPECTRAL_MAPS = (None, "contra", "power", "soft")
NORMUON_NORMS = ("frobenius", "gram_frobenius")
#: Soft-Muon's series (modded-nanogpt Track 3 result #20, ``_soft_coefficients``): per
#: power ``p``, the weights of the Newton-Schulz iterates ``X_0 .. X_12`` of the
#: ``"track3"`` iteration whose sum has singular values close to ``σ^p``.
SOFT_MUON_SERIES: dict[float, tuple[float, ...]] = {
    0.0: (0.0,) * 12 + (1.0,),
    0.1: (0.1091613623, 0.07085664498, 0.05210528973, 0.05457295795, 0.05011334061,
          0.03334622198, 0.05022104481, 0.1053727358, 0.1187323776, 0.1185061091,
          0.1185059576, 0.1185059576, 0.0),
}
SHAPE_SCALES = ("modded", "consistent_rms")


class MuonState(NamedTuple):
    """State of `scale_by_muon`.

    Attributes:
      count: number of updates so far (int32 scalar); schedules are evaluated at it.
      mu: momentum buffer, shaped like the params, in ``mu_dtype`` (by default float32,
        float64 for float64 params).
      smooth: update-smoothing buffer (shaped like the params, float32 or float64 as
        ``mu``), or ``optax.EmptyState()`` when smoothing is off.
      nu: NorMuon's second moment (float32 or float64 as ``mu``, shaped like the params
        with the reduced matrix axis of size 1), or ``optax.EmptyState()`` without
        ``beta2``.
      precondition: the `MatrixPrecondition`'s state (`OwnedPreconditionState`), or
        ``optax.EmptyState()`` without one.
    """

    count: jax.Array
    mu: optax.Updates
    smooth: optax.Updates | optax.EmptyState
    nu: optax.Updates | optax.EmptyState = optax.EmptyState()
    precondition: optax.OptState = optax.EmptyState()


def _resolve_shape_scale(shape_scale: Any) -> str | None:
    """``True``/``"modded"`` -> "modded", ``"consistent_rms"``, ``False``/``None`` -> None."""
    if shape_scale is True:
        return "modded"
    if shape_scale is False or shape_scale is None:
        return None
    if isinstance(shape_scale, str) and shape_scale in SHAPE_SCALES:
        return shape_scale
    raise ValueError(
        f"shape_scale must be one of {SHAPE_SCALES}, True (= 'modded'), False or None "
        f"(no scale); got {shape_scale!r}.")


def _shape_factor(kind: str | None, fan_in: int, fan_out: int) -> float:
    if kind == "modded":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if kind == "consistent_rms":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    return 1.0


def scale_by_muon(
    beta: float | optax.Schedule = 0.95,
    *,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    beta2: float | optax.Schedule | None = None,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    mu_dtype: jax.typing.DTypeLike | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    precondition: MatrixPrecondition | None = None,
    ns_normalization: str = "frobenius",
    spectral_map: str | None = None,
    spectral_strength: float | optax.Schedule = 0.4,
    spectral_input_scale: float = 1.0,
    soft_power: float = 0.1,
    soft_contra: float | optax.Schedule = 0.0,
    normuon_norm: str = "frobenius",
    aurora_iterations: int | None = None,
    aurora_beta: float = 0.5,
    orthogonalize: bool = True,
    normuon_square: bool = True,
    tempered_polar: float | optax.Schedule | None = None,
    tempered_polar_max: float = 0.25,
) -> optax.GradientTransformation:
    r"""The Muon direction: orthogonalised momentum, scaled by the matrix shape.

    For each leaf (a matrix, or a stack of matrices whose two matrix axes are
    ``matrix_axes``), with gradient ``g`` and ``t`` the update count::

        m = β m + (1-β) g                                 # float32 buffer
        v = β m + (1-β) g   if nesterov else   m          # EMA form of Nesterov
        v = precondition(v, g)                            # if precondition, per matrix (below)
        O = orthogonalize(v)                              # each matrix on its own
                                       # (O = v with orthogonalize=False, below)
                                       # (Aurora's polar(D v) if aurora_iterations, below;
                                       # Soft-Muon's blend if spectral_map="soft", below)
        O = temper(O, v)                                  # if tempered_polar (below)
        O = contra(O, v)                                  # if spectral_map="contra" (below)
        O = power(O, v)                                   # if spectral_map="power" (below)
        O = normuon(O)                                    # if beta2 (NorMuon, below)
        S = σ S + (1-σ) O;  O = S (ema) or σ S + (1-σ) O (nesterov)   # if smoothing
        update = s(fan_in, fan_out) * O                   # shape scale

    with ``s = sqrt(max(1, fan_out / fan_in))`` (``shape_scale="modded"``, the record's)
    or ``s = 0.2 sqrt(max(fan_in, fan_out))`` (``"consistent_rms"``, Moonlight's: the
    update's RMS matches AdamW's, about 0.2, so AdamW's learning rate and weight decay
    carry over).

    NorMuon (``beta2`` set; Li et al. 2025, as modded-nanogpt's current record runs it):
    with ``r`` the shorter matrix axis (``fan_in`` for a square matrix, so the statistic
    is per output neuron), ``q = mean_r(O²)`` (one value per row of the longer axis),
    ``ν = β₂ ν + (1-β₂) q``, ``D = O / sqrt(max(ν, 1e-10))`` and
    ``O = D ‖O‖_F / max(‖D‖_F, 1e-10)``: each neuron's update gets the same RMS on
    average, and the matrix keeps the Frobenius norm orthogonalisation gave it
    (``normuon_norm="gram_frobenius"``: the norm ``‖·‖₄`` below, as Track 3 result #20).

    Preconditioning (``precondition`` set, e.g. `soap_whitening` for SOAP-Muon): a
    `MatrixPrecondition`, a function of each matrix alone (its Newton-Schulz input ``v``,
    its raw gradient ``g`` and its own state) that returns the matrix to orthogonalise.
    With sharded params the raw gradient travels to the owner beside the momentum (the
    same all-to-all), the owner preconditions its whole matrices before their iteration
    and keeps their state (`OwnedPreconditionState`, `MuonState`'s ``precondition``
    field), so the sharded plan's collectives stay one redistribution in and one out. To
    precondition the gradient before Muon instead, chain a transform before
    `scale_by_muon` (as `newton_muon` does).

    With ``bias_correction=True`` the momentum is bias-corrected exactly as
    ``optax.contrib.scale_by_muon`` does: ``v = β m/(1-β^(t+2)) + (1-β) g/(1-β^(t+1))``
    with Nesterov, ``v = m/(1-β^(t+1))`` without. The update is returned in the gradient
    dtype; no learning rate and no sign are applied (chain with
    ``optax.scale_by_learning_rate``, or use `muon`).

    Sharded params (``shard_newton_schulz=True``): the whole matrices of the leaves
    split over a multi-device mesh, of every shape, are assigned to devices in one
    balanced assignment, each device runs the iteration on its own matrices, and the
    results return to the leaves' shardings: no collective inside the iteration, one
    redistribution in and one out per step, the single-device result (float32
    iteration: to ~1e-6 relative).
    Where each leaf lives is read from the arrays when they are concrete (or typed on
    Explicit mesh axes); under ``jax.jit`` on Auto mesh axes it comes from
    ``newton_schulz_plan`` (`NewtonSchulzPlan.from_params` on the params or their
    abstract shapes). Leaves of unknown sharding are split over ``mesh`` (or the
    ``jax.set_mesh`` context of the update) as FSDP lays them out, and XLA converts
    them there and back; without a mesh the partitioner decides for them. Leaves known
    to stay whole are orthogonalised together by shape (one batched iteration per shape).

    Args:
      beta: momentum in [0, 1), or a schedule of the update count (e.g.
        `muon_momentum_warmup`).
      coefficients: Newton-Schulz preset (``"modded"``, ``"keller"``,
        ``"polar_express"``) or a sequence of ``(a, b, c)`` triples, one per iteration;
        see `orthogonalize`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      nesterov: orthogonalise ``β m + (1-β) g`` instead of ``m``.
      bias_correction: bias-correct the momentum like optax.contrib.muon (the record does
        not).
      matrix_axes: ``(fan_in axis, fan_out axis)`` of every leaf; the other axes are batch
        axes. ``(-2, -1)`` fits Flax ``(in, out)`` kernels and ``(E, in, out)`` stacks;
        ``(1, 0)`` fits PyTorch ``(out, in)`` weights. A 4-D leaf (a convolution kernel)
        is treated as a stack of matrices, with a warning.
      shape_scale: ``"modded"`` (or ``True``), ``"consistent_rms"``, or ``None`` (or
        ``False``) for no scale.
      beta2: NorMuon's second-moment decay in [0, 1) or a schedule of the count
        (the paper's 0.95; modded-nanogpt's record 0.9); ``None``: plain Muon.
      smoothing: update-smoothing coefficient σ in [0, 1) or a schedule of the count;
        ``None`` turns smoothing off (record PR #137 used 0.2).
      smoothing_form: ``"ema"`` (use ``S``, PR #137) or ``"nesterov"`` (use
        ``σ S + (1-σ) O``, PR #129).
      mu_dtype: dtype of the momentum buffer; ``None``: float32, or the param's dtype
        where it is wider (float64 params keep float64 momentum, smoothing and NorMuon
        statistics).
      shard_newton_schulz: on sharded params, give each device whole matrices to
        orthogonalise (above); ``False`` leaves the iteration to the partitioner.
      newton_schulz_plan: where the leaves live when the update cannot see it (above);
        `NewtonSchulzPlan`.
      mesh: the mesh to split leaves of unknown sharding over (above); default: the
        plan's, else the ``jax.set_mesh`` context of the update, if any.
      precondition: a `MatrixPrecondition` run on each matrix's Newton-Schulz input
        before the iteration (on its owner under the sharded plan, above); ``None``:
        none.
      ns_normalization: how the iteration's input is scaled, ``"frobenius"`` or
        ``"gram_frobenius"`` (modded-nanogpt Track 3's SOAP-Muon); see `orthogonalize`.
      spectral_map: ``None``, ``"contra"``, ``"power"`` or ``"soft"``. ``"contra"``:
        Contra-Muon (nilin, https://github.com/nilin/contra-muon, 2026; Track 3 result #11):
        ``O' = O - (c/2) v/‖v‖_op``, then ``O' ‖O‖_F/max(‖O'‖_F, 1e-10)``, before NorMuon;
        ``‖v‖_op`` by 5 power iterations from the all-ones vector on the fan_in axis, in
        float32, norms clamped at 1e-10, as the record computes it.

        ``"power"``: DynMuon (modded-nanogpt Track 3 result #28, 2026), an update whose
        singular values are close to ``σᵢ^p`` of ``X = spectral_input_scale · v`` instead
        of 1 (near them while ``Xn``'s are near 1, the series' expansion point):
        ``s = ‖X‖_F + 1e-7``, ``Xn = X/s``, ``O = orthogonalize(Xn)``, with ``E = Xn Xnᵀ - I``
        on the shorter side (``fan_out`` for a square matrix, PyTorch's rows),
        ``δ = p/2`` and ``C = I + δE + ½δ(δ-1)E²`` (the second-order series of
        ``(Xn Xnᵀ)^δ``): ``O' = C O s^p``, in float32. Not scale-free (``s^p``): the
        record's ``X`` is the summed (not EMA) Nesterov momentum of the mean-loss
        gradient, ``spectral_input_scale = (1/524288)/(1-β)`` of this ``v`` for its
        summed loss over 524288 tokens.

        ``"soft"``: Soft-Muon and its interpolation with Contra-Muon (nilin,
        https://nilin.github.io/contra-muon-and-soft-muon/, 2026; Track 3 result #20), in
        place of ``orthogonalize(v)``, ``v`` the iteration's input (after ``precondition``).
        With ``‖X‖₄ = max(‖XᵀX‖_F^{1/2}, 1e-10)`` (the Schatten-4 norm, the record's
        ``gram_frobenius_norm_estimate``), ``O = orthogonalize(v)``, ``n = ‖O‖₄`` and
        ``[Y] = Y n/‖Y‖₄``::

            C = [O - (k/2) v/‖v‖₄]              # Contra-Muon, k = soft_contra
            S = [Σ_j w_j X_j]                   # Soft-Muon: singular values ~ σ^p
            O' = [C + b (S - C)]                # b = spectral_strength

        ``X_j`` are the iterates of the record's own iteration (``"track3"``: ``(2, -1.5,
        0.5)`` twelve times on ``v/‖v‖₄`` in ``ns_dtype``, whatever ``coefficients``),
        ``w`` the record's weights for ``p = soft_power`` (`SOFT_MUON_SERIES`; summed in
        float32 where the record sums in bfloat16); `optax_snoo._src.newton_schulz.
        soft_polar`. ``k = 0, b = 0`` is Muon; ``b = 0`` is Contra-Muon with ``‖·‖₄``
        for ``#11``'s operator and Frobenius norms; the series is skipped while ``b = 0``.
        It runs on each matrix's owner under the sharded plan (whole matrices, after the
        precondition), which receives the float32 input (twice a bfloat16 transfer).
        With ``tempered_polar``, ``O`` is the tempered polar (``C`` and ``n`` read it;
        ``S``'s iterates do not), as Track 3 result #38's ``muon_update`` tempers
        ``ns_update`` before its Contra-Muon and Soft-Muon terms.
      spectral_strength: ``c`` of ``"contra"`` (the record's ``CONTRA_MUON=0.4``), ``p``
        of ``"power"``, or the blend ``b`` in [0, 1] of ``"soft"``; a number or a
        schedule of the update count (`logistic_schedule` is DynMuon's).
      spectral_input_scale: ``"power"``'s factor on ``v`` (above); refused with another
        map.
      soft_power: ``"soft"``'s ``p``, a key of `SOFT_MUON_SERIES` (the record's 0.1).
      soft_contra: ``"soft"``'s Contra-Muon strength ``k >= 0`` (as ``"contra"``'s ``c``;
        #20: 0.4 falling linearly to 0 at update 2000), a number or a schedule; refused
        (unless 0) with another map.
      normuon_norm: the norm NorMuon keeps, ``"frobenius"`` (NorMuon, #9, #11) or
        ``"gram_frobenius"`` (``‖·‖₄``, #20).
      aurora_iterations: ``None`` (plain polar) or ``k >= 1``: Aurora's leverage-uniform
        polar (Tilde Research, https://github.com/tilde-research/aurora-release, 2026;
        Track 3 result #17) in place of ``orthogonalize(v)``: ``U = orthogonalize(D v)``
        with ``D`` a positive diagonal on the longer matrix axis, ``D = 1/‖v_i‖`` first,
        then ``k - 1`` damped fixed-point updates ``D ← D ((n/m)/‖U_i‖²)^aurora_beta`` so
        ``U``'s lines have the uniform squared norm ``n/m`` (``n <= m`` the matrix's
        sides); square matrices get the plain polar. ``1`` is "Muon EQ" (each line
        normalised, then the polar); the record runs 2. ``D`` is computed from the
        float32 ``v``, so under the sharded plan the matrices travel to their owners and
        back in float32 (twice a bfloat16 iteration's transfer bytes).
      aurora_beta: the damping exponent in (0, 1] (the record's ``pp_beta=0.5``).
      orthogonalize: ``False``: no Newton-Schulz and no normalisation, ``O = v``: the
        direction is the precondition's output as it is (SinkSOAP's `gram_sinkhorn`
        balances the momentum in its Gram eigenbasis and gives it the polar factor's
        Frobenius norm instead; modded-nanogpt Track 3 result #26). The matrices then
        travel to their owners in ``ns_dtype`` widened to float32 (``ns_dtype=float64``
        keeps a float64 run's); ``coefficients`` and ``ns_normalization`` are unused. Refused
        with ``spectral_map`` or ``aurora_iterations``, which read the polar factor.
      normuon_square: ``False``: NorMuon (``beta2``) skips square matrices, their
        update and ``ν`` left as they are (result #26 normalises only ``m != n``).
      tempered_polar: ``None`` (off) or ``ρ`` >= 0, a number or a schedule of the update
        count: Tempered Polar (modded-nanogpt Track 3 result #38, J. Clark, 2026), the
        polar moved toward its own normalised input (`newton_schulz.tempered_polar`):
        with ``‖·‖`` the Gram-Frobenius norm ``(Σσ⁴)^{1/4}`` (clamped at 1e-10),
        ``R = v/‖v‖ - O`` and ``O ← O + ρ·min(1, tempered_polar_max·‖O‖/‖R‖)·R``,
        rescaled to the polar's ``‖O‖``; after Aurora, before the spectral maps and
        NorMuon, on the matrix the iteration received (after ``precondition``). #38:
        ``optax.linear_schedule(0.0, 0.05, 200, 2600)``, ``tempered_polar_max=0.25``.
        In float32 (float64 for float64 input), rounded to ``ns_dtype`` as the record
        rounds it to its bfloat16 polar; the matrices travel to their owners in float32
        under the sharded plan (``v`` is read at full precision, as the record).
      tempered_polar_max: the clip (> 0) of ``‖R‖`` relative to ``‖O‖`` (#38: 0.25).

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState`.

    Raises:
      ValueError: for bad coefficients, ``beta``, ``beta2`` or ``smoothing`` outside
        [0, 1), bad ``matrix_axes``, ``shape_scale``, ``smoothing_form``,
        ``ns_normalization``, ``precondition``, ``aurora_iterations`` or
        ``aurora_beta``, ``orthogonalize=False`` with a spectral map or Aurora; at init/trace
        time for 0-D/1-D leaves (those belong to Adam) and axes that do not fit a leaf.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import scale_by_muon
      >>> params = {"w": jnp.ones((4, 8)), "experts": jnp.ones((2, 8, 4))}
      >>> tx = optax.chain(scale_by_muon(shape_scale="consistent_rms", beta2=0.95),
      ...                  optax.scale_by_learning_rate(0.02))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state)
      >>> updates["w"].shape
      (4, 8)

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024

      Liu et al., `Muon is Scalable for LLM Training
      <https://arxiv.org/abs/2502.16982>`_, 2025

      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025
    """
    triples = _resolve_coefficients(coefficients)
    if spectral_map not in SPECTRAL_MAPS:
        raise ValueError(f"spectral_map must be one of {SPECTRAL_MAPS}, got {spectral_map!r}.")
    if spectral_map == "contra":
        check_non_negative("spectral_strength", spectral_strength)
    _check_soft(spectral_map, spectral_strength, soft_power, soft_contra)
    if normuon_norm not in NORMUON_NORMS:
        raise ValueError(f"normuon_norm must be one of {NORMUON_NORMS}, got {normuon_norm!r}.")
    check_positive("spectral_input_scale", spectral_input_scale)
    input_scale_now = concrete_real(spectral_input_scale)  # None while inject traces it
    if spectral_map != "power" and input_scale_now not in (None, 1.0):
        raise ValueError(f"spectral_input_scale={spectral_input_scale!r} is read only by "
                         f"spectral_map='power', got spectral_map={spectral_map!r}.")
    if spectral_map == "power" and (precondition is not None or aurora_iterations is not None
                                    or tempered_polar is not None):
        raise ValueError("spectral_map='power' orthogonalises its own normalised input: it "
                         "does not combine with precondition, aurora_iterations or "
                         "tempered_polar.")
    if not orthogonalize and (spectral_map is not None or aurora_iterations is not None
                              or tempered_polar is not None):
        raise ValueError(f"orthogonalize=False (no Newton-Schulz) does not combine with "
                         f"spectral_map={spectral_map!r}, aurora_iterations="
                         f"{aurora_iterations!r} or tempered_polar={tempered_polar!r}: they "
                         f"read the polar factor.")
    check_non_negative("tempered_polar", tempered_polar, allow_none=True)
    max_now = concrete_real(tempered_polar_max)
    if callable(tempered_polar_max) or (max_now is not None and not max_now > 0):
        raise ValueError(f"tempered_polar_max must be a number > 0, got "
                         f"{tempered_polar_max!r}.")
    if isinstance(aurora_iterations, jax.Array):  # what inject_hyperparams makes of an int
        raise ValueError(f"aurora_iterations (a number of Newton-Schulz rounds) must be a "
                         f"Python int, got an array {aurora_iterations!r}: under "
                         f"optax.inject_hyperparams pass static_args=('aurora_iterations',).")
    if aurora_iterations is not None and (isinstance(aurora_iterations, bool) or not isinstance(
            aurora_iterations, int | np.integer) or aurora_iterations < 1):
        raise ValueError(f"aurora_iterations must be None or an integer >= 1, "
                         f"got {aurora_iterations!r}.")
    beta_now = concrete_real(aurora_beta)
    if beta_now is not None and not 0 < beta_now <= 1:
        raise ValueError(f"aurora_beta must be in (0, 1], got {aurora_beta!r}.")
    check_float_dtype("ns_dtype", ns_dtype)
    check_unit_interval("beta", beta)
    check_unit_interval("beta2", beta2, allow_none=True)
    check_unit_interval("smoothing", smoothing, allow_none=True)
    axes = _check_matrix_axes(matrix_axes)
    scale_kind = _resolve_shape_scale(shape_scale)
    if smoothing_form not in SMOOTHING_FORMS:
        raise ValueError(
            f"smoothing_form must be one of {SMOOTHING_FORMS}, got {smoothing_form!r}.")
    if newton_schulz_plan is not None and not isinstance(newton_schulz_plan, NewtonSchulzPlan):
        raise ValueError(f"newton_schulz_plan must be a NewtonSchulzPlan (e.g. "
                         f"NewtonSchulzPlan.from_params(params)), got {newton_schulz_plan!r}.")
    _check_ns_normalization(ns_normalization)
    if precondition is not None and not isinstance(precondition, MatrixPrecondition):
        raise ValueError(f"precondition must be a MatrixPrecondition (e.g. soap_whitening()) "
                         f"or None, got {type(precondition).__name__}; to precondition the "
                         f"gradient before Muon, chain a transform before scale_by_muon "
                         f"(as newton_muon does).")
    per_matrix = precondition is not None
    plan = newton_schulz_plan or NewtonSchulzPlan()
    spread_mesh = mesh if mesh is not None else plan.mesh
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    ns_dt = jnp.dtype(ns_dtype)
    newton_schulz = functools.partial(_newton_schulz, triples=triples, ns_dtype=ns_dt, eps=1e-7,
                                      normalization=ns_normalization)
    transfer_dtype = ns_dt
    if aurora_iterations is not None:
        newton_schulz = functools.partial(leverage_balanced, newton_schulz=newton_schulz,
                                          iterations=aurora_iterations, beta=aurora_beta)
        # D comes from the float32 momentum (as the record): rounding it to bf16 first
        # moves a sharded update by ~2% (Newton-Schulz amplifies the double rounding).
        transfer_dtype = jnp.promote_types(ns_dt, jnp.float32)
    if not orthogonalize:
        newton_schulz = _unchanged  # orthogonalize=False
        transfer_dtype = jnp.promote_types(ns_dt, jnp.float32)
    if tempered_polar is not None:
        # the residual reads v itself (the record's float32 momentum), not its bf16 copy
        transfer_dtype = jnp.promote_types(ns_dt, jnp.float32)
    if spectral_map == "soft":  # its Contra-Muon term reads the float32 input, as the record
        transfer_dtype = jnp.promote_types(ns_dt, jnp.float32)
        series = SOFT_MUON_SERIES[concrete_real(soft_power)]

    def init_fn(params: optax.Params) -> MuonState:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            _warn_if_convolution(path_to_str(path), jnp.shape(p), axes)
        # statistics in float32, or wider with the param (a float64 run stays float64)
        zeros = lambda dtype: lambda p: jnp.zeros_like(p, dtype=state_dtype(dtype, p))
        stats_like = lambda: jax.tree.map(zeros(None), params)
        nu = optax.EmptyState() if beta2 is None else jax.tree.map(
            lambda p: jnp.zeros(_reduced_shape(jnp.shape(p), axes), state_dtype(None, p)),
            params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros(mu_dtype), params),
                         smooth=optax.EmptyState() if smoothing is None else stats_like(), nu=nu,
                         precondition=(init_owned(params) if per_matrix
                                       else optax.EmptyState()))

    def flags_of(paths: list[str], treedef: Any) -> list[bool]:
        flags = precondition.flags
        return [False] * len(paths) if flags is None else list(flags(paths, treedef))

    def init_owned(params: optax.Params) -> OwnedPreconditionState:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths, leaves = [path_to_str(p) for p, _ in with_paths], [p for _, p in with_paths]
        placements = place_leaves(plan, paths, [[p] for p in leaves])
        per_leaf, owned = init_precondition(
            precondition, leaves, [_normalized_axes(jnp.shape(p), axes) for p in leaves],
            placements, mesh=spread_mesh, split=shard_newton_schulz,
            flags=flags_of(paths, treedef))
        return OwnedPreconditionState(treedef.unflatten(per_leaf), owned)

    def update_fn(updates: optax.Updates, state: MuonState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, MuonState]:
        count = state.count
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths, grads = [path_to_str(p) for p, _ in with_paths], [g for _, g in with_paths]
        mus = treedef.flatten_up_to(state.mu)
        leaf_axes = [_normalized_axes(jnp.shape(g), axes) for g in grads]

        beta_t = value_at(beta, count)
        moments = [_momentum(g, m, beta_t, count, nesterov=nesterov,
                             bias_correction=bias_correction)
                   for g, m in zip(grads, mus, strict=True)]
        inputs = [v for v, _ in moments]
        ns_inputs = inputs
        if spectral_map == "power":
            normalized = [_power_input(v, spectral_input_scale, a)
                          for v, a in zip(inputs, leaf_axes, strict=True)]
            ns_inputs = [xn for xn, _ in normalized]
        pre_state = state.precondition
        placements = place_leaves(plan, paths, list(zip(grads, mus, strict=True)))
        owned = {}
        if per_matrix:
            owned = dict(precondition=precondition, grads=grads, count=count,
                         leaf_states=treedef.flatten_up_to(pre_state.leaves),
                         owned=pre_state.owned, flags=flags_of(paths, treedef))
        polar = newton_schulz
        if tempered_polar is not None:
            polar = functools.partial(tempered, newton_schulz=newton_schulz,
                                      rho=value_at(tempered_polar, count),
                                      max_delta=tempered_polar_max, round_dtype=ns_dt)
        if spectral_map == "soft":  # around each matrix's iteration, on its owner
            polar = functools.partial(  # C reads the (tempered) polar, S the iterates
                soft_polar, newton_schulz=polar, contra=value_at(soft_contra, count),
                blend=value_at(spectral_strength, count), series=series, ns_dtype=ns_dt)
        ortho, leaf_states, owned_states = orthogonalize_leaves(
            ns_inputs, leaf_axes, placements, newton_schulz=polar, ns_dtype=transfer_dtype,
            mesh=spread_mesh, split=shard_newton_schulz, **owned)
        if per_matrix:
            pre_state = OwnedPreconditionState(treedef.unflatten(leaf_states), owned_states)
        if spectral_map == "contra":
            c = value_at(spectral_strength, count)
            ortho = [_contra(o, v, c, a) for o, v, a in zip(ortho, inputs, leaf_axes, strict=True)]
        elif spectral_map == "power":
            p = value_at(spectral_strength, count)
            ortho = [_power(o, xn, s, p, a)
                     for o, (xn, s), a in zip(ortho, normalized, leaf_axes, strict=True)]
        nu = state.nu
        if beta2 is not None:
            beta2_t = value_at(beta2, count)
            normed = [(o, v) if not normuon_square and o.shape[a[0]] == o.shape[a[1]]
                      else _normuon(o, v, beta2_t, a, normuon_norm)
                      for o, v, a in zip(ortho, treedef.flatten_up_to(nu), leaf_axes, strict=True)]
            ortho, nu = [o for o, _ in normed], treedef.unflatten([v for _, v in normed])
        smooth = state.smooth
        if smoothing is not None:
            ortho, smooth = _smooth(ortho, treedef.flatten_up_to(smooth),
                                    value_at(smoothing, count), smoothing_form)
            smooth = treedef.unflatten(smooth)

        new_updates = [(_shape_factor(scale_kind, g.shape[a[0]], g.shape[a[1]]) * o).astype(g.dtype)
                       for o, g, a in zip(ortho, grads, leaf_axes, strict=True)]
        return treedef.unflatten(new_updates), MuonState(
            count=optax.safe_increment(count), mu=treedef.unflatten([m for _, m in moments]),
            smooth=smooth, nu=nu, precondition=pre_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _momentum(g: jax.Array, m: jax.Array, beta: Any, count: jax.Array, *, nesterov: bool,
              bias_correction: bool) -> tuple[jax.Array, jax.Array]:
    """(float32 input of the iteration, new momentum buffer in the buffer's dtype) of one
    leaf; float64 for float64 gradients or buffers."""
    mu_dtype = m.dtype
    compute = jnp.promote_types(jnp.promote_types(g.dtype, mu_dtype), jnp.float32)
    g32 = g.astype(compute)
    m = beta * m.astype(compute) + (1 - beta) * g32
    if bias_correction:
        bc_g = 1 - beta ** (count + 1)
        v = m / (1 - beta ** (count + 2) if nesterov else bc_g)
        if nesterov:
            v = beta * v + (1 - beta) * (g32 / bc_g)
    else:
        v = beta * m + (1 - beta) * g32 if nesterov else m
    return v, m.astype(mu_dtype)


def _contra(o: jax.Array, v: jax.Array, strength: float, axes: tuple[int, int]) -> jax.Array:
    """Contra-Muon's map of one leaf: ``O' = O - (c/2) v/‖v‖_op`` rescaled to ``‖O‖_F``.

    ``‖v‖_op`` by the record's 5 power iterations from the all-ones vector on the fan_in
    axis (each norm clamped at 1e-10), in float32 (float64 for float64 inputs).
    """
    fan_in, fan_out = axes
    dtype = jnp.promote_types(v.dtype, jnp.float32)
    x = jnp.moveaxis(v.astype(dtype), (fan_out, fan_in), (-2, -1))  # (..., out, in)

    def unit(y):
        return y / jnp.maximum(jnp.linalg.norm(y, axis=-1, keepdims=True), 1e-10)

    r = unit(jnp.ones(x.shape[:-2] + x.shape[-1:], dtype))
    for _ in range(5):
        r = unit(jnp.einsum("...ij,...i->...j", x, unit(jnp.einsum("...ij,...j->...i", x, r))))
    op = jnp.maximum(jnp.linalg.norm(jnp.einsum("...ij,...j->...i", x, r), axis=-1), 1e-10)
    op = jnp.expand_dims(op, (min(axes), max(axes)))
    c = o - (strength / 2) * (v.astype(dtype) / op).astype(o.dtype)
    norm = jnp.sqrt(jnp.sum(jnp.square(o), axis=axes, keepdims=True))
    return c * (norm / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(c), axis=axes, keepdims=True)),
                                   1e-10))


def _schatten4(x: jax.Array, axes: tuple[int, int]) -> jax.Array:
    """``max(‖XᵀX‖_F^{1/2}, 1e-10)`` per matrix of a leaf, its matrix axes kept (size 1)."""
    moved = jnp.moveaxis(x, axes, (-2, -1))
    return jnp.expand_dims(gram_frobenius_norm(moved, 1e-10)[..., 0, 0], axes)


def _check_soft(spectral_map: str | None, blend: Any, power: Any, contra: Any) -> None:
    """Soft-Muon's settings: a tabulated ``p``, ``k >= 0`` (0 with another map), a blend
    in [0, 1]."""
    check_non_negative("soft_contra", contra)
    if spectral_map != "soft":
        if concrete_real(contra) not in (None, 0.0):
            raise ValueError(f"soft_contra={contra!r} is read only by spectral_map='soft', "
                             f"got spectral_map={spectral_map!r}.")
        return
    if concrete_real(power) not in SOFT_MUON_SERIES:
        raise ValueError(f"soft_power must be one of {sorted(SOFT_MUON_SERIES)} (the powers "
                         f"the record's series has weights for), got {power!r}; under "
                         f"optax.inject_hyperparams pass static_args=('soft_power',).")
    b = concrete_real(blend)
    if b is not None and not 0 <= b <= 1:
        raise ValueError(f"spectral_strength (Soft-Muon's blend) must be in [0, 1] for "
                         f"spectral_map='soft', got {blend!r}.")


def _gram_sides(shape: tuple[int, ...], axes: tuple[int, int]) -> tuple[int, int]:
    """(short, long) matrix axes of DynMuon's Gram: PyTorch's rows (``fan_out``) unless
    they are the longer side (its ``fast_spectral`` transposes only tall matrices)."""
    fan_in, fan_out = axes
    return (fan_in, fan_out) if shape[fan_out] > shape[fan_in] else (fan_out, fan_in)


def _power_input(v: jax.Array, scale: float, axes: tuple[int, int]
                 ) -> tuple[jax.Array, jax.Array]:
    """DynMuon's ``(Xn, s)`` of one leaf: ``X = scale·v``, ``s = ‖X‖_F + 1e-7``, ``Xn = X/s``."""
    x = v.astype(jnp.promote_types(v.dtype, jnp.float32)) * scale
    s = jnp.sqrt(jnp.sum(jnp.square(x), axis=axes, keepdims=True)) + 1e-7
    return x / s, s


def _power(o: jax.Array, xn: jax.Array, s: jax.Array, p: Any, axes: tuple[int, int]
           ) -> jax.Array:
    """DynMuon's map of one leaf: ``C O s^p`` with ``C = I + δE + ½δ(δ-1)E²``,
    ``E = Xn Xnᵀ - I`` on the shorter side, ``δ = p/2`` (float32, or float64)."""
    short, long = _gram_sides(xn.shape, axes)
    x = jnp.moveaxis(xn, (short, long), (-2, -1))
    y = jnp.moveaxis(o.astype(xn.dtype), (short, long), (-2, -1))
    dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    e = dot("...ik,...jk->...ij", x, x) - jnp.eye(x.shape[-2], dtype=x.dtype)
    delta = p / 2
    c = delta * e + (0.5 * delta * (delta - 1)) * dot("...ik,...kj->...ij", e, e)
    u = y + dot("...ik,...kj->...ij", c, y)  # (I + δE + ½δ(δ-1)E²) O
    return jnp.moveaxis(u, (-2, -1), (short, long)) * s ** p


def _reduced_axis(shape: tuple[int, ...], axes: tuple[int, int]) -> int:
    """NorMuon's reduced axis: the shorter matrix axis, ``fan_in`` for a square matrix
    (modded-nanogpt reduces the last axis of its (out, in) weights unless rows < cols)."""
    fan_in, fan_out = _normalized_axes(shape, axes)
    return fan_out if shape[fan_out] < shape[fan_in] else fan_in


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, int]) -> tuple[int, ...]:
    red = _reduced_axis(shape, axes)
    return tuple(1 if a == red else n for a, n in enumerate(shape))


def _normuon(o: jax.Array, nu: jax.Array, beta2: Any, axes: tuple[int, int],
             norm: str = "frobenius") -> tuple[jax.Array, jax.Array]:
    """NorMuon's variance normalisation of one leaf's orthogonalised update (float32).

    Written as the record fuses it: ``‖O‖_F² = Σ n q`` and ``‖D‖_F² = Σ n q / ν`` from
    the per-neuron mean squares ``q``, so only one pass over ``O`` reads it whole.
    ``norm="gram_frobenius"``: ``D ‖O‖₄/‖D‖₄`` instead (`_schatten4`, clamps 1e-10).
    """
    red, dtype = _reduced_axis(o.shape, axes), nu.dtype  # the state keeps its dtype
    n = o.shape[red]
    q = jnp.mean(jnp.square(o), axis=red, keepdims=True)
    nu = beta2 * nu + (1 - beta2) * q
    inv_rms = jax.lax.rsqrt(jnp.maximum(nu, 1e-10))
    if norm == "gram_frobenius":
        d = o * inv_rms
        return d * (_schatten4(o, axes) / _schatten4(d, axes)), nu.astype(dtype)
    norm = jnp.sqrt(jnp.sum(n * q, axis=axes, keepdims=True))
    new_norm = jnp.sqrt(jnp.sum(n * q * jnp.square(inv_rms), axis=axes, keepdims=True))
    return o * (inv_rms * (norm / jnp.maximum(new_norm, 1e-10))), nu.astype(dtype)


def _smooth(ortho: Sequence[jax.Array], smooth: Sequence[jax.Array], sigma: Any, form: str
            ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Update smoothing: ``S = σ S + (1-σ) O``; the update is ``S`` ("ema") or
    ``σ S + (1-σ) O`` ("nesterov")."""
    smooth = [(sigma * s + (1 - sigma) * o).astype(s.dtype)
              for s, o in zip(smooth, ortho, strict=True)]
    if form == "ema":
        return smooth, smooth
    return [sigma * s + (1 - sigma) * o for s, o in zip(smooth, ortho, strict=True)], smooth


def _warn_if_convolution(name: str, shape: tuple[int, ...], axes: tuple[int, int]) -> None:
    """Check the leaf fits `axes`; warn (once per leaf: the warnings registry) on 4-D ones."""
    fan_in_axis, fan_out_axis = _normalized_axes(shape, axes)
    if len(shape) == 4:
        fan_in, fan_out = shape[fan_in_axis], shape[fan_out_axis]
        warnings.warn(
            f"Muon: leaf {name!r} of shape {shape} is 4-D (a convolution kernel?); it is "
            f"orthogonalised as a stack of {math.prod(shape) // (fan_in * fan_out)} separate "
            f"{fan_in}x{fan_out} matrices (matrix_axes={axes}). To orthogonalise it as one "
            "matrix, reshape it to (kh*kw*in, out); or label it for Adam.",
            UserWarning, stacklevel=4)
