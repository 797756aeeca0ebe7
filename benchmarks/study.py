"""The optimizer study: a grid of optimizer stacks x seeds through the trainer, with statistics.

Each stack is a registered optimizer (`train.optimizers.OPTIMIZERS`), optionally with
config overrides after `@` (`snoo_muon@snoo_k=7@snoo_learning_rate=0.5`), or an alias from
`ALIASES`.
Every run is `train.run` on the preset with `max_iters=--steps`; the report gives, per
stack, the final val loss (mean ± sample std over seeds), the steps to reach the target
(the baseline's mean final val loss, as the modded-nanogpt records did: the first
evaluation at or below the target, interpolated linearly between evaluations), wall time,
tokens/s, optimizer-state bytes (`optax_snoo.memory` on `jax.eval_shape` of the state) and
one-sided Welch t-tests of "this stack's final val loss is lower than the baseline's" and,
for a Snoo stack, "... than its inner optimizer's" (`snoo_muon` against `muon`), when the
inner stack is in the same grid. What this shares with `benchmarks.snoo_scaling` (a
stack's config, one run, the t-tests, the report folder) is in `benchmarks.study_tools`.

    python -m benchmarks.study                            # the default study: all suites
    python -m benchmarks.study --suite=dense              # one suite
    python -m benchmarks.study --suite=moe                # SkewAdam and friends on moe_tiny
    python -m benchmarks.study --suite=snoo_sensitivity   # k and outer lr/momentum
    python -m benchmarks.study --suite=snoo_scaling       # Snoo against model size
    python -m benchmarks.study --preset=shakespeare_char_cpu --optimizers=adamw,snoo_adamw \
        --seeds=3 --steps=500 --name=quick
    python -m benchmarks.study --preset=gpt2_small@warmup_iters=20 --optimizers=adamw,muon \
        --seeds=1 --steps=150                             # overrides for every stack

Writes `benchmarks/results/<name>.md`, `.json` and `.png` (val loss against step), one
set per suite. Runs with the same (preset, stack, seed, steps) are trained once per
invocation and shared between suites, and a persistent compilation cache (a temporary
folder, unless `jax_compilation_cache_dir` is already set) lets seeds 1.. skip compiling.

References:
  Welch, "The generalization of Student's problem when several different population
  variances are involved", Biometrika 34, 1947.
  Jordan et al., "modded-nanogpt" (records report p-values of one-sided t-tests over
  seeds), https://github.com/KellerJordan/modded-nanogpt, 2025.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import snoo_scaling
from benchmarks.study_tools import (
    ALIASES,
    RESULTS,
    compilation_cache,
    fmt_or_dash,
    machine_line,
    paired_one_sided,
    stack_config,
    train_one,
    welch_one_sided,
)


@dataclasses.dataclass(frozen=True)
class Suite:
    """A predefined grid: preset, stacks (the first is the baseline), seeds and steps."""

    preset: str
    stacks: tuple[str, ...]
    seeds: int
    steps: int
    eval_interval: int


# Sized so that the three together (92 runs, 6 of them shared) take about 70 minutes on 2 CPU
# cores: a dense step costs 50-90 ms there, a moe_tiny step about 150 ms.
SUITES: dict[str, Suite] = {
    # tiny shakespeare, nanoGPT's CPU recipe shape.
    "dense": Suite("shakespeare_char_cpu", (
        "adamw", "muon", "snoo_adamw", "snoo_muon", "snoo_muon_smooth", "normuon",
        "snoo_normuon", "kfac", "snoo_kfac"), seeds=5, steps=400, eval_interval=100),
    "moe": Suite("moe_tiny", ("adamw", "skew_adam", "snoo_skew_adam", "adafactor"),
                 seeds=5, steps=300, eval_interval=50),
    # Snoo around Muon at our scale: k, then the outer lr and momentum around (0.68, 0.37).
    "snoo_sensitivity": Suite("shakespeare_char_cpu", (
        "muon", "snoo_muon@snoo_k=7", "snoo_muon@snoo_k=14", "snoo_muon", "snoo_muon@snoo_k=56",
        "snoo_muon@snoo_learning_rate=0.5", "snoo_muon@snoo_learning_rate=0.9",
        "snoo_muon@snoo_momentum=0.0",
        "snoo_muon@snoo_momentum=0.6"), seeds=3, steps=400, eval_interval=100),
}
DEFAULT_SUITES = ("dense", "moe", "snoo_sensitivity")


def inner_stack(stack: str, stacks: Sequence[str]) -> str | None:
    """The stack in `stacks` that a Snoo stack wraps (`snoo_muon@snoo_k=7` -> `muon`), or
    None when `stack` is not a Snoo stack or its inner stack is not in the grid."""
    name = ALIASES.get(stack, stack).split("@")[0]
    inner = name.removeprefix("snoo_")
    return inner if inner != name and inner in stacks else None


def optimizer_state_bytes(config) -> int:
    """Bytes of the optimizer state of `config` on its model, from shapes only (one
    replica's with `--mesh_diloco`)."""
    from flax import nnx

    import models
    from optax_snoo.memory import state_bytes
    from train.config import model_config
    from train.data import open_dataset
    from train.optimizers import build_optimizer

    vocab = open_dataset(config.data.path).vocab_size
    gpt = nnx.eval_shape(lambda: models.GPT(model_config(config, vocab), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.split(gpt, nnx.Param, ...)[1])
    tx = build_optimizer(config).replica_tx  # with DiLoCo replicas: one replica's state
    return state_bytes(jax.eval_shape(tx.init, params))


def steps_to_target(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """First step at which the val curve reaches `target`, interpolated between evals."""
    if curve and curve[0][1] <= target:
        return float(curve[0][0])
    for (s0, l0), (s1, l1) in itertools.pairwise(curve):
        if l1 <= target:  # l0 > target here, so the division is safe
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def run_grid(preset: str, stacks: Sequence[str], *, seeds: int, steps: int,
             eval_interval: int, cache: dict[tuple, dict[str, Any]] | None = None,
             log=print) -> dict[str, Any]:
    """Train every (stack, seed) and collect curves, final losses and speed. Runs already in
    `cache` (keyed by preset, stack, seed, steps, eval interval) are not trained again."""
    cache = {} if cache is None else cache
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
    for seed in range(seeds):  # seed-major: an interrupted grid still covers every stack
        for stack in stacks:
            key = (preset, stack, seed, steps, eval_interval)
            if key not in cache:
                cache[key] = train_one(preset, stack, seed=seed, steps=steps,
                                       eval_interval=eval_interval)
                log(f"[study] {preset} {stack} seed {seed}: val {cache[key]['val_loss']:.4f}, "
                    f"{cache[key]['wall_s']:.0f} s")
            runs[stack].append(cache[key])
    state = {s: optimizer_state_bytes(stack_config(preset, s, seed=0, steps=steps,
                                                   eval_interval=eval_interval, out_dir="-"))
             for s in stacks}
    return {"preset": preset, "steps": steps, "seeds": seeds, "eval_interval": eval_interval,
            "baseline": stacks[0], "runs": runs, "state_bytes": state}


def summarize(grid: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stack: statistics against the baseline (the grid's first stack)."""
    base = [r["val_loss"] for r in grid["runs"][grid["baseline"]]]
    target = statistics.mean(base)
    rows = []
    for stack, runs in grid["runs"].items():
        finals = [r["val_loss"] for r in runs]
        reached = [s for s in (steps_to_target(r["curve"], target) for r in runs)
                   if s is not None]
        t, p = (welch_one_sided(finals, base) if stack != grid["baseline"] and len(finals) > 1
                and len(base) > 1 else (None, None))
        inner = inner_stack(stack, list(grid["runs"]))
        inner_finals = [r["val_loss"] for r in grid["runs"][inner]] if inner else []
        p_inner = (welch_one_sided(finals, inner_finals)[1]
                   if len(finals) > 1 and len(inner_finals) > 1 else None)
        p_paired = _paired_p(runs, grid["runs"][inner]) if inner else None
        p_base_paired = (_paired_p(runs, grid["runs"][grid["baseline"]])
                         if stack != grid["baseline"] else None)
        aux = [r["aux_loss"] for r in runs if r["aux_loss"] is not None]
        rows.append({
            "stack": stack, "n": len(finals), "val_mean": statistics.mean(finals),
            "val_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "steps_to_target": statistics.mean(reached) if reached else None,
            "reached": len(reached), "wall_s": statistics.mean(r["wall_s"] for r in runs),
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in runs),
            "state_bytes": grid["state_bytes"][stack], "t": t, "p": p,
            "p_paired": p_base_paired,
            "inner": inner, "p_inner": p_inner, "p_inner_paired": p_paired,
            "aux_loss": statistics.mean(aux) if aux else None})
    return rows


def _paired_p(runs: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]]) -> float | None:
    """p of the paired one-sided t-test "runs' final val loss < others'", over the seeds
    both have (None with fewer than two)."""
    by_seed = {r["seed"]: r["val_loss"] for r in others}
    pairs = [(r["val_loss"], by_seed[r["seed"]]) for r in runs if r["seed"] in by_seed]
    return paired_one_sided(*zip(*pairs, strict=True))[1] if len(pairs) > 1 else None


def write_report(name: str, grid: dict[str, Any], rows: list[dict[str, Any]],
                 command: str, directory: Path | None = None,
                 machine: str | None = None) -> Path:
    """Write `<name>.md`, `<name>.json` and `<name>.png` into `directory` (`RESULTS`);
    `machine` (default: `machine_line()` now) says where and when the grid ran."""
    directory = RESULTS if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    machine = machine_line() if machine is None else machine
    target = rows[0]["val_mean"]
    moe = any(r["aux_loss"] for r in rows)
    head = ("| stack | val loss (mean ± std) | steps to target | wall s | tokens/s | "
            "opt state | p (< baseline) | p (< inner) |" + (" aux loss |" if moe else ""))
    lines = [
        f"# Study `{name}`", "",
        f"`{command}`", "",
        f"{machine}. Preset `{grid['preset']}`, "
        f"{grid['steps']} steps, {grid['seeds']} seeds (0..{grid['seeds'] - 1}), evaluation "
        f"every {grid['eval_interval']} steps. Baseline `{grid['baseline']}`; target = its "
        f"mean final val loss {target:.4f}.", "",
        head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        steps = "-" if r["steps_to_target"] is None else (
            f"{r['steps_to_target']:.0f} ({r['reached']}/{r['n']})")
        inner = "-" if r["p_inner"] is None else (
            f"{r['inner']}: {r['p_inner']:.4f}, paired {fmt_or_dash(r['p_inner_paired'], '.4f')}")
        line = (f"| {r['stack']} | {r['val_mean']:.4f} ± {r['val_std']:.4f} | {steps} | "
                f"{r['wall_s']:.0f} | {r['tokens_per_sec']:,.0f} | "
                f"{r['state_bytes'] / 2**20:.2f} MiB | {_welch_and_paired(r)} | {inner} |")
        lines.append(line + (f" {fmt_or_dash(r['aux_loss'], '.4f')} |" if moe else ""))
    lines += ["", "p: one-sided t-tests of the stack's final val loss against the "
              "baseline's (p < baseline) and, for a Snoo stack, against the stack it wraps "
              "(p < inner): Welch's, and paired by seed, since a seed fixes the init and the "
              "batches. Steps to target: mean over the seeds that reached it.", ""]
    (directory / f"{name}.md").write_text("\n".join(lines))
    (directory / f"{name}.json").write_text(json.dumps(
        {"command": command, "machine": machine, "grid": grid, "rows": rows}, indent=1) + "\n")
    _plot(grid, directory / f"{name}.png")
    return directory / f"{name}.md"


def _welch_and_paired(row: dict[str, Any]) -> str:
    """The baseline cell: Welch's p, then the paired one where there is one."""
    if row["p"] is None:
        return "-"
    paired = row.get("p_paired")  # reports written before it was computed lack it
    return f"{row['p']:.4f}" + ("" if paired is None else f", paired {paired:.4f}")


def _plot(grid: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # not pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for stack, runs in grid["runs"].items():
        steps = [s for s, _ in runs[0]["curve"]]
        losses = np.array([[v for _, v in r["curve"]] for r in runs])
        mean, std = losses.mean(0), losses.std(0)
        ax.plot(steps, mean, label=stack)
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    low = min(min(v for _, v in r["curve"]) for runs in grid["runs"].values() for r in runs)
    ax.set_ylim(low - 0.05, low + 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{grid['preset']}: val loss, mean ± std over {grid['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rewrite_report(name: str, directory: Path | None = None) -> Path:
    """Rewrite `<name>.md` and `.png` from `<name>.json` (the grid and its command)."""
    directory = RESULTS if directory is None else directory
    saved = json.loads((directory / f"{name}.json").read_text())
    grid = saved["grid"]
    for runs in grid["runs"].values():  # JSON turned the curves' (step, loss) into lists
        for r in runs:
            r["curve"] = [tuple(point) for point in r["curve"]]
    return write_report(name, grid, summarize(grid), saved["command"], directory,
                        machine=saved.get("machine", "(machine not recorded)"))


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=["all", *sorted(SUITES), "snoo_scaling"],
                        help=f"a predefined grid; 'all' (the default without --optimizers) "
                             f"runs {', '.join(DEFAULT_SUITES)}; 'snoo_scaling' is Snoo "
                             "against model size (benchmarks/snoo_scaling.py; takes "
                             "--steps, --seeds, --from_json)")
    parser.add_argument("--preset", help="trainer preset (overrides the suite's), with "
                        "overrides for every stack after @: gpt2_small@warmup_iters=20")
    parser.add_argument("--optimizers", help="comma-separated stacks; the first is the baseline")
    parser.add_argument("--seeds", type=int, help="seeds per stack (>= 2 for the t-test)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run")
    parser.add_argument("--eval_interval", type=int, help="steps between evaluations")
    parser.add_argument("--name", help="report name under benchmarks/results/ (one grid only)")
    parser.add_argument("--from_json", action="store_true",
                        help="train nothing: rewrite each report from its .json grid")
    args = parser.parse_args(argv)
    if args.suite == "snoo_scaling":
        if args.preset or args.optimizers or args.name or args.eval_interval:
            parser.error("--suite=snoo_scaling takes only --steps, --seeds and --from_json")
        return snoo_scaling.main(steps=args.steps, seeds=args.seeds,
                                 from_json=args.from_json, argv=argv)
    if args.optimizers and not (args.preset or args.suite not in (None, "all")):
        parser.error("--optimizers needs --preset (or a single --suite for its preset)")
    if args.optimizers:
        names = [args.suite if args.suite not in (None, "all") else None]
    else:
        names = list(DEFAULT_SUITES) if args.suite in (None, "all") else [args.suite]
    if args.name and len(names) > 1:
        parser.error("--name names one grid's report; give --suite or --optimizers with it")
    grids = []
    for suite_name in names:
        suite = SUITES[suite_name] if suite_name else None
        preset = args.preset or suite.preset
        stacks = tuple(args.optimizers.split(",")) if args.optimizers else suite.stacks
        seeds = args.seeds or (suite.seeds if suite else 3)
        steps = args.steps or (suite.steps if suite else 1000)
        eval_interval = args.eval_interval or (suite.eval_interval if suite else 100)
        if seeds < 1 or steps < 1 or eval_interval < 1:
            parser.error(f"--seeds, --steps, --eval_interval must be >= 1 (got {seeds}, "
                         f"{steps}, {eval_interval})")
        for stack in stacks:  # fail before hours of training, not after
            stack_config(preset, stack, seed=0, steps=steps, eval_interval=eval_interval,
                         out_dir="-")
        grids.append((args.name or suite_name or "study", preset, stacks, seeds, steps,
                      eval_interval))
    command = "python -m benchmarks.study " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_json:
        return [rewrite_report(name) for name, *_ in grids]
    reports, cache = [], {}
    with (tempfile.TemporaryDirectory(prefix="optax_snoo_study_jax_cache_") as jax_cache,
          compilation_cache(jax_cache)):
        for name, preset, stacks, seeds, steps, eval_interval in grids:
            grid = run_grid(preset, stacks, seeds=seeds, steps=steps,
                            eval_interval=eval_interval, cache=cache)
            reports.append(write_report(name, grid, summarize(grid), command.strip()))
            print(reports[-1].read_text())
    return reports


if __name__ == "__main__":
    main()
