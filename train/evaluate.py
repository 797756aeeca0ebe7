"""Loss of a checkpoint on a whole split: `python -m train.evaluate --out_dir=DIR [options]`.

The trainer's own evaluation averages `eval_iters` random batches (nanoGPT's estimate; 20
batches of the CPU recipe move by about ±0.03 with the seed). This one reads every
non-overlapping `block_size` window of the split once, so two runs compare on the same
tokens: the mean cross-entropy over all of them (each window's targets are its inputs
shifted by one; the split's last partial window is left out).

`--out_dir` is the trainer's (`--out` is an alias). Options: `--split` (val), `--step`
(latest checkpoint), `--batch_size` (windows per forward pass, 64), `--data` (the corpus;
default: the run's own `data` setting).

Example:
  $ python -m train.evaluate --out_dir=out/shakespeare_char_cpu
  val loss 1.9013 over 1,742 windows of 64 tokens (111,488 of 111,540 tokens), step 2000
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from train.config import config_from_dict, override
from train.data import CharDataset
from train.errors import run_cli
from train.sample import load_params
from train.sharding import make_mesh, tree_shardings
from train.step import make_eval_step

__all__ = ["evaluate_split", "main", "split_windows"]


def split_windows(ids: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every non-overlapping window of `ids`: `(inputs, targets)`, int32 `(W, block_size)`
    with `W = (len(ids) - 1) // block_size` and targets the inputs shifted by one."""
    n = (len(ids) - 1) // block_size
    if n < 1:
        raise ValueError(f"a split of {len(ids)} tokens holds no window of block_size="
                         f"{block_size} (it needs block_size + 1 tokens)")
    flat = np.asarray(ids[:n * block_size + 1], np.int32)
    return flat[:-1].reshape(n, block_size), flat[1:].reshape(n, block_size)


def evaluate_split(out_dir: str | Path, *, split: str = "val", step: int | None = None,
                   batch_size: int = 64, data: str | None = None) -> dict:
    """Mean cross-entropy of a checkpoint over every window of `split` (see module doc).

    Returns:
      `{"loss", "windows", "tokens", "split_tokens", "block_size", "step"}`.

    Raises:
      ValueError: the corpus's vocabulary is not the checkpoint's, or a bad `split` or
        `batch_size`.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    CharDataset.check_split(split)  # before the checkpoint is read
    model_def, params, vocab, meta = load_params(out_dir, step)
    config = config_from_dict(meta["config"])
    dataset = CharDataset.load(config.data.path if data is None else data)
    if dataset.chars != vocab.chars:
        raise ValueError(f"the corpus has a vocabulary of {dataset.vocab_size} characters "
                         f"that differs from the checkpoint's {vocab.vocab_size}; pass the "
                         f"run's corpus with --data")
    ids = dataset.split_ids(split)
    block_size = config.model.block_size
    inputs, targets = split_windows(ids, block_size)
    mesh = make_mesh(override(config, mesh_data=1, mesh_fsdp=1, mesh_tensor=1))
    eval_step = make_eval_step(model_def, mesh=mesh, params_shardings=tree_shardings(params, mesh))
    total, n = 0.0, len(inputs)
    full = n // batch_size * batch_size
    # Whole batches in one scan, the rest as one smaller batch; weighted by window count.
    for lo, hi, b in ((0, full, batch_size), (full, n, n - full)):
        if hi > lo:
            x = inputs[lo:hi].reshape(-1, b, block_size)
            y = targets[lo:hi].reshape(-1, b, block_size)
            total += float(jax.device_get(eval_step(params, x, y))) * (hi - lo)
    return {"loss": total / n, "windows": n, "tokens": n * block_size,
            "split_tokens": len(ids), "block_size": block_size,
            "step": meta["checkpoint_step"]}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m train.evaluate`; prints the loss."""
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", "--out", dest="out_dir", required=True,
                        help="the run's --out_dir (holds checkpoints/)")
    parser.add_argument("--split", default="val", choices=("train", "val"))
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--batch_size", type=int, default=64, help="windows per forward pass")
    parser.add_argument("--data", default=None, help="corpus path (default: the run's)")
    args = parser.parse_args(argv)
    return run_cli(lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    r = evaluate_split(args.out_dir, split=args.split, step=args.step,
                       batch_size=args.batch_size, data=args.data)
    print(f"{args.split} loss {r['loss']:.4f} over {r['windows']:,} windows of "
          f"{r['block_size']} tokens ({r['tokens']:,} of {r['split_tokens']:,} tokens), "
          f"step {r['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
