"""Optimizer cost per device and step on 1, 2, 4, 8 devices, read from the compiled programs.

For each parameter tree (GPT-2 small's and ``moe_tiny``'s, sharded by the trainer's
logical rules over the ``("data", "fsdp", "tensor")`` mesh) and each optimizer step in
`STACKS`, the jitted update is compiled (under ``jax.set_mesh``, as the trainer's step)
on sub-meshes of the first N simulated CPU devices (fsdp-only ``(1, N, 1)`` and data x
fsdp ``(2, N/2, 1)``) and its HLO is read with `benchmarks.hlo`: collective bytes per
device by kind and FLOPs per device, with while/scan bodies counted trip-count times
(``cost_analysis`` counts them once) and eigendecompositions at 9 n^3 (which
``cost_analysis`` leaves out). The K-FAC step (the trainer's `kfac` stack, expert stacks
included on MoE trees, fed the captured statistics of one batch) gives two rows from one
program: its refresh branch ("kfac refresh") and its plain branch ("kfac"). Nothing is
timed there; the wall-time section times Muon before (``shard_newton_schulz=False``, the
partitioner's choice) and after on the 8-device mesh, interleaved, in one process.

    python -m benchmarks.scaling [--trees gpt2_small,moe_tiny,16x512] [--out benchmarks/results]

A tree is a trainer preset, optionally with ``@key=value`` overrides
(``shakespeare_char_cpu@n_layer=2``), ``16x512``, or one of `MIXED_TREES` (a few
matrices per shape, rows and columns split, an expert stack: same-shape groups smaller
than the mesh). Targets checked (and printed): Muon's collective bytes per device per
step <= 2x the device's share of the params (bf16 transfers); with float32 Newton-Schulz
("muon f32") <= 3x; its per-device FLOPs <= 1.1 total/N + one matrix ("muon f32":
1.3 total/N + one matrix); Snoo adds no collective bytes to Muon's;
the K-FAC refresh's per-device FLOPs <= 1.1 total/N + one matrix (the largest factor's
eigendecomposition), for the whole step and for its eigendecompositions alone.

Extension point: `register_stack(name)` adds a step to measure. A builder gets a `Tree`
and a mesh and returns a `Step` (the function to jit and its arguments, concrete arrays
or ``jax.ShapeDtypeStruct``s with shardings), or None where the step does not apply to
the tree; `Step.rows` names the rows read from its one program (K-FAC: the refresh and the
plain branch)::

    @register_stack("sgd")
    def _sgd(tree: Tree, mesh) -> Step:
        return optimizer_step(optax.sgd(0.1), tree)
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_snoo
from benchmarks import hlo
from optax_snoo.labels import muon_adam_labels

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass
class Tree:
    """A parameter tree to measure: abstract params carrying their shardings."""

    name: str
    params: Any            # jax.ShapeDtypeStruct leaves with NamedShardings on `mesh`
    labels: Any            # "muon"/"adam" per leaf (optax_snoo.labels.muon_adam_labels)
    config: Any            # the models.GPTConfig it came from
    mesh: Any
    train_config: Any = None  # the train.config.TrainConfig preset (None for 16x512)


@dataclasses.dataclass
class Step:
    """A jittable step and its arguments (arrays or ShapeDtypeStructs)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    muon_like: bool = False      # checked against Muon's targets
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # (row name, hlo.analyze's eigh_branch) per row read from the program; () = one row
    # named after the stack, conditionals at their most expensive branch.
    rows: tuple[tuple[str, bool | None], ...] = ()


StackBuilder = Callable[[Tree, Any], Step | None]
STACKS: dict[str, StackBuilder] = {}


def register_stack(name: str) -> Callable[[StackBuilder], StackBuilder]:
    """Add a step to measure (in registration order) under `name`."""
    def add(build: StackBuilder) -> StackBuilder:
        STACKS[name] = build
        return build
    return add


def make_mesh(shape: tuple[int, int, int]):
    n = math.prod(shape)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:n])


