"""modded-nanogpt Track 3's protocol as a tool: `python -m benchmarks.track3 --optimizers=A,B
--seeds=n --preset=track3_cpu`.

Runs each optimizer `n` seeds with the trainer (one `python -m train` process a run, the
preset's data order, validation and cadence), then applies the benchmark's statistics
(records/track_3_optimization/README.md) to the val losses at the evaluation steps:

- one-sample rule: at an evaluation step, `(target - mean) * sqrt(n) >= c`; the benchmark's
  `c = 0.004` is `z * sigma` with `z = 3.09` (one-sided p < 0.001) and `sigma = 0.0013`,
  its seed-to-seed std of the final loss. On the twin `sigma` is measured: the std of the
  first optimizer's (the baseline's) final losses over its seeds (`--sigma` overrides), and
  `c = 3.09 sigma`. An optimizer's result is the first evaluation step where the rule holds.
- target: the benchmark picked 3.28, a loss its baseline reaches at its planned step count;
  here (unless `--target`) the baseline's mean final loss plus `c / sqrt(n)`, rounded up to
  3 decimals: the smallest 3-decimal target the baseline passes at its last step.
- pairwise rule, for each pair (old = the earlier in `--optimizers`):
  `(old mean - new mean + (old steps - new steps) / 100 * d) / sqrt(1/n_old + 1/n_new) >= c`,
  each at its own result step (both at their last step where one has no result); `d` is
  the loss the baseline loses per 100 fewer steps near the target (the benchmark
  measured 0.0045), here the least-squares slope of the baseline's mean val loss over the
  evaluations of the last `--slope_frac` of the run (an approximation: the benchmark
  compared runs of different lengths).

Writes `<out>.json`, `<out>.md` and `<out>.png` (default `benchmarks/results/<preset>`);
each run keeps its folder under `--runs_dir` and is not run again while its metrics hold
the final step (`--rerun` forces it).

References:
  Jordan et al., modded-nanogpt Track 3 (optimization), README (rules, statistics) and
  train_gpt_simple.py,
  https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
  2026.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: One-sided z of the benchmark's p < 0.001 (0.004 = Z_999 x 0.0013, rounded).
Z_999 = statistics.NormalDist().inv_cdf(0.999)
#: The benchmark's own constants (README of records/track_3_optimization).
BENCHMARK_SIGMA, BENCHMARK_THRESHOLD, BENCHMARK_PER_100 = 0.0013, 0.004, 0.0045


# ------------------------------------------------------------------------ statistics


def threshold(sigma: float, z: float = Z_999) -> float:
    """`c = z * sigma`: the one-sample rule's right-hand side (benchmark: 3.09 x 0.0013)."""
    if not sigma > 0:
        raise ValueError(f"sigma={sigma!r}: expected a seed-to-seed std > 0")
    return z * sigma


def one_sample_score(losses: Sequence[float], target: float) -> float:
    """`(target - mean) * sqrt(n)` of the `n` seeds' losses at one evaluation step."""
    if not len(losses):
        raise ValueError("losses: expected at least one run")
    return (target - float(np.mean(losses))) * math.sqrt(len(losses))


def first_significant_step(steps: Sequence[int], losses_by_seed: Sequence[Sequence[float]],
                           target: float, c: float) -> int | None:
    """The first of `steps` where `one_sample_score(losses at it, target) >= c`, or None.

    Args:
      steps: the evaluation steps, increasing.
      losses_by_seed: one row per seed, one loss per step (the same steps for every seed:
        the benchmark forbids per-run choices).
    """
    table = np.asarray(losses_by_seed, np.float64)
    if table.ndim != 2 or table.shape[1] != len(steps):
        raise ValueError(f"losses_by_seed: expected (seeds, {len(steps)}) losses, got shape "
                         f"{table.shape}")
    for j, step in enumerate(steps):
        if one_sample_score(table[:, j], target) >= c:
            return int(step)
    return None


def pairwise_score(old: tuple[float, int, int], new: tuple[float, int, int],
                   per_100: float) -> float:
    """`(old mean - new mean + (old steps - new steps)/100 * per_100) / sqrt(1/n_old +
    1/n_new)`; `old`, `new` are `(mean loss, runs, steps)`. The new result is better when
    this is at least the one-sample threshold `c`."""
    (old_loss, n_old, old_steps), (new_loss, n_new, new_steps) = old, new
    step_term = (old_steps - new_steps) / 100 * per_100
    return (old_loss - new_loss + step_term) / math.sqrt(1 / n_old + 1 / n_new)


