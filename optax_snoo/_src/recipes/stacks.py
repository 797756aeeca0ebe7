"""The general-purpose recipes: AdamW, Muon, NorMuon, SkewAdam, Adafactor, K-FAC, Newton-Muon.

Each is one optimizer (or Muon + one Adam group) on one learning-rate schedule,
nanoGPT's warm-up + cosine by default or modded-nanogpt's flat + linear cooldown, with
a `with_snoo` twin (``snoo_adamw``, ``snoo_muon``...). Their defaults are the trainer's
CPU presets' (a 4-layer character GPT); the records' own stacks are in the other modules
of this package.

References:
  Karpathy, `nanoGPT <https://github.com/karpathy/nanoGPT>`_, 2023.
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax

from optax_snoo import kfac as kfac_lib
from optax_snoo._src.labels import by_path, label_by_rules, muon_adam_labels, partition
from optax_snoo._src.muon_adam import muon
from optax_snoo._src.newton_muon import newton_muon
from optax_snoo._src.recipes.base import (
    Hyperparameters,
    Recipe,
    Stack,
    hyperparameter,
    register,
    with_snoo,
)
from optax_snoo._src.schedules import (
    muon_momentum_warmup,
    nanogpt_cosine_schedule,
    stable_cooldown_schedule,
)
from optax_snoo._src.skew_adam import skew_adam

__all__ = [
    "KFAC_LABEL_RULES",
    "NEWTON_MUON_SHARED_INPUTS",
    "ScheduleHyperparameters",
    "kfac_label_rules",
    "nanogpt_decay_mask",
    "schedule_of",
]


@dataclasses.dataclass(frozen=True)
class ScheduleHyperparameters(Hyperparameters):
    """Every group's learning rate follows one schedule of its own peak."""

    schedule: str = hyperparameter(
        "cosine", "every group's lr: nanoGPT's warm-up + cosine, or modded-nanogpt's flat "
        "then linear cooldown", choices=("cosine", "stable_cooldown"))
    warmup_iters: int = hyperparameter(100, "cosine: linear warm-up steps",
                                       check="at_least_0", read_when=("schedule", "cosine"))
    lr_decay_iters: int | None = hyperparameter(
        None, "cosine: the step the cosine reaches its floor (None = the run's length)",
        check="at_least_0", read_when=("schedule", "cosine"))
    cooldown_frac: float = hyperparameter(
        0.7, "stable_cooldown: fraction of the run spent in the linear cooldown",
        check="positive_fraction", read_when=("schedule", "stable_cooldown"))
    final_lr_scale: float = hyperparameter(
        0.1, "each group's final lr as a fraction of its peak (nanoGPT's min_lr/lr)",
        check="fraction")


def schedule_of(table: ScheduleHyperparameters, peak: float, total_steps: int
                ) -> optax.Schedule:
    """``table``'s schedule peaking at ``peak`` over ``total_steps``."""
    if table.schedule == "stable_cooldown":
        return stable_cooldown_schedule(peak, total_steps, table.cooldown_frac,
                                        table.final_lr_scale)
    decay = total_steps if table.lr_decay_iters is None else table.lr_decay_iters
    return nanogpt_cosine_schedule(peak, warmup_steps=table.warmup_iters, decay_steps=decay,
                                   final_lr_scale=table.final_lr_scale)


def _warmup_of(table: ScheduleHyperparameters) -> int:
    return table.warmup_iters if table.schedule == "cosine" else 0


def nanogpt_decay_mask(params: optax.Params) -> optax.Params:
    """nanoGPT's decay mask: True on leaves with >= 2 axes (matrices, embeddings), never on
    norm scales and biases (also when stacked ``(n_layer, D)``)."""
    return by_path([(r"(^|/)(scale|bias)$", False)],
                   default=lambda leaf: leaf.ndim >= 2)(params)


# --------------------------------------------------------------------------------- AdamW


@dataclasses.dataclass(frozen=True)
class AdamWHyperparameters(ScheduleHyperparameters):
    """nanoGPT's AdamW (`optax.adamw`): decoupled decay on >= 2-D leaves only."""

    learning_rate: float = hyperparameter(1e-3, "AdamW's peak lr", check="positive")
    b1: float = hyperparameter(0.9, "Adam's first-moment decay", check="unit_interval")
    b2: float = hyperparameter(0.99, "Adam's second-moment decay", check="unit_interval")
    eps: float = hyperparameter(1e-8, "Adam's epsilon", check="positive")
    weight_decay: float = hyperparameter(0.1, "decoupled weight decay on >= 2-D leaves "
                                         "(not norms, biases)", check="non_negative")


