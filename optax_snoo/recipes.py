"""Ready-made optimizer stacks as `Recipe` objects, one registry shared by the library, the
trainer (``python -m train --optimizer=NAME``) and the benchmarks.

``recipes.get(name)`` (or the module attribute of the same name) is a `Recipe`:
``recipe(total_steps, **hyperparameters)`` is its transformation,
``recipe.stack(total_steps, ...)`` a `Stack` with the learning rate a trainer logs, Snoo's
sync period and phase, the parameter groups and the readout; ``recipe.hyperparameters``
is the frozen table of its constants with their defaults and help. `describe` prints
each leaf's group.
"""

from optax_snoo._src.recipes import Groups, describe
from optax_snoo._src.recipes.base import (
    REGISTRY,
    Hyperparameters,
    Recipe,
    SnooHyperparameters,
    Stack,
    get,
    hyperparameter,
    register,
    with_snoo,
)
from optax_snoo._src.recipes.gpt2_medium import (
    RECORD_ADAM_PATTERNS,
    RECORD_MLP_PATTERN,
    modded_nanogpt,
    modded_nanogpt_muon,
)
from optax_snoo._src.recipes.stacks import (
    KFAC_LABEL_RULES,
    NEWTON_MUON_SHARED_INPUTS,
    adafactor,
    adamw,
    kfac_label_rules,
    kfac_refresh_policy,
    nanogpt_decay_mask,
    snoo_adamw,
    snoo_kfac,
    snoo_muon,
    snoo_normuon,
    snoo_skew_adam,
)
from optax_snoo._src.recipes.stacks import kfac_recipe as kfac
from optax_snoo._src.recipes.stacks import muon_recipe as muon
from optax_snoo._src.recipes.stacks import newton_muon_recipe as newton_muon
from optax_snoo._src.recipes.stacks import normuon_recipe as normuon
from optax_snoo._src.recipes.stacks import skew_adam_recipe as skew_adam
from optax_snoo._src.recipes.track3_adam import track3_adam
from optax_snoo._src.recipes.track3_aurora_ema import (
    track3_aurora_ema_ref,
    track3_circuit_muon,
    track3_ema_nesterov_aurora,
    track3_tail_phase_readout,
)
from optax_snoo._src.recipes.track3_aurora_proj import (
    TRACK3_AURORA_PROJ_PATTERNS,
    track3_aurora_proj,
    track3_rre,
    track3_tail_refinterp,
)
from optax_snoo._src.recipes.track3_baseline import snoo_track3_baseline, track3_baseline
from optax_snoo._src.recipes.track3_common import (
    TRACK3_ADAM_PATTERNS,
    TRACK3_RECORD_ADAM_PATTERNS,
    TRACK3_TRUST_GATE_PATTERN,
)
from optax_snoo._src.recipes.track3_contra import (
    track3_aurora,
    track3_contra_muon,
    track3_normuon_floor,
)
from optax_snoo._src.recipes.track3_hyperball import adamh, muloco_normuonh, muonh
from optax_snoo._src.recipes.track3_muon_variants import (
    track3_dynmuon,
    track3_muon_squared,
    track3_pmuon,
    track3_sinksoap,
    track3_spectral_descent,
)
from optax_snoo._src.recipes.track3_muown import (
    MUOWN_POLAR_EXPRESS,
    TRACK3_MLP_PROJ_PATTERN,
    track3_contra_normuown,
    track3_muown,
)
from optax_snoo._src.recipes.track3_newton_muon import (
    TRACK3_NEWTON_MUON_PATTERNS,
    track3_newton_muon,
)
from optax_snoo._src.recipes.track3_psgd import track3_psgd
from optax_snoo._src.recipes.track3_shampoo import track3_shampoo, track3_shampoo_pinv
from optax_snoo._src.recipes.track3_soap import (
    track3_record,
    track3_soap_muon,
    track3_soap_muon_record,
)
from optax_snoo._src.recipes.track3_soaph import (
    track3_klsoap,
    track3_klsoap_power_decay,
    track3_soaph,
)
from optax_snoo._src.recipes.track3_soft_muon import (
    TRACK3_SOAP_MLP_PATTERN,
    TRACK3_SOAP_V_PATTERN,
    track3_contra_soft_muon,
    track3_soda,
)

__all__ = [
    "KFAC_LABEL_RULES",
    "MUOWN_POLAR_EXPRESS",
    "NEWTON_MUON_SHARED_INPUTS",
    "RECORD_ADAM_PATTERNS",
    "RECORD_MLP_PATTERN",
    "REGISTRY",
    "TRACK3_ADAM_PATTERNS",
    "TRACK3_AURORA_PROJ_PATTERNS",
    "TRACK3_MLP_PROJ_PATTERN",
    "TRACK3_NEWTON_MUON_PATTERNS",
    "TRACK3_RECORD_ADAM_PATTERNS",
    "TRACK3_SOAP_MLP_PATTERN",
    "TRACK3_SOAP_V_PATTERN",
    "TRACK3_TRUST_GATE_PATTERN",
    "Groups",
    "Hyperparameters",
    "Recipe",
    "SnooHyperparameters",
    "Stack",
    "adafactor",
    "adamh",
    "adamw",
    "describe",
    "get",
    "hyperparameter",
    "kfac",
    "kfac_label_rules",
    "kfac_refresh_policy",
    "modded_nanogpt",
    "modded_nanogpt_muon",
    "muloco_normuonh",
    "muon",
    "muonh",
    "nanogpt_decay_mask",
    "newton_muon",
    "normuon",
    "register",
    "skew_adam",
    "snoo_adamw",
    "snoo_kfac",
    "snoo_muon",
    "snoo_normuon",
    "snoo_skew_adam",
    "snoo_track3_baseline",
    "track3_adam",
    "track3_aurora",
    "track3_aurora_ema_ref",
    "track3_aurora_proj",
    "track3_baseline",
    "track3_circuit_muon",
    "track3_contra_muon",
    "track3_contra_normuown",
    "track3_contra_soft_muon",
    "track3_dynmuon",
    "track3_ema_nesterov_aurora",
    "track3_klsoap",
    "track3_klsoap_power_decay",
    "track3_muon_squared",
    "track3_muown",
    "track3_newton_muon",
    "track3_normuon_floor",
    "track3_pmuon",
    "track3_psgd",
    "track3_record",
    "track3_rre",
    "track3_shampoo",
    "track3_shampoo_pinv",
    "track3_sinksoap",
    "track3_soap_muon",
    "track3_soap_muon_record",
    "track3_soaph",
    "track3_soda",
    "track3_spectral_descent",
    "track3_tail_phase_readout",
    "track3_tail_refinterp",
    "with_snoo",
]
