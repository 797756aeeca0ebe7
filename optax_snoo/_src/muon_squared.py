"""Muon²: Adam's second moment preconditions Muon's momentum before Newton-Schulz.

`muon_squared_precondition` is a `MatrixPrecondition` for ``scale_by_muon(precondition=)``
(or ``muon(precondition=)``): per matrix, with ``G`` the raw gradient and ``M`` the Newton-
Schulz input (the Nesterov momentum)::

    V ← β₂ V + (1 - β₂) G²          (elementwise; no bias correction)
    D = M / (sqrt(V) + eps)          then D is orthogonalised

so that the iteration starts from a better-conditioned matrix. As a `MatrixPrecondition` it
runs on the matrices' owners under `scale_by_muon`'s sharded plan, its state kept there.

References:
  Liu et al., `Muon²: Boosting Muon via Adaptive Second-Moment Preconditioning
  <https://arxiv.org/abs/2604.09967>`_, 2026

  modded-nanogpt Track 3 result #7 (`results/20260501_muonsq
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  ``muon_sq_update``), 2026
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.muon_sharding import MatrixPrecondition
from optax_snoo._src.utils import check_positive, check_unit_interval, value_at

__all__ = ["MuonSquaredState", "muon_squared_precondition"]


class MuonSquaredState(NamedTuple):
    """Muon²'s second moment ``V`` of a batch of matrices ``(..., out, in)``."""

    second_moment: jax.Array


def muon_squared_precondition(beta2: float | optax.Schedule = 0.95, eps: float = 1e-10
                              ) -> MatrixPrecondition:
    """Muon²'s precondition: the Nesterov momentum over the raw gradient's RMS.

    ``V ← β₂ V + (1 - β₂) G²`` (updated before use, no bias correction), then
    ``M / (sqrt(V) + eps)`` goes to Newton-Schulz; ``V`` is float32 (float64 for float64
    params).

    Args:
      beta2: decay of the second moment (Track 3 #7: 0.95), in [0, 1), or a schedule.
      eps: added to ``sqrt(V)`` (#7: 1e-10), > 0.

    Returns:
      A `MatrixPrecondition` for ``scale_by_muon(precondition=...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import muon_squared_precondition, scale_by_muon
      >>> tx = scale_by_muon(precondition=muon_squared_precondition())
      >>> params = {"w": jnp.ones((8, 4))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.eye(8, 4)}, state, params)

    References:
      Liu et al., `Muon²: Boosting Muon via Adaptive Second-Moment Preconditioning
      <https://arxiv.org/abs/2604.09967>`_, 2026
    """
    check_unit_interval("beta2", beta2)
    check_positive("eps", eps)

    def init(batch: int, out: int, inn: int, dtype: Any) -> MuonSquaredState:
        dt = jnp.promote_types(dtype, jnp.float32)
        return MuonSquaredState(jnp.zeros((batch, out, inn), dt))

    def apply(M: jax.Array, G: jax.Array, state: MuonSquaredState, count: jax.Array,
              flags: Any) -> tuple[jax.Array, MuonSquaredState]:
        del flags
        V = state.second_moment
        b2 = value_at(beta2, count)
        V = b2 * V + (1 - b2) * jnp.square(G.astype(V.dtype))
        return M.astype(V.dtype) / (jnp.sqrt(V) + eps), MuonSquaredState(V)

    return MatrixPrecondition(init, apply)
