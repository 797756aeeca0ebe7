"""The optimizer registry: `--optimizer NAME` -> a `TrainOptimizer` built from a `TrainConfig`.

A builder (`@register("name")`) takes the config and returns a `TrainOptimizer`: the
gradient transformation plus everything the train step and loop need to know about it
(the learning rate to log, Snoo's sync period, whether it rounds the params itself, and
hooks for optimizers that need more than the gradient, such as K-FAC's curvature). The
step and the loop read only that object, so they hold no optimizer-specific code. Every
stack starts with global-norm clipping (`grad_clip`, 0 = off). The builders that read
the layers' statistics (`kfac`, `snoo_kfac`, `newton_muon`) live with their glue in
`train.kfac_trainer`, which `train`'s `__init__` imports, so the registry is complete
whenever `train` is imported.

Example:
  >>> from train.config import TrainConfig, override
  >>> spec = build_optimizer(override(TrainConfig(), optimizer="snoo_adamw", snoo_k=4))
  >>> spec.sync_period, spec.update_kwargs(0), spec.update_kwargs(1)
  (4, {'snoo_sync': True}, {'snoo_sync': False})

References:
  Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
  https://arxiv.org/abs/1711.05101, 2019.
  Jordan et al., "Muon: An optimizer for hidden layers in neural networks",
  https://kellerjordan.github.io/posts/muon/, 2024.
  Jordan et al., "modded-nanogpt" (record 2025-09-16, Snoo, PR #128),
  https://github.com/KellerJordan/modded-nanogpt, 2025.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

import optax_snoo
from optax_snoo import muon_momentum_warmup, power_cool, recipes, snoo_is_sync_step
from optax_snoo.recipes import stable_cooldown_schedule
from train.sharding import REPLICA_AXIS

if TYPE_CHECKING:
    from train.config import TrainConfig

__all__ = [
    "OPTIMIZERS",
    "Builder",
    "Monitor",
    "TrainOptimizer",
    "build_optimizer",
    "get_builder",
    "learning_rate_schedule",
    "register",
    "track3_labels",
]


class Monitor:
    """Host-side log of what `TrainOptimizer.observe` reads from the state every step.

    The loop calls `add` after every step (device values: nothing is read), `flush` on
    its logging steps (one transfer) and `finish` at the end. This base does nothing.
    """

    def add(self, observed: Any) -> None:
        """Keep one step's observation (device arrays)."""

    def flush(self) -> None:
        """Read the kept observations and write them out."""

    def finish(self) -> None:
        """The last flush, and any summary of the run (plots)."""


def _no_observation(opt_state: Any) -> tuple:
    return ()


def _no_monitor(out: Path, start: int) -> Monitor:
    return Monitor()


def _unprepared(state: dict, **context: Any) -> dict:
    return state


