"""Which products of a loss's jaxpr K-FAC captures, and how: the analysis half of capture.

`trace_loss` traces the loss over the flat params and walks its jaxpr once
(`Analysis`), following every params leaf through pass-through ops, transposes, nested
calls and scan bodies (its `Provenance`), and returns a plan: for each equation that the
interpreter (`optax_snoo._src.kfac.interpreter`) must treat specially, an `Action`.
What is captured and why not is described in `optax_snoo._src.kfac.capture`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any, Literal, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp

from optax_snoo._src.utils import path_to_str

_PASS = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier",
                   "sharding_constraint"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat",
                    "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


SiteKind = Literal["dense", "conv"]
# What the interpreter does at an equation: "site" records x and perturbs the product;
# "fast" does so around a custom_vjp/jvp call kept whole; "inline" runs a call's body
# with its own plan; "scan" re-runs a scan with perturbations in and records out.
ActionKind = Literal["site", "fast", "inline", "scan"]


class Provenance(NamedTuple):
    """Where a jaxpr var comes from: params leaf ``leaf`` through pass-through ops and
    transposes, its axis ``j`` being the leaf's axis ``perm[j]``.

    Attributes:
      leaf: index of the params leaf.
      perm: the leaf's axis behind each of the var's axes.
      sliced_axis: inside a scan body, the leaf axis the scan's ``xs`` slices (one layer
        per iteration); None otherwise.
      loop_constant: inside a scan body, the var is one of the scan's constants or its
        carry (the whole leaf on every iteration, not a slice).
    """

    leaf: int
    perm: tuple[int, ...]
    sliced_axis: int | None = None
    loop_constant: bool = False


@dataclasses.dataclass
class Site:
    """A captured product: the kernel leaf, its layout and the perturbation's type."""

    leaf: int
    path: str
    kind: SiteKind
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
class Action:
    """What the interpreter does at one equation of the plan."""

    kind: ActionKind
    site: Site | None = None
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


def open_jaxpr(j: Any) -> Any:
    return j.jaxpr if isinstance(j, jex.core.ClosedJaxpr) else j


