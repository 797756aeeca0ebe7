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
free axes (``d_out``), in any order and also through ``transpose`` (``x @ W.T`` on a
PyTorch-style ``(out, in)`` kernel): the statistics follow the product, and
`LayerStats.kernel_axes` (passed on as `LayerCurvature.kernel_axes`) records the
permutation of the kernel's axes to ``(*batch, *contracting, *free)``, so `scale_by_kfac`
preconditions the gradient in the kernel's own layout. ``nnx.Linear`` ``(in, out)``,
``nnx.Einsum`` kernels such as ``"btd,dnh->btnh"`` (``d_in = d``, ``d_out = n·h``) and
expert stacks ``(E, in, out)`` need no permutation. The ``x`` side may be in any layout.

Convolutions (``conv_general_dilated`` with a params-leaf kernel, ``nnx.Conv``; any
spatial rank, strides, padding, dilations) record the input and turn it into its patches
(``conv_general_dilated_patches``): ``d_in = in_channels · window``, one row per example
and output position (Grosse & Martens 2016). Grouped and depthwise convolutions
(``feature_group_count`` or ``batch_group_count`` > 1) are not captured.

A kernel read by several products in the same layout (weight sharing) gets all their
rows, concatenated (`LayerStats.uses`; K-FAC-expand, see `curvature_from_stats`).

