"""Snoo against model size: `python -m benchmarks.study --suite=snoo_scaling`.

Does Snoo's gain over its inner optimizer grow with the model, as Kallusky et al. report
at up to 1e23 training FLOPs? The grid trains nanoGPT's CPU recipe (tiny shakespeare, 4
layers, block 64, batch 12: the same tokens per step at every size) at several widths,
each run with its own warmup and a cosine that ends at its last step:

- `adamw` against `snoo_adamw`, and `muon` against `snoo_muon` (at `muon_widths`), paired
  by seed (a seed fixes the init and the batches), with Snoo at two settings: the
  modded-nanogpt record's (k = 28, outer lr 0.68, momentum 0.37) and the paper's tuned one
  (K = 100, η = 0.8, μ = 0.75, its 125M-parameter optimum);
- `adamw` at several lengths (1.25x, 1.5x, 2x the steps, fewer seeds), for the paper's
  **compute factor**: the training length AdamW needs to reach Snoo's final val loss,
  divided by Snoo's, interpolated linearly between the final losses of the AdamW runs
  bracketing it (each run's own final loss, never a point part-way along a longer run). A
  Snoo loss beyond the longest AdamW run's gives a lower bound; one above the 1x run's
  gives an upper bound of 1.

The loss compared is each run's final checkpoint on the whole val split
(`train.evaluate.evaluate_split`: every 64-token window once, the same tokens for every
run), not the trainer's 20-random-batch estimate.

    python -m benchmarks.study --suite=snoo_scaling               # the grid (~80 min, 2 cores)
    python -m benchmarks.study --suite=snoo_scaling --steps=30 --seeds=2   # a smoke run
    python -m benchmarks.study --suite=snoo_scaling --from_json   # rewrite the report

Writes `benchmarks/results/snoo_scaling.{md,json,png}`; runs finished so far are kept in
`snoo_scaling.partial.json` beside them, so an interrupted grid resumes where it stopped.

References:
  Kallusky, Rao, Nandavanam, Shi, "SNOO: Step-K Nesterov Outer Optimizer - The
  Surprising Effectiveness of Nesterov Momentum Applied to Pseudo-Gradients",
  arXiv:2510.15830, 2025.
  Jordan et al., "modded-nanogpt", GPT-2 Medium record of 2025-09-16 (Snoo, PR #128),
  https://github.com/KellerJordan/modded-nanogpt, 2025.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import study_tools

# Snoo's (k, outer lr, outer momentum): the record's are the trainer's defaults.
SNOO_SETTINGS: dict[str, str] = {
    "record": "",
    "paper": "@snoo_k=100@snoo_learning_rate=0.8@snoo_momentum=0.75",
}


@dataclasses.dataclass(frozen=True)
class ScalingGrid:
    """The runs of the study. Sized for about 80 minutes on 2 CPU cores: a step costs about
    14, 40 and 90 ms at widths 64, 128 and 256 with AdamW, 20, 70 and 220 ms with Muon."""

    preset: str = "shakespeare_char_cpu"
    widths: tuple[int, ...] = (64, 128, 256)  # 0.20M, 0.79M, 3.15M non-embedding params
    muon_widths: tuple[int, ...] = (64, 128)
    steps: int = 1000
    seeds: int = 3
    lengths: tuple[float, ...] = (1.25, 1.5, 2.0)  # AdamW runs beside the 1x ones
    length_seeds: tuple[int, ...] = (2, 2, 1)  # seeds of those runs, by width
    eval_interval: int = 250

    def __post_init__(self):
        if len(self.length_seeds) != len(self.widths):
            raise ValueError(f"length_seeds={self.length_seeds}: expected one seed count "
                             f"per width {self.widths}")

    def preset_at(self, width: int) -> str:
        return f"{self.preset}@n_embd={width}"

    def runs(self) -> list[tuple[int, str, int, int]]:
        """Every `(width, stack, seed, steps)`, smallest width first, seed-major within it."""
        out = []
        for width, length_seeds in zip(self.widths, self.length_seeds, strict=True):
            pairs = [("adamw", "snoo_adamw")]
            if width in self.muon_widths:
                pairs.append(("muon", "snoo_muon"))
            for seed in range(self.seeds):
                for inner, snoo in pairs:
                    out.append((width, inner, seed, self.steps))
                    out += [(width, snoo + extra, seed, self.steps)
                            for extra in SNOO_SETTINGS.values()]
            for seed in range(length_seeds):
                out += [(width, "adamw", seed, round(self.steps * f)) for f in self.lengths]
        return out


def run_key(width: int, stack: str, seed: int, steps: int) -> str:
    return f"{width}/{stack}/{seed}/{steps}"


def _renamed_runs(results: dict[str, Any]) -> dict[str, Any]:
    """`results` keyed by today's names (runs saved before the config's renames name
    `snoo_lr`; `study_tools.renamed_stack`)."""
    out = {}
    for key, value in results.items():
        width, stack, seed, steps = key.split("/")
        out[run_key(width, study_tools.renamed_stack(stack), seed, steps)] = value
    return out


def non_embedding_params(preset: str) -> int:
    """Parameters of the preset's model other than the token and position embeddings."""
    import jax
    from flax import nnx

    import models
    from train.config import model_config, parse_args
    from train.data import open_dataset

    name, *overrides = preset.split("@")
    config = parse_args([f"--preset={name}", *(f"--{o}" for o in overrides)])
    vocab = open_dataset(config.data.path).vocab_size
    gpt = nnx.eval_shape(lambda: models.GPT(model_config(config, vocab), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(gpt, nnx.Param))
    return sum(int(np.prod(leaf.shape)) for name, sub in params.items()
               if name not in ("wte", "wpe") for leaf in jax.tree.leaves(sub))


def compute_factor(lengths: Sequence[float], losses: Sequence[float],
                   target: float) -> tuple[float, str]:
    """`(factor, kind)`: the AdamW length (a multiple of Snoo's) whose final loss is
    `target`, linear between the two runs that bracket it; `kind` is "=", or ">=" (even
    the longest run is above `target`: a lower bound) or "<=" (the 1x run is already at
    or below it: Snoo gains nothing)."""
    order = np.argsort(lengths)
    x, y = np.asarray(lengths, float)[order], np.asarray(losses, float)[order]
    if target >= y[0]:
        return float(x[0]), "<="
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(x, y, strict=True)):
        if y1 <= target:  # y0 > target here: the first crossing
            return float(x0 + (x1 - x0) * (y0 - target) / (y0 - y1)), "="
    return float(x[-1]), ">="


