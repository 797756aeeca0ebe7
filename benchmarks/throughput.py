"""Tokens/s of the trainer's jitted step, against a minimal pure-JAX step in the same process.

The step is the one `python -m train` runs (`train.step.make_train_step`: forward,
backward, clipping, optimizer update, donated state) on random tokens at a preset's
shape. Variants (compute dtypes of ours, and a reference GPT step written here in plain
`jax.numpy`, float32, same shape and AdamW) run interleaved, round by round, so machine
load hits them alike; the table gives median wall time per step, tokens/s, CPU time
per step (load-robust on a shared machine), the ratio to the reference, the median
over rounds of each round's tokens/s ratio to the first variant, and MFU
(nanoGPT's estimate; needs a known accelerator, see `train.metrics.PEAK_FLOPS`).
`--torch=PYTHON` adds nanoGPT's recipe in PyTorch (`benchmarks/torch_recipe.py --serve`,
run by that interpreter, which must have torch) as the first variant: a subprocess that
waits on a pipe while ours run and does its timed steps while ours wait.

    python -m benchmarks.throughput                       # nanoGPT's CPU recipe, adamw
    python -m benchmarks.throughput --rounds=3 --n_layer=2   # any train key overrides
    python -m benchmarks.throughput --optimizers=adamw,snoo_adamw --dtypes=bfloat16
    bash benchmarks/gpu.sh                                # gpt2_small on one GPU, MFU
    python -m benchmarks.throughput --torch=/path/to/venv/bin/python \
        --optimizers=adamw,snoo_muon --dtypes=bfloat16 --no_reference --rounds=9

Compilation and a few warm-up steps are excluded. Machine load (`os.getloadavg`) is
printed before and after, since absolute figures move with it.

References:
  Karpathy, "nanoGPT" (train.py; model.py estimate_mfu), https://github.com/karpathy/nanoGPT,
  2023.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.config import TrainConfig, model_config, override, parse_args
from train.metrics import flops_per_token, peak_flops_per_device
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import compiler_options, create_train_state, make_train_step

VOCAB = 65  # tiny shakespeare's characters; the tokens are random, the shapes are real


@dataclasses.dataclass
class Variant:
    """One timed step: `run(n)` does `n` steps and blocks; `flops` per step (or None).

    `run` returns None, or `(wall, cpu)` seconds when the steps ran in another process;
    `attention`: the implementation ours ran (`models.resolve_attention`).
    """

    name: str
    run: Callable[[int], tuple[float, float] | None]
    flops: float | None
    attention: str | None = None
    #: () -> the compiled step's HLO text (for `benchmarks.hlo`), where it can be had.
    hlo_text: Callable[[], str] | None = None
    #: Steps that run every program the step compiles (Snoo's sync step is a program of
    #: its own, first run at its first sync): a warm-up takes at least these.
    warmup_steps: int = 0
    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)


def _batches(config: TrainConfig, count: int = 4, vocab: int = VOCAB
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    shape = (config.data.grad_accum, config.data.batch_size, config.model.block_size + 1)
    windows = [rng.integers(0, vocab, shape, dtype=np.int32) for _ in range(count)]
    return [(w[..., :-1], w[..., 1:]) for w in windows]


def ours(config: TrainConfig, *, vocab: int = VOCAB,
         batch: Callable[[int], tuple[jax.Array, jax.Array]] | None = None,
         sync_every: int | None = None) -> Variant:
    """The trainer's step for `config` (its mesh, shardings, optimizer and Snoo hint).

    Args:
      vocab: the data's vocabulary size (before padding).
      batch: step -> the placed `(inputs, targets)` (default: 4 random batches in turn).
      sync_every: read the metrics every this many steps, as the trainer's log does
        (default: only at the end of `run`).
    """
    gpt_config = model_config(config, vocab)
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(gpt_config, spec.tx, seed=config.run.seed, mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh),
                           loss_reduction=config.optimizer.loss_reduction)
    if batch is None:
        data = batch_sharding(mesh)
        batches = [(put_batch(x, data), put_batch(y, data))
                   for x, y in _batches(config, vocab=vocab)]
        batch = lambda i: batches[i % len(batches)]
    tokens = config.data.grad_accum * config.data.batch_size * config.model.block_size
    flops = flops_per_token(state.params, gpt_config) * tokens
    box = {"state": state, "i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            i = box["i"]
            box["state"], metrics = step(box["state"], *batch(i), **spec.update_kwargs(i))
            box["i"] = i + 1
            if sync_every and box["i"] % sync_every == 0:
                jax.device_get(metrics)
        jax.block_until_ready(metrics)

    def hlo_text() -> str:  # the step after the first, whose hints every later step has
        return step.lower(box["state"], *batch(1), **spec.update_kwargs(1)).compile().as_text()

    hints = [spec.update_kwargs(i) for i in range(2 * (spec.sync_period or 1))]
    warmup = 1 + max(hints.index(h) for h in hints)  # through each hint's first step
    return Variant(f"ours {config.optimizer.name} {config.model.dtype}", run, flops,
                   attention=gpt_config.attention, hlo_text=hlo_text, warmup_steps=warmup)


def _reference_loss(params: dict, x_BT: jax.Array, y_BT: jax.Array, n_head: int) -> jax.Array:
    """A plain GPT (pre-LayerNorm, causal softmax attention, exact GELU, tied head)."""

    def norm(x, scale):
        x = x - x.mean(-1, keepdims=True)
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale

    B, T = x_BT.shape
    h = params["wte"][x_BT] + params["wpe"][:T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    for p in params["blocks"]:
        q, k, v = jnp.split(norm(h, p["ln_1"]) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(B, T, n_head, -1).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -jnp.inf)
        a = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
        h = h + a @ p["proj"]
        h = h + jax.nn.gelu(norm(h, p["ln_2"]) @ p["fc"], approximate=False) @ p["out"]
    logits = norm(h, params["ln_f"]) @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, y_BT).mean()


def reference(config: TrainConfig) -> Variant:
    """A minimal float32 GPT step at `config`'s shape: value_and_grad, clip, AdamW, donated."""
    L, D = config.model.n_layer, config.model.n_embd
    keys = iter(jax.random.split(jax.random.key(config.run.seed), 2 + 4 * L))
    normal = lambda *shape, std=0.02: std * jax.random.normal(next(keys), shape)
    params = {"wte": normal(VOCAB, D), "wpe": normal(config.model.block_size, D),
              "ln_f": jnp.ones(D), "blocks": [
                  {"ln_1": jnp.ones(D), "qkv": normal(D, 3 * D),
                   "proj": normal(D, D, std=0.02 / math.sqrt(2 * L)), "ln_2": jnp.ones(D),
                   "fc": normal(D, 4 * D), "out": normal(4 * D, D, std=0.02 / math.sqrt(2 * L))}
                  for _ in range(L)]}
    a = override(config, optimizer="adamw").optimizer.table  # AdamW's defaults, its preset's
    tx = optax.chain(optax.clip_by_global_norm(config.optimizer.grad_clip),
                     optax.adamw(a.learning_rate, b1=a.b1, b2=a.b2,
                                 weight_decay=a.weight_decay))

    @functools.partial(jax.jit, donate_argnums=(0, 1),
                       compiler_options=compiler_options(make_mesh(config)))  # as ours
    def step(params, opt_state, x_ABT, y_ABT):
        grad_fn = jax.value_and_grad(_reference_loss)
        loss, grads = grad_fn(params, x_ABT[0], y_ABT[0], config.model.n_head)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in _batches(config)]
    box = {"state": (params, tx.init(params)), "i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            *box["state"], loss = step(*box["state"], *batches[box["i"] % len(batches)])
            box["i"] += 1
        jax.block_until_ready(loss)

    return Variant("reference float32 (plain jax)", run, None)


def pytorch(python: str) -> Variant:
    """nanoGPT's CPU recipe in PyTorch (`torch_recipe.py --serve` under `python`)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_recipe.py")
    proc = subprocess.Popen([python, script, "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    hello = json.loads(proc.stdout.readline() or "{}")
    if "torch" not in hello:
        raise SystemExit(f"{python} {script} --serve did not start (is torch installed there?)")

    def run(n: int) -> tuple[float, float]:
        proc.stdin.write(f"{n}\n")
        timing = json.loads(proc.stdout.readline())
        return timing["wall"], timing["cpu"]

    return Variant(f"pytorch {hello['torch']} float32 ({hello['threads']} threads)", run, None)


def measure(variants: Sequence[Variant], *, rounds: int, steps: int, warmup: int) -> None:
    """Warm every variant up (compiles), then time `rounds` interleaved rounds of `steps`
    (every other round in reverse order, so no variant always follows the same one)."""
    for v in variants:
        v.run(max(warmup, v.warmup_steps))
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            timed = v.run(steps)
            wall, cpu = timed or (time.perf_counter() - t0, time.process_time() - c0)
            v.wall.append(wall / steps)
            v.cpu.append(cpu / steps)


def report(variants: Sequence[Variant], config: TrainConfig, load: tuple[Any, Any]) -> str:
    """The result table (markdown) with the machine, the shape and the load."""
    device = jax.devices()[0]
    peak = peak_flops_per_device(device.device_kind)
    m, d = config.model, config.data
    tokens = d.grad_accum * d.batch_size * m.block_size
    ref = next((v for v in variants if v.name.startswith("reference")), None)
    first_ours = next(v for v in variants if v.name.startswith("ours"))

    def paired(a: Variant, b: Variant) -> tuple[str, str]:
        """Median and range over rounds of `a`'s wall time over `b`'s, round by round."""
        r = [x / y for x, y in zip(a.wall, b.wall, strict=True)]
        return f"{statistics.median(r):.3f}", f"{min(r):.3f}-{max(r):.3f}"

    attention = ", ".join(f"{v.name}: {v.attention}" for v in variants if v.attention)
    lines = [
        f"machine: {jax.device_count()} x {device.device_kind} ({jax.default_backend()}), "
        f"{os.cpu_count()} CPUs; load average {load[0]} before, {load[1]} after",
        f"shape: {m.n_layer} layers x {m.n_embd}, {m.n_head} heads, block "
        f"{m.block_size}, batch {d.batch_size} x {d.grad_accum}; "
        f"{tokens:,} tokens/step; {len(variants[0].wall)} rounds; attention ({attention})", "",
        "| variant | ms/step (median, min) | tokens/s | CPU ms/step | speed vs reference "
        f"| tokens/s vs {variants[0].name} (paired by round) | its range "
        f"| step time vs {first_ours.name} (paired by round) | its range | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        wall = statistics.median(v.wall)
        ratio = f"{statistics.median(ref.wall) / wall:.2f}x" if ref else "-"
        speed, speed_range = paired(variants[0], v)
        time_ratio, time_range = paired(v, first_ours)
        mfu = f"{v.flops / wall / (peak * jax.device_count()):.1%}" if (
            peak and v.flops) else "n/a"
        lines.append(f"| {v.name} | {wall * 1e3:.1f}, {min(v.wall) * 1e3:.1f} | "
                     f"{tokens / wall:,.0f} | {statistics.median(v.cpu) * 1e3:.1f} | "
                     f"{ratio} | {speed} | {speed_range} | {time_ratio} | {time_range} "
                     f"| {mfu} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=(
        "Other --key=value arguments are train config keys (python -m train --help)."))
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="compute dtypes of our step, comma-separated")
    parser.add_argument("--optimizers", default=None,
                        help="optimizers of our step (train.optimizers names), comma-separated; "
                             "each runs at every dtype, all interleaved in this process "
                             "(default: --optimizer, which defaults to adamw here)")
    parser.add_argument("--no_reference", action="store_true",
                        help="skip the plain-JAX reference step")
    parser.add_argument("--torch", default=None, metavar="PYTHON",
                        help="also time nanoGPT's recipe in PyTorch (benchmarks/torch_recipe.py) "
                             "under this interpreter, as the first variant (CPU recipe only)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=VOCAB,
                        help="the random tokens' vocabulary (before padding; GPT-2's: 50257)")
    parser.add_argument("--require_accelerator", action="store_true",
                        help="fail unless JAX's default backend is a GPU or TPU")
    args, rest = parser.parse_known_args(argv)
    if args.require_accelerator and jax.default_backend() == "cpu":
        raise SystemExit("no GPU/TPU visible to JAX (jax.devices() = "
                         f"{jax.devices()}); install jax[cuda12] or run on a GPU machine")
    config = parse_args(["--optimizer=adamw", *rest])
    names = args.optimizers.split(",") if args.optimizers else [config.optimizer.name]
    variants = [ours(override(config, optimizer=o, dtype=d), vocab=args.vocab)
                for o in names for d in args.dtypes.split(",")]
    if not args.no_reference:
        variants.append(reference(config))
    if args.torch:
        m, d = config.model, config.data
        recipe = (m.n_layer, m.n_head, m.n_embd, m.block_size, d.batch_size, d.grad_accum)
        if recipe != (4, 4, 128, 64, 12, 1):
            raise SystemExit(f"--torch runs nanoGPT's CPU recipe only (4 layers, 4 heads, "
                             f"128 wide, block 64, batch 12 x 1), not {recipe}")
        variants.insert(0, pytorch(args.torch))
    load_before = os.getloadavg()[0]
    measure(variants, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    table = report(variants, config, (f"{load_before:.1f}", f"{os.getloadavg()[0]:.1f}"))
    print(table)
    return table


if __name__ == "__main__":
    main()