def _adamw(t: AdamWHyperparameters, total_steps: int) -> Stack:
    lr = schedule_of(t, t.learning_rate, total_steps)
    tx = optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                     mask=nanogpt_decay_mask)
    return Stack(optax.with_extra_args_support(tx), lr)


adamw = register(Recipe("adamw", AdamWHyperparameters, _adamw,
                        summary="nanoGPT's AdamW (decay on >= 2-D leaves), warm-up + cosine"))
snoo_adamw = register(with_snoo(adamw))

# ---------------------------------------------------------------------------------- Muon


@dataclasses.dataclass(frozen=True)
class MuonHyperparameters(ScheduleHyperparameters):
    """Muon on the hidden matrices, one Adam group (no decay) on the rest (`optax_snoo.muon`)."""

    muon_learning_rate: float = hyperparameter(0.02, "Muon's peak lr", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum (after its warm-up)",
                                          check="unit_interval")
    muon_momentum_warmup_steps: int = hyperparameter(
        300, "steps warming Muon's momentum up from min(0.85, muon_momentum) (0 = constant)",
        check="at_least_0")
    muon_weight_decay: float = hyperparameter(0.0, "Muon's decoupled weight decay (times "
                                              "its lr)", check="non_negative")
    muon_smoothing: float | None = hyperparameter(
        None, "Muon's update smoothing sigma (modded-nanogpt PR #137, EMA form; None = off)",
        check="unit_interval")
    cautious_weight_decay: bool = hyperparameter(
        False, "decay only where the update and the weight agree in sign (every group)")
    adam_learning_rate: float = hyperparameter(1e-3, "the Adam group's peak lr "
                                               "(embeddings, head, norms, biases)",
                                               check="positive")
    adam_b1: float = hyperparameter(0.9, "Adam's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.99, "Adam's second-moment decay", check="unit_interval")
    adam_eps: float = hyperparameter(1e-8, "Adam's epsilon", check="positive")


@dataclasses.dataclass(frozen=True)
class NorMuonHyperparameters(MuonHyperparameters):
    """NorMuon: Muon with a per-neuron second moment after orthogonalising (Li et al.)."""

    muon_beta2: float = hyperparameter(0.95, "NorMuon's per-neuron second-moment decay",
                                       check="unit_interval")
    cautious_weight_decay: bool = hyperparameter(
        True, "decay only where the update and the weight agree in sign (every group; on "
        "as in modded-nanogpt's current record)")


def _momentum(t: MuonHyperparameters) -> Any:
    if t.muon_momentum_warmup_steps == 0:
        return t.muon_momentum
    return muon_momentum_warmup(min(0.85, t.muon_momentum), t.muon_momentum,
                                t.muon_momentum_warmup_steps)


def _muon_kwargs(t: MuonHyperparameters, total_steps: int) -> dict[str, Any]:
    return dict(
        learning_rate=schedule_of(t, t.muon_learning_rate, total_steps), beta=_momentum(t),
        weight_decay=t.muon_weight_decay, smoothing=t.muon_smoothing,
        beta2=getattr(t, "muon_beta2", None), cautious_weight_decay=t.cautious_weight_decay,
        adam_learning_rate=schedule_of(t, t.adam_learning_rate, total_steps),
        adam_b1=t.adam_b1, adam_b2=t.adam_b2, adam_eps=t.adam_eps)


def _muon(t: MuonHyperparameters, total_steps: int, *, labels: Any = None,
          newton_schulz_plan: Any = None, shard_newton_schulz: bool = True) -> Stack:
    kwargs = _muon_kwargs(t, total_steps)
    tx = muon(**kwargs, labels=labels, newton_schulz_plan=newton_schulz_plan,
              shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, kwargs["learning_rate"], groups=labels or muon_adam_labels)


#: The structural options of the Muon recipes: the labels and where the matrices live.
MUON_OPTIONS = dict(labels=None, newton_schulz_plan=None, shard_newton_schulz=True)

muon_recipe = register(Recipe(
    "muon", MuonHyperparameters, _muon, options=MUON_OPTIONS,
    summary="Muon on hidden matrices (momentum warm-up), Adam on the rest, one schedule"))
snoo_muon = register(with_snoo(muon_recipe))
normuon_recipe = register(Recipe(
    "normuon", NorMuonHyperparameters, _muon, options=MUON_OPTIONS,
    summary="NorMuon (per-neuron second moment after Newton-Schulz, cautious decay) on "
    "hidden matrices, Adam on the rest"))
snoo_normuon = register(with_snoo(normuon_recipe))

# ------------------------------------------------------------------------------ SkewAdam


@dataclasses.dataclass(frozen=True)
class SkewAdamHyperparameters(ScheduleHyperparameters):
    """SkewAdam's per-role state (`optax_snoo.skew_adam`)."""

    learning_rate: float = hyperparameter(1e-3, "SkewAdam's peak lr (the paper's 3e-4 is "
                                          "for its 6.8B model)", check="positive")
    b1: float = hyperparameter(0.9, "first-moment decay (roles with momentum)",
                               check="unit_interval")
    b2: float = hyperparameter(0.99, "second-moment decay", check="unit_interval")
    eps: float = hyperparameter(1e-8, "lower clamp of the squared statistics",
                                check="positive")
    weight_decay: float = hyperparameter(0.05, "decoupled weight decay (backbone, experts; "
                                         "never the router)", check="non_negative")
    clip_threshold: float = hyperparameter(1.0, "per-tensor RMS clip of the update (0 = off)",
                                           check="non_negative")
    policies: str = hyperparameter("skew_adam", "the per-role state table", choices=(
        "skew_adam", "expert_momentum", "factored_router", "uniform"))


def _skew_adam(t: SkewAdamHyperparameters, total_steps: int, *, rounding: Any = None
               ) -> Stack:
    lr = schedule_of(t, t.learning_rate, total_steps)
    tx = skew_adam(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                   policies=t.policies, rounding=rounding,
                   clip_threshold=t.clip_threshold if t.clip_threshold > 0 else None)
    return Stack(tx, lr)


skew_adam_recipe = register(Recipe(
    "skew_adam", SkewAdamHyperparameters, _skew_adam, options=dict(rounding=None),
    summary="SkewAdam: per-role state for MoE (backbone momentum + factored second moment, "
    "experts factored only, router full, no decay)"))
snoo_skew_adam = register(with_snoo(skew_adam_recipe))


@dataclasses.dataclass(frozen=True)
class AdafactorHyperparameters(ScheduleHyperparameters):
    """optax's Adafactor as SkewAdam's baseline."""

    learning_rate: float = hyperparameter(1e-3, "Adafactor's peak lr (absolute steps, no "
                                          "parameter scaling)", check="positive")
    weight_decay: float = hyperparameter(0.05, "decoupled weight decay, times the lr",
                                         check="non_negative")


def _adafactor(t: AdafactorHyperparameters, total_steps: int) -> Stack:
    lr = schedule_of(t, t.learning_rate, total_steps)
    wd = t.weight_decay
    # optax adds weight_decay_rate after the lr: wd·lr(t) is the decoupled decay.
    tx = optax.adafactor(lr, multiply_by_parameter_scale=False,
                         weight_decay_rate=lambda count: wd * lr(count))
    return Stack(optax.with_extra_args_support(tx), lr)


adafactor = register(Recipe(
    "adafactor", AdafactorHyperparameters, _adafactor,
    summary="optax's Adafactor (factored second moment, no momentum, update clipping 1.0)"))

# ---------------------------------------------------------------------------------- K-FAC


def kfac_label_rules(experts: bool = False) -> tuple:
    """`label_by_rules` rules of the K-FAC recipes: hidden Dense kernels and their biases to
    ``"kfac"``; embeddings, the head, norms, routers (and expert stacks unless
    ``experts``) to ``"adamw"``."""
    to_adamw = "wte|wpe|lm_head|router" + ("" if experts else "|experts")
    return ((rf"(^|/)({to_adamw})(/|$)", "adamw"),
            (r"(^|/)(ln\w*|\w*norm\w*)(/|$)", "adamw"),
            (r"(^|/)(kernel|bias)$", "kfac"),
            *(((r"(^|/)experts/w_\w+$", "kfac"),) if experts else ()),
            (r".*", "adamw"))


#: The K-FAC recipes' label rules without the expert stacks (`kfac_label_rules`).
KFAC_LABEL_RULES: tuple = kfac_label_rules()


@dataclasses.dataclass(frozen=True)
class KfacHyperparameters(ScheduleHyperparameters):
    """K-FAC on hidden Dense kernels (+ biases), AdamW on the rest (`optax_snoo.kfac.kfac`)."""

    kfac_learning_rate: float = hyperparameter(1e-3, "the K-FAC group's peak lr",
                                               check="positive")
    kfac_damping: float = hyperparameter(1e-3, "K-FAC's damping lambda", check="non_negative")
    kfac_ema_decay: float = hyperparameter(0.95, "the factors' EMA decay rho",
                                           check="unit_interval")
    kfac_momentum: float = hyperparameter(0.9, "the K-FAC group's heavy-ball momentum",
                                          check="unit_interval")
    kfac_mode: str = hyperparameter("pi", "damping: factored (pi) or exact (eigen)",
                                    choices=("pi", "eigen"))
    kfac_graft: str = hyperparameter("adam", "per-layer norm of the K-FAC direction",
                                     choices=("adam", "sgd", "none"))
    kfac_refresh: str = hyperparameter("every", "when the inverses are refreshed",
                                       choices=("every", "by_lr_phase", "lr_ratio"))
    kfac_interval: int = hyperparameter(100, "every: steps between refreshes; lr_ratio: the "
                                        "longest interval", check="at_least_1")
    kfac_first: int | None = hyperparameter(None, "every: first refresh step (None = "
                                            "kfac_interval)", check="at_least_0",
                                            read_when=("kfac_refresh", "every"))
    kfac_phases: str = hyperparameter("none,150,300,600", "by_lr_phase: intervals for "
                                      "warmup,peak,decay,tail (an int, none or once)",
                                      read_when=("kfac_refresh", "by_lr_phase"))
    kfac_tau: float = hyperparameter(0.15, "lr_ratio: relative lr change that refreshes",
                                     check="positive", read_when=("kfac_refresh", "lr_ratio"))
    kfac_min_interval: int = hyperparameter(10, "lr_ratio: fewest steps between refreshes",
                                            check="at_least_1",
                                            read_when=("kfac_refresh", "lr_ratio"))
    kfac_skip_warmup: bool = hyperparameter(False, "lr_ratio: no refresh in the warm-up",
                                            read_when=("kfac_refresh", "lr_ratio"))
    kfac_stats_every: int = hyperparameter(1, "factor statistics every n-th step only (EMA "
                                           "decay rho^n)", check="at_least_1")
    kfac_stats_stride: int = hyperparameter(1, "a trainer's capture: factors from every n-th "
                                            "position of each sequence (rotating)",
                                            check="at_least_1")
    kfac_warm_start: int = hyperparameter(0, "a trainer's capture: batches estimating the "
                                          "factors before step 0", check="at_least_0")
    kfac_experts: bool = hyperparameter(False, "K-FAC also on MoE expert stacks (per-expert "
                                        "factors); else AdamW")
    adam_learning_rate: float = hyperparameter(1e-3, "the AdamW group's peak lr",
                                               check="positive")
    adam_b1: float = hyperparameter(0.9, "AdamW's first-moment decay", check="unit_interval")
    adam_b2: float = hyperparameter(0.99, "AdamW's second-moment decay (also Adam "
                                    "grafting's)", check="unit_interval")
    adam_eps: float = hyperparameter(1e-8, "AdamW's epsilon (also Adam grafting's)",
                                     check="positive")
    weight_decay: float = hyperparameter(0.1, "decoupled weight decay of both groups on >= 2-D "
                                         "leaves", check="non_negative")

    def validate(self) -> None:
        if self.kfac_refresh == "by_lr_phase":
            kfac_phase_intervals(self.kfac_phases)


def kfac_phase_intervals(text: str) -> dict[str, Any]:
    """``"none,150,300,600"`` -> the `optax_snoo.kfac.by_lr_phase` intervals."""
    values = [v.strip().lower() for v in text.split(",")]
    if len(values) != len(kfac_lib.PHASES):
        raise ValueError(f"kfac_phases={text!r}: expected {len(kfac_lib.PHASES)} comma-"
                         f"separated intervals for {', '.join(kfac_lib.PHASES)}")
    for v in values:
        if v not in ("none", "once") and not v.isdigit():
            raise ValueError(f"kfac_phases={text!r}: {v!r} is not an interval, none or once")
    parse = lambda v: None if v == "none" else v if v == "once" else int(v)
    return dict(zip(kfac_lib.PHASES, map(parse, values), strict=True))


def kfac_refresh_policy(t: KfacHyperparameters) -> Any:
    """The refresh policy ``kfac_refresh`` names."""
    if t.kfac_refresh == "every":
        return kfac_lib.every(t.kfac_interval, first=t.kfac_first)
    if t.kfac_refresh == "lr_ratio":
        return kfac_lib.lr_ratio(t.kfac_tau, max_interval=t.kfac_interval,
                                 min_interval=t.kfac_min_interval,
                                 warmup_steps=_warmup_of(t) if t.kfac_skip_warmup else 0)
    return kfac_lib.by_lr_phase(t.kfac_learning_rate, warmup_steps=_warmup_of(t),
                                intervals=kfac_phase_intervals(t.kfac_phases))


def _kfac_layers(params: optax.Params) -> dict:
    """The K-FAC group's kernels (every matrix it sees but the biases), experts included."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]
    from optax_snoo._src.utils import path_to_str
    paths = [path_to_str(p) for p, leaf in leaves
             if not isinstance(leaf, optax.MaskedNode) and leaf.ndim >= 2
             and not path_to_str(p).endswith("/bias")]  # (L, d): scanned biases
    return kfac_lib.layers_from_params(params, paths)


def _kfac(t: KfacHyperparameters, total_steps: int, *, shardings: Any = None,
          stats_axes: tuple[str, ...] | None = None) -> Stack:
    lr = schedule_of(t, t.kfac_learning_rate, total_steps)
    hidden = kfac_lib.kfac(
        lr, damping=t.kfac_damping, momentum=t.kfac_momentum, weight_decay=t.weight_decay,
        mask=nanogpt_decay_mask, ema_decay=t.kfac_ema_decay, refresh=kfac_refresh_policy(t),
        mode=t.kfac_mode, graft=None if t.kfac_graft == "none" else t.kfac_graft,
        b2=t.adam_b2, eps=t.adam_eps, layers=_kfac_layers, shardings=shardings,
        stats_every=t.kfac_stats_every, stats_axes=stats_axes)
    rest = optax.adamw(schedule_of(t, t.adam_learning_rate, total_steps), b1=t.adam_b1,
                       b2=t.adam_b2, eps=t.adam_eps, weight_decay=t.weight_decay,
                       mask=nanogpt_decay_mask)
    labels = label_by_rules(kfac_label_rules(t.kfac_experts))
    return Stack(partition({"kfac": hidden, "adamw": rest}, labels), lr, groups=labels,
                 update_args=("curvature",))


kfac_recipe = register(Recipe(
    "kfac", KfacHyperparameters, _kfac, options=dict(shardings=None, stats_axes=None),
    summary="K-FAC on hidden Dense kernels and biases (grafted to Adam's norm), refreshes "
    "scheduled; AdamW on embeddings, head, norms"))
snoo_kfac = register(with_snoo(kfac_recipe))

# ---------------------------------------------------------------------------- Newton-Muon
#: Modules of this repository's GPT that read one input: their kernels share one factor.
NEWTON_MUON_SHARED_INPUTS: tuple[tuple[str, ...], ...] = (("c_q", "c_k", "c_v"),
                                                          ("c_fc", "c_gate"))


@dataclasses.dataclass(frozen=True)
class NewtonMuonHyperparameters(MuonHyperparameters):
    """Muon on gradients first multiplied by their layer's inverse input covariance."""

    newton_refresh_every: int = hyperparameter(64, "updates between refreshes of the input "
                                               "covariance inverses (record #15: 64)",
                                               check="at_least_1")
    newton_ema_decay: float = hyperparameter(0.95, "the input covariance's EMA decay per "
                                             "refresh", check="unit_interval")
    newton_damping: float = hyperparameter(0.2, "damping as a fraction of the mean "
                                           "eigenvalue", check="non_negative")


def _newton_muon(t: NewtonMuonHyperparameters, total_steps: int, *, labels: Any = None,
                 newton_schulz_plan: Any = None, shard_newton_schulz: bool = True,
                 block_size: int | None = None,
                 shared_inputs: Sequence[Sequence[str]] = NEWTON_MUON_SHARED_INPUTS) -> Stack:
    kwargs = _muon_kwargs(t, total_steps)
    tx = newton_muon(
        kwargs.pop("learning_rate"), ema_decay=t.newton_ema_decay, damping=t.newton_damping,
        refresh_every=t.newton_refresh_every, block_size=block_size,
        shared_inputs=shared_inputs, **kwargs, labels=labels,
        newton_schulz_plan=newton_schulz_plan, shard_newton_schulz=shard_newton_schulz)
    return Stack(tx, schedule_of(t, t.muon_learning_rate, total_steps),
                 groups=labels or muon_adam_labels, update_args=("input_covariance",))


newton_muon_recipe = register(Recipe(
    "newton_muon", NewtonMuonHyperparameters, _newton_muon,
    options={**MUON_OPTIONS, "block_size": None, "shared_inputs": NEWTON_MUON_SHARED_INPUTS},
    summary="Newton-Muon (Track 3 record #15's method): Muon on gradients times the inverse "
    "input covariance of their layer"))
