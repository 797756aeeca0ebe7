"""NorMuon: Muon with per-neuron variance normalisation, `scale_by_normuon` and `normuon`.

The normalisation itself runs inside `scale_by_muon` (its ``beta2``); these are the
named entry points.

References:
  Li et al., `NorMuon: Making Muon more efficient and scalable
  <https://arxiv.org/abs/2510.05491>`_, 2025
"""

from __future__ import annotations

from typing import Any

import optax

from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import muon


def scale_by_normuon(beta2: float | optax.Schedule = 0.95, **kwargs: Any
                     ) -> optax.GradientTransformation:
    r"""NorMuon's direction: `scale_by_muon` with its per-neuron variance normalisation.

    ``scale_by_muon(beta2=beta2, **kwargs)``: after orthogonalisation, each neuron's
    update (a row of the longer matrix axis) is divided by the square root of an EMA of
    its mean square and the matrix rescaled to keep its Frobenius norm (formula in
    `scale_by_muon`).

    Args:
      beta2: decay of the per-neuron second moment in [0, 1) or a schedule (the paper's
        0.95; modded-nanogpt's current record uses 0.9).
      **kwargs: any other argument of `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `MuonState` (``nu`` holds the
      second moment).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_normuon
      >>> tx = scale_by_normuon(0.95)
      >>> state = tx.init({"w": jnp.ones((4, 8))})
      >>> state.nu["w"].shape  # one value per column: the longer axis
      (1, 8)

    References:
      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025
    """
    return scale_by_muon(beta2=beta2, **kwargs)


def normuon(learning_rate: optax.ScalarOrSchedule, *,
            beta2: float | optax.Schedule = 0.95, **kwargs: Any
            ) -> optax.GradientTransformation:
    r"""NorMuon on matrices and matrix stacks, AdamW on every other leaf.

    ``muon(learning_rate, beta2=beta2, **kwargs)``: `muon` with NorMuon's per-neuron
    variance normalisation after orthogonalisation (see `scale_by_muon`). NorMuon's
    normalisation gives every neuron an update of similar size, which plain Muon's
    orthogonalisation does not; the paper reports 11-22% fewer steps than Muon at 1.1B
    to 5.4B parameters, and modded-nanogpt's records run it.

    Args:
      learning_rate: NorMuon learning rate (float >= 0 or schedule).
      beta2: per-neuron second-moment decay in [0, 1) or a schedule.
      **kwargs: any other argument of `muon`.

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import normuon
      >>> params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}
      >>> tx = normuon(0.02, labels={"w": "muon", "b": "adam"}, adam_learning_rate=3e-3)
      >>> updates, state = tx.update(params, tx.init(params), params)

    References:
      Li et al., `NorMuon: Making Muon more efficient and scalable
      <https://arxiv.org/abs/2510.05491>`_, 2025

      Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_ (NorMuonAndAdam), 2025
    """
    return muon(learning_rate, beta2=beta2, **kwargs)
