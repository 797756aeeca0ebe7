"""SkewAdam vs AdamW vs optax Adafactor on the `moe_tiny` preset (issue 4's study).

For each seed and optimizer, one trainer run (`train.run`, same steps, each optimizer
with the trainer's defaults: AdamW lr 1e-3 / wd 0.1 on matrices; SkewAdam and Adafactor
`learning_rate` 1e-3 / wd 0.05; betas 0.9/0.99 for both Adams): final val loss, the MoE
load-balance loss over the last fifth of the run, and throughput. Then, on the same
params: optimizer-state bytes measured on the real state with `optax_snoo.memory` next to
the formula's prediction, and the update time of each stack as a ratio to AdamW's, all
in one process (`benchmarks.skewadam_speed.update_time_ratio`).

    nice -n 15 python -m benchmarks.skewadam_study --max_iters=200 --seeds=0,1,2

Writes `benchmarks/results/skewadam_study.{json,md}` (after every run, so a partial study
is kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax

import train
from benchmarks.skewadam_speed import moe_tiny_params, update_time_ratio
from optax_snoo.memory import (
    adamw_state_bytes,
    skew_adam_state_bytes,
    skew_adam_state_bytes_by_role,
    state_bytes,
    state_bytes_by_group,
)
from train.config import get_preset, override
from train.optimizers import build_optimizer

OPTIMIZERS = ("skew_adam", "adamw", "adafactor")
RESULTS = Path(__file__).parent / "results"


def study_config(optimizer: str, seed: int, args, out_dir: str):
    return override(
        get_preset("moe_tiny"), optimizer=optimizer, seed=seed, max_iters=args.max_iters,
        eval_interval=args.max_iters // 2, eval_iters=args.eval_iters,
        warmup_iters=args.warmup_iters, log_interval=10, checkpoint_every=args.max_iters,
        num_samples=0, progress=False, out_dir=out_dir)


def load_balance(aux_loss: float, config) -> float:
    """The Switch load-balance loss per MoE block (1.0 for uniform routing): the logged
    `aux_loss` sums `aux_loss_coef · E·Σ f_e P_e` over the MoE blocks."""
    m = config.model
    return aux_loss / (m.aux_loss_coef * (m.n_layer // m.moe_every))


def run_one(optimizer: str, seed: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = study_config(optimizer, seed, args, tmp)
        result = train.run(config)
    logged = [h for h in result.history if "aux_loss" in h]
    tail = logged[-max(1, len(logged) // 5):]
    aux = statistics.mean(h["aux_loss"] for h in tail)
    return {"optimizer": optimizer, "seed": seed, "val_loss": result.final["val_loss"],
            "train_loss": result.final["train_loss"],
            "aux_loss": aux, "load_balance": load_balance(aux, config),
            "tokens_per_sec": result.final["tokens_per_sec"], "wall_s": result.final["wall_s"]}


def state_and_speed(args) -> dict:
    """State bytes (measured vs predicted) and update-time ratios on moe_tiny's params."""
    params = moe_tiny_params()
    txs, out = {}, {}
    for name in OPTIMIZERS:
        tx = build_optimizer(study_config(name, 0, args, "unused")).tx
        state = tx.init(params)
        txs[name] = tx
        out[name] = {"state_bytes": state_bytes(state, statistics_only=True)}
    out["skew_adam"]["predicted"] = skew_adam_state_bytes(params)
    out["skew_adam"]["by_role"] = state_bytes_by_group(txs["skew_adam"].init(params),
                                                     statistics_only=True)
    out["skew_adam"]["predicted_by_role"] = skew_adam_state_bytes_by_role(params)
    out["adamw"]["predicted"] = adamw_state_bytes(params)
    out["adafactor"]["predicted"] = None  # optax's layout (placeholder leaves), no formula
    speed = update_time_ratio(params, rounds=args.speed_rounds, steps=10, txs=txs)
    for name in OPTIMIZERS:
        out[name].update(update_seconds=speed[name]["seconds"], update_ratio=speed[name]["ratio"],
                         update_ratio_per_round=speed[name]["ratio_per_round"])
    out["num_params"] = sum(x.size for x in jax.tree.leaves(params))
    return out


