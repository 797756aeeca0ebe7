"""PMuon: Muon's momentum between two streaming covariance powers before Newton-Schulz.

`pmuon_precondition` is a `MatrixPrecondition` for ``scale_by_muon(precondition=)`` (or
``muon(precondition=)``): per matrix, with ``U`` the Newton-Schulz input (the Nesterov
momentum) in the ``(out, in)`` layout, Newton-Schulz runs on ``P_L U P_R`` where
``P_L ∝ L^{-γ}`` and ``P_R ∝ R^{-γ}`` are powers of EMAs of ``U Uᵀ`` and ``Uᵀ U``, each
power from one step of orthogonal (subspace) iteration per update. As a
`MatrixPrecondition` it runs on the matrices' owners under `scale_by_muon`'s sharded plan,
its state kept there.

References:
  modded-nanogpt Track 3 result #18, PMuon (`results/20260507_pmuon
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  log ``54fc0541-7a62-4772-a8f8-d3a46ad10dba.txt``: ``_streaming_cov_power``,
  ``pmuon_update``, ``Muon.step``; PR #285 by zzp1012), 2026
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.kfac.precondition import map_matrices
from optax_snoo._src.muon_sharding import MatrixPrecondition
from optax_snoo._src.utils import (
    check_non_negative,
    check_positive,
    check_unit_interval,
    is_integer,
    value_at,
)

__all__ = ["PMuonState", "pmuon_precondition"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=_HIGHEST)


class PMuonState(NamedTuple):
    """State of `pmuon_precondition` for a batch of matrices ``(..., out, in)`` (the
    record's PyTorch layout: ``out`` our fan_out axis, ``in`` our fan_in axis). Float32
    (float64 for float64 params).

    Attributes:
      cov_out: ``L``, the decayed sum ``β L + U Uᵀ`` over the fan_out axis,
        ``(..., out, out)`` (the record's ``out`` buffer).
      cov_in: ``R``, the decayed sum ``β R + Uᵀ U`` over the fan_in axis, ``(..., in, in)``
        (the record's ``cov`` buffer).
      basis_out: ``Q_L``, the orthogonal iteration's basis of ``L``, ``(..., out, out)``.
      basis_in: ``Q_R``, that of ``R``, ``(..., in, in)``.
    """

    cov_out: jax.Array
    cov_in: jax.Array
    basis_out: jax.Array
    basis_in: jax.Array


def initial_basis(n: int, seed: int, dtype: Any) -> jax.Array:
    """The orthogonal iteration's start: the Q factor of an ``(n, n)`` standard normal
    matrix drawn (in float32, so a float64 run starts from the same matrix) from
    ``jax.random.key(seed)``; one start per size, whatever the matrix, so every path of
    `scale_by_muon` (per leaf, stacked, on owners) starts each matrix alike."""
    z = jax.random.normal(jax.random.key(seed), (n, n), jnp.float32)
    return jnp.linalg.qr(z.astype(dtype))[0]


def covariance_power(cov: jax.Array, basis: jax.Array, gamma: Any, eps: float
                     ) -> tuple[jax.Array, jax.Array]:
    """One step of the record's streaming power ``C^{-γ}`` of matrices ``(..., n, n)``.

    ``Q = qr(C Q).Q`` (one orthogonal iteration), ``λ = max(diag(Qᵀ C Q), eps)`` (the
    Rayleigh quotients), ``d = λ^{-γ}`` and ``P = Q diag(d) Qᵀ · sqrt(n)/(‖d‖ + eps)``
    (``d`` normalised to RMS 1). ``P`` is invariant to the signs of ``Q``'s columns, so
    QR's sign convention does not matter. Returns ``(P, Q)``.
    """
    n = cov.shape[-1]
    flat = cov.reshape(-1, n, n)
    q = map_matrices(lambda c, b: jnp.linalg.qr(_mm("ij,jk->ik", c, b))[0],
                     flat, basis.reshape(-1, n, n)).reshape(cov.shape)
    lam = jnp.maximum(jnp.sum(q * _mm("...ij,...jk->...ik", cov, q), axis=-2), eps)
    d = lam ** (-gamma)
    p = _mm("...ij,...kj->...ik", q * d[..., None, :], q)
    scale = math.sqrt(n) / (jnp.sqrt(jnp.sum(jnp.square(d), axis=-1)) + eps)
    return p * scale[..., None, None], q


def pmuon_precondition(beta: float | optax.Schedule = 0.95,
                       gamma: float | optax.Schedule = 0.3, *, damping: float = 1e-6,
                       eps: float = 1e-6, seed: int = 0) -> MatrixPrecondition:
    r"""PMuon's precondition (modded-nanogpt Track 3 result #18): ``P_L U P_R``.

    Per matrix, with ``U`` its Newton-Schulz input (the Nesterov momentum) in the record's
    ``(out, in)`` layout (our ``(fan_out, fan_in)``), ``β`` = ``beta``, ``γ`` = ``gamma``::

        R = β R + UᵀU;   C = UᵀU + β R + damping·I       # (in, in)
        L = β L + UUᵀ;   A = UUᵀ + β L + damping·I       # (out, out)
        P_R = covariance_power(C),  P_L = covariance_power(A)
        D = P_L U P_R                                    # then orthogonalised

    where `covariance_power` is one step of orthogonal iteration on a kept basis ``Q``
    (``Q = qr(C Q).Q``), the Rayleigh quotients ``λ = max(diag(Qᵀ C Q), eps)``,
    ``d = λ^{-γ}`` and ``P = Q diag(d) Qᵀ · sqrt(n)/(‖d‖ + eps)``: as ``Q`` follows the
    eigenvectors of the slowly moving ``C``, ``P`` approaches ``C^{-γ}`` normalised so
    that its eigenvalues have RMS 1. Directions where the momentum has been large are
    damped before the polar factor equalises the singular values.

    As in the record's code (``pmuon_update``): the covariances are of the Nesterov
    momentum ``U`` (the record's ``grad.lerp_`` overwrites the gradient with it before
    the products; its README writes ``G``), the sums ``L``, ``R`` carry no ``(1-β)``, and
    the current product is counted twice in ``A`` and ``C`` (``(1+β) UᵀU + β² R_prev``).

    The record starts each basis at the Q factor of an unseeded ``torch.randn``; ours is
    that of a normal matrix from ``jax.random.key(seed)``, the same for every matrix of a
    size (`initial_basis`), so runs are reproducible and every path of `scale_by_muon`
    (per leaf, stacked, on owners) agrees. The products are at ``Precision.HIGHEST``
    (PyTorch's float32 matmuls, no TF32). ``damping`` and ``eps`` are absolute, in units
    of the squared gradient: the record's gradient is that of the summed token loss over
    524288 tokens (the trainer's Track 3 default ``--loss_reduction=sum``); with a mean
    loss the covariances are ``524288²`` times smaller and ``damping`` dominates them.

    Args:
      beta: decay of the covariance sums, in [0, 1), or a schedule (record: 0.95).
      gamma: the power ``γ >= 0`` (record: 0.3), or a schedule; 0 is Muon.
      damping: added to the covariances' diagonal (record: 1e-6), > 0.
      eps: floor of the Rayleigh quotients and added to ``‖d‖`` (record: 1e-6), > 0.
      seed: the key of the bases' random start (an int).

    Returns:
      A `MatrixPrecondition` for `scale_by_muon(precondition=...)`, whose per-matrix state
      is a `PMuonState`.

    Raises:
      ValueError: for ``beta`` outside [0, 1), a negative ``gamma``, a non-positive
        ``damping`` or ``eps``, a ``seed`` that is not an int.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import pmuon_precondition, scale_by_muon
      >>> tx = scale_by_muon(precondition=pmuon_precondition(beta=0.95, gamma=0.3))
      >>> params = {"w": jnp.ones((8, 4))}
      >>> state = tx.init(params)
      >>> state.precondition.leaves["w"].cov_out.shape  # L over the fan_out axis (4)
      (4, 4)
      >>> updates, state = tx.update({"w": jnp.eye(8, 4)}, state, params)

    References:
      modded-nanogpt Track 3 result #18, PMuon (`results/20260507_pmuon
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      PR #285 by zzp1012), 2026
    """
    check_unit_interval("beta", beta)
    check_non_negative("gamma", gamma)
    check_positive("damping", damping)
    check_positive("eps", eps)
    if not is_integer(seed):
        raise ValueError(f"seed must be an int (the key of the bases' random start), "
                         f"got {seed!r}.")

    def init(batch: int, out: int, inn: int, dtype: Any) -> PMuonState:
        dt = jnp.promote_types(dtype, jnp.float32)
        start = lambda n: jnp.broadcast_to(initial_basis(n, seed, dt), (batch, n, n))
        return PMuonState(jnp.zeros((batch, out, out), dt), jnp.zeros((batch, inn, inn), dt),
                          start(out), start(inn))

    def apply(M: jax.Array, G: jax.Array, state: PMuonState, count: jax.Array,
              flags: Any) -> tuple[jax.Array, PMuonState]:
        del G, flags  # the record's statistics are of the Nesterov momentum
        b, g = value_at(beta, count), value_at(gamma, count)
        U = M.astype(state.cov_out.dtype)
        outer, inner = _mm("...ij,...kj->...ik", U, U), _mm("...ji,...jk->...ik", U, U)
        cov_out = b * state.cov_out + outer
        cov_in = b * state.cov_in + inner
        damp = lambda c: c + damping * jnp.eye(c.shape[-1], dtype=c.dtype)
        left, basis_out = covariance_power(damp(outer + b * cov_out), state.basis_out, g, eps)
        right, basis_in = covariance_power(damp(inner + b * cov_in), state.basis_in, g, eps)
        D = _mm("...ij,...jk,...kl->...il", left, U, right)
        return D, PMuonState(cov_out, cov_in, basis_out, basis_in)

    return MatrixPrecondition(init, apply)
