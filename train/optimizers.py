"""The trainer's optimizers: ``--optimizer NAME`` is the recipe ``NAME`` of `optax_snoo.recipes`.

`build_optimizer` builds the recipe's `optax_snoo.recipes.Stack` for the run (its
hyperparameters from ``config.optimizer``, its length ``max_iters``, placed on the mesh)
and wraps it in a `TrainOptimizer`: the transformation after global-norm clipping (and
QK-clip, rounding), plus what the train step and loop need to know of it (the learning
rate to log, Snoo's sync period and phase, whether it rounds the params itself, and the
hooks of optimizers that need more than the gradient: K-FAC's curvature and Newton-Muon's
input covariances, in `train.kfac_trainer`, registered with `register_hooks`). The step and
the loop read only that object, so they hold no optimizer-specific code; the recipe is the
one home of every optimizer's formula, defaults and schedule.

Example:
  >>> from train.config import TrainConfig, override
  >>> spec = build_optimizer(override(TrainConfig(), optimizer="snoo_adamw", snoo_k=4))
  >>> spec.sync_period, spec.update_kwargs(0), spec.update_kwargs(1)
  (4, {'snoo_sync': True}, {'snoo_sync': False})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optax

import optax_snoo
from optax_snoo import recipes, snoo_is_sync_step
from train.sharding import REPLICA_AXIS

if TYPE_CHECKING:
    from train.config import TrainConfig

__all__ = [
    "HYPERBALL_RECIPES",
    "OPTIMIZERS",
    "Monitor",
    "TrainOptimizer",
    "build_optimizer",
    "check_optimizer",
    "register_hooks",
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
      learning_rate: the schedule of the main group's applied lr, logged as `lr` (the
        recipe's `Stack.learning_rate`: Muon's for the Muon stacks).
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
      readout: the weights to evaluate and save are `optax_snoo.eval_params(params,
        state)` (the recipe's `Stack.readout`).
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
    readout: bool = False
    replica_tx: optax.GradientTransformation | None = None

    @property
    def takes_curvature(self) -> bool:
        """Whether `tx.update` takes per-batch arguments besides the gradient (`grad_fn`)."""
        return self.grad_fn is not None

    def update_kwargs(self, step: int) -> dict[str, Any]:
        """Static keyword arguments of `tx.update` at update number `step` (host side).

        With Snoo, `{"snoo_sync": snoo_is_sync_step(step, k, phase)}`: a skipped step
        keeps its slot in the period (`optax_snoo.skip_update`), so the hint is a
        function of the step alone.
        """
        if self.sync_period is None:
            return {}
        return {"snoo_sync": snoo_is_sync_step(step, self.sync_period, self.sync_phase)}


#: Every ``--optimizer`` name: the recipes of `optax_snoo.recipes.REGISTRY`.
OPTIMIZERS: dict[str, recipes.Recipe] = recipes.REGISTRY
#: `stack.update_args` name -> `hooks(config) -> dict` of `TrainOptimizer` fields (a
#: gradient function that also returns those arguments, a warm start, a monitor).
HOOKS: dict[str, Callable[[TrainConfig], dict[str, Any]]] = {}
#: The recipes that keep every hidden matrix on its initial sphere.
HYPERBALL_RECIPES = ("muonh", "muloco_normuonh", "adamh")


def register_hooks(update_arg: str) -> Callable:
    """Decorator: the trainer hooks of the recipes whose ``update`` takes ``update_arg``."""

    def add(hooks: Callable[[TrainConfig], dict[str, Any]]) -> Callable:
        if update_arg in HOOKS:
            raise ValueError(f"hooks for {update_arg!r} are already registered")
        HOOKS[update_arg] = hooks
        return hooks

    return add


def clipping(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping at `grad_clip` (identity for 0), the first link of a stack."""
    clip = config.optimizer.grad_clip
    return optax.clip_by_global_norm(clip) if clip > 0 else optax.identity()


def rounding(config: TrainConfig) -> optax.GradientTransformation | None:
    """`--rounding`: the transform that puts low-precision params on rounded values."""
    name = config.optimizer.rounding
    return None if name == "none" else optax_snoo.rounding.by_name(name, key=config.run.seed)


def qk_clip(config: TrainConfig) -> optax.GradientTransformationExtraArgs | None:
    """`--qk_clip_tau`: QK-clip of the GPT's query and key heads (`c_q`, `c_k` kernels and
    biases of every block), or `None` when 0."""
    tau, model = config.optimizer.qk_clip_tau, config.model
    if tau == 0:
        return None
    return optax_snoo.scale_by_qk_clip(tau, optax_snoo.qk_clip_heads(model.n_head,
                                                                     model.kv_heads))