def mixed_tree(n_layers: int, experts: int, width: int = 64) -> dict[str, tuple]:
    """A small transformer's Muon matrices, ``name -> (shape, spec)``: per layer qkv (rows
    over fsdp), the attention output and the MLP's up projection (columns), the down
    projection (rows), then one expert stack ``(experts, width/2, width)`` (rows)."""
    tree = {}
    for i in range(n_layers):
        tree |= {f"h{i}/qkv": ((width, 3 * width), P("fsdp", None)),
                 f"h{i}/o": ((width, width), P(None, "fsdp")),
                 f"h{i}/up": ((width, 4 * width), P(None, "fsdp")),
                 f"h{i}/down": ((4 * width, width), P("fsdp", None))}
    tree["experts"] = ((experts, width // 2, width), P(None, "fsdp", None))
    return tree


#: Trees of same-shape groups smaller than the mesh (1-2 matrices per shape, 6 or 10
#: experts): what padding each group to the mesh size paid for.
MIXED_TREES = {"mixed_2l_e6": mixed_tree(2, 6), "mixed_2l_e10": mixed_tree(2, 10),
               "mixed_4l_e10": mixed_tree(4, 10)}


def build_tree(name: str, mesh) -> Tree:
    """The trainer preset's params as ShapeDtypeStructs sharded by the logical rules
    (``preset@key=value...`` overrides its keys); ``"16x512"`` is the issue's case: 16
    matrices 512x512 float32, rows over fsdp; `MIXED_TREES` by name."""
    if name in MIXED_TREES:
        params = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
                  for k, (shape, spec) in MIXED_TREES[name].items()}
        return Tree(name, params, {k: "muon" for k in params}, None, mesh)
    if name == "16x512":
        sharding = NamedSharding(mesh, P("fsdp", None))
        params = {f"w{i:02d}": jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=sharding)
                  for i in range(16)}
        return Tree(name, params, {k: "muon" for k in params}, None, mesh)
    from flax import nnx

    import models
    from train.config import model_config, parse_args

    preset, *overrides = name.split("@")
    train_config = parse_args([f"--preset={preset}", *(f"--{o}" for o in overrides)])
    config = model_config(train_config, 65)  # the trainer's character vocabulary
    with jax.set_mesh(mesh), nnx.logical_axis_rules(models.logical_rules()):
        model = nnx.eval_shape(lambda: models.GPT(config, rngs=nnx.Rngs(0)))
        state = nnx.state(model, nnx.Param)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    is_spec = lambda x: isinstance(x, P)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        shapes, specs, is_leaf=lambda x: is_spec(x) or hasattr(x, "shape"))
    return Tree(name, params, muon_adam_labels(params), config, mesh, train_config)


def concrete(tree_like: Any) -> Any:
    """Zeros with the shapes, dtypes and shardings of a ShapeDtypeStruct tree."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), tree_like)


def optimizer_step(tx: optax.GradientTransformation, tree: Tree, **kwargs) -> Step:
    # init on concrete sharded arrays, as the trainer does: state leaves inherit the
    # params' shardings.
    state = tx.init(concrete(tree.params))
    return Step(lambda g, s, p: tx.update(g, s, p, **kwargs),
                (tree.params, state, tree.params))


def _muon(tree: Tree, **kw) -> optax.GradientTransformation:
    """Muon told where the tree's leaves live (the jitted update cannot see it)."""
    return optax_snoo.muon(0.02, labels=tree.labels, weight_decay=0.01, newton_schulz_plan=
                           optax_snoo.NewtonSchulzPlan.from_params(tree.params), **kw)


@register_stack("adamw")
def _adamw(tree: Tree, mesh) -> Step:
    return optimizer_step(optax.adamw(3e-4, weight_decay=0.1), tree)


@register_stack("optax.contrib.muon")
def _optax_muon(tree: Tree, mesh) -> Step:
    dims = jax.tree.map(
        lambda x, label: (optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1)
                          if label == "muon" else None), tree.params, tree.labels)
    tx = optax.contrib.muon(0.02, weight_decay=0.01, muon_weight_dimension_numbers=dims)
    return dataclasses.replace(optimizer_step(tx, tree), muon_like=True)


