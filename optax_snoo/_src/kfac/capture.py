"""K-FAC layer statistics of any JAX model, read from the jaxpr of its loss.

`value_grad_and_stats` traces the loss once (``jax.make_jaxpr`` over the flattened
params), finds every ``dot_general`` one of whose operands is a params leaf (a *kernel*),
and re-evaluates the jaxpr with an interpreter that records the other operand ``x`` of
each such product and adds a zero perturbation ``p`` to its output ``y``. One backward
pass then gives the parameter gradients and ``∂L/∂p = ∂L/∂y`` for every layer (the
recipe of Martens & Grosse 2015 and kfac-jax's tracer, without layer tags).

What counts as "a params leaf": the leaf itself, or the leaf through
``convert_element_type`` / ``copy`` / ``optimization_barrier`` / sharding constraints,
also across ``jit`` (``jnp.matmul`` and ``jnp.einsum`` are nested jits), ``closed_call``,
``remat`` and ``custom_jvp`` / ``custom_vjp`` boundaries. A ``custom_vjp`` (or
``custom_jvp``) call whose body is a single captured product, with ``x`` and the product
connected to the call's inputs and output through those pass-through ops only (a fast
hand-written matmul), is kept whole: ``x`` is read at the call's input and the call's
output is perturbed, so its custom backward still runs. Other calls with captured
products inside are inlined (their custom rules are not used).

Layouts. The ``dot_general`` dimension numbers give, on the kernel's side, batch axes
(a stack of independent layers, e.g. MoE experts ``E``), contracting axes (``d_in``) and
free axes (``d_out``). Supported are kernels whose axes are, in order,
``(*batch, *contracting, *free)``: ``nnx.Linear`` ``(in, out)``, ``nnx.Einsum`` kernels
such as ``"btd,dnh->btnh"`` (``d_in = d``, ``d_out = n·h``) or ``"btnh,nhd->btd"``, and
expert stacks ``(E, in, out)`` with ``E`` a batch axis. The ``x`` side may be in any
layout. Not captured (skipped with a warning when ``layers=None``, an error when the
kernel is named in ``layers``): other kernel layouts (e.g. a transposed ``(out, in)``
use), a kernel used by more than one product (weight sharing), and products inside
``scan`` / ``while`` / ``cond`` bodies.

Statistics (`LayerStats`, keyed by the kernel's path, `optax_snoo._src.utils.
path_to_str`): ``inputs`` ``(*stack, N, d_in)`` and ``out_grads`` ``(*stack, N, d_out)``,
the ``N`` tokens being every free axis of ``x`` flattened in order (``B·T`` for a
``(B, T, d)`` input; the capacity slots ``C`` of an expert buffer ``(E, C, d)``), in the
dtypes the product saw. ``out_grads`` are the gradients of the loss as written: for a
mean over ``M`` tokens they are ``1/M`` of the per-token gradients (`layer_factors` and
`curvature_from_stats` rescale them).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp

from optax_snoo._src.kfac.factors import LayerCurvature, layer_factors
from optax_snoo._src.utils import check_int_at_least, path_to_str

_PASS = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier",
                   "sharding_constraint"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat",
                    "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One layer's batch statistics from `value_grad_and_stats` (a pytree).

    Attributes:
      inputs: the layer inputs ``x``, ``(*stack, N, d_in)``.
      out_grads: ``∂L/∂y`` of the loss as written, ``(*stack, N, d_out)``.
      has_bias: whether the params tree has a bias sibling for this kernel (the leaf
        named ``"bias"`` next to it, of ``stack + d_out`` elements); static.
    """

    inputs: jax.Array
    out_grads: jax.Array
    has_bias: bool = False


jax.tree_util.register_dataclass(LayerStats, data_fields=["inputs", "out_grads"],
                                 meta_fields=["has_bias"])


# ------------------------------------------------------------------------------ analysis
@dataclasses.dataclass
class _Site:
    """A captured product: the kernel leaf, its layout and the perturbation's type."""

    leaf: int
    path: str
    kernel_pos: int            # operand index of the kernel in the dot_general
    x_batch: tuple[int, ...]   # x axes paired with the kernel's batch axes, kernel order
    x_contract: tuple[int, ...]
    x_free: tuple[int, ...]
    out_perm: tuple[int, ...]  # product output -> (*stack, *x free, *kernel free)
    stack: tuple[int, ...]
    d_in: int
    d_out: int
    out_aval: Any
    x_dtype: Any
    index: int = -1


