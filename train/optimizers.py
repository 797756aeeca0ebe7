"""The optimizer registry: `--optimizer NAME` -> an optax stack built from a `TrainConfig`.

A builder takes the config and returns `(tx, snoo_k)`: the gradient transformation and,
when the stack is wrapped in `optax_snoo.snoo`, its sync period (the trainer then compiles
a sync and a no-sync step and picks one on the host), else `None`. Every stack starts with
global-norm clipping (`grad_clip`, 0 = off). Later work adds entries with `register`.

Example:
  >>> from train.config import TrainConfig
  >>> tx, snoo_k = build_optimizer(TrainConfig(optimizer="snoo_adamw", snoo_k=4))
  >>> snoo_k
  4

References:
  Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
  https://arxiv.org/abs/1711.05101, 2019.
  Jordan et al., "Muon: An optimizer for hidden layers in neural networks",
  https://kellerjordan.github.io/posts/muon/, 2024.
  Jordan et al., "modded-nanogpt" (record 2025-09-16, Snoo, PR #128),
  https://github.com/KellerJordan/modded-nanogpt, 2025.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import optax_snoo
import optax_snoo.labels
from optax_snoo import kfac as kfac_lib
from optax_snoo import muon as muon_tx
from optax_snoo import muon_momentum_warmup
from optax_snoo.recipes import stable_cooldown_schedule
from train.config import TrainConfig

__all__ = [
    "OPTIMIZERS",
    "Builder",
    "build_optimizer",
    "learning_rate_schedule",
    "register",
]

Builder = Callable[[TrainConfig], tuple[optax.GradientTransformationExtraArgs, int | None]]
OPTIMIZERS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator adding a builder to `OPTIMIZERS` under `name` (names are unique)."""

    def add(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        return builder

    return add


def learning_rate_schedule(config: TrainConfig, peak: float | None = None) -> optax.Schedule:
    """The learning rate of `config.schedule` peaking at `peak` (default `learning_rate`).

    - `"cosine"` (nanoGPT's `get_lr`): `peak*(t+1)/(warmup+1)` for `t < warmup_iters`, then
      cosine down to `min_lr` at `lr_decay_iters` (default `max_iters`), then `min_lr`.
      For another `peak`, `min_lr` is scaled by `peak / learning_rate`.
    - `"stable_cooldown"` (SPEC §2.5): `peak` until `1 - cooldown_frac` of `max_iters`,
      then linear down to `peak * final_lr_scale`.
    """
    peak = config.learning_rate if peak is None else peak
    if config.schedule == "stable_cooldown":
        return stable_cooldown_schedule(
            peak, max(config.max_iters, 1), cooldown_frac=config.cooldown_frac,
            final_lr_scale=config.final_lr_scale)
    decay_iters = config.max_iters if config.lr_decay_iters is None else config.lr_decay_iters
    warmup = config.warmup_iters
    end = config.min_lr * peak / config.learning_rate if config.learning_rate else 0.0
    if decay_iters <= warmup:  # nanoGPT: warmup, then min_lr
        return optax.join_schedules([optax.linear_schedule(peak / (warmup + 1), peak, warmup),
                                     optax.constant_schedule(end)], [warmup])
    # optax's linear warmup from peak/(w+1) equals nanoGPT's peak*(t+1)/(w+1) exactly.
    return optax.warmup_cosine_decay_schedule(
        init_value=peak / (warmup + 1), peak_value=peak, warmup_steps=warmup,
        decay_steps=decay_iters, end_value=end)


def _clip(config: TrainConfig) -> optax.GradientTransformation:
    return optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else (
        optax.identity())


def _decay_matrices(params: optax.Params) -> optax.Params:
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _adamw(config: TrainConfig) -> optax.GradientTransformation:
    return optax.adamw(learning_rate_schedule(config), b1=config.beta1, b2=config.beta2,
                       eps=config.eps, weight_decay=config.weight_decay, mask=_decay_matrices)


def _muon(config: TrainConfig) -> optax.GradientTransformation:
    beta = config.muon_beta if config.muon_beta_warmup == 0 else muon_momentum_warmup(
        min(0.85, config.muon_beta), config.muon_beta, config.muon_beta_warmup)
    return muon_tx(
        learning_rate_schedule(config, config.muon_lr), beta=beta,
        weight_decay=config.muon_weight_decay, smoothing=config.muon_smoothing,
        adam_learning_rate=learning_rate_schedule(config), adam_b1=config.beta1,
        adam_b2=config.beta2, adam_eps=config.eps, adam_weight_decay=0.0)


def _snoo(config: TrainConfig, inner: optax.GradientTransformation):
    return optax_snoo.snoo(inner, learning_rate=config.snoo_lr, momentum=config.snoo_momentum,
                           k=config.snoo_k)


@register("adamw")
def adamw(config: TrainConfig):
    """nanoGPT's AdamW: decay on >= 2-D params only, warmup + cosine by default."""
    return optax.chain(_clip(config), _adamw(config)), None


@register("muon")
def muon(config: TrainConfig):
    """Muon on hidden matrices (`muon_lr`, momentum warmed up from 0.85 to `muon_beta` over
    `muon_beta_warmup` steps); Adam without decay (`learning_rate`) on embeddings, head,
    norms and biases."""
    return optax.chain(_clip(config), _muon(config)), None


@register("snoo_adamw")
def snoo_adamw(config: TrainConfig):
    """`adamw` wrapped in Snoo (`snoo_lr`, `snoo_momentum`, `snoo_k`)."""
    return optax.chain(_clip(config), _snoo(config, _adamw(config))), config.snoo_k


@register("snoo_muon")
def snoo_muon(config: TrainConfig):
    """The modded-nanogpt record's stack adapted: Snoo around Muon (hidden matrices) and
    Adam (embeddings, head, norms); use `--schedule=stable_cooldown` for the record's lr."""
    return optax.chain(_clip(config), _snoo(config, _muon(config))), config.snoo_k


def _skew_adam(config: TrainConfig, rounding: optax.GradientTransformation | None = None
               ) -> optax.GradientTransformation:
    return optax_snoo.skew_adam(
        learning_rate_schedule(config, config.skew_lr), b1=config.beta1, b2=config.beta2,
        eps=config.eps, weight_decay=config.skew_weight_decay, policies=config.skew_policies,
        clip_threshold=config.skew_clip if config.skew_clip > 0 else None, rounding=rounding)


@register("skewadam")
def skewadam(config: TrainConfig):
    """SkewAdam (SPEC §3): roles from param paths (`experts`, `router`, else backbone),
    momentum for the backbone only, factored second moments, no decay on the router;
    `skew_lr` on the trainer's schedule, `beta1`/`beta2`/`eps` shared with AdamW (eps is
    SkewAdam's clamp on the squared statistics), `skew_policies` picks the paper's
    ablations. `--rounding` goes inside SkewAdam, so it rounds `p + u` from the float32
    update (SPEC §3 step 5) rather than from an update already cast to bf16."""
    return optax.chain(_clip(config), _skew_adam(config, _rounding(config))), None


@register("snoo_skewadam")
def snoo_skewadam(config: TrainConfig):
    """`skewadam` wrapped in Snoo (`snoo_lr`, `snoo_momentum`, `snoo_k`)."""
    return optax.chain(_clip(config), _snoo(config, _skew_adam(config))), config.snoo_k


@register("adafactor")
def adafactor(config: TrainConfig):
    """optax's Adafactor as SkewAdam's baseline: factored second moment (dims >= 128), no
    momentum, its own beta2 schedule (decay 0.8), update clipping 1.0, absolute steps
    (no parameter scaling) at `skew_lr` and decoupled decay `skew_weight_decay` (optax adds
    its `weight_decay_rate` after the lr, so it gets `skew_weight_decay · lr(t)`)."""
    lr = learning_rate_schedule(config, config.skew_lr)
    return optax.chain(_clip(config), optax.adafactor(
        lr, multiply_by_parameter_scale=False,
        weight_decay_rate=lambda t: config.skew_weight_decay * lr(t))), None


#: Stacks that apply `--rounding` themselves (build_optimizer does not append it).
ROUNDING_INSIDE = {"skewadam"}


def _rounding(config: TrainConfig) -> optax.GradientTransformation | None:
    """`--rounding`: the transform that puts low-precision params on rounded values."""
    makers = {"stochastic": optax_snoo.stochastic_rounding,
              "dithered": optax_snoo.dithered_rounding}
    return makers[config.rounding](key=config.seed) if config.rounding in makers else None
# ------------------------------------------------------------------------------ K-FAC
# Hidden Dense kernels and their biases go to K-FAC; embeddings, the head, norms, routers
# and expert stacks (3-D) to AdamW. The trainer passes their curvature from the step.
KFAC_RULES: tuple = (
    (r"(^|/)(wte|wpe|lm_head|router|experts)(/|$)", "adamw"),
    (r"(^|/)(ln\w*|\w*norm\w*)(/|$)", "adamw"),
    (r"(^|/)(kernel|bias)$", "kfac"),
    (r".*", "adamw"),
)
CURVATURE_OPTIMIZERS: set[str] = set()


def needs_curvature(config: TrainConfig) -> bool:
    """Whether `config.optimizer` takes the batch K-FAC statistics (`curvature=`)."""
    return config.optimizer in CURVATURE_OPTIMIZERS


def kfac_refresh_policy(config: TrainConfig) -> kfac_lib.RefreshPolicy:
    """The refresh policy of `config.kfac_refresh` (SPEC §4.3).

    - `every`: `every(kfac_interval, first=kfac_first)`;
    - `by_lr_phase`: `kfac_phases` (warmup, peak, decay, tail), peak at `kfac_lr`;
    - `lr_ratio`: `lr_ratio(kfac_tau, max_interval=kfac_interval, min_interval=
      kfac_min_interval)`, skipping the warmup when `kfac_skip_warmup`.
    """
    if config.kfac_refresh == "every":
        return kfac_lib.every(config.kfac_interval, first=config.kfac_first)
    if config.kfac_refresh == "lr_ratio":
        return kfac_lib.lr_ratio(
            config.kfac_tau, max_interval=config.kfac_interval,
            min_interval=config.kfac_min_interval,
            warmup_steps=config.warmup_iters if config.kfac_skip_warmup else 0)
    values = [v.strip().lower() for v in config.kfac_phases.split(",")]
    if len(values) != len(kfac_lib.PHASES):
        raise ValueError(f"kfac_phases={config.kfac_phases!r}: expected {len(kfac_lib.PHASES)}"
                         f" comma-separated intervals for {', '.join(kfac_lib.PHASES)}")
    parse = lambda v: None if v == "none" else v if v == "once" else int(v) if v.isdigit() else v
    intervals = dict(zip(kfac_lib.PHASES, map(parse, values), strict=True))
    peak = config.learning_rate if config.kfac_lr is None else config.kfac_lr
    return kfac_lib.by_lr_phase(peak, warmup_steps=config.warmup_iters, intervals=intervals)


def kfac_schedule(config: TrainConfig) -> optax.Schedule:
    """The learning rate of the K-FAC group (what LR-aware refresh policies read)."""
    return learning_rate_schedule(config, config.kfac_lr)


def _kfac(config: TrainConfig) -> optax.GradientTransformation:
    if config.kfac_warm_start < 0:
        raise ValueError(f"kfac_warm_start={config.kfac_warm_start}: expected batches >= 0")
    hidden = kfac_lib.kfac(
        kfac_schedule(config), damping=config.kfac_damping, momentum=config.kfac_momentum,
        weight_decay=config.weight_decay, weight_decay_mask=_decay_matrices,
        ema_decay=config.kfac_ema, refresh=kfac_refresh_policy(config), mode=config.kfac_mode,
        graft=None if config.kfac_graft == "none" else config.kfac_graft, b2=config.beta2,
        eps=config.eps)
    return optax_snoo.labels.partition({"kfac": hidden, "adamw": _adamw(config)},
                                       optax_snoo.labels.label_by_rules(KFAC_RULES))


def kfac_curvature_fn(params: optax.Params, stride: int = 1
                      ) -> Callable[[dict, jax.Array], dict]:
    """`(stats, step) -> curvature` for the K-FAC group of `params` (see `KFAC_RULES`).

    `stats` is the dict of `models.value_grad_and_stats` (`path -> (inputs, out_grads)`,
    `(B, T, ·)`); the result maps each K-FAC kernel path to its `layer_factors` (with the
    bias coordinate when the layer has a bias), the `curvature=` argument of `kfac`.
    With `stride > 1` the factors come from every `stride`-th position of each sequence
    (positions `step % stride`, `+ stride`, ...: all positions over `stride` steps), which
    divides their cost by `stride`; `g = M·dy` keeps `M` the number of tokens of the loss.
    """
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"kfac_stats_stride={stride!r}: expected an int >= 1")
    labels = optax_snoo.labels.label_by_rules(KFAC_RULES)(params)
    paths = {optax_snoo.labels.path_to_str(p): label for p, label in
             jax.tree_util.tree_flatten_with_path(labels)[0]}
    layers = {path: path[:-len("kernel")] + "bias" in paths for path, label in paths.items()
              if label == "kfac" and path.endswith("/kernel")}

    def positions(x_BTD: jax.Array, offset: jax.Array) -> jax.Array:
        B, T, D = x_BTD.shape
        if T % stride:
            raise ValueError(f"kfac_stats_stride={stride} must divide the sequence length {T}")
        return jax.lax.dynamic_index_in_dim(x_BTD.reshape(B, T // stride, stride, D), offset,
                                            axis=2, keepdims=False)

    def curvature(stats: dict, step: jax.Array) -> dict:
        missing = sorted(set(layers) - set(stats))
        if missing:
            raise ValueError(f"the model captured no K-FAC statistics for {missing}")
        out = {}
        for path, has_bias in layers.items():
            x, dy = stats[path]
            num_tokens = math.prod(x.shape[:-1])
            if stride > 1:
                offset = jnp.asarray(step, jnp.int32) % stride
                x, dy = positions(x, offset), positions(dy, offset)
            out[path] = kfac_lib.layer_factors(x, dy, has_bias, num_tokens=num_tokens)
        return out

    return curvature


def _register_kfac(name: str) -> Callable[[Builder], Builder]:
    CURVATURE_OPTIMIZERS.add(name)
    return register(name)


@_register_kfac("kfac")
def kfac(config: TrainConfig):
    """K-FAC (SPEC §4) on hidden Dense kernels and biases, grafted to Adam's norm by default
    (`kfac_*` options), AdamW on embeddings, head and norms; needs `curvature=`."""
    return optax.chain(_clip(config), _kfac(config)), None


@_register_kfac("snoo_kfac")
def snoo_kfac(config: TrainConfig):
    """`kfac` wrapped in Snoo (`snoo_lr`, `snoo_momentum`, `snoo_k`)."""
    return optax.chain(_clip(config), _snoo(config, _kfac(config))), config.snoo_k


def build_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformationExtraArgs,
                                                  int | None]:
    """Build `config.optimizer` from `OPTIMIZERS`.

    With `rounding` other than "none", the stack is followed by that rounding transform
    (seeded with `seed`; stacks in `ROUNDING_INSIDE` place it themselves), so bf16 params
    land on stochastically (or dithered-) rounded values; float32 params pass through it
    unchanged.

    Returns:
      `(tx, snoo_k)`; `snoo_k` is the Snoo sync period or `None` for stacks without Snoo.

    Raises:
      ValueError: for an unknown name, listing the registry.
    """
    if config.optimizer not in OPTIMIZERS:
        close = difflib.get_close_matches(config.optimizer, OPTIMIZERS, n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"unknown optimizer {config.optimizer!r}{hint} Registered: "
                         f"{sorted(OPTIMIZERS)}")
    tx, snoo_k = OPTIMIZERS[config.optimizer](config)
    rounding = _rounding(config)
    if rounding is not None and config.optimizer not in ROUNDING_INSIDE:
        tx = optax.chain(tx, rounding)
    return optax.with_extra_args_support(tx), snoo_k