@register_stack("muon before")
def _muon_before(tree: Tree, mesh) -> Step:
    return dataclasses.replace(optimizer_step(_muon(tree, shard_newton_schulz=False), tree),
                               muon_like=True)


@register_stack("muon")
def _muon_after(tree: Tree, mesh) -> Step:
    return dataclasses.replace(optimizer_step(_muon(tree), tree), muon_like=True)


@register_stack("muon f32")
def _muon_f32(tree: Tree, mesh) -> Step:
    """Float32 Newton-Schulz: transfers in float32, the issue's unit for the 3x target."""
    return dataclasses.replace(optimizer_step(_muon(tree, ns_dtype=jnp.float32), tree),
                               muon_like=True)


@register_stack("snoo(muon)")
def _snoo_muon(tree: Tree, mesh) -> Step:
    return dataclasses.replace(optimizer_step(optax_snoo.snoo(_muon(tree)), tree,
                                              snoo_sync=False), muon_like=True)


@register_stack("snoo(muon) sync")
def _snoo_muon_sync(tree: Tree, mesh) -> Step:
    return dataclasses.replace(optimizer_step(optax_snoo.snoo(_muon(tree)), tree,
                                              snoo_sync=True), muon_like=True)


@register_stack("kfac")
def kfac_stack(tree: Tree, mesh, statistics: bool = True) -> Step | None:
    """The trainer's `kfac` stack and its batch factors from one batch's statistics;
    `statistics=False`: a step without them (`curvature=None`), as the trainer's steps
    between statistics steps are with `--kfac_stats_every` > 1."""
    if tree.train_config is None:
        return None
    from flax import nnx

    import models
    from optax_snoo import kfac
    from train.config import override
    from train.kfac_trainer import kfac_curvature_fn
    from train.optimizers import build_optimizer
    from train.sharding import BATCH_AXES
    from train.step import cross_entropy

    experts = tree.config.moe_every > 0  # MoE trees: per-expert factors, split like the rest
    config = override(tree.train_config, optimizer="kfac", kfac_experts=experts)
    tx = build_optimizer(config, params=tree.params).tx  # told where the kernels live
    curvature_fn = kfac_curvature_fn(tree.params, config.optimizer.table.kfac_stats_stride,
                                     experts)
    graphdef, _, rest = nnx.split(
        nnx.eval_shape(lambda: models.GPT(tree.config, rngs=nnx.Rngs(0))), nnx.Param, ...)

    def stats_of(params, tokens_BT):
        def loss(p):
            logits_BTV, aux, _ = models.forward(nnx.merge(graphdef, p, rest), tokens_BT)
            return cross_entropy(logits_BTV, tokens_BT) + aux
        return kfac.value_grad_and_stats(loss, params, layers=curvature_fn.layers)[2]

    tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.model.block_size), jnp.int32)
    stats = jax.eval_shape(stats_of, tree.params, tokens)
    # The trainer's batch is split over the batch axes, so are the statistics' tokens.
    split = math.prod(mesh.shape[a] for a in BATCH_AXES)
    stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
        mesh, P(*[None] * (s.ndim - 2), BATCH_AXES if s.shape[-2] % split == 0 else None,
                None))), stats)
    # Abstract state on the shardings the compiled init gives it (no gigabytes of zeros);
    # the constants it places on one device are replicated, as a concrete init's are.
    shardings = jax.jit(tx.init).lower(tree.params).compile().output_shardings
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s if isinstance(
            s, NamedSharding) else NamedSharding(mesh, P())),
        jax.eval_shape(tx.init, tree.params), shardings)
    # The factor EMAs where an eager init (the trainer's) puts them: rows split over the
    # batch axes (`kfac(stats_axes=BATCH_AXES)`).
    is_state = lambda x: isinstance(x, kfac.ScaleByKfacState)
    state = jax.tree.map(lambda s: s._replace(factors=jax.tree.map(
        lambda f: jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=NamedSharding(
            mesh, kfac.factor_spec(f.shape, mesh, BATCH_AXES))), s.factors))
        if is_state(s) else s, state, is_leaf=is_state)

    def step(grads, state, params, stats):
        curvature = curvature_fn.from_stats(stats, 0) if statistics else None
        return tx.update(grads, state, params, curvature=curvature)

    return Step(step, (tree.params, state, tree.params, stats),
                rows=(("kfac refresh", True), ("kfac", False)))