def summarize(grid: ScalingGrid, results: dict[str, dict[str, Any]],
              params: dict[int, int]) -> list[dict[str, Any]]:
    """One row per (width, Snoo stack): both stacks' whole-val losses, their paired
    difference and one-sided p-value, and (AdamW stacks) the compute factor."""
    def finals(width, stack, steps, seeds):
        return [results[run_key(width, stack, s, steps)]["whole_val_loss"] for s in seeds]

    rows = []
    for width, length_seeds in zip(grid.widths, grid.length_seeds, strict=True):
        seeds = range(grid.seeds)
        lengths = [1.0, *grid.lengths]
        adamw_curve = [statistics.mean(finals(width, "adamw", round(grid.steps * f),
                                              seeds if f == 1.0 else range(length_seeds)))
                       for f in lengths]
        pairs = [("adamw", "snoo_adamw")] + (
            [("muon", "snoo_muon")] if width in grid.muon_widths else [])
        for inner, snoo in pairs:
            base = finals(width, inner, grid.steps, seeds)
            for setting, extra in SNOO_SETTINGS.items():
                ours = finals(width, snoo + extra, grid.steps, seeds)
                diff = [a - b for a, b in zip(ours, base, strict=True)]
                p = study_tools.paired_one_sided(ours, base)[1] if len(diff) > 1 else None
                factor, kind = (compute_factor(lengths, adamw_curve, statistics.mean(ours))
                                if inner == "adamw" else (None, None))
                rows.append({
                    "width": width, "params": params[width], "inner": inner,
                    "stack": snoo + extra, "setting": setting, "n": len(ours),
                    "inner_mean": statistics.mean(base),
                    "inner_std": statistics.stdev(base) if len(base) > 1 else 0.0,
                    "snoo_mean": statistics.mean(ours),
                    "snoo_std": statistics.stdev(ours) if len(ours) > 1 else 0.0,
                    "diff_mean": statistics.mean(diff),
                    "diff_std": statistics.stdev(diff) if len(diff) > 1 else 0.0,
                    "p": p, "compute_factor": factor, "factor_kind": kind,
                    "adamw_lengths": lengths if inner == "adamw" else None,
                    "adamw_losses": adamw_curve if inner == "adamw" else None})
    return rows


