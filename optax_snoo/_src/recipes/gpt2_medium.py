"""modded-nanogpt's GPT-2 Medium record stack (PR #128): Snoo around Muon and Adam groups.

References:
  Jordan et al, `modded-nanogpt GPT-2 Medium records #128, #129, #137
  <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_snoo._src.adam import AdamGroup
from optax_snoo._src.muon_adam import MuonGroup, group_labels, muon
from optax_snoo._src.recipes.base import (
    Hyperparameters,
    Recipe,
    Stack,
    hyperparameter,
    register,
    with_snoo,
)
from optax_snoo._src.schedules import muon_momentum_warmup, stable_cooldown_schedule

__all__ = ["RECORD_ADAM_PATTERNS", "RECORD_MLP_PATTERN"]

#: The record's Adam groups by path (first match wins), on this repository's names: the
#: head, the embeddings, everything else. Their rates belong to the record's architecture
#: (untied embeddings, 1/320 head): rescale for others.
RECORD_ADAM_PATTERNS: dict[str, str] = {
    "head": r"(^|/)(lm_head|head)(/|$)",
    "embed": r"(^|/)(wte|wpe|embed\w*)(/|$)",
    "vectors": r".*",
}
#: The Muon matrices with the record's ``wd_mul = 2`` (its ``mlp.fc_w``, ``mlp.proj_w``;
#: here ``mlp/c_fc``, ``mlp/c_proj``, ``mlp/c_gate``).
RECORD_MLP_PATTERN = r"(^|/)mlp(/|$)"


@dataclasses.dataclass(frozen=True)
class ModdedNanogptHyperparameters(Hyperparameters):
    """The GPT-2 Medium record's optimizer constants (PR #128)."""

    muon_learning_rate: float = hyperparameter(0.027, "Muon's peak lr (0.03 from PR #129)",
                                               check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum after its warm-up",
                                          check="unit_interval")
    muon_momentum_start: float = hyperparameter(0.85, "Muon's momentum at step 0",
                                                check="unit_interval")
    muon_momentum_warmup_steps: int = hyperparameter(300, "steps of the momentum warm-up",
                                                     check="at_least_0")
    muon_weight_decay: float = hyperparameter(0.01, "Muon's decoupled weight decay (times "
                                              "its lr)", check="non_negative")
    mlp_weight_decay_multiplier: float = hyperparameter(
        2.0, "the record's wd_mul on the MLP matrices", check="non_negative")
    muon_smoothing: float | None = hyperparameter(
        None, "Muon's update smoothing sigma (PR #137: 0.2; None = off)",
        check="unit_interval")
    smoothing_form: str = hyperparameter("ema", "the smoothing's form: ema (PR #137) or "
                                         "nesterov (PR #129)", choices=("ema", "nesterov"))
    head_learning_rate: float = hyperparameter(1 / 320, "Adam's peak lr on the head",
                                               check="positive")
    embed_learning_rate: float = hyperparameter(0.3, "Adam's peak lr on the embeddings",
                                                check="positive")
    vector_learning_rate: float = hyperparameter(0.015, "Adam's peak lr on every other "
                                                 "non-Muon leaf", check="positive")
    adam_b1: float = hyperparameter(0.8, "Adam's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.95, "Adam's second-moment decay", check="unit_interval")
    adam_eps: float = hyperparameter(1e-10, "Adam's epsilon", check="positive")
    cooldown_frac: float = hyperparameter(0.7, "fraction of the run in the linear cooldown",
                                          check="positive_fraction")
    final_lr_scale: float = hyperparameter(0.0, "every lr's final multiplier",
                                           check="fraction")
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))


def _modded_nanogpt(t: ModdedNanogptHyperparameters, total_steps: int, *, labels: Any = None,
                    adam_patterns: dict[str, str] | None = None,
                    newton_schulz_plan: Any = None, shard_newton_schulz: bool = True) -> Stack:
    patterns = _patterns(adam_patterns)
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, t.cooldown_frac,
                                                     t.final_lr_scale)
    claimed = {"head", "embed"}
    groups = [AdamGroup(patterns[name], schedule(lr), t.adam_b1, t.adam_b2, t.adam_eps,
                        name=name, claim=name in claimed, required=name == "embed",
                        like="embed" if name == "head" else None)
              for name, lr in (("head", t.head_learning_rate),
                               ("embed", t.embed_learning_rate),
                               ("vectors", t.vector_learning_rate))]
    mlp_decay = t.muon_weight_decay * t.mlp_weight_decay_multiplier
    lr = schedule(t.muon_learning_rate)
    muon_groups = [MuonGroup(RECORD_MLP_PATTERN, weight_decay=mlp_decay, name="mlp"),
                   MuonGroup(".*", name="matrices")]
    tx = muon(
        lr, beta=muon_momentum_warmup(t.muon_momentum_start, t.muon_momentum,
                                      t.muon_momentum_warmup_steps),
        weight_decay=t.muon_weight_decay, muon_groups=muon_groups,
        coefficients="modded", ns_dtype=t.ns_dtype, smoothing=t.muon_smoothing,
        smoothing_form=t.smoothing_form,
        adam_groups=groups, labels=labels, newton_schulz_plan=newton_schulz_plan,
        shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, lr, groups=group_labels(groups, labels, muon_groups))


def _patterns(adam_patterns: dict[str, str] | None) -> dict[str, str]:
    patterns = {**RECORD_ADAM_PATTERNS, **(adam_patterns or {})}
    if set(patterns) != set(RECORD_ADAM_PATTERNS):
        raise ValueError(f"adam_patterns: expected keys among {sorted(RECORD_ADAM_PATTERNS)}, "
                         f"got {sorted(adam_patterns or {})}")
    return patterns


_OPTIONS = dict(labels=None, adam_patterns=None, newton_schulz_plan=None,
                shard_newton_schulz=True)

modded_nanogpt_muon = register(Recipe(
    "modded_nanogpt_muon", ModdedNanogptHyperparameters, _modded_nanogpt, options=_OPTIONS,
    summary="the GPT-2 Medium record's Muon + Adam groups without Snoo (modded-nanogpt "
    "PR #128): wd_mul 2 on the MLP, flat then 70% linear cooldown"))
modded_nanogpt = register(with_snoo(
    modded_nanogpt_muon, "modded_nanogpt",
    summary="modded-nanogpt's GPT-2 Medium record (PR #128): Snoo (0.68, 0.37, k 28) around "
    "Muon (lr 0.027, wd 0.01, wd_mul 2 on the MLP, momentum 0.85 -> 0.95 over 300 steps) and "
    "Adam (head 1/320, embeddings 0.3, rest 0.015; betas (0.8, 0.95), eps 1e-10), flat then "
    "a 70% linear cooldown"))