def share_bytes(params: Any, labels: Any | None = None, label: str | None = None) -> float:
    """Bytes of `params` (or of the leaves labelled `label`) one device holds."""
    total = 0.0
    for x, lab in zip(jax.tree.leaves(params),
                      jax.tree.leaves(labels) if labels is not None
                      else [None] * len(jax.tree.leaves(params)), strict=True):
        if label is None or lab == label:
            total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def largest_matrix_flops(tree: Tree, steps: int = 5) -> float:
    """FLOPs of the Newton-Schulz iteration on the largest Muon matrix (rows <= cols)."""
    best = 0.0
    for x, label in zip(jax.tree.leaves(tree.params), jax.tree.leaves(tree.labels),
                        strict=True):
        if label == "muon":
            r, c = sorted(x.shape[-2:])
            best = max(best, steps * (4 * r * r * c + 2 * r**3))
    return best


def measure(tree_name: str, mesh_shape: tuple[int, int, int], names: list[str]) -> list[dict]:
    mesh = make_mesh(mesh_shape)
    tree = build_tree(tree_name, mesh)
    share = share_bytes(tree.params)
    muon_share = share_bytes(tree.params, tree.labels, "muon")
    rows = []
    for name in names:
        step = STACKS[name](tree, mesh)
        if step is None:
            continue
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            text = jax.jit(step.fn).lower(*step.args).compile().as_text()
        compile_s = time.perf_counter() - start
        for row_name, eigh_branch in step.rows or ((name, None),):
            cost = hlo.analyze(text, eigh_branch=eigh_branch)
            rows.append({
                "tree": tree_name, "mesh": "x".join(map(str, mesh_shape)),
                "n": math.prod(mesh_shape), "step": row_name, "muon_like": step.muon_like,
                "collective_bytes": cost.collective_bytes,
                "loop_collective_bytes": cost.loop_collective_bytes,
                "by_kind": dict(cost.by_kind), "counts": dict(cost.counts),
                "flops": cost.flops, "eigh": {int(k): int(v) for k, v in cost.eigh.items()},
                "eigh_flops": cost.eigh_flops,
                "share_bytes": share, "muon_share_bytes": muon_share,
                "largest_matrix_flops": largest_matrix_flops(tree),
                "compile_s": compile_s,
            })
            print(f"  {tree_name} {rows[-1]['mesh']} {row_name}: {hlo.summary(cost)}",
                  flush=True)
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    """One line per target and (tree, mesh): 'ok' or what failed."""
    out = []
    single = {(r["tree"], r["step"]): r["flops"] for r in rows if r["n"] == 1}
    whole = {r["tree"]: r["muon_share_bytes"] for r in rows if r["n"] == 1}
    by = {(r["tree"], r["mesh"], r["step"]): r for r in rows}
    for r in rows:
        if r["step"] not in ("muon", "muon f32"):
            continue
        # bf16 transfers: 2x the share; float32: 3x, FLOPs 1.3 total/N + one matrix.
        most, slack = (2.0, 1.1) if r["step"] == "muon" else (3.0, 1.3)
        n, key = r["n"], (r["tree"], r["mesh"])
        if n > 1 and r["muon_share_bytes"] == whole.get(r["tree"]):
            out.append(f"{r['tree']} {r['mesh']}: params unsharded (replicated): the "
                       f"per-leaf path, {r['collective_bytes']:.0f} B, "
                       f"{r['flops'] / 1e9:.2f} GFLOP per device (not a target)")
            continue
        ratio = r["collective_bytes"] / r["muon_share_bytes"]
        total = single.get((r["tree"], r["step"]))
        flops_ok = total is None or r["flops"] <= slack * total / n + r["largest_matrix_flops"]
        snoo = by.get((*key, "snoo(muon)")) if r["step"] == "muon" else None
        snoo_extra = None if snoo is None else snoo["collective_bytes"] - r["collective_bytes"]
        out.append(
            f"{r['tree']} {r['mesh']} {r['step']}: bytes {ratio:.2f}x muon share "
            f"({'ok' if ratio <= most else 'FAIL'}), loop bytes "
            f"{r['loop_collective_bytes']:.0f}, flops {r['flops'] / 1e9:.4f} G vs total/N "
            f"{(total or 0) / n / 1e9:.4f} G ({'ok' if flops_ok else 'FAIL'}), snoo adds "
            f"{'n/a' if snoo_extra is None else f'{snoo_extra:.0f} B'}"
            f"{'' if not snoo_extra else ' FAIL'}")
    out += check_kfac_targets(rows)
    return out


