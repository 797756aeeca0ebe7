"""What modded-nanogpt Track 3's recipes share: the groups' path patterns on this repository's
GPT and the Adam groups built from them.

The records name their parameters ``embed``, ``proj`` (the head), ``blocks.N.attn.
{q,k,v,proj}``, ``mlp.{fc,proj}``, ``norm*.gains``; this repository's GPT calls them
``wte/embedding``, ``lm_head/kernel``, ``blocks/N/attn/c_{q,k,v,proj}``, ``mlp/c_{fc,proj}``,
``ln_*/scale``. Every recipe takes ``adam_patterns=`` (a dict by group name) for other
names, and ``labels=`` for another Muon/Adam split; the embedding and head groups claim
what they match from Muon, and a model whose embedding matches nothing, or whose head
matches nothing while a Muon matrix has the embedding's shape, is refused.

References:
  Jordan et al., `modded-nanogpt Track 3 (optimization)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from optax_snoo._src.adam import AdamGroup

__all__ = [
    "EMBED_PATTERN",
    "HEAD_PATTERN",
    "TRACK3_ADAM_PATTERNS",
    "TRACK3_RECORD_ADAM_PATTERNS",
    "TRACK3_TRUST_GATE_PATTERN",
    "adam_groups",
    "patterns",
]

#: The token (and any position) embedding.
EMBED_PATTERN = r"(^|/)(wte|wpe|embed\w*)(/|$)"
#: The LM head.
HEAD_PATTERN = r"(^|/)(lm_head|head)(/|$)"
#: #36's (and #5, #8, #13, #15's) three AdamW groups, first match wins: every 1-D parameter
#: (biases, the head's bias, norm gains), the embedding, the head.
TRACK3_ADAM_PATTERNS: dict[str, str] = {
    "vectors": r"(^|/)(bias|scale|gains?)$|(^|/)(ln\w*|\w*norm\w*)(/|$)",
    "embed": EMBED_PATTERN,
    "head": HEAD_PATTERN,
}
#: #44/#46's five Adam groups, first match wins: every norm gain (``.../scale``), the
#: attention output projection's bias, every other 1-D parameter, the embedding, the head.
TRACK3_RECORD_ADAM_PATTERNS: dict[str, str] = {
    "gains": r"(^|/)(scale|gains?)$",
    "attn_proj_bias": r"(^|/)attn/c_proj/bias$",
    "vectors": r"(^|/)bias$",
    "embed": EMBED_PATTERN,
    "head": HEAD_PATTERN,
}
#: #44/#46's attention output projections (``attn.proj``; here ``attn/c_proj``): the
#: leaves the SOAP trust gate acts on.
TRACK3_TRUST_GATE_PATTERN = r"(^|/)attn/c_proj/kernel$"
#: The groups that take what their patterns match, also from Muon.
CLAIMING_GROUPS = ("embed", "head")


def patterns(defaults: Mapping[str, str], given: Mapping[str, str] | None) -> dict[str, str]:
    """``defaults`` with ``given`` replacing some (keys must be the groups')."""
    unknown = set(given or {}) - set(defaults)
    if unknown:
        raise ValueError(f"adam_patterns: {sorted(unknown)} are not groups of this recipe; "
                         f"its groups are {list(defaults)}")
    return {**defaults, **(given or {})}


def adam_groups(patterns: Mapping[str, str],
                settings: Sequence[tuple[str, optax.ScalarOrSchedule, float, float, float,
                                         float, bool]]) -> list[AdamGroup]:
    """One `AdamGroup` per ``(name, lr, b1, b2, eps, weight_decay, bias_correction)``, its
    pattern from ``patterns``; the embedding and head groups claim what they match, the
    embedding is required, the head when a Muon matrix is shaped like the embedding (a
    tied head is the embedding)."""
    return [AdamGroup(patterns[name], lr, b1, b2, eps, wd, bias_correction=bc, name=name,
                      claim=name in CLAIMING_GROUPS, required=name == "embed",
                      like="embed" if name == "head" else None)
            for name, lr, b1, b2, eps, wd, bc in settings]


def steps_in_order(table: Any, *names: str) -> None:
    """Refuse step constants that are not >= 1 and increasing (a run too short for the
    record's phases): ``names`` in the order the record has them."""
    values = [getattr(table, n) for n in names]
    if values[0] < 1 or any(b <= a for a, b in itertools.pairwise(values)):
        shown = ", ".join(f"{n}={getattr(table, n)}" for n in names)
        raise ValueError(f"the step constants {shown} must be >= 1 and increasing")


Schedule = Callable[[Any], Any]
