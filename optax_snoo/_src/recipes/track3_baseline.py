"""modded-nanogpt Track 3's tuned Muon + AdamW baseline, record #36 (``train_gpt_simple.py``).

- Muon on the blocks' matrices: momentum 0.95 in EMA-Nesterov form without bias
  correction, Newton-Schulz ``(2, -1.5, 0.5)`` x 12 in bfloat16 after ``X/(‖X‖_F + 1e-7)``,
  shape scale ``sqrt(max(1, out/in))``, ``p ← p (1 - lr·0.05) - lr·O``, lr 0.025;
- AdamW (PyTorch's: bias-corrected, ``p ← p (1 - lr·wd)``, betas (0.8, 0.95), eps 1e-10,
  wd 0.001) in three groups (`TRACK3_ADAM_PATTERNS`): every 1-D parameter lr 0.015, the
  token embedding lr 0.7, the LM head lr 0.004;
- every learning rate (so every decay) flat for the first 30% of the run, then linear
  to 0 (`optax_snoo.stable_cooldown_schedule`).

#36 sums the token losses (``reduction="sum"``); with a mean loss the gradients are smaller
by the token count, which changes only the epsilons' relative size.

References:
  Jordan et al., `modded-nanogpt Track 3 record #36, tuned Muon baseline
  (train_gpt_simple.py)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_snoo._src.muon_adam import group_labels, muon
from optax_snoo._src.recipes.base import (
    Hyperparameters,
    Recipe,
    Stack,
    hyperparameter,
    register,
    with_snoo,
)
from optax_snoo._src.recipes.track3_common import TRACK3_ADAM_PATTERNS, adam_groups, patterns
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["Track3BaselineHyperparameters"]


@dataclasses.dataclass(frozen=True)
class Track3BaselineHyperparameters(Hyperparameters):
    """Record #36's constants (``train_gpt_simple.py``)."""

    muon_learning_rate: float = hyperparameter(0.025, "Muon's peak lr", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (EMA-Nesterov form)",
                                          check="unit_interval")
    muon_weight_decay: float = hyperparameter(0.05, "Muon's decoupled weight decay (times "
                                              "its lr)", check="non_negative")
    embed_learning_rate: float = hyperparameter(0.7, "AdamW's peak lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(0.004, "AdamW's peak lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.015, "AdamW's peak lr on every 1-D "
                                                 "parameter", check="positive")
    adam_b1: float = hyperparameter(0.8, "AdamW's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.95, "AdamW's second-moment decay",
                                    check="unit_interval")
    adam_eps: float = hyperparameter(1e-10, "AdamW's epsilon", check="positive")
    adam_weight_decay: float = hyperparameter(0.001, "AdamW's decoupled weight decay (times "
                                              "its lr), every group", check="non_negative")
    cooldown_frac: float = hyperparameter(0.7, "fraction of the run in the linear cooldown "
                                          "to 0", check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _track3_baseline(t: Track3BaselineHyperparameters, total_steps: int, *, labels: Any = None,
                     adam_patterns: dict[str, str] | None = None,
                     newton_schulz_plan: Any = None, shard_newton_schulz: bool = True) -> Stack:
    names = patterns(TRACK3_ADAM_PATTERNS, adam_patterns)
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, t.cooldown_frac)
    groups = adam_groups(names, [
        (name, schedule(lr), t.adam_b1, t.adam_b2, t.adam_eps, t.adam_weight_decay, True)
        for name, lr in (("vectors", t.vector_learning_rate), ("embed", t.embed_learning_rate),
                         ("head", t.head_learning_rate))])
    lr = schedule(t.muon_learning_rate)
    tx = muon(lr, beta=t.muon_momentum, weight_decay=t.muon_weight_decay,
              coefficients="track3", ns_dtype=t.ns_dtype, adam_groups=groups, labels=labels,
              newton_schulz_plan=newton_schulz_plan, shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, lr, groups=group_labels(groups, labels))


#: The options of the Track 3 recipes: the labels, the groups' patterns, placement.
TRACK3_OPTIONS = dict(labels=None, adam_patterns=None, newton_schulz_plan=None,
                      shard_newton_schulz=True)

track3_baseline = register(Recipe(
    "track3_baseline", Track3BaselineHyperparameters, _track3_baseline,
    options=TRACK3_OPTIONS, record_steps=3250,
    summary="modded-nanogpt Track 3's tuned Muon + AdamW baseline (record #36, 3250 steps)"))
snoo_track3_baseline = register(with_snoo(track3_baseline))