def summarise(runs: list[dict]) -> dict:
    out = {}
    for name in OPTIMIZERS:
        rs = [r for r in runs if r["optimizer"] == name]
        if not rs:
            continue
        col = lambda k, rs=rs: [r[k] for r in rs]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else float("nan")
        out[name] = {"seeds": col("seed"), "val_loss_mean": statistics.mean(col("val_loss")),
                     "val_loss_std": sd(col("val_loss")),
                     "load_balance_mean": statistics.mean(col("load_balance")),
                     "tokens_per_sec_median": statistics.median(col("tokens_per_sec"))}
    return out


def write(report: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "skewadam_study.json").write_text(json.dumps(report, indent=2) + "\n")
    s, st = report["summary"], report.get("state_and_speed", {})
    lines = [
        "# SkewAdam study: moe_tiny on CPU", "",
        f"`{report['command']}`  ",
        f"{report['date']}, {report['device']}, load average {report['load_start']:.1f} at "
        f"start, {report.get('load_end', float('nan')):.1f} at the end; "
        f"{report['max_iters']} steps, warmup {report['warmup_iters']}, cosine to 1e-4, "
        f"{report['tokens_per_step']} tokens/step, val loss over {report['eval_iters']} "
        f"batches. Load balance: the Switch loss E·Σ f_e P_e per MoE block (uniform routing "
        "= 1.0; the logged aux_loss is 0.01 x that, summed over the 2 MoE blocks), mean "
        "over the last fifth of the logged steps.", "",
        "| optimizer | seeds | val loss (mean ± std) | load balance | tokens/s (median) "
        "| state bytes measured | predicted | update time / AdamW |",
        "|---|---|---|---|---|---|---|---|"]
    for name in OPTIMIZERS:
        if name not in s:
            continue
        x, y = s[name], st.get(name, {})
        pred = y.get("predicted")
        lines.append(
            f"| {name} | {len(x['seeds'])} | {x['val_loss_mean']:.4f} ± "
            f"{x['val_loss_std']:.4f} | {x['load_balance_mean']:.4f} | "
            f"{x['tokens_per_sec_median']:,.0f} | {y.get('state_bytes', float('nan')):,} | "
            f"{'-' if pred is None else f'{pred:,}'} | "
            f"{y.get('update_ratio', float('nan')):.2f} |")
    if "skew_adam" in st:
        lines += ["", f"SkewAdam state per role (measured = predicted): "
                  f"{st['skew_adam']['by_role']}; {st['num_params']:,} params, AdamW would "
                  f"hold {st['adamw']['predicted']:,} bytes."]
    lines += ["", "Per run:", "", "| optimizer | seed | val loss | train loss | load balance "
              "| tokens/s | wall s |", "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['optimizer']} | {r['seed']} | {r['val_loss']:.4f} | "
                     f"{r['train_loss']:.4f} | {r['load_balance']:.4f} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['wall_s']:.0f} |")
    (RESULTS / "skewadam_study.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_iters", type=int, default=200)
    parser.add_argument("--warmup_iters", type=int, default=20)
    parser.add_argument("--eval_iters", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--speed_rounds", type=int, default=7)
    args = parser.parse_args(argv)
    cache = Path(tempfile.gettempdir()) / "skewadam_study_jax_cache"
    jax.config.update("jax_compilation_cache_dir", str(cache))  # seeds share programs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    base = get_preset("moe_tiny")
    report = {"command": "python -m benchmarks.skewadam_study " + " ".join(
        f"--{k}={v}" for k, v in vars(args).items()),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}, jax {jax.__version__}",
        "load_start": os.getloadavg()[0], "max_iters": args.max_iters,
        "warmup_iters": args.warmup_iters, "eval_iters": args.eval_iters,
        "tokens_per_step": base.data.batch_size * base.model.block_size, "runs": [],
        "summary": {}}
    t0 = time.perf_counter()
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in OPTIMIZERS:
            report["runs"].append(run_one(name, seed, args))
            report["summary"] = summarise(report["runs"])
            write(report)
            print(report["runs"][-1], flush=True)
    report["state_and_speed"] = state_and_speed(args)
    report["load_end"], report["wall_s"] = os.getloadavg()[0], time.perf_counter() - t0
    write(report)
    print((RESULTS / "skewadam_study.md").read_text())


if __name__ == "__main__":
    main()
