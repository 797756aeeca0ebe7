"""Ready optimizer stacks: modded-nanogpt's GPT-2 Medium record and Track 3 baseline.

`stable_cooldown_schedule` is the records' learning-rate multiplier; `snoo_muon` is Snoo
around `optax_snoo.muon` (Muon on hidden matrices, one or more Adam groups);
`modded_nanogpt` is `snoo_muon` with the GPT-2 Medium record's values (PR #128), every one
overridable, all learning rates scaled by that schedule; `track3_baseline` is Track 3's
tuned Muon + AdamW baseline (record #36).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.adam import AdamGroup
from optax_snoo._src.averaging import ema_nesterov, tail_ema
from optax_snoo._src.labels import label_by_rules, path_to_str
from optax_snoo._src.muon import (
    Coefficients,
    muon,
    muon_momentum_warmup,
    scale_by_muon,
    with_adam_groups,
)
from optax_snoo._src.muon_sharding import NewtonSchulzPlan
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.schedules import muon_momentum_schedule, power_cool
from optax_snoo._src.snoo import snoo
from optax_snoo._src.soap_muon import scale_by_soap_whitening, trust_gate_cap, trust_gate_floor
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    is_real,
)

__all__ = [
    "RECORD_ADAM_GROUPS",
    "RECORD_WEIGHT_DECAY_MULTIPLIERS",
    "TRACK3_ADAM_PATTERNS",
    "TRACK3_COEFFICIENTS",
    "TRACK3_NEWTON_MUON_GROUPS",
    "TRACK3_POWER_COOL_C",
    "TRACK3_RECORD_ADAM_PATTERNS",
    "TRACK3_RECORD_STEPS",
    "TRACK3_TRUST_GATE_PATTERN",
    "modded_nanogpt",
    "muloco_normuonh",
    "muonh",
    "record_weight_decay_multiplier",
    "snoo_muon",
    "stable_cooldown_schedule",
    "track3_baseline",
    "track3_newton_muon",
    "track3_record",
    "track3_soap_muon",
]

#: The record's Adam groups: (path pattern, learning rate); first match wins. These rates
#: belong to the record's architecture (untied embeddings, 1/320 head): rescale for others.
RECORD_ADAM_GROUPS: tuple[tuple[str, float], ...] = (
    (r"(^|/)(lm_head|head)(/|$)", 1 / 320),
    (r"(^|/)(wte|wpe|embed\w*)(/|$)", 0.3),
    (r".*", 0.015),
)
#: The record's Muon `wd_mul`: (path pattern, multiplier); first match wins. 2.0 on the MLP
#: weights (the record's `mlp.fc_w`, `mlp.proj_w`; here `mlp/c_fc`, `mlp/c_proj`, `mlp/c_gate`).
RECORD_WEIGHT_DECAY_MULTIPLIERS: tuple[tuple[str, float], ...] = (
    (r"(^|/)mlp(/|$)", 2.0),
    (r".*", 1.0),
)


def record_weight_decay_multiplier(params: Any) -> Any:
    """The record's per-leaf Muon weight-decay multiplier (`RECORD_WEIGHT_DECAY_MULTIPLIERS`).

    Leaves are matched by their path (`optax_snoo.labels.label_by_rules` on the rules'
    indices); `optax.MaskedNode` leaves (the Adam leaves inside the partition) get 1.0,
    which the decay skips anyway.

    Args:
      params: the params tree (or the Muon part of a partition, with `optax.MaskedNode`s).

    Returns:
      A tree of floats with the structure of `params` (a float at each `MaskedNode`).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import record_weight_decay_multiplier
      >>> record_weight_decay_multiplier({"mlp": {"c_fc": jnp.zeros((4, 8))},
      ...                                 "attn": {"c_q": jnp.zeros((4, 4))}})
      {'attn': {'c_q': 1.0}, 'mlp': {'c_fc': 2.0}}

    References:
      Jordan et al, `modded-nanogpt GPT-2 Medium record #128
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
    """
    rules = RECORD_WEIGHT_DECAY_MULTIPLIERS
    group = label_by_rules([(pattern, str(i)) for i, (pattern, _) in enumerate(rules)])
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    return jax.tree.map(lambda i: 1.0 if is_masked(i) else rules[int(i)][1], group(params),
                        is_leaf=is_masked)


def stable_cooldown_schedule(peak_value: float, total_steps: int, cooldown_frac: float = 0.7,
                             final_lr_scale: float = 0.0) -> optax.Schedule:
    """Constant, then a linear cooldown over the last `cooldown_frac` of training.

    The multiplier at step `t` of `T` is 1 while `t/T < 1 - cooldown_frac`, then
    `(1 - t/T) / cooldown_frac * (1 - final_lr_scale) + final_lr_scale`.

    Args:
      peak_value: the learning rate before the cooldown.
      total_steps: `T`, the number of training steps (>= 1).
      cooldown_frac: fraction of `T` spent cooling down, in (0, 1].
      final_lr_scale: multiplier reached at `t = T` (record: 0 in PR #128, 0.01 later).

    Returns:
      A schedule `step -> learning rate`.

    Example:
      >>> sched = stable_cooldown_schedule(0.03, 1000)
      >>> round(float(sched(0)), 6), float(sched(1000))
      (0.03, 0.0)

    References:
      Jordan et al, `modded-nanogpt <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
    """
    check_int_at_least("total_steps", total_steps, 1)
    if not 0 < cooldown_frac <= 1:
        raise ValueError(f"cooldown_frac must be in (0, 1], got {cooldown_frac!r}")
    if not 0 <= final_lr_scale <= 1:
        raise ValueError(f"final_lr_scale must be in [0, 1], got {final_lr_scale!r}")

    def schedule(count):
        x = jnp.asarray(count, jnp.result_type(float)) / total_steps  # float64 under x64
        cooling = (1 - x) / cooldown_frac * (1 - final_lr_scale) + final_lr_scale
        return peak_value * jnp.where(x < 1 - cooldown_frac, 1.0, cooling)

    return schedule


def snoo_muon(
    muon_learning_rate: optax.ScalarOrSchedule,
    adam_learning_rate: (optax.ScalarOrSchedule
                         | Sequence[AdamGroup | tuple[str, optax.ScalarOrSchedule]]),
    *,
    muon_momentum: float | optax.Schedule = 0.95,
    muon_weight_decay: float = 0.0,
    weight_decay_multiplier: Any = None,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    beta2: float | optax.Schedule | None = None,
    cautious_weight_decay: bool = False,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    snoo_k: int | None = 28,
    snoo_learning_rate: float = 0.68,
    snoo_momentum: float = 0.37,
    snoo_replica_axis: str | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """`snoo(muon(...))`: Snoo around Muon on hidden matrices and Adam groups.

    The inner optimizer is `optax_snoo.muon` (the library's one Muon + Adam builder):

    - ``"muon"`` (leaves `optax_snoo.labels.muon_adam_labels` gives to Muon):
      ``chain(scale_by_muon, add_decoupled_weight_decay, scale_by_learning_rate)``, i.e.
      ``p <- p (1 - lr·wd·wd_mul) - lr·sqrt(max(1, fan_out/fan_in))·O`` (NorMuon with
      ``beta2``; the decay only where ``O`` and ``p`` agree in sign with
      ``cautious_weight_decay``: modded-nanogpt's current stack);
    - Adam on every other leaf: one group ``"adam"`` for a single learning rate, or one
      group per entry of a sequence, first match wins: an `optax_snoo.AdamGroup` as it
      is, or a ``(path pattern, learning rate)`` pair as group ``"adam_i"`` with
      ``adam_b1``, ``adam_b2``, ``adam_eps``, bias correction and no weight decay;
    - Snoo (outer lr ``snoo_learning_rate``, momentum ``snoo_momentum``, period
      ``snoo_k``) around both, unless ``snoo_k`` is ``None``.

    Args:
      muon_learning_rate: Muon learning rate (float or schedule).
      adam_learning_rate: the Adam learning rate (float or schedule), or ordered groups
        for the non-Muon leaves: `optax_snoo.AdamGroup` entries or ``(path pattern,
        learning rate)`` pairs.
      muon_momentum: Muon momentum (float or schedule, e.g. `muon_momentum_warmup`).
      muon_weight_decay: Muon decoupled weight decay.
      weight_decay_multiplier: per-leaf multiplier tree or callable; ``None`` = 1.
      coefficients: Newton-Schulz preset or triples.
      ns_dtype: dtype of the Newton-Schulz iteration.
      smoothing: Muon update smoothing σ (float or schedule) or ``None``.
      smoothing_form: ``"ema"`` or ``"nesterov"``.
      beta2: NorMuon's per-neuron second-moment decay, or ``None`` for Muon; see
        `optax_snoo.scale_by_muon`.
      cautious_weight_decay: decay only where the update and the weight agree in sign;
        see `optax_snoo.add_decoupled_weight_decay`.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``; see
        `optax_snoo.NewtonSchulzPlan`.
      adam_b1: Adam's first-moment decay (of the groups not given as `AdamGroup`).
      adam_b2: Adam's second-moment decay (likewise).
      adam_eps: Adam epsilon (likewise).
      snoo_k: Snoo sync period, or ``None`` for the inner partition alone.
      snoo_learning_rate: Snoo outer lr η.
      snoo_momentum: Snoo outer momentum μ.
      snoo_replica_axis: Snoo's `replica_axis` (DiLoCo's replicas; see `optax_snoo.diloco`).
      shard_newton_schulz: `scale_by_muon`'s: whole matrices to devices on sharded params
        (False leaves the iteration to the partitioner, as inside `optax_snoo.over_replicas`
        over a sharded replica axis, whose mesh axis the plan must not use).

    Returns:
      A `GradientTransformationExtraArgs`; `update` needs `params`.

    Raises:
      ValueError: a negative learning rate or weight decay, or no Adam group.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.recipes import snoo_muon
      >>> params = {"h": {"kernel": jnp.ones((4, 4))}, "wte": {"embedding": jnp.ones((8, 4))}}
      >>> tx = snoo_muon(0.02, 3e-3, snoo_k=4)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params, snoo_sync=True)
      >>> sorted(state.inner_state.inner_states)
      ['adam', 'muon']

    References:
      Jordan et al, `modded-nanogpt GPT-2 Medium records #128, #129, #137
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
    """
    check_non_negative("muon_learning_rate", muon_learning_rate)
    check_non_negative("muon_weight_decay", muon_weight_decay)
    if callable(adam_learning_rate) or is_real(adam_learning_rate):
        check_non_negative("adam_learning_rate", adam_learning_rate)
        groups = (AdamGroup(".*", adam_learning_rate, adam_b1, adam_b2, adam_eps, name="adam"),)
    else:
        groups = tuple(_as_adam_group(entry, i, adam_b1, adam_b2, adam_eps)
                       for i, entry in enumerate(adam_learning_rate))
        if not groups:
            raise ValueError("adam_learning_rate: expected a learning rate or at least one "
                             "(pattern, learning rate) group, got no group")
    inner = muon(
        muon_learning_rate, beta=muon_momentum, weight_decay=muon_weight_decay,
        weight_decay_multiplier=weight_decay_multiplier, coefficients=coefficients,
        ns_dtype=ns_dtype, smoothing=smoothing, smoothing_form=smoothing_form, beta2=beta2,
        cautious_weight_decay=cautious_weight_decay, newton_schulz_plan=newton_schulz_plan,
        shard_newton_schulz=shard_newton_schulz, adam_groups=groups)
    if snoo_k is None:
        return inner
    return snoo(inner, snoo_learning_rate, snoo_momentum, snoo_k,
                replica_axis=snoo_replica_axis)


def _as_adam_group(entry: Any, index: int, b1: float, b2: float, eps: float) -> AdamGroup:
    """An `AdamGroup` as it is; a ``(pattern, lr)`` pair as group ``adam_<index>``."""
    if isinstance(entry, AdamGroup):
        return entry
    if not (isinstance(entry, tuple | list) and len(entry) == 2):
        raise ValueError(f"adam_learning_rate[{index}]: expected an AdamGroup or a "
                         f"(pattern, learning rate) pair, got {entry!r}")
    pattern, lr = entry
    check_non_negative(f"adam_learning_rate[{index}]", lr)
    return AdamGroup(pattern, lr, b1, b2, eps, name=f"adam_{index}")


def modded_nanogpt(
    total_steps: int,
    *,
    muon_learning_rate: float = 0.027,
    muon_momentum: float | optax.Schedule | None = None,
    muon_weight_decay: float = 0.01,
    weight_decay_multiplier: Any = record_weight_decay_multiplier,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    adam_groups: tuple[tuple[str, float], ...] = RECORD_ADAM_GROUPS,
    adam_b1: float = 0.8,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-10,
    cooldown_frac: float = 0.7,
    final_lr_scale: float = 0.0,
    use_snoo: bool = True,
    snoo_learning_rate: float = 0.68,
    snoo_momentum: float = 0.37,
    snoo_k: int = 28,
) -> optax.GradientTransformationExtraArgs:
    """The GPT-2 Medium record's optimizer: `snoo_muon` with the record's values.

    - Muon on hidden matrices (`optax_snoo.labels.muon_adam_labels`): modded Newton-Schulz
      coefficients, momentum warmed up 0.85 -> 0.95 over 300 steps, decoupled weight decay
      `lr·wd·wd_mul`, optional update smoothing (PR #137: `smoothing=0.2`; PR #129:
      `smoothing=schedule, smoothing_form="nesterov"`).
    - Adam (betas (0.8, 0.95), eps 1e-10, no weight decay) on every other leaf, one group
      per `(pattern, learning rate)` of `adam_groups`.
    - Every group's learning rate (and so weight decay) follows
      `stable_cooldown_schedule(·, total_steps, cooldown_frac, final_lr_scale)`.
    - Snoo (0.68, 0.37, k = 28) around it all, its own lr unscheduled.

    Args:
      total_steps: training steps `T` of the schedule.
      muon_learning_rate: Muon peak lr (0.027 in PR #128, 0.03 from PR #129).
      muon_momentum: float or schedule; `None` = `muon_momentum_warmup(0.85, 0.95, 300)`.
      muon_weight_decay: Muon decoupled weight decay.
      weight_decay_multiplier: per-leaf multiplier tree or callable; the default is the
        record's (2.0 on leaves under an `mlp` path component, else 1.0); `None` = 1.
      coefficients: Newton-Schulz preset or triples.
      ns_dtype: dtype of the Newton-Schulz iteration (bfloat16 as in the record).
      smoothing: update smoothing σ (float or schedule) or `None`.
      smoothing_form: `"ema"` (PR #137) or `"nesterov"` (PR #129).
      adam_groups: ordered `(path pattern, peak lr)` pairs for the non-Muon leaves.
      adam_b1: Adam's first-moment decay.
      adam_b2: Adam's second-moment decay.
      adam_eps: Adam epsilon.
      cooldown_frac: fraction of training in the linear cooldown.
      final_lr_scale: lr multiplier at the end.
      use_snoo: wrap in Snoo (False gives the record's inner optimizer alone).
      snoo_learning_rate: Snoo outer lr η.
      snoo_momentum: Snoo outer momentum μ.
      snoo_k: Snoo sync period.

    Returns:
      A `GradientTransformationExtraArgs`; `update` needs `params`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import modded_nanogpt
      >>> params = {"h": {"kernel": jnp.ones((4, 4))}, "lm_head": {"kernel": jnp.ones((4, 8))}}
      >>> tx = modded_nanogpt(5640)
      >>> state = tx.init(params)
      >>> sorted(state.inner_state.inner_states)
      ['adam_0', 'adam_1', 'adam_2', 'muon']

    References:
      Jordan et al, `modded-nanogpt GPT-2 Medium records #128, #129, #137
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2025.
    """
    if not adam_groups:
        raise ValueError("adam_groups must name at least one (pattern, lr) group")
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, cooldown_frac,
                                                     final_lr_scale)
    return snoo_muon(
        schedule(muon_learning_rate),
        tuple((pattern, schedule(lr)) for pattern, lr in adam_groups),
        muon_momentum=(muon_momentum_warmup(0.85, 0.95, 300) if muon_momentum is None
                       else muon_momentum),
        muon_weight_decay=muon_weight_decay, weight_decay_multiplier=weight_decay_multiplier,
        coefficients=coefficients, ns_dtype=ns_dtype, smoothing=smoothing,
        smoothing_form=smoothing_form, adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
        snoo_k=snoo_k if use_snoo else None, snoo_learning_rate=snoo_learning_rate,
        snoo_momentum=snoo_momentum)


#: modded-nanogpt Track 3 #36's Newton-Schulz: (2, -1.5, 0.5) twelve times.
TRACK3_COEFFICIENTS: tuple[tuple[float, float, float], ...] = ((2.0, -1.5, 0.5),) * 12
#: Path patterns of #36's three AdamW groups on this repository's GPT (first match wins):
#: every 1-D parameter (biases, the LM head's bias included, and norm gains), the token
#: (and, if any, position) embedding, the LM head.
TRACK3_ADAM_PATTERNS: dict[str, str] = {
    "vectors": r"(^|/)(bias|scale|gains?)$|(^|/)(ln\w*|\w*norm\w*)(/|$)",
    "embed": r"(^|/)(wte|wpe|embed\w*)(/|$)",
    "head": r"(^|/)(lm_head|head)(/|$)",
}


def track3_baseline(
    total_steps: int = 3250,
    *,
    muon_learning_rate: float = 0.025,
    muon_weight_decay: float = 0.05,
    muon_momentum: float | optax.Schedule = 0.95,
    coefficients: Coefficients = TRACK3_COEFFICIENTS,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    embed_learning_rate: float = 0.7,
    head_learning_rate: float = 0.004,
    vector_learning_rate: float = 0.015,
    adam_b1: float = 0.8,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-10,
    adam_weight_decay: float = 0.001,
    cooldown_frac: float = 0.7,
    adam_patterns: dict[str, str] | None = None,
    labels: Any = None,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """modded-nanogpt Track 3's tuned Muon + AdamW baseline (record #36, 3250 steps).

    `optax_snoo.muon` with #36's values (``train_gpt_simple.py``):

    - Muon on the blocks' matrices (`optax_snoo.labels.muon_adam_labels`): momentum 0.95
      in EMA-Nesterov form without bias correction, Newton-Schulz ``(2, -1.5, 0.5)`` x 12
      in bfloat16 after ``X/(‖X‖_F + 1e-7)``, shape scale ``sqrt(max(1, out/in))``,
      ``p ← p (1 - lr·0.05) - lr·O``, lr 0.025;
    - AdamW (PyTorch's: bias-corrected, ``p ← p (1 - lr·wd)``, betas (0.8, 0.95), eps
      1e-10, wd 0.001) in three groups, first match wins (`TRACK3_ADAM_PATTERNS`):
      ``"vectors"`` every 1-D parameter lr 0.015, ``"embed"`` the token embedding lr 0.7,
      ``"head"`` the LM head lr 0.004;
    - every learning rate (so every decay) on `stable_cooldown_schedule`: flat for the
      first 30% of ``total_steps``, then linear to 0.

    #36 sums the token losses (``reduction="sum"``); with a mean loss the gradients are
    smaller by the token count, which changes only the epsilons' relative size (Muon and
    Adam are otherwise invariant to the gradient's scale).

    Args:
      total_steps: ``T`` of the schedule (#36: 3250).
      muon_learning_rate: Muon peak lr.
      muon_weight_decay: Muon decoupled weight decay (times the lr).
      muon_momentum: Muon momentum (float or schedule, e.g. `muon_momentum_schedule`).
      coefficients: Newton-Schulz triples or preset.
      ns_dtype: dtype of the Newton-Schulz iteration (bfloat16 as #36).
      embed_learning_rate: peak lr of the embedding group.
      head_learning_rate: peak lr of the LM-head group.
      vector_learning_rate: peak lr of the 1-D group.
      adam_b1: AdamW's first-moment decay of every group.
      adam_b2: AdamW's second-moment decay of every group.
      adam_eps: AdamW epsilon of every group.
      adam_weight_decay: AdamW decoupled weight decay of every group.
      cooldown_frac: fraction of ``total_steps`` in the linear cooldown.
      adam_patterns: path patterns of the groups, keys ``"vectors"``, ``"embed"``,
        ``"head"`` (tried in that order); ``None``: `TRACK3_ADAM_PATTERNS`.
      labels: ``"muon"``/``"adam"`` labels (tree or callable); ``None``:
        `optax_snoo.labels.muon_adam_labels`.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``.
      shard_newton_schulz: whole matrices per device on sharded params.

    Returns:
      A `GradientTransformationExtraArgs` (`optax_snoo.muon`'s partition, groups
      ``muon``, ``vectors``, ``embed``, ``head``); ``update`` needs ``params``.

    Raises:
      ValueError: bad values (see `optax_snoo.muon`), pattern keys other than the three
        groups'; at init a non-Muon leaf no pattern matches.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import track3_baseline
      >>> params = {"wte": {"embedding": jnp.ones((16, 4))},
      ...           "blocks": [{"attn": {"c_q": {"kernel": jnp.ones((4, 4)),
      ...                                        "bias": jnp.zeros(4)}}}],
      ...           "lm_head": {"kernel": jnp.zeros((4, 16))}}
      >>> tx = track3_baseline()
      >>> sorted(tx.init(params).inner_states)
      ['embed', 'head', 'muon', 'vectors']

    References:
      Jordan et al., `modded-nanogpt Track 3 record #36, tuned Muon baseline
      (train_gpt_simple.py)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    patterns = dict(TRACK3_ADAM_PATTERNS if adam_patterns is None else adam_patterns)
    if set(patterns) != set(TRACK3_ADAM_PATTERNS):
        raise ValueError(f"adam_patterns: expected the keys {sorted(TRACK3_ADAM_PATTERNS)}, "
                         f"got {sorted(patterns)}")
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, cooldown_frac)
    rates = {"muon_learning_rate": muon_learning_rate,
             "vector_learning_rate": vector_learning_rate,
             "embed_learning_rate": embed_learning_rate, "head_learning_rate": head_learning_rate}
    for argument, lr in rates.items():
        check_non_negative(argument, lr)
    groups = [AdamGroup(patterns[name], schedule(lr), adam_b1, adam_b2, adam_eps,
                        adam_weight_decay, name=name)
              for name, lr in (("vectors", vector_learning_rate), ("embed", embed_learning_rate),
                               ("head", head_learning_rate))]
    return muon(schedule(muon_learning_rate), beta=muon_momentum,
                weight_decay=muon_weight_decay, coefficients=coefficients, ns_dtype=ns_dtype,
                adam_groups=groups, labels=labels, newton_schulz_plan=newton_schulz_plan,
                shard_newton_schulz=shard_newton_schulz)


# ------------------------------------------------------------------ Track 3's later records

#: Record #46's step count: its step constants scale with ``total_steps / 2900``.
TRACK3_RECORD_STEPS = 2900
#: Path patterns of #46's five Adam groups on this repository's GPT (first match wins):
#: every norm gain (``.../scale``), the attention output projection's bias, every other
#: 1-D parameter (biases, the LM head's included), the token embedding, the LM head.
TRACK3_RECORD_ADAM_PATTERNS: dict[str, str] = {
    "gains": r"(^|/)(scale|gains?)$",
    "attn_proj_bias": r"(^|/)attn/c_proj/bias$",
    "vectors": r"(^|/)bias$",
    "embed": TRACK3_ADAM_PATTERNS["embed"],
    "head": TRACK3_ADAM_PATTERNS["head"],
}
#: #46's attention output projections (``attn.proj``; here ``attn/c_proj``), the leaves
#: its SOAP trust gate acts on.
TRACK3_TRUST_GATE_PATTERN = r"(^|/)attn/c_proj/kernel$"
#: #20/#46's PowerCool constants ``c`` at ``t_end = 2900`` (``power = 1.2``), by group.
TRACK3_POWER_COOL_C: dict[str, float] = {
    "muon": 3.3169534699576625e-06,
    "embed": 4.976805410800738e-05,
    "head": 5.184172302917436e-07,
    "vectors": 1.6589351369335795e-06,
}


def _steps(record_steps: float, total_steps: int, record_total: int) -> int:
    """A record's step constant rescaled to a run of ``total_steps``."""
    return round(record_steps * total_steps / record_total)


def _path_matcher(pattern: str) -> Callable[[str], bool]:
    regex = re.compile(pattern)
    return lambda path: bool(regex.search(path))


def _power_cool_scaled(lr0: float, c: float, total_steps: int) -> optax.Schedule:
    """PowerCool of #46 (``t_end = 2900``) stretched in time to ``t_end = total_steps``:
    ``c_N = c·(2900/N)^1.2`` keeps the flat part the same fraction of the run."""
    return power_cool(lr0, c=c * (TRACK3_RECORD_STEPS / total_steps) ** 1.2, t_end=total_steps)


def _not_matching(pattern: str) -> Callable[[optax.Params], Any]:
    """A mask callable: True on every leaf whose path does not match ``pattern``."""
    matches = _path_matcher(pattern)
    return lambda params: jax.tree.map_with_path(
        lambda path, _: not matches(path_to_str(path)), params)


def track3_record(
    total_steps: int = TRACK3_RECORD_STEPS,
    *,
    muon_learning_rate: float = 0.0375,
    embed_learning_rate: float = 0.3,
    head_learning_rate: float = 1 / 320,
    vector_learning_rate: float = 0.01,
    soap_beta: float = 0.9,
    brake: float | None = 0.5,
    floor: float | None = 0.3825,
    cautious_weight_decay: float = 0.025,
    lookahead: float = 0.3,
    lookahead_ema: float = 0.99,
    tail_horizon: float = 150.0,
    tail_blend: float = 0.6,
    adam_patterns: dict[str, str] | None = None,
    trust_gate_pattern: str = TRACK3_TRUST_GATE_PATTERN,
    labels: Any = None,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""modded-nanogpt Track 3's record #46 (2690 steps): the whole optimizer stack.

    ``chain(ema_nesterov(partition), tail_ema)`` with, per group:

    - Muon (the blocks' matrices, `optax_snoo.labels.muon_adam_labels`):
      ``scale_by_muon`` with Muon's momentum on `muon_momentum_schedule` (0.85 -> 0.95
      over the first 300 updates, back to 0.85 over the last 200), SOAP whitening of the
      Nesterov momentum (`scale_by_soap_whitening`: Gram EMAs and ``V`` at
      ``soap_beta`` 0.9, basis refreshed every update, Gram-norm match; the trust gate on
      the attention output projections only, its floor 0.45 fading to 0 over updates
      1375 -> 1625 and its cap 0.85 until 1625), Newton-Schulz ``(2, -1.5, 0.5)`` x 12
      in bfloat16 after the Gram-Frobenius normalisation, shape scale
      ``sqrt(max(1, out/in))``; then `radius_steps` in place of the learning rate:
      radial brake 0.5, RowFloor 0.3825 per output neuron, the first-order radius pin,
      cautious weight decay 0.025 after the pin; lr 0.0375 on PowerCool.
    - Adam, in five groups (`TRACK3_RECORD_ADAM_PATTERNS`, first match wins), eps 1e-10,
      no weight decay, every lr on PowerCool (``power`` 1.2, `TRACK3_POWER_COOL_C`):
      ``"gains"`` (norm gains) lr 0.01 betas (0.8, 0.99), ``"attn_proj_bias"`` 0.01
      (0.8, 0.9965), ``"vectors"`` (every other 1-D parameter, the head's bias
      included) 0.01 (0.8, 0.997), these three **without bias correction** (the
      record's ``Adam`` class); ``"embed"`` 0.3 and ``"head"`` 1/320 with betas
      (0.8, 0.99) and bias correction (``torch.optim.AdamW``).
    - `ema_nesterov` around all of it: lookahead 0.3 times the embedding's lr ratio
      (read, as the record does, on the previous update), EMA 0.99, from update 300 to
      1950 (``2900 - 950``).
    - `tail_ema` after it: EMA of the weights from update 2400 (horizon 150, until
      2900), evaluated as ``0.4 w + 0.6 ema`` on every parameter but the token
      embedding. Evaluate and checkpoint ``optax_snoo.eval_params(params, state)``.

    **Total steps.** Every step constant above is a fraction of the record's 2900
    (``FINAL_TRAIN_STEPS``): with ``total_steps = N`` they become
    ``round(x·N/2900)`` (300, 1950, 2400, 1375, 1625, the 200-step cool-down, the tail
    horizon 150 (at least 1)) and PowerCool ends at ``N`` with ``c·(2900/N)^1.2``, so
    each group leaves its flat part at the same fraction of the run (Muon at 17.7%,
    Adam at 51.3%). ``track3_record()`` is the record's schedule exactly; the record
    claims its loss at 2690 of the 2900-step schedule.

    **Names.** The record's parameters are ``embed``, ``proj`` (head), ``blocks.N.attn.
    {q,k,v,proj}``, ``mlp.{fc,proj}``, ``norm*.gains``; this repository's GPT calls them
    ``wte/embedding``, ``lm_head/kernel``, ``blocks/N/attn/c_{q,k,v,proj}``,
    ``mlp/c_{fc,proj}``, ``ln_*/scale``: the patterns are for these names, overridable.

    Not here (the model's, not the optimizer's): #46's init (zero ``proj`` weights,
    the MLP's depth scaling, its RMSNorm gains); its summed loss (a mean loss only
    changes the epsilons' relative size).

    Args:
      total_steps: ``N``, the run's length (record: 2900).
      muon_learning_rate: Muon's flat lr.
      embed_learning_rate: the embedding's flat lr.
      head_learning_rate: the LM head's flat lr.
      vector_learning_rate: the three 1-D groups' flat lr.
      soap_beta: SOAP's Gram/``V`` decay.
      brake: `radius_steps`'s outward radial factor (``None``: off).
      floor: RowFloor target (``None``: off).
      cautious_weight_decay: post-pin cautious decay (0: off).
      lookahead: EMA-Nesterov's ``β0`` (0: no lookahead; the wrapper stays).
      lookahead_ema: EMA-Nesterov's ``γ``.
      tail_horizon: the tail EMA's horizon at ``N = 2900`` (scaled with ``N``).
      tail_blend: the EMA's weight in the evaluated weights.
      adam_patterns: the groups' path patterns, keys as `TRACK3_RECORD_ADAM_PATTERNS`
        (the embedding's also names what the tail EMA leaves out); ``None``: those.
      trust_gate_pattern: path pattern of the trust-gated Muon leaves.
      labels: ``"muon"``/``"adam"`` labels; ``None``: `optax_snoo.labels.muon_adam_labels`.
      ns_dtype: Newton-Schulz dtype (record: bfloat16).
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``.
      shard_newton_schulz: whole matrices per device on sharded params.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``; its
      state is ``(EmaNesterovState, TailEmaState)``.

    Raises:
      ValueError: ``total_steps`` < 4, bad pattern keys, bad values.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> from optax_snoo.recipes import track3_record
      >>> params = {"wte": {"embedding": jnp.ones((16, 4))},
      ...           "blocks": [{"attn": {"c_proj": {"kernel": jnp.eye(4), "bias": jnp.zeros(4)}},
      ...                       "ln_1": {"scale": jnp.ones(4)}}],
      ...           "lm_head": {"kernel": jnp.zeros((4, 16)), "bias": jnp.zeros(16)}}
      >>> tx = track3_record(total_steps=29)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> sorted(state[0].inner_state.inner_states)
      ['attn_proj_bias', 'embed', 'gains', 'head', 'muon', 'vectors']
      >>> ev = optax_snoo.eval_params(params, state)  # the weights to evaluate

    References:
      Jordan et al., `modded-nanogpt Track 3 record #46 (RowFloor + post-pin CWD +
      tail-EMA, results/20260619_cwd_rowfloor_tailema)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_int_at_least("total_steps", total_steps, 4)
    n, rec = total_steps, TRACK3_RECORD_STEPS
    inner, embed_lr, patterns = _track3_partition(
        n, muon_learning_rate=muon_learning_rate, embed_learning_rate=embed_learning_rate,
        head_learning_rate=head_learning_rate, vector_learning_rate=vector_learning_rate,
        soap_beta=soap_beta, adam_patterns=adam_patterns,
        trust_gate_pattern=trust_gate_pattern, labels=labels, ns_dtype=ns_dtype,
        newton_schulz_plan=newton_schulz_plan, shard_newton_schulz=shard_newton_schulz,
        brake=brake, floor=floor, floor_per="fan_out", pin="first_order",
        cautious_weight_decay=cautious_weight_decay)
    # The record reads the embedding group's lr ratio as set on the previous update.
    ratio = lambda t: embed_lr(jnp.maximum(t - 1, 0)) / embed_learning_rate
    return optax.chain(
        ema_nesterov(inner, lookahead, lookahead_ema, prefill=_steps(300, n, rec),
                     stop=_steps(1950, n, rec), lr_ratio=ratio),
        tail_ema(_steps(2400, n, rec), max(1.0, tail_horizon * n / rec), tail_blend, end=n,
                 mask=_not_matching(patterns["embed"])))


def _track3_partition(n: int, *, muon_learning_rate: float, embed_learning_rate: float,
                      head_learning_rate: float, vector_learning_rate: float,
                      soap_beta: float, adam_patterns: dict[str, str] | None,
                      trust_gate_pattern: str, labels: Any, ns_dtype: Any,
                      newton_schulz_plan: NewtonSchulzPlan | None,
                      shard_newton_schulz: bool, **radius: Any
                      ) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule,
                                 dict[str, str]]:
    """#44/#46's SOAP-Muon + Adam partition over ``n`` steps (`radius` = `radius_steps`'
    options); also the embedding's lr schedule and the groups' patterns."""
    patterns = dict(TRACK3_RECORD_ADAM_PATTERNS if adam_patterns is None else adam_patterns)
    if set(patterns) != set(TRACK3_RECORD_ADAM_PATTERNS):
        raise ValueError(f"adam_patterns: expected the keys "
                         f"{sorted(TRACK3_RECORD_ADAM_PATTERNS)}, got {sorted(patterns)}")
    rec = TRACK3_RECORD_STEPS
    for argument, lr in (("muon_learning_rate", muon_learning_rate),
                         ("embed_learning_rate", embed_learning_rate),
                         ("head_learning_rate", head_learning_rate),
                         ("vector_learning_rate", vector_learning_rate)):
        check_positive(argument, lr)
    c = TRACK3_POWER_COOL_C
    # The constants are the record's for its rates; other rates keep the flat part's end.
    sched = lambda lr, group, lr_rec: _power_cool_scaled(lr, c[group] * lr / lr_rec, n)
    momentum = muon_momentum_schedule(0.85, 0.95, warmup=_steps(300, n, rec),
                                      cooldown=_steps(200, n, rec), total=n)
    whitening = scale_by_soap_whitening(
        soap_beta, precondition_frequency=1, trust_gate=_path_matcher(trust_gate_pattern),
        trust_floor=trust_gate_floor(0.45, _steps(1375, n, rec), _steps(1625, n, rec)),
        trust_cap=trust_gate_cap(0.85, _steps(1625, n, rec)))
    muon_tx = optax.chain(
        scale_by_muon(momentum, precondition=whitening, ns_normalization="gram_frobenius",
                      coefficients=TRACK3_COEFFICIENTS, ns_dtype=ns_dtype,
                      newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz),
        radius_steps(sched(muon_learning_rate, "muon", 0.0375), **radius))
    vec = sched(vector_learning_rate, "vectors", 0.01)
    embed_lr = sched(embed_learning_rate, "embed", 0.3)
    groups = [
        AdamGroup(patterns["gains"], vec, 0.8, 0.99, 1e-10, bias_correction=False,
                  name="gains"),
        AdamGroup(patterns["attn_proj_bias"], vec, 0.8, 0.9965, 1e-10, bias_correction=False,
                  name="attn_proj_bias"),
        AdamGroup(patterns["vectors"], vec, 0.8, 0.997, 1e-10, bias_correction=False,
                  name="vectors"),
        AdamGroup(patterns["embed"], embed_lr, 0.8, 0.99, 1e-10, name="embed"),
        AdamGroup(patterns["head"], sched(head_learning_rate, "head", 1 / 320), 0.8, 0.99,
                  1e-10, name="head"),
    ]
    return with_adam_groups(muon_tx, groups, labels=labels), embed_lr, patterns


