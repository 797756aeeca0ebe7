"""The train state and the jitted train and eval steps.

The state is a `train.state.TrainState`, a typed pytree: the GPT's parameters (a
nested dict from `nnx.split`), the optax state, the number of updates done, the base
PRNG key data and the non-finite step counters. The step merges the parameters into the model inside
`jax.jit` (explicit in/out shardings, donated state), accumulates gradients over the
micro-batches with `lax.scan`, and applies the optimizer (whose chain starts with
global-norm clipping). Everything optimizer-specific comes from the `TrainOptimizer`
(`train.optimizers`): static hints such as Snoo's `snoo_sync` (the trainer compiles a
sync and a no-sync variant and picks one on the host), and for K-FAC the gradient
function that also returns the curvature.

Example:
  >>> spec = build_optimizer(config)  # doctest: +SKIP
  >>> model, state = create_train_state(gpt_config, spec.tx, seed=0, mesh=mesh)  # doctest: +SKIP
  >>> train_step = make_train_step(model, spec, mesh=mesh, state_shardings=...)  # doctest: +SKIP
  >>> state, metrics = train_step(state, x_ABT, y_ABT, **spec.update_kwargs(0))  # doctest: +SKIP

References:
  Karpathy, "nanoGPT" (train.py), https://github.com/karpathy/nanoGPT, 2023.
  Flax, "examples/gemma" (NNX split/merge under jax.jit), https://github.com/google/flax, 2025.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
import optax_snoo
from train.nonfinite import update_if_finite
from train.sharding import REPLICA_AXIS, batch_sharding, replica_axis, replicated, tree_shardings
from train.state import TrainState

if TYPE_CHECKING:
    from train.optimizers import TrainOptimizer

__all__ = [
    "CPU_COMPILER_OPTIONS",
    "ModelDef",
    "TrainState",
    "TrainStep",
    "compiler_options",
    "create_train_state",
    "cross_entropy",
    "make_eval_step",
    "make_readout",
    "make_train_step",
    "param_shardings",
]

# XLA:CPU's memory-optimized instruction schedule, not its default concurrency-optimized
# one: the nanoGPT CPU recipe's step runs 1.35x faster (benchmarks/README.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    """XLA options for the trainer's jitted programs on `mesh`'s platform (None: defaults).

    An option also given in the ``XLA_FLAGS`` environment variable is left to it.
    """
    if mesh.devices.flat[0].platform != "cpu":
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in CPU_COMPILER_OPTIONS.items() if f"--{k}=" not in flags}
    return options or None


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
    a parameter inherit its sharding; everything else is replicated on `mesh`. On a mesh
    with M > 1 DiLoCo replicas (`--mesh_diloco`), `tx` is one replica's optimizer
    (`TrainOptimizer.replica_tx`): the params and every optimizer-state leaf but the
    integer scalars (step counts, kept once as `optax_snoo.over_replicas` does) are
    stacked M times on a leading axis over `diloco`, every replica starting the same.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(models.logical_rules()):
        model = models.GPT(gpt_config, rngs=nnx.Rngs(seed))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        trained = {"params": params, "opt_state": tx.init(params)}
        if replica_axis(mesh) > 1:
            trained = _stack_replicas(trained, mesh)
        state = TrainState.start(trained["params"], trained["opt_state"], seed=seed)
    state = jax.device_put(state, tree_shardings(state, mesh))
    return ModelDef(graphdef, rest, gpt_config), state


def param_shardings(gpt_config: models.GPTConfig, mesh: Mesh) -> Any:
    """The shardings `create_train_state` gives the params on `mesh` (one replica's),
    from an abstract init: nothing is allocated, so the optimizer can be built, told
    where its params live, before the state it initialises."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(models.logical_rules()):
        abstract = nnx.eval_shape(lambda: models.GPT(gpt_config, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(nnx.split(abstract, nnx.Param, ...)[1])
    spec = lambda x: getattr(getattr(x, "sharding", None), "spec", None) or P()
    return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params)


def is_step_count(x: Any) -> bool:
    """Whether a state leaf (array or abstract) is an integer scalar, a step count: kept
    once for all DiLoCo replicas (as `optax_snoo.over_replicas` keeps it), not stacked."""
    return x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer)


def _stack_replicas(tree: Any, mesh: Mesh) -> Any:
    """`tree` on every replica: each leaf but the integer scalars with a leading axis of
    size M sharded over `diloco` (the rest of its sharding kept)."""
    replicas = replica_axis(mesh)
    shardings = tree_shardings(tree, mesh)
    stacked = jax.tree.map(lambda x, s: s if is_step_count(x) else jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(REPLICA_AXIS, *s.spec)), tree, shardings)
    stack = lambda t: jax.tree.map(
        lambda x: x if is_step_count(x) else jnp.broadcast_to(x, (replicas, *jnp.shape(x))), t)
    return jax.jit(stack, out_shardings=stacked)(tree)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean token cross-entropy (float32 logits from the model)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


