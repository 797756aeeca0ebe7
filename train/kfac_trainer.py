"""K-FAC in the trainer: the `kfac`, `snoo_kfac` and `newton_muon` builders and their glue.

Hidden Dense kernels and their biases go to K-FAC; embeddings, the head, norms, routers
and expert stacks (3-D) to AdamW (`KFAC_RULES`). The builders return a `TrainOptimizer`
whose hooks carry everything else, so `train.step` and `train.loop` know nothing of
K-FAC:

- `grad_fn`: the gradient and the batch Kronecker factors from one backward pass
  (`models.value_grad_and_stats`, called in `grad_and_curvature_fn` only), handed to
  `tx.update` as `curvature=`;
- `prepare`: the warm start (`kfac_warm_start` batches estimate the factors before step
  0, `optax_snoo.kfac.warm_start`);
- `observe` + `monitor`: every step the K-FAC state's latest refresh event stays on the
  device; on logging steps `train.metrics.RefreshLog` fetches the kept events in one
  transfer and writes one row to `refresh_events.jsonl` per new refresh, in the rows of
  `optax_snoo.kfac.refresh_events`; at the end `refresh_events.png` draws the refreshes
  over the learning-rate curve (`train.metrics.plot_refresh_events`).

Example:
  >>> from train.config import TrainConfig, override
  >>> from train.optimizers import build_optimizer
  >>> spec = build_optimizer(override(TrainConfig(), optimizer="kfac"))
  >>> spec.takes_curvature, spec.sync_period
  (True, None)

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
  Curvature", https://arxiv.org/abs/1503.05671, 2015.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import models
import optax_snoo
import optax_snoo.labels
import optax_snoo.recipes
from optax_snoo import kfac as kfac_lib
from optax_snoo.recipes import stable_cooldown_schedule
from train.metrics import RefreshLog, plot_refresh_events
from train.optimizers import (
    TrainOptimizer,
    _muon_stack,
    adamw_group,
    clipping,
    decay_mask,
    learning_rate_schedule,
    register,
    with_snoo,
)
from train.sharding import BATCH_AXES, batch_sharding, replicated
from train.state import TrainState
from train.step import compiler_options, cross_entropy

if TYPE_CHECKING:
    from train.config import TrainConfig

__all__ = [
    "KFAC_RULES",
    "NEWTON_MUON_SHARED",
    "CurvatureFn",
    "grad_and_curvature_fn",
    "grad_and_stats_fn",
    "kfac_curvature_fn",
    "kfac_refresh_policy",
    "kfac_schedule",
    "make_curvature_estimate",
    "newton_muon_layers",
    "newton_muon_precondition",
    "warm_start_state",
]


def kfac_rules(experts: bool = False) -> tuple:
    """Label rules of the K-FAC group; `experts`: the MoE expert stacks go to K-FAC too
    (per-expert factors), else to AdamW."""
    to_adamw = "wte|wpe|lm_head|router" + ("" if experts else "|experts")
    return ((rf"(^|/)({to_adamw})(/|$)", "adamw"),
            (r"(^|/)(ln\w*|\w*norm\w*)(/|$)", "adamw"),
            (r"(^|/)(kernel|bias)$", "kfac"),
            *(((r"(^|/)experts/w_\w+$", "kfac"),) if experts else ()),
            (r".*", "adamw"))


KFAC_RULES: tuple = kfac_rules()


def kfac_refresh_policy(config: TrainConfig) -> kfac_lib.RefreshPolicy:
    """The refresh policy of `kfac_refresh`.

    - `every`: `every(kfac_interval, first=kfac_first)`;
    - `by_lr_phase`: `kfac_phases` (warmup, peak, decay, tail), peak at `kfac_learning_rate`;
    - `lr_ratio`: `lr_ratio(kfac_tau, max_interval=kfac_interval, min_interval=
      kfac_min_interval)`, skipping the warmup when `kfac_skip_warmup`.
    """
    k, warmup = config.kfac, config.schedule.warmup_iters
    if k.refresh == "every":
        return kfac_lib.every(k.interval, first=k.first)
    if k.refresh == "lr_ratio":
        return kfac_lib.lr_ratio(k.tau, max_interval=k.interval, min_interval=k.min_interval,
                                 warmup_steps=warmup if k.skip_warmup else 0)
    values = [v.strip().lower() for v in k.phases.split(",")]
    if len(values) != len(kfac_lib.PHASES):
        raise ValueError(f"kfac_phases={k.phases!r}: expected {len(kfac_lib.PHASES)}"
                         f" comma-separated intervals for {', '.join(kfac_lib.PHASES)}")
    parse = lambda v: None if v == "none" else v if v == "once" else int(v) if v.isdigit() else v
    intervals = dict(zip(kfac_lib.PHASES, map(parse, values), strict=True))
    peak = config.adamw.learning_rate if k.learning_rate is None else k.learning_rate
    return kfac_lib.by_lr_phase(peak, warmup_steps=warmup, intervals=intervals)


def kfac_schedule(config: TrainConfig) -> optax.Schedule:
    """The learning rate of the K-FAC group (logged as `lr`; LR-aware policies read it)."""
    return learning_rate_schedule(config, config.kfac.learning_rate)


def _kfac_group(config: TrainConfig, params: Any = None) -> optax.GradientTransformation:
    """The K-FAC and AdamW groups; `params` (arrays, abstract arrays or their shardings):
    where the kernels live, so the jitted update preconditions them there."""
    k, a = config.kfac, config.adamw
    hidden = kfac_lib.kfac(
        kfac_schedule(config), damping=k.damping, momentum=k.momentum,
        weight_decay=a.weight_decay, mask=decay_mask, ema_decay=k.ema_decay,
        refresh=kfac_refresh_policy(config), mode=k.mode,
        graft=None if k.graft == "none" else k.graft, b2=a.b2, eps=a.eps,
        layers=_kfac_layers, shardings=params, stats_every=k.stats_every,
        stats_axes=BATCH_AXES)
    return optax_snoo.labels.partition(
        {"kfac": hidden, "adamw": adamw_group(config)},
        optax_snoo.labels.label_by_rules(kfac_rules(k.experts)))


def _kfac_layers(params: optax.Params) -> dict:
    """The K-FAC group's kernels (every matrix it sees but the biases), experts included."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]
    paths = [optax_snoo.labels.path_to_str(p) for p, leaf in leaves
             if not isinstance(leaf, optax.MaskedNode) and leaf.ndim >= 2
             and not optax_snoo.labels.path_to_str(p).endswith("/bias")]  # (L, d): scanned
    return kfac_lib.layers_from_params(params, paths)


