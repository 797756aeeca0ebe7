"""Ready-made stacks: modded-nanogpt's GPT-2 Medium record (Snoo + Muon + Adam), Track 3's
Muon + AdamW baseline (#36), and their schedule."""

from optax_snoo._src.recipes import (
    RECORD_ADAM_GROUPS,
    RECORD_WEIGHT_DECAY_MULTIPLIERS,
    TRACK3_ADAM_PATTERNS,
    TRACK3_COEFFICIENTS,
    modded_nanogpt,
    record_weight_decay_multiplier,
    snoo_muon,
    stable_cooldown_schedule,
    track3_baseline,
)

__all__ = [
    "RECORD_ADAM_GROUPS",
    "RECORD_WEIGHT_DECAY_MULTIPLIERS",
    "TRACK3_ADAM_PATTERNS",
    "TRACK3_COEFFICIENTS",
    "modded_nanogpt",
    "record_weight_decay_multiplier",
    "snoo_muon",
    "stable_cooldown_schedule",
    "track3_baseline",
]
