"""Path-rule labelling of params trees for `optax.partition` (Muon/Adam split, roles)."""

from optax_snoo._src.labels import (
    MUON_ADAM_RULES,
    describe,
    label_by_rules,
    muon_adam_labels,
    partition,
    path_to_str,
)

__all__ = [
    "MUON_ADAM_RULES",
    "describe",
    "label_by_rules",
    "muon_adam_labels",
    "partition",
    "path_to_str",
]
