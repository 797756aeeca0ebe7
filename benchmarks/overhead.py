"""Per-step cost of Snoo (plain transform and the trainer's fast path) relative to AdamW.

All variants run in one process on the same params tree, interleaved round by round, and
are reported as ratios of median step times, so machine load cancels as far as it can.
Each step is a jitted `update` + `apply_updates` with donated params and state.

    python -m benchmarks.overhead                 # GPT-2 small shape (124M params)
    python -m benchmarks.overhead --n_layer=2     # smaller, quicker

It ends with `benchmarks.muon_vs_optax` (our Muon vs optax.contrib.muon, same work) unless
`--skip_muon`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_snoo
from benchmarks import muon_vs_optax


def gpt2_shaped_params(n_layer: int = 12, d: int = 768, vocab: int = 50304, block: int = 1024):
    """Zeros shaped like GPT-2 small's params (Flax `(in, out)` kernels)."""
    params = {"wte": jnp.zeros((vocab, d)), "wpe": jnp.zeros((block, d)),
              "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)}}
    for i in range(n_layer):
        params[f"h{i}"] = {
            "ln_1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "c_attn": {"kernel": jnp.zeros((d, 3 * d)), "bias": jnp.zeros(3 * d)},
            "c_proj": {"kernel": jnp.zeros((d, d)), "bias": jnp.zeros(d)},
            "ln_2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "c_fc": {"kernel": jnp.zeros((d, 4 * d)), "bias": jnp.zeros(4 * d)},
            "c_proj_mlp": {"kernel": jnp.zeros((4 * d, d)), "bias": jnp.zeros(d)},
        }
    return params


def make_step(tx, snoo_sync=None):
    kwargs = {} if snoo_sync is None else {"snoo_sync": snoo_sync}

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **kwargs)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def time_rounds(runners: dict, rounds: int) -> dict[str, float]:
    """Median seconds per step of each runner; runners are interleaved within each round."""
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(run())
    return {name: float(np.median(t)) for name, t in times.items()}


def snoo_overhead(params, k: int = 28, rounds: int = 3) -> dict[str, float]:
    """Seconds per step, amortised over k steps: adamw, snoo(adamw) plain and fast path."""
    adamw = optax.adamw(1e-3)
    snoo = optax_snoo.snoo(optax.adamw(1e-3), k=k)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    steps = {"adamw": make_step(adamw), "snoo_plain": make_step(snoo)}
    fast = {True: make_step(snoo, True), False: make_step(snoo, False)}
    states = {}
    for name, tx in (("adamw", adamw), ("snoo_plain", snoo), ("snoo_fast", snoo)):
        p = jax.tree.map(jnp.copy, params)
        states[name] = [p, tx.init(p), 0]

    def runner(name):
        def run():
            p, s, t = states[name]
            start = time.perf_counter()
            for _ in range(k):
                if name == "snoo_fast":
                    p, s = fast[optax_snoo.snoo_is_sync_step(t, k)](p, s, grads)
                else:
                    p, s = steps[name](p, s, grads)
                t += 1
            jax.block_until_ready(p)
            states[name] = [p, s, t]
            return (time.perf_counter() - start) / k
        return run

    runners = {name: runner(name) for name in states}
    for run in runners.values():   # compile and warm up (one full period each)
        run()
    return time_rounds(runners, rounds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--k", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip_muon", action="store_true")
    args = parser.parse_args(argv)
    params = gpt2_shaped_params(args.n_layer)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"params tree: GPT-2 small shape, {args.n_layer} layers, {n / 1e6:.1f}M params, "
          f"float32, {jax.devices()[0].device_kind}, k={args.k}")
    t = snoo_overhead(params, args.k, args.rounds)
    print(f"adamw                      {1e3 * t['adamw']:8.1f} ms/step")
    labels = {"snoo_plain": "snoo(adamw), plain", "snoo_fast": "snoo(adamw), fast path"}
    for name, label in labels.items():
        print(f"{label:26s} {1e3 * t[name]:8.1f} ms/step  ratio {t[name] / t['adamw']:.3f}")
    if not args.skip_muon:
        print("\nMuon (ours / optax.contrib.muon, same coefficients, steps and dtype):")
        muon_vs_optax.main([])


if __name__ == "__main__":
    main()