def kfac_bound(single: dict, n: int, key: str = "flops") -> float:
    """1.1 x the single-device refresh's `key` / n + one matrix (the largest factor's
    eigendecomposition, 9 n^3): the issue's target for a K-FAC refresh on n devices."""
    return 1.1 * single[key] / n + hlo.EIGH_FLOPS_PER_N3 * max(single["eigh"]) ** 3


def check_kfac_targets(rows: list[dict]) -> list[str]:
    """The K-FAC refresh's per-device FLOPs (whole step, and its eigendecompositions)
    against 1.1 total/N + one matrix (the largest factor's eigendecomposition, 9 n^3)."""
    out = []
    single = {r["tree"]: r for r in rows if r["n"] == 1 and r["step"] == "kfac refresh"}
    for r in rows:
        if r["step"] != "kfac refresh" or r["tree"] not in single:
            continue
        parts = []
        for what, key in (("step", "flops"), ("eigh", "eigh_flops")):
            bound = kfac_bound(single[r["tree"]], r["n"], key)
            parts.append(f"{what} {r[key] / 1e9:.2f} G <= {bound / 1e9:.2f} G "
                         f"({'ok' if r[key] <= bound else 'FAIL'})")
        out.append(f"{r['tree']} {r['mesh']}: kfac refresh per device: " + ", ".join(parts))
    return out


