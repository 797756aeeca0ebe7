"""Rounding of low-precision params after an update: stochastic (unbiased) or dithered."""

from optax_snoo._src.rounding import (
    RoundingState,
    by_name,
    dithered_rounding,
    round_dithered,
    round_stochastic,
    stochastic_rounding,
)

__all__ = [
    "RoundingState",
    "by_name",
    "dithered_rounding",
    "round_dithered",
    "round_stochastic",
    "stochastic_rounding",
]