@dataclasses.dataclass
class _Action:
    kind: str                  # "site" | "fast" | "inline"
    site: _Site | None = None
    x_input: int = -1          # fast: call input holding x
    plan: dict | None = None   # inline: the body's plan
    inner: str = ""            # inline: the param holding the body


def _dot_layout(eqn: Any, kernel_pos: int) -> tuple | None:
    """The kernel/x axis roles of a dot_general, or None for an unsupported layout."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k_c, x_c = (tuple(lc), tuple(rc)) if kernel_pos == 0 else (tuple(rc), tuple(lc))
    k_b, x_b = (tuple(lb), tuple(rb)) if kernel_pos == 0 else (tuple(rb), tuple(lb))
    k_aval, x_aval = eqn.invars[kernel_pos].aval, eqn.invars[1 - kernel_pos].aval
    nb, nc = len(k_b), len(k_c)
    k_free = tuple(a for a in range(k_aval.ndim) if a not in k_b and a not in k_c)
    if (tuple(sorted(k_b)) != tuple(range(nb)) or tuple(sorted(k_c)) != tuple(range(nb, nb + nc))
            or k_free != tuple(range(nb + nc, k_aval.ndim))):
        return None
    b_order = sorted(range(nb), key=lambda i: k_b[i])
    c_order = sorted(range(nc), key=lambda i: k_c[i])
    x_batch = tuple(x_b[i] for i in b_order)
    x_contract = tuple(x_c[i] for i in c_order)
    x_free = tuple(a for a in range(x_aval.ndim) if a not in x_b and a not in x_c)
    # Output axes: batch (dimension-number order), lhs free, rhs free.
    n_xf, n_kf = len(x_free), len(k_free)
    batch_pos = list(b_order)
    if kernel_pos == 0:
        k_free_pos, x_free_pos = range(nb, nb + n_kf), range(nb + n_kf, nb + n_kf + n_xf)
    else:
        x_free_pos, k_free_pos = range(nb, nb + n_xf), range(nb + n_xf, nb + n_xf + n_kf)
    shape = k_aval.shape
    return dict(x_batch=x_batch, x_contract=x_contract, x_free=x_free,
                out_perm=(*batch_pos, *x_free_pos, *k_free_pos), stack=tuple(shape[:nb]),
                d_in=math.prod(shape[nb:nb + nc]), d_out=math.prod(shape[nb + nc:]))


def _inner_jaxpr(eqn: Any) -> tuple[str, Any] | None:
    for name in ("jaxpr", "call_jaxpr"):
        if name in eqn.params:
            return name, eqn.params[name]
    return None


def _open(j: Any) -> Any:
    return j.jaxpr if isinstance(j, jex.core.ClosedJaxpr) else j


class _Analysis:
    """Walks a jaxpr once, deciding for every equation what the interpreter does."""

    def __init__(self, paths: list[str], wanted: Collection[str] | None):
        self.paths = paths
        self.wanted = wanted
        self.sites: list[_Site] = []
        self.uses: dict[int, int] = {}
        self.problems: dict[int, str] = {}

    def problem(self, leaf: int, why: str) -> None:
        self.problems.setdefault(leaf, why)

    def wants(self, leaf: int) -> bool:
        return self.wanted is None or self.paths[leaf] in self.wanted

    def site(self, eqn: Any, prov: dict, in_loop: bool) -> _Site | None:
        if eqn.primitive.name != "dot_general":
            return None
        sides = [prov.get(v) if isinstance(v, jex.core.Var) else None for v in eqn.invars]
        if (sides[0] is None) == (sides[1] is None):
            return None                      # no kernel, or param @ param
        kernel_pos = 0 if sides[0] is not None else 1
        leaf = sides[kernel_pos]
        if not self.wants(leaf):
            return None
        self.uses[leaf] = self.uses.get(leaf, 0) + 1
        if in_loop:
            self.problem(leaf, "it feeds a matmul inside a scan/while/cond body")
            return None
        layout = _dot_layout(eqn, kernel_pos)
        if layout is None:
            dn = eqn.params["dimension_numbers"]
            self.problem(leaf, f"its matmul layout (dimension numbers {dn}, kernel operand "
                               f"{kernel_pos}) is not (*batch, *contracting, *free) on the "
                               "kernel's axes")
            return None
        return _Site(leaf=leaf, path=self.paths[leaf], kernel_pos=kernel_pos,
                     out_aval=eqn.outvars[0].aval,
                     x_dtype=eqn.invars[1 - kernel_pos].aval.dtype, **layout)

    def fast_call(self, eqn: Any, prov: dict, in_loop: bool) -> _Action | None:
        """A custom_vjp/jvp call that is one captured product between pass-through ops."""
        if eqn.primitive.name not in _CUSTOM or in_loop or len(eqn.outvars) != 1:
            return None
        inner = _open(eqn.params["call_jaxpr"])
        if len(inner.invars) != len(eqn.invars):
            return None
        dots = [e for e in inner.eqns if e.primitive.name == "dot_general"]
        if len(dots) != 1 or any(e.primitive.name not in _PASS
                                 for e in inner.eqns if e is not dots[0]):
            return None
        source = {v: i for i, v in enumerate(inner.invars)}   # var -> call input
        from_dot = set(dots[0].outvars)
        for e in inner.eqns:
            if e.primitive.name == "dot_general":
                continue
            for i, o in zip(e.invars, e.outvars, strict=False):
                if isinstance(i, jex.core.Var) and i in source:
                    source[o] = source[i]
                if isinstance(i, jex.core.Var) and i in from_dot:
                    from_dot.add(o)
        out = inner.outvars[0]
        if not (isinstance(out, jex.core.Var) and out in from_dot):
            return None
        dot = dots[0]
        ins = [source.get(v) if isinstance(v, jex.core.Var) else None for v in dot.invars]
        if None in ins or ins[0] == ins[1]:
            return None
        outer = [eqn.invars[i] for i in ins]
        if eqn.outvars[0].aval.shape != dot.outvars[0].aval.shape:
            return None
        inner_prov = {v: prov[outer[k]] for k, v in enumerate(dot.invars)
                      if isinstance(outer[k], jex.core.Var) and outer[k] in prov}
        site = self.site(dot, inner_prov, in_loop)
        if site is None:
            return None
        site.out_aval = eqn.outvars[0].aval
        return _Action("fast", site=site, x_input=ins[1 - site.kernel_pos])

    def walk(self, jaxpr: Any, prov: dict, in_loop: bool = False) -> dict:
        plan: dict[int, _Action] = {}
        prov = dict(prov)
        for n, eqn in enumerate(jaxpr.eqns):
            name = eqn.primitive.name
            in_prov = [prov.get(v) if isinstance(v, jex.core.Var) else None
                       for v in eqn.invars]
            if name in _PASS:
                if name == "optimization_barrier":
                    for o, p in zip(eqn.outvars, in_prov, strict=True):
                        if p is not None:
                            prov[o] = p
                elif in_prov[0] is not None:
                    prov[eqn.outvars[0]] = in_prov[0]
                continue
            site = self.site(eqn, prov, in_loop)
            if site is not None:
                self.register(site)
                plan[n] = _Action("site", site=site)
                continue
            if all(p is None for p in in_prov):
                continue
            fast = self.fast_call(eqn, prov, in_loop)
            if fast is not None:
                self.register(fast.site)
                plan[n] = fast
                continue
            inner = _inner_jaxpr(eqn) if name in _CALLS else None
            if inner is not None:
                key, body = inner
                body = _open(body)
                sub_prov = {v: p for v, p in zip(body.invars, in_prov, strict=True)
                            if p is not None}
                sub_plan = self.walk(body, sub_prov, in_loop)
                if sub_plan:
                    plan[n] = _Action("inline", plan=sub_plan, inner=key)
                continue
            # Loops, conditionals and unknown higher-order primitives: look for captured
            # kernels inside, to report them (they are never captured).
            for body, inputs in self._bodies(eqn, in_prov):
                self.walk(body, {v: p for v, p in zip(body.invars, inputs, strict=False)
                                 if p is not None}, in_loop=True)
        return plan

    @staticmethod
    def _bodies(eqn: Any, in_prov: list) -> list[tuple[Any, list]]:
        name, p = eqn.primitive.name, eqn.params
        if name == "scan":
            return [(_open(p["jaxpr"]), in_prov)]
        if name == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            return [(_open(p["cond_jaxpr"]), in_prov[:nc] + in_prov[nc + nb:]),
                    (_open(p["body_jaxpr"]), in_prov[nc:])]
        if name == "cond":
            return [(_open(b), in_prov[1:]) for b in p["branches"]]
        # Unknown: conservatively, any param input may reach any invar of any body.
        leaves = [x for x in in_prov if x is not None]
        out = []
        for sub in jex.core.jaxprs_in_params(p):
            sub = _open(sub)
            out.append((sub, [leaves[0] if leaves else None] * len(sub.invars)))
        return out

    def register(self, site: _Site) -> None:
        site.index = len(self.sites)
        self.sites.append(site)


# --------------------------------------------------------------------------- interpreter
def _run(jaxpr: Any, consts: list, args: list, plan: dict, perts: list,
         records: list) -> list:
    env: dict = {}
    read = lambda v: v.val if isinstance(v, jex.core.Literal) else env[v]
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for n, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        action = plan.get(n)
        if action is not None and action.kind == "inline":
            body = eqn.params[action.inner]
            body_consts = body.consts if isinstance(body, jex.core.ClosedJaxpr) else []
            with eqn.ctx.manager:
                ans = _run(_open(body), list(body_consts), invals, action.plan, perts,
                           records)
            if not eqn.primitive.multiple_results:
                ans = ans[0]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **params)
            if action is not None:
                site = action.site
                if action.kind == "site":
                    records[site.index] = invals[1 - site.kernel_pos]
                    ans = ans + perts[site.index]
                else:                                       # "fast": keep the call
                    records[site.index] = invals[action.x_input].astype(site.x_dtype)
                    ans = [ans[0] + perts[site.index], *ans[1:]]
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, ans, strict=True):
                env[v] = x
        else:
            env[eqn.outvars[0]] = ans
    return [read(v) for v in jaxpr.outvars]


def _standard(site: _Site, x: jax.Array, dy: jax.Array) -> LayerStats:
    x = jnp.transpose(x, (*site.x_batch, *site.x_free, *site.x_contract))
    x = x.reshape(*site.stack, -1, site.d_in)
    dy = jnp.transpose(dy, site.out_perm).reshape(*site.stack, -1, site.d_out)
    return x, dy


def _bias_sibling(path: str, shapes: dict[str, tuple[int, ...]], site: _Site,
                  bias_name: str) -> bool:
    names = path.split("/")
    bias = "/".join([*names[:-1], bias_name])
    shape = shapes.get(bias)
    return (bias != path and shape is not None and tuple(shape[:len(site.stack)]) == site.stack
            and math.prod(shape[len(site.stack):]) == site.d_out)


def value_grad_and_stats(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    has_aux: bool = False,
    layers: Collection[str] | None = None,
    bias_name: str = "bias",
) -> tuple[Any, Any, dict[str, LayerStats]]:
    r"""Loss, gradients and K-FAC statistics of every dense layer, in one backward pass.

    Works on any JAX loss: the layers are found in the jaxpr of
    ``loss_fn(params, *args)`` (see the module docstring for what is captured), so a
    Flax NNX model of ``nnx.Linear`` / ``nnx.Einsum`` layers, a plain-JAX model or
    expert stacks need no changes. ``args`` are closed over (Python values stay static).

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (a float scalar), or ``(loss, aux)``
        with ``has_aux``.
      params: the parameters (any pytree of arrays).
      *args: the other arguments of ``loss_fn`` (batch, targets, PRNG key...).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      layers: paths (``"dense/kernel"``, the `optax_snoo._src.utils.path_to_str` of the
        leaf) of the kernels to capture; ``None``: every supported kernel (unsupported
        ones are skipped with a warning). A named kernel that is not found or not
        supported raises.
      bias_name: key of a kernel's bias sibling (sets `LayerStats.has_bias`).

    Returns:
      ``(value, grads, stats)``: ``value`` as ``loss_fn`` returns it; ``grads`` the
      gradient of the loss (tree of ``params``); ``stats`` a dict from kernel path to
      `LayerStats`. Feed K-FAC with `curvature_from_stats`.

    Raises:
      ValueError: a kernel named in ``layers`` that no product uses, or one that cannot
        be captured (its layout, weight sharing, a loop body).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import kfac
      >>> params = {"l1": {"kernel": jnp.ones((4, 8)) / 4, "bias": jnp.zeros(8)},
      ...           "l2": {"kernel": jnp.ones((8, 3)) / 8}}
      >>> def loss_fn(p, x, y):
      ...   h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
      ...   return optax.softmax_cross_entropy_with_integer_labels(
      ...       h @ p["l2"]["kernel"], y).mean()
      >>> x, y = jnp.ones((2, 5, 4)), jnp.zeros((2, 5), jnp.int32)
      >>> loss, grads, stats = kfac.value_grad_and_stats(loss_fn, params, x, y)
      >>> stats["l1/kernel"].inputs.shape, stats["l1/kernel"].has_bias
      ((10, 4), True)
      >>> tx = kfac.kfac(0.1, refresh=kfac.every(1, first=0))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params,
      ...                            curvature=kfac.curvature_from_stats(stats))

    References:
      Martens and Grosse, `Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature <https://arxiv.org/abs/1503.05671>`_, 2015

      Botev and Martens, `KFAC-JAX <https://github.com/google-deepmind/kfac-jax>`_, 2022
      (the jaxpr tracer this follows)
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_to_str(p) for p, _ in pairs]
    leaves = [leaf for _, leaf in pairs]
    wanted = None if layers is None else set(layers)
    if wanted is not None:
        if not all(isinstance(k, str) for k in wanted):
            raise ValueError(f"layers must be kernel paths (strings), got "
                             f"{sorted(map(repr, wanted))}.")
        unknown = sorted(wanted - set(paths))
        if unknown:
            raise ValueError(f"value_grad_and_stats: layers {unknown} are not paths of "
                             f"params leaves (e.g. {paths[:3]}).")

    def flat_loss(leaves):
        return loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), *args)

    closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(leaves)
    jaxpr = closed.jaxpr
    out_tree = jax.tree.structure(out_shape)
    analysis = _Analysis(paths, wanted)
    plan = analysis.walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)})
    for leaf, count in analysis.uses.items():
        if count > 1:
            analysis.problem(leaf, f"it feeds {count} matmuls (weight sharing)")
    problems = {paths[leaf]: why for leaf, why in analysis.problems.items()}
    if problems:
        lines = "; ".join(f"{p}: {why}" for p, why in sorted(problems.items()))
        if wanted is not None:
            raise ValueError(f"value_grad_and_stats cannot capture {lines}.")
        warnings.warn(f"value_grad_and_stats: not captured (K-FAC statistics skipped): "
                      f"{lines}.", stacklevel=2)
    sites = [s for s in analysis.sites if s.path not in problems]
    if wanted is not None:
        missing = sorted(wanted - {s.path for s in sites})
        if missing:
            raise ValueError(f"value_grad_and_stats: no matmul uses the kernels {missing} "
                             "(as an operand, directly or through dtype casts).")
    keep = {s.index for s in sites}
    perts = [jnp.zeros(s.out_aval.shape, s.out_aval.dtype) for s in analysis.sites]
    consts = list(closed.consts)

    def total(leaves, perts):
        records = [None] * len(analysis.sites)
        out = _run(jaxpr, consts, leaves, plan, perts, records)
        value = jax.tree_util.tree_unflatten(out_tree, out)
        loss = value[0] if has_aux else value
        return loss, (value, records)

    (_, (value, records)), (grads, dys) = jax.value_and_grad(
        total, argnums=(0, 1), has_aux=True)(leaves, perts)
    shapes = {p: tuple(jnp.shape(leaf)) for p, leaf in zip(paths, leaves, strict=True)}
    stats = {}
    for s in analysis.sites:
        if s.index not in keep:
            continue
        x, dy = _standard(s, records[s.index], dys[s.index])
        stats[s.path] = LayerStats(x, dy, _bias_sibling(s.path, shapes, s, bias_name))
    return value, jax.tree_util.tree_unflatten(treedef, grads), stats


