"""SkewAdam's update time relative to AdamW's, on the same params tree in one process.

Each step is a jitted `update` + `apply_updates` with donated params and state; the two
optimizers run interleaved round by round and the figure is the ratio of median step
times, so machine load cancels as far as it can. Trees: the `moe_tiny` preset's params
(real paths, so SkewAdam's roles apply: experts, router, backbone), the same model at width
256 with 1024-wide experts (`moe_10m`) and a dense GPT-2-small shape (every leaf is
backbone: momentum + factored second moment). `--hlo` also prints what
XLA compiled: fusions, reductions and the temporary bytes of each program.

    python -m benchmarks.skewadam_speed                 # all trees
    python -m benchmarks.skewadam_speed --tree=moe_tiny --rounds=9 --hlo
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.overhead import gpt2_shaped_params
from optax_snoo import skew_adam


def moe_tiny_params(seed: int = 0, **overrides) -> dict:
    """The `moe_tiny` preset's params (vocabulary 65 padded to 72), as a pure dict;
    `overrides` replace preset fields (e.g. `n_embd`, `expert_hidden`)."""
    from flax import nnx

    import models
    from train.config import get_preset, model_config, override

    config = override(get_preset("moe_tiny"), **overrides)
    model = models.GPT(model_config(config, 65), rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])


def optimizers(lr: float = 1e-3) -> dict[str, optax.GradientTransformation]:
    """AdamW and SkewAdam with the SkewAdam paper's betas, eps and weight decay."""
    return {"adamw": optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05),
            "skew_adam": skew_adam(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)}


def make_step(tx: optax.GradientTransformation):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def hlo_summary(tx: optax.GradientTransformation, params, grads) -> dict[str, int]:
    """Counts in the optimised HLO of one step, and XLA's temporary bytes."""
    compiled = make_step(tx).lower(params, tx.init(params), grads).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return {"fusions": len(re.findall(r"^\s*\S*fusion\S* = .*calls=", text, re.M)),
            "reduce_ops": len(re.findall(r" reduce\(", text)),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1))}


def update_time_ratio(params, rounds: int = 7, steps: int = 10,
                      txs: dict[str, optax.GradientTransformation] | None = None,
                      baseline: str = "adamw") -> dict[str, dict]:
    """Median seconds per step of each optimizer and its ratio to `baseline`'s.

    Returns:
      `{name: {"seconds": median, "ratio": median / baseline's median, "ratio_per_round":
      [...]}}`; rounds alternate the order of the optimizers.
    """
    txs = txs or optimizers()
    key = jax.random.key(0)
    grads = jax.tree.map(lambda p: 1e-3 * jax.random.normal(key, p.shape, p.dtype), params)
    runs = {}
    for name, tx in txs.items():
        p = jax.tree.map(jnp.copy, params)
        runs[name] = [make_step(tx), p, tx.init(p)]

    def run(name) -> float:
        step, p, s = runs[name]
        start = time.perf_counter()
        for _ in range(steps):
            p, s = step(p, s, grads)
        jax.block_until_ready((p, s))
        runs[name][1:] = [p, s]
        return (time.perf_counter() - start) / steps

    for name in runs:  # compile and warm up
        run(name)
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[name].append(run(name))
    base = float(np.median(times[baseline]))
    return {name: {"seconds": float(np.median(t)), "ratio": float(np.median(t)) / base,
                   "ratio_per_round": [a / b for a, b in zip(t, times[baseline], strict=True)]}
            for name, t in times.items()}


TREES = {"moe_tiny": moe_tiny_params,
         "moe_10m": lambda: moe_tiny_params(n_embd=256, expert_hidden=1024),
         "gpt2_small_2l": lambda: gpt2_shaped_params(n_layer=2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", choices=[*TREES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hlo", action="store_true", help="print HLO counts too")
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, optax {optax.__version__}, "
          f"load {os.getloadavg()[0]:.1f}")
    for name in TREES if args.tree == "all" else [args.tree]:
        params = TREES[name]()
        n = sum(x.size for x in jax.tree.leaves(params))
        t = update_time_ratio(params, args.rounds, args.steps)
        per_round = ", ".join(f"{r:.2f}" for r in t["skew_adam"]["ratio_per_round"])
        print(f"{name:14s} {n / 1e6:6.2f}M params: adamw {1e3 * t['adamw']['seconds']:7.2f} "
              f"ms, skew_adam {1e3 * t['skew_adam']['seconds']:7.2f} ms, ratio "
              f"{t['skew_adam']['ratio']:.3f} (rounds: {per_round})")
        if args.hlo:
            grads = jax.tree.map(jnp.zeros_like, params)
            for opt, tx in optimizers().items():
                print(f"  {opt:9s} {hlo_summary(tx, params, grads)}")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
