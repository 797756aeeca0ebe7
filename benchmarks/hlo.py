"""Per-device collective bytes and FLOPs of a compiled XLA program, loops counted.

`compiled.cost_analysis()` and a plain text count of the HLO see a while (scan) body
once. Here every computation is weighted by how often it runs: a while body (and its
condition) by the loop's ``known_trip_count`` from its backend config, a conditional by
its most expensive branch (one branch runs per step; ``eigh_branch`` picks K-FAC's refresh
or non-refresh branch instead), fusions and calls once per call.

Counted per device (an SPMD program is one device's program):

- collectives: all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute
  (and their async ``-start`` forms), each by the larger of its input and output buffers
  (all-gather: the gathered result; reduce-scatter: the full input; a tuple all-to-all:
  all its elements). The traffic that actually leaves the device is ``(g-1)/g`` of it
  for a group of ``g`` devices;
- FLOPs: ``2 * prod(result) * prod(contracted dims)`` per dot, one per output element of
  elementwise arithmetic, one per input element of a reduce, and ``9 n^3`` per ``n x n``
  matrix of an eigendecomposition custom call (LAPACK/cuSOLVER ``syevd``/``syevj``, which
  ``cost_analysis`` leaves out): tridiagonalisation, back-transformation and implicit QR
  of a symmetric eigensolver with eigenvectors (Golub & Van Loan, "Matrix Computations",
  4th ed., 2013, section 8.3), and per ``m x n`` matrix of a Householder QR's two custom
  calls (LAPACK/cuSOLVER ``geqrf`` and ``orgqr``) ``2 m n² - (2/3) n³`` and
  ``4 m n k - 2 (m + n) k² + (4/3) k³`` with ``k = min(m, n)`` (``(8/3) n³`` for a
  square one; Golub & Van Loan, sections 5.2.1 and 5.1.6).

Usage::

    compiled = jax.jit(f).lower(*args).compile()
    stats = analyze(compiled.as_text())
    stats.collective_bytes, stats.by_kind, stats.flops, stats.in_loops, stats.eigh, stats.qr
    steady = analyze(text, without_eigh=True)   # SOAP's steps after its first (power-QR)
    refresh = analyze(text, eigh_branch=True)   # a K-FAC refresh step
    plain = analyze(text, eigh_branch=False)    # a step without refresh
    across = analyze(text, only=spans_blocks(4))  # collectives between 4-device blocks
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from collections.abc import Callable

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0,
}
COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}
ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder",
    "atan2", "negate", "abs", "sqrt", "rsqrt", "cbrt", "exponential",
    "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh", "sine", "cosine",
    "tan", "erf", "sign", "floor", "ceil", "round-nearest-even", "round-nearest-afz",
    "compare", "select", "clamp", "and", "or", "xor", "not",
}

EIGH_FLOPS_PER_N3 = 9
_EIGH_TARGETS = ("syevd", "syevj", "heevd", "eigh")
_QR_TARGETS = ("geqrf",)
_Q_TARGETS = ("orgqr", "ungqr", "householder_product")

_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|true_computation|false_computation)="
                       r"(\{[^}]*\}|%?[\w.\-]+)")


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _bytes(type_str: str) -> float:
    return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in _arrays(type_str))


def _elements(type_str: str) -> int:
    return sum(math.prod(s) for _, s in _arrays(type_str))


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*"
                          r"(?:,\s*device_ids=\(([^)]*\)?)\)\s*)?\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")


def replica_groups(remainder: str) -> list[list[int]] | None:
    """The device groups of a collective's attributes (None where none are written: one
    group of every device). Reads the explicit (``{{0,1},{2,3}}``), iota
    (``[2,4]<=[4,2]T(1,0)``) and named-mesh (``mesh['a'=2,'b'=4] {'a'}``, optionally with
    ``device_ids=([2,4]T(1,0))`` or ``device_ids=(0,4,1,5,...)`` placing the devices on
    the mesh) forms."""
    m = _MESH_GROUPS.search(remainder)
    if m:
        axes = [(a.split("=")[0].strip(" '"), int(a.split("=")[1]))
                for a in m.group(1).split(",") if a.strip()]
        names = [a.strip(" '") for a in m.group(3).split(",") if a.strip()]
        size_all = math.prod(s for _, s in axes)
        ids = np.arange(size_all)
        if m.group(2):
            iota = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group(2).strip())
            if iota:
                ids = ids.reshape([int(x) for x in iota.group(1).split(",")])
                if iota.group(2):
                    ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
            else:
                ids = np.array([int(x) for x in m.group(2).split(",") if x.strip()])
        ids = ids.reshape([s for _, s in axes])
        grouped = [i for i, (n, _) in enumerate(axes) if n in names]
        rest = [i for i in range(len(axes)) if i not in grouped]
        size = math.prod(axes[i][1] for i in grouped)
        return ids.transpose(rest + grouped).reshape(-1, size).tolist()
    m = _IOTA_GROUPS.search(remainder)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = _LIST_GROUPS.search(remainder)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x]
                for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return None


def spans_blocks(block: int) -> Callable[[list[list[int]] | None], bool]:
    """A filter for `analyze(only=)`: collectives whose groups join devices of different
    blocks of `block` consecutive device ids (e.g. the replicas of a mesh whose first
    axis is the replica axis). A collective without groups spans every device."""

    def spans(groups):
        if groups is None:
            return True
        return any(len({d // block for d in g}) > 1 for g in groups)

    return spans


def _split_type(rest: str) -> tuple[str, str, str]:
    """``TYPE opcode(operands), attrs`` -> (type, opcode, remainder)."""
    if rest.startswith("("):
        depth, end = 0, len(rest) - 1
        for pos, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = pos
                break
        type_str, tail = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        type_str, _, tail = rest.partition(" ")
    opcode, _, remainder = tail.partition("(")
    return type_str, opcode.strip(), remainder


@dataclasses.dataclass
class Cost:
    """Per-device totals of one computation (or the whole program)."""

    flops: float = 0.0
    by_kind: Counter = dataclasses.field(default_factory=Counter)      # bytes per kind
    counts: Counter = dataclasses.field(default_factory=Counter)       # executions per kind
    in_loops: Counter = dataclasses.field(default_factory=Counter)     # bytes inside loops
    eigh: Counter = dataclasses.field(default_factory=Counter)         # n -> n x n matrices
    eigh_flops: float = 0.0                                            # part of `flops`
    qr: Counter = dataclasses.field(default_factory=Counter)           # n -> m x n matrices
    qr_flops: float = 0.0                                              # part of `flops`
    linalg_calls: Counter = dataclasses.field(default_factory=Counter)  # target -> calls

    def add(self, other: Cost, times: float = 1.0, in_loop: bool = False) -> None:
        self.flops += times * other.flops
        self.eigh_flops += times * other.eigh_flops
        self.qr_flops += times * other.qr_flops
        for k, v in other.eigh.items():
            self.eigh[k] += times * v
        for k, v in other.qr.items():
            self.qr[k] += times * v
        for k, v in other.linalg_calls.items():
            self.linalg_calls[k] += times * v
        for k, v in other.by_kind.items():
            self.by_kind[k] += times * v
            if in_loop:
                self.in_loops[k] += times * v
        for k, v in other.counts.items():
            self.counts[k] += times * v
        for k, v in other.in_loops.items():
            if not in_loop:
                self.in_loops[k] += times * v

    @property
    def collective_bytes(self) -> float:
        return float(sum(self.by_kind.values()))

    @property
    def loop_collective_bytes(self) -> float:
        return float(sum(self.in_loops.values()))


def _parse(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            type_str, opcode, remainder = _split_type(m.group(3))
            comps[current].append((m.group(2), type_str, opcode, remainder))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _trip_count(remainder: str) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', remainder)
    return int(m.group(1)) if m else None


def _target(opcode: str, remainder: str) -> str:
    """A custom call's target ("" for other instructions)."""
    if opcode != "custom-call":
        return ""
    target = re.search(r'custom_call_target="([^"]*)"', remainder)
    return target.group(1) if target else ""