class CurvatureFn(NamedTuple):
    """The K-FAC group's batch factors (`kfac_curvature_fn`): which kernels to capture and
    how their captured statistics become the `curvature=` argument of `kfac`."""

    layers: tuple[str, ...]  # for `optax_snoo.kfac.value_grad_and_stats(layers=...)`
    from_stats: Callable[[dict, jax.Array], dict]  # `(stats, step) -> curvature`


def kfac_curvature_fn(params: optax.Params, stride: int = 1, experts: bool = False
                      ) -> CurvatureFn:
    """The K-FAC group's kernels of `params` (see `kfac_rules`) and `(stats, step) ->
    curvature` for them.

    `stats` is the dict of `optax_snoo.kfac.value_grad_and_stats` (kernel path ->
    `LayerStats`); the curvature maps each K-FAC kernel path to its factors
    (`optax_snoo.kfac.curvature_from_stats`: bias coordinate when the layer has a bias,
    per-expert factors for expert stacks), the `curvature=` argument of `kfac`. With
    `stride > 1` the dense factors come from every `stride`-th token (offset `step %
    stride`: all tokens over `stride` steps), dividing their cost by `stride`; `g = M·dy`
    keeps `M` the number of tokens of the loss. Under a mesh the dense factors are
    reduce-scattered over the batch axes (`BATCH_AXES`), rows split as `kfac`'s
    `stats_axes` keeps their EMAs.
    """
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"kfac_stats_stride={stride!r}: expected an int >= 1")
    labels = optax_snoo.labels.label_by_rules(kfac_rules(experts))(params)
    layers = tuple(sorted(
        optax_snoo.labels.path_to_str(p) for p, label in
        jax.tree_util.tree_flatten_with_path(labels)[0]
        if label == "kfac" and not optax_snoo.labels.path_to_str(p).endswith("/bias")))

    def from_stats(stats: dict, step: jax.Array) -> dict:
        missing = sorted(set(layers) - set(stats))
        if missing:
            raise ValueError(f"the model captured no K-FAC statistics for {missing}")
        # A dense layer's N, or a scanned one's (each layer of the stack sees all tokens).
        num_tokens = next(s.inputs.shape[-2] for s in stats.values()
                          if s.inputs.ndim == 2 + s.scanned)
        return kfac_lib.curvature_from_stats(
            {path: stats[path] for path in layers}, num_tokens=num_tokens,
            token_stride=stride, token_offset=jnp.asarray(step, jnp.int32) % stride,
            scatter_axes=BATCH_AXES)

    return CurvatureFn(layers, from_stats)