#: Update arguments of a `grad_fn` combined over the micro-batches by their maximum (the
#: others are averaged): a logit bound must hold on every micro-batch.
MAXED_OVER_MICRO_BATCHES = frozenset({"max_logits"})


def _plain_grad_fn(model: ModelDef, params: Any, *, max_logits: bool = False
                   ) -> Callable[..., Any]:
    """`(params, inputs_BT, targets_BT, key, step) -> ((loss, (ce, aux)), (grads, args))`:
    `args` is `{}`, or with `max_logits` `{"max_logits": {layer: (n_head,)}}` from the
    same forward pass (QK-clip's measurement)."""

    def loss_fn(params, inputs_BT, targets_BT, key):
        logits_BTV, aux_loss, layer_max_logits = models.forward(
            model.merge(params), inputs_BT, dropout_key=key, max_logits=max_logits)
        ce = cross_entropy(logits_BTV, targets_BT)
        return ce + aux_loss, (ce, aux_loss, layer_max_logits)

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(params, inputs_BT, targets_BT, key, step):
        (loss, (ce, aux_loss, layer_max_logits)), grads = value_and_grad(
            params, inputs_BT, targets_BT, key)
        update_args = {} if layer_max_logits is None else {"max_logits": layer_max_logits}
        return (loss, (ce, aux_loss)), (grads, update_args)

    return grad_fn


def _accumulate(total: dict, update_args: dict) -> dict:
    """One more micro-batch's update arguments: a max for `MAXED_OVER_MICRO_BATCHES`, else
    a sum (divided by the count at the end)."""
    return {name: jax.tree.map(jnp.maximum if name in MAXED_OVER_MICRO_BATCHES else jnp.add,
                               total[name], value) for name, value in update_args.items()}


def _wide(dtype: Any) -> jnp.dtype:
    """float32, or float64 for float64 values: what sums of `dtype` values are kept in."""
    return jnp.promote_types(jnp.float32, dtype)


def _accumulator(shapes: dict) -> dict:
    """The start of `_accumulate`: `-inf` for a maximum, 0 for a sum (float32; float64
    for float64 values)."""
    def start(name: str, shape: jax.ShapeDtypeStruct) -> jax.Array:
        fill = -jnp.inf if name in MAXED_OVER_MICRO_BATCHES else 0.0
        return jnp.full(shape.shape, fill, _wide(shape.dtype))

    return {name: jax.tree.map(functools.partial(start, name), value)
            for name, value in shapes.items()}


def _finish_accumulation(total: dict, count: int) -> dict:
    return {name: value if name in MAXED_OVER_MICRO_BATCHES else
            jax.tree.map(lambda x: x / count, value) for name, value in total.items()}


