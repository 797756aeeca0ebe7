"""`scale_by_kfac`: K-FAC as an optax transformation with learning-rate-aware refresh.

The transformation receives each step's batch factors as an extra argument,
keeps their debiased moving averages (every step, or every ``stats_every``-th), recomputes
the inverses only on refresh steps (inside ``lax.cond``: no ``eigh`` on other steps) and
applies the cached inverses on every step, in three functions: `update_factors`,
`refresh_when_due` and `precondition_blocks`. Before the first refresh the cache is the
identity.

**Which parameters.** A preconditioned layer is a kernel leaf of the params tree, named by
its key path (``("l1", "kernel")``; nnx ``Variable.value`` suffixes are ignored). The
layer's bias, when its factors include the homogeneous coordinate, is the sibling leaf
named ``bias_name`` (``("l1", "bias")``): kernel and bias gradients are preconditioned
together as ``[∇W; ∇b]`` (``(d_in + 1, d_out)``). Everything else passes through
unchanged, so K-FAC composes with ``optax.partition`` (a K-FAC group and an AdamW group).

By default (``layers=None``) every 2-D leaf whose key is ``"kernel"`` is preconditioned
(a Flax ``Dense``/``nnx.Linear``), with its ``"bias"`` sibling when one of shape
``(d_out,)`` exists. Otherwise ``layers`` is a template: a pytree with a `LayerCurvature`
at the path of each kernel to precondition, whose ``a``/``g`` carry the factor shapes
(arrays or ``jax.ShapeDtypeStruct``; e.g. ``jax.eval_shape`` of the function that
computes the curvature). The factor shapes define the layer:

- ``a`` ``(*stack, d_in', d_in')`` and ``g`` ``(*stack, d_out, d_out)``; leading axes are
  a stack of independent layers (MoE experts ``(E, d_in, d_out)``);
- the kernel's axes after the stack axes (permuted first by the template's
  `LayerCurvature.kernel_axes` when it gives them: a PyTorch ``(out, in)`` kernel, a
  convolution's ``(H, W, in, out)``; the update comes back in the kernel's own layout)
  must split, in order, into axes of total size ``d_in`` then ``d_out``
  (``(d_model, heads, head_dim)`` works with ``d_out = heads·head_dim``); the kernel
  gradient is reshaped to ``(d_in, d_out)``;
- ``d_in' = d_in + 1`` means "with bias" (the ``bias_name`` sibling is required).

**Curvature extra argument.** ``update(grads, state, params, curvature=C)`` where ``C`` is
a pytree with a `LayerCurvature` (batch factors from `layer_factors`, float32) at the key
path of every preconditioned kernel (``None`` or absent elsewhere): e.g.
``{"l1": {"kernel": layer_factors(x1, dy1, True)}, "l2": {"kernel": ...}}``, or a tree
shaped like the params with ``None`` at the other leaves. Keys are split on "/", so a
flat dict keyed by path strings works too, which is what `curvature_from_stats` returns
for the statistics of `value_grad_and_stats` (``{"blocks/0/mlp/fc/kernel": ...}``, any
JAX model); ``layers=jax.eval_shape(curvature_from_stats, stats)`` then names exactly
those kernels, and `layers_from_params` builds the template from the params' shapes.
Entries for parameters of other ``optax.partition`` groups (masked here) are ignored;
entries for parameters that do not exist or are not preconditioned, missing layers and
wrong shapes raise ``ValueError`` at trace time. The argument is required: an update
without it raises ``ValueError`` (a forgotten argument would otherwise silently run
plain momentum SGD). ``curvature=None``, passed explicitly, skips the statistics for that
step (the factors and their EMA weight are left unchanged; the cached inverses still
apply).
With gradient accumulation, average the batch factors over the micro-batches and pass
them with the accumulated gradient.

**Learning rate.** Refresh policies read the learning rate of the current update: from
the ``learning_rate`` extra argument when given (the trainer's current LR), else from the
``learning_rate`` schedule given at construction, evaluated at the update count.

**Sharding.** Cached inverses are replicated, and so are the factors unless
``stats_axes`` names the mesh's batch axes: then each factor EMA keeps its rows split
over them (`factor_spec`: ``1/N`` of it per device), the layout in which
`curvature_from_stats(..., scatter_axes=...)` reduce-scatters the batch factors, so the
EMA update is elementwise where they arrive. `init` places them so on the mesh of
sharded (concrete) params, and inside ``jax.set_mesh(mesh)`` every update constrains
them to stay so (without a mesh context XLA chooses).
Gradients keep their sharding. On a refresh step with a mesh (``jax.set_mesh`` around
the update, or ``mesh=``) of ``N`` devices, the eigendecompositions are split: the
factors of all layers (and experts) are grouped by size, each group's stack is split over
all ``N`` devices, each device decomposes (and, in ``"pi"`` mode, inverts) only its
``1/N`` share, and one ``all_gather`` per group replicates the results
(`optax_snoo._src.kfac.distributed`; kfac-jax distributes its inverses likewise). Per
device that is ``1/N`` of the work plus at most one padded matrix per factor size.
On every step, each split layer's gradient is preconditioned where it lives:
the products contracting its columns run with its rows split over the ``N`` devices,
those contracting its rows with its columns split, and all-to-alls of each device's
share move it between the two layouts and back (2x the share per step in ``"pi"`` mode,
at most 4x in ``"eigen"`` mode); the partitioner alone would gather the whole gradient
on every device. This applies to 2-D kernels whose sharding splits them, as seen on the
gradients or, for updates under ``jax.jit`` on Auto mesh axes, as given by
``shardings=`` (the params or their shardings); replicated gradients (data parallelism),
expert stacks, kernels of other ranks and dimensions that do not divide by ``N`` are left
to the partitioner.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo._src.kfac.blocks import (
    Block,
    Names,
    default_specs,
    flatten_nested,
    flatten_params,
    from_layer,
    match_curvature,
    nested,
    resolve_blocks,
    template_specs,
    to_layer,
)
from optax_snoo._src.kfac.distributed import precondition_split, refresh_all, split_layouts
from optax_snoo._src.kfac.factors import LayerCurvature, factor_spec
from optax_snoo._src.kfac.grafting import graft as graft_transform
from optax_snoo._src.kfac.precondition import (
    MODES,
    EigenInverse,
    Inverse,
    PiInverse,
    apply_inverse,
    identity_inverse,
)
from optax_snoo._src.kfac.refresh import (
    RefreshPolicy,
    every,
    learning_rate_at,
    needs_learning_rate,
    policy_step,
)
from optax_snoo._src.sharding import concrete_sharding
from optax_snoo._src.utils import (
    check_non_negative,
    check_unit_interval,
    concrete_real,
    is_integer,
    is_real,
    path_names,
    value_at,
)

GRAFTS = (None, "adam", "sgd")


class KfacRefreshEvent(NamedTuple):
    """The latest refresh, kept in the state (scalars; read on host with `refresh_events`).

    Attributes:
      count: number of refreshes so far (int32); a trainer logs a row when it grows.
      step: update count of the latest refresh (int32), -1 before the first.
      learning_rate: learning rate at the latest refresh (float32).
      a_max, a_min: largest/smallest raw eigenvalue of the A factors over all layers.
      g_max, g_min: same for the G factors.
      num_clipped: eigenvalues raised to the floor in that refresh, all layers (int32).
    """

    count: jax.Array
    step: jax.Array
    learning_rate: jax.Array
    a_max: jax.Array
    a_min: jax.Array
    g_max: jax.Array
    g_min: jax.Array
    num_clipped: jax.Array


class ScaleByKfacState(NamedTuple):
    """State of `scale_by_kfac`.

    Attributes:
      count: number of updates so far (int32); policies and schedules read it.
      factor_weight: weight of the factor EMA (float32): ``w ← ρ w + 1`` per step with
        statistics; 0 means no statistics yet (no refresh can happen).
      factors: nested dict keyed by the kernel key path (strings) of `LayerCurvature`
        moving averages (float32).
      inverses: same keys, the cached `PiInverse` or `EigenInverse` (float32).
      event: the latest `KfacRefreshEvent`.
    """

    count: jax.Array
    factor_weight: jax.Array
    factors: dict
    inverses: dict
    event: KfacRefreshEvent


_MISSING: Any = object()   # `update` without the curvature= extra argument


def _initial_event() -> KfacRefreshEvent:
    # One buffer per field: a trainer donating the state must not see one buffer twice.
    zero = lambda: jnp.zeros((), jnp.float32)
    return KfacRefreshEvent(
        count=jnp.zeros((), jnp.int32), step=jnp.full((), -1, jnp.int32),
        learning_rate=zero(), a_max=zero(), a_min=zero(), g_max=zero(), g_min=zero(),
        num_clipped=jnp.zeros((), jnp.int32))


def _placed_like(x: jax.Array, leaf: Any, axes: tuple[str, ...] | None = None) -> jax.Array:
    """Place a factor-sized array on the mesh of a sharded (concrete) param: rows split
    over ``axes`` where `factor_spec` allows (the factor EMAs), else replicated."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding):
            spec = factor_spec(x.shape, sharding.mesh, axes)
            return jax.device_put(x, NamedSharding(sharding.mesh, spec))
    return x


