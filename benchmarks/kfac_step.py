"""Cost of a K-FAC train step relative to an AdamW train step on the same GPT.

Both are the trainer's jitted steps (`train.step.make_train_step`): AdamW's, and K-FAC's
with a `curvature_fn` (forward/backward with the layer statistics, the factor EMAs,
preconditioning, momentum) in two variants: never refreshing (the inverses cached, what
most steps cost) and refreshing every step (an `eigh` of every factor). They run in one
process on the same model and batch, interleaved round by round; the figures are ratios
of median step times, so machine load cancels as far as it can. The amortised cost of a
refresh every N steps is ``(refresh - plain) / N`` per step.

    python -m benchmarks.kfac_step                     # shakespeare_char_cpu shape, fp32
    python -m benchmarks.kfac_step --dtype=bfloat16 --rounds=30
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from train.config import TrainConfig, model_config, override
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step


def _runner(config: TrainConfig, batch: np.ndarray):
    """A closure running one (donated) train step and returning its wall time."""
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(model_config(config, 65), spec.tx, seed=0, mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh))
    x, y = (put_batch(a, batch_sharding(mesh)) for a in batch)
    holder = {"state": state}

    def run() -> float:
        t = time.perf_counter()
        holder["state"], metrics = step(holder["state"], x, y)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - t

    run()  # compile
    return run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=12)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--interval", type=int, default=100, help="for the amortised cost")
    parser.add_argument("--strides", default="1,4", help="kfac_stats_stride values")
    args = parser.parse_args(argv)
    base = override(TrainConfig(), dtype=args.dtype, n_layer=args.n_layer, n_embd=args.n_embd,
                    batch_size=args.batch_size, block_size=args.block_size, mesh_data=1,
                    max_iters=10_000)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65, (2, 1, args.batch_size, args.block_size), dtype=np.int32)
    strides = [int(s) for s in args.strides.split(",")]
    kfac = override(base, optimizer="kfac")
    runners = {"adamw": _runner(override(base, optimizer="adamw"), tokens)}
    for s in strides:
        runners[f"kfac_stride{s}"] = _runner(override(
            kfac, kfac_first=10**9, kfac_stats_stride=s), tokens)
    runners["kfac_refresh"] = _runner(override(
        kfac, kfac_interval=1, kfac_first=0, kfac_stats_stride=strides[0]), tokens)
    times = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            times[name].append(run())
    med = {name: float(np.median(t)) for name, t in times.items()}
    plain = med[f"kfac_stride{strides[0]}"]
    result = {
        "shape": vars(args), "median_s": med,
        **{f"kfac_stride{s}_over_adamw": med[f"kfac_stride{s}"] / med["adamw"]
           for s in strides},
        f"refresh_stride{strides[0]}_over_adamw": med["kfac_refresh"] / med["adamw"],
        "refresh_cost_in_adamw_steps": (med["kfac_refresh"] - plain) / med["adamw"],
        f"amortised_every_{args.interval}_stride{strides[0]}_over_adamw":
            (plain + (med["kfac_refresh"] - plain) / args.interval) / med["adamw"],
        "load": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