def make_train_step(model: ModelDef, optimizer: TrainOptimizer, *, mesh: Mesh,
                    state_shardings: Any, max_bad_steps: int | None = 10,
                    loss_reduction: str = "mean") -> TrainStep:
    """Build `train_step(state, inputs_ABT, targets_ABT, **hints)` (jitted).

    Args:
      model: from `create_train_state`.
      optimizer: from `train.optimizers.build_optimizer`: its `tx` (whose chain clips
        first), `learning_rate` (logged as `lr`), `grad_fn` (how the loss is
        differentiated, and what else `tx.update` takes from the backward pass) and
        `observe` (what the metrics carry from the new optimizer state, as `observed`).
      mesh: the device mesh.
      state_shardings: shardings of the train state (in and out; the state is donated).
      max_bad_steps: a step with a non-finite loss or gradient leaves the state unchanged
        but for its counters (`train.nonfinite`); after this many in a row, all are
        skipped. `None` applies every update unchecked.
      loss_reduction: `"mean"`: the gradient of the mean token cross-entropy over the
        step's batch; `"sum"`: of its sum over every token of the step (all micro-batches;
        each DiLoCo replica its own rows), modded-nanogpt Track 3's `reduction="sum"` with
        gradients summed over micro-batches and ranks: the mean's gradient times the
        step's token count (so clipping and Adam's eps see that scale). The logged
        `loss` stays the mean.

    `hints` are static keyword arguments of `tx.update`, `optimizer.update_kwargs(step)`
    on the host (Snoo's `snoo_sync`; one program is compiled per distinct value). With
    accumulation, the gradients and `grad_fn`'s update arguments are averaged over the
    micro-batches (each with its own dropout key), except those of
    `MAXED_OVER_MICRO_BATCHES` (QK-clip's `max_logits`), whose maximum is taken.

    Returns:
      The jitted step, returning `(state, metrics)` with float32 scalars `loss` (mean
      cross-entropy over all micro-batches), `aux_loss` (MoE, already scaled; it is added
      to the differentiated loss), `grad_norm` (before clipping) and `lr` (the main
      group's applied lr at this update), `skipped`, `bad_steps` and `skipped_steps`
      unless `max_bad_steps` is `None`, and `observed`; with `optimizer.max_logits`
      (QK-clip) also `max_logit`, the largest attention logit of the step (before the
      clip).
    """
    tx, lr_schedule = optimizer.tx, optimizer.learning_rate
    make_grad_fn = optimizer.grad_fn or functools.partial(_plain_grad_fn,
                                                          max_logits=optimizer.max_logits)
    use_dropout = model.config.dropout > 0
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r}: expected 'mean' or 'sum'")
    if loss_reduction == "sum" and optimizer.grad_fn is not None:
        raise ValueError("loss_reduction='sum' needs plain gradients; this optimizer computes "
                         "its own (K-FAC's curvature would not be rescaled): use 'mean'")

    replicas = replica_axis(mesh)

    def gradients(params, inputs_ABT, targets_ABT, key, step):
        """(grads, update_args, ce, aux_loss) of one replica's batch."""
        A = inputs_ABT.shape[0]
        # the mean's gradient times the tokens: that of the sum over the step's tokens
        to_sum = inputs_ABT.size if loss_reduction == "sum" else 1
        grad_fn = make_grad_fn(model, params)
        keys_A = jax.random.split(key, A if use_dropout else 1)
        key_of = lambda a: keys_A[a] if use_dropout else None

        if A == 1:
            (_, (ce, aux_loss)), (grads, update_args) = grad_fn(
                params, inputs_ABT[0], targets_ABT[0], key_of(0), step)
            if to_sum != 1:
                grads = jax.tree.map(lambda g: (g.astype(_wide(g.dtype)) * to_sum).astype(g.dtype),
                                     grads)
        else:
            def micro_step(total, batch):
                inputs_BT, targets_BT, a = batch
                (_, (ce, aux_loss)), grads_and_args = grad_fn(
                    params, inputs_BT, targets_BT, key_of(a), step)
                grads, update_args = grads_and_args
                total = (jax.tree.map(jnp.add, total[0], grads),
                         _accumulate(total[1], update_args))
                return total, (ce, aux_loss)

            grad_shapes, args_shapes = jax.eval_shape(
                grad_fn, params, inputs_ABT[0], targets_ABT[0], key_of(0), step)[1]
            zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, _wide(s.dtype)), grad_shapes),
                     _accumulator(args_shapes))
            (grads, update_args), (ce_A, aux_A) = jax.lax.scan(
                micro_step, zeros, (inputs_ABT, targets_ABT, jnp.arange(A)))
            grads = jax.tree.map(lambda g, p: (g * (to_sum / A)).astype(p.dtype), grads, params)
            update_args = _finish_accumulation(update_args, A)
            ce, aux_loss = ce_A.mean(), aux_A.mean()
        return grads, update_args, ce, aux_loss

    def train_step(state, inputs_ABT, targets_ABT, hints):
        params, step = state.params, state.step
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
        if replicas == 1:
            grads, update_args, ce, aux_loss = gradients(params, inputs_ABT, targets_ABT,
                                                         key, step)
            grad_norm = optax.tree.norm(grads)
        else:  # replica r: its params, rows [r B/M, (r+1) B/M) and dropout key
            split = lambda x: x.reshape(x.shape[0], replicas, -1, *x.shape[2:])
            keys_M = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(replicas))
            grads, update_args, ce_M, aux_M = jax.vmap(
                gradients, in_axes=(0, 1, 1, 0, None), spmd_axis_name=REPLICA_AXIS)(
                params, split(inputs_ABT), split(targets_ABT), keys_M, step)
            ce, aux_loss = ce_M.mean(), aux_M.mean()
            # The replicas' rms, each norm taken on its own devices: one scalar crosses.
            grad_norm = jnp.sqrt(jnp.mean(jax.vmap(optax.tree.norm)(grads) ** 2))
        extra = {**dict(hints), **update_args}

        def update(state: TrainState) -> TrainState:
            updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
            return state._replace(params=optax.apply_updates(state.params, updates),
                                  opt_state=opt_state, step=state.step + 1)

        metrics = {"loss": ce, "aux_loss": aux_loss, "grad_norm": grad_norm,
                   "lr": jnp.asarray(lr_schedule(state.step), jnp.float32)}
        if "max_logits" in update_args:
            metrics["max_logit"] = jnp.max(jnp.stack(
                [jnp.max(m) for m in jax.tree.leaves(update_args["max_logits"])]))
        if max_bad_steps is None:
            new_state = update(state)
        else:
            new_state, flags = update_if_finite(state, update, ce + aux_loss,
                                                metrics["grad_norm"], max_bad_steps=max_bad_steps)
            metrics.update(flags)
        metrics["observed"] = optimizer.observe(new_state.opt_state)
        return new_state, metrics

    data = batch_sharding(mesh)
    jitted = jax.jit(train_step, in_shardings=(state_shardings, data, data),
                     out_shardings=(state_shardings, replicated(mesh)), donate_argnums=0,
                     static_argnums=3, compiler_options=compiler_options(mesh))

    return TrainStep(jitted, mesh)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The jitted train step; `hints` (static keyword arguments of `tx.update`) become
    one hashable static argument, so each distinct value compiles once. It is traced
    under `jax.set_mesh(mesh)`, so transforms that split work over the mesh (K-FAC's
    refresh) see it (`set_mesh` cannot be entered inside `jit`)."""

    jitted: Any
    mesh: Mesh

    def __call__(self, state: TrainState, inputs_ABT: jax.Array, targets_ABT: jax.Array,
                 **hints: Any) -> tuple[TrainState, dict]:
        with jax.set_mesh(self.mesh):
            return self.jitted(state, inputs_ABT, targets_ABT, tuple(sorted(hints.items())))

    def lower(self, state: TrainState, inputs_ABT: jax.Array, targets_ABT: jax.Array,
              **hints: Any) -> Any:
        """`jax.jit(...).lower` of the step for these hints (cost analysis, HLO)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(state, inputs_ABT, targets_ABT,
                                     tuple(sorted(hints.items())))