def _fmt_factor(row: dict[str, Any]) -> str:
    if row["compute_factor"] is None:
        return "-"
    return {"=": "", ">=": "≥ ", "<=": "≤ "}[row["factor_kind"]] + f"{row['compute_factor']:.2f}"


def write_report(grid: ScalingGrid, results: dict[str, dict[str, Any]],
                 params: dict[int, int], command: str, machine: str, wall_s: float,
                 directory: Path | None = None) -> Path:
    """`snoo_scaling.{md,json,png}` in `directory` (`benchmarks/results`)."""
    directory = study_tools.RESULTS if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    rows = summarize(grid, results, params)
    head = ("| width | non-emb. params | stacks | Snoo setting | inner val (mean ± std) | "
            "Snoo val (mean ± std) | Snoo − inner, paired | p (Snoo < inner) | "
            "compute factor |")
    lines = [
        "# Study `snoo_scaling`: Snoo against model size", "",
        f"`{command}`", "",
        f"{machine}; {len(results)} runs, {wall_s / 60:.0f} min. Preset `{grid.preset}` at "
        f"n_embd {', '.join(map(str, grid.widths))} (4 layers, block 64, batch 12: 768 "
        f"tokens per step at every size); {grid.steps} steps, {grid.seeds} seeds per stack; "
        f"AdamW also at {', '.join(f'{f:g}x' for f in grid.lengths)} the steps with "
        f"{', '.join(map(str, grid.length_seeds))} seeds by width. Every run warms up and "
        "decays over its own length. "
        "Loss: the final checkpoint on the whole val split. Snoo settings: record = "
        "(k 28, lr 0.68, μ 0.37), paper = (K 100, η 0.8, μ 0.75).", "",
        head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['params'] / 1e6:.2f}M | {r['inner']} vs "
            f"{r['stack'].split('@')[0]} | {r['setting']} | {r['inner_mean']:.4f} ± "
            f"{r['inner_std']:.4f} | {r['snoo_mean']:.4f} ± {r['snoo_std']:.4f} | "
            f"{r['diff_mean']:+.4f} ± {r['diff_std']:.4f} | "
            f"{study_tools.fmt_or_dash(r['p'], '.4f')} | {_fmt_factor(r)} |")
    lines += ["", "AdamW's final whole-val loss by length (mean over seeds), the curve the "
              "compute factor is read from:", "",
              "| width | " + " | ".join(f"{f:g}x" for f in [1.0, *grid.lengths]) + " |",
              "|---|" + "---|" * (1 + len(grid.lengths))]
    for r in rows:
        if r["inner"] == "adamw" and r["setting"] == "record":
            lines.append(f"| {r['width']} | " + " | ".join(
                f"{v:.4f}" for v in r["adamw_losses"]) + " |")
    lines += ["", "p: one-sided paired t-test (n − 1 degrees of freedom) of Snoo's final "
              "loss below its inner optimizer's, pairs sharing a seed. Compute factor: "
              "AdamW steps to reach Snoo's mean final loss over Snoo's steps; ≥ means even "
              "the longest AdamW run did not reach it, ≤ 1.00 that the 1x run already did.",
              ""]
    (directory / "snoo_scaling.md").write_text("\n".join(lines))
    (directory / "snoo_scaling.json").write_text(json.dumps(
        {"command": command, "machine": machine, "wall_s": wall_s,
         "grid": dataclasses.asdict(grid), "params": params, "results": results,
         "rows": rows}, indent=1) + "\n")
    _plot(rows, directory / "snoo_scaling.png")
    return directory / "snoo_scaling.md"


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    markers = {"=": "o", ">=": "^", "<=": "v"}
    for setting in SNOO_SETTINGS:
        mine = [r for r in rows if r["inner"] == "adamw" and r["setting"] == setting]
        xs = [r["params"] for r in mine]
        left.plot(xs, [r["compute_factor"] for r in mine], "-", alpha=0.5,
                  label=f"snoo_adamw, {setting}")
        for r in mine:
            left.plot(r["params"], r["compute_factor"], markers[r["factor_kind"]], color="k")
        for inner in ("adamw", "muon"):
            mine = [r for r in rows if r["inner"] == inner and r["setting"] == setting]
            if mine:
                right.errorbar([r["params"] for r in mine], [r["diff_mean"] for r in mine],
                               yerr=[r["diff_std"] for r in mine], marker="o", capsize=3,
                               label=f"snoo_{inner} − {inner}, {setting}")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(xscale="log", xlabel="non-embedding params", ylabel="compute factor vs AdamW",
             title="compute factor (▲ lower bound, ▼ upper bound)")
    right.axhline(0.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="non-embedding params",
              ylabel="final val loss difference (nats)", title="Snoo − inner, paired by seed")
    for ax in (left, right):
        ax.xaxis.set_minor_formatter(NullFormatter())  # 2x10^5, 3x10^5 ... overlap
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _train(width: int, stack: str, seed: int, steps: int, grid: ScalingGrid) -> dict[str, Any]:
    run = study_tools.train_one(grid.preset_at(width), stack, seed=seed, steps=steps,
                          eval_interval=min(grid.eval_interval, steps), whole_val=True)
    return {"whole_val_loss": run["whole_val_loss"], "val_loss": run["val_loss"],
            "wall_s": run["wall_s"], "tokens_per_sec": run["tokens_per_sec"]}