def grad_and_stats_fn(model: Any, layers: Sequence[str], update_args: Callable[[dict, Any], dict],
                      stats_step: Callable[[Any], Any] | None = None):
    """`(params, inputs_BT, targets_BT, key, step) -> ((loss, (ce, aux)), (grads,
    update_args(stats, step)))`: the gradient and the extra arguments of `tx.update` from
    the statistics of `layers` in the same backward pass
    (`optax_snoo.kfac.value_grad_and_stats`, which reads the layers from the loss's jaxpr:
    the one capture call of the trainer). With `stats_step`, they are computed (under
    `lax.cond`) only on the steps where `stats_step(step)` holds; zeros on the others."""

    def grad_fn(params, inputs_BT, targets_BT, key, step):
        def loss_fn(params):
            logits_BTV, aux_loss, _ = models.forward(model.merge(params), inputs_BT,
                                                     dropout_key=key)
            ce = cross_entropy(logits_BTV, targets_BT)
            return ce + aux_loss, (ce, aux_loss)

        out, grads, stats = kfac_lib.value_grad_and_stats(
            loss_fn, params, has_aux=True, layers=layers)
        if stats_step is None:
            return out, (grads, update_args(stats, step))
        compute = lambda s: update_args(s, step)
        zeros = lambda s: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                       jax.eval_shape(compute, s))
        return out, (grads, jax.lax.cond(stats_step(step), compute, zeros, stats))

    return grad_fn


