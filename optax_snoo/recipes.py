"""Ready-made stacks: the modded-nanogpt record's Snoo + Muon + Adam, and its schedule."""

from optax_snoo._src.recipes import (
    RECORD_ADAM_GROUPS,
    RECORD_WEIGHT_DECAY_MULTIPLIERS,
    modded_nanogpt,
    record_weight_decay_multiplier,
    snoo_muon,
    stable_cooldown_schedule,
)

__all__ = [
    "RECORD_ADAM_GROUPS",
    "RECORD_WEIGHT_DECAY_MULTIPLIERS",
    "modded_nanogpt",
    "record_weight_decay_multiplier",
    "snoo_muon",
    "stable_cooldown_schedule",
]