def run(grid: ScalingGrid, *, command: str, directory: Path | None = None,
        train: Callable[..., dict[str, Any]] = _train, log=print) -> Path:
    """Train the grid's runs not already in `<directory>/snoo_scaling.partial.json` (kept
    after each run; its runs stay valid for another grid on the same preset and eval
    interval) and write the report."""
    directory = study_tools.RESULTS if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / "snoo_scaling.partial.json"
    saved = json.loads(partial.read_text()) if partial.exists() else {}
    spec = json.loads(json.dumps(dataclasses.asdict(grid)))  # tuples as JSON keeps them
    if any(saved.get("grid", {}).get(k) != spec[k] for k in ("preset", "eval_interval")):
        saved = {"results": {}, "wall_s": 0.0}  # runs keyed by width/stack/seed/steps
    saved["grid"] = spec
    results = saved["results"] = _renamed_runs(saved["results"])
    t0, wall_before = time.perf_counter(), saved["wall_s"]
    for width, stack, seed, steps in grid.runs():
        key = run_key(width, stack, seed, steps)
        if key not in results:
            results[key] = train(width, stack, seed, steps, grid)
            saved["wall_s"] = wall_before + time.perf_counter() - t0
            partial.write_text(json.dumps(saved, indent=1) + "\n")
            log(f"[snoo_scaling] {key}: whole val {results[key]['whole_val_loss']:.4f}, "
                f"{results[key]['wall_s']:.0f} s")
    params = {w: non_embedding_params(grid.preset_at(w)) for w in grid.widths}
    report = write_report(grid, results, params, command, study_tools.machine_line(),
                          saved["wall_s"], directory)
    partial.unlink()
    return report


def rewrite_report(directory: Path | None = None) -> Path:
    """Rewrite `snoo_scaling.md` and `.png` from its `.json`."""
    directory = study_tools.RESULTS if directory is None else directory
    saved = json.loads((directory / "snoo_scaling.json").read_text())
    grid = ScalingGrid(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in saved["grid"].items()})
    params = {int(k): v for k, v in saved["params"].items()}
    return write_report(grid, _renamed_runs(saved["results"]), params, saved["command"],
                        saved["machine"],
                        saved["wall_s"], directory)


def main(*, steps: int | None, seeds: int | None, from_json: bool,
         argv: Sequence[str] | None = None) -> list[Path]:
    """`python -m benchmarks.study --suite=snoo_scaling [--steps] [--seeds] [--from_json]`."""
    if from_json:
        return [rewrite_report()]
    grid = ScalingGrid()
    grid = dataclasses.replace(grid, steps=steps or grid.steps, seeds=seeds or grid.seeds,
                               length_seeds=tuple(min(n, seeds or grid.seeds)
                                                  for n in grid.length_seeds))
    command = "python -m benchmarks.study " + " ".join(
        argv if argv is not None else sys.argv[1:])
    with (tempfile.TemporaryDirectory(prefix="optax_snoo_study_jax_cache_") as cache,
          study_tools.compilation_cache(cache)):  # seeds and lengths share compiled programs
        report = run(grid, command=command.strip())
    print(report.read_text())
    return [report]