def loss_per_100_steps(steps: Sequence[int], mean_losses: Sequence[float]) -> float:
    """The loss lost per 100 fewer steps: `-100 x` the least-squares slope of the losses
    against the steps (>= 0 for a falling curve)."""
    if len(steps) < 2:
        raise ValueError("loss_per_100_steps: expected at least two evaluations")
    slope = np.polyfit(np.asarray(steps, np.float64), np.asarray(mean_losses, np.float64), 1)[0]
    return float(-100 * slope)


def target_from_baseline(final_losses: Sequence[float], c: float, decimals: int = 3) -> float:
    """The smallest target with `decimals` decimals that the baseline's final losses pass:
    `mean + c / sqrt(n)` rounded up (3.28 played this role for the benchmark's 3.2787,
    n = 10)."""
    need = float(np.mean(final_losses)) + c / math.sqrt(len(final_losses))
    scale = 10 ** decimals
    return math.ceil(need * scale - 1e-9) / scale


def steps_to_target(steps: Sequence[int], losses: Sequence[float],
                    target: float) -> int | None:
    """One run's first evaluation step with `loss <= target`, or None (a per-seed figure
    for the paired test; the benchmark's own result is `first_significant_step`)."""
    for step, loss in zip(steps, losses, strict=True):
        if loss <= target:
            return int(step)
    return None


def paired_t_test(base: Mapping[int, float | None],
                  other: Mapping[int, float | None]) -> dict:
    """Two-sided paired t-test of `other - base` over the seeds both define (not None).

    Args:
      base, other: `{seed: value}` (a final loss, or steps to the target).

    Returns:
      `{"n", "mean_diff", "std_diff", "t", "p", "seeds"}`: the pairs' mean and std
      (ddof 1) of `other - base`, `t = mean / (std / sqrt(n))` and its two-sided p under
      Student's t with `n - 1` degrees of freedom; `t` and `p` are None below two pairs,
      and `t = ±inf`, `p = 0` (or `t = 0`, `p = 1`) when every difference is the same.
    """
    from scipy import stats

    seeds = sorted(s for s in base if s in other and base[s] is not None
                   and other[s] is not None)
    diff = np.array([other[s] - base[s] for s in seeds], np.float64)
    out = {"n": len(seeds), "seeds": seeds,
           "mean_diff": float(diff.mean()) if len(seeds) else None,
           "std_diff": float(diff.std(ddof=1)) if len(seeds) > 1 else None,
           "t": None, "p": None}
    if len(seeds) < 2:
        return out
    if out["std_diff"] == 0:
        out["t"] = 0.0 if out["mean_diff"] == 0 else math.copysign(math.inf, out["mean_diff"])
        out["p"] = 1.0 if out["mean_diff"] == 0 else 0.0
        return out
    t = out["mean_diff"] / (out["std_diff"] / math.sqrt(len(seeds)))
    out["t"], out["p"] = float(t), float(2 * stats.t.sf(abs(t), len(seeds) - 1))
    return out