def _placement(config: TrainConfig, recipe: recipes.Recipe, params: Any) -> dict[str, Any]:
    """The recipe's options a trainer sets: where the matrices live, the mesh axes, the
    model's shared inputs."""
    from train.sharding import BATCH_AXES

    replicas, model = config.mesh.diloco, config.model
    placed = params is not None and replicas == 1
    options: dict[str, Any] = {
        # Over DiLoCo replicas (a vmap over `diloco`) the partitioner splits the iteration.
        "shard_newton_schulz": replicas == 1,
        "newton_schulz_plan": (optax_snoo.NewtonSchulzPlan.from_params(params)
                               if placed else None),
        "replica_axis": REPLICA_AXIS if replicas > 1 else None,
        "shardings": params if placed else None,
        "stats_axes": BATCH_AXES,
        # Newton-Muon's factors of at most n_embd: the MLP's wider input in blocks (#15).
        "block_size": model.n_embd if model.hidden % model.n_embd == 0 else None,
        "shared_inputs": recipes.NEWTON_MUON_SHARED_INPUTS,
        # Circuit-Muon's heads (#41): the attention's.
        "num_heads": model.n_head,
    }
    return {k: v for k, v in options.items() if k in recipe.options}


def check_optimizer(config: TrainConfig) -> None:
    """What a recipe cannot do in this run, refused in one line."""
    name, steps, recipe = config.optimizer.name, config.run.max_iters, config.optimizer.recipe
    if steps < recipe.min_steps:
        why = (f"its step constants are fractions of the record's {recipe.defaults.RECORD_STEPS}"
               if recipe.defaults.RECORD_STEPS else "a schedule needs a step")
        plural = "" if recipe.min_steps == 1 else "s"
        raise ValueError(f"--max_iters={steps}: --optimizer={name} needs at least "
                         f"{recipe.min_steps} step{plural} ({why})")
    recipe.check_steps(steps, config.optimizer.table)
    if name in HYPERBALL_RECIPES and config.model.init == "track3":
        raise ValueError(
            f"--optimizer={name} keeps every hidden matrix on its initial sphere, and "
            "--init=track3 starts every proj at zero (it would never move): use "
            "--init=hyperball (Track 3 #5/#8/#13's init) or --init=nanogpt")


def build_optimizer(config: TrainConfig, params: Any = None) -> TrainOptimizer:
    """Build the recipe `config.optimizer.name` for `max_iters` steps.

    `params` (the params, abstract params or their shardings) tells an optimizer whose
    update depends on placement where they live (Muon splits Newton-Schulz over the
    devices by whole matrices; K-FAC preconditions split kernels in place); the state it
    initialises is the same either way (not with DiLoCo replicas, whose Newton-Schulz
    runs inside each replica's vmapped update).

    With `qk_clip_tau` > 0 the stack is followed by QK-clip (`qk_clip`), which then sees
    the whole update, Snoo's outer step included. With `rounding` other than "none", the
    stack (and clip) is followed by that rounding transform (seeded with `seed`), so bf16
    params land on stochastically (or dithered-) rounded values of the clipped weights;
    float32 params pass through it unchanged. A plain SkewAdam places it inside; QK-clip
    after it leaves the clipped heads' bf16 weights rounded to nearest.

    Raises:
      ValueError: a run shorter than the recipe's minimum; DiLoCo replicas without Snoo;
        the hyperball with zero-initialised matrices; `qk_clip_tau` with an optimizer
        that computes its own gradients (K-FAC).
    """
    name, recipe = config.optimizer.name, config.optimizer.recipe
    check_optimizer(config)
    options = _placement(config, recipe, params)
    rounding_tx = rounding(config)
    inside = "rounding" in recipe.options and "replica_axis" not in recipe.options
    if inside:
        options["rounding"] = rounding_tx
    stack = recipe.stack(config.run.max_iters, **config.optimizer.hyperparameters, **options)
    hooks: dict[str, Any] = {}
    for arg in stack.update_args:
        hooks.update(HOOKS[arg](config))
    spec = TrainOptimizer(optax.chain(clipping(config), stack.tx), stack.learning_rate,
                          sync_period=stack.sync_every, sync_phase=stack.sync_phase,
                          rounds_itself=inside, readout=stack.readout, **hooks)
    replicas = config.mesh.diloco
    if replicas > 1 and (spec.sync_period is None or spec.grad_fn is not None):
        snoos = sorted(n for n, r in recipes.REGISTRY.items() if "replica_axis" in r.options)
        raise ValueError(f"--mesh_diloco={replicas}: DiLoCo needs an optimizer wrapped in Snoo "
                         f"({', '.join(snoos)}); got --optimizer={name}")
    tx, clip_tx = spec.tx, qk_clip(config)
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
