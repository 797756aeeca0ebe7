"""Where K-FAC refreshes fall on the learning-rate curve: a study on tiny shakespeare.

A refresh strategy is judged at equal cost. This runs, for several seeds, the
trainer (`train.run`) on a CPU-sized character GPT with AdamW and with K-FAC under:

- ``a_fixed_early``: every N steps, first refresh at step N;
- ``b_fixed_after_warmup``: every N, first at the end of the warmup;
- ``c_by_lr_phase``: none in the warmup, N at the peak, 2N decaying, 4N in the tail;
- ``d_lr_ratio``: refresh when the lr moved by τ = 0.15 since the last refresh, at most
  4N apart, at least N/2;
- ``e_warm_start``: (b) with the factors warm-started from a few batches;
- ``a_long_warmup``: (a) with a warmup of 2.5x the length (the short/long pair).

Runs go to ``--work/<strategy>_s<seed>`` (one process per seed can run side by side);
``--report`` then reads them and prints the table (refresh count, final val loss mean ±
std over seeds, wall time), and writes ``<out>/kfac_refresh.json``, ``.png`` (val loss
per strategy; the refresh points of each strategy over the LR curve) and
``kfac_refresh_table.md``. Every K-FAC run's
logged refreshes are checked against `optax_snoo.kfac.refresh_steps`.

    python -m benchmarks.kfac_refresh --seeds=0 &   # and 1, 2: one process per seed
    python -m benchmarks.kfac_refresh --report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import jax

import train
from optax_snoo import kfac as kfac_lib
from train.config import TrainConfig, flat_dict, override
from train.kfac_trainer import kfac_refresh_policy, kfac_schedule

HERE = Path(__file__).resolve().parent


def base_config(args: argparse.Namespace) -> TrainConfig:
    """The study's model and schedule (CPU-sized; see the module docstring): K-FAC, both
    its groups at `--lr`, cosine to a tenth of it."""
    return override(
        TrainConfig(), n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=8, dtype="float32",
        optimizer="kfac", kfac_learning_rate=args.lr, adam_learning_rate=args.lr,
        final_lr_scale=0.1, warmup_iters=args.warmup,
        max_iters=args.max_iters, eval_interval=args.max_iters // 4, eval_iters=args.eval_iters,
        log_interval=50, checkpoint_every=10**6, num_samples=0, progress=False, mesh_data=1,
        kfac_damping=args.damping, kfac_interval=args.interval)


def strategies(base: TrainConfig, interval: int, long_warmup: int) -> dict[str, TrainConfig]:
    """Name -> config for the baseline and the K-FAC refresh strategies."""
    kfac = base
    n, warmup = interval, base.optimizer.table.warmup_iters
    return {
        # the baseline at the same rate and schedule
        "adamw": override(base, optimizer="adamw",
                          learning_rate=base.optimizer.table.adam_learning_rate),
        "a_fixed_early": override(kfac, kfac_first=n),
        "b_fixed_after_warmup": override(kfac, kfac_first=warmup),
        "c_by_lr_phase": override(kfac, kfac_refresh="by_lr_phase",
                                             kfac_phases=f"none,{n},{2 * n},{4 * n}"),
        "d_lr_ratio": override(kfac, kfac_refresh="lr_ratio", kfac_tau=0.15,
                                          kfac_interval=4 * n,
                                          kfac_min_interval=max(1, n // 2)),
        "e_warm_start": override(kfac, kfac_first=warmup,
                                            kfac_warm_start=10),
        "a_long_warmup": override(kfac, kfac_first=n, warmup_iters=long_warmup),
    }


def planned_refreshes(config: TrainConfig) -> list[int]:
    """`kfac.refresh_steps` of the config's policy and K-FAC learning rate."""
    return kfac_lib.refresh_steps(kfac_refresh_policy(config), kfac_schedule(config),
                                  config.run.max_iters).tolist()


def read_run(out_dir: Path) -> dict | None:
    """One finished run from its outputs (None if unfinished): final val loss, the eval
    curve, the logged refresh steps and its wall time (config.json to loss.png: the
    training and evaluations, without start-up)."""
    metrics, done = out_dir / "metrics.jsonl", out_dir / "loss.png"
    if not (metrics.exists() and done.exists()):
        return None
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    row = {"val_loss": curve[-1][1], "curve": curve,
           "wall_s": done.stat().st_mtime - (out_dir / "config.json").stat().st_mtime}
    events = out_dir / "refresh_events.jsonl"
    if events.exists():
        row["refresh_steps"] = [json.loads(line)["step"]
                                for line in events.read_text().splitlines()]
    return row


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for name, rows in runs.items():
        losses = [r["val_loss"] for r in rows]
        out[name] = {
            "refreshes": len(rows[0].get("refresh_steps", [])),
            "val_loss_mean": statistics.mean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "wall_s_mean": statistics.mean(r["wall_s"] for r in rows),
            "seeds": len(rows)}
    return out