@dataclasses.dataclass(frozen=True)
class TrainOptimizer:
    """Everything the train step and loop need from an optimizer.

    Attributes:
      tx: the transformation (its chain clips first), with extra-args support.
      learning_rate: the schedule of the main group's applied lr, logged as `lr`
        (Muon's for the Muon stacks, SkewAdam's, K-FAC's...).
      sync_period: Snoo's `k` when the stack is Snoo-wrapped, else `None`; then
        `update_kwargs(step)` gives the static sync hint.
      sync_phase: Snoo's `sync`: `"start"` (updates 0, k, 2k, ...) or `"end"` (after
        every k-th update, MuLoCo's).
      rounds_itself: the stack applies `--rounding` itself (`build_optimizer` then does
        not append it).
      max_logits: `tx.update` takes `max_logits=` (QK-clip): the step's plain gradient
        function then also returns every attention layer's per-head max logit, the max
        over the micro-batches (set by `build_optimizer` for `--qk_clip_tau`).
      grad_fn: `None` for plain gradients; else `grad_fn(model, params) -> fn` with
        `fn(params, inputs_BT, targets_BT, key, step) -> ((loss, (ce, aux_loss)),
        (grads, update_args))`: the gradient and the extra keyword arguments of
        `tx.update` from the same backward pass (K-FAC: `{"curvature": ...}`), averaged
        over the micro-batches by the step.
      observe: `opt_state -> pytree` of device scalars read after every update (for
        the `Monitor`); `()` by default.
      monitor: `(out_dir, start_step) -> Monitor`, the host log of the observations.
      prepare: `prepare(state, *, model, mesh, shardings, batch, start) -> state`, run
        once before the first step (K-FAC: the warm start); `batch(step, grad_accum)` is
        the run's train batch of `step`, placed on the mesh; identity by default.
      for_params: `params -> TrainOptimizer`, the same optimizer told where the params
        live (arrays, abstract arrays or their shardings): Muon's Newton-Schulz plan,
        K-FAC's kernel shardings, which a jitted update cannot read from its tracers.
        `None`: placement does not matter. `build_optimizer(config, params)` applies it
        (not with DiLoCo replicas, whose Newton-Schulz runs inside each replica's vmapped
        update).
      replica_tx: one replica's transformation (`build_optimizer` sets it): `tx` itself,
        or with `--mesh_diloco` > 1 the transformation `tx` runs on every replica of
        replica-stacked params (`optax_snoo.over_replicas`).
    """

    tx: optax.GradientTransformationExtraArgs
    learning_rate: optax.Schedule
    sync_period: int | None = None
    sync_phase: str = "start"
    rounds_itself: bool = False
    max_logits: bool = False
    grad_fn: Callable[[Any, Any], Callable[..., Any]] | None = None
    observe: Callable[[Any], Any] = _no_observation
    monitor: Callable[[Path, int], Monitor] = _no_monitor
    prepare: Callable[..., dict] = _unprepared
    for_params: Callable[[Any], TrainOptimizer] | None = None
    replica_tx: optax.GradientTransformation | None = None

    @property
    def takes_curvature(self) -> bool:
        """Whether `tx.update` takes per-batch arguments besides the gradient (`grad_fn`)."""
        return self.grad_fn is not None

    def update_kwargs(self, step: int) -> dict[str, Any]:
        """Static keyword arguments of `tx.update` at update number `step` (host side).

        With Snoo, `{"snoo_sync": step % k == 0}`: a skipped step keeps its slot in the
        period (`optax_snoo.skip_update`), so the hint is a function of the step alone.
        """
        if self.sync_period is None:
            return {}
        return {"snoo_sync": snoo_is_sync_step(step, self.sync_period, self.sync_phase)}


