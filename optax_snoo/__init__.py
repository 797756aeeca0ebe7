"""optax_snoo: Snoo, Muon, SkewAdam and K-FAC as composable optax transformations.

Modules: `snoo`, `muon`, `skew_adam`, `kfac`, `rounding`, `labels`, `memory`, `recipes`.
The functions below are re-exported; import module internals from their modules
(`from optax_snoo.muon import ...`), since `optax_snoo.snoo` and `optax_snoo.skew_adam`
name the functions here.
"""

from optax_snoo import kfac, labels, memory, recipes, rounding
from optax_snoo.memory import state_bytes, state_bytes_by_group
from optax_snoo.muon import (
    MuonState,
    add_decoupled_weight_decay,
    muon,
    muon_momentum_warmup,
    orthogonalize,
    scale_by_muon,
)
from optax_snoo.recipes import modded_nanogpt, stable_cooldown_schedule
from optax_snoo.rounding import RoundingState, dithered_rounding, stochastic_rounding
from optax_snoo.skew_adam import (
    RolePolicy,
    ScaleBySecondMomentState,
    ScaleBySkewAdamState,
    assign_roles,
    scale_by_second_moment,
    scale_by_skew_adam,
    skew_adam,
)
from optax_snoo.snoo import SnooState, snoo, snoo_is_sync_step

__version__ = "0.1.0"

__all__ = [
    "MuonState",
    "RolePolicy",
    "RoundingState",
    "ScaleBySecondMomentState",
    "ScaleBySkewAdamState",
    "SnooState",
    "add_decoupled_weight_decay",
    "assign_roles",
    "dithered_rounding",
    "kfac",
    "labels",
    "memory",
    "modded_nanogpt",
    "muon",
    "muon_momentum_warmup",
    "orthogonalize",
    "recipes",
    "rounding",
    "scale_by_muon",
    "scale_by_second_moment",
    "scale_by_skew_adam",
    "skew_adam",
    "snoo",
    "snoo_is_sync_step",
    "stable_cooldown_schedule",
    "state_bytes",
    "state_bytes_by_group",
    "stochastic_rounding",
]