def _is_eigh(opcode: str, remainder: str) -> bool:
    return any(t in _target(opcode, remainder) for t in _EIGH_TARGETS)


def _is_qr(opcode: str, remainder: str) -> bool:
    return any(t in _target(opcode, remainder) for t in _QR_TARGETS + _Q_TARGETS)


def _qr_flops(target: str, shape: tuple[int, ...]) -> float:
    """FLOPs of a QR custom call on ``(*batch, m, n)`` matrices (0 for other targets)."""
    m, n = shape[-2:]
    k, count = min(m, n), math.prod(shape[:-2])
    if any(t in target for t in _QR_TARGETS):
        return count * (2 * m * k * k - 2 / 3 * k ** 3 if m >= n
                        else 2 * n * m * m - 2 / 3 * m ** 3)
    if any(t in target for t in _Q_TARGETS):
        return count * (4 * m * n * k - 2 * (m + n) * k * k + 4 / 3 * k ** 3)
    return 0.0


def analyze(hlo_text: str, eigh_branch: bool | None = None, cheapest: bool = False,
            only: Callable[[list[list[int]] | None], bool] | None = None,
            without_eigh: bool = False) -> Cost:
    """Loop-aware per-device collective bytes and FLOPs of compiled HLO text.

    Args:
      hlo_text: ``compiled.as_text()`` (one device's program under SPMD).
      eigh_branch: how a conditional with an eigendecomposition in some branches (K-FAC's
        refresh) counts: None, its most expensive branch; True, the most expensive branch
        with one (a refresh step); False, the most expensive without (a plain step).
        Other conditionals count their most expensive branch, or with ``cheapest`` their
        least expensive one (a step that takes no optional branch, e.g. K-FAC's step
        between statistics steps with ``--kfac_stats_every``).
      only: count only the collectives whose `replica_groups` this predicate accepts
        (e.g. `spans_blocks(n)`); None counts them all.
      without_eigh: every conditional at its most expensive branch that runs no
        eigendecomposition outside a conditional of its own (the nested ones choose
        likewise): a step after the first of a precondition that builds its bases by
        ``eigh`` on its first update only (SOAP), wherever the conditional sits (e.g.
        inside the trainer's non-finite guard, which ``eigh_branch=False`` would drop).

    Raises:
      ValueError: for a while loop without a known trip count (its cost per step is
        not determined by the program).
    """
    comps, entry = _parse(hlo_text)
    types = {name: t for instrs in comps.values() for name, t, _, _ in instrs}
    memo: dict[str, Cost] = {}
    eigh_inside: dict[str, bool] = {}

    def has_eigh(name: str) -> bool:
        if name not in eigh_inside:
            eigh_inside[name] = False  # a computation does not call itself
            eigh_inside[name] = any(
                _is_eigh(op, rem) or any(has_eigh(c) for _, c in _CALLS.findall(rem))
                or any(has_eigh(b) for b in _branches(rem))
                for _, _, op, rem in comps.get(name, []))
        return eigh_inside[name]

    direct: dict[str, bool] = {}

    def has_direct_eigh(name: str) -> bool:
        """An eigh in `name` or its callees that no conditional of their own chooses."""
        if name not in direct:
            direct[name] = False
            direct[name] = any(
                _is_eigh(op, rem) or (op != "conditional" and any(
                    has_direct_eigh(c) for _, c in _CALLS.findall(rem)))
                for _, _, op, rem in comps.get(name, []))
        return direct[name]

    def operand_types(remainder: str) -> list[str]:
        args = remainder.split(")", 1)[0]
        return [types.get(a.strip().lstrip("%"), "") for a in args.split(",") if a.strip()]

    def cost(name: str) -> Cost:
        if name in memo:
            return memo[name]
        total = Cost()
        for _, type_str, opcode, remainder in comps.get(name, []):
            if opcode in COLLECTIVES:
                if only is None or only(replica_groups(remainder)):
                    operand_bytes = sum(_bytes(t) for t in operand_types(remainder))
                    kind = COLLECTIVES[opcode]
                    total.by_kind[kind] += max(_bytes(type_str), operand_bytes)
                    total.counts[kind] += 1
            elif opcode == "dot":
                lhs = operand_types(remainder)[0]
                dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", remainder)
                lhs_shape = _arrays(lhs)[0][1] if _arrays(lhs) else ()
                contracted = math.prod(lhs_shape[int(d)] for d in dims.group(1).split(",")
                                       if d) if dims and lhs_shape else 1
                total.flops += 2.0 * _elements(type_str) * contracted
            elif _is_eigh(opcode, remainder):
                _, shape = _arrays(type_str)[0]  # the eigenvectors, (*batch, n, n)
                matrices = math.prod(shape[:-2])
                total.eigh[shape[-1]] += matrices
                total.eigh_flops += EIGH_FLOPS_PER_N3 * shape[-1] ** 3 * matrices
                total.flops += EIGH_FLOPS_PER_N3 * shape[-1] ** 3 * matrices
            elif _is_qr(opcode, remainder):
                target = _target(opcode, remainder)
                _, shape = _arrays(type_str)[0]  # the matrices, (*batch, m, n)
                flops = _qr_flops(target, shape)
                if any(t in target for t in _QR_TARGETS):
                    total.qr[shape[-1]] += math.prod(shape[:-2])
                total.qr_flops += flops
                total.flops += flops
            elif opcode in ELEMENTWISE:
                total.flops += _elements(type_str)
            if _is_eigh(opcode, remainder) or _is_qr(opcode, remainder):
                total.linalg_calls[_target(opcode, remainder)] += 1
            elif opcode == "reduce":
                ins = operand_types(remainder)
                total.flops += sum(_elements(t) for t in ins[:len(ins) // 2 or 1])
            if opcode == "while":
                trips = _trip_count(remainder)
                if trips is None:
                    raise ValueError(f"while loop in {name} without a known trip count")
                called = dict(_CALLS.findall(remainder))
                total.add(cost(called["body"]), trips, in_loop=True)
                total.add(cost(called["condition"]), trips + 1, in_loop=True)
            elif opcode == "conditional":
                branches = _branches(remainder)
                if without_eigh:
                    branches = [b for b in branches if not has_direct_eigh(b)] or branches
                if eigh_branch is not None and any(has_eigh(b) for b in branches):
                    branches = [b for b in branches if has_eigh(b) == eigh_branch]
                if branches:
                    pick = min if cheapest and not (eigh_branch is not None and any(
                        has_eigh(b) for b in _branches(remainder))) else max
                    total.add(pick((cost(b) for b in branches),
                                   key=lambda c: (c.collective_bytes, c.flops)))
            elif opcode != "reduce":
                for attr, callee in _CALLS.findall(remainder):
                    if attr in ("calls", "to_apply"):
                        total.add(cost(callee))
        memo[name] = total
        return total

    return cost(entry)


def _branches(remainder: str) -> list[str]:
    return [b.strip().lstrip("%") for group in _BRANCHES.findall(remainder)
            for b in group.strip("{}").split(",") if b.strip()]


def in_conditional_branch(hlo_text: str, opcode: str) -> list[bool]:
    """For every `opcode` instruction of the program, whether it runs inside a conditional's
    branch (in the branch's computation or one it calls): read from the program's
    structure, not from the debug names in its metadata."""
    comps, entry = _parse(hlo_text)
    inside: dict[str, bool] = {}

    def visit(name: str, branch: bool) -> None:  # again only to mark it inside a branch
        if name not in comps or (name in inside and (inside[name] or not branch)):
            return
        inside[name] = branch
        for _, _, op, rem in comps[name]:
            for _, callee in _CALLS.findall(rem):
                visit(callee, branch)
            for callee in _branches(rem) if op == "conditional" else ():
                visit(callee, True)

    visit(entry, False)
    return [inside.get(name, False) for name, instrs in comps.items()
            for _, _, op, _ in instrs if op == opcode]


def trip_counts(hlo_text: str) -> list[int | None]:
    """The known trip count of every while loop in the program (None where unknown)."""
    comps, _ = _parse(hlo_text)
    return [_trip_count(rem) for instrs in comps.values() for _, _, op, rem in instrs
            if op == "while"]


def summary(cost: Cost) -> str:
    """One line: bytes per collective kind (MiB) and GFLOPs."""
    parts = [f"{k} {v / 2**20:.2f} MiB x{int(cost.counts[k])}" for k, v in
             sorted(cost.by_kind.items())]
    out = {"collectives": parts, "gflops": round(cost.flops / 1e9, 4)}
    if cost.eigh:
        out["eigh"] = {int(n): int(c) for n, c in sorted(cost.eigh.items())}
    if cost.qr:
        out["qr"] = {int(n): int(c) for n, c in sorted(cost.qr.items())}
    return json.dumps(out)
