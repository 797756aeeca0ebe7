"""Newton-Muon: Muon on gradients right-preconditioned by the inverse input covariance.

Each dense layer ``y = x W`` (a Flax ``(in, out)`` kernel) keeps the moving average ``C``
of its inputs' second moment ``K = xᵀx / N`` (the A factor of K-FAC, without the bias
coordinate), and its gradient is replaced, before Muon's momentum, by

    G ← (C + λ I)⁻¹ G,        λ = damping · tr(C) / d + eps

on the input side: the rows of an ``(in, out)`` kernel's gradient, the columns of a
PyTorch ``(out, in)`` weight's (``G·P`` in modded-nanogpt's layout). ``C`` advances and
the inverse is recomputed only on refresh steps, every ``refresh_every`` updates (update
counts ``refresh_every - 1``, ``2·refresh_every - 1``, ...), each refresh one EMA step
``C ← C + (1 - ρ)(K - C)`` from ``C₀ = c₀ I``; before the first refresh the gradient is
unchanged. Inputs wider than ``block_size`` use a block-diagonal ``C`` (``d / block_size``
independent blocks), and layers that read the same input (attention's q, k and v) share
one ``C``.

`precondition_by_input_covariance` is the transform (chain it before `scale_by_muon`),
`input_covariance_from_stats` builds its ``input_covariance=`` extra argument from the
statistics `optax_snoo.kfac.value_grad_and_stats` captures, and `newton_muon` is the
optimizer (preconditioner, Muon, AdamW on the rest).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.kfac.blocks import Names, flatten_params, label, nested
from optax_snoo._src.kfac.transform import _keep_under_mesh, _placed_like
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_unit_interval,
    path_names,
    state_dtype,
)

__all__ = ["InputCovarianceState", "input_covariance_from_stats",
           "input_covariance_refresh_due", "newton_muon", "precondition_by_input_covariance"]

_HIGHEST = jax.lax.Precision.HIGHEST
_MISSING: Any = object()   # `update` without the input_covariance= extra argument


class InputCovarianceState(NamedTuple):
    """State of `precondition_by_input_covariance`.

    Attributes:
      count: number of updates so far (int32).
      refreshes: number of refreshes so far (int32); 0 means the gradient passes unchanged.
      covariances: nested dict keyed by the key path of each factor's kernel (the first
        layer of a shared group) of the input-covariance EMA ``C``, float32 (float64 for
        float64 params) ``(*stack, blocks, block, block)``.
      inverses: same keys, the damped inverse ``(C + λI)⁻¹`` of the latest refresh
        (identity before the first).
    """

    count: jax.Array
    refreshes: jax.Array
    covariances: dict
    inverses: dict


class _Layer(NamedTuple):
    names: Names           # the kernel's key path
    factor: Names          # the key path of the factor it uses (its group's first layer)
    stack: tuple[int, ...]
    d_in: int
    blocks: int


def input_covariance_refresh_due(count: jax.typing.ArrayLike, refresh_every: int = 64
                                 ) -> jax.Array | bool:
    """Whether update number ``count`` (from 0) refreshes `precondition_by_input_covariance`:
    ``(count + 1) % refresh_every == 0``, modded-nanogpt Track 3 record #15's schedule.
    A trainer computes the statistics (`input_covariance_from_stats`) on these steps only.

    Example:
      >>> from optax_snoo import input_covariance_refresh_due
      >>> [s for s in range(200) if input_covariance_refresh_due(s, 64)]
      [63, 127, 191]
    """
    return (count + 1) % refresh_every == 0


def input_covariance_from_stats(stats: dict, *, layers: Collection[str] | None = None
                                ) -> dict[str, jax.Array]:
    """The ``input_covariance=`` argument of `precondition_by_input_covariance` from the
    statistics `optax_snoo.kfac.value_grad_and_stats` captures.

    For each kernel path, ``K = xᵀx / N`` over its ``N`` input rows, float32
    ``(*stack, d_in, d_in)``: the A factor of `optax_snoo.kfac.curvature_from_stats`
    without the bias coordinate (the transform splits wide inputs into blocks itself).
    Per expert of a stack, over its routed (non-zero) slots; for a scanned stack, per layer.

    Args:
      stats: kernel path -> `optax_snoo.kfac.LayerStats`.
      layers: the kernel paths to compute (e.g. one per shared group: the transform reads
        only the group's first layer); ``None``: every entry of ``stats``.

    Returns:
      A dict from kernel path to ``K``.

    Raises:
      ValueError: a path of ``layers`` without statistics, or a kernel not stored as
        ``(*stack, in, out)`` (a PyTorch ``(out, in)`` weight read as ``x @ W.T``).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import input_covariance_from_stats
      >>> from optax_snoo.kfac import LayerStats
      >>> x = jnp.array([[1.0, 0.0], [1.0, 2.0]])
      >>> k = input_covariance_from_stats({"l/kernel": LayerStats(x, jnp.ones((2, 3)), True)})
      >>> k["l/kernel"].tolist()
      [[1.0, 1.0], [1.0, 2.0]]
    """
    from optax_snoo import kfac

    chosen = stats if layers is None else {}
    for path in () if layers is None else layers:
        if path not in stats:
            raise ValueError(f"input_covariance_from_stats: no statistics for {path!r}; "
                             f"captured: {sorted(stats)}.")
        chosen[path] = stats[path]
    for path, s in chosen.items():
        if s.kernel_axes is not None:
            raise ValueError(
                f"input_covariance_from_stats: {path} is a kernel in layout "
                f"{s.kernel_axes} (e.g. a PyTorch (out, in) weight); "
                "precondition_by_input_covariance takes (*stack, in, out) kernels only.")
    # num_tokens scales only the G factor, which is not used (and not computed under jit).
    factors = kfac.curvature_from_stats(chosen, num_tokens=1)
    out = {}
    for path, s in chosen.items():
        d = s.inputs.shape[-1]
        out[path] = factors[path].a[..., :d, :d]
    return out


def _group_key(names: Names, groups: Sequence[Sequence[str]], is_layer) -> Names:
    """The factor of kernel ``names``: the first existing layer of its shared group."""
    for i in range(len(names) - 1, -1, -1):
        for group in groups:
            if names[i] in group:
                for leader in group:
                    candidate = (*names[:i], leader, *names[i + 1:])
                    if is_layer(candidate):
                        return candidate
    return names


def _resolve(entries: list[tuple[Names, Any]], layers: Collection[str] | None,
             groups: Sequence[Sequence[str]], block_size: int | None) -> list[_Layer]:
    """The preconditioned kernels of a (possibly masked) params/updates tree."""
    present = {n: leaf for n, leaf in entries if not isinstance(leaf, optax.MaskedNode)}
    if layers is None:
        chosen = [n for n, leaf in present.items() if n[-1] == "kernel" and leaf.ndim >= 2]
    else:
        chosen = []
        everything = {n for n, _ in entries}
        for path in layers:
            n = path_names((path,))
            if n not in everything:
                raise ValueError(f"precondition_by_input_covariance: layers names {path!r}, "
                                 f"which is not a leaf of the params.")
            if n in present:
                if present[n].ndim < 2:
                    raise ValueError(f"precondition_by_input_covariance: {path!r} has shape "
                                     f"{present[n].shape}; a kernel has >= 2 axes.")
                chosen.append(n)
    is_layer = set(chosen).__contains__
    out = []
    for n in chosen:
        shape = present[n].shape
        d_in = shape[-2]
        blocks = 1
        if block_size is not None and d_in > block_size:
            if d_in % block_size:
                raise ValueError(f"precondition_by_input_covariance: {label(n)} has {d_in} "
                                 f"inputs, not a multiple of block_size={block_size}.")
            blocks = d_in // block_size
        out.append(_Layer(n, _group_key(n, groups, is_layer), shape[:-2], d_in, blocks))
    by_factor: dict[Names, _Layer] = {}
    for layer in out:
        first = by_factor.setdefault(layer.factor, layer)
        if (first.stack, first.d_in) != (layer.stack, layer.d_in):
            raise ValueError(
                f"precondition_by_input_covariance: {label(layer.names)} shares the input of "
                f"{label(first.names)} (shared_inputs) but its kernel has stack {layer.stack} "
                f"and {layer.d_in} inputs, against {first.stack} and {first.d_in}.")
    return out


def _factor_shape(layer: _Layer) -> tuple[int, ...]:
    b = layer.d_in // layer.blocks
    return (*layer.stack, layer.blocks, b, b)


def _diagonal_blocks(k: jax.Array, blocks: int) -> jax.Array:
    """``(*stack, d, d)`` -> its ``blocks`` diagonal blocks ``(*stack, blocks, b, b)``."""
    b = k.shape[-1] // blocks
    k = k.reshape(*k.shape[:-2], blocks, b, blocks, b)
    return jnp.stack([k[..., i, :, i, :] for i in range(blocks)], axis=-3)


def _damped_inverse(c: jax.Array, damping: Any, eps: Any) -> jax.Array:
    """``(C + (damping·tr(C)/b + eps) I)⁻¹`` by Cholesky; the identity where it fails."""
    b = c.shape[-1]
    eye = jnp.eye(b, dtype=c.dtype)
    reg = damping * jnp.trace(c, axis1=-2, axis2=-1) / b + eps
    chol = jnp.linalg.cholesky(c + reg[..., None, None] * eye)
    inv = jax.scipy.linalg.cho_solve((chol, True), jnp.broadcast_to(eye, c.shape))
    ok = jnp.all(jnp.isfinite(inv), axis=(-2, -1), keepdims=True)
    return jnp.where(ok, inv, eye)


def precondition_by_input_covariance(
    ema_decay: float = 0.95,
    damping: float = 0.2,
    *,
    refresh_every: int = 64,
    block_size: int | None = None,
    shared_inputs: Sequence[Sequence[str]] = (),
    layers: Collection[str] | None = None,
    initial_scale: float = 1e-3,
    eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    r"""Newton-Muon's preconditioner: each kernel gradient times its inverse input covariance.

    For a dense kernel ``W`` ``(*stack, d_in, d_out)`` with inputs ``x``, on update
    ``t`` (from 0)::

        if (t + 1) % refresh_every == 0:                        # refresh
            C ← C + (1 - ρ) (K - C)        K = xᵀx / N  (input_covariance=)
            P ← (C + (damping · tr(C)/b + eps) I)⁻¹              # Cholesky; I where it fails
        G ← P G   (after the first refresh; else G unchanged)

    ``C`` starts at ``initial_scale · I``, is not debiased, and advances only on refresh
    steps (ρ per refresh, not per step); ``b`` is the factor's size. ``P`` multiplies the
    gradient on its **input** side: in this ``(in, out)`` layout from the left,
    ``G ← P G`` (PyTorch's ``(out, in)`` weights get ``G·P``, as record #15 writes it).
    The result goes to Muon's momentum: chain this *before* `scale_by_muon`
    (or use `newton_muon`). It is the one-sided inverse of K-FAC's A factor: Muon's
    orthogonalisation takes the place of the output side.

    **Statistics.** ``update(grads, state, params, input_covariance=K)`` where ``K`` maps
    each factor's kernel path (``"blocks/0/attn/c_q/kernel"``, or a nested dict) to
    ``xᵀx / N`` ``(*stack, d_in, d_in)`` float32: `input_covariance_from_stats` of
    `optax_snoo.kfac.value_grad_and_stats`' statistics. Only refresh steps read it
    (`input_covariance_refresh_due`), so a trainer computes it on those steps only and
    may pass ``input_covariance=None`` on the others; ``None`` on a refresh step
    recomputes ``P`` from the unchanged ``C``, and so does a batch with any NaN or Inf
    (dropped whole; the record would carry it into ``C``). The argument is required (a forgotten
    one would otherwise silently run plain Muon). With gradient accumulation, pass the
    mean of the micro-batches' ``K`` (the record's mean over micro-batches and ranks).

    **Which kernels.** By default every 2-D (or stacked) leaf named ``kernel`` that is
    not masked (``optax.masked``, ``optax.partition``); ``layers`` lists key paths
    instead. Other leaves pass unchanged. ``shared_inputs`` names groups of sibling
    modules that read the same input (``(("c_q", "c_k", "c_v"),)``): the kernels whose
    paths differ only in that component share one factor, kept under, and read from,
    the first of the group present. ``block_size``: an input wider than it gets
    ``d_in / block_size`` independent diagonal blocks (the record splits the MLP's
    3072-wide ``proj`` input into 4 blocks of 768), each damped by its own trace.

    Args:
      ema_decay: ρ in [0, 1), the EMA decay per refresh (record: 0.95).
      damping: relative damping in units of the mean eigenvalue ``tr(C)/b`` (record: 0.2).
      refresh_every: refresh interval in updates (record: 64).
      block_size: largest factor size (record: the model width, 768); ``None``: full.
      shared_inputs: groups of module names whose kernels read one input (record: q/k/v).
      layers: key paths of the kernels to precondition; ``None``: every ``kernel`` leaf.
      initial_scale: ``C₀ = initial_scale · I`` (record: 0.001).
      eps: absolute damping added to the relative one (record: 1e-8).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state `InputCovarianceState`.

    Raises:
      ValueError: bad hyperparameters; at init/trace time a kernel whose input width does
        not divide into ``block_size`` blocks, shared kernels of different input widths,
        unknown ``layers``, a missing ``input_covariance`` argument or entry, a wrong
        shape, or an entry for a path that is not a leaf.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import (input_covariance_from_stats, kfac,
      ...                         precondition_by_input_covariance, scale_by_muon)
      >>> params = {"l1": {"kernel": jnp.ones((4, 8)) / 4}, "l2": {"kernel": jnp.ones((8, 2))}}
      >>> def loss_fn(p, x):
      ...   return jnp.mean(jnp.tanh(x @ p["l1"]["kernel"]) @ p["l2"]["kernel"])
      >>> tx = optax.chain(precondition_by_input_covariance(refresh_every=2),
      ...                  scale_by_muon(), optax.scale_by_learning_rate(0.02))
      >>> state = tx.init(params)
      >>> x = jax.random.normal(jax.random.key(0), (16, 4))
      >>> @jax.jit
      ... def step(params, state):
      ...   _, grads, stats = kfac.value_grad_and_stats(loss_fn, params, x)
      ...   updates, state = tx.update(grads, state, params,
      ...                              input_covariance=input_covariance_from_stats(stats))
      ...   return optax.apply_updates(params, updates), state
      >>> for _ in range(4):
      ...   params, state = step(params, state)
      >>> int(state[0].refreshes)
      2

    References:
      modded-nanogpt Track 3 record #15, Newton-Muon (3275 steps),
      `records/track_3_optimization/results/20260505_newton_muon
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026

      Newton-Muon, `arXiv:2604.01472 <https://arxiv.org/abs/2604.01472>`_, 2026

      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015 (the A factor)
    """
    check_unit_interval("ema_decay", ema_decay)
    check_non_negative("damping", damping)
    check_non_negative("eps", eps)
    check_positive("initial_scale", initial_scale)
    check_int_at_least("refresh_every", refresh_every, 1)
    if block_size is not None:
        check_int_at_least("block_size", block_size, 1)
    if isinstance(shared_inputs, str) or not all(
            not isinstance(g, str) and all(isinstance(n, str) for n in g)
            for g in shared_inputs):
        raise ValueError(f"shared_inputs must be groups of module names, e.g. "
                         f"(('c_q', 'c_k', 'c_v'),), got {shared_inputs!r}.")
    if layers is not None and (isinstance(layers, str)
                               or not all(isinstance(p, str) for p in layers)):
        raise ValueError(f"layers must be a collection of key path strings, got {layers!r}.")
    groups = tuple(tuple(g) for g in shared_inputs)

    def factors_of(tree):
        entries, treedef = flatten_params(tree)
        found = _resolve(entries, layers, groups, block_size)
        return entries, treedef, found, {f.factor: f for f in found if f.factor == f.names}

    def init_fn(params):
        entries, _, _, factors = factors_of(params)
        leaf = dict(entries)
        covariances, inverses = {}, {}
        for names, f in factors.items():   # replicated on a sharded kernel's mesh (K-FAC's)
            shape = _factor_shape(f)
            eye = jnp.broadcast_to(
                jnp.eye(shape[-1], dtype=state_dtype(None, leaf[f.names])), shape)
            covariances[names] = _placed_like(initial_scale * eye, leaf[f.names])
            inverses[names] = _placed_like(jnp.array(eye), leaf[f.names])
        return InputCovarianceState(
            count=jnp.zeros((), jnp.int32), refreshes=jnp.zeros((), jnp.int32),
            covariances=nested(covariances), inverses=nested(inverses))

    def batch_covariances(input_covariance, factors, entries):
        """factor key -> this batch's diagonal blocks of K (None: no statistics)."""
        if input_covariance is None:
            return None
        pairs = jax.tree_util.tree_flatten_with_path(input_covariance)[0]
        given = {path_names(path): x for path, x in pairs}
        known = {n for n, _ in entries}
        for names in given:
            if names not in known:
                raise ValueError(f"precondition_by_input_covariance: input_covariance has an "
                                 f"entry for {label(names)}, which is not a params leaf.")
        out = {}
        for names, f in factors.items():
            if names not in given:
                raise ValueError(
                    f"precondition_by_input_covariance: input_covariance has no entry for "
                    f"{label(names)} (see optax_snoo.input_covariance_from_stats); "
                    f"given: {sorted(label(n) for n in given)}.")
            k = given[names]
            want = (*f.stack, f.d_in, f.d_in)
            if tuple(k.shape) != want:
                raise ValueError(f"precondition_by_input_covariance: input_covariance of "
                                 f"{label(names)} has shape {tuple(k.shape)}, expected {want}.")
            out[names] = _diagonal_blocks(jnp.asarray(k, state_dtype(None, k)), f.blocks)
        return out

    def update_fn(updates, state, params=None, *, input_covariance=_MISSING, **extra_args):
        del params, extra_args
        if input_covariance is _MISSING:
            raise ValueError(
                "precondition_by_input_covariance/newton_muon: update() needs the "
                "input_covariance= extra argument (see optax_snoo.input_covariance_from_stats);"
                " pass input_covariance=None explicitly for a step without statistics.")
        entries, treedef, found, factors = factors_of(updates)
        keys = list(factors)
        covariances = [_at(state.covariances, k) for k in keys]
        inverses = [_at(state.inverses, k) for k in keys]
        batch = batch_covariances(input_covariance, factors, entries)
        due = input_covariance_refresh_due(state.count, refresh_every)

        def refresh(operands):
            covariances, _ = operands
            if batch is not None:
                # A batch with a NaN/Inf anywhere is dropped whole (as K-FAC's): C is kept.
                use = jnp.isfinite(sum(jnp.sum(batch[k]) for k in keys))
                covariances = [jnp.where(use, c + (1.0 - ema_decay) * (batch[k].astype(c.dtype)
                                                                       - c), c)
                               for c, k in zip(covariances, keys, strict=True)]
            return covariances, [_damped_inverse(c, damping, eps) for c in covariances]

        covariances, inverses = jax.lax.cond(due, refresh, lambda operands: operands,
                                             (covariances, inverses))
        covariances, inverses = _keep_under_mesh((covariances, inverses))
        refreshes = state.refreshes + due.astype(jnp.int32)
        inverse_of = dict(zip(keys, inverses, strict=True))
        leaves = [leaf for _, leaf in entries]
        index = {n: i for i, (n, _) in enumerate(entries)}
        for layer in found:
            i = index[layer.names]
            g = leaves[i]
            p = inverse_of[layer.factor]
            b = layer.d_in // layer.blocks
            g32 = g.astype(jnp.promote_types(state_dtype(None, g), p.dtype))
            blocks = g32.reshape(*layer.stack, layer.blocks, b, g.shape[-1])
            # Pᵀ G: the record's G·P in the (in, out) layout (P is symmetric up to rounding).
            pg = jnp.einsum("...kji,...kjo->...kio", p, blocks, precision=_HIGHEST)
            leaves[i] = jnp.where(refreshes > 0, pg.reshape(g.shape), g32).astype(g.dtype)
        new_state = InputCovarianceState(
            count=optax.safe_increment(state.count), refreshes=refreshes,
            covariances=nested(dict(zip(keys, covariances, strict=True))),
            inverses=nested(inverse_of))
        return jax.tree_util.tree_unflatten(treedef, leaves), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _at(tree: dict, names: Names) -> jax.Array:
    for name in names:
        tree = tree[name]
    return tree


def newton_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    ema_decay: float = 0.95,
    damping: float = 0.2,
    refresh_every: int = 64,
    block_size: int | None = None,
    shared_inputs: Sequence[Sequence[str]] = (),
    layers: Collection[str] | None = None,
    **muon_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""Newton-Muon: `precondition_by_input_covariance` on the Muon group, then `muon`.

    ``chain(masked(precondition_by_input_covariance(...), Muon leaves), muon(...))``: the
    preconditioner rewrites the gradients of the Muon group's ``kernel`` leaves only
    (the leaves ``labels`` gives to ``"muon"``; `optax_snoo.labels.muon_adam_labels` by
    default), so Muon's momentum and orthogonalisation see ``P G`` and AdamW the raw
    gradients of everything else: record #15's order (precondition, momentum,
    Newton-Schulz, decoupled weight decay). Pass ``input_covariance=`` to every update
    (see `precondition_by_input_covariance`).

    Args:
      learning_rate: Muon's learning rate or schedule (record #15: 0.020 for q/k/v, 0.025
        attention output, 0.030 MLP, on the 0.7 cooldown schedule).
      ema_decay: ρ of the covariance EMA per refresh.
      damping: relative damping (fraction of the mean eigenvalue).
      refresh_every: refresh interval in updates.
      block_size: largest factor size (``None``: one factor per input).
      shared_inputs: groups of module names reading one input (``(("c_q", "c_k",
        "c_v"),)`` for this repository's GPT).
      layers: key paths of the kernels to precondition (``None``: every Muon ``kernel``).
      **muon_kwargs: the keyword arguments of `optax_snoo.muon` (momentum, weight decay,
        Newton-Schulz, the AdamW group, ``labels``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import input_covariance_from_stats, kfac, newton_muon
      >>> params = {"h": {"kernel": jnp.ones((4, 8)) / 4, "bias": jnp.zeros(8)},
      ...           "lm_head": {"kernel": jnp.ones((8, 3)) / 8}}
      >>> def loss_fn(p, x, y):
      ...   h = jax.nn.relu(x @ p["h"]["kernel"] + p["h"]["bias"])
      ...   return optax.softmax_cross_entropy_with_integer_labels(
      ...       h @ p["lm_head"]["kernel"], y).mean()
      >>> tx = newton_muon(0.02, refresh_every=2, adam_learning_rate=3e-3)
      >>> state = tx.init(params)
      >>> x, y = jax.random.normal(jax.random.key(0), (16, 4)), jnp.zeros(16, jnp.int32)
      >>> @jax.jit
      ... def step(params, state):
      ...   _, grads, stats = kfac.value_grad_and_stats(loss_fn, params, x, y)
      ...   updates, state = tx.update(grads, state, params,
      ...                              input_covariance=input_covariance_from_stats(stats))
      ...   return optax.apply_updates(params, updates), state
      >>> params, state = step(params, state)

    References:
      modded-nanogpt Track 3 record #15, Newton-Muon (3275 steps),
      `records/track_3_optimization/results/20260505_newton_muon
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    from optax_snoo._src.labels import muon_adam_labels
    from optax_snoo._src.muon_adam import muon

    labels = muon_kwargs.get("labels") or muon_adam_labels

    def is_muon(tree):
        tags = labels(tree) if callable(labels) else labels
        return jax.tree.map(lambda tag: tag == "muon", tags)

    precondition = precondition_by_input_covariance(
        ema_decay, damping, refresh_every=refresh_every, block_size=block_size,
        shared_inputs=shared_inputs, layers=layers)
    return optax.chain(optax.masked(precondition, is_muon), muon(learning_rate, **muon_kwargs))