def summarize(curves: Mapping[str, Mapping[int, Mapping[int, float]]], *,
              target: float | None = None, sigma: float | None = None,
              slope_frac: float = 0.2) -> dict:
    """The protocol's figures from `curves[optimizer][seed][step] = val loss`.

    The first optimizer is the baseline (sigma, target and the per-100-steps term come
    from it unless given). Steps are those every run of an optimizer evaluated.
    """
    names = list(curves)
    if not names:
        raise ValueError("curves: expected at least one optimizer")
    table = {}
    for name in names:
        seeds = sorted(curves[name])
        steps = sorted(set.intersection(*(set(curves[name][s]) for s in seeds)))
        table[name] = (seeds, steps, np.array([[curves[name][s][t] for t in steps]
                                               for s in seeds]))
    base_seeds, base_steps, base = table[names[0]]
    if sigma is None:
        if len(base_seeds) < 2:
            raise ValueError("sigma: measuring it needs at least two baseline seeds; pass it")
        sigma = float(np.std(base[:, -1], ddof=1))
    c = threshold(sigma)
    if target is None:
        target = target_from_baseline(base[:, -1], c)
    last = base_steps[-1]
    window = [j for j, t in enumerate(base_steps) if t >= (1 - slope_frac) * last]
    per_100 = loss_per_100_steps([base_steps[j] for j in window], base[:, window].mean(0))
    out = {"target": target, "sigma": sigma, "threshold": c, "z": Z_999,
           "per_100_steps": per_100, "slope_window": [base_steps[window[0]], last],
           "optimizers": {}}
    for name in names:
        seeds, steps, losses = table[name]
        step = first_significant_step(steps, losses, target, c)
        at = steps.index(step) if step is not None else len(steps) - 1
        out["optimizers"][name] = {
            "seeds": seeds, "steps": steps, "losses": losses.tolist(),
            "mean": losses.mean(0).tolist(),
            "std": (losses.std(0, ddof=1) if len(seeds) > 1 else 0 * losses[0]).tolist(),
            "result_step": step, "result_mean": float(losses[:, at].mean()),
            "final_mean": float(losses[:, -1].mean()),
            "final_std": float(losses[:, -1].std(ddof=1)) if len(seeds) > 1 else None,
            "score_at_final": one_sample_score(losses[:, -1], target)}
    pairs = []
    for i, old in enumerate(names):
        for new in names[i + 1:]:
            o, n = out["optimizers"][old], out["optimizers"][new]
            # at each one's result step; where one has none, both at their last step
            at_result = o["result_step"] is not None and n["result_step"] is not None
            key = ("result_mean", "result_step") if at_result else ("final_mean", "last")
            a, b = ((r[key[0]], len(r["seeds"]), r["steps"][-1] if key[1] == "last" else
                     r[key[1]]) for r in (o, n))
            score, reverse = pairwise_score(a, b, per_100), pairwise_score(b, a, per_100)
            pairs.append({"old": old, "new": new, "at": "result" if at_result else "final",
                          "score": score, "better": score >= c, "reverse_score": reverse,
                          "old_better": reverse >= c})
    out["pairs"] = pairs
    for name in names:
        o = out["optimizers"][name]
        o["seed_steps_to_target"] = {
            seed: steps_to_target(o["steps"], row, target)
            for seed, row in zip(o["seeds"], o["losses"], strict=True)}
    base = out["optimizers"][names[0]]
    base_final = {s: row[-1] for s, row in zip(base["seeds"], base["losses"], strict=True)}
    out["paired"] = {}
    for name in names[1:]:
        o = out["optimizers"][name]
        final = {s: row[-1] for s, row in zip(o["seeds"], o["losses"], strict=True)}
        out["paired"][name] = {
            "final_loss": paired_t_test(base_final, final),
            "steps_to_target": paired_t_test(base["seed_steps_to_target"],
                                             o["seed_steps_to_target"])}
    return out


# ------------------------------------------------------------------------------ runs


def read_curve(metrics: Path) -> dict[int, float]:
    """`{step: val_loss}` of a run's `metrics.jsonl`."""
    curve = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "val_loss" in row:
            curve[int(row["step"])] = float(row["val_loss"])
    return curve