def _keep_under_mesh(tree: Any, axes: tuple[str, ...] | None = None) -> Any:
    """Inside ``jax.set_mesh(...)``, constrain factor-sized arrays to their `factor_spec`
    over ``axes`` (replicated without axes: else XLA may shard them after the first
    update); without a mesh context, leave placement to XLA."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    put = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    return jax.tree.map(lambda x: put(x, factor_spec(x.shape, mesh, axes)), tree)


def _common_sharding(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Under Explicit mesh axes, arrays of different shardings resharded to replicated
    (``concatenate`` requires one sharding there); otherwise unchanged."""
    shardings = [getattr(jax.typeof(x), "sharding", None) for x in xs]
    explicit = [s for s in shardings if isinstance(s, NamedSharding) and any(
        t == AxisType.Explicit for t in s.mesh.axis_types)]
    if not explicit or all(getattr(s, "spec", None) == explicit[0].spec for s in shardings):
        return xs
    return tuple(jax.sharding.reshard(x, P()) for x in xs)


def kernel_shardings(shardings: Any) -> dict[Names, NamedSharding | None]:
    """Key path -> sharding of every leaf of ``shardings`` (see `scale_by_kfac`)."""
    if shardings is None:
        return {}
    pairs = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: isinstance(x, NamedSharding | optax.MaskedNode))[0]
    out = {}
    for path, leaf in pairs:
        if isinstance(leaf, NamedSharding):
            out[path_names(path)] = leaf if leaf.mesh.size > 1 else None
        elif not isinstance(leaf, optax.MaskedNode):
            out[path_names(path)] = concrete_sharding(leaf)
    return out


