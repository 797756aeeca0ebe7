"""Newton-Muon with modded-nanogpt Track 3 record #15's groups (3300 steps, claim 3275).

`optax_snoo.newton_muon` (the inputs' covariance, EMA 0.95 per refresh every 64 updates,
damping 0.2 x the mean eigenvalue, applied on the input side before Muon's momentum; q/k/v
share one factor) with Muon (momentum 0.95, Newton-Schulz ``(2, -1.5, 0.5)`` x 12) in four
`optax_snoo.MuonGroup`\\ s, ``W ← W (1 - lr·wd) - lr·O``: q/k/v lr 0.020 wd 0.025,
attention output 0.025/0.025, MLP in 0.030/0.0375, MLP out 0.030/0.025; aux AdamW (betas
(0.8, 0.95), eps 1e-10, no decay) embedding 0.3, head 1/320, 1-D 0.01; every lr flat then
linear to 0 over the last 70%. #15 splits the 3072-wide MLP input into blocks of 768: pass
the option ``block_size=n_embd``. Pass ``input_covariance=`` to every ``update`` (see
`optax_snoo.precondition_by_input_covariance`).

References:
  modded-nanogpt Track 3 record #15, Newton-Muon (`results/20260505_newton_muon
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
  2026
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from optax_snoo._src.muon_adam import MuonGroup, group_labels
from optax_snoo._src.newton_muon import newton_muon
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import TRACK3_ADAM_PATTERNS, patterns
from optax_snoo._src.recipes.track3_hyperball import AuxAdamWHyperparameters, aux_adamw_groups
from optax_snoo._src.schedules import stable_cooldown_schedule

__all__ = ["TRACK3_NEWTON_MUON_PATTERNS", "Track3NewtonMuonHyperparameters"]

#: Record #15's Muon groups on this repository's GPT: the record's q/k/v, attn.proj,
#: mlp.fc, mlp.proj kernels.
TRACK3_NEWTON_MUON_PATTERNS: dict[str, str] = {
    "qkv": r"(^|/)attn/c_[qkv]/kernel$",
    "attn_proj": r"(^|/)attn/c_proj/kernel$",
    "mlp_fc": r"(^|/)mlp/c_fc/kernel$",
    "mlp_proj": r"(^|/)mlp/c_proj/kernel$",
}


@dataclasses.dataclass(frozen=True)
class Track3NewtonMuonHyperparameters(AuxAdamWHyperparameters):
    """Record #15's constants."""

    qkv_learning_rate: float = hyperparameter(0.020, "Muon's peak lr on q, k, v",
                                              check="positive")
    qkv_weight_decay: float = hyperparameter(0.025, "Muon's decay on q, k, v",
                                             check="non_negative")
    attn_proj_learning_rate: float = hyperparameter(0.025, "Muon's peak lr on the attention "
                                                    "output", check="positive")
    attn_proj_weight_decay: float = hyperparameter(0.025, "Muon's decay on the attention "
                                                   "output", check="non_negative")
    mlp_fc_learning_rate: float = hyperparameter(0.030, "Muon's peak lr on the MLP input",
                                                 check="positive")
    mlp_fc_weight_decay: float = hyperparameter(0.0375, "Muon's decay on the MLP input",
                                                check="non_negative")
    mlp_proj_learning_rate: float = hyperparameter(0.030, "Muon's peak lr on the MLP output",
                                                   check="positive")
    mlp_proj_weight_decay: float = hyperparameter(0.025, "Muon's decay on the MLP output",
                                                  check="non_negative")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum", check="unit_interval")
    newton_refresh_every: int = hyperparameter(64, "updates between refreshes of the input "
                                               "covariance inverses", check="at_least_1")
    newton_ema_decay: float = hyperparameter(0.95, "the input covariance's EMA decay per "
                                             "refresh", check="unit_interval")
    newton_damping: float = hyperparameter(0.2, "damping as a fraction of the mean "
                                           "eigenvalue", check="non_negative")
    cooldown_frac: float = hyperparameter(0.7, "every lr's linear cooldown fraction",
                                          check="positive_fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _track3_newton_muon(t: Track3NewtonMuonHyperparameters, total_steps: int, *,
                        labels: Any = None, adam_patterns: dict[str, str] | None = None,
                        newton_schulz_plan: Any = None, shard_newton_schulz: bool = True,
                        block_size: int | None = None,
                        shared_inputs: Sequence[Sequence[str]] = (("c_q", "c_k", "c_v"),)
                        ) -> Stack:
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, t.cooldown_frac)
    muon_groups = [MuonGroup(pattern, schedule(getattr(t, f"{name}_learning_rate")),
                             getattr(t, f"{name}_weight_decay"), name=name)
                   for name, pattern in TRACK3_NEWTON_MUON_PATTERNS.items()]
    groups = aux_adamw_groups(t, patterns(TRACK3_ADAM_PATTERNS, adam_patterns), total_steps,
                              t.cooldown_frac)
    # Muon's own lr is each group's: a Muon leaf no group matches is refused at init.
    tx = newton_muon(
        schedule(t.mlp_fc_learning_rate), ema_decay=t.newton_ema_decay,
        damping=t.newton_damping, refresh_every=t.newton_refresh_every,
        block_size=block_size, shared_inputs=shared_inputs, beta=t.muon_momentum,
        muon_groups=muon_groups, coefficients="track3", ns_dtype=t.ns_dtype,
        adam_groups=groups, labels=labels, newton_schulz_plan=newton_schulz_plan,
        shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, schedule(t.mlp_fc_learning_rate),
                 groups=group_labels(groups, labels, muon_groups),
                 update_args=("input_covariance",))


track3_newton_muon = register(Recipe(
    "track3_newton_muon", Track3NewtonMuonHyperparameters, _track3_newton_muon,
    options={**TRACK3_OPTIONS, "block_size": None,
             "shared_inputs": (("c_q", "c_k", "c_v"),)},
    record_steps=3300,
    summary="Newton-Muon with Track 3 record #15's four Muon groups and aux AdamW (3300 "
    "steps)"))
