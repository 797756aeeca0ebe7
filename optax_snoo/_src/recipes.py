"""Ready optimizer stacks: modded-nanogpt's GPT-2 Medium record and Track 3 baseline.

`stable_cooldown_schedule` is the records' learning-rate multiplier; `snoo_muon` is Snoo
around `optax_snoo.muon` (Muon on hidden matrices, one or more Adam groups);
`modded_nanogpt` is `snoo_muon` with the GPT-2 Medium record's values (PR #128), every one
overridable, all learning rates scaled by that schedule; `track3_baseline` is Track 3's
tuned Muon + AdamW baseline (record #36).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.adam import AdamGroup
from optax_snoo._src.labels import label_by_rules
from optax_snoo._src.muon import Coefficients, muon, muon_momentum_warmup
from optax_snoo._src.muon_sharding import NewtonSchulzPlan
from optax_snoo._src.snoo import snoo
from optax_snoo._src.utils import check_int_at_least, check_non_negative, is_real

__all__ = [
    "RECORD_ADAM_GROUPS",
    "RECORD_WEIGHT_DECAY_MULTIPLIERS",
    "TRACK3_ADAM_PATTERNS",
    "TRACK3_COEFFICIENTS",
    "modded_nanogpt",
    "record_weight_decay_multiplier",
    "snoo_muon",
    "stable_cooldown_schedule",
    "track3_baseline",
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
        x = jnp.asarray(count, jnp.float32) / total_steps
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
      adam_b1: Adam beta1 (of the groups not given as `AdamGroup`).
      adam_b2: Adam beta2 (likewise).
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
      adam_b1: Adam beta1.
      adam_b2: Adam beta2.
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
      adam_b1: AdamW beta1 of every group.
      adam_b2: AdamW beta2 of every group.
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