def update_factors(state: ScaleByKfacState, *, blocks: list[Block], entries: list,
                   curvature: Any, ema_decay: float, stats_every: int = 1,
                   stats_axes: tuple[str, ...] | None = None
                   ) -> tuple[list[LayerCurvature], jax.Array]:
    """Phase 1: the factor moving averages advanced by this step's batch factors.

    On a statistics step (update count a multiple of ``stats_every``):
    ``w ← ρᵏ w + 1``, ``F ← (1 - 1/w) F + (1/w) F_batch`` with ``k = stats_every``. Other
    steps, ``curvature=None`` and a batch with any non-finite factor (dropped whole)
    leave both unchanged. The factors keep their `factor_spec` over ``stats_axes`` (an
    elementwise update of row-split arrays: no collective when the batch factors arrive
    so, as `layer_factors` with ``scatter_axes`` gives them).

    Returns:
      ``(factors, weight)``: the blocks' factors (in ``blocks`` order) and the EMA weight.
    """
    old = flatten_nested(state.factors, LayerCurvature)
    factors = [old[b.names] for b in blocks]
    weight = state.factor_weight
    if curvature is None:
        return _keep_under_mesh(factors, stats_axes), weight
    batch = match_curvature(curvature, blocks, entries)
    # The test is on the sum of all entries (NaN and ±Inf propagate through a sum): one
    # fused reduction per factor, cheaper than an isfinite map and an all-reduce
    # (benchmarks/README.md, "K-FAC step cost"); a float32 overflow counts as non-finite.
    use = jnp.isfinite(sum(jnp.sum(x) for c in batch for x in c))
    if not (is_integer(stats_every) and stats_every == 1):  # (an array under inject_hyperparams)
        use = use & (state.count % stats_every == 0)
    new_weight = ema_decay ** stats_every * weight + 1.0
    new_frac = 1.0 / new_weight
    factors = [jax.tree.map(lambda old, new: jnp.where(
        use, (1.0 - new_frac) * old + new_frac * new, old), f, c)
        for f, c in zip(factors, batch, strict=True)]
    return _keep_under_mesh(factors, stats_axes), jnp.where(use, new_weight, weight)


