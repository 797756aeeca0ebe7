"""Loss of a checkpoint on a whole split: `python -m train.evaluate --out_dir=DIR [options]`.

The trainer's own evaluation averages `eval_iters` random batches (nanoGPT's estimate; 20
batches of the CPU recipe move by about ±0.03 with the seed). This one reads every
non-overlapping `block_size` window of the split once, file by file, so two runs compare
on the same tokens: the mean cross-entropy over all of them (each window's targets are its
inputs shifted by one; each file's last partial window is left out). `--eval_tokens=N`
stops after the first `N // block_size` windows: a fixed budget on a large val split, as
modded-nanogpt's 10,485,760 val tokens. The split is read lazily, a batch at a time.

`--out_dir` is the trainer's (`--out` is an alias). Options: `--split` (val), `--step`
(latest checkpoint), `--batch_size` (windows per forward pass, 64), `--eval_tokens` (all),
`--data` (the dataset; default: the run's own `data` setting).

Example:
  $ python -m train.evaluate --out_dir=out/shakespeare_char_cpu
  val loss 1.9013 over 1,742 windows of 64 tokens (111,488 of 111,540 tokens), step 2000
  $ python -m train.evaluate --out_dir=out/gpt2_medium_fineweb --eval_tokens=10485760

References:
  Jordan et al., "modded-nanogpt" (train_gpt.py, val_tokens),
  https://github.com/KellerJordan/modded-nanogpt, 2024.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from train.config import config_from_dict, override
from train.data import check_split, open_dataset
from train.errors import run_cli
from train.loop import run_tokenizer
from train.sample import load_params
from train.sharding import make_mesh, tree_shardings
from train.step import make_eval_step
from train.tokenizer import describe_meta

__all__ = ["evaluate_split", "main"]


def evaluate_split(out_dir: str | Path, *, split: str = "val", step: int | None = None,
                   batch_size: int = 64, data: str | None = None,
                   eval_tokens: int | None = None) -> dict:
    """Mean cross-entropy of a checkpoint over every window of `split` (see module doc).

    Returns:
      `{"loss", "windows", "tokens", "split_tokens", "block_size", "step"}`.

    Raises:
      ValueError: the dataset's tokenizer is not the checkpoint's, a bad `split`,
        `batch_size` or `eval_tokens`, or a split without a whole window.
    """
    if batch_size < 1:
        raise ValueError(f"--batch_size={batch_size}: expected >= 1")
    if eval_tokens is not None and eval_tokens < 1:
        raise ValueError(f"--eval_tokens={eval_tokens}: expected >= 1 (or leave it out: all)")
    check_split(split)  # before the checkpoint is read
    model_def, params, meta = load_params(out_dir, step)
    config = config_from_dict(meta["config"])
    dataset = open_dataset(config.data.path if data is None else data)
    tokenizer, _ = run_tokenizer(dataset)
    if tokenizer != meta["tokenizer"]:  # as a resume checks (a tokenizer.json by content)
        raise ValueError(f"--data: its tokenizer ({describe_meta(tokenizer)}) is not the "
                         f"checkpoint's ({describe_meta(meta['tokenizer'])}); pass the run's "
                         "data with --data")
    block_size = config.model.block_size
    mesh = make_mesh(override(config, mesh_data=1, mesh_fsdp=1, mesh_tensor=1, mesh_diloco=1))
    eval_step = make_eval_step(model_def, mesh=mesh, params_shardings=tree_shardings(params, mesh))
    total, n = 0.0, 0
    group: list[tuple[np.ndarray, np.ndarray]] = []

    def flush():  # same-size batches in one call (the eval step scans over them)
        nonlocal total, n
        x, y = np.stack([g[0] for g in group]), np.stack([g[1] for g in group])
        total += float(jax.device_get(eval_step(params, x, y))) * x.shape[0] * x.shape[1]
        n += x.shape[0] * x.shape[1]
        group.clear()

    for x, y in dataset.sequential_windows(split, block_size, batch_size=batch_size,
                                           max_tokens=eval_tokens):
        if group and (len(group) == 16 or len(x) != len(group[0][0])):
            flush()
        group.append((x, y))
    if group:
        flush()
    if n == 0:
        raise ValueError(f"the {split} split holds no window of block_size={block_size} (a "
                         "file needs block_size + 1 tokens)")
    return {"loss": total / n, "windows": n, "tokens": n * block_size,
            "split_tokens": dataset.num_tokens(split), "block_size": block_size,
            "step": meta["checkpoint_step"]}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m train.evaluate`; prints the loss."""
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                     allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True,
                        help="the run's --out_dir (holds checkpoints/)")
    parser.add_argument("--split", default="val", choices=("train", "val"))
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--batch_size", type=int, default=64, help="windows per forward pass")
    parser.add_argument("--eval_tokens", type=int, default=None,
                        help="at most this many tokens, the split's first windows (all)")
    parser.add_argument("--data", default=None, help="dataset path (default: the run's)")
    args = parser.parse_args(argv)
    return run_cli(lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    r = evaluate_split(args.out_dir, split=args.split, step=args.step,
                       batch_size=args.batch_size, data=args.data,
                       eval_tokens=args.eval_tokens)
    print(f"{args.split} loss {r['loss']:.4f} over {r['windows']:,} windows of "
          f"{r['block_size']} tokens ({r['tokens']:,} of {r['split_tokens']:,} tokens), "
          f"step {r['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
