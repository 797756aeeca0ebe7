"""What several trainer test modules build: tiny run configs, the jitted step the loop
would build for one, random token batches, and a corpus folder as nanoGPT writes it."""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import jax
import numpy as np

from references.error import float64, in_float64
from references.gpt64 import FLOAT64_DTYPES
from train import config as tc
from train import data as td
from train.config import override
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step

#: The tiny runs' Snoo-AdamW: lr 1e-2 with a 2-step warm-up, cosine to 1e-3 at step 8.
TINY_OPTIMIZER = dict(optimizer="snoo_adamw", snoo_k=3, learning_rate=1e-2,
                      final_lr_scale=0.1, warmup_iters=2, lr_decay_iters=8)


def _with(base: dict, overrides: dict) -> tc.TrainConfig:
    """`base` (with `TINY_OPTIMIZER`), then `overrides`: another `optimizer` keeps those of
    the base's hyperparameters it has, as `train.config.override` does for a preset."""
    return tc.override(tc.override(tc.TrainConfig(), **TINY_OPTIMIZER, **base), **overrides)


def tiny(corpus, tmp_path, **overrides) -> tc.TrainConfig:
    """An 8-step Snoo-AdamW run of a 1-layer GPT in `tmp_path / "run"` (test_train's)."""
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        max_iters=8, eval_interval=4, eval_iters=2, log_interval=1, checkpoint_every=4,
        mesh_data=1, num_samples=0, progress=False, vocab_multiple=8, data=str(corpus),
        out_dir=str(tmp_path / "run"))
    return _with(base, overrides)


def step_setup(config):
    """The jitted step the loop would build for `config` (same program: cached compiles)."""
    vocab_size = td.open_dataset(config.data.path).vocab_size
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, vocab_size), spec.tx, seed=0,
                                      mesh=mesh)
    shardings = tree_shardings(state, mesh)
    spec = build_optimizer(config, params=shardings.params)  # as the loop does
    step = make_train_step(model, spec, mesh=mesh, state_shardings=shardings)
    return mesh, state, step, spec, vocab_size


def random_batches(config, steps, vocab_size):
    """`steps` random (x, y) token batches, shaped as the step takes them."""
    rng = np.random.default_rng(0)
    shape = (config.data.grad_accum, config.data.batch_size, config.model.block_size)
    return [rng.integers(0, vocab_size, (2, *shape)).astype(np.int32) for _ in range(steps)]


def permute_rows(xy, seed, replicas=1):
    """A step's batch ``(2, A, B, T)`` with each micro-batch's rows in another order (within
    each DiLoCo replica's block of ``B / replicas`` rows): the same mean loss and gradients,
    summed in another order."""
    blocks = xy.reshape(*xy.shape[:2], replicas, -1, xy.shape[-1])
    order = np.random.default_rng(seed).permutation(blocks.shape[3])
    return blocks[:, :, :, order].reshape(xy.shape)


#: The loss scale of `rounded_otherwise`: not a power of two, so every value derived from
#: the gradient rounds (to float32, and to bf16 in Newton-Schulz) otherwise.
LOSS_SCALE = 1 + 3 * 2**-10
#: Recipes whose step depends on the gradient's scale (K-FAC's damping): their peer is
#: the batch rows permuted only.
SCALE_DEPENDENT = frozenset({"kfac", "snoo_kfac"})


@contextlib.contextmanager
def rounded_otherwise(scale=LOSS_SCALE):
    """Inside, the trainer differentiates its mean cross-entropy times `scale`. Muon's
    Newton-Schulz normalises its input and Adam divides by its second moment's root, so
    their steps are the same for a scaled loss (Adam's eps aside, 1e-8 against the
    gradients' ~1e-3), while every rounding moves: with the rows permuted, the peer of a
    program that computes the same step in another order (another blocking of the bf16
    Newton-Schulz products among them, which permuted rows alone leave unchanged: their
    float32 differences rarely move a bf16 rounding)."""
    import train.kfac_trainer
    import train.step

    plain = train.step.cross_entropy
    scaled = lambda logits_BTV, targets_BT: plain(logits_BTV, targets_BT) * scale
    with contextlib.ExitStack() as stack:
        for module in (train.step, train.kfac_trainer):
            stack.enter_context(_setattr(module, "cross_entropy", scaled))
        yield