def refresh_when_due(state: ScaleByKfacState, *, blocks: list[Block],
                     factors: list[LayerCurvature], weight: jax.Array, lr: jax.Array,
                     policy: RefreshPolicy, damping: jax.Array | float, mode: str,
                     floors: tuple[float, float], mesh: Any
                     ) -> tuple[list[Inverse], KfacRefreshEvent]:
    """Phase 2: the policy's decision and, under ``lax.cond``, the new inverses.

    ``eigh`` runs on refresh steps only (split over ``mesh`` when given, `refresh_all`),
    and only once statistics exist (``weight > 0``).

    Returns:
      ``(inverses, event)``: the blocks' cached inverses and the latest refresh event.
    """
    count = state.count
    do_refresh, _, _ = policy_step(policy, count, lr, state.event.step,
                                   state.event.learning_rate, allowed=weight > 0)

    def recompute(operands):
        factors, _, event = operands
        new_inverses, stats = refresh_all(factors, damping, mode, *floors, mesh)
        extreme = lambda fn, name: (fn(jnp.stack([getattr(s, name) for s in stats]))
                                    if stats else jnp.zeros((), jnp.float32))
        new_event = KfacRefreshEvent(
            count=event.count + 1, step=count, learning_rate=lr,
            a_max=extreme(jnp.max, "a_max"), a_min=extreme(jnp.min, "a_min"),
            g_max=extreme(jnp.max, "g_max"), g_min=extreme(jnp.min, "g_min"),
            num_clipped=sum((s.num_clipped for s in stats), jnp.zeros((), jnp.int32)))
        return new_inverses, new_event

    def keep(operands):
        _, inverses, event = operands
        return inverses, event

    old = flatten_nested(state.inverses, (PiInverse, EigenInverse))
    inverses, event = jax.lax.cond(
        do_refresh, recompute, keep,
        (factors, [old[b.names] for b in blocks], state.event))
    return _keep_under_mesh(inverses), event


def precondition_blocks(entries: list, blocks: list[Block], inverses: list[Inverse],
                        shardings: list[NamedSharding | None]) -> list[Any]:
    """Phase 3: every block's kernel (and bias) gradient times its cached inverse.

    A kernel with a sharding that `split_layouts` accepts is preconditioned where it
    lives (`precondition_split`); the others through `apply_inverse` as the partitioner
    places them. Other leaves pass through.

    Returns:
      The flat leaves of the update.
    """
    leaves = [leaf for _, leaf in entries]
    for b, inverse, sharding in zip(blocks, inverses, shardings, strict=True):
        kernel = leaves[b.kernel]
        grad = jnp.reshape(to_layer(kernel, b.kernel_axes),
                           (*b.stack, b.d_in, b.d_out)).astype(jnp.float32)
        layouts = None if sharding is None else split_layouts(sharding, b.d_in, b.d_out)
        if layouts is not None:
            bias = None if b.bias is None else leaves[b.bias]
            out_w, out_b = precondition_split(
                inverse, grad,
                None if bias is None else jnp.reshape(bias, (b.d_out,)).astype(jnp.float32),
                sharding, layouts)
            leaves[b.kernel] = out_w.astype(kernel.dtype)
            if bias is not None:
                leaves[b.bias] = jnp.reshape(out_b, bias.shape).astype(bias.dtype)
            continue
        if b.bias is not None:
            bias_row = jnp.reshape(leaves[b.bias], (*b.stack, 1, b.d_out))
            grad, bias_row = _common_sharding(grad, bias_row.astype(jnp.float32))
            grad = jnp.concatenate([grad, bias_row], axis=-2)
        out = apply_inverse(inverse, grad)
        leaves[b.kernel] = from_layer(out[..., :b.d_in, :], b.kernel_axes,
                                      kernel.shape).astype(kernel.dtype)
        if b.bias is not None:
            bias = leaves[b.bias]
            leaves[b.bias] = jnp.reshape(out[..., b.d_in, :], bias.shape).astype(bias.dtype)
    return leaves