def grad_and_curvature_fn(model: Any, curvature_fn: CurvatureFn, stats_every: int = 1):
    """`grad_and_stats_fn` for K-FAC: `{"curvature": curvature_fn.from_stats(stats, step //
    stats_every)}`. With `stats_every > 1` the factors are computed only on steps that are
    multiples of it, the statistics steps of `kfac(stats_every=...)` (the train step is
    the K-FAC update count); zeros, which the transform ignores, on the others."""
    return grad_and_stats_fn(
        model, curvature_fn.layers,
        lambda stats, step: {"curvature": curvature_fn.from_stats(stats, step // stats_every)},
        None if stats_every == 1 else lambda step: step % stats_every == 0)


def make_curvature_estimate(model: Any, *, mesh: Any, params_shardings: Any,
                            curvature_fn: CurvatureFn
                            ) -> Callable[[Any, jax.Array, jax.Array, int], Any]:
    """`estimate(params, inputs_ABT, targets_ABT, index) -> curvature`: the batch factors
    averaged over the `A` micro-batches (no update, no dropout; `index` plays the step for
    `curvature_fn`), one batch of a K-FAC warm start (`optax_snoo.kfac.warm_start`)."""
    grad_fn = grad_and_curvature_fn(model, curvature_fn)

    def estimate(params, inputs_ABT, targets_ABT, index):
        A = inputs_ABT.shape[0]
        curvatures = []
        for a in range(A):
            _, (_, update_args) = grad_fn(params, inputs_ABT[a], targets_ABT[a], None, index)
            curvatures.append(update_args["curvature"])
        return jax.tree.map(lambda *c: sum(c) / A, *curvatures)

    data = batch_sharding(mesh)
    return jax.jit(estimate, in_shardings=(params_shardings, data, data, replicated(mesh)),
                   out_shardings=replicated(mesh), compiler_options=compiler_options(mesh))


def warm_start_state(state: TrainState, estimate: Callable[[Any, Any, Any, Any], Any],
                     batches: Sequence[tuple[Any, Any]], shardings: Any) -> TrainState:
    """`state` with its K-FAC factors seeded from `batches` (`optax_snoo.kfac.warm_start`).

    Args:
      state: the train state (step 0).
      estimate: `estimate(params, inputs_ABT, targets_ABT, index) -> curvature` (from
        `make_curvature_estimate`).
      batches: `(inputs_ABT, targets_ABT)` pairs already placed on the mesh.
      shardings: the train state's shardings (the result is put back on them).
    """
    curvatures = [estimate(state.params, x, y, jnp.int32(i))
                  for i, (x, y) in enumerate(batches)]
    opt_state = kfac_lib.warm_start(state.opt_state, curvatures)
    return jax.device_put(state._replace(opt_state=opt_state), shardings)


def _observe(opt_state: Any) -> Any:
    """`opt_state` cut down to its K-FAC states' scalars (the refresh event and counts),
    a pytree `optax_snoo.kfac.refresh_events` reads; every other leaf becomes `None`."""
    is_state = lambda x: isinstance(x, kfac_lib.ScaleByKfacState)
    return jax.tree.map(lambda x: x._replace(factors={}, inverses={}) if is_state(x) else None,
                        opt_state, is_leaf=is_state)


def _hooks(config: TrainConfig) -> dict[str, Any]:
    """The `TrainOptimizer` hooks of the K-FAC stacks."""
    stride, experts = config.kfac.stats_stride, config.kfac.experts

    def grad_fn(model, params):
        return grad_and_curvature_fn(model, kfac_curvature_fn(params, stride, experts),
                                      config.kfac.stats_every)

    def prepare(state, *, model, mesh, shardings, batch, start):
        """Warm-start batches are the train windows of steps `max_iters, max_iters + 1,
        ...` (never used by the run's own steps), one micro-batch of `batch_size` each."""
        if start > 0 or config.kfac.warm_start == 0:
            return state
        estimate = make_curvature_estimate(
            model, mesh=mesh, params_shardings=shardings.params,
            curvature_fn=kfac_curvature_fn(state.params, stride, experts))
        batches = [batch(config.run.max_iters + i, grad_accum=1)
                   for i in range(config.kfac.warm_start)]
        return warm_start_state(state, estimate, batches, shardings)

    def monitor(out, start):
        if jax.process_index() != 0:  # in a multi-process run, process 0 writes the log
            return RefreshLog(os.devnull, start=start)
        plot = lambda rows: plot_refresh_events(rows, kfac_schedule(config),
                                                config.run.max_iters,
                                                Path(out) / "refresh_events.png")
        return RefreshLog(Path(out) / "refresh_events.jsonl", start=start, plot=plot)

    return dict(grad_fn=grad_fn, prepare=prepare, observe=_observe, monitor=monitor)


def _kfac_stack(config: TrainConfig, snoo: bool, params: Any = None) -> TrainOptimizer:
    group = _kfac_group(config, params)
    return TrainOptimizer(
        optax.chain(clipping(config), with_snoo(config, group) if snoo else group),
        kfac_schedule(config), sync_period=config.snoo.k if snoo else None,
        for_params=lambda p: _kfac_stack(config, snoo, p), **_hooks(config))


@register("kfac")
def kfac(config: TrainConfig) -> TrainOptimizer:
    """K-FAC on hidden Dense kernels and biases, grafted to Adam's norm by default
    (`kfac_*` options), AdamW on embeddings, head and norms. Logs the K-FAC group's lr."""
    return _kfac_stack(config, snoo=False)


@register("snoo_kfac")
def snoo_kfac(config: TrainConfig) -> TrainOptimizer:
    """`kfac` wrapped in Snoo (`snoo_learning_rate`, `snoo_momentum`, `snoo_k`)."""
    return _kfac_stack(config, snoo=True)


# ------------------------------------------------------------------------------ Newton-Muon
#: Modules of our GPT that read one input: their kernels share one Newton-Muon factor.
NEWTON_MUON_SHARED = (("c_q", "c_k", "c_v"), ("c_fc", "c_gate"))


def _muon_mask(tree: Any) -> Any:
    return jax.tree.map(lambda label: label == "muon", optax_snoo.labels.muon_adam_labels(tree))


def newton_muon_layers(params: optax.Params) -> tuple[str, ...]:
    """The Muon group's kernels whose statistics Newton-Muon reads: one per shared input
    (`c_q` for q/k/v, `c_fc` for a SwiGLU's gate), MoE expert stacks excluded."""
    followers = {name for group in NEWTON_MUON_SHARED for name in group[1:]}
    paths = [optax_snoo.labels.path_to_str(p) for p, is_muon in
             jax.tree_util.tree_flatten_with_path(_muon_mask(params))[0] if is_muon]
    return tuple(sorted(p for p in paths if p.endswith("/kernel")
                        and not followers & set(p.split("/"))))


def newton_muon_precondition(config: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """`optax_snoo.precondition_by_input_covariance` on the Muon group's kernels: refresh
    every `newton_muon_interval` steps, EMA `newton_muon_ema_decay` per refresh, damping
    `newton_muon_damping` x the mean eigenvalue, factors of at most `n_embd` (the MLP's
    wider input in blocks, as record #15), one factor per shared input."""
    m, model = config.muon, config.model
    block = model.n_embd if model.hidden % model.n_embd == 0 else None
    return optax.masked(optax_snoo.precondition_by_input_covariance(
        m.newton_ema_decay, m.newton_damping, refresh_every=m.newton_interval,
        block_size=block, shared_inputs=NEWTON_MUON_SHARED), _muon_mask)


def _newton_muon_grad_fn(config: TrainConfig) -> Callable[[Any, Any], Callable[..., Any]]:
    """The step's gradient function with each shared input's statistics on refresh steps."""
    every = config.muon.newton_interval

    def grad_fn(model, params):
        layers = newton_muon_layers(params)
        covariances = lambda stats, step: {"input_covariance": optax_snoo.
                                           input_covariance_from_stats(stats, layers=layers)}
        return grad_and_stats_fn(model, layers, covariances,
                                 lambda step: optax_snoo.input_covariance_refresh_due(step, every))

    return grad_fn


def _newton_muon_stack(config: TrainConfig, params: Any = None) -> TrainOptimizer:
    spec = _muon_stack(config, None, params=params, precondition=newton_muon_precondition(config))
    return dataclasses.replace(spec, grad_fn=_newton_muon_grad_fn(config),
                               for_params=lambda p: _newton_muon_stack(config, p))


def _track3_newton_muon(config: TrainConfig, params: Any = None) -> TrainOptimizer:
    m, model = config.muon, config.model
    steps = max(config.run.max_iters, 1)
    plan = None if params is None else optax_snoo.NewtonSchulzPlan.from_params(params)
    tx = optax_snoo.recipes.track3_newton_muon(
        steps, ema_decay=m.newton_ema_decay, damping=m.newton_damping,
        refresh_every=m.newton_interval,
        block_size=model.n_embd if model.hidden % model.n_embd == 0 else None,
        shared_inputs=NEWTON_MUON_SHARED, newton_schulz_plan=plan,
        shard_newton_schulz=config.mesh.diloco == 1)
    mlp_lr = optax_snoo.recipes.TRACK3_NEWTON_MUON_GROUPS[-1][1]
    return TrainOptimizer(optax.chain(clipping(config), tx),
                          stable_cooldown_schedule(mlp_lr, steps),
                          grad_fn=_newton_muon_grad_fn(config),
                          for_params=lambda p: _track3_newton_muon(config, p))


@register("newton_muon")
def newton_muon(config: TrainConfig) -> TrainOptimizer:
    """Newton-Muon (modded-nanogpt Track 3 record #15): `muon` on gradients first
    multiplied, on their input side, by the inverse input covariance of their layer
    (`newton_muon_*` options; statistics captured in the step on refresh steps only)."""
    return _newton_muon_stack(config)


@register("track3_newton_muon")
def track3_newton_muon(config: TrainConfig) -> TrainOptimizer:
    """Newton-Muon with Track 3 record #15's groups and rates (`optax_snoo.recipes.
    track3_newton_muon`: four Muon groups, aux AdamW, the 0.7 cooldown over `max_iters`);
    the preconditioner's `newton_muon_*` options as `newton_muon`'s (their defaults are
    #15's). Logs the MLP groups' lr."""
    return _track3_newton_muon(config)
