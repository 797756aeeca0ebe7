"""The compiled `track3_cpu` step of each optimizer against the baseline's, in one process.

`python -m benchmarks.track3_step_time --optimizers=track3_baseline,track3_record
[--set_for=muloco_normuonh:init=hyperball --rounds=6 --steps=10]`. Each optimizer is the
trainer's jitted step on the twin (`benchmarks.throughput.ours`: the preset's network,
batch, mesh and the optimizer's update, Snoo's outer step included on its steps); after
two warm-up steps each, the optimizers take turns round by round, so the machine's load
hits them alike. The ratio is an optimizer's total time over the baseline's (the first
optimizer), with the range of the per-round ratios; the `lscpu` model, its bf16 flags and
the load average are reported beside it. `--flops` adds each step's FLOPs read from its
compiled program (`benchmarks.hlo`, loops counted, a refresh's QR and eigendecompositions
at their LAPACK cost) over the baseline's: the floor the time ratio would sit on if every
FLOP ran at one rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.track3 import per_optimizer_options
from benchmarks.track3_speed import _cpu


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="track3_baseline,snoo_track3_baseline",
                        help="comma-separated; the first is the baseline")
    parser.add_argument("--preset", default="track3_cpu")
    parser.add_argument("--set_for", action="append", default=[],
                        metavar="OPTIMIZER:KEY=VALUE", help="a config key for one optimizer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per optimizer per round")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--flops", action="store_true",
                        help="also each step's FLOPs from its compiled program "
                             "(benchmarks.hlo, loops counted) over the baseline's: the "
                             "ratio the step would have if every FLOP ran at one rate")
    args = parser.parse_args(argv)
    import jax

    from benchmarks.throughput import ours
    from train.config import parse_args

    names = [x for x in args.optimizers.split(",") if x]
    own = per_optimizer_options(args.set_for, names)
    runs = {}
    for name in names:  # the flags as the trainer parses them (typed by the recipe)
        config = parse_args([f"--preset={args.preset}", f"--optimizer={name}",
                             *own.get(name, [])])
        runs[name] = ours(config)
    load = [os.getloadavg()]
    for variant in runs.values():
        variant.run(max(2, variant.warmup_steps))  # compile every program, warm up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, variant in runs.items():
            t0 = time.perf_counter()
            variant.run(args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    load.append(os.getloadavg())
    base = names[0]
    cpu, flags = _cpu()
    result = {"preset": args.preset, "cpu": cpu, "bf16_flags": flags, "load": load,
              "rounds": args.rounds, "steps": args.steps, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "optimizers": {}}
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[base], strict=True)]
        result["optimizers"][name] = {
            "options": own.get(name, []), "ms_per_step": 1e3 * sum(times[name]) / args.rounds,
            "ratio": sum(times[name]) / sum(times[base]),
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
        r = result["optimizers"][name]
        if args.flops:
            r.update(step_flops(runs[name].hlo_text()))
        print(f"{name}: {r['ms_per_step']:.0f} ms/step, x{r['ratio']:.2f} the {base}'s "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    if args.flops:
        for name in names:
            r, b = result["optimizers"][name], result["optimizers"][base]
            r["floor"] = r["gflop"] / b["gflop"]
            r["floor_eigh"] = r["gflop_eigh"] / b["gflop"]
            print(f"{name}: {r['gflop']:.3f} GFLOP/step (floor x{r['floor']:.2f}; a step "
                  f"refreshing by eigh {r['gflop_eigh']:.3f}, x{r['floor_eigh']:.2f})")
    print(f"{cpu}; bf16 flags: {flags}; load {load[0][0]:.1f} -> {load[1][0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def step_flops(hlo_text: str) -> dict[str, float]:
    """The trainer's step's GFLOP (`benchmarks.hlo`), read through its non-finite guard:
    `gflop` a step after the first (every
    conditional at its most expensive branch that runs no eigendecomposition: SOAP's
    power-QR refresh, Shampoo's step between refreshes), or, where every step runs one
    (SinkSOAP, a root refresh every update), the step with it; `gflop_eigh` a step
    refreshing by `eigh` (the first, Shampoo's every `precondition_frequency`); the
    QR's and eigh's shares."""
    from benchmarks import hlo

    steady, worst = hlo.analyze(hlo_text, without_eigh=True), hlo.analyze(hlo_text)
    # Where no branch without eigh does the update, the choice above is the non-finite
    # guard's skip branch (the forward and backward alone, as `cheapest` counts it).
    if steady.flops <= hlo.analyze(hlo_text, cheapest=True).flops:
        steady = worst
    return {"gflop": steady.flops / 1e9, "gflop_qr": steady.qr_flops / 1e9,
            "gflop_eigh": worst.flops / 1e9, "gflop_eigh_part": worst.eigh_flops / 1e9}


if __name__ == "__main__":
    main()
