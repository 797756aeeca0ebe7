"""Sample text from a trained GPT: `python -m train.sample --out_dir=DIR [options]`.

`--out_dir` is the trainer's. Options (defaults from the run's config, where the trainer
names them `--num_samples` and, for the rest, with a `sample_` prefix):
`--num_samples`, `--max_new_tokens`, `--temperature`, `--top_k`, `--start` (a
prompt, or `FILE:path`), `--seed`, `--step` (default: the latest checkpoint; an unknown
step lists the saved ones). Samples decode with the run's tokenizer (its characters,
bytes, GPT-2's BPE, or the `tokenizer.json` the run copied into `--out_dir`); only the
data's own ids are sampled (a padded vocabulary's extra ids are masked), so each sample
has exactly `--max_new_tokens` tokens after the prompt. Nothing is written: a missing
`--out_dir` is an error, not a new folder. A mistake ends with one `error: ...` line and
exit status 2 (`train.errors.MISTAKE_EXIT_STATUS`).

Example:
  $ python -m train.sample --out_dir=out/adamw --num_samples=2 --start="ROMEO:"

References:
  Karpathy, "nanoGPT" (sample.py), https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import models
from train.checkpoint import Checkpointer, saved_tokenizer
from train.config import config_from_dict, flat_dict, override
from train.errors import run_cli
from train.optimizers import build_optimizer
from train.sharding import make_mesh
from train.step import ModelDef, create_train_state, is_step_count, make_readout
from train.tokenizer import Tokenizer, from_meta, prompt_ids, read_prompt

__all__ = ["generate_text", "load_model", "load_params", "main"]


def generate_text(model: models.GPT, tokenizer: Tokenizer, vocab_size: int, *, start: str,
                  num_samples: int, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int = 0) -> list[str]:
    """`num_samples` continuations of `start` (decoded, prompt included).

    Only the data's `vocab_size` ids are sampled (a padded vocabulary's extra rows are
    masked). An empty `start` begins at the end-of-text id (a document's start), or id 0
    for a character vocabulary.
    """
    prompt = np.asarray(prompt_ids(tokenizer, start), np.int32)
    tokens_BT = jnp.asarray(np.tile(prompt[None], (num_samples, 1)))
    top_k = None if top_k is None else min(top_k, vocab_size)
    out_BT = models.generate(model, tokens_BT, max_new_tokens, temperature=temperature,
                             top_k=top_k, rng=jax.random.key(seed), valid_vocab=vocab_size)
    return [tokenizer.decode(row) for row in np.asarray(out_BT)]


def load_model(out_dir: str | Path, step: int | None = None
               ) -> tuple[models.GPT, Tokenizer, dict]:
    """The model saved in `out_dir/checkpoints` (latest step by default) and its tokenizer.

    Returns:
      `(model, tokenizer, meta)`.
    """
    model_def, params, meta = load_params(out_dir, step)
    return model_def.merge(params), from_meta(meta["tokenizer"], root=out_dir), meta


def load_params(out_dir: str | Path, step: int | None = None
                ) -> tuple[ModelDef, dict, dict]:
    """`(model_def, params, meta)` of a checkpoint in `out_dir/checkpoints` (latest step by
    default), restored on one device; `meta` is the saved JSON item plus
    `"checkpoint_step"`, its `"tokenizer"` and the data's `"vocab_size"` filled in for
    checkpoints older than token datasets. Nothing is created or changed in `out_dir`.

    Raises:
      FileNotFoundError: `out_dir` holds no checkpoint, or none at `step` (the message
        lists the saved steps).
    """
    if not Path(out_dir).is_dir():
        raise FileNotFoundError(f"--out_dir={str(out_dir)!r}: no such folder (a run's "
                                "--out_dir holds checkpoints/)")
    try:
        ckpt = Checkpointer(Path(out_dir) / "checkpoints", async_save=False, read_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"--out_dir={str(out_dir)!r} holds no checkpoints/ folder: "
                                "not a training run's output") from None
    saved = ckpt.steps()
    if not saved:
        raise FileNotFoundError(f"--out_dir={str(out_dir)!r}: no checkpoint in "
                                f"{ckpt.directory}")
    step = saved[-1] if step is None else step
    if step not in saved:
        raise FileNotFoundError(f"--step={step}: no such checkpoint in {ckpt.directory}; "
                                f"saved steps: {', '.join(map(str, saved))}")
    meta = ckpt.restore_meta(step)
    tokenizer = saved_tokenizer(meta)
    vocab_size = meta.get("vocab_size") or len(tokenizer["chars"])
    config = override(config_from_dict(meta["config"]), attention="auto")  # for this backend
    # One device; a DiLoCo run's replicas are restored there and replica 0 is used (as the
    # run evaluated and sampled it).
    replicas = config.mesh.diloco
    config = override(config, mesh_data=1, mesh_fsdp=1, mesh_tensor=1, mesh_diloco=1)
    tx = build_optimizer(config).tx
    mesh = make_mesh(config)
    model_def, like = create_train_state(config.model, tx, seed=config.run.seed, mesh=mesh)
    if replicas > 1:
        like = like._replace(**_stacked_like({"params": like.params,
                                              "opt_state": like.opt_state}, replicas))
    state, _ = ckpt.restore(step, like=like)
    ckpt.close()
    params = make_readout(state.opt_state)(state)  # the weights the run evaluated
    params = params if replicas == 1 else jax.tree.map(lambda x: x[0], params)
    return model_def, params, {**meta, "tokenizer": tokenizer, "vocab_size": vocab_size,
                               "checkpoint_step": step}


def _stacked_like(tree, replicas: int):
    """Abstract `tree` with a leading axis of `replicas` on every leaf but the integer
    scalars (the layout `train.step.create_train_state` gives DiLoCo replicas)."""
    def stacked(x):
        shape = x.shape if is_step_count(x) else (replicas, *x.shape)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(stacked, tree)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m train.sample`; prints the samples."""
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__,
                                     allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True,
                        help="the run's --out_dir (holds checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--num_samples", type=int, default=None)
    parser.add_argument("--max_new_tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--start", default=None, help="prompt, or FILE:path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return run_cli(lambda: _sample(args))


def _sample(args: argparse.Namespace) -> int:
    given = None if args.start is None else read_prompt(args.start)  # before any work
    model, tokenizer, meta = load_model(args.out_dir, args.step)
    cfg = flat_dict(meta["config"])
    start = read_prompt(cfg["sample_start"], flag="--sample_start") if given is None else given
    pick = lambda value, key: cfg[key] if value is None else value
    texts = generate_text(model, tokenizer, meta["vocab_size"], start=start,
                          num_samples=pick(args.num_samples, "num_samples"),
                          max_new_tokens=pick(args.max_new_tokens, "sample_max_new_tokens"),
                          temperature=pick(args.temperature, "sample_temperature"),
                          top_k=pick(args.top_k, "sample_top_k"), seed=args.seed)
    for text in texts:
        print(text, "\n---------------", sep="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
