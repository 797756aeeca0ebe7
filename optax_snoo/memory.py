"""Optimizer-state accounting in bytes, on real states or `jax.eval_shape` trees."""

from optax_snoo._src.memory import (
    adamw_state_bytes,
    muon_state_bytes,
    skew_adam_state_bytes,
    skew_adam_state_bytes_by_role,
    soap_muon_state_bytes,
    state_bytes,
    state_bytes_by_group,
)

__all__ = [
    "adamw_state_bytes",
    "muon_state_bytes",
    "skew_adam_state_bytes",
    "skew_adam_state_bytes_by_role",
    "soap_muon_state_bytes",
    "state_bytes",
    "state_bytes_by_group",
]
