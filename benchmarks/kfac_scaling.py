"""Per-device cost of the K-FAC optimizer step at N = 1, 2, 4, 8 devices (compiled HLO).

The measured program is one jitted optimizer step of a GPT's K-FAC group: the batch
factors from the captured statistics (`optax_snoo.kfac.curvature_from_stats`, the tokens
sharded over a ``data`` mesh axis, so the factor sums are reduced over it), the factor
EMAs, the refresh (under ``lax.cond``) and the preconditioning. For each N (a sub-mesh of
the host's devices, ``jax.set_mesh``) the compiled module is read, not timed:

- ``eigh`` calls each device runs, by matrix size (custom calls, times the trip counts of
  the loops around them), and their FLOPs at ``9 n³`` each (tridiagonalisation, its
  back-transformation and the implicit QR sweeps of a symmetric eigensolver with
  eigenvectors, Golub & Van Loan §8.3);
- matmul FLOPs (``dot`` instructions, ``2·|out|·|contracted|``);
- collective bytes (the output bytes of every all-gather / all-reduce / reduce-scatter /
  all-to-all / collective-permute, times trip counts);

separately for a refresh step (the cond's refresh branch) and a plain step (the other
branch). `kfac_rows` returns the rows; ``python -m benchmarks.kfac_scaling`` prints them
with the target check: the refresh's per-device eigh FLOPs within 10% of
``total / N + the largest matrix``.

    python -m benchmarks.kfac_scaling                  # shakespeare_char_cpu GPT shape
    python -m benchmarks.kfac_scaling --moe_every=2    # experts preconditioned too
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_snoo import kfac
from optax_snoo._src.utils import path_to_str

EIGH_FLOPS_PER_N3 = 9
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "collective-permute")
_DTYPE_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1,
                "u8": 1, "pred": 1, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(f32|f64|bf16|f16|s32|u32|s8|u8|pred|s64|u64)\[([0-9,]*)\]")


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _SHAPE.findall(text)]


def _is_eigh(line: str) -> bool:
    """An eigendecomposition custom call (LAPACK syevd on CPU, cuSOLVER syevd/syevj)."""
    return "custom-call" in line and any(s in line for s in ("syevd", "syevj", "eigh"))


def _parse(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and "=" in line:
            comps[current].append(line.strip())
    return comps, entry


def _callees(line: str) -> list[tuple[str, int]]:
    """Computations an instruction calls, each with its repeat count."""
    out = []
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    body = re.search(r"body=%?([\w.\-]+)", line)
    if body:
        out.append((body.group(1), int(trip.group(1)) if trip else 1))
    for key in ("condition", "calls", "to_apply", "true_computation", "false_computation"):
        for m in re.finditer(key + r"=%?([\w.\-]+)", line):
            out.append((m.group(1), 1))
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        out += [(b.strip().lstrip("%"), 1) for b in branches.group(1).split(",")]
    return out


def _multiplicities(comps: dict[str, list[str]], entry: str, skip: set[str]
                    ) -> dict[str, int]:
    """How many times each computation runs per execution of ``entry`` (not ``skip``)."""
    mult: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        if name in skip or name not in comps:
            return
        mult[name] += times
        for ln in comps[name]:
            for callee, n in _callees(ln):
                visit(callee, times * n)

    visit(entry, 1)
    return mult


def analyse(hlo: str) -> dict[str, dict[str, Any]]:
    """Per-device costs of a compiled module, for a refresh and a plain K-FAC step.

    Args:
      hlo: ``compiled.as_text()`` of the step (one device's program under SPMD).

    Returns:
      ``{"refresh": costs, "plain": costs}`` with ``eigh`` (``{n: count}``),
      ``eigh_flops``, ``dot_flops``, ``collective_bytes`` (``{kind: bytes}``) and
      ``collective_ops`` (``{kind: executions}``).
    """
    comps, entry = _parse(hlo)
    has_eigh: dict[str, bool] = {}

    def eigh_inside(name: str) -> bool:
        if name not in has_eigh:
            lines = comps.get(name, [])
            has_eigh[name] = any(_is_eigh(ln) for ln in lines) or any(
                eigh_inside(c) for ln in lines for c, _ in _callees(ln) if c != name)
        return has_eigh[name]

    # Branches of conditionals: the one with eigh is the refresh, the others plain.
    refresh_branches, plain_branches = set(), set()
    for lines in comps.values():
        for ln in lines:
            if " conditional(" in ln:
                names = [c for c, _ in _callees(ln)]
                with_eigh = [c for c in names if eigh_inside(c)]
                if with_eigh:
                    refresh_branches.update(with_eigh)
                    plain_branches.update(c for c in names if c not in with_eigh)
    result = {}
    for mode, skip in (("refresh", plain_branches), ("plain", refresh_branches)):
        mult = _multiplicities(comps, entry, skip)
        shape_of: dict[str, tuple[str, tuple[int, ...]]] = {}
        for lines in comps.values():
            for ln in lines:
                m = re.match(r"%?([\w.\-]+)\s*=\s*(\S+)", ln)
                if m:
                    shapes = _shapes(m.group(2))
                    if shapes:
                        shape_of[m.group(1)] = shapes[0]
        eigh: dict[int, int] = defaultdict(int)
        dot_flops = 0
        collective: dict[str, int] = defaultdict(int)
        collective_ops: dict[str, int] = defaultdict(int)
        for name, times in mult.items():
            for ln in comps[name]:
                rhs = ln.partition("=")[2]
                if _is_eigh(rhs):
                    operand = _shapes(rhs.split("custom-call(")[0])[0][1]
                    eigh[operand[-1]] += times * math.prod(operand[:-2])
                elif re.search(r"\sdot\(", rhs):
                    out = _shapes(rhs.split(" dot(")[0])[0][1]
                    args = re.search(r"dot\(%?([\w.\-]+)", rhs).group(1)
                    contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rhs)
                    dims = [int(d) for d in contract.group(1).split(",") if d] if contract else []
                    lhs_shape = shape_of.get(args, ("f32", ()))[1]
                    k = math.prod(lhs_shape[d] for d in dims) if lhs_shape else 1
                    dot_flops += times * 2 * math.prod(out) * k
                else:
                    for kind in _COLLECTIVES:
                        if re.search(rf"\s{kind}(-start)?\(", rhs):
                            head = rhs.split(f" {kind}")[0]
                            collective[kind] += times * sum(
                                _DTYPE_BYTES[t] * math.prod(s) for t, s in _shapes(head))
                            collective_ops[kind] += times
        result[mode] = {
            "eigh": dict(sorted(eigh.items())),
            "eigh_flops": sum(EIGH_FLOPS_PER_N3 * n ** 3 * c for n, c in eigh.items()),
            "dot_flops": dot_flops, "collective_bytes": dict(collective),
            "collective_ops": dict(collective_ops)}
    return result


def gpt_problem(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, block_size: int = 64,
                batch_size: int = 12, moe_every: int = 0, n_experts: int = 8,
                bias: bool = False) -> tuple[Any, Any]:
    """Shapes of a GPT's params and of its K-FAC statistics (``jax.eval_shape`` only).

    Returns ``(params, stats)`` as ``ShapeDtypeStruct`` trees; the statistics are those
    of every kernel `optax_snoo.kfac.value_grad_and_stats` captures, except the
    embeddings, the head and the routers (the trainer keeps them on AdamW).
    """
    import optax
    from flax import nnx

    import models

    cfg = models.GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                           block_size=block_size, moe_every=moe_every, n_experts=n_experts,
                           bias=bias)
    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tokens = jax.ShapeDtypeStruct((batch_size, block_size), jnp.int32)

    def stats(params, x):
        def loss(p):
            logits, aux, _ = models.forward(nnx.merge(graphdef, p, rest), x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, x).mean() + aux
        return kfac.value_grad_and_stats(loss, params)[2]

    shapes = jax.eval_shape(stats, params, tokens)
    shapes = {k: v for k, v in shapes.items() if not any(
        s in k for s in ("lm_head", "router", "wte", "wpe"))}
    return params, shapes


def _step_fn(tx: Any, num_tokens: int):
    def step(grads, state, params, stats):
        curvature = kfac.curvature_from_stats(stats, num_tokens=num_tokens)
        return tx.update(grads, state, params, curvature=curvature)
    return step


def kfac_rows(
    device_counts: Sequence[int] = (1, 2, 4, 8),
    *,
    mode: str = "pi",
    **problem: Any,
) -> list[dict[str, Any]]:
    """Per-device FLOPs and collective bytes of a K-FAC refresh and plain step at each N.

    Args:
      device_counts: sub-meshes of the first N host devices (a ``data`` axis of size N).
      mode: K-FAC damping mode.
      **problem: `gpt_problem` arguments (GPT shape, batch, ``moe_every``...).

    Returns:
      One dict per N: ``devices``, ``refresh`` and ``plain`` (the `analyse` costs),
      ``eigh_flops_total`` (all the factors' matrices), ``eigh_bound`` (``total/N`` plus the
      largest matrix) and ``within_target`` (refresh eigh FLOPs <= 1.1 · bound).
    """
    params_s, stats_s = gpt_problem(**problem)
    kernels = {p for p in stats_s}
    layers = jax.eval_shape(lambda s: kfac.curvature_from_stats(s, num_tokens=1), stats_s)
    num_tokens = problem.get("batch_size", 12) * problem.get("block_size", 64)
    flat = jax.tree_util.tree_flatten_with_path(params_s)[0]
    keep = {path_to_str(p) for p, _ in flat if path_to_str(p) in kernels or any(
        path_to_str(p) == k[:-len("kernel")] + "bias" for k in kernels)}
    sub = {}
    for p, leaf in flat:
        name = path_to_str(p)
        if name in keep:
            sub[name] = jnp.zeros(leaf.shape, jnp.float32)
    tx = kfac.scale_by_kfac(refresh=kfac.every(2, first=0), mode=mode, layers=layers)
    sizes = [f.shape[-1] for c in layers.values() for f in c
             for _ in range(math.prod(f.shape[:-2]))]
    total = sum(EIGH_FLOPS_PER_N3 * d ** 3 for d in sizes)
    largest = EIGH_FLOPS_PER_N3 * max(sizes) ** 3
    rows = []
    for n in device_counts:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        stats = jax.tree.map(lambda s, mesh=mesh: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(
                mesh, P(*([None] * (len(s.shape) - 2)), "data", None))), stats_s)
        with jax.set_mesh(mesh):
            state = jax.eval_shape(tx.init, sub)
            compiled = jax.jit(_step_fn(tx, num_tokens)).lower(sub, state, sub, stats).compile()
        costs = analyse(compiled.as_text())
        bound = total / n + largest
        rows.append({"devices": n, **costs, "eigh_flops_total": total, "eigh_bound": bound,
                     "within_target": costs["refresh"]["eigh_flops"] <= 1.1 * bound})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=12)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--moe_every", type=int, default=0)
    parser.add_argument("--mode", default="pi")
    parser.add_argument("--devices", default="1,2,4,8")
    args = parser.parse_args(argv)
    rows = kfac_rows([int(n) for n in args.devices.split(",")], mode=args.mode,
                     n_layer=args.n_layer, n_embd=args.n_embd, batch_size=args.batch_size,
                     block_size=args.block_size, moe_every=args.moe_every)
    print("| N | refresh eigh/device | refresh eigh GFLOP/device | bound (total/N + 1) | "
          "refresh collective MiB | plain collective MiB | plain dot GFLOP |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mib = lambda c: sum(c["collective_bytes"].values()) / 2 ** 20
        print(f"| {r['devices']} | {sum(r['refresh']['eigh'].values())} | "
              f"{r['refresh']['eigh_flops'] / 1e9:.3f} | {r['eigh_bound'] / 1e9:.3f} | "
              f"{mib(r['refresh']):.2f} | {mib(r['plain']):.2f} | "
              f"{r['plain']['dot_flops'] / 1e9:.3f} |")
    print(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
