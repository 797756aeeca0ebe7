"""The train state and the jitted train and eval steps.

The state is a pure pytree, `{"params", "opt_state", "step", "rng"}`: the GPT's
parameters (a nested dict from `nnx.split`), the optax state, the number of updates done
and the base PRNG key data. The step merges the parameters into the model inside
`jax.jit` (explicit in/out shardings, donated state), accumulates gradients over the
micro-batches with `lax.scan`, and applies the optimizer (whose chain starts with
global-norm clipping). With Snoo, `snoo_sync` is a static argument: the trainer compiles
a sync and a no-sync variant and picks one on the host.

Example:
  >>> model, state = create_train_state(gpt_config, tx, seed=0, mesh=mesh)  # doctest: +SKIP
  >>> train_step = make_train_step(model, tx, mesh=mesh, state_shardings=...)  # doctest: +SKIP
  >>> state, metrics = train_step(state, x_ABT, y_ABT)  # doctest: +SKIP

References:
  Karpathy, "nanoGPT" (train.py), https://github.com/karpathy/nanoGPT, 2023.
  Flax, "examples/gemma" (NNX split/merge under jax.jit), https://github.com/google/flax, 2025.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import models
from train.nonfinite import counters, update_if_finite
from train.sharding import batch_sharding, replicated, tree_shardings

__all__ = [
    "ModelDef",
    "create_train_state",
    "make_eval_step",
    "make_train_step",
]

TrainState = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """What rebuilds the model from its params: the NNX graph and the non-Param state."""

    graphdef: Any
    rest: Any
    config: models.GPTConfig

    def merge(self, params: Any) -> models.GPT:
        """The model with `params` (a pure dict) in place."""
        return nnx.merge(self.graphdef, params, self.rest)


def create_train_state(gpt_config: models.GPTConfig, tx: optax.GradientTransformation, *,
                       seed: int, mesh: Mesh) -> tuple[ModelDef, TrainState]:
    """Initialise the model (sharded by its logical names) and the optimizer state.

    The optimizer state is created eagerly from the sharded params, so leaves that mirror
    a parameter inherit its sharding; everything else is replicated on `mesh`.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(models.logical_rules()):
        model = models.GPT(gpt_config, rngs=nnx.Rngs(seed))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0),
                 "rng": jax.random.key_data(jax.random.key(seed)), **counters()}
    state = jax.device_put(state, tree_shardings(state, mesh))
    return ModelDef(graphdef, rest, gpt_config), state


def _cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def make_train_step(model: ModelDef, tx: optax.GradientTransformationExtraArgs, *, mesh: Mesh,
                    state_shardings: Any, lr_schedule: Callable[[jax.Array], jax.Array],
                    snoo: bool = False, max_bad_steps: int | None = 10,
                    curvature_fn: Callable[[dict, jax.Array], Any] | None = None,
                    ) -> Callable[..., tuple[TrainState, dict]]:
    """Build `train_step(state, inputs_ABT, targets_ABT, snoo_sync=None)` (jitted).

    Args:
      model: from `create_train_state`.
      tx: the optimizer (its chain clips first).
      mesh: the device mesh.
      state_shardings: shardings of the train state (in and out; the state is donated).
      lr_schedule: logged as `lr` (the schedule's value at this update).
      snoo: the optimizer is Snoo-wrapped; `snoo_sync` (static, positional) is then passed
        on to it (`True`/`False` on the host's fast path, `None` to decide in the step).
      max_bad_steps: a step with a non-finite loss or gradient leaves the state unchanged
        but for its counters (`train.nonfinite`); after this many in a row, all are
        skipped. `None` applies every update unchecked.
      curvature_fn: for optimizers that take K-FAC statistics (`curvature=`): the
        gradient then comes with the batch factors `curvature_fn(stats, step)` (stats from
        `models.value_grad_and_stats`, in the same backward pass; with accumulation both
        are averaged over the micro-batches), and the metrics also hold `kfac_event`, the
        K-FAC state's latest `KfacRefreshEvent` after this update (small scalars the
        trainer reads on its logging steps). `None` (default): plain gradients.

    Returns:
      The jitted step, returning `(state, metrics)` with float32 scalars `loss` (mean
      cross-entropy over all micro-batches), `aux_loss` (MoE, already scaled; it is added
      to the differentiated loss), `grad_norm` (before clipping) and `lr`, plus
      `skipped`, `bad_steps` and `skipped_steps` unless `max_bad_steps` is `None`.
    """

    if curvature_fn is None:
        def loss_fn(params, inputs_BT, targets_BT, key):
            logits_BTV, aux_loss, _ = models.forward(model.merge(params), inputs_BT,
                                                     dropout_key=key)
            ce = _cross_entropy(logits_BTV, targets_BT)
            return ce + aux_loss, (ce, aux_loss)

        value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

        def grad_fn(params, inputs_BT, targets_BT, key, step):
            out, grads = value_and_grad(params, inputs_BT, targets_BT, key)
            return out, (grads, None)
    else:
        grad_fn = _grad_and_curvature_fn(model, curvature_fn)
    use_dropout = model.config.dropout > 0

    def train_step(state, inputs_ABT, targets_ABT, snoo_sync=None):
        params, A = state["params"], inputs_ABT.shape[0]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        keys_A = jax.random.split(key, A if use_dropout else 1)
        key_of = lambda a: keys_A[a] if use_dropout else None

        if A == 1:
            (_, (ce, aux_loss)), (grads, curvature) = grad_fn(
                params, inputs_ABT[0], targets_ABT[0], key_of(0), state["step"])
        else:
            def micro_step(total, batch):
                inputs_BT, targets_BT, a = batch
                (_, (ce, aux_loss)), grads_and_curvature = grad_fn(
                    params, inputs_BT, targets_BT, key_of(a), state["step"])
                return jax.tree.map(jnp.add, total, grads_and_curvature), (ce, aux_loss)

            shapes = jax.eval_shape(grad_fn, params, inputs_ABT[0], targets_ABT[0], key_of(0),
                                    state["step"])[1]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
            (grads, curvature), (ce_A, aux_A) = jax.lax.scan(
                micro_step, zeros, (inputs_ABT, targets_ABT, jnp.arange(A)))
            grads = jax.tree.map(lambda g, p: (g / A).astype(p.dtype), grads, params)
            curvature = jax.tree.map(lambda c: c / A, curvature)
            ce, aux_loss = ce_A.mean(), aux_A.mean()
        extra = {"snoo_sync": snoo_sync} if snoo else {}
        if curvature_fn is not None:
            extra["curvature"] = curvature

        def update(state):
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"], **extra)
            return {**state, "params": optax.apply_updates(state["params"], updates),
                    "opt_state": opt_state, "step": state["step"] + 1}

        metrics = {"loss": ce, "aux_loss": aux_loss, "grad_norm": optax.tree.norm(grads),
                   "lr": jnp.asarray(lr_schedule(state["step"]), jnp.float32)}
        if max_bad_steps is None:
            new_state = update(state)
        else:
            new_state, flags = update_if_finite(state, update, ce + aux_loss,
                                                metrics["grad_norm"], max_bad_steps=max_bad_steps)
            metrics.update(flags)
        if curvature_fn is not None:
            metrics["kfac_event"] = _refresh_event(new_state["opt_state"])
        return new_state, metrics

    data = batch_sharding(mesh)
    return jax.jit(train_step, in_shardings=(state_shardings, data, data),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=0,
                   static_argnums=3)