# ------------------------------------------------------------------------ the transform
def scale_by_kfac(
    damping: optax.ScalarOrSchedule = 1e-3,
    *,
    ema_decay: float = 0.95,
    refresh: RefreshPolicy | int = 10,
    learning_rate: optax.ScalarOrSchedule | None = None,
    mode: str = "pi",
    eig_floor_abs: float = 1e-8,
    eig_floor_rel: float = 1e-6,
    layers: Any = None,
    bias_name: str = "bias",
    distributed_refresh: bool = True,
    mesh: Any = None,
    distributed_precondition: bool = True,
    shardings: Any = None,
    stats_every: int = 1,
    stats_axes: tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""K-FAC preconditioning direction (no learning rate, no sign).

    Every update: (1) when ``curvature`` is given, the factor EMAs advance, kfac-jax
    style: ``w ← ρ w + 1``, ``F ← (1 - 1/w) F + (1/w) F_batch`` (so the first batch is
    taken as is, and the weights always sum to one); (2) the refresh policy decides, from
    the update count and learning rate, whether to recompute the inverses — inside
    ``lax.cond``, so ``eigh`` runs on refresh steps only, and only once statistics exist;
    (3) the cached inverses precondition each layer (identity before the first refresh).
    Leaves that are not preconditioned pass through unchanged.

    Extra arguments of ``update``: ``curvature`` (required: the batch factors, see the
    module docstring for the format, or ``None`` to skip the statistics of that step)
    and ``learning_rate`` (the current LR, overriding the construction-time schedule
    for the refresh policy).

    Args:
      damping: λ >= 0, or a schedule of the update count (read at refresh time).
      ema_decay: ρ in [0, 1) of the factor EMA (kfac-jax/KAISA default 0.95).
      refresh: a refresh policy (`every`, `by_lr_phase`, `lr_ratio`, or any callable
        ``(step, lr, last_step, last_lr) -> bool``); an int ``n`` means ``every(n)``.
      learning_rate: the LR schedule (or constant) that LR-aware policies read; the
        transform does not scale by it. Not needed when the ``learning_rate`` extra
        argument is passed on every update, or for `every`.
      mode: ``"pi"`` (factored damping, cached ``Â⁻¹`` and ``Ĝ⁻¹``) or ``"eigen"``
        (exact damping ``(A⊗G + λI)⁻¹``, cached eigenbases and ``1/(s_A s_Gᵀ + λ)``).
      eig_floor_abs: absolute floor of the factor eigenvalues at refresh.
      eig_floor_rel: floor relative to each factor's largest eigenvalue.
      layers: None (every 2-D ``"kernel"`` leaf, with its ``bias`` sibling), a template
        tree of `LayerCurvature` shapes at the kernels to precondition, or a callable
        ``params -> template`` evaluated at init on the params this transform sees (e.g.
        ``lambda p: layers_from_params(p, paths)`` for expert stacks).
      bias_name: key of a kernel's bias sibling.
      distributed_refresh: split the refresh's eigendecompositions over the devices of
        the mesh (see the module docstring); False: every device runs all of them.
      mesh: the mesh to split the refresh over; default: the mesh set with
        ``jax.set_mesh`` around the update, if any (else nothing is split).
      distributed_precondition: precondition each split 2-D kernel's gradient where it
        lives (see the module docstring); False: as the partitioner chooses (it
        gathers each such gradient whole on every device).
      shardings: where the kernels live, for updates under ``jax.jit`` on Auto mesh axes
        (whose traced gradients do not carry it): the params (arrays or
        ``jax.ShapeDtypeStruct`` s with shardings) or a tree of their ``NamedSharding`` s,
        with the params' key paths. None: only what the gradients carry (concrete
        arrays, or tracers on Explicit axes).
      stats_every: ``k >= 1``: the factor EMAs advance only on updates whose count is a
        multiple of ``k`` (kfac-jax's ``curvature_update_period``), each with decay
        ``ρᵏ`` (``w ← ρᵏ w + 1``, ``F ← (1 - 1/w) F + (1/w) F_batch``), so the average
        keeps its memory in steps: a batch ``j`` steps old weighs ``ρʲ`` either way. The
        ``curvature`` of other updates is ignored (a trainer computes it only on
        statistics steps).
      stats_axes: the mesh axes that split the batch (e.g. ``("data", "fsdp")``): each
        factor EMA ``(*stack, d, d)`` keeps its rows split over them (each device holds
        ``1/N`` of it) where ``d`` divides by their devices (`factor_spec`), the layout
        in which `curvature_from_stats` with the same ``scatter_axes`` reduce-scatters
        the batch factors. None: factors replicated.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state `ScaleByKfacState`.

    Raises:
      ValueError: bad hyperparameters here; bad ``layers``/``curvature`` trees at
        init/trace time.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo.kfac import every, layer_factors, scale_by_kfac
      >>> params = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}}
      >>> tx = optax.chain(scale_by_kfac(damping=1e-2, refresh=every(1, first=0)),
      ...                  optax.scale_by_learning_rate(0.1))
      >>> state = tx.init(params)
      >>> x = jax.random.normal(jax.random.key(0), (8, 4))
      >>> dy = jax.random.normal(jax.random.key(1), (8, 3)) / 8
      >>> curvature = {"dense": {"kernel": layer_factors(x, dy, has_bias=True)}}
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params, curvature=curvature)
      >>> int(state[0].event.count)
      1

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015

      Botev and Martens, `KFAC-JAX <https://github.com/google-deepmind/kfac-jax>`_, 2022
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    check_unit_interval("ema_decay", ema_decay)
    check_non_negative("damping", damping)
    check_non_negative("eig_floor_abs", eig_floor_abs)
    check_non_negative("eig_floor_rel", eig_floor_rel)
    known_every = concrete_real(stats_every)
    if (callable(stats_every) or isinstance(stats_every, bool | float)
            or (known_every is not None
                and (known_every < 1 or known_every != int(known_every)))):
        raise ValueError(f"stats_every must be an int >= 1, got {stats_every!r}.")
    if is_integer(refresh):
        refresh = every(int(refresh))
    if not callable(refresh):
        raise ValueError(f"refresh must be a refresh policy or an int interval, got "
                         f"{refresh!r}.")
    if not isinstance(bias_name, str):
        raise ValueError(f"bias_name must be a string, got {bias_name!r}.")
    if stats_axes is not None:
        if isinstance(stats_axes, str) or not all(isinstance(a, str) for a in stats_axes):
            raise ValueError(f"stats_axes must be a tuple of mesh axis names, got "
                             f"{stats_axes!r}.")
        stats_axes = tuple(stats_axes)
    lr_schedule = learning_rate

    known_shardings = kernel_shardings(shardings)

    def refresh_mesh():
        if not distributed_refresh:
            return None
        if mesh is not None:
            return mesh
        context = jax.sharding.get_abstract_mesh()
        return None if context.empty else context

    def sharding_of(block, grad):
        """The sharding to precondition ``grad`` in (None: leave it to the partitioner)."""
        if (not distributed_precondition or block.stack or grad.ndim != 2
                or block.kernel_axes is not None):
            return None
        sharding = concrete_sharding(grad) or known_shardings.get(block.names)
        context = jax.sharding.get_abstract_mesh()
        if sharding is not None and not context.empty and (
                context.axis_names != sharding.mesh.axis_names
                or context.axis_sizes != sharding.mesh.axis_sizes):
            return None  # given for another mesh than the one this update runs on
        return sharding

    def learning_rate_now(learning_rate, count):
        if learning_rate is not None:
            return jnp.asarray(learning_rate, jnp.float32)
        if lr_schedule is not None or not needs_learning_rate(refresh):
            return learning_rate_at(lr_schedule, count)
        raise ValueError(
            f"refresh policy {refresh!r} reads the learning rate: pass learning_rate= "
            "to scale_by_kfac (the schedule) or to update (the current value).")

    def init_fn(params):
        entries, _ = flatten_params(params)
        if layers is None:
            specs = default_specs(entries, bias_name)
        else:
            template = layers(params) if callable(layers) else layers
            specs = template_specs(template, entries)
        blocks = resolve_blocks(specs, entries, bias_name)
        factors, inverses = {}, {}
        for b in blocks:
            kernel = entries[b.kernel][1]
            factors[b.names] = LayerCurvature(
                a=_placed_like(jnp.zeros(b.a_shape, jnp.float32), kernel, stats_axes),
                g=_placed_like(jnp.zeros(b.g_shape, jnp.float32), kernel, stats_axes),
                kernel_axes=b.kernel_axes)
            inverses[b.names] = jax.tree.map(
                lambda x, k=kernel: _placed_like(x, k),
                identity_inverse(b.a_shape, b.g_shape, mode))
        return ScaleByKfacState(
            count=jnp.zeros((), jnp.int32), factor_weight=jnp.zeros((), jnp.float32),
            factors=nested(factors), inverses=nested(inverses), event=_initial_event())

    def update_fn(updates, state, params=None, *, curvature=_MISSING, learning_rate=None,
                  **extra_args):
        del params, extra_args
        if curvature is _MISSING:
            raise ValueError(
                "scale_by_kfac/kfac: update() needs the curvature= extra argument (the batch "
                "factors, see optax_snoo.kfac.value_grad_and_stats); pass curvature=None "
                "explicitly for a step without statistics.")
        entries, treedef = flatten_params(updates)
        specs = {n: (tuple(f.a.shape), tuple(f.g.shape), f.kernel_axes)
                 for n, f in flatten_nested(state.factors, LayerCurvature).items()}
        blocks = resolve_blocks(specs, entries, bias_name)
        factors, weight = update_factors(
            state, blocks=blocks, entries=entries, curvature=curvature, ema_decay=ema_decay,
            stats_every=stats_every, stats_axes=stats_axes)
        lr = learning_rate_now(learning_rate, state.count)
        lam = value_at(damping, state.count)
        inverses, event = refresh_when_due(
            state, blocks=blocks, factors=factors, weight=weight, lr=lr, policy=refresh,
            damping=lam, mode=mode, floors=(eig_floor_abs, eig_floor_rel),
            mesh=refresh_mesh())
        leaves = precondition_blocks(
            entries, blocks, inverses, [sharding_of(b, entries[b.kernel][1]) for b in blocks])
        names = [b.names for b in blocks]
        new_state = ScaleByKfacState(
            count=optax.safe_increment(state.count), factor_weight=weight,
            factors=nested(dict(zip(names, factors, strict=True))),
            inverses=nested(dict(zip(names, inverses, strict=True))), event=event)
        return jax.tree_util.tree_unflatten(treedef, leaves), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kfac(
    learning_rate: optax.ScalarOrSchedule,
    damping: optax.ScalarOrSchedule = 1e-3,
    *,
    momentum: float | None = 0.9,
    nesterov: bool = False,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Any = None,
    ema_decay: float = 0.95,
    refresh: RefreshPolicy | int = 10,
    mode: str = "pi",
    graft: str | None = None,
    b2: float = 0.999,
    eps: float = 1e-8,
    eig_floor_abs: float = 1e-8,
    eig_floor_rel: float = 1e-6,
    layers: Any = None,
    bias_name: str = "bias",
    distributed_refresh: bool = True,
    mesh: Any = None,
    distributed_precondition: bool = True,
    shardings: Any = None,
    stats_every: int = 1,
    stats_axes: tuple[str, ...] | None = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""K-FAC optimizer: `scale_by_kfac`, optional grafting, momentum, weight decay, LR.

    ``chain(graft(magnitude, scale_by_kfac) or scale_by_kfac, trace(momentum),
    add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``.
    Grafting (per leaf) rescales the K-FAC direction to the norm of another direction
    computed from the same gradient: ``"sgd"`` the gradient itself, ``"adam"`` Adam's
    second-moment-normalised gradient (``scale_by_adam(b1=0, b2, eps)``: momentum is
    applied after grafting, as in Distributed Shampoo). The ``learning_rate`` schedule is
    also what LR-aware refresh policies read. Pass the batch factors as
    ``update(..., curvature=...)`` (see `scale_by_kfac`).

    Args:
      learning_rate: learning rate or schedule.
      damping: λ or a schedule.
      momentum: heavy-ball momentum (``optax.trace``) or None/0 for none.
      nesterov: Nesterov momentum.
      weight_decay: decoupled weight decay (AdamW style, multiplied by the LR).
      mask: which leaves get weight decay: a tree of booleans or a callable of the
        params returning one (``optax.add_decayed_weights``'s ``mask``); None: all.
      ema_decay: factor EMA decay ρ.
      refresh: refresh policy or an interval.
      mode: ``"pi"`` or ``"eigen"``.
      graft: None (no grafting; ``--kfac_graft=none`` on the trainer's command line),
        ``"adam"`` or ``"sgd"``.
      b2: Adam's second-moment decay for ``graft="adam"``.
      eps: Adam's epsilon for ``graft="adam"``.
      eig_floor_abs: absolute eigenvalue floor.
      eig_floor_rel: relative eigenvalue floor.
      layers: which kernels to precondition (see `scale_by_kfac`).
      bias_name: key of a kernel's bias sibling.
      distributed_refresh: split the refresh's eigendecompositions over the devices of
        the mesh (see the module docstring); False: every device runs all of them.
      mesh: the mesh to split the refresh over; default: the mesh set with
        ``jax.set_mesh`` around the update, if any (else nothing is split).
      distributed_precondition: precondition each split kernel's gradient where it
        lives (see `scale_by_kfac`).
      shardings: where the kernels live under ``jax.jit`` (see `scale_by_kfac`).
      stats_every: advance the factor EMAs every this many updates (see `scale_by_kfac`).
      stats_axes: the mesh axes the factor EMAs' rows are split over (see `scale_by_kfac`).
      weight_decay_mask: the former name of ``mask``; passing it raises.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: unknown ``graft``, bad hyperparameters, or ``weight_decay_mask``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.kfac import every, kfac
      >>> tx = kfac(optax.cosine_decay_schedule(0.1, 1000), damping=1e-2,
      ...           refresh=every(100, first=0), graft="adam")
      >>> state = tx.init({"dense": {"kernel": jnp.ones((4, 3))}})

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015

      Agarwal et al., `Disentangling Adaptive Gradient Methods from Learning Rates
      <https://arxiv.org/abs/2002.11803>`_, 2020 (grafting)
    """
    if weight_decay_mask is not None:
        raise ValueError("kfac: weight_decay_mask was renamed mask (optax's name).")
    if graft not in GRAFTS:
        raise ValueError(f"graft must be one of {GRAFTS}, got {graft!r}.")
    check_unit_interval("momentum", momentum, allow_none=True)
    direction = scale_by_kfac(
        damping=damping, ema_decay=ema_decay, refresh=refresh, learning_rate=learning_rate,
        mode=mode, eig_floor_abs=eig_floor_abs, eig_floor_rel=eig_floor_rel, layers=layers,
        bias_name=bias_name, distributed_refresh=distributed_refresh, mesh=mesh,
        distributed_precondition=distributed_precondition, shardings=shardings,
        stats_every=stats_every, stats_axes=stats_axes)
    if graft == "adam":
        direction = graft_transform(optax.scale_by_adam(b1=0.0, b2=b2, eps=eps), direction)
    elif graft == "sgd":
        direction = graft_transform(optax.identity(), direction)
    return optax.chain(
        direction,
        (optax.identity() if momentum is None or (is_real(momentum) and momentum == 0)
         else optax.trace(decay=momentum, nesterov=nesterov)),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
