"""optax_snoo: Snoo, Muon, SkewAdam, K-FAC, Newton-Muon, QK-clip as composable optax transforms.

The transformations and their states are exported here; `optax_snoo.kfac`,
`optax_snoo.labels`, `optax_snoo.rounding`, `optax_snoo.memory` and `optax_snoo.recipes`
are namespaces of related tools. Implementations live in `optax_snoo._src` (as in optax),
so no public module is shadowed by a function of the same name.
"""

from optax_snoo import kfac, labels, memory, recipes, rounding
from optax_snoo._src.adam import AdamGroup, adam_group, scale_by_adam
from optax_snoo._src.averaging import (
    EmaNesterovState,
    ReferenceInterpolationState,
    TailEmaState,
    TailVelocityState,
    ema_nesterov,
    eval_params,
    reference_interpolation,
    tail_ema,
    tail_velocity,
)
from optax_snoo._src.circuit import OVHeads, circuit_ov_heads, scale_by_circuit_ov
from optax_snoo._src.memory import state_bytes, state_bytes_by_group
from optax_snoo._src.muon import SOFT_MUON_SERIES, MuonState, scale_by_muon
from optax_snoo._src.muon_adam import MuonGroup, muon
from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.muon_sharding import MatrixPrecondition, OwnedPreconditionState
from optax_snoo._src.muon_squared import MuonSquaredState, muon_squared_precondition
from optax_snoo._src.muown import MuownState, muown
from optax_snoo._src.newton_muon import (
    InputCovarianceState,
    input_covariance_from_stats,
    input_covariance_refresh_due,
    newton_muon,
    precondition_by_input_covariance,
)
from optax_snoo._src.newton_schulz import (
    COEFFICIENT_PRESETS,
    POLAR_EXPRESS_COEFFICIENTS,
    orthogonalize,
)
from optax_snoo._src.normuon import normuon, scale_by_normuon
from optax_snoo._src.phase_readout import PhaseReadoutState, phase_readout
from optax_snoo._src.pmuon import PMuonState, pmuon_precondition
from optax_snoo._src.psgd import (
    PSGDKronState,
    psgd_kron,
    psgd_probes,
    psgd_spectral_norm,
    scale_by_psgd_kron,
)
from optax_snoo._src.qk_clip import QKHeads, qk_clip_heads, qk_clip_scales, scale_by_qk_clip
from optax_snoo._src.radius import RadiusStepsState, radius_steps
from optax_snoo._src.recipes.gpt2_medium import modded_nanogpt
from optax_snoo._src.rounding import RoundingState, dithered_rounding, stochastic_rounding
from optax_snoo._src.schedules import (
    logistic_schedule,
    muon_momentum_schedule,
    muon_momentum_warmup,
    nanogpt_cosine_schedule,
    power_cool,
    power_cool_scaled,
    stable_cooldown_schedule,
    trust_gate_cap,
    trust_gate_floor,
)
from optax_snoo._src.shampoo import (
    ShampooState,
    scale_by_shampoo,
    shampoo,
    shampoo_inverse_root,
)
from optax_snoo._src.sinksoap import (
    GramSinkhornState,
    gram_sinkhorn,
    scale_by_sinksoap,
    sinkhorn_balance,
    sinksoap,
)
from optax_snoo._src.skew_adam import (
    DEFAULT_POLICIES,
    DEFAULT_ROLE_RULES,
    POLICY_PRESETS,
    RolePolicy,
    ScaleBySecondMomentState,
    ScaleBySkewAdamState,
    assign_roles,
    cast_to_param_dtype,
    scale_by_second_moment,
    scale_by_skew_adam,
    skew_adam,
    skew_adam_roles,
)
from optax_snoo._src.snoo import (
    SnooState,
    diloco,
    over_replicas,
    skip_update,
    snoo,
    snoo_is_sync_step,
)
from optax_snoo._src.soap import SoapState, scale_by_soap, soap
from optax_snoo._src.soap_muon import SoapMatrixState, soap_muon, soap_whitening
from optax_snoo._src.trajectory import (
    DeltaPulsesState,
    PullToInitState,
    RreExtrapolationState,
    delta_pulses,
    pull_to_init,
    rre_extrapolation,
)
from optax_snoo._src.weight_decay import (
    DecoupledWeightDecayState,
    add_decoupled_weight_decay,
    cautious_mask,
)

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENT_PRESETS",
    "DEFAULT_POLICIES",
    "DEFAULT_ROLE_RULES",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLICY_PRESETS",
    "SOFT_MUON_SERIES",
    "AdamGroup",
    "DecoupledWeightDecayState",
    "DeltaPulsesState",
    "EmaNesterovState",
    "GramSinkhornState",
    "InputCovarianceState",
    "MatrixPrecondition",
    "MuonGroup",
    "MuonSquaredState",
    "MuonState",
    "MuownState",
    "NewtonSchulzPlan",
    "OVHeads",
    "OwnedPreconditionState",
    "PMuonState",
    "PSGDKronState",
    "PhaseReadoutState",
    "PullToInitState",
    "QKHeads",
    "RadiusStepsState",
    "ReferenceInterpolationState",
    "RolePolicy",
    "RoundingState",
    "RreExtrapolationState",
    "ScaleBySecondMomentState",
    "ScaleBySkewAdamState",
    "ShampooState",
    "SnooState",
    "SoapMatrixState",
    "SoapState",
    "TailEmaState",
    "TailVelocityState",
    "adam_group",
    "add_decoupled_weight_decay",
    "assign_roles",
    "cast_to_param_dtype",
    "cautious_mask",
    "circuit_ov_heads",
    "delta_pulses",
    "diloco",
    "dithered_rounding",
    "ema_nesterov",
    "eval_params",
    "gram_sinkhorn",
    "input_covariance_from_stats",
    "input_covariance_refresh_due",
    "kfac",
    "labels",
    "logistic_schedule",
    "memory",
    "modded_nanogpt",
    "muon",
    "muon_momentum_schedule",
    "muon_momentum_warmup",
    "muon_squared_precondition",
    "muown",
    "nanogpt_cosine_schedule",
    "newton_muon",
    "normuon",
    "orthogonalize",
    "over_replicas",
    "phase_readout",
    "pmuon_precondition",
    "power_cool",
    "power_cool_scaled",
    "precondition_by_input_covariance",
    "psgd_kron",
    "psgd_probes",
    "psgd_spectral_norm",
    "pull_to_init",
    "qk_clip_heads",
    "qk_clip_scales",
    "radius_steps",
    "recipes",
    "reference_interpolation",
    "rounding",
    "rre_extrapolation",
    "scale_by_adam",
    "scale_by_circuit_ov",
    "scale_by_muon",
    "scale_by_normuon",
    "scale_by_psgd_kron",
    "scale_by_qk_clip",
    "scale_by_second_moment",
    "scale_by_shampoo",
    "scale_by_sinksoap",
    "scale_by_skew_adam",
    "scale_by_soap",
    "shampoo",
    "shampoo_inverse_root",
    "sinkhorn_balance",
    "sinksoap",
    "skew_adam",
    "skew_adam_roles",
    "skip_update",
    "snoo",
    "snoo_is_sync_step",
    "soap",
    "soap_muon",
    "soap_whitening",
    "stable_cooldown_schedule",
    "state_bytes",
    "state_bytes_by_group",
    "stochastic_rounding",
    "tail_ema",
    "tail_velocity",
    "trust_gate_cap",
    "trust_gate_floor",
]