Builder = Callable[["TrainConfig"], TrainOptimizer]
OPTIMIZERS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator adding a builder to `OPTIMIZERS` under `name` (names are unique).

    Example:
      >>> @register("sgd_example")
      ... def sgd(config):
      ...     lr = learning_rate_schedule(config)
      ...     return TrainOptimizer(optax.chain(clipping(config), optax.sgd(lr)), lr)
      >>> "sgd_example" in OPTIMIZERS
      True
      >>> del OPTIMIZERS["sgd_example"]
    """

    def add(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        return builder

    return add


def get_builder(name: str) -> Builder:
    """The builder registered as `name`.

    Raises:
      ValueError: for an unknown name, with close matches and the registry.
    """
    if name not in OPTIMIZERS:
        close = difflib.get_close_matches(name, OPTIMIZERS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"optimizer={name!r}: unknown{hint}; registered optimizers are "
                         f"{sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def learning_rate_schedule(config: TrainConfig, peak: float | None = None) -> optax.Schedule:
    """The learning rate of `config.schedule` peaking at `peak` (default AdamW's).

    - `"cosine"` (nanoGPT's `get_lr`): `peak*(t+1)/(warmup+1)` for `t < warmup_iters`, then
      cosine down to `min_lr` at `lr_decay_iters` (default `max_iters`), then `min_lr`.
      For another `peak`, `min_lr` is scaled by `peak / learning_rate`.
    - `"stable_cooldown"` (the modded-nanogpt record's): `peak` until `1 - cooldown_frac`
      of `max_iters`, then linear down to `peak * final_lr_scale`.
    """
    s, base = config.schedule, config.adamw.learning_rate
    peak = base if peak is None else peak
    max_iters = config.run.max_iters
    if s.kind == "stable_cooldown":
        return stable_cooldown_schedule(peak, max(max_iters, 1), cooldown_frac=s.cooldown_frac,
                                        final_lr_scale=s.final_lr_scale)
    decay_iters = max_iters if s.lr_decay_iters is None else s.lr_decay_iters
    warmup = s.warmup_iters
    end = s.min_lr * peak / base if base else 0.0
    if decay_iters <= warmup:  # nanoGPT: warmup, then min_lr
        return optax.join_schedules([optax.linear_schedule(peak / (warmup + 1), peak, warmup),
                                     optax.constant_schedule(end)], [warmup])
    # optax's linear warmup from peak/(w+1) equals nanoGPT's peak*(t+1)/(w+1) exactly.
    return optax.warmup_cosine_decay_schedule(
        init_value=peak / (warmup + 1), peak_value=peak, warmup_steps=warmup,
        decay_steps=decay_iters, end_value=end)


# ------------------------------------------------------------------ parts of the stacks


def clipping(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping at `grad_clip` (identity for 0), the first link of a stack."""
    clip = config.optimizer.grad_clip
    return optax.clip_by_global_norm(clip) if clip > 0 else optax.identity()


def decay_mask(params: optax.Params) -> optax.Params:
    """nanoGPT's decay mask: True on leaves with >= 2 axes (matrices, embeddings), but
    never on LayerNorm scales and biases (stacked `(n_layer, D)` by `--scan_layers`)."""
    def decays(path, p):
        return p.ndim >= 2 and optax_snoo.labels.path_to_str(path).rsplit("/", 1)[-1] not in (
            "scale", "bias")
    return jax.tree_util.tree_map_with_path(decays, params)


def adamw_group(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW at `learning_rate` on the schedule, decay on `decay_mask` leaves only."""
    a = config.adamw
    return optax.adamw(learning_rate_schedule(config), b1=a.b1, b2=a.b2, eps=a.eps,
                       weight_decay=a.weight_decay, mask=decay_mask)


def snoo_replica_axis(config: TrainConfig) -> str | None:
    """Snoo's `replica_axis`: the `diloco` mesh axis with `--mesh_diloco` > 1, else None."""
    return REPLICA_AXIS if config.mesh.diloco > 1 else None


def with_snoo(config: TrainConfig, inner: optax.GradientTransformation
              ) -> optax.GradientTransformationExtraArgs:
    """`inner` wrapped in Snoo (`snoo_learning_rate`, `snoo_momentum`, `snoo_k`; with
    `--mesh_diloco` > 1 averaging the pseudo-gradient over the replicas)."""
    s = config.snoo
    return optax_snoo.snoo(inner, learning_rate=s.learning_rate, momentum=s.momentum, k=s.k,
                           replica_axis=snoo_replica_axis(config))


def rounding(config: TrainConfig) -> optax.GradientTransformation | None:
    """`--rounding`: the transform that puts low-precision params on rounded values."""
    name = config.optimizer.rounding
    return None if name == "none" else optax_snoo.rounding.by_name(name, key=config.run.seed)


# ------------------------------------------------------------------ the registered stacks


@register("adamw")
def adamw(config: TrainConfig) -> TrainOptimizer:
    """nanoGPT's AdamW: decay on >= 2-D params only, warmup + cosine by default."""
    return TrainOptimizer(optax.chain(clipping(config), adamw_group(config)),
                          learning_rate_schedule(config))


@register("snoo_adamw")
def snoo_adamw(config: TrainConfig) -> TrainOptimizer:
    """`adamw` wrapped in Snoo (`snoo_learning_rate`, `snoo_momentum`, `snoo_k`)."""
    return TrainOptimizer(optax.chain(clipping(config), with_snoo(config, adamw_group(config))),
                          learning_rate_schedule(config), sync_period=config.snoo.k)


def _muon_stack(config: TrainConfig, snoo_k: int | None, *, normuon: bool = False,
                params: Any = None,
                precondition: optax.GradientTransformation | None = None) -> TrainOptimizer:
    """`optax_snoo.muon` (Muon on hidden matrices, one Adam group without decay on the
    rest, at `learning_rate`), wrapped in Snoo when `snoo_k` is set; `precondition`
    (Newton-Muon's) rewrites the clipped gradients before both groups see them."""
    m, a = config.muon, config.adamw
    beta = m.beta if m.beta_warmup == 0 else muon_momentum_warmup(
        min(0.85, m.beta), m.beta, m.beta_warmup)
    lr = learning_rate_schedule(config, m.learning_rate)
    plan = None if params is None else optax_snoo.NewtonSchulzPlan.from_params(params)
    inner = optax_snoo.muon(
        lr, beta=beta, weight_decay=m.weight_decay, smoothing=m.smoothing,
        beta2=m.beta2 if normuon else None,
        cautious_weight_decay=normuon if m.cautious is None else m.cautious,
        newton_schulz_plan=plan, adam_learning_rate=learning_rate_schedule(config),
        adam_b1=a.b1, adam_b2=a.b2, adam_eps=a.eps,
        # Over DiLoCo replicas (a vmap over `diloco`) the partitioner splits the iteration.
        shard_newton_schulz=config.mesh.diloco == 1)
    stack = inner if snoo_k is None else with_snoo(config, inner)
    before = () if precondition is None else (precondition,)
    return TrainOptimizer(
        optax.chain(clipping(config), *before, stack), lr, sync_period=snoo_k,
        for_params=lambda p: _muon_stack(config, snoo_k, normuon=normuon, params=p,
                                         precondition=precondition))


@register("muon")
def muon(config: TrainConfig) -> TrainOptimizer:
    """Muon on hidden matrices (`muon_learning_rate`, momentum warmed up from 0.85 to
    `muon_beta` over `muon_beta_warmup` steps); Adam without decay (`learning_rate`) on
    embeddings, head, norms and biases. Logs Muon's lr."""
    return _muon_stack(config, None)


@register("snoo_muon")
def snoo_muon(config: TrainConfig) -> TrainOptimizer:
    """The modded-nanogpt record's stack adapted (`optax_snoo.recipes.snoo_muon`'s): Snoo
    around Muon (hidden matrices) and Adam (embeddings, head, norms); use
    `--schedule=stable_cooldown` for the record's lr. Logs Muon's lr."""
    return _muon_stack(config, config.snoo.k)


@register("normuon")
def normuon(config: TrainConfig) -> TrainOptimizer:
    """NorMuon (Li et al. 2025) on hidden matrices: `muon` with the per-neuron
    second-moment normalisation after orthogonalisation (`muon_beta2`) and cautious
    weight decay (`cautious_weight_decay`, on by default here), as modded-nanogpt's
    current record runs it; Adam on the rest. Logs NorMuon's lr."""
    return _muon_stack(config, None, normuon=True)


@register("snoo_normuon")
def snoo_normuon(config: TrainConfig) -> TrainOptimizer:
    """modded-nanogpt's current stack adapted: Snoo around NorMuon (cautious decay) and
    Adam. Logs NorMuon's lr."""
    return _muon_stack(config, config.snoo.k, normuon=True)


#: The Adam groups of modded-nanogpt's Track-3 baseline, by path (first match wins): the
#: LM head's kernel, the token (and any position) embedding, then every other non-Muon leaf
#: (biases, norm gains: the file's `p.ndim < 2`, also when `--scan_layers` stacks them).
TRACK3_ADAM_RULES = ((r"(^|/)lm_head/kernel$", "head"), (r"(^|/)(wte|wpe)(/|$)", "embed"),
                     (r".*", "vector"))


def track3_labels(params: Any) -> Any:
    """`"muon"` on the hidden matrices (`optax_snoo.labels.muon_adam_labels`), else the
    Adam group of `TRACK3_ADAM_RULES`: `"head"`, `"embed"` or `"vector"`."""
    adam = optax_snoo.labels.label_by_rules(TRACK3_ADAM_RULES)(params)
    return jax.tree.map(lambda base, group: base if base == "muon" else group,
                        optax_snoo.labels.muon_adam_labels(params), adam)


def _track3_stack(config: TrainConfig) -> optax.GradientTransformation:
    """modded-nanogpt Track 3's baseline (#36, train_gpt_simple.py), from the config.

    Muon on the hidden matrices: EMA-form Nesterov momentum `muon_beta` (0.95; warmed up
    from 0.85 over `muon_beta_warmup` steps, which the presets set to 0 as the file has
    no warm-up), 12 Newton-Schulz steps of (2, -1.5, 0.5) in bf16 (`"track3"`), the shape
    scale `sqrt(max(1, fan_out/fan_in))`, decoupled decay `muon_weight_decay` (0.05) at
    `muon_learning_rate` (0.025). AdamW (bias-corrected, decoupled decay `weight_decay`
    0.001 on every group, `b1`, `b2`, `eps`) at `learning_rate` on the embedding (0.7),
    `head_learning_rate` on the LM head's kernel (0.004), `vector_learning_rate` on biases
    and gains (0.015). Every group on `--schedule` (stable_cooldown 0.7 to 0).
    """
    m, a = config.muon, config.adamw
    lr = lambda peak: learning_rate_schedule(config, peak)
    beta = m.beta if m.beta_warmup == 0 else muon_momentum_warmup(  # the presets: constant
        min(0.85, m.beta), m.beta, m.beta_warmup)
    adamw = lambda peak: optax.adamw(lr(peak), b1=a.b1, b2=a.b2, eps=a.eps,
                                     weight_decay=a.weight_decay)
    muon = optax.chain(
        optax_snoo.scale_by_muon(beta, coefficients=((2.0, -1.5, 0.5),) * 12,
                                 ns_dtype=jnp.bfloat16, nesterov=True, shape_scale="modded",
                                 shard_newton_schulz=config.mesh.diloco == 1),
        optax_snoo.add_decoupled_weight_decay(m.weight_decay),
        optax.scale_by_learning_rate(lr(m.learning_rate)))
    head = a.learning_rate if a.head_learning_rate is None else a.head_learning_rate
    vector = a.learning_rate if a.vector_learning_rate is None else a.vector_learning_rate
    return optax_snoo.labels.partition(
        {"muon": muon, "embed": adamw(a.learning_rate), "head": adamw(head),
         "vector": adamw(vector)}, track3_labels)


def _track3(config: TrainConfig, snoo_k: int | None) -> TrainOptimizer:
    stack = _track3_stack(config)
    if snoo_k is not None:
        stack = with_snoo(config, stack)
    return TrainOptimizer(optax.chain(clipping(config), stack),
                          learning_rate_schedule(config, config.muon.learning_rate),
                          sync_period=snoo_k)


@register("track3_baseline")
def track3_baseline(config: TrainConfig) -> TrainOptimizer:
    """modded-nanogpt Track 3's tuned Muon + AdamW baseline (#36, `_track3_stack`); the
    `track3` presets set its values. Logs Muon's lr."""
    return _track3(config, None)


@register("snoo_track3_baseline")
def snoo_track3_baseline(config: TrainConfig) -> TrainOptimizer:
    """`track3_baseline` wrapped in Snoo (`snoo_learning_rate`, `snoo_momentum`,
    `snoo_k`). Logs Muon's lr."""
    return _track3(config, config.snoo.k)


def _track3_recipe(config: TrainConfig, name: str, params: Any = None) -> TrainOptimizer:
    """A Track 3 recipe of `optax_snoo.recipes` over `max_iters` steps (its step constants
    and schedules scaled to the run), after `grad_clip`; logs its Muon lr."""
    steps = max(config.run.max_iters, 4)
    plan = None if params is None else optax_snoo.NewtonSchulzPlan.from_params(params)
    placement = dict(newton_schulz_plan=plan, shard_newton_schulz=config.mesh.diloco == 1)
    if name == "track3_record":
        tx = recipes.track3_record(steps, **placement)
        lr = power_cool(0.0375, c=recipes.TRACK3_POWER_COOL_C["muon"]
                        * (recipes.TRACK3_RECORD_STEPS / steps) ** 1.2, t_end=steps)
    elif name == "track3_soap_muon":
        tx = recipes.track3_soap_muon(steps, **placement)
        lr = power_cool(0.0375, c=recipes.TRACK3_POWER_COOL_C["muon"]
                        * (recipes.TRACK3_RECORD_STEPS / steps) ** 1.2, t_end=steps)
    elif name == "muonh":
        tx, lr = recipes.muonh(steps, **placement), stable_cooldown_schedule(0.018, steps, 1.0)
    else:  # muloco_normuonh: Snoo's sync after every 30th update
        tx = recipes.muloco_normuonh(steps, **placement)
        return TrainOptimizer(
            optax.chain(clipping(config), tx), stable_cooldown_schedule(0.018, steps, 1.0),
            sync_period=30, sync_phase="end",
            for_params=lambda p: _track3_recipe(config, name, p))
    return TrainOptimizer(optax.chain(clipping(config), tx), lr,
                          for_params=lambda p: _track3_recipe(config, name, p))


@register("track3_record")
def track3_record_optimizer(config: TrainConfig) -> TrainOptimizer:
    """modded-nanogpt Track 3's record #46 stack (`optax_snoo.recipes.track3_record`:
    SOAP-Muon with the radius steps, PowerCool, five Adam groups, EMA-Nesterov, tail-EMA
    readout), its step constants scaled to `max_iters`; evaluated and checkpointed at
    `optax_snoo.eval_params`. Only `grad_clip` is read besides. Logs Muon's lr."""
    return _track3_recipe(config, "track3_record")


@register("track3_soap_muon")
def track3_soap_muon_optimizer(config: TrainConfig) -> TrainOptimizer:
    """SOAP-Muon as Track 3 record #44 runs it, alone (`optax_snoo.recipes.
    track3_soap_muon`), over `max_iters`. Logs Muon's lr."""
    return _track3_recipe(config, "track3_soap_muon")


def _on_the_hyperball(config: TrainConfig) -> None:
    """The hyperball keeps each hidden matrix at its initial norm: a zero one never moves."""
    if config.model.init == "track3":
        raise ValueError(
            f"--optimizer={config.optimizer.name} keeps every hidden matrix on its initial "
            "sphere, and --init=track3 starts every proj at zero (it would never move): use "
            "--init=hyperball (Track 3 #5/#8/#13's init) or --init=nanogpt")


@register("muonh")
def muonh_optimizer(config: TrainConfig) -> TrainOptimizer:
    """MuonH, Muon on the hyperball (Track 3 record #5, `optax_snoo.recipes.muonh`), over
    `max_iters`; needs non-zero initial hidden matrices (`--init=hyperball`, the record's;
    `init='track3'` is refused). Logs the hyperball's lr."""
    _on_the_hyperball(config)
    return _track3_recipe(config, "muonh")


@register("muloco_normuonh")
def muloco_normuonh_optimizer(config: TrainConfig) -> TrainOptimizer:
    """MuLoCo's outer Nesterov (0.7, 0.5, after every 30th update) around NorMuonH (Track 3
    record #13, `optax_snoo.recipes.muloco_normuonh`), over `max_iters`; needs non-zero
    initial hidden matrices (`--init=hyperball`, the record's). Logs the hyperball's lr."""
    _on_the_hyperball(config)
    return _track3_recipe(config, "muloco_normuonh")


def _skew_adam(config: TrainConfig, rounding_tx: optax.GradientTransformation | None = None
               ) -> optax.GradientTransformation:
    s, a = config.skew_adam, config.adamw
    return optax_snoo.skew_adam(
        learning_rate_schedule(config, s.learning_rate), b1=a.b1, b2=a.b2, eps=a.eps,
        weight_decay=s.weight_decay, policies=s.policies,
        clip_threshold=s.clip if s.clip > 0 else None, rounding=rounding_tx)


@register("skew_adam")
def skew_adam(config: TrainConfig) -> TrainOptimizer:
    """SkewAdam: roles from param paths (`experts`, `router`, else backbone), momentum for
    the backbone only, factored second moments, no decay on the router;
    `skew_learning_rate` on the trainer's schedule, `b1`/`b2`/`eps` shared with AdamW
    (eps is SkewAdam's clamp on the squared statistics), `skew_policies` picks the paper's
    ablations. `--rounding` goes inside SkewAdam, so it rounds `p + u` from the float32
    update rather than from an update already cast to bf16."""
    return TrainOptimizer(optax.chain(clipping(config), _skew_adam(config, rounding(config))),
                          learning_rate_schedule(config, config.skew_adam.learning_rate),
                          rounds_itself=True)


@register("snoo_skew_adam")
def snoo_skew_adam(config: TrainConfig) -> TrainOptimizer:
    """`skew_adam` wrapped in Snoo (`snoo_learning_rate`, `snoo_momentum`, `snoo_k`)."""
    return TrainOptimizer(optax.chain(clipping(config), with_snoo(config, _skew_adam(config))),
                          learning_rate_schedule(config, config.skew_adam.learning_rate),
                          sync_period=config.snoo.k)


@register("adafactor")
def adafactor(config: TrainConfig) -> TrainOptimizer:
    """optax's Adafactor as SkewAdam's baseline: factored second moment (dims >= 128), no
    momentum, its own beta2 schedule (decay 0.8), update clipping 1.0, absolute steps
    (no parameter scaling) at `skew_learning_rate` and decoupled decay `skew_weight_decay`
    (optax adds its `weight_decay_rate` after the lr, so it gets `skew_weight_decay ·
    lr(t)`)."""
    lr = learning_rate_schedule(config, config.skew_adam.learning_rate)
    wd = config.skew_adam.weight_decay
    return TrainOptimizer(optax.chain(clipping(config), optax.adafactor(
        lr, multiply_by_parameter_scale=False, weight_decay_rate=lambda t: wd * lr(t))), lr)


def qk_clip(config: TrainConfig) -> optax.GradientTransformationExtraArgs | None:
    """`--qk_clip_tau`: QK-clip of the GPT's query and key heads (`c_q`, `c_k` kernels and
    biases of every block), or `None` when 0."""
    tau, model = config.optimizer.qk_clip_tau, config.model
    if tau == 0:
        return None
    return optax_snoo.scale_by_qk_clip(tau, optax_snoo.qk_clip_heads(model.n_head,
                                                                     model.kv_heads))


def build_optimizer(config: TrainConfig, params: Any = None) -> TrainOptimizer:
    """Build `config.optimizer.name` from `OPTIMIZERS`, told where `params` live if given.

    `params` (the params, abstract params or their shardings) lets an optimizer whose
    update depends on placement plan for it (`TrainOptimizer.for_params`: Muon splits
    Newton-Schulz over the devices by whole matrices); the state it initialises is the
    same either way.

    With `qk_clip_tau` > 0 the stack is followed by QK-clip (`qk_clip`), which then sees
    the whole update, Snoo's outer step included. With `rounding` other than "none", the
    stack (and clip) is followed by that rounding transform (seeded with `seed`), so bf16
    params land on stochastically (or dithered-) rounded values of the clipped weights;
    float32 params pass through it unchanged. Stacks that round themselves place it
    inside; QK-clip after them leaves the clipped heads' bf16 weights rounded to nearest.

    Raises:
      ValueError: for an unknown name, listing the registry; for bad optimizer values;
        `qk_clip_tau` with an optimizer that computes its own gradients (K-FAC).
    """
    name = config.optimizer.name
    spec = get_builder(name)(config)
    replicas = config.mesh.diloco
    if replicas > 1 and (spec.sync_period is None or spec.grad_fn is not None):
        raise ValueError(f"--mesh_diloco={replicas}: DiLoCo needs an optimizer wrapped in Snoo "
                         f"(snoo_adamw, snoo_muon, snoo_normuon, snoo_skew_adam); got "
                         f"--optimizer={name}")
    if params is not None and spec.for_params is not None and replicas == 1:
        spec = spec.for_params(params)
    tx, clip_tx, rounding_tx = spec.tx, qk_clip(config), rounding(config)
    if clip_tx is not None:
        if spec.grad_fn is not None:
            raise ValueError(f"qk_clip_tau={config.optimizer.qk_clip_tau}: not supported with "
                             f"--optimizer={name}, whose own gradient function does not "
                             "measure attention logits; use --qk_clip_tau=0")
        tx = optax.chain(tx, clip_tx)
        spec = dataclasses.replace(spec, max_logits=True)
    if rounding_tx is not None and not spec.rounds_itself:
        tx = optax.chain(tx, rounding_tx)
    tx = optax.with_extra_args_support(tx)
    if replicas > 1:  # every replica its own state; Snoo's syncs average across them
        return dataclasses.replace(spec, replica_tx=tx, tx=optax_snoo.over_replicas(
            tx, REPLICA_AXIS, spmd_axis_name=REPLICA_AXIS))
    return dataclasses.replace(spec, tx=tx, replica_tx=tx)

