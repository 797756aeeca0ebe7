"""The trainer's data loader: its rate, what prefetching saves, and memory against data size.

Three measurements, each printed as a table (and `--out=DIR` writes `data_loader.json`):

1. **Loader rate**: tokens/s of `TokenDataset.batch` for one process at `gpt2_owt`'s step
   (12 x 40 windows of 1025 tokens: 491,520 tokens), on modded-nanogpt shards of random
   GPT-2 ids written here (`--loader_gib` in all, in the page cache), against the tokens a
   step consumes per second at nanoGPT's reported pace for that config (8 x A100 40GB,
   about 4 days for 600k steps: ~0.58 s/step, ~850k tokens/s for the job).
2. **Prefetch**: the CPU recipe's step (the trainer's, `benchmarks.throughput.ours`) fed
   through `train.data.BatchPrefetcher` on and off, alternated round by round in one
   process, on the shipped corpus as characters and as byte-token shards on disk; and
   the time to read and place one batch.
3. **Peak memory**: the resident-set peak of `python -m train` (a small GPT on GPT-2
   ids) on a shard set of `--sparse_gib` (sparse files) against one of a few thousand
   tokens, same model and steps.

    python -m benchmarks.data_loader                     # all three
    python -m benchmarks.data_loader --only=loader,memory --sparse_gib=16

The machine's load (`os.getloadavg`) and CPU model are printed beside the figures.

References:
  Karpathy, "nanoGPT" (config/train_gpt2.py; README: GPT-2 124M on OpenWebText in about
  4 days on 8 x A100 40GB), https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from train import data as td

ROOT = Path(__file__).resolve().parents[1]
OWT_STEP = dict(batch_size=12, grad_accum=40, block_size=1024)  # gpt2_owt's step
OWT_TOKENS_PER_STEP = 12 * 40 * 1024
NANOGPT_OWT_SECONDS_PER_STEP = 4 * 24 * 3600 / 600_000  # README: ~4 days, 600k steps


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(x.split(":", 1)[1].strip() for x in out.splitlines()
                    if x.startswith("Model name"))
        flags = next((x for x in out.splitlines() if x.startswith("Flags")), "")
        bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
        return f"{name} (bf16 flags: {', '.join(bf16) or 'none'})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def write_random_shards(folder: Path, gib: float, shard_tokens: int = 2**27) -> Path:
    """`gib` GiB of random GPT-2 ids as modded-nanogpt shards (and a small val shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    total = int(gib * 2**30 / 2)
    for i, lo in enumerate(range(0, total, shard_tokens)):
        n = min(shard_tokens, total - lo)
        td.write_shard(folder / f"rand_train_{i:06d}.bin",
                       rng.integers(0, td.GPT2_VOCAB_SIZE, n, dtype=np.uint16))
    td.write_shard(folder / "rand_val_000000.bin", rng.integers(0, 50257, 2**16, np.uint16))
    return folder


def loader_rate(folder: Path, steps: int) -> dict:
    data = td.open_dataset(folder)
    data.batch("train", 0, **OWT_STEP)  # warm the code path
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        data.batch("train", step, **OWT_STEP)
    seconds = (time.perf_counter() - t0) / steps
    needed = OWT_TOKENS_PER_STEP / NANOGPT_OWT_SECONDS_PER_STEP
    return {"tokens": data.num_tokens("train"), "seconds_per_step": seconds,
            "tokens_per_s": OWT_TOKENS_PER_STEP / seconds, "step_needs_tokens_per_s": needed,
            "ratio": OWT_TOKENS_PER_STEP / seconds / needed}


def prepared_bytes_corpus(folder: Path) -> Path:
    """The shipped corpus as byte tokens in a prepared folder (90/10 split)."""
    raw = np.frombuffer(td.SHIPPED_CORPUS.read_bytes(), np.uint8).astype(np.uint16)
    folder.mkdir(parents=True, exist_ok=True)
    cut = int(len(raw) * 0.9)
    td.write_shard(folder / "tokens_train_000000.bin", raw[:cut])
    td.write_shard(folder / "tokens_val_000000.bin", raw[cut:])
    (folder / td.DATASET_META).write_text(json.dumps(
        {"layout": "shards", "vocab_size": 257, "tokenizer": {"kind": "bytes"}}))
    return folder


def batch_seconds(path: str | None, steps: int = 200) -> float:
    """Seconds to read one CPU-recipe batch (12 x 65 tokens) and place it on the device:
    what prefetching takes off the step's critical path."""
    import jax

    data = td.open_dataset(path)
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = data.batch("train", step, batch_size=12, block_size=64, seed=0)
        jax.block_until_ready((jax.device_put(x), jax.device_put(y)))
    return (time.perf_counter() - t0) / steps


def prefetch_rates(datasets: dict[str, str | None], steps: int, rounds: int) -> dict:
    """The CPU recipe's step (snoo_muon) fed from each dataset through the trainer's
    `BatchPrefetcher`, on and off, in one process: alternating rounds of `steps` steps,
    the metrics read every 10 steps as the trainer's log reads them."""
    import jax

    from benchmarks.throughput import ours
    from train.config import get_preset
    from train.sharding import batch_sharding, make_mesh, put_batch

    config = get_preset("shakespeare_char_cpu")
    sharding = batch_sharding(make_mesh(config))
    out = {}
    for name, path in datasets.items():
        data, read = td.open_dataset(path), batch_seconds(path)

        def make(step, data=data):
            x, y = data.batch("train", step, batch_size=12, block_size=64, seed=0)
            return put_batch(x, sharding), put_batch(y, sharding)

        loaders = {on: td.BatchPrefetcher(make, enabled=on) for on in (True, False)}
        variants = {on: ours(config, vocab=data.vocab_size, batch=loaders[on].get,
                             sync_every=10) for on in (True, False)}
        for variant in variants.values():
            variant.run(20)  # compile and warm up
        times = {True: [], False: []}
        for _ in range(rounds):
            for on, variant in variants.items():
                t0 = time.perf_counter()
                variant.run(steps)
                times[on].append((time.perf_counter() - t0) / steps)
        for loader in loaders.values():
            loader.close()
        ratios = [off / on for on, off in zip(times[True], times[False], strict=True)]
        step_s = statistics.median(times[False])
        out[name] = {"step_seconds_prefetch": times[True], "step_seconds_no_prefetch":
                     times[False], "median_speedup": statistics.median(ratios),
                     "speedups": ratios, "batch_seconds": read, "step_seconds": step_s,
                     "batch_share_of_step": read / step_s}
        jax.clear_caches()
    return out


_PEAK = ("import resource, runpy, sys; sys.argv = ['train', *sys.argv[1:]]\n"
         "try:\n    runpy.run_module('train', run_name='__main__')\n"
         "finally:\n    print('PEAK_MIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
         " / 1024, file=sys.stderr)\n")


def peak_memory(sparse_gib: float, scratch: Path) -> dict:
    big = scratch / "sparse"
    big.mkdir(parents=True, exist_ok=True)
    shard_tokens = 2**30 - 2**20  # under the header's int32 count
    total = int(sparse_gib * 2**30 / 2)
    for i, lo in enumerate(range(0, total, shard_tokens)):
        n = min(shard_tokens, total - lo)
        header = np.zeros(td.SHARD_HEADER_INTS, np.int32)
        header[:3] = td.SHARD_MAGIC, td.SHARD_VERSION, n
        with open(big / f"big_train_{i:06d}.bin", "wb") as f:
            f.write(header.tobytes())
            f.truncate(header.nbytes + 2 * n)
    td.write_shard(big / "big_val_000000.bin", np.zeros(2**16, np.uint16))
    tiny = write_random_shards(scratch / "tiny", 2**13 * 2 / 2**30)
    result = {}
    for name, folder in (("sparse", big), ("tiny", tiny)):
        args = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--max_iters=100",
                "--eval_interval=50", "--eval_iters=5", "--checkpoint_every=100",
                f"--data={folder}", f"--out_dir={scratch / ('out_' + name)}",
                "--progress=false", "--num_samples=0"]
        proc = subprocess.run([sys.executable, "-c", _PEAK, *args], cwd=ROOT, check=True,
                              capture_output=True, text=True)
        peak = float(next(x.split()[1] for x in proc.stderr.splitlines()
                          if x.startswith("PEAK_MIB")))
        result[name] = {"tokens": td.open_dataset(folder, check=False).num_tokens("train"),
                        "peak_mib": peak}
    result["difference_mib"] = result["sparse"]["peak_mib"] - result["tiny"]["peak_mib"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_loader",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="loader,prefetch,memory")
    parser.add_argument("--loader_gib", type=float, default=2.0)
    parser.add_argument("--loader_steps", type=int, default=20)
    parser.add_argument("--prefetch_steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sparse_gib", type=float, default=8.0)
    parser.add_argument("--out", default=None, help="folder for data_loader.json")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    results: dict = {"cpu": cpu_model(), "load_before": os.getloadavg()}
    print(f"# {results['cpu']}; load {results['load_before'][0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if "loader" in only:
            r = results["loader"] = loader_rate(
                write_random_shards(scratch / "rand", args.loader_gib), args.loader_steps)
            print(f"loader at gpt2_owt's step ({OWT_TOKENS_PER_STEP:,} tokens), "
                  f"{r['tokens']:,} tokens in shards: {r['seconds_per_step'] * 1e3:.1f} ms "
                  f"per step, {r['tokens_per_s']:,.0f} tokens/s per process = "
                  f"{r['ratio']:.1f}x what nanoGPT's 8 x A100 step consumes "
                  f"({r['step_needs_tokens_per_s']:,.0f} tokens/s)", flush=True)
        if "prefetch" in only:
            corpus = prepared_bytes_corpus(scratch / "bytes")
            r = results["prefetch"] = prefetch_rates(
                {"characters (in memory)": None, "byte shards (memmap)": str(corpus)},
                args.prefetch_steps, args.rounds)
            for name, row in r.items():
                print(f"prefetch, {name}: step time off/on = {row['median_speedup']:.3f} "
                      f"(rounds {', '.join(f'{x:.3f}' for x in row['speedups'])}); "
                      f"{statistics.median(row['step_seconds_prefetch']) * 1e3:.1f} ms on, "
                      f"{row['step_seconds'] * 1e3:.1f} ms off; reading a batch "
                      f"{row['batch_seconds'] * 1e6:,.0f} us = "
                      f"{row['batch_share_of_step']:.2%} of a step", flush=True)
        if "memory" in only:
            r = results["memory"] = peak_memory(args.sparse_gib, scratch)
            print(f"peak RSS of python -m train: {r['sparse']['peak_mib']:.0f} MiB on "
                  f"{r['sparse']['tokens']:,} tokens (sparse shards), "
                  f"{r['tiny']['peak_mib']:.0f} MiB on {r['tiny']['tokens']:,}: "
                  f"{r['difference_mib']:+.0f} MiB", flush=True)
    results["load_after"] = os.getloadavg()
    print(f"# load after {results['load_after'][0]:.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "data_loader.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