def markdown(summary: dict[str, dict], meta: dict) -> str:
    base_wall = summary["adamw"]["wall_s_mean"] if "adamw" in summary else None
    lines = ["| strategy | refreshes | final val loss (mean ± std) | wall (s) | vs adamw |",
             "|---|---|---|---|---|"]
    for name, s in summary.items():
        rel = f"{s['wall_s_mean'] / base_wall - 1:+.0%}" if base_wall else "n/a"
        lines.append(f"| {name} | {s['refreshes']} | {s['val_loss_mean']:.4f} ± "
                     f"{s['val_loss_std']:.4f} (n={s['seeds']}) | {s['wall_s_mean']:.1f} | "
                     f"{rel} |")
    return (f"{meta['date']}, load average {meta['load']:.1f}; {meta['config']}\n\n"
            + "\n".join(lines) + "\n")


def plot(runs: dict[str, list[dict]], configs: dict[str, TrainConfig], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, rows) in enumerate(runs.items()):
        steps = [s for s, _ in rows[0]["curve"]]
        mean = np.mean([[v for _, v in r["curve"]] for r in rows], axis=0)
        ax_loss.plot(steps[1:], mean[1:], marker="o", label=name, color=f"C{i}")
        if name == "adamw":
            continue
        config = configs[name]
        sched = kfac_schedule(config)
        t = np.arange(config.run.max_iters)
        ax_lr.plot(t, np.asarray(jax.vmap(sched)(t)) * (1 + 0.04 * i), color=f"C{i}",
                   alpha=0.5, lw=1)
        marks = rows[0].get("refresh_steps", [])
        ax_lr.scatter(marks, [float(sched(s)) * (1 + 0.04 * i) for s in marks], s=10,
                      color=f"C{i}", label=f"{name} ({len(marks)})")
    ax_loss.set(xlabel="step", ylabel="val loss (mean over seeds)", title="validation loss")
    ax_lr.set(xlabel="step", ylabel="learning rate (offset per strategy)",
              title="refresh points on the LR curve")
    for ax in (ax_loss, ax_lr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds to run")
    parser.add_argument("--max_iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--long_warmup", type=int, default=125)
    parser.add_argument("--interval", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--damping", type=float, default=1e-3)
    parser.add_argument("--eval_iters", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated strategy names")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: summarise the finished runs in --work")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--work", default="/tmp/kfac_refresh_runs")
    args = parser.parse_args(argv)
    work = Path(args.work)
    jax.config.update("jax_compilation_cache_dir", str(work / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    base = base_config(args)
    configs = strategies(base, args.interval, args.long_warmup)
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    seeds = [int(x) for x in args.seeds.split(",")]
    if not args.report:  # seed-major: a partial study still covers every strategy
        for seed in seeds:
            for name, config in configs.items():
                config = override(config, seed=seed,
                                             out_dir=str(work / f"{name}_s{seed}"))
                shutil.rmtree(config.run.out_dir, ignore_errors=True)
                train.run(config)
                row = read_run(Path(config.run.out_dir))
                if config.optimizer.name != "adamw" and row["refresh_steps"] != planned_refreshes(
                        config):
                    raise AssertionError(f"{name}: logged refreshes {row['refresh_steps']} "
                                         f"differ from the plan {planned_refreshes(config)}")
                print(f"{name} seed {seed}: val {row['val_loss']:.4f}, "
                      f"{len(row.get('refresh_steps', []))} refreshes, {row['wall_s']:.1f} s",
                      flush=True)
        return {}
    runs = {name: [r for seed in seeds if (r := read_run(work / f"{name}_s{seed}"))]
            for name in configs}
    runs = {name: rows for name, rows in runs.items() if rows}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": os.getloadavg()[0], "seeds": seeds, "args": vars(args),
            "config": ", ".join(f"{k}={flat_dict(base)[k]}" for k in (
                "n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters",
                "warmup_iters", "kfac_learning_rate", "final_lr_scale", "kfac_damping",
                "kfac_interval",
                "kfac_ema_decay", "kfac_graft", "kfac_stats_stride", "dtype"))}
    summary = summarise(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kfac_refresh.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    plot(runs, configs, out / "kfac_refresh.png")
    (out / "kfac_refresh_table.md").write_text(markdown(summary, meta))
    print(markdown(summary, meta))
    return summary


if __name__ == "__main__":
    main()