def _aux_adamw(total_steps: int, cooldown_frac: float, patterns: dict[str, str] | None,
               rates: tuple[float, float, float]) -> list[AdamGroup]:
    """The #5/#8/#13/#15 aux ``torch.optim.AdamW``: embed/head/1-D groups, betas (0.8,
    0.95), eps 1e-10, no decay, on `stable_cooldown_schedule`."""
    patterns = dict(TRACK3_ADAM_PATTERNS if patterns is None else patterns)
    if set(patterns) != set(TRACK3_ADAM_PATTERNS):
        raise ValueError(f"adam_patterns: expected the keys {sorted(TRACK3_ADAM_PATTERNS)}, "
                         f"got {sorted(patterns)}")
    for name, lr in zip(("embed", "head", "vectors"), rates, strict=True):
        check_non_negative(f"{name} learning rate", lr)
    embed, head, vectors = rates
    schedule = lambda peak: stable_cooldown_schedule(peak, total_steps, cooldown_frac)
    return [AdamGroup(patterns[name], schedule(lr), 0.8, 0.95, 1e-10, name=name)
            for name, lr in (("vectors", vectors), ("embed", embed), ("head", head))]


def muonh(
    total_steps: int = 3325,
    *,
    learning_rate: float = 0.018,
    momentum: float = 0.95,
    normuon_beta2: float | None = None,
    pin: str = "initial",
    adam_learning_rates: tuple[float, float, float] = (0.3, 1 / 320, 0.01),
    adam_cooldown_frac: float = 0.4,
    adam_patterns: dict[str, str] | None = None,
    labels: Any = None,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""MuonH, Muon on the hyperball (modded-nanogpt Track 3 record #5, 3325 steps).

    Muon's direction ``O`` (momentum 0.95, Newton-Schulz ``(2, -1.5, 0.5)`` x 12) and
    `radius_steps` with ``pin="initial"``: ``W' = W - lr·‖W₀‖·O/‖O‖``, retracted to the
    sphere of radius ``‖W₀‖`` (each matrix keeps its initial norm; no weight decay); lr
    0.018 decaying linearly to 0 over the whole run. Aux AdamW (betas (0.8, 0.95), eps
    1e-10, no decay, bias-corrected): embedding 0.3, head 1/320, 1-D 0.01, flat then
    linear to 0 over the last 40%. ``normuon_beta2=0.95`` is NorMuonH (#8): NorMuon's
    per-neuron normalisation before the retraction.

    A zero-initialised matrix stays zero on the hyperball: #5 initialises every hidden
    matrix non-zero (``attn.proj`` x1.25, ``mlp.proj`` x3, ``mlp.fc`` x1.5 of PyTorch's
    default), which this repository's ``init="track3"`` (zero projections) is not.

    Args:
      total_steps: ``T`` of both schedules (#5: 3325; NorMuonH #8: 3275).
      learning_rate: the hyperball's relative step at update 0.
      momentum: Muon's momentum.
      normuon_beta2: NorMuon's second-moment decay (NorMuonH), or ``None`` (MuonH).
      pin: `radius_steps`'s hyperball: ``"initial"`` (the radius ``‖W₀‖`` kept exactly)
        or ``"current"`` (the radius the matrix has, as #5's code reads it: the same here,
        different under an outer optimizer that moves ``‖W‖``).
      adam_learning_rates: (embedding, head, 1-D) peak lrs.
      adam_cooldown_frac: the aux groups' cooldown fraction.
      adam_patterns: `TRACK3_ADAM_PATTERNS`-keyed path patterns; ``None``: those.
      labels: ``"muon"``/``"adam"`` labels; ``None``: `optax_snoo.labels.muon_adam_labels`.
      ns_dtype: Newton-Schulz dtype.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``.
      shard_newton_schulz: whole matrices per device on sharded params.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.recipes import muonh
      >>> params = {"blocks": {"mlp": {"c_fc": {"kernel": jnp.eye(4)}}},
      ...           "ln_f": {"scale": jnp.ones(4)}}
      >>> tx = muonh(100)
      >>> state = tx.init(params)
      >>> updates, _ = tx.update(params, state, params)
      >>> new = optax.apply_updates(params, updates)["blocks"]["mlp"]["c_fc"]["kernel"]
      >>> round(float(jnp.linalg.norm(new)), 4)  # ‖W₀‖ = 2 kept
      2.0

    References:
      Jordan et al., `modded-nanogpt Track 3 records #5 (MuonH) and #8 (NorMuonH)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_int_at_least("total_steps", total_steps, 1)
    check_non_negative("learning_rate", learning_rate)
    lr = stable_cooldown_schedule(learning_rate, total_steps, cooldown_frac=1.0)
    muon_tx = optax.chain(
        scale_by_muon(momentum, beta2=normuon_beta2, coefficients=TRACK3_COEFFICIENTS,
                      ns_dtype=ns_dtype, newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz),
        radius_steps(lr, brake=None, floor=None, pin=pin, cautious_weight_decay=0.0))
    groups = _aux_adamw(total_steps, adam_cooldown_frac, adam_patterns, adam_learning_rates)
    return with_adam_groups(muon_tx, groups, labels=labels)


def muloco_normuonh(
    total_steps: int = 3210,
    *,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.5,
    sync_every: int = 30,
    **muonh_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""MuLoCo around NorMuonH (modded-nanogpt Track 3 record #13, 3210 steps).

    ``snoo(muonh(total_steps, normuon_beta2=0.95, pin="current"), 0.7, 0.5, k=30,
    sync="end")``: after
    every 30th update the outer Nesterov step ``u = μu + ηΔ; W = snapshot - μu - ηΔ`` on
    all parameters (``Δ`` = snapshot - fast weights), the inner NorMuonH (#8: hyperball
    lr 0.018 linear to 0 over the run, NorMuon β2 0.95; aux AdamW 0.3/(1/320)/0.01, betas
    (0.8, 0.95), cooldown 0.4) never reset. The outer step moves each matrix off its
    sphere and the record's hyperball then keeps the radius it finds (``pin="current"``,
    #5's ``scale_invariant_update_``), not the initial one. 3210 = 107 x 30: the last
    update is a sync, so the evaluated weights are outer weights. Pass
    ``snoo_sync=snoo_is_sync_step(t, sync_every, "end")`` to ``update`` for a static sync
    (or nothing: traced).

    Args:
      total_steps: the inner schedules' ``T``.
      outer_learning_rate: MuLoCo's ``η``.
      outer_momentum: MuLoCo's ``μ``.
      sync_every: ``H``, updates per outer step.
      **muonh_kwargs: further `muonh` arguments (``normuon_beta2`` defaults to 0.95).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (`snoo`'s state).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import muloco_normuonh
      >>> params = {"blocks": {"mlp": {"c_fc": {"kernel": jnp.eye(4)}}},
      ...           "ln_f": {"scale": jnp.ones(4)}}
      >>> state = muloco_normuonh().init(params)
      >>> int(state.count)
      0

    References:
      Jordan et al., `modded-nanogpt Track 3 record #13 (MuLoCo-NorMuonH,
      NesterovOuterOptimizer)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    muonh_kwargs.setdefault("normuon_beta2", 0.95)
    muonh_kwargs.setdefault("pin", "current")
    return snoo(muonh(total_steps, **muonh_kwargs), outer_learning_rate, outer_momentum,
                sync_every, sync="end")


def track3_soap_muon(
    total_steps: int = TRACK3_RECORD_STEPS,
    *,
    muon_learning_rate: float = 0.0375,
    soap_beta: float = 0.9,
    adam_patterns: dict[str, str] | None = None,
    trust_gate_pattern: str = TRACK3_TRUST_GATE_PATTERN,
    labels: Any = None,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""SOAP-Muon as record #44 runs it, without the rest of its stack.

    `track3_record`'s Muon direction (SOAP whitening on every hidden matrix, frequency 1,
    beta 0.9, Gram-norm match, the trust gate on the attention output projections with
    its fading floor; Gram-Frobenius Newton-Schulz ``(2, -1.5, 0.5)`` x 12; momentum
    0.85 -> 0.95 -> 0.85), its lr 0.0375 on PowerCool with plain ``W ← W - lr·O`` (no
    brake, floor, pin or decay), and #44's five Adam groups (the same as #46's); no
    EMA-Nesterov, no tail EMA. Step constants scale with ``total_steps/2900`` as in
    `track3_record`. It isolates the SOAP whitening: #44 itself also has the u/w floor,
    the radial brake and pin, and EMA-Nesterov (`track3_record` with ``floor_per``
    per matrix is closest).

    Args:
      total_steps: ``N`` (record: 2900).
      muon_learning_rate: Muon's flat lr.
      soap_beta: SOAP's Gram/``V`` decay.
      adam_patterns: as `track3_record`.
      trust_gate_pattern: as `track3_record`.
      labels: as `track3_record`.
      ns_dtype: Newton-Schulz dtype.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``.
      shard_newton_schulz: whole matrices per device on sharded params.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (a partition); ``update`` needs
      ``params``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import track3_soap_muon
      >>> params = {"blocks": {"attn": {"c_proj": {"kernel": jnp.eye(4)}}},
      ...           "ln_f": {"scale": jnp.ones(4)}}
      >>> sorted(track3_soap_muon(29).init(params).inner_states)
      ['attn_proj_bias', 'embed', 'gains', 'head', 'muon', 'vectors']

    References:
      Jordan et al., `modded-nanogpt Track 3 record #44 (SOAP on all hidden matrices,
      frequency 1, results/20260609_soap_f1_auxb2_clean)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_int_at_least("total_steps", total_steps, 4)
    inner, _, _ = _track3_partition(
        total_steps, muon_learning_rate=muon_learning_rate, embed_learning_rate=0.3,
        head_learning_rate=1 / 320, vector_learning_rate=0.01, soap_beta=soap_beta,
        adam_patterns=adam_patterns, trust_gate_pattern=trust_gate_pattern, labels=labels,
        ns_dtype=ns_dtype, newton_schulz_plan=newton_schulz_plan,
        shard_newton_schulz=shard_newton_schulz, brake=None, floor=None, pin=None,
        cautious_weight_decay=0.0)
    return inner


#: Record #15's Muon groups on this repository's GPT: (kernel path pattern, lr, weight decay);
#: the record's q/k/v, attn.proj, mlp.fc, mlp.proj.
TRACK3_NEWTON_MUON_GROUPS: tuple[tuple[str, float, float], ...] = (
    (r"(^|/)attn/c_[qkv]/kernel$", 0.020, 0.025),
    (r"(^|/)attn/c_proj/kernel$", 0.025, 0.025),
    (r"(^|/)mlp/c_fc/kernel$", 0.030, 0.0375),
    (r"(^|/)mlp/c_proj/kernel$", 0.030, 0.025),
)


def _per_path(groups: Sequence[tuple[str, float, float]], column: int,
              default: float | None) -> Callable[[Any], Any]:
    """``tree -> floats``: each leaf's value from the first group its path matches
    (``default`` where none does; ``None``: an error); `optax.MaskedNode` leaves -> 1.0."""
    compiled = [(re.compile(g[0]), g[column]) for g in groups]
    masked = lambda x: isinstance(x, optax.MaskedNode)

    def leaf(path, x):
        if masked(x):
            return 1.0
        name = path_to_str(path)
        for regex, value in compiled:
            if regex.search(name):
                return value
        if default is None:
            raise ValueError(f"Muon parameter {name!r} matches no group of "
                             f"{[g[0] for g in groups]}")
        return default

    return lambda tree: jax.tree.map_with_path(leaf, tree, is_leaf=masked)


def _scale_by_path(factors: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Multiply each update leaf by ``factors(updates)`` (a float per leaf)."""
    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, f: u * jnp.asarray(f, u.dtype), updates,
                            factors(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def track3_newton_muon(
    total_steps: int = 3300,
    *,
    muon_groups: Sequence[tuple[str, float, float]] = TRACK3_NEWTON_MUON_GROUPS,
    momentum: float = 0.95,
    ema_decay: float = 0.95,
    damping: float = 0.2,
    refresh_every: int = 64,
    block_size: int | None = None,
    shared_inputs: Sequence[Sequence[str]] = (("c_q", "c_k", "c_v"),),
    adam_learning_rates: tuple[float, float, float] = (0.3, 1 / 320, 0.01),
    cooldown_frac: float = 0.7,
    adam_patterns: dict[str, str] | None = None,
    labels: Any = None,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    shard_newton_schulz: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Newton-Muon with record #15's groups (modded-nanogpt Track 3, 3300 steps, claim 3275).

    `optax_snoo.newton_muon` (the inputs' covariance, EMA 0.95 per refresh every 64
    updates, damping 0.2 x the mean eigenvalue, applied on the input side before Muon's
    momentum; q/k/v share one factor) with Muon (momentum 0.95, Newton-Schulz
    ``(2, -1.5, 0.5)`` x 12) in four groups, ``W ← W (1 - lr·wd) - lr·O``
    (`TRACK3_NEWTON_MUON_GROUPS`): q/k/v lr 0.020 wd 0.025, attention output 0.025/0.025,
    MLP in 0.030/0.0375, MLP out 0.030/0.025; aux AdamW (betas (0.8, 0.95), eps 1e-10,
    no decay) embedding 0.3, head 1/320, 1-D 0.01; every lr flat then linear to 0 over
    the last 70%. #15 splits the 3072-wide MLP input into blocks of 768: pass
    ``block_size=n_embd``. Pass ``input_covariance=`` to every ``update`` (see
    `optax_snoo.precondition_by_input_covariance`).

    The groups' rates are applied as a per-leaf factor on Muon's update with a unit
    learning-rate schedule (and the decay as a per-leaf multiplier of 1.0): the numbers
    are the record's ``lr_g·η(t)``.

    Args:
      total_steps: ``T`` of the schedule (record: 3300).
      muon_groups: ``(path pattern, lr, weight decay)`` of the Muon leaves, first match
        wins; a Muon leaf no pattern matches is an error at init.
      momentum: Muon's momentum.
      ema_decay: the covariance EMA per refresh.
      damping: the relative damping.
      refresh_every: the refresh period.
      block_size: largest factor (``None``: one per input).
      shared_inputs: module names reading one input.
      adam_learning_rates: (embedding, head, 1-D) peak lrs.
      cooldown_frac: the schedule's cooldown fraction.
      adam_patterns: `TRACK3_ADAM_PATTERNS`-keyed path patterns; ``None``: those.
      labels: ``"muon"``/``"adam"`` labels; ``None``: `optax_snoo.labels.muon_adam_labels`.
      ns_dtype: Newton-Schulz dtype.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``.
      shard_newton_schulz: whole matrices per device on sharded params.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params`` and
      ``input_covariance``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.recipes import track3_newton_muon
      >>> params = {"blocks": {"mlp": {"c_fc": {"kernel": jnp.eye(4)}}},
      ...           "ln_f": {"scale": jnp.ones(4)}}
      >>> state = track3_newton_muon().init(params)

    References:
      modded-nanogpt Track 3 record #15, Newton-Muon (`results/20260505_newton_muon
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_),
      2026
    """
    check_int_at_least("total_steps", total_steps, 1)
    muon_groups = tuple(muon_groups)
    if not muon_groups:
        raise ValueError("muon_groups: expected at least one (pattern, lr, weight decay)")
    for pattern, lr, wd in muon_groups:
        check_non_negative(f"muon_groups[{pattern!r}] learning rate", lr)
        check_non_negative(f"muon_groups[{pattern!r}] weight decay", wd)
    from optax_snoo._src.newton_muon import newton_muon

    unit = stable_cooldown_schedule(1.0, total_steps, cooldown_frac)
    groups = _aux_adamw(total_steps, cooldown_frac, adam_patterns, adam_learning_rates)
    inner = newton_muon(
        unit, ema_decay=ema_decay, damping=damping, refresh_every=refresh_every,
        block_size=block_size, shared_inputs=shared_inputs, beta=momentum,
        weight_decay=1.0, weight_decay_multiplier=_per_path(muon_groups, 2, None),
        coefficients=TRACK3_COEFFICIENTS, ns_dtype=ns_dtype, adam_groups=groups,
        labels=labels, newton_schulz_plan=newton_schulz_plan,
        shard_newton_schulz=shard_newton_schulz)
    # Adam leaves match no kernel pattern: factor 1 (their rates are their groups').
    return optax.chain(inner, _scale_by_path(_per_path(muon_groups, 1, 1.0)))