@contextlib.contextmanager
def _setattr(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def peer_steps(config, steps=None, **kw):
    """`train_steps` of the same computation with its roundings moved: each batch's rows
    permuted and, unless the recipe is `SCALE_DEPENDENT`, the loss scaled
    (`rounded_otherwise`). Its distance from `config`'s own run bounds (x4, references.
    error.bound) another program's of that run where no float64 run exists (bf16
    Newton-Schulz, a run over several processes)."""
    name = config.optimizer.name
    with contextlib.nullcontext() if name in SCALE_DEPENDENT else rounded_otherwise():
        return train_steps(config, steps, shuffle=True, **kw)


def train_steps(config, steps=None, *, batches=None, hinted=True, shuffle=False,
                on_host=True, history=False):
    """The jitted step of `config` (`step_setup`) over `batches` (default `steps` of
    `random_batches`, each reshaped to the config's micro-batches): each step's float
    metrics (``loss``, ``grad_norm``) as arrays over the steps, and the final state on
    the host (on its devices unless `on_host`). `hinted`: pass the optimizer's static
    hints (else its in-jit choices);
    `shuffle`: each batch's rows permuted (`permute_rows`), the peer of a program that
    sums the same rows in another order. `history`: the metrics also hold ``params``,
    the list of the params (on the host) after each step."""
    mesh, state, step, spec, vocab_size = step_setup(config)
    if batches is None:
        batches = random_batches(config, steps, vocab_size)
    put = lambda x: put_batch(x, batch_sharding(mesh))
    metrics = {"loss": [], "grad_norm": []}
    params = []
    for t, xy in enumerate(batches):
        xy = xy.reshape(2, config.data.grad_accum, config.data.batch_size, -1)
        if shuffle:
            xy = permute_rows(xy, t, config.mesh.diloco)
        state, out = step(state, put(xy[0]), put(xy[1]),
                          **(spec.update_kwargs(t) if hinted else {}))
        for name, values in metrics.items():
            values.append(np.asarray(out[name]))
        if history:
            params.append(jax.device_get(state.params))
    metrics = {k: np.stack(v) for k, v in metrics.items()}
    if history:
        metrics["params"] = params
    return metrics, jax.device_get(state) if on_host else state


def float64_train_steps(config, steps=None, **kw):
    """`train_steps` of `config` with every model dtype float64, under jax's x64 (inside
    only): the computation its float32 runs round, with the optimizer in float64 where
    its state follows the params (K-FAC's factors and SkewAdam's momentum stay float32:
    one float32 rounding of that state a step, as in every float32 run)."""
    with in_float64():
        return float64(train_steps(tc.override(config, **FLOAT64_DTYPES), steps, **kw))


def tiny_in(corpus, out_dir, **overrides) -> tc.TrainConfig:
    """`tiny`'s run in `out_dir` itself, without `vocab_multiple` (test_faults')."""
    base = dict(
        n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        max_iters=8, eval_interval=4, eval_iters=2, log_interval=1, checkpoint_every=4,
        mesh_data=1, num_samples=0, progress=False, data=str(corpus), out_dir=str(out_dir))
    return _with(base, overrides)


def tiny_adamw(corpus, tmp_path, **values):
    """An AdamW run of a 1-layer GPT 16 wide in `tmp_path / "run"` (test_train_optimizers')."""
    return override(tc.TrainConfig(), **{
        "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "batch_size": 4,
        "dtype": "float32", "mesh_data": 1, "optimizer": "adamw", "data": str(corpus),
        "out_dir": str(tmp_path / "run"), **values})


def model_setup(config, vocab_size=32):
    """The mesh, model, state and jitted step for `config` at `vocab_size`."""
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, vocab_size), spec.tx, seed=0,
                                      mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh))
    return mesh, model, state, step


def nanogpt_char_folder(tmp_path: Path, text: str) -> Path:
    """What nanoGPT's data/shakespeare_char/prepare.py writes: its steps, not its code."""
    folder = tmp_path / "shakespeare_char"
    folder.mkdir()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    for name, part in (("train", text[:int(n * 0.9)]), ("val", text[int(n * 0.9):])):
        np.array([stoi[c] for c in part], np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return folder
