"""SinkSOAP: Muon's momentum Sinkhorn-balanced in the eigenbasis of its gradient's Grams.

`gram_sinkhorn` is a `MatrixPrecondition` for ``scale_by_muon(precondition=...,
orthogonalize=False)``: per matrix it rotates the Nesterov momentum into the eigenbases of
the gradient's two Gram EMAs (SOAP's basis), balances the squared entries there to uniform
row and column sums by Sinkhorn's iteration, rotates back and gives the result the
Frobenius norm of a semi-orthogonal matrix, so the balancing stands in for Newton-Schulz
(an orthogonal matrix's squared entries are such a balance in every basis). `sinksoap`
chains it with NorMuon on the non-square matrices and a learning rate; `sinkhorn_balance`
is the balancing alone and `scale_by_sinksoap` the direction without a learning rate.

References:
  modded-nanogpt Track 3 (optimization) result #26, SinkSOAP, by L. Liu and Z. Xu
  (`results/20260514_sinksoap
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  PR #298), 2026

  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024

  Sinkhorn, `A Relationship Between Arbitrary Positive Matrices and Doubly Stochastic
  Matrices <https://doi.org/10.1214/aoms/1177703591>`_, 1964

  Li et al., `NorMuon: Making Muon more efficient and scalable
  <https://arxiv.org/abs/2510.05491>`_, 2025
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.muon_sharding import MatrixPrecondition
from optax_snoo._src.soap_muon import _eigenbasis, _mm
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_unit_interval,
    value_at,
)

__all__ = ["GramSinkhornState", "gram_sinkhorn", "scale_by_sinksoap", "sinkhorn_balance",
           "sinksoap"]


class GramSinkhornState(NamedTuple):
    """State of `gram_sinkhorn` for a batch of matrices ``(..., out, in)`` (the record's
    ``(m, n)``): float32, float64 for float64 params.

    Attributes:
      gram_out: ``L``, the EMA of ``G Gᵀ`` over the fan_out axis, ``(..., out, out)``.
      gram_in: ``R``, the EMA of ``Gᵀ G`` over the fan_in axis, ``(..., in, in)``.
    """

    gram_out: jax.Array
    gram_in: jax.Array


def sinkhorn_balance(a: jax.Array, steps: int = 10, eps: float = 1e-8) -> jax.Array:
    r"""Sinkhorn's balancing of the squared entries of matrices ``(..., m, n)``.

    With ``B = A² + eps`` (elementwise) and ``r = 1_m``, ``c = 1_n``, ``steps`` times::

        r = (1/m) / (B c + eps);   c = (1/n) / (Bᵀ r + eps)

    so ``diag(r) B diag(c)`` has row sums ``1/m`` and (exactly, after the last step)
    column sums ``≈ 1/n``; returns ``diag(r)^{1/2} A diag(c)^{1/2}``, whose squared entries
    are that balanced matrix up to the ``eps``. No overall scale is restored.

    Args:
      a: matrices ``(..., m, n)``, float.
      steps: Sinkhorn iterations (result #26: 10), >= 1.
      eps: added to ``A²`` and to both denominators (result #26: 1e-8), >= 0.

    Returns:
      The balanced matrices, shaped and typed like ``a``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import sinkhorn_balance
      >>> b = sinkhorn_balance(jnp.array([[4.0, 1.0], [1.0, 1.0]]), steps=50, eps=0.0)
      >>> [round(float(x), 3) for x in (b**2).sum(axis=1)]  # equal row energies
      [0.5, 0.5]
    """
    m, n = a.shape[-2:]
    b = jnp.square(a) + eps

    def body(_: Any, rc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        _, c = rc
        r = (1.0 / m) / (_mm("...ij,...j->...i", b, c) + eps)
        return r, (1.0 / n) / (_mm("...ij,...i->...j", b, r) + eps)

    ones = lambda k: jnp.ones((*a.shape[:-2], k), a.dtype)
    r, c = jax.lax.fori_loop(0, steps, body, (ones(m), ones(n)))
    return jnp.sqrt(r)[..., :, None] * a * jnp.sqrt(c)[..., None, :]


def _gram_sinkhorn(M: jax.Array, G: jax.Array, state: GramSinkhornState, count: jax.Array,
                   flags: Any, *, beta: Any, steps: int, eps: float
                   ) -> tuple[jax.Array, GramSinkhornState]:
    """One update of matrices ``(..., out, in)``: the Grams first (they are used at once),
    then the balanced momentum at the polar factor's Frobenius norm."""
    del flags
    beta = value_at(beta, count)
    dt = state.gram_out.dtype
    M, G = M.astype(dt), G.astype(dt)
    L = beta * state.gram_out + (1 - beta) * _mm("...ij,...kj->...ik", G, G)
    R = beta * state.gram_in + (1 - beta) * _mm("...ji,...jk->...ik", G, G)
    # The record's `eps I` shifts every eigenvalue alike: the basis is the same.
    eye = lambda k: jnp.eye(k, dtype=dt)
    U = _eigenbasis(L + eps * eye(L.shape[-1]))
    V = _eigenbasis(R + eps * eye(R.shape[-1]))
    A = sinkhorn_balance(_mm("...ji,...jk,...kl->...il", U, M, V), steps, eps)
    D = _mm("...ij,...jk,...lk->...il", U, A, V)
    m, n = D.shape[-2:]
    norm = jnp.sqrt(jnp.sum(jnp.square(D), axis=(-2, -1), keepdims=True))
    return D * (min(m, n) ** 0.5 / jnp.maximum(norm, eps)), GramSinkhornState(L, R)


def gram_sinkhorn(beta: float | optax.Schedule = 0.95, *, sinkhorn_steps: int = 10,
                  eps: float = 1e-8) -> MatrixPrecondition:
    r"""SinkSOAP's map of Muon's momentum (modded-nanogpt Track 3 result #26).

    A `MatrixPrecondition` for ``scale_by_muon(precondition=gram_sinkhorn(),
    orthogonalize=False)``: it replaces Newton-Schulz. Per matrix, in the record's
    ``(m, n) = (out, in)`` terms, with ``G`` the raw gradient and ``M`` the Nesterov
    momentum (`scale_by_muon`'s)::

        L = β L + (1-β) G Gᵀ;   R = β R + (1-β) Gᵀ G      # zero start, no bias correction
        U, V = eigenvectors of L + eps I, R + eps I      # eigh, every step
        A = Uᵀ M V                                       # the momentum in SOAP's basis
        A = sinkhorn_balance(A, sinkhorn_steps, eps)     # squared entries balanced
        D = U A Vᵀ
        D = D · sqrt(min(m, n)) / max(‖D‖_F, eps)        # a semi-orthogonal matrix's norm

    The Grams are updated before they are used (SOAP-Muon's `soap_whitening` uses the
    previous ones). ``D`` does not depend on the eigenvectors' signs or order, and in the
    null space of a rank-deficient Gram (a non-square matrix's longer side, before
    ``ceil(long/short)`` gradients are seen) ``A``'s rows or columns are zero but for
    rounding, which the balancing's ``1/sqrt(eps)`` amplifies: those few updates depend on
    the rounding (and on ``eigh``'s basis there), in the record as here. The record
    multiplies ``D`` by its shape factor ``sqrt(max(1, m/n))`` here; `scale_by_muon`'s
    ``shape_scale="modded"`` applies it after NorMuon instead, the same update (NorMuon
    keeps the Frobenius norm and is blind to a constant factor), with NorMuon's ``ν``
    ``1/(m/n)`` of the record's on tall matrices. Statistics are float32 (float64 for
    float64 params), as the record's.

    Args:
      beta: decay of the Gram EMAs (result #26: 0.95), in [0, 1), or a schedule.
      sinkhorn_steps: Sinkhorn iterations (result #26: 10), an int >= 1.
      eps: added to the Grams' diagonals, to ``A²`` and the balancing's denominators,
        and the floor of ``‖D‖_F`` (result #26: 1e-8), > 0.

    Returns:
      A `MatrixPrecondition` whose per-matrix state is a `GramSinkhornState`.

    Raises:
      ValueError: for ``beta`` outside [0, 1), ``sinkhorn_steps`` not an int >= 1,
        ``eps`` not positive.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import gram_sinkhorn, scale_by_muon
      >>> tx = scale_by_muon(precondition=gram_sinkhorn(), orthogonalize=False)
      >>> params = {"w": jnp.ones((8, 4))}
      >>> state = tx.init(params)
      >>> state.precondition.leaves["w"].gram_out.shape  # L over the fan_out axis (4)
      (4, 4)
      >>> updates, state = tx.update({"w": jnp.eye(8, 4)}, state, params)

    References:
      modded-nanogpt Track 3 result #26, SinkSOAP, L. Liu and Z. Xu (`results/20260514_sinksoap
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      PR #298), 2026

      Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
      <https://arxiv.org/abs/2409.11321>`_, 2024
    """
    check_unit_interval("beta", beta)
    check_int_at_least("sinkhorn_steps", sinkhorn_steps, 1)
    check_positive("eps", eps)

    def init(batch: int, out: int, inn: int, dtype: Any) -> GramSinkhornState:
        dt = jnp.promote_types(dtype, jnp.float32)
        return GramSinkhornState(jnp.zeros((batch, out, out), dt),
                                 jnp.zeros((batch, inn, inn), dt))

    return MatrixPrecondition(init, functools.partial(
        _gram_sinkhorn, beta=beta, steps=int(sinkhorn_steps), eps=eps))


def scale_by_sinksoap(
    beta: float | optax.Schedule = 0.95,
    *,
    gram_beta: float | optax.Schedule = 0.95,
    normuon_beta: float | optax.Schedule | None = 0.95,
    sinkhorn_steps: int = 10,
    eps: float = 1e-8,
    matrix_axes: tuple[int, int] = (-2, -1),
    mu_dtype: jax.typing.DTypeLike | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    r"""SinkSOAP's direction (modded-nanogpt Track 3 result #26), without a learning rate.

    ``scale_by_muon(beta, precondition=gram_sinkhorn(gram_beta, ...),
    orthogonalize=False, beta2=normuon_beta, normuon_square=False,
    shape_scale="modded")``: the Nesterov momentum balanced in its gradient's Gram
    eigenbasis (`gram_sinkhorn`) in place of Newton-Schulz, NorMuon on the non-square
    matrices (the record's postconditioner: ``ν = β₂ ν + (1-β₂) mean(D²)`` per line of the
    longer axis, ``D/sqrt(ν)`` rescaled to ``‖D‖_F``), then Muon's shape scale
    ``sqrt(max(1, fan_out/fan_in))``. Every leaf is a matrix or a stack: send 0-D/1-D
    leaves, embeddings and the head elsewhere with ``optax.partition`` (or
    `with_adam_groups`).

    Differs from the record in NorMuon's floor: ours divides by ``sqrt(max(ν, 1e-10))``
    (`scale_by_muon`'s), the record by ``max(sqrt(ν), 1e-10)``; they differ only on a line
    whose mean square stayed below 1e-10 in a matrix of mean square ``1/max(m, n)``, a
    line that is zero but for rounding.

    Args:
      beta: Muon's momentum (result #26: 0.95), or a schedule.
      gram_beta: decay of the Gram EMAs (0.95), or a schedule.
      normuon_beta: NorMuon's decay (0.95), or a schedule; ``None``: no NorMuon.
      sinkhorn_steps: Sinkhorn iterations (10).
      eps: `gram_sinkhorn`'s ``eps`` (1e-8).
      matrix_axes: ``(fan_in, fan_out)`` axes of every leaf, as in `scale_by_muon`.
      mu_dtype: dtype of the momentum (``None``: float32, float64 for float64 params).
      shard_newton_schulz: as in `scale_by_muon` (the balancing runs on the owners).
      newton_schulz_plan: as in `scale_by_muon`.
      mesh: as in `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState`, the balancing's
      `OwnedPreconditionState` in its ``precondition`` field.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_sinksoap
      >>> tx = scale_by_sinksoap()
      >>> state = tx.init({"attn": jnp.ones((8, 8)), "fc": jnp.ones((8, 32))})
      >>> state.nu["fc"].shape  # NorMuon's statistic on the longer axis
      (1, 32)

    References:
      modded-nanogpt Track 3 result #26, SinkSOAP, L. Liu and Z. Xu (`results/20260514_sinksoap
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      PR #298), 2026

      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025
    """
    return scale_by_muon(
        beta, precondition=gram_sinkhorn(gram_beta, sinkhorn_steps=sinkhorn_steps, eps=eps),
        orthogonalize=False, ns_dtype=jnp.float32, beta2=normuon_beta, normuon_square=False,
        shape_scale="modded", matrix_axes=matrix_axes, mu_dtype=mu_dtype,
        shard_newton_schulz=shard_newton_schulz, newton_schulz_plan=newton_schulz_plan,
        mesh=mesh)


def sinksoap(learning_rate: optax.ScalarOrSchedule, **kwargs: Any
             ) -> optax.GradientTransformation:
    r"""SinkSOAP on matrices and matrix stacks (modded-nanogpt Track 3 result #26's).

    ``chain(scale_by_sinksoap(**kwargs), scale_by_learning_rate(learning_rate))``; the
    record adds decoupled weight decay (``add_decoupled_weight_decay(0.025)`` before the
    learning rate, as `recipes.track3_sinksoap` does).

    Args:
      learning_rate: float or schedule (result #26: 0.04, flat for 30%, then linear to 0).
      **kwargs: any argument of `scale_by_sinksoap`.

    Returns:
      An ``optax.GradientTransformation``: a chain whose first state is a `MuonState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import sinksoap
      >>> params = {"attn": jnp.ones((8, 8)), "fc": jnp.ones((8, 32))}
      >>> tx = sinksoap(0.04)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)

    References:
      modded-nanogpt Track 3 result #26, SinkSOAP, L. Liu and Z. Xu (`results/20260514_sinksoap
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      PR #298), 2026
    """
    check_non_negative("learning_rate", learning_rate)
    return optax.chain(scale_by_sinksoap(**kwargs), optax.scale_by_learning_rate(learning_rate))