def make_eval_step(model: ModelDef, *, mesh: Mesh,
                   params_shardings: Any) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """Build `eval_step(params, inputs_NBT, targets_NBT) -> mean cross-entropy` (no dropout).

    The `N` batches run in one `lax.scan`, so an evaluation is one call and one transfer.
    """

    def eval_step(params, inputs_NBT, targets_NBT):
        def one(total, batch):  # merge inside the scan: NNX modules are trace-level bound
            logits_BTV, _, _ = models.forward(model.merge(params), batch[0])
            return total + _cross_entropy(logits_BTV, batch[1]), None

        total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (inputs_NBT, targets_NBT))
        return total / inputs_NBT.shape[0]

    data = batch_sharding(mesh)
    return jax.jit(eval_step, in_shardings=(params_shardings, data, data),
                   out_shardings=replicated(mesh))


def _refresh_event(opt_state: Any) -> Any:
    """The `KfacRefreshEvent` of the (first) K-FAC transform in `opt_state`."""
    from optax_snoo.kfac import ScaleByKfacState

    is_state = lambda x: isinstance(x, ScaleByKfacState)
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]
    if not states:
        raise ValueError("the optimizer takes curvature= but has no K-FAC state")
    return states[0].event


def _grad_and_curvature_fn(model: ModelDef, curvature_fn: Callable[[dict, jax.Array], Any]):
    """`(params, inputs_BT, targets_BT, key, step) -> ((loss, (ce, aux)), (grads, curvature))`:
    the gradient and the K-FAC batch factors `curvature_fn(stats, step)` from one backward
    pass (`models.value_grad_and_stats`), over the whole (global) batch."""

    def loss_fn(logits_BTV, aux_loss, targets_BT):
        ce = _cross_entropy(logits_BTV, targets_BT)
        return ce + aux_loss, (ce, aux_loss)

    def grad_fn(params, inputs_BT, targets_BT, key, step):
        out, grads, stats = models.value_grad_and_stats(
            loss_fn, model.merge(params), inputs_BT, targets_BT, dropout_key=key,
            has_aux=True)
        return out, (nnx.to_pure_dict(grads), curvature_fn(stats, step))

    return grad_fn


def make_curvature_estimate(model: ModelDef, *, mesh: Mesh, params_shardings: Any,
                            curvature_fn: Callable[[dict, jax.Array], Any]
                            ) -> Callable[[Any, jax.Array, jax.Array, int], Any]:
    """`estimate(params, inputs_ABT, targets_ABT, index) -> curvature`: the batch factors
    averaged over the `A` micro-batches (no update, no dropout; `index` plays the step for
    `curvature_fn`), one batch of a K-FAC warm start (`optax_snoo.kfac.warm_start`)."""
    grad_fn = _grad_and_curvature_fn(model, curvature_fn)

    def estimate(params, inputs_ABT, targets_ABT, index):
        A = inputs_ABT.shape[0]
        total = [grad_fn(params, inputs_ABT[a], targets_ABT[a], None, index)[1][1]
                 for a in range(A)]
        return jax.tree.map(lambda *c: sum(c) / A, *total)

    data = batch_sharding(mesh)
    return jax.jit(estimate, in_shardings=(params_shardings, data, data, replicated(mesh)),
                   out_shardings=replicated(mesh))
