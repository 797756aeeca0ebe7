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
from collections.abc import Callable

import jax
import optax

import optax_snoo
from optax_snoo.muon import muon as muon_tx
from optax_snoo.muon import muon_momentum_warmup
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


def _skew_adam(config: TrainConfig) -> optax.GradientTransformation:
    return optax_snoo.skew_adam(
        learning_rate_schedule(config, config.skew_lr), b1=config.beta1, b2=config.beta2,
        eps=config.eps, weight_decay=config.skew_weight_decay, policies=config.skew_policies,
        clip_threshold=config.skew_clip if config.skew_clip > 0 else None)


@register("skewadam")
def skewadam(config: TrainConfig):
    """SkewAdam (SPEC §3): roles from param paths (`experts`, `router`, else backbone),
    momentum for the backbone only, factored second moments, no decay on the router;
    `skew_lr` on the trainer's schedule, `beta1`/`beta2`/`eps` shared with AdamW (eps is
    SkewAdam's clamp on the squared statistics), `skew_policies` picks the paper's
    ablations."""
    return optax.chain(_clip(config), _skew_adam(config)), None


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


def _rounding(config: TrainConfig) -> optax.GradientTransformation | None:
    """`--rounding`: the transform that puts low-precision params on rounded values."""
    makers = {"stochastic": optax_snoo.stochastic_rounding,
              "dithered": optax_snoo.dithered_rounding}
    return makers[config.rounding](key=config.seed) if config.rounding in makers else None


def build_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformationExtraArgs,
                                                  int | None]:
    """Build `config.optimizer` from `OPTIMIZERS`.

    With `rounding` other than "none", the stack is followed by that rounding transform
    (seeded with `seed`), so bf16 params land on stochastically (or dithered-) rounded
    values; float32 params pass through it unchanged.

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
    if rounding is not None:
        tx = optax.chain(tx, rounding)
    return optax.with_extra_args_support(tx), snoo_k