def make_readout(opt_state: Any) -> Callable[[TrainState], Any]:
    """``state -> the params to evaluate``: `optax_snoo.eval_params` of the state when the
    optimizer keeps a readout in it (EMA-Nesterov's lookahead, a tail EMA, a reference
    interpolation, a tail velocity: Track 3's readouts), else the params themselves
    (decided once, from the state's structure: no work for other optimizers).
    Evaluation, sampling and `train.evaluate` use it; a checkpoint holds the optimizer
    state, so its readout is computed at restore.

    Args:
      opt_state: the optimizer state (or its abstract shapes).

    Returns:
      A function of the train state (jitted where there is a readout).
    """
    is_readout = lambda x: isinstance(x, optax_snoo.EmaNesterovState | optax_snoo.TailEmaState
                                      | optax_snoo.ReferenceInterpolationState
                                      | optax_snoo.TailVelocityState)
    if not any(is_readout(x) for x in jax.tree.leaves(opt_state, is_leaf=is_readout)):
        return lambda state: state.params
    readout = jax.jit(optax_snoo.eval_params)
    return lambda state: readout(state.params, state.opt_state)


def make_eval_step(model: ModelDef, *, mesh: Mesh,
                   params_shardings: Any) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """Build `eval_step(params, inputs_NBT, targets_NBT) -> mean cross-entropy` (no dropout).

    The `N` batches run in one `lax.scan`, so an evaluation is one call and one transfer.
    """

    def eval_step(params, inputs_NBT, targets_NBT):
        def one(total, batch):  # merge inside the scan: NNX modules are trace-level bound
            logits_BTV, _, _ = models.forward(model.merge(params), batch[0])
            return total + cross_entropy(logits_BTV, batch[1]), None

        total = jnp.zeros((), model.config.accumulation_dtype)
        total, _ = jax.lax.scan(one, total, (inputs_NBT, targets_NBT))
        return total / inputs_NBT.shape[0]

    data = batch_sharding(mesh)
    return jax.jit(eval_step, in_shardings=(params_shardings, data, data),
                   out_shardings=replicated(mesh), compiler_options=compiler_options(mesh))
