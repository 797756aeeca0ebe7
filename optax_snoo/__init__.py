"""optax_snoo: Snoo, Muon, SkewAdam and K-FAC as composable optax transformations."""

from optax_snoo.snoo import SnooState, snoo, snoo_is_sync_step

__version__ = "0.1.0"