class Analysis:
    """Walks a jaxpr once, deciding for every equation what the interpreter does.

    ``prov`` maps each var derived from a params leaf to its `Provenance`.
    """

    def __init__(self, paths: list[str], shapes: list[tuple[int, ...]],
                 wanted: Collection[str] | None):
        self.paths = paths
        self.shapes = shapes
        self.wanted = wanted
        self.sites: list[Site] = []
        self.problems: dict[int, str] = {}
        self.others: dict[int, set[str]] = {}   # leaf -> other primitives that read it

    def problem(self, leaf: int, why: str) -> None:
        self.problems.setdefault(leaf, why)

    def other(self, leaf: int, name: str) -> None:
        self.others.setdefault(leaf, set()).add(name)

    def wants(self, leaf: int) -> bool:
        return self.wanted is None or self.paths[leaf] in self.wanted

    def site(self, eqn: Any, prov: dict, in_loop: bool) -> Site | None:
        name = eqn.primitive.name
        if name not in ("dot_general", "conv_general_dilated"):
            return None
        sides = [prov.get(v) if isinstance(v, jex.core.Var) else None for v in eqn.invars]
        if sides[0] is None and sides[1] is None:
            return None
        if sides[0] is not None and sides[1] is not None:
            for side in sides:
                self.other(side.leaf, f"{name} with another params leaf")
            return None
        kernel_pos = 0 if sides[0] is not None else 1
        leaf, perm, sliced_axis, loop_constant = sides[kernel_pos]
        if not self.wants(leaf):
            return None
        if in_loop:
            self.problem(leaf, "it feeds a matmul or convolution inside a while/cond body "
                               "or a nested scan")
            return None
        if loop_constant:
            self.problem(leaf, "a scan body reads it whole on every iteration (a stacked "
                               "leaf sliced by the scan's xs is captured per layer)")
            return None
        if name == "conv_general_dilated":
            layout = (_conv_layout(eqn, kernel_pos, perm) if sliced_axis is None else
                      "it feeds a convolution inside a scan body")
        else:
            layout = _dot_layout(eqn, kernel_pos, perm)
        if isinstance(layout, str):
            self.problem(leaf, layout)
            return None
        if sliced_axis is not None:      # a slice of the stacked leaf: one layer per iteration
            inner = layout["kernel_axes"] or tuple(range(len(perm)))
            layout.update(kernel_axes=_axes_or_none((sliced_axis, *inner)), scanned=True,
                          stack=(self.shapes[leaf][sliced_axis], *layout["stack"]))
        return Site(leaf=leaf, path=self.paths[leaf], kernel_pos=kernel_pos,
                     out_aval=eqn.outvars[0].aval,
                     x_dtype=eqn.invars[1 - kernel_pos].aval.dtype, **layout)

    def fast_call(self, eqn: Any, prov: dict, in_loop: bool) -> Action | None:
        """A custom_vjp/jvp call that is one captured product between pass-through ops."""
        if eqn.primitive.name not in _CUSTOM or in_loop or len(eqn.outvars) != 1:
            return None
        inner = open_jaxpr(eqn.params["call_jaxpr"])
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
        return Action("fast", site=site, x_input=ins[1 - site.kernel_pos])

    def scan(self, eqn: Any, in_prov: list) -> Action | None:
        """A scan whose body reads slices of stacked params leaves through its ``xs``."""
        p = eqn.params
        fixed = p["num_consts"] + p["num_carry"]
        body = open_jaxpr(p["jaxpr"])
        body_prov = {}
        for i, (v, src) in enumerate(zip(body.invars, in_prov, strict=True)):
            if src is None:
                continue
            body_prov[v] = (Provenance(src.leaf, src.perm, loop_constant=True) if i < fixed
                            else Provenance(src.leaf, src.perm[1:], sliced_axis=src.perm[0]))
        start = len(self.sites)
        sub_plan = self.walk(body, body_prov, in_scan=True)
        if not sub_plan:
            return None
        return Action("scan", plan=sub_plan,
                       indices=tuple(s.index for s in self.sites[start:]))

    def walk(self, jaxpr: Any, prov: dict, in_loop: bool = False,
             in_scan: bool = False) -> dict:
        plan: dict[int, Action] = {}
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
                source = in_prov[0]
                prov[eqn.outvars[0]] = source._replace(
                    perm=tuple(source.perm[a] for a in eqn.params["permutation"]))
                continue
            if name == "scan" and not in_loop and not in_scan:
                action = self.scan(eqn, in_prov)
                if action is not None:
                    plan[n] = action
                continue
            site = self.site(eqn, prov, in_loop)
            if site is not None:
                self.register(site)
                plan[n] = Action("site", site=site)
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
                body = open_jaxpr(body)
                sub_prov = {v: p for v, p in zip(body.invars, in_prov, strict=True)
                            if p is not None}
                sub_plan = self.walk(body, sub_prov, in_loop, in_scan)
                if sub_plan:
                    plan[n] = Action("inline", plan=sub_plan, inner=key)
                continue
            bodies = self._bodies(eqn, in_prov)
            if not bodies:
                for p in in_prov:
                    if p is not None:
                        self.other(p.leaf, name)
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
            return [(open_jaxpr(p["jaxpr"]), in_prov)]
        if name == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            return [(open_jaxpr(p["cond_jaxpr"]), in_prov[:nc] + in_prov[nc + nb:]),
                    (open_jaxpr(p["body_jaxpr"]), in_prov[nc:])]
        if name == "cond":
            return [(open_jaxpr(b), in_prov[1:]) for b in p["branches"]]
        # Unknown: conservatively, any param input may reach any invar of any body.
        leaves = [x for x in in_prov if x is not None]
        out = []
        for sub in jex.core.jaxprs_in_params(p):
            sub = open_jaxpr(sub)
            out.append((sub, [leaves[0] if leaves else None] * len(sub.invars)))
        return out

    def register(self, site: Site) -> None:
        site.index = len(self.sites)
        self.sites.append(site)

    def finish(self, shapes: list[tuple[int, ...]]) -> tuple[dict, dict]:
        """``(captured, skipped)``: path -> its sites (all of one layout), and path -> why
        not, for every kernel K-FAC will not precondition (a named one, or any leaf called
        ``kernel`` with two or more axes, or one that a product reads in a way not
        captured)."""
        by_leaf: dict[int, list[Site]] = {}
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



@dataclasses.dataclass
class Trace:
    closed: Any
    out_tree: Any
    treedef: Any
    paths: list[str]
    shapes: dict[str, tuple[int, ...]]
    analysis: Analysis
    plan: dict
    captured: dict[str, list[Site]]
    skipped: dict[str, str]


def trace_loss(loss_fn: Callable[..., Any], params: Any, args: tuple,
           layers: Collection[str] | None, who: str) -> Trace:
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
    analysis = Analysis(paths, shapes, wanted)
    jaxpr = closed.jaxpr
    plan = analysis.walk(jaxpr, {v: Provenance(i, tuple(range(v.aval.ndim)))
                                 for i, v in enumerate(jaxpr.invars)})
    captured, skipped = analysis.finish(shapes)
    return Trace(closed, jax.tree.structure(out_shape), treedef, paths,
                  dict(zip(paths, shapes, strict=True)), analysis, plan, captured, skipped)