def run_one(preset: str, optimizer: str, seed: int, out_dir: Path, extra: Sequence[str],
            max_iters: int, rerun: bool) -> tuple[dict[int, float], float | None]:
    """Train one run in its own process (unless its metrics already hold `max_iters`):
    its val-loss curve and wall time (None when reused)."""
    metrics = out_dir / "metrics.jsonl"
    if not rerun and metrics.exists() and max_iters in read_curve(metrics):
        return read_curve(metrics), None
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    cmd = [sys.executable, "-m", "train", f"--preset={preset}", f"--optimizer={optimizer}",
           f"--seed={seed}", f"--out_dir={out_dir}", "--progress=false", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return read_curve(metrics), time.perf_counter() - t0


def per_optimizer_options(items: Sequence[str], names: Sequence[str]) -> dict[str, list[str]]:
    """`["opt:key=value", ...]` -> `{opt: ["--key=value", ...]}` (trainer options for one
    optimizer's runs only)."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv or name not in names:
            raise ValueError(f"--set_for={item!r}: expected OPTIMIZER:KEY=VALUE with "
                             f"OPTIMIZER one of {list(names)}")
        out.setdefault(name, []).append(f"--{kv}")
    return out


def _machine() -> dict:
    info = {"platform": platform.platform(), "load_average": list(os.getloadavg())}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info["cpu"] = next((x.split(":", 1)[1].strip() for x in lscpu.splitlines()
                            if x.startswith("Model name")), "?")
    except OSError:
        info["cpu"] = "?"
    return info


def write_report(summary: dict, out: Path, title: str) -> None:
    """`out.json`, `out.md` (tables) and `out.png` (mean ± std curves, target line)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    opt = summary["optimizers"]
    lines = [f"# {title}", "",
             f"target {summary['target']:.3f}; sigma {summary['sigma']:.5f} (std of the "
             f"baseline's final losses); threshold c = {summary['z']:.3f} x sigma = "
             f"{summary['threshold']:.5f}; loss per 100 steps near the end "
             f"{summary['per_100_steps']:.4f} (fit over steps {summary['slope_window'][0]}-"
             f"{summary['slope_window'][1]})", "",
             "| optimizer | seeds | final val loss (mean ± std) | (target - mean) sqrt(n) at the "
             "end | first step with the one-sample rule | mean loss there |",
             "|---|---|---|---|---|---|"]
    for name, o in opt.items():
        std = "" if o["final_std"] is None else f" ± {o['final_std']:.4f}"
        lines.append(f"| {name} | {len(o['seeds'])} | {o['final_mean']:.4f}{std} | "
                     f"{o['score_at_final']:.4f} | {o['result_step'] or 'none'} | "
                     f"{o['result_mean']:.4f} |")
    lines += ["", "| old | new | compared at | pairwise score (new better) | new better? | "
              "reverse score | old better? |", "|---|---|---|---|---|---|---|"]
    for p in summary["pairs"]:
        at = "result steps" if p["at"] == "result" else "last step (a result is missing)"
        lines.append(f"| {p['old']} | {p['new']} | {at} | {p['score']:.4f} | {p['better']} "
                     f"| {p['reverse_score']:.4f} | {p['old_better']} |")
    if summary.get("paired"):
        base = next(iter(opt))
        lines += ["", f"Paired by seed against {base} (two-sided paired t-test; differences "
                  "are optimizer - baseline, negative = better; steps to the target per seed "
                  "where both runs reach it):", "",
                  "| optimizer | final loss diff (mean ± std) | p | steps to target per seed | "
                  "steps diff (mean, pairs) | p |", "|---|---|---|---|---|---|"]
        fmt = lambda x, f: "n/a" if x is None else format(x, f)
        for name, test in summary["paired"].items():
            f, st = test["final_loss"], test["steps_to_target"]
            per_seed = ", ".join(str(v) if v is not None else "-" for v in
                                 opt[name]["seed_steps_to_target"].values())
            lines.append(f"| {name} | {fmt(f['mean_diff'], '+.4f')} ± "
                         f"{fmt(f['std_diff'], '.4f')} | {fmt(f['p'], '.3g')} | {per_seed} | "
                         f"{fmt(st['mean_diff'], '+.1f')} ({st['n']}) | "
                         f"{fmt(st['p'], '.3g')} |")
    if summary.get("step_time"):
        st = summary["step_time"]
        lines += ["", f"Step time (`benchmarks.track3_step_time`, {st['date']}, {st['cpu']}, "
                  f"bf16 flags {st['bf16_flags']}, load {st['load'][0][0]:.1f} -> "
                  f"{st['load'][1][0]:.1f}; {st['rounds']} rounds x {st['steps']} steps, "
                  "alternating in one process):", "",
                  "| optimizer | options | ms per step | / baseline | per-round range |",
                  "|---|---|---|---|---|"]
        for name, r in st["optimizers"].items():
            lines.append(f"| {name} | {' '.join(r['options']) or '-'} | "
                         f"{r['ms_per_step']:.0f} | {r['ratio']:.2f} | "
                         f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f} |")
    lines += ["", "Per-seed val loss at every evaluation:", ""]
    for name, o in opt.items():
        lines.append(f"- {name}: steps {o['steps']}")
        for seed, row in zip(o["seeds"], o["losses"], strict=True):
            lines.append(f"  - seed {seed}: " + ", ".join(f"{x:.4f}" for x in row))
    if "machine" in summary:
        m = summary["machine"]
        lines += ["", f"Machine: {m['cpu']}, load average at the end {m['load_average']}; "
                  f"runs' wall times (s): {summary.get('wall_s')}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, tail in zip(axes, (False, True), strict=True):
        for name, o in opt.items():
            steps, mean, std = np.array(o["steps"]), np.array(o["mean"]), np.array(o["std"])
            keep = steps >= (0.5 * steps[-1] if tail else 0)
            line, = ax.plot(steps[keep], mean[keep], label=f"{name} (n={len(o['seeds'])})")
            ax.fill_between(steps[keep], (mean - std)[keep], (mean + std)[keep], alpha=0.2,
                            color=line.get_color())
            if o["result_step"] is not None:
                ax.axvline(o["result_step"], color=line.get_color(), ls=":")
        ax.axhline(summary["target"], color="k", lw=0.8, ls="--", label="target")
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.set_title("second half" if tail else title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizers", default="track3_baseline,snoo_track3_baseline",
                        help="comma-separated registered names; the first is the baseline")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--preset", default="track3_cpu")
    parser.add_argument("--target", type=float, default=None,
                        help="the target val loss (default: from the baseline, see above)")
    parser.add_argument("--sigma", type=float, default=None,
                        help="seed-to-seed std (default: the baseline's final losses')")
    parser.add_argument("--slope_frac", type=float, default=0.2,
                        help="fit the loss per 100 steps over this last fraction of the run")
    parser.add_argument("--runs_dir", default="out/track3_runs")
    parser.add_argument("--out", default=None, help="report path without suffix")
    parser.add_argument("--rerun", action="store_true")
    parser.add_argument("--step_time", default=None, metavar="JSON",
                        help="add benchmarks.track3_step_time's --out file to the report")
    parser.add_argument("--title", default=None, help="the report's title")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer option for every run (repeatable)")
    parser.add_argument("--set_for", action="append", default=[],
                        metavar="OPTIMIZER:KEY=VALUE",
                        help="a trainer option for one optimizer's runs (repeatable), e.g. "
                             "muloco_normuonh:init=hyperball; its runs' folder and report name "
                             "carry it")
    parser.add_argument("--seeds_for", action="append", default=[], metavar="OPTIMIZER:N",
                        help="seeds 0..N-1 for one optimizer instead of --seeds (repeatable)")
    parser.add_argument("--reuse_report", default=None, metavar="JSON",
                        help="take the curves of the optimizers (and seeds) that an earlier "
                             "report of the same preset and options holds instead of rerunning")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from train.config import get_preset, parse_args

    names = [x for x in args.optimizers.split(",") if x]
    extra = [f"--{kv}" for kv in args.set]
    own = per_optimizer_options(args.set_for, names)
    seeds_for = {}
    for item in args.seeds_for:
        name, _, n = item.partition(":")
        if name not in names or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--seeds_for={item!r}: expected OPTIMIZER:N with OPTIMIZER one "
                             f"of {names} and N >= 1")
        seeds_for[name] = int(n)
    max_iters = parse_args([f"--preset={args.preset}", *extra]).run.max_iters
    get_preset(args.preset)
    reused = {}
    if args.reuse_report:
        old = json.loads(Path(args.reuse_report).read_text())
        if old.get("preset") != args.preset or old.get("extra", []) != extra:
            raise ValueError(f"--reuse_report={args.reuse_report}: its preset/options "
                             f"{old.get('preset')!r} {old.get('extra')} are not "
                             f"{args.preset!r} {extra}")
        reused = old["optimizers"]
    curves, walls = {}, {}
    for name in names:
        label = name + "".join(f"[{kv[2:]}]" for kv in own.get(name, []))
        curves[label] = {}
        for seed in range(seeds_for.get(name, args.seeds)):
            if label in reused and seed in reused[label]["seeds"]:
                row = reused[label]["losses"][reused[label]["seeds"].index(seed)]
                curves[label][seed] = dict(zip(reused[label]["steps"], row, strict=True))
                walls[f"{label}/{seed}"] = "reused"
                print(f"{label} seed {seed}: final val loss {row[-1]:.4f} (from "
                      f"{args.reuse_report})", flush=True)
                continue
            out_dir = Path(args.runs_dir) / args.preset / label / f"seed{seed}"
            curve, wall = run_one(args.preset, name, seed, out_dir,
                                  [*extra, *own.get(name, [])], max_iters, args.rerun)
            curves[label][seed] = curve
            name_seed = label
            walls[f"{name_seed}/{seed}"] = None if wall is None else round(wall, 1)
            print(f"{name_seed} seed {seed}: final val loss {curve[max_iters]:.4f}"
                  + ("" if wall is None else f" ({wall:.0f} s)"), flush=True)
    summary = summarize(curves, target=args.target, sigma=args.sigma,
                        slope_frac=args.slope_frac)
    summary.update(preset=args.preset, extra=extra, machine=_machine(), wall_s=walls,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if args.step_time:
        summary["step_time"] = json.loads(Path(args.step_time).read_text())
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / args.preset
    write_report(summary, out, args.title or f"Track-3 protocol, {args.preset}")
    print(out.with_suffix(".md").read_text())
    return summary


if __name__ == "__main__":
    main()