def _every_nth(a: jax.Array, stride: int, offset: int | jax.Array) -> jax.Array:
    """Tokens ``offset, offset + stride, ...`` of ``a`` ``(..., N, d)``."""
    a = a.reshape(*a.shape[:-2], a.shape[-2] // stride, stride, a.shape[-1])
    return jax.lax.dynamic_index_in_dim(a, offset, axis=a.ndim - 2, keepdims=False)


def curvature_from_stats(
    stats: dict[str, LayerStats],
    *,
    num_tokens: int | jax.Array | None = None,
    token_stride: int = 1,
    token_offset: int | jax.Array = 0,
) -> dict[str, LayerCurvature]:
    r"""The ``curvature=`` argument of `kfac` / `scale_by_kfac` from captured statistics.

    For each layer, `layer_factors` of its inputs and output gradients (with the bias
    coordinate when `LayerStats.has_bias`): ``A = Σ x̃ x̃ᵀ / n`` and ``G = Σ g gᵀ / n``
    with ``g = M ∂L/∂y``. Stacked layers (MoE experts, ``(E, C, ·)``) get per-expert
    factors from each expert's own tokens: a slot whose input row is all zeros is an
    empty slot (zero-padded dispatch buffers) and is not counted.

    Args:
      stats: from `value_grad_and_stats`.
      num_tokens: ``M``, the number of tokens the mean loss averages over. Default: each
        dense layer's own token count ``N`` (right when the loss is the mean over the
        tokens the layer saw); required when ``stats`` holds a stacked layer.
      token_stride: use every ``token_stride``-th token only (cheaper factors; over
        ``token_stride`` steps with ``token_offset = step % token_stride`` every token is
        used once). ``N`` must be divisible by it. Stacked layers use all their slots
        (each expert already sees a fraction of the tokens).
      token_offset: first token used (``0 <= offset < token_stride``), may be traced.

    Returns:
      A dict from kernel path to `LayerCurvature` (float32).

    Raises:
      ValueError: a stacked layer without ``num_tokens``, a bad ``token_stride`` or one
        that does not divide a layer's token count.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.kfac import LayerStats, curvature_from_stats
      >>> s = {"l/kernel": LayerStats(jnp.ones((6, 4)), jnp.full((6, 2), 1 / 6))}
      >>> c = curvature_from_stats(s)
      >>> c["l/kernel"].a.shape, float(c["l/kernel"].g[0, 0])
      ((4, 4), 1.0)
    """
    check_int_at_least("token_stride", token_stride, 1)
    out = {}
    for path, s in stats.items():
        x, dy = s.inputs, s.out_grads
        stacked = x.ndim > 2
        n = x.shape[-2]
        if stacked and num_tokens is None:
            raise ValueError(
                f"curvature_from_stats: {path} is a stack of layers {x.shape[:-2]} (e.g. "
                "MoE experts): pass num_tokens, the number of tokens the mean loss averages "
                "over, which the expert slots do not determine.")
        m = n if num_tokens is None else num_tokens
        if token_stride > 1 and not stacked:
            if n % token_stride:
                raise ValueError(f"token_stride={token_stride} must divide the token count "
                                 f"{n} of {path}.")

            x, dy = (_every_nth(a, token_stride, token_offset) for a in (x, dy))
        if stacked:
            lead = x.shape[:-2]
            x3 = x.reshape(-1, *x.shape[-2:])
            dy3 = dy.reshape(-1, *dy.shape[-2:])
            mask = jnp.any(x3 != 0, axis=-1)
            f = layer_factors(x3, dy3, s.has_bias, mask=mask, num_tokens=m, stacked=True)
            f = LayerCurvature(f.a.reshape(*lead, *f.a.shape[1:]),
                               f.g.reshape(*lead, *f.g.shape[1:]))
        else:
            f = layer_factors(x, dy, s.has_bias, num_tokens=m)
        out[path] = f
    return out
