"""Path rules over params trees: `by_path` (any value per leaf), labels for `optax.partition`
(Muon/Adam split, roles), `describe`."""

from optax_snoo._src.labels import (
    MUON_ADAM_RULES,
    by_path,
    describe,
    label_by_rules,
    muon_adam_labels,
    partition,
    path_to_str,
)

__all__ = [
    "MUON_ADAM_RULES",
    "by_path",
    "describe",
    "label_by_rules",
    "muon_adam_labels",
    "partition",
    "path_to_str",
]
