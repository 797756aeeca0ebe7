"""The trainer's glue of the optimizers that need more than the gradient: K-FAC and
Newton-Muon (the recipes ``kfac``, ``snoo_kfac``, ``newton_muon``, ``track3_newton_muon``
of `optax_snoo.recipes`).

Their `TrainOptimizer` hooks (`register_hooks`, by the keyword argument the recipe's
``update`` needs) carry everything the plain gradient does not, so `train.step` and
`train.loop` know nothing of them:

- `grad_fn`: the gradient and the batch Kronecker factors (K-FAC's ``curvature=``) or the
  inputs' covariances (Newton-Muon's ``input_covariance=``, on refresh steps only) from
  one backward pass (`models.value_grad_and_stats`, called in `grad_and_stats_fn` only);
- `prepare`: K-FAC's warm start (``kfac_warm_start`` batches estimate the factors before
  step 0, `optax_snoo.kfac.warm_start`);
- `observe` + `monitor`: every step the K-FAC state's latest refresh event stays on the
  device; on logging steps `train.metrics.RefreshLog` fetches the kept events in one
  transfer and writes one row to `refresh_events.jsonl` per new refresh, in the rows of
  `optax_snoo.kfac.refresh_events`; at the end `refresh_events.png` draws the refreshes
  over the learning-rate curve (`train.metrics.plot_refresh_events`).

Hidden Dense kernels and their biases go to K-FAC; embeddings, the head, norms, routers
and expert stacks (3-D) to AdamW (`optax_snoo.recipes.kfac_label_rules`).

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
from optax_snoo import kfac as kfac_lib
from optax_snoo import recipes
from train.metrics import RefreshLog, plot_refresh_events
from train.optimizers import build_optimizer, register_hooks
from train.sharding import BATCH_AXES, batch_sharding, replicated
from train.state import TrainState
from train.step import compiler_options, cross_entropy

if TYPE_CHECKING:
    from train.config import TrainConfig

__all__ = [
    "CurvatureFn",
    "grad_and_curvature_fn",
    "grad_and_stats_fn",
    "kfac_curvature_fn",
    "kfac_refresh_policy",
    "kfac_schedule",
    "make_curvature_estimate",
    "newton_muon_layers",
    "warm_start_state",
]


def kfac_refresh_policy(config: TrainConfig) -> kfac_lib.RefreshPolicy:
    """The K-FAC recipe's refresh policy for `config` (``kfac_refresh`` and its options)."""
    return recipes.kfac_refresh_policy(config.optimizer.table)


def kfac_schedule(config: TrainConfig) -> optax.Schedule:
    """The learning rate of the K-FAC group (logged as `lr`; LR-aware policies read it)."""
    return build_optimizer(config).learning_rate


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
    labels = optax_snoo.labels.label_by_rules(recipes.kfac_label_rules(experts))(params)
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


@register_hooks("curvature")
def kfac_hooks(config: TrainConfig) -> dict[str, Any]:
    """The `TrainOptimizer` hooks of the K-FAC recipes (``kfac_stats_stride``,
    ``kfac_experts``, ``kfac_stats_every``, ``kfac_warm_start`` of the recipe's table)."""
    table = config.optimizer.table
    stride, experts = table.kfac_stats_stride, table.kfac_experts

    def grad_fn(model, params):
        return grad_and_curvature_fn(model, kfac_curvature_fn(params, stride, experts),
                                      table.kfac_stats_every)

    def prepare(state, *, model, mesh, shardings, batch, start):
        """Warm-start batches are the train windows of steps `max_iters, max_iters + 1,
        ...` (never used by the run's own steps), one micro-batch of `batch_size` each."""
        if start > 0 or table.kfac_warm_start == 0:
            return state
        estimate = make_curvature_estimate(
            model, mesh=mesh, params_shardings=shardings.params,
            curvature_fn=kfac_curvature_fn(state.params, stride, experts))
        batches = [batch(config.run.max_iters + i, grad_accum=1)
                   for i in range(table.kfac_warm_start)]
        return warm_start_state(state, estimate, batches, shardings)

    def monitor(out, start):
        if jax.process_index() != 0:  # in a multi-process run, process 0 writes the log
            return RefreshLog(os.devnull, start=start)
        plot = lambda rows: plot_refresh_events(rows, kfac_schedule(config),
                                                config.run.max_iters,
                                                Path(out) / "refresh_events.png")
        return RefreshLog(Path(out) / "refresh_events.jsonl", start=start, plot=plot)

    return dict(grad_fn=grad_fn, prepare=prepare, observe=_observe, monitor=monitor)


# ------------------------------------------------------------------------------ Newton-Muon


def _muon_mask(tree: Any) -> Any:
    return jax.tree.map(lambda label: label == "muon", optax_snoo.labels.muon_adam_labels(tree))


def newton_muon_layers(params: optax.Params) -> tuple[str, ...]:
    """The Muon group's kernels whose statistics Newton-Muon reads: one per shared input
    (`c_q` for q/k/v, `c_fc` for a SwiGLU's gate), MoE expert stacks excluded."""
    shared = recipes.NEWTON_MUON_SHARED_INPUTS
    followers = {name for group in shared for name in group[1:]}
    paths = [optax_snoo.labels.path_to_str(p) for p, is_muon in
             jax.tree_util.tree_flatten_with_path(_muon_mask(params))[0] if is_muon]
    return tuple(sorted(p for p in paths if p.endswith("/kernel")
                        and not followers & set(p.split("/"))))


@register_hooks("input_covariance")
def newton_muon_hooks(config: TrainConfig) -> dict[str, Any]:
    """The step's gradient function of the Newton-Muon recipes: each shared input's
    statistics on refresh steps (every ``newton_refresh_every``)."""
    every = config.optimizer.table.newton_refresh_every

    def grad_fn(model, params):
        layers = newton_muon_layers(params)
        covariances = lambda stats, step: {"input_covariance": optax_snoo.
                                           input_covariance_from_stats(stats, layers=layers)}
        return grad_and_stats_fn(model, layers, covariances,
                                 lambda step: optax_snoo.input_covariance_refresh_due(step, every))

    return dict(grad_fn=grad_fn)