Scanned layers (``jax.lax.scan`` / ``nnx.scan`` over a stacked params leaf passed as the
scan's ``xs``, as MaxText and levanter compile their layers): a product in the body
whose kernel is the iteration's slice is captured per layer, the scan re-run with the
perturbations as extra ``xs`` and the inputs as extra outputs; the statistics are
stacked ``(L, N, ·)`` (`LayerStats.scanned`) and the factors ``(L, d, d)``, preconditioned
as a stack like expert stacks.

Not captured, each named with its reason (a warning when ``layers=None``, an error
when the kernel is named in ``layers``): products inside ``while`` / ``cond`` bodies or
nested scans, a kernel a scan body reads whole (a constant of the loop), convolutions
inside a scan, a kernel used in different layouts, grouped convolutions, and a leaf
called ``kernel`` that reaches the loss only through other ops (``x @ (2 * W)``).
`describe` lists what is captured, and why not.

Statistics (`LayerStats`, keyed by the kernel's path, `optax_snoo._src.utils.
path_to_str`): ``inputs`` ``(*stack, N, d_in)`` and ``out_grads`` ``(*stack, N, d_out)``,
the ``N`` tokens being every free axis of ``x`` flattened in order (a convolution's
examples and output positions) (``B·T`` for a
``(B, T, d)`` input; the capacity slots ``C`` of an expert buffer ``(E, C, d)``), in the
dtypes the product saw. ``out_grads`` are the gradients of the loss as written: for a
mean over ``M`` tokens they are ``1/M`` of the per-token gradients (`layer_factors` and
`curvature_from_stats` rescale them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp

from optax_snoo._src.kfac.description import Description
from optax_snoo._src.kfac.factors import LayerCurvature, layer_factors
from optax_snoo._src.utils import check_int_at_least, path_to_str

_PASS = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier",
                   "sharding_constraint"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat",
                    "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_HIGHEST = jax.lax.Precision.HIGHEST
_FIXED = "fixed"   # provenance inside a scan body: a constant or the carry, not a slice
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One kernel's batch statistics from `value_grad_and_stats` (a pytree).

    Attributes:
      inputs: the layer inputs ``x`` (for a convolution, its input patches),
        ``(*stack, N, d_in)``.
      out_grads: ``∂L/∂y`` of the loss as written, ``(*stack, N, d_out)``.
      has_bias: whether the params tree has a bias sibling for this kernel (the leaf
        named ``"bias"`` next to it, of ``stack + d_out`` elements); static.
      kernel_axes: static: the kernel's axes in the order ``(*stack, *inputs,
        *outputs)`` that ``d_in`` and ``d_out`` flatten (`LayerCurvature.kernel_axes`);
        ``None`` when the kernel is stored in that order.
      locations: static: output positions per example that one kernel application
        repeats over (a convolution's spatial output size; 1 for a matmul).
      uses: static: number of products that read this kernel (weight sharing); their
        rows are concatenated along ``N``.
      scanned: static: the first stack axis is the layer axis of a stacked leaf a
        ``scan`` walks (one layer per iteration, each seeing all ``N`` tokens).
    """

    inputs: jax.Array
    out_grads: jax.Array
    has_bias: bool = False
    kernel_axes: tuple[int, ...] | None = None
    locations: int = 1
    uses: int = 1
    scanned: bool = False


jax.tree_util.register_dataclass(
    LayerStats, data_fields=["inputs", "out_grads"],
    meta_fields=["has_bias", "kernel_axes", "locations", "uses", "scanned"])


# ------------------------------------------------------------------------------ analysis
@dataclasses.dataclass
class _Site:
    """A captured product: the kernel leaf, its layout and the perturbation's type."""

    leaf: int
    path: str
    kind: str                  # "dense" | "conv"
    kernel_pos: int            # operand index of the kernel
    kernel_axes: tuple[int, ...] | None
    out_perm: tuple[int, ...]  # product output -> (*stack, *tokens, *kernel free)
    stack: tuple[int, ...]
    d_in: int
    d_out: int
    out_aval: Any
    x_dtype: Any
    x_batch: tuple[int, ...] = ()    # dense: x axes paired with the kernel's batch axes
    x_contract: tuple[int, ...] = ()
    x_free: tuple[int, ...] = ()
    locations: int = 1               # conv: output positions per example
    conv: dict | None = None         # conv: the arguments of conv_general_dilated_patches
    scanned: bool = False            # in a scan body: records and perturbations (L, ...)
    index: int = -1

    @property
    def pert_shape(self) -> tuple[int, ...]:
        return (*self.stack[:1], *self.out_aval.shape) if self.scanned else self.out_aval.shape

    def signature(self) -> tuple:
        return (self.kind, self.kernel_axes, self.stack, self.d_in, self.d_out, self.locations,
                self.scanned)


@dataclasses.dataclass
class _Action:
    kind: str                  # "site" | "fast" | "inline"
    site: _Site | None = None
    x_input: int = -1          # fast: call input holding x
    plan: dict | None = None   # inline / scan: the body's plan
    inner: str = ""            # inline: the param holding the body
    indices: tuple[int, ...] = ()  # scan: the sites inside its body


def _axes_or_none(axes: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if axes == tuple(range(len(axes))) else tuple(int(a) for a in axes)


def _dot_layout(eqn: Any, kernel_pos: int, perm: tuple[int, ...]) -> dict:
    """The kernel/x axis roles of a dot_general whose kernel operand is the params leaf
    with its axes permuted by ``perm`` (operand axis i is leaf axis ``perm[i]``)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k_c, x_c = (tuple(lc), tuple(rc)) if kernel_pos == 0 else (tuple(rc), tuple(lc))
    k_b, x_b = (tuple(lb), tuple(rb)) if kernel_pos == 0 else (tuple(rb), tuple(lb))
    k_aval, x_aval = eqn.invars[kernel_pos].aval, eqn.invars[1 - kernel_pos].aval
    nb = len(k_b)
    k_free = tuple(a for a in range(k_aval.ndim) if a not in k_b and a not in k_c)
    x_free = tuple(a for a in range(x_aval.ndim) if a not in x_b and a not in x_c)
    # Output axes: batch (dimension-number order), lhs free, rhs free.
    n_xf, n_kf = len(x_free), len(k_free)
    if kernel_pos == 0:
        k_free_pos, x_free_pos = range(nb, nb + n_kf), range(nb + n_kf, nb + n_kf + n_xf)
    else:
        x_free_pos, k_free_pos = range(nb, nb + n_xf), range(nb + n_xf, nb + n_xf + n_kf)
    # Each group of kernel axes in the params leaf's own order (kernel_axes None when the
    # leaf is (*batch, *contracting, *free)), with the paired x / output axes alongside.
    by_leaf = lambda axes: sorted(range(len(axes)), key=lambda i: perm[axes[i]])
    b_order, c_order, f_order = by_leaf(k_b), by_leaf(k_c), by_leaf(k_free)
    k_b, x_b = tuple(k_b[i] for i in b_order), tuple(x_b[i] for i in b_order)
    k_c, x_c = tuple(k_c[i] for i in c_order), tuple(x_c[i] for i in c_order)
    k_free, k_free_pos = tuple(k_free[i] for i in f_order), tuple(k_free_pos[i] for i in f_order)
    shape = k_aval.shape
    return dict(kind="dense", x_batch=x_b, x_contract=x_c, x_free=x_free,
                out_perm=(*b_order, *x_free_pos, *k_free_pos),
                kernel_axes=_axes_or_none(tuple(perm[a] for a in (*k_b, *k_c, *k_free))),
                stack=tuple(shape[a] for a in k_b), d_in=math.prod(shape[a] for a in k_c),
                d_out=math.prod(shape[a] for a in k_free))


def _conv_layout(eqn: Any, kernel_pos: int, perm: tuple[int, ...]) -> dict | str:
    """The layout of a conv_general_dilated with a params-leaf kernel, or why not."""
    p = eqn.params
    if kernel_pos != 1:
        return "a convolution takes it as the input (lhs), not as the kernel"
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return (f"its convolution has feature_group_count={p['feature_group_count']}, "
                f"batch_group_count={p['batch_group_count']} (grouped and depthwise "
                "convolutions are not supported: 1 expected)")
    dn = p["dimension_numbers"]
    k_shape = eqn.invars[1].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    o_axis, i_axis, spatial = dn.rhs_spec[0], dn.rhs_spec[1], tuple(dn.rhs_spec[2:])
    # Patch features are ordered (in channel, *spatial in rhs_spec order).
    order = (i_axis, *spatial, o_axis)
    conv = dict(filter_shape=tuple(k_shape[a] for a in spatial),
                window_strides=p["window_strides"], padding=p["padding"],
                lhs_dilation=p["lhs_dilation"], rhs_dilation=p["rhs_dilation"],
                dimension_numbers=dn)
    out = dn.out_spec
    return dict(kind="conv", out_perm=(out[0], *out[2:], out[1]),
                kernel_axes=_axes_or_none(tuple(perm[a] for a in order)), stack=(),
                d_in=math.prod(k_shape[a] for a in order[:-1]), d_out=k_shape[o_axis],
                locations=math.prod(out_shape[a] for a in out[2:]), conv=conv)


def _inner_jaxpr(eqn: Any) -> tuple[str, Any] | None:
    for name in ("jaxpr", "call_jaxpr"):
        if name in eqn.params:
            return name, eqn.params[name]
    return None


def _open(j: Any) -> Any:
    return j.jaxpr if isinstance(j, jex.core.ClosedJaxpr) else j


class _Analysis:
    """Walks a jaxpr once, deciding for every equation what the interpreter does.

    Provenance: a var derived from params leaf ``i`` through pass-through ops and
    transposes maps to ``(i, perm, scan)``, its axis ``j`` being the leaf's axis
    ``perm[j]``; ``scan`` is None outside loops, inside a scan body the leaf axis its
    ``xs`` slices (one layer per iteration), or ``_FIXED`` for the scan's constants and
    carry.
    """

    def __init__(self, paths: list[str], shapes: list[tuple[int, ...]],
                 wanted: Collection[str] | None):
        self.paths = paths
        self.shapes = shapes
        self.wanted = wanted
        self.sites: list[_Site] = []
        self.problems: dict[int, str] = {}
        self.others: dict[int, set[str]] = {}   # leaf -> other primitives that read it

    def problem(self, leaf: int, why: str) -> None:
        self.problems.setdefault(leaf, why)

    def other(self, leaf: int, name: str) -> None:
        self.others.setdefault(leaf, set()).add(name)

    def wants(self, leaf: int) -> bool:
        return self.wanted is None or self.paths[leaf] in self.wanted

    def site(self, eqn: Any, prov: dict, in_loop: bool) -> _Site | None:
        name = eqn.primitive.name
        if name not in ("dot_general", "conv_general_dilated"):
            return None
        sides = [prov.get(v) if isinstance(v, jex.core.Var) else None for v in eqn.invars]
        if sides[0] is None and sides[1] is None:
            return None
        if sides[0] is not None and sides[1] is not None:
            for side in sides:
                self.other(side[0], f"{name} with another params leaf")
            return None
        kernel_pos = 0 if sides[0] is not None else 1
        leaf, perm, scan = sides[kernel_pos]
        if not self.wants(leaf):
            return None
        if in_loop:
            self.problem(leaf, "it feeds a matmul or convolution inside a while/cond body "
                               "or a nested scan")
            return None
        if scan == _FIXED:
            self.problem(leaf, "a scan body reads it whole on every iteration (a stacked "
                               "leaf sliced by the scan's xs is captured per layer)")
            return None
        if name == "conv_general_dilated":
            layout = (_conv_layout(eqn, kernel_pos, perm) if scan is None else
                      "it feeds a convolution inside a scan body")
        else:
            layout = _dot_layout(eqn, kernel_pos, perm)
        if isinstance(layout, str):
            self.problem(leaf, layout)
            return None
        if scan is not None:      # a slice of the stacked leaf: one layer per iteration
            inner = layout["kernel_axes"] or tuple(range(len(perm)))
            layout.update(kernel_axes=_axes_or_none((scan, *inner)), scanned=True,
                          stack=(self.shapes[leaf][scan], *layout["stack"]))
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

    def scan(self, eqn: Any, in_prov: list) -> _Action | None:
        """A scan whose body reads slices of stacked params leaves through its ``xs``."""
        p = eqn.params
        fixed = p["num_consts"] + p["num_carry"]
        body = _open(p["jaxpr"])
        body_prov = {}
        for i, (v, src) in enumerate(zip(body.invars, in_prov, strict=True)):
            if src is None:
                continue
            leaf, perm, _ = src
            body_prov[v] = ((leaf, perm, _FIXED) if i < fixed
                            else (leaf, perm[1:], perm[0]))
        start = len(self.sites)
        sub_plan = self.walk(body, body_prov, in_scan=True)
        if not sub_plan:
            return None
        return _Action("scan", plan=sub_plan,
                       indices=tuple(s.index for s in self.sites[start:]))

    def walk(self, jaxpr: Any, prov: dict, in_loop: bool = False,
             in_scan: bool = False) -> dict:
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
            if name == "transpose" and in_prov[0] is not None:
                leaf, perm, scan = in_prov[0]
                prov[eqn.outvars[0]] = (
                    leaf, tuple(perm[a] for a in eqn.params["permutation"]), scan)
                continue
            if name == "scan" and not in_loop and not in_scan:
                action = self.scan(eqn, in_prov)
                if action is not None:
                    plan[n] = action
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
                sub_plan = self.walk(body, sub_prov, in_loop, in_scan)
                if sub_plan:
                    plan[n] = _Action("inline", plan=sub_plan, inner=key)
                continue
            bodies = self._bodies(eqn, in_prov)
            if not bodies:
                for p in in_prov:
                    if p is not None:
                        self.other(p[0], name)
            # Loops, conditionals and unknown higher-order primitives: look for captured
            # kernels inside, to report them (they are never captured).
            for body, inputs in bodies:
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

    def finish(self, shapes: list[tuple[int, ...]]) -> tuple[dict, dict]:
        """``(captured, skipped)``: path -> its sites (all of one layout), and path -> why
        not, for every kernel K-FAC will not precondition (a named one, or any leaf called
        ``kernel`` with two or more axes, or one that a product reads in a way not
        captured)."""
        by_leaf: dict[int, list[_Site]] = {}
        for s in self.sites:
            by_leaf.setdefault(s.leaf, []).append(s)
        for leaf, sites in by_leaf.items():
            kinds = {s.signature() for s in sites}
            if len(kinds) > 1:
                self.problem(leaf, f"it feeds {len(sites)} products in different layouts "
                                   "(shared weights are captured when every use has the "
                                   "same kernel layout)")
        captured = {self.paths[leaf]: sites for leaf, sites in by_leaf.items()
                    if leaf not in self.problems}
        skipped = {self.paths[leaf]: why for leaf, why in self.problems.items()}
        for leaf, path in enumerate(self.paths):
            if path in captured or path in skipped:
                continue
            named = self.wanted is not None and path in self.wanted
            kernel_like = (self.wanted is None and path.split("/")[-1] == "kernel"
                           and len(shapes[leaf]) >= 2)
            if not (named or kernel_like):
                continue
            reads = sorted(self.others.get(leaf, ()))
            skipped[path] = (f"it reaches the loss only through {', '.join(reads)}, not as "
                             "the kernel operand of a matmul or convolution (directly or "
                             "through casts and transposes)" if reads else
                             "the loss does not read it")
        return captured, skipped


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
        if action is not None and action.kind == "scan":
            ans = _run_scan(eqn, invals, action, perts, records)
        elif action is not None and action.kind == "inline":
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


def _run_scan(eqn: Any, invals: list, action: _Action, perts: list, records: list) -> list:
    """A scan with captured products in its body: their perturbations enter as extra
    ``xs`` (one slice per iteration) and their inputs leave as extra ``ys``."""
    p = eqn.params
    body = p["jaxpr"]
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

    def step(carry, inputs):
        xs_i, perts_i = inputs
        local_perts = list(perts)
        for i, pert in zip(action.indices, perts_i, strict=True):
            local_perts[i] = pert
        local_records = [None] * len(records)
        out = _run(_open(body), list(body.consts), [*consts, *carry, *xs_i], action.plan,
                   local_perts, local_records)
        return out[:ncar], (out[ncar:], [local_records[i] for i in action.indices])

    with eqn.ctx.manager:
        carry, (ys, recorded) = jax.lax.scan(
            step, list(init), (list(xs), [perts[i] for i in action.indices]),
            length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    for i, x in zip(action.indices, recorded, strict=True):
        records[i] = x
    return [*carry, *ys]


def _standard(site: _Site, x: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` (a convolution's input patches) ``(*stack, N, d_in)`` and ``dy``
    ``(*stack, N, d_out)`` of one product."""
    # A scanned site's records lead with the layer axis: the first stack axis.
    lead = (lambda axes: (0, *(a + 1 for a in axes))) if site.scanned else tuple
    if site.kind == "conv":
        x = jax.lax.conv_general_dilated_patches(x, precision=_HIGHEST, **site.conv)
        x = jnp.transpose(x, site.out_perm)
    else:
        x = jnp.transpose(x, lead((*site.x_batch, *site.x_free, *site.x_contract)))
    x = x.reshape(*site.stack, -1, site.d_in)
    dy = jnp.transpose(dy, lead(site.out_perm)).reshape(*site.stack, -1, site.d_out)
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
    r"""Loss, gradients and K-FAC statistics of every layer, in one backward pass.

    Works on any JAX loss: the layers are found in the jaxpr of
    ``loss_fn(params, *args)`` (see the module docstring for what is captured), so a
    Flax NNX model of ``nnx.Linear`` / ``nnx.Einsum`` / ``nnx.Conv`` layers, a plain-JAX
    model, PyTorch-layout ``(out, in)`` kernels, shared kernels or expert stacks need no
    changes. `describe` says what it captures. ``args`` are closed over (Python values stay static).

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
      ValueError: a kernel named in ``layers`` that cannot be captured, with the reason
        (a while/cond body, uses in different layouts, a grouped convolution, no matmul
        or convolution reads it as its kernel).

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

      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016
    """
    trace = _trace(loss_fn, params, args, layers, "value_grad_and_stats")
    if trace.skipped:
        lines = "; ".join(f"{p}: {why}" for p, why in sorted(trace.skipped.items()))
        if layers is not None:
            raise ValueError(f"value_grad_and_stats cannot capture {lines}.")
        warnings.warn(f"value_grad_and_stats: not captured (K-FAC statistics skipped, "
                      f"these kernels get no curvature): {lines}.", stacklevel=2)
    analysis, jaxpr, plan = trace.analysis, trace.closed.jaxpr, trace.plan
    leaves = jax.tree_util.tree_leaves(params)
    perts = [jnp.zeros(s.pert_shape, s.out_aval.dtype) for s in analysis.sites]
    consts = list(trace.closed.consts)

    def total(leaves, perts):
        records = [None] * len(analysis.sites)
        out = _run(jaxpr, consts, leaves, plan, perts, records)
        value = jax.tree_util.tree_unflatten(trace.out_tree, out)
        loss = value[0] if has_aux else value
        return loss, (value, records)

    (_, (value, records)), (grads, dys) = jax.value_and_grad(
        total, argnums=(0, 1), has_aux=True)(leaves, perts)
    stats = {}
    for path, sites in trace.captured.items():
        xs, dys_ = zip(*(_standard(s, records[s.index], dys[s.index]) for s in sites),
                       strict=True)
        s = sites[0]
        stats[path] = LayerStats(
            jnp.concatenate(xs, axis=-2) if len(xs) > 1 else xs[0],
            jnp.concatenate(dys_, axis=-2) if len(dys_) > 1 else dys_[0],
            _bias_sibling(path, trace.shapes, s, bias_name), s.kernel_axes, s.locations,
            len(sites), s.scanned)
    return value, jax.tree_util.tree_unflatten(trace.treedef, grads), stats


@dataclasses.dataclass
class _Trace:
    closed: Any
    out_tree: Any
    treedef: Any
    paths: list[str]
    shapes: dict[str, tuple[int, ...]]
    analysis: _Analysis
    plan: dict
    captured: dict[str, list[_Site]]
    skipped: dict[str, str]


def _trace(loss_fn: Callable[..., Any], params: Any, args: tuple,
           layers: Collection[str] | None, who: str) -> _Trace:
    """The loss's jaxpr over the flat params, and which kernels are captured (or why not)."""
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
            raise ValueError(f"{who}: layers {unknown} are not paths of params leaves "
                             f"(e.g. {paths[:3]}).")

    def flat_loss(leaves):
        return loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), *args)

    closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(leaves)
    shapes = [tuple(jnp.shape(leaf)) for leaf in leaves]
    analysis = _Analysis(paths, shapes, wanted)
    jaxpr = closed.jaxpr
    plan = analysis.walk(jaxpr, {v: (i, tuple(range(v.aval.ndim)), None)
                                 for i, v in enumerate(jaxpr.invars)})
    captured, skipped = analysis.finish(shapes)
    return _Trace(closed, jax.tree.structure(out_shape), treedef, paths,
                  dict(zip(paths, shapes, strict=True)), analysis, plan, captured, skipped)


def describe(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    layers: Collection[str] | None = None,
    bias_name: str = "bias",
) -> Description:
    r"""What K-FAC's capture makes of each params leaf: a kernel's kind, or why not.

    Traces ``loss_fn(params, *args)`` as `value_grad_and_stats` does (no computation:
    ``params`` and ``args`` may be ``jax.ShapeDtypeStruct``) and describes every leaf:

    - a captured kernel: ``"dense"`` or ``"conv"`` with ``d_in``/``d_out``, then any of
      ``"scanned stack (L,)"``, ``"expert stack (E,)"``, ``"transposed"`` (stored in
      another axis order than ``(*stack, *in, *out)``: `LayerCurvature.kernel_axes`),
      ``"shared by k products"``, ``"with bias b"``, and ``"also read by gather"``
      when other ops read it too (their share of its gradient is preconditioned with
      these factors);
    - a kernel that will not be preconditioned: ``"skipped: <why>"`` (the reasons
      `value_grad_and_stats` warns or raises with);
    - any other leaf: ``"first-order: read by <ops>"`` (or ``"unused"``).

    Args:
      loss_fn: ``loss_fn(params, *args)``, as for `value_grad_and_stats`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the other arguments of ``loss_fn``.
      layers: kernel paths to capture (``None``: every one), as for
        `value_grad_and_stats`.
      bias_name: key of a kernel's bias sibling.

    Returns:
      A dict from each leaf's path (in leaf order) to its description, which prints as
      a table (`Description`).

    Raises:
      ValueError: ``layers`` naming a path that is not a params leaf.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from optax_snoo import kfac
      >>> p = {"c": {"kernel": jnp.ones((3, 3, 1, 4)), "bias": jnp.zeros(4)},
      ...      "head": {"kernel": jnp.ones((2, 4 * 36))}}          # PyTorch (out, in)
      >>> def loss_fn(p, x):
      ...   h = jax.lax.conv_general_dilated(x, p["c"]["kernel"], (1, 1), "VALID",
      ...       dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["c"]["bias"]
      ...   return jnp.mean(h.reshape(len(x), -1) @ p["head"]["kernel"].T)
      >>> print(kfac.describe(loss_fn, p, jnp.ones((2, 8, 8, 1))))
      leaf         K-FAC
      c/bias       bias of c/kernel
      c/kernel     conv, d_in 9, d_out 4, 36 locations, kernel axes (2, 0, 1, 3), with bias c/bias
      head/kernel  dense, d_in 144, d_out 2, transposed (1, 0)
      2 kernels preconditioned, 0 skipped, 1 other leaf (biases go with their kernel)

    References:
      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016
    """
    trace = _trace(loss_fn, params, args, layers, "describe")
    out, biases = {}, {}
    for path, sites in trace.captured.items():
        s = sites[0]
        words = [s.kind, f"d_in {s.d_in}", f"d_out {s.d_out}"]
        if s.kind == "conv":
            words.append(f"{s.locations} locations")
        if s.scanned:
            words.append(f"scanned stack ({s.stack[0]},)")
        if s.stack[s.scanned:]:
            words.append(f"expert stack {s.stack[s.scanned:]}")
        if s.kernel_axes is not None:
            words.append(f"{'transposed' if s.kind == 'dense' else 'kernel axes'} "
                         f"{s.kernel_axes}")
        if len(sites) > 1:
            words.append(f"shared by {len(sites)} products")
        if _bias_sibling(path, trace.shapes, s, bias_name):
            bias = "/".join([*path.split("/")[:-1], bias_name])
            biases[bias] = path
            words.append(f"with bias {bias}")
        reads = trace.analysis.others.get(trace.paths.index(path))
        if reads:
            words.append(f"also read by {', '.join(sorted(reads))}")
        out[path] = ", ".join(words)
    for i, path in enumerate(trace.paths):
        if path in out:
            continue
        if path in trace.skipped:
            out[path] = f"skipped: {trace.skipped[path]}"
        elif path in biases:
            out[path] = f"bias of {biases[path]}"
        else:
            reads = sorted(trace.analysis.others.get(i, ()))
            out[path] = f"first-order: read by {', '.join(reads)}" if reads else "unused"
    return Description({path: out[path] for path in trace.paths})


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
    scatter_axes: Sequence[str] | None = None,
) -> dict[str, LayerCurvature]:
    r"""The ``curvature=`` argument of `kfac` / `scale_by_kfac` from captured statistics.

    For each layer, `layer_factors` of its inputs and output gradients (with the bias
    coordinate when `LayerStats.has_bias`): ``A = Σ x̃ x̃ᵀ / n`` and ``G = Σ g gᵀ / n``
    with ``g = M ∂L/∂y``. Stacked layers (MoE experts, ``(E, C, ·)``) get per-expert
    factors from each expert's own tokens: a slot whose input row is all zeros is an
    empty slot (zero-padded dispatch buffers) and is not counted.

    A convolution (``S = LayerStats.locations`` output positions per example) follows
    Grosse & Martens (KFC) and kfac-jax's ``Conv2DTwoKroneckerFactored``: ``A`` and
    ``G`` are means over examples and positions, and ``G`` carries KFC's factor ``S``
    (kfac-jax's ``fixed_scale``): ``G = S·M²·mean(dy dyᵀ)``. A kernel shared by ``k``
    products (``LayerStats.uses``) follows K-FAC-expand (Eschenhagen et al. 2023): its
    uses count as more tokens of one layer, ``A`` the mean over all of them and ``G``
    the sum of the uses' own ``G`` (``k·M²·mean(dy dyᵀ)``).

    Args:
      stats: from `value_grad_and_stats`.
      num_tokens: ``M``, the number of terms the mean loss averages over (tokens for a
        language model, examples for an image classifier). Default: each layer's own
        ``N / (locations · uses)``, the tokens of a dense layer or the examples of a
        convolution (right when the loss is the mean over those); required when
        ``stats`` holds a stacked layer.
      token_stride: use every ``token_stride``-th token only (cheaper factors; over
        ``token_stride`` steps with ``token_offset = step % token_stride`` every token is
        used once). ``N`` must be divisible by it. Stacked layers use all their slots
        (each expert already sees a fraction of the tokens).
      token_offset: first token used (``0 <= offset < token_stride``), may be traced.
      scatter_axes: the mesh axes splitting the tokens: dense factors come back with
        their rows split over them by one reduce-scatter (`layer_factors`), for
        `scale_by_kfac` with the same ``stats_axes``. None: as the partitioner places them.

    Returns:
      A dict from kernel path to `LayerCurvature` (float32, with the kernel's
      ``kernel_axes``).

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

    References:
      Grosse and Martens, `A Kronecker-factored approximate Fisher matrix for
      convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016

      Eschenhagen et al., `Kronecker-Factored Approximate Curvature for Modern Neural
      Network Architectures <https://arxiv.org/abs/2311.00636>`_, 2023
    """
    check_int_at_least("token_stride", token_stride, 1)
    out = {}
    for path, s in stats.items():
        x, dy = s.inputs, s.out_grads
        layers_only = s.scanned and x.ndim == 3   # (L, N, d): every layer sees every token
        stacked = x.ndim > 2 and not layers_only
        n = x.shape[-2]
        if stacked and num_tokens is None:
            raise ValueError(
                f"curvature_from_stats: {path} is a stack of layers {x.shape[:-2]} (e.g. "
                "MoE experts): pass num_tokens, the number of tokens the mean loss averages "
                "over, which the expert slots do not determine.")
        # KFC's |T| and K-FAC-expand's sum over uses: G = uses·locations·M²·mean(dy dyᵀ).
        repeats = s.uses * s.locations
        m = n // repeats if num_tokens is None else num_tokens
        m = m * math.sqrt(repeats) if repeats > 1 else m
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
        elif layers_only:
            f = jax.vmap(functools.partial(layer_factors, has_bias=s.has_bias,
                                           num_tokens=m))(x, dy)
        else:
            f = layer_factors(x, dy, s.has_bias, num_tokens=m, scatter_axes=scatter_axes)
        out[path] = LayerCurvature(f.a, f.g, s.kernel_axes)
    return out
