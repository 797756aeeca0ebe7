"""Jitted Muon update time: optax_snoo.muon vs optax.contrib.muon, same work.

Both optimizers get the same tree of transformer-shaped matrices (every leaf goes to Muon),
the same Newton-Schulz coefficients and step count, the same iteration dtype and
bias-corrected Nesterov momentum (``bias_correction=True`` on our side), and optax gets a
full ``muon_weight_dimension_numbers`` tree (its default breaks on dict params, optax
0.2.8). Times are per jitted ``update`` call, interleaved (ours, optax, ours, ...) so that
machine load hits both alike. Ratios are ours / optax (below 1 = ours faster): the median
of the per-round wall-time ratios (each round times both back to back), and the ratio of
median process CPU times (total work over all threads, less sensitive to other load).

Usage: ``python -m benchmarks.muon_vs_optax [--d 256] [--layers 4] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from optax_snoo import COEFFICIENT_PRESETS, muon

OPTAX_PRESET = {"keller": COEFFICIENT_PRESETS["keller"][0],
                "modded": list(COEFFICIENT_PRESETS["modded"]),
                "polar_express": list(COEFFICIENT_PRESETS["polar_express"])}


def transformer_matrices(d: int, layers: int, dtype) -> dict:
    """Per layer: q, k, v, o (d, d) and the MLP (d, 4d), (4d, d); Flax (in, out) layout."""
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
              "fc": (d, 4 * d), "proj": (4 * d, d)}
    key = jax.random.key(0)
    params = {}
    for layer in range(layers):
        for name, shape in shapes.items():
            key, sub = jax.random.split(key)
            params[f"h{layer}_{name}"] = (0.02 * jax.random.normal(sub, shape)).astype(dtype)
    return params


def time_calls(fn, args, calls: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of a compiled `fn`, averaged over `calls`."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2, help="calls per timed round")
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__}, optax {optax.__version__}, backend "
          f"{jax.default_backend()}, {jax.device_count()} device(s)")
    cases = [("keller", jnp.float32), ("modded", jnp.float32), ("modded", jnp.bfloat16),
             ("polar_express", jnp.float32)]
    print(f"{'coefficients':<15}{'dtype':<10}{'ours ms':>9}{'optax ms':>10}"
          f"{'wall ratio':>12}{'cpu ratio':>11}{'compile s ours/optax':>23}")
    for preset, dtype in cases:
        params = transformer_matrices(args.d, args.layers, dtype)
        grads = jax.tree.map(lambda p: (p * 3 + 0.01).astype(p.dtype), params)
        labels = jax.tree.map(lambda _: "muon", params)
        dims = jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(0, 1), params)
        ours = muon(0.02, beta=0.95, coefficients=preset, ns_dtype=dtype,
                    bias_correction=True, labels=labels)
        theirs = optax.contrib.muon(0.02, ns_coeffs=OPTAX_PRESET[preset], ns_steps=5,
                                    beta=0.95, eps=1e-7, muon_weight_dimension_numbers=dims)
        fns, compiles = {}, {}
        for name, tx in (("ours", ours), ("optax", theirs)):
            state = tx.init(params)
            start = time.perf_counter()
            fn = jax.jit(tx.update).lower(grads, state, params).compile()
            compiles[name] = time.perf_counter() - start
            fns[name] = (fn, (grads, state, params))
            jax.block_until_ready(fn(grads, state, params))  # warm up
        rounds = [{name: time_calls(fn, fn_args, args.calls)
                   for name, (fn, fn_args) in fns.items()} for _ in range(args.rounds)]
        wall = {k: statistics.median(r[k][0] for r in rounds) for k in fns}
        cpu = {k: statistics.median(r[k][1] for r in rounds) for k in fns}
        wall_ratio = statistics.median(r["ours"][0] / r["optax"][0] for r in rounds)
        print(f"{preset:<15}{jnp.dtype(dtype).name:<10}{1e3 * wall['ours']:>9.1f}"
              f"{1e3 * wall['optax']:>10.1f}{wall_ratio:>12.3f}"
              f"{cpu['ours'] / cpu['optax']:>11.3f}"
              f"{compiles['ours']:>13.2f} / {compiles['optax']:.2f}")
    n = sum(x.size for x in jax.tree.leaves(transformer_matrices(args.d, args.layers,
                                                                   jnp.float32)))
    print(f"tree: {args.layers} layers x 6 matrices, d={args.d}: {n / 1e6:.2f}M parameters; "
          f"times are medians over {args.rounds} rounds of {args.calls} calls")


if __name__ == "__main__":
    main()
