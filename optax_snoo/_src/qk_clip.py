"""QK-clip (MuonClip's weight clipping): keep every attention head's largest logit <= tau.

After each optimizer update, every attention head ``n`` whose largest pre-softmax logit
``S_n`` (over the step's batch and positions, as measured by the model in the forward
pass) exceeded ``tau`` gets its query and key weights scaled so that its logits scale by
``gamma_n = min(1, tau / S_n)``, bringing that logit back to ``tau``.

With one key head per query head (multi-head attention) that is Kimi K2's per-head rule:
``W_q^n <- sqrt(gamma_n) W_q^n`` and ``W_k^n <- sqrt(gamma_n) W_k^n``. With grouped-query
attention (``K`` key heads shared by groups of ``N / K`` query heads; query head ``n`` uses
key head ``j(n) = n // (N / K)``) a key head cannot be scaled per query head, so the
exact per-head rule used here is: key head ``j`` by ``sqrt(g_j)`` with
``g_j = min(gamma_n for n in group j)``, query head ``n`` by ``gamma_n / sqrt(g_j(n))``.
Every query head's logits ``q_n . k_j(n)`` then scale by exactly ``gamma_n``: heads at or
below ``tau`` keep their logits (their weights are untouched when their whole group is),
and the key head is never scaled up. For ``K == N`` this is ``sqrt(gamma)`` on both sides.

The transform is model-agnostic: a tree of `QKHeads` (or `qk_clip_heads`' path rules)
says which parameter leaves hold which heads of which layer, and the model passes its
measured logits to ``update`` as the extra argument ``max_logits``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.labels import by_path
from optax_snoo._src.utils import check_int_at_least, check_positive, path_to_str, state_dtype

__all__ = ["QKHeads", "qk_clip_heads", "qk_clip_scales", "scale_by_qk_clip"]

_ROLES = ("query", "key")


class QKHeads(NamedTuple):
    """How one parameter leaf holds the query or key heads of an attention layer.

    Heads are stored contiguously along ``axis``: head ``n`` occupies entries
    ``[n * H, (n + 1) * H)`` of that axis, ``H = shape[axis] // num_heads``. A projection
    kernel ``(D, N*H)`` and its bias ``(N*H,)`` both have ``axis=-1``.

    Attributes:
      layer: the attention layer's name, the key of ``max_logits`` (e.g. ``"blocks/0/attn"``).
      role: ``"query"`` or ``"key"``.
      num_heads: heads stored in this leaf (``N`` for queries, ``K`` for keys).
      axis: the axis holding the heads.
    """

    layer: str
    role: str
    num_heads: int
    axis: int = -1


HeadsTree = Any  # a tree with the params' structure, leaves `QKHeads` or None


def _is_heads_leaf(x: Any) -> bool:
    return x is None or isinstance(x, QKHeads)


def _check_heads(path: str, heads: QKHeads, shape: tuple[int, ...]) -> None:
    if heads.role not in _ROLES:
        raise ValueError(f"QKHeads of {path!r}: role must be one of {_ROLES}, got {heads.role!r}.")
    check_int_at_least(f"QKHeads.num_heads of {path!r}", heads.num_heads, 1)
    if not -len(shape) <= heads.axis < len(shape):
        raise ValueError(f"QKHeads of {path!r}: axis={heads.axis} is out of range for a "
                         f"parameter of shape {shape}.")
    size = shape[heads.axis]
    if size % heads.num_heads:
        raise ValueError(f"QKHeads of {path!r}: num_heads={heads.num_heads} does not divide "
                         f"axis {heads.axis} of size {size} (shape {shape}).")


def _layer_heads(marked: list[tuple[str, QKHeads]]) -> dict[str, tuple[int, int]]:
    """`{layer: (N, K)}` from the marked leaves, checking each layer is consistent."""
    counts: dict[str, dict[str, set[int]]] = {}
    for _, h in marked:
        counts.setdefault(h.layer, {"query": set(), "key": set()})[h.role].add(h.num_heads)
    layers = {}
    for layer, by_role in counts.items():
        for role, other in (("query", "key"), ("key", "query")):
            if not by_role[role]:
                raise ValueError(f"QK-clip layer {layer!r} has a {other} leaf but no {role} "
                                 f"leaf; mark both projections of every clipped layer.")
            if len(by_role[role]) > 1:
                raise ValueError(f"QK-clip layer {layer!r}: its {role} leaves disagree on "
                                 f"num_heads ({sorted(by_role[role])}).")
        (n,), (k,) = by_role["query"], by_role["key"]
        if n % k:
            raise ValueError(f"QK-clip layer {layer!r}: {n} query heads are not a multiple "
                             f"of its {k} key heads.")
        layers[layer] = (n, k)
    return layers


def qk_clip_scales(max_logits_N: jax.Array, tau: float | jax.Array, num_kv_heads: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Per-head weight scales of one layer: ``(query_N, key_K)``, float32 (float64 for
    float64 logits).

    ``gamma_n = min(1, tau / S_n)`` (1 when ``S_n <= tau``); key head ``j`` scales by
    ``sqrt(g_j)``, ``g_j = min`` of ``gamma`` over its query group; query head ``n`` by
    ``gamma_n / sqrt(g_j(n))``, so head ``n``'s logits scale by exactly ``gamma_n``.

    Args:
      max_logits_N: the largest logit of each query head, ``(N,)``.
      tau: the logit threshold (> 0).
      num_kv_heads: ``K``, dividing ``N``; query head ``n`` uses key head ``n // (N / K)``.

    Returns:
      ``(query_scale_N, key_scale_K)``.

    Example:
      >>> import jax.numpy as jnp
      >>> q, k = qk_clip_scales(jnp.array([50.0, 400.0]), 100.0, 2)
      >>> (q * k).tolist()  # each head's logits scale by min(1, tau / S)
      [1.0, 0.25]

    References:
      Kimi Team, "Kimi K2: Open Agentic Intelligence", https://arxiv.org/abs/2507.20534,
      2025 (MuonClip, Algorithm 1).
    """
    s = jnp.asarray(max_logits_N, state_dtype(None, max_logits_N))  # float64 ones stay
    gamma_N = jnp.where(s > tau, tau / jnp.where(s > tau, s, 1.0), 1.0)
    group_g_K = jnp.min(gamma_N.reshape(num_kv_heads, -1), axis=1)
    key_K = jnp.sqrt(group_g_K)
    query_N = gamma_N / jnp.repeat(key_K, gamma_N.shape[0] // num_kv_heads)
    return query_N, key_K


def _clip_leaf(u: jax.Array, p: jax.Array, heads: QKHeads, scale_heads: jax.Array) -> jax.Array:
    """`u'` with `p + u' = (p + u) * scale` along the heads' axis, `u` where the scale is 1."""
    axis = heads.axis % p.ndim
    # Indexed on the leaf's own shape: a factor vector shared by a kernel and its bias
    # would carry the kernel's sharding to the bias under jit.
    head_of = jax.lax.broadcasted_iota(jnp.int32, p.shape, axis) // (
        p.shape[axis] // heads.num_heads)
    scale = scale_heads[head_of]
    dt = jnp.promote_types(state_dtype(None, p), state_dtype(None, u))  # f32, f64 for f64
    p32 = p.astype(dt)
    clipped = ((p32 + u.astype(dt)) * scale.astype(dt) - p32).astype(u.dtype)
    return jnp.where(scale == 1.0, u, clipped)


def _layer_max_logits(max_logits: Any, layers: dict[str, tuple[int, int]]
                      ) -> dict[str, jax.Array]:
    if max_logits is None:
        raise ValueError("scale_by_qk_clip: update needs max_logits= (a mapping from each "
                         "attention layer to its per-query-head max logit, shape (N,)); got "
                         "None. Pass it through optax's extra args: tx.update(updates, state, "
                         "params, max_logits=...).")
    if not isinstance(max_logits, Mapping):
        raise ValueError(f"scale_by_qk_clip: max_logits must be a mapping layer -> (N,) "
                         f"array, got {type(max_logits).__name__}.")
    out = {}
    for layer, (n, _) in layers.items():
        if layer not in max_logits:
            raise ValueError(f"scale_by_qk_clip: max_logits has no entry for layer {layer!r} "
                             f"(it has {sorted(max_logits)}).")
        value = jnp.asarray(max_logits[layer])
        if value.shape != (n,):
            raise ValueError(f"scale_by_qk_clip: max_logits[{layer!r}] has shape "
                             f"{value.shape}; expected ({n},), one value per query head.")
        out[layer] = value
    return out


def scale_by_qk_clip(
    tau: float,
    heads: HeadsTree | Callable[[optax.Params], HeadsTree],
) -> optax.GradientTransformationExtraArgs:
    """QK-clip: rescale the query/key heads whose max logit exceeded ``tau`` (MuonClip).

    Place it LAST in the chain, after the learning rate (and before any rounding): it
    returns ``u'`` with ``p + u' = clip(p + u)``, where ``clip`` scales the query and key
    heads of every layer by `qk_clip_scales` of the ``max_logits`` measured in this step's
    forward pass (the per-head rule, exact for grouped-query attention; see the module
    docstring). The work is done in float32 (float64 for float64 params) and cast back
    to the update's dtype; leaves
    whose heads need no scaling (and unmarked leaves) keep ``u`` exactly.

    Args:
      tau: the logit threshold, > 0 (Kimi K2 used 100).
      heads: a tree with the params' structure whose leaves are `QKHeads` (a leaf holding
        heads) or ``None`` (left alone), or a function ``params -> tree`` such as
        `qk_clip_heads`.

    Returns:
      An `optax.GradientTransformationExtraArgs` (stateless) whose
      ``update(updates, state, params, *, max_logits)`` takes ``max_logits``, a mapping
      from each layer named in ``heads`` to a float array ``(N,)`` of its query heads'
      largest pre-softmax logits (``q . k / sqrt(H)`` as the softmax sees it); entries
      for other layers are ignored. ``params`` is required.

    Raises:
      ValueError: at construction for ``tau <= 0``; at ``init``/trace time for a heads
        tree that does not match the params, a layer with a query leaf but no key leaf
        (or the reverse), ``num_heads`` not dividing its axis, query heads not a multiple
        of the key heads, and a ``max_logits`` that is missing, lacks a layer or has the
        wrong length.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import QKHeads, scale_by_qk_clip
      >>> params = {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))}  # 2 heads of 2
      >>> heads = {"q": QKHeads("attn", "query", 2), "k": QKHeads("attn", "key", 2)}
      >>> tx = optax.chain(optax.sgd(0.1), scale_by_qk_clip(100.0, heads))
      >>> grads = jax.tree.map(jnp.zeros_like, params)
      >>> u, _ = tx.update(grads, tx.init(params), params,
      ...                  max_logits={"attn": jnp.array([50.0, 400.0])})
      >>> optax.apply_updates(params, u)["q"][0].tolist()  # head 1 scaled by sqrt(1/4)
      [1.0, 1.0, 0.5, 0.5]

    References:
      Kimi Team, "Kimi K2: Open Agentic Intelligence", https://arxiv.org/abs/2507.20534,
      2025 (Section 2.1, MuonClip; the per-head QK-clip).
    """
    check_positive("tau", tau)

    def marked_leaves(params: optax.Params) -> list[tuple[str, QKHeads | None]]:
        tree = heads(params) if callable(heads) else heads
        paths_leaves, treedef = jax.tree.flatten_with_path(params)
        try:
            heads_leaves = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"scale_by_qk_clip: heads must have the params' structure "
                             f"(leaves QKHeads or None): {err}") from None
        out = []
        for (path, p), h in zip(paths_leaves, heads_leaves, strict=True):
            if not _is_heads_leaf(h):
                raise ValueError(f"scale_by_qk_clip: heads of {path_to_str(path)!r} must be a "
                                 f"QKHeads or None, got {h!r}.")
            if h is not None:
                _check_heads(path_to_str(path), h, tuple(p.shape))
            out.append((path_to_str(path), h))
        return out

    def init_fn(params):
        marked = [(path, h) for path, h in marked_leaves(params) if h is not None]
        _layer_heads(marked)
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scale_by_qk_clip needs params (it clips p + u).")
        marked = marked_leaves(params)
        layers = _layer_heads([(path, h) for path, h in marked if h is not None])
        logits = _layer_max_logits(max_logits, layers)
        scales = {layer: qk_clip_scales(logits[layer], tau, k) for layer, (_, k) in
                  layers.items()}
        u_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        new = [u if h is None else
               _clip_leaf(u, p, h, scales[h.layer][_ROLES.index(h.role)])
               for u, p, (_, h) in zip(u_leaves, p_leaves, marked, strict=True)]
        return jax.tree.unflatten(treedef, new), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def qk_clip_heads(
    num_heads: int,
    num_kv_heads: int | None = None,
    *,
    query: str = r"c_q/(kernel|bias)$",
    key: str = r"c_k/(kernel|bias)$",
    axis: int = -1,
) -> Callable[[optax.Params], HeadsTree]:
    """The `QKHeads` tree of a model whose query and key leaves are found by path.

    Each leaf's path is written as ``"blocks/0/attn/c_q/kernel"``
    (`optax_snoo.labels.path_to_str`); ``query`` and ``key`` are regular expressions
    searched in it, and the leaf's layer is the part of the path before the match, without
    its trailing ``"/"`` (``"blocks/0/attn"``), which is how `models.forward` names the
    layers of its ``max_logits``.

    Args:
      num_heads: query heads ``N`` of every matched layer.
      num_kv_heads: key heads ``K`` (default ``N``: multi-head attention).
      query: regex of the query leaves (kernels and biases).
      key: regex of the key leaves.
      axis: the axis holding the heads in every matched leaf.

    Returns:
      A function ``params -> heads tree`` for `scale_by_qk_clip`.

    Raises:
      ValueError: when called, if no leaf matches ``query``; at construction for bad
        patterns or head counts.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"attn": {"c_q": {"kernel": jnp.zeros((8, 8))},
      ...                    "c_k": {"kernel": jnp.zeros((8, 4))}}}
      >>> qk_clip_heads(4, 2)(params)["attn"]["c_k"]["kernel"]
      QKHeads(layer='attn', role='key', num_heads=2, axis=-1)

    References:
      Kimi Team, "Kimi K2: Open Agentic Intelligence", https://arxiv.org/abs/2507.20534,
      2025.
    """
    check_int_at_least("num_heads", num_heads, 1)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_int_at_least("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}.")
    try:
        rules = by_path([(query, ("query", num_heads)), (key, ("key", num_kv_heads))],
                        default=None, what="qk_clip_heads pattern")
    except ValueError as err:
        raise ValueError(f"qk_clip_heads: invalid pattern: {err}") from None

    def heads_fn(params: optax.Params) -> HeadsTree:
        tree = rules.by_prefix(params, lambda layer, role_count: QKHeads(
            layer, role_count[0], role_count[1], axis))
        if not any(isinstance(h, QKHeads) for h in jax.tree.leaves(tree, is_leaf=_is_heads_leaf)):
            raise ValueError(f"qk_clip_heads: no parameter path matches the query pattern "
                             f"{query!r}.")
        return tree

    return heads_fn