def kfac_markdown(rows: list[dict]) -> str:
    """The K-FAC rows side by side: refresh and plain step per (tree, mesh)."""
    by = {(r["tree"], r["mesh"], r["step"]): r for r in rows}
    single = {r["tree"]: r for r in rows if r["n"] == 1 and r["step"] == "kfac refresh"}
    lines = ["| tree | mesh | N | eigh per device | eigh GFLOP/device | refresh GFLOP/device "
             "| target: 1.1 total/N + one matrix | refresh collective MiB | plain GFLOP/device "
             "| plain collective MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    mib = lambda r: ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r["by_kind"].items())
                              ) or "0"
    for (tree, mesh, step), r in by.items():
        plain = by.get((tree, mesh, "kfac"))
        if step != "kfac refresh" or plain is None:
            continue
        bound = "-" if tree not in single else f"{kfac_bound(single[tree], r['n']) / 1e9:.1f}"
        lines.append(
            f"| {tree} | {mesh} | {r['n']} | {sum(r['eigh'].values())} "
            f"| {r['eigh_flops'] / 1e9:.1f} | {r['flops'] / 1e9:.1f} | {bound} | {mib(r)} "
            f"| {plain['flops'] / 1e9:.1f} | {mib(plain)} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| tree | mesh | N | step | collective MiB/device | x share | x Muon share "
             "| in loops MiB | GFLOP/device | by kind |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r["by_kind"].items()))
        lines.append(
            f"| {r['tree']} | {r['mesh']} | {r['n']} | {r['step']} "
            f"| {r['collective_bytes'] / 2**20:.2f} "
            f"| {r['collective_bytes'] / r['share_bytes']:.2f} "
            f"| {r['collective_bytes'] / r['muon_share_bytes']:.2f} "
            f"| {r['loop_collective_bytes'] / 2**20:.2f} | {r['flops'] / 1e9:.2f} "
            f"| {kinds or '-'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = sorted({r["tree"] for r in rows})
    fig, axes = plt.subplots(2, len(trees), figsize=(6 * len(trees), 8), squeeze=False)
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 2))]
    markers = "osv^Dx*+"
    names = list(dict.fromkeys(r["step"] for r in rows))
    for col, tree in enumerate(trees):
        for i, name in enumerate(names):
            pts = sorted((r["n"], r) for r in rows
                         if r["tree"] == tree and r["step"] == name and r["mesh"].startswith("1x"))
            if not pts:
                continue
            ns = [n for n, _ in pts]
            ratio = [max(r["collective_bytes"] / r["share_bytes"], 1e-3) for _, r in pts]
            style = dict(ls=styles[i % len(styles)], marker=markers[i % len(markers)],
                         label=name, alpha=0.8)
            axes[0, col].plot(ns, ratio, **style)
            axes[1, col].plot(ns, [r["flops"] / 1e9 for _, r in pts], **style)
        axes[0, col].set(title=f"{tree}: collective bytes / param share\n"
                               "(fsdp mesh 1xNx1; 0 drawn at 1e-3)",
                         xscale="log", yscale="log", xlabel="devices N")
        axes[1, col].set(title=f"{tree}: GFLOP per device and step", xscale="log",
                         yscale="log", xlabel="devices N")
        for ax in axes[:, col]:
            ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
        axes[0, col].axhline(2.0, color="k", ls="--", lw=0.8)
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def wall_times(tree_name: str, rounds: int, calls: int) -> dict:
    """Muon before/after on the 8-device fsdp mesh: median paired ratio after/before."""
    mesh = make_mesh((1, 8, 1))
    tree = build_tree(tree_name, mesh)
    rng = np.random.default_rng(0)
    arrays = jax.tree.map(
        lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype) * 0.02,
                                 x.sharding), tree.params)
    fns = {}
    for name, tx in (("before", _muon(tree, shard_newton_schulz=False)),
                     ("after", _muon(tree))):
        state = tx.init(arrays)
        fn = jax.jit(tx.update).lower(arrays, state, arrays).compile()
        jax.block_until_ready(fn(arrays, state, arrays))
        fns[name] = (fn, (arrays, state, arrays))
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, (fn, args) in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"],
                                                     strict=True))
    return {"tree": tree_name, "before_ms": 1e3 * statistics.median(times["before"]),
            "after_ms": 1e3 * statistics.median(times["after"]), "ratio": ratio,
            "rounds": rounds, "calls": calls}


MESHES = [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1)]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="gpt2_small,moe_tiny,16x512")
    parser.add_argument("--steps", default=",".join(STACKS), help="names in STACKS")
    parser.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in MESHES))
    parser.add_argument("--wall_trees", default="moe_tiny,16x512",
                        help="trees timed on 8 devices; '' to skip the timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default="", help="folder for scaling.{json,md,png}")
    parser.add_argument("--replot", default="", help="only redraw the plot from this json")
    args = parser.parse_args(argv)
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())["rows"]
        plot(rows, Path(args.replot).with_suffix(".png"))
        return rows

    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices")
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    names = [n for n in args.steps.split(",") if n]
    rows = []
    for tree_name in args.trees.split(","):
        for shape in meshes:
            rows.extend(measure(tree_name, shape, names))
    table = markdown(rows)
    if any(r["step"] == "kfac refresh" for r in rows):
        table += "\n\n" + kfac_markdown(rows)
    targets = check_targets(rows)
    wall = [wall_times(t, args.rounds, args.calls) for t in args.wall_trees.split(",") if t]
    print(table)
    print("\n".join(targets))
    for w in wall:
        targets.append(
            f"wall time, {w['tree']} on 8 CPU devices (1x8x1): muon before "
            f"{w['before_ms']:.1f} ms, after {w['after_ms']:.1f} ms, after/before "
            f"{w['ratio']:.3f} (median of {w['rounds']} paired rounds of {w['calls']} calls)")
        print(targets[-1])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling.json").write_text(json.dumps({"rows": rows, "wall": wall}, indent=1))
        (out / "scaling.md").write_text(table + "\n\n" + "\n".join(targets) + "\n")
        plot(rows, out / "scaling.png")
    return rows


if __name__ == "__main__":
    main()
