"""The training loop, `run(config)`, read top to bottom like nanoGPT's train.py.

Per step: (the learning-rate schedule lives in the optimizer) -> evaluate and checkpoint
-> forward/backward over the micro-batches -> clip -> update -> log. Outputs go to
`out_dir`: `config.json`, `metrics.jsonl`, `checkpoints/`, `loss.png`, `samples.txt`.

With several processes (`jax.distributed`, see `train.__main__`) every process runs this
same loop on the global mesh and feeds only its own rows of each batch; checkpoints are
written collectively; process 0 alone writes the other outputs and shows progress.

Example:
  >>> from train.config import get_preset, override
  >>> config = override(get_preset("shakespeare_char_cpu"), max_iters=20)
  >>> result = run(config)  # doctest: +SKIP
  >>> result.final["val_loss"]  # doctest: +SKIP

References:
  Karpathy, "nanoGPT" (train.py), https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from train.checkpoint import Checkpointer, check_compatible, saved_tokenizer
from train.config import TrainConfig, config_to_dict, flat_dict, model_config
from train.data import BatchPrefetcher, TokenDataset, open_dataset
from train.errors import one_line
from train.metrics import (
    COMPILING_BAR,
    MetricsLog,
    check_memory,
    check_trackers,
    flops_per_token,
    open_trackers,
    peak_flops_per_device,
    plot_losses,
    restart_clock,
    run_title,
    show_compiling,
)
from train.nonfinite import check_bad_steps
from train.optimizers import build_optimizer
from train.sharding import (
    batch_sharding,
    make_mesh,
    process_rows,
    put_batch,
    replica_zero,
    tree_shardings,
)
from train.step import create_train_state, make_eval_step, make_readout, make_train_step
from train.tokenizer import describe_meta

__all__ = ["RunResult", "run", "run_tokenizer"]


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the last metrics, every logged line, and where outputs went."""

    final: dict[str, Any]
    history: list[dict[str, Any]]
    out_dir: Path


def _start(config: TrainConfig, ckpt: Checkpointer, state: Any, tokenizer: dict):
    """Restore the newest readable checkpoint for `--resume` (checking it fits), else step 0.

    A damaged newer checkpoint is set aside with a warning (`Checkpointer.restore_latest`);
    the metrics log is cut back to the restored step, so it reads as one run.
    """
    latest = ckpt.latest_step()
    if not config.run.resume:
        if latest is not None:
            raise FileExistsError(f"--out_dir={config.run.out_dir!r} already holds a run "
                                  f"(checkpoints up to step {latest} in {ckpt.directory}); "
                                  "pass --resume to continue it or choose another --out_dir")
        return state, 0
    if latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory} "
                                f"(--out_dir={config.run.out_dir!r}); run without --resume to "
                                "start")

    def check(meta):
        check_compatible(flat_dict(meta["config"]), flat_dict(config), where=str(ckpt.directory))
        saved_replicas = flat_dict(meta["config"]).get("mesh_diloco", 1)
        if saved_replicas != config.mesh.diloco:  # the state's replica axis has this size
            raise ValueError(f"cannot resume from {ckpt.directory}: it trained "
                             f"--mesh_diloco={saved_replicas} replicas, this run asks for "
                             f"--mesh_diloco={config.mesh.diloco}")
        saved = saved_tokenizer(meta)
        if saved != tokenizer:
            raise ValueError(f"cannot resume from {ckpt.directory}: its data's tokenizer "
                             f"({describe_meta(saved)}) is not this --data's "
                             f"({describe_meta(tokenizer)})")

    state, _, step = ckpt.restore_latest(like=state, check=check)
    log = Path(config.run.out_dir) / "metrics.jsonl"
    if log.exists() and jax.process_index() == 0:  # drop what a killed run logged after it
        lines = log.read_text().splitlines()
        log.write_text("".join(x + "\n" for x in lines if json.loads(x)["step"] <= step))
    return state, step


def _check_writable(out: Path) -> None:
    """Fail before any work if `out` (and its checkpoints folder) cannot be written.

    Creates nothing, so a start that fails later leaves `out` as it was: a probe file comes
    and goes in the deepest folder of `out/checkpoints` that exists.
    """
    folder = out / "checkpoints"
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
        probe = folder / f".write-test-{jax.process_index()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise type(err)(err.errno, f"--out_dir={str(out)!r} is not writable ({err.strerror}: "
                        f"{err.filename}); nothing was trained. Choose another --out_dir "
                        "or fix its permissions.") from None


def run(config: TrainConfig) -> RunResult:
    """Train `config` and return the final metrics and the logged history."""
    t_start, out = time.perf_counter(), Path(config.run.out_dir)
    optimizer = build_optimizer(config)  # an unknown name or bad values: before any work
    check_trackers(config.run)  # tensorboardX / wandb installed, if asked for
    _check_writable(out)
    data = open_dataset(config.data.path)  # headers, sizes and ids checked: before compiling
    config = dataclasses.replace(config, model=model_config(config, data.vocab_size))
    d, r = config.data, config.run
    mesh = make_mesh(config)
    check_memory(config, config.model, optimizer.replica_tx,  # before any compile
                 list(mesh.devices.flat))
    model, state = create_train_state(config.model, optimizer.replica_tx, seed=r.seed, mesh=mesh)
    shardings = tree_shardings(state, mesh)
    # Evaluation, sampling and the FLOPs count see replica 0 (all of the params without
    # DiLoCo replicas): its fast weights, as a single-replica Snoo run evaluates its own.
    replica0, params0_shardings = replica_zero(shardings["params"], mesh)
    params0_shapes = jax.eval_shape(replica0, state["params"])
    optimizer = build_optimizer(config, params=shardings["params"])  # Muon's plan: same state
    ckpt = Checkpointer(out / "checkpoints")
    try:
        tokenizer, tokenizer_file = run_tokenizer(data)
        state, start = _start(config, ckpt, state, tokenizer)
    except BaseException:
        ckpt.close()  # a refused start: nothing pending, but Orbax's clean-up must end
        raise
    lead = jax.process_index() == 0
    if lead:
        print(_startup_line(config, params0_shapes, mesh, start, data), flush=True)
        out.mkdir(parents=True, exist_ok=True)  # the first output: the start succeeded
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
    rows = process_rows(batch_sharding(mesh), d.batch_size)  # this process's slice
    put = lambda x: put_batch(x, batch_sharding(mesh), d.batch_size)

    def train_batch(step, grad_accum=d.grad_accum):  # only this process's rows are read
        shape = dict(batch_size=d.batch_size, block_size=config.model.block_size,
                     grad_accum=grad_accum, rows=rows)
        inputs_ABT, targets_ABT = (data.sequential_batch("train", step, **shape)
                                   if d.order == "sequential" else
                                   data.batch("train", step, seed=r.seed, **shape))
        return put(inputs_ABT), put(targets_ABT)

    state = optimizer.prepare(state, model=model, mesh=mesh, shardings=shardings,
                              batch=train_batch, start=start)
    monitor = optimizer.monitor(out, start)
    train_step = make_train_step(model, optimizer, mesh=mesh, state_shardings=shardings,
                                 max_bad_steps=r.max_bad_steps,
                                 loss_reduction=config.optimizer.loss_reduction)
    eval_step = make_eval_step(model, mesh=mesh, params_shardings=params0_shardings)
    readout = make_readout(state["opt_state"])  # the weights the optimizer says to evaluate
    evals = {split: [put(a) for a in data.eval_batches(
        split, num_batches=r.eval_iters, batch_size=d.batch_size,
        block_size=config.model.block_size, seed=r.seed, rows=rows)]
        for split in ("train", "val")}
    if r.val_tokens is not None:  # the split's first val_tokens, as modded-nanogpt's Track 3
        evals["val"] = [put(a) for a in data.first_windows(
            "val", num_tokens=r.val_tokens, batch_size=d.batch_size,
            block_size=config.model.block_size, rows=rows)]
    log = MetricsLog(out / "metrics.jsonl" if lead else os.devnull, append=r.resume,
                     trackers=open_trackers(config, out, start=start) if lead else ())
    tokens_per_step = d.batch_size * d.grad_accum * config.model.block_size
    peak = peak_flops_per_device(jax.devices()[0].device_kind)
    flops = flops_per_token(params0_shapes, config.model) * tokens_per_step
    meta = {"config": config_to_dict(config), "tokenizer": tokenizer,
            "vocab_size": data.vocab_size, "seed": r.seed}
    batches = BatchPrefetcher(train_batch, enabled=d.prefetch)  # the next step's, meanwhile
    # The bar's rate and ETA count from the end of compilation (restart_clock).
    bar = tqdm(total=r.max_iters, initial=start, disable=not (r.progress and lead),
               dynamic_ncols=True, desc="compiling", bar_format=COMPILING_BAR)
    compiled = set()  # the train-step variants called so far (Snoo: sync and no-sync)
    rates, mfu, t_last, steps_since = [], None, time.perf_counter(), 0
    skipped = float(state["skipped_steps"])
    for step in range(start, r.max_iters + 1):
        is_last_step = step == r.max_iters
        # evaluate and checkpoint (not again at the step a resumed run starts from)
        # (the last step always; also step 0 of a fresh run with max_iters=0)
        is_save_step = (step > start or (is_last_step and not r.resume)) and (
            step % r.checkpoint_every == 0 or is_last_step)
        is_eval_step = (step > start or not r.resume) and (
            r.is_cadence_step(step) or is_save_step)
        if is_eval_step:
            params0 = replica0(readout(state))
            losses = {s: float(eval_step(params0, *evals[s])) for s in evals}
            log.write(step=step, train_loss=losses["train"], val_loss=losses["val"])
            speed = "" if not rates else f", {rates[-1]:,.0f} tokens/s" + (
                f", MFU {mfu:.1%}" if mfu is not None else "")
            bar.write(f"step {step}: train loss {losses['train']:.4f}, val loss "
                      f"{losses['val']:.4f}{speed}")
            if is_save_step:  # never after max_bad_steps bad steps in a row
                _check_bad_steps(int(state["bad_steps"]), config, step, ckpt)
                ckpt.save(step, state, {**meta, "step": step, "val_loss": losses["val"]},
                          val_loss=losses["val"])
            t_last, steps_since = time.perf_counter(), 0
        if is_last_step:
            break
        step_kwargs = optimizer.update_kwargs(step)  # static: Snoo's sync or no-sync step
        variant = tuple(sorted(step_kwargs.items()))
        if variant not in compiled:  # this call compiles its variant: no rate or ETA
            show_compiling(bar)
        # forward/backward over grad_accum micro-batches -> clip -> update (one jitted call)
        state, metrics = train_step(state, *batches.get(step), **step_kwargs)
        steps_since += 1
        bar.update()
        if variant not in compiled:  # this call compiled its variant: time from now on
            compiled.add(variant)
            restart_clock(bar)
        monitor.add(metrics.pop("observed"))  # kept on device, read when logging
        # log (the only host sync outside evaluations)
        if (step + 1) % r.log_interval == 0 or step + 1 == r.max_iters:
            monitor.flush()
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            rate = steps_since * tokens_per_step / (now - t_last)
            rates.append(rate)
            mfu = rate * flops / tokens_per_step / (peak * mesh.size) if peak else None
            log.write(step=step + 1, **metrics, tokens_per_sec=rate,
                      **({} if mfu is None else {"mfu": mfu}))
            if metrics["skipped_steps"] > skipped:
                skipped = metrics["skipped_steps"]
                bar.write(f"step {step + 1}: skipped {skipped:.0f} step(s) with a non-finite "
                          f"loss or gradient so far ({metrics['bad_steps']:.0f} in a row)")
            _check_bad_steps(int(metrics["bad_steps"]), config, step + 1, ckpt)
            ckpt.check_for_errors()  # a failed asynchronous write stops the run now
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{rate:,.0f}")
            t_last, steps_since = now, 0
    bar.close()
    batches.close()
    ckpt.close()
    monitor.finish()
    result = _finish(config, model, replica0(readout(state)), data, log, rates, out)
    log.close()  # the trackers (W&B's run ends here)
    result.final["wall_s"] = time.perf_counter() - t_start
    return result


def _check_bad_steps(bad_steps: int, config: TrainConfig, step: int, ckpt: Checkpointer):
    """Stop (pending checkpoint writes finished first) after too many bad steps in a row."""
    if bad_steps >= config.run.max_bad_steps:
        ckpt.close()
        check_bad_steps(bad_steps, max_bad_steps=config.run.max_bad_steps, step=step,
                        checkpoints=ckpt.steps())


def _startup_line(config: TrainConfig, params: Any, mesh: Any, start: int,
                  data: TokenDataset) -> str:
    """One line: model size (one replica's `params`), attention, optimizer, devices and
    mesh, the data, out_dir (and the resumed step)."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    devices = mesh.devices.flat[0]
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    resumed = f"; resuming at step {start}" if config.run.resume else ""
    m = config.model
    padded = f" (padded to {m.vocab_size:,})" if m.vocab_size != data.vocab_size else ""
    why = " (QK-clip reads its max logits)" if config.optimizer.qk_clip_tau > 0 else ""
    return (f"train: {n / 1e6:.2f}M parameters (n_layer={m.n_layer}, n_embd={m.n_embd}, "
            f"block_size={m.block_size}), attention {m.attention}{why}, "
            f"optimizer {config.optimizer.name}, "
            f"{mesh.size} {devices.platform} device(s) ({devices.device_kind}), mesh {axes}; "
            f"data: {data.describe()}{padded}; out_dir {config.run.out_dir}{resumed}")


def run_tokenizer(data: TokenDataset) -> tuple[dict[str, Any], Path | None]:
    """The tokenizer description a checkpoint stores, and the `tokenizer.json` to copy into
    the run's folder (named there relative to it, so the run samples without its data)."""
    meta = dict(data.tokenizer_meta)
    if meta.get("kind") != "huggingface":
        return meta, None
    source = Path(meta["file"])
    source = source if source.is_absolute() or data.root is None else data.root / source
    digest = hashlib.sha256(source.read_bytes()).hexdigest()  # a resume checks the same file
    return {**meta, "file": "tokenizer.json", "sha256": digest}, source


def _finish(config, model, params, data, log, rates, out) -> RunResult:
    """Write loss.png and samples.txt (process 0, sampled from `params`: replica 0's);
    summarise the run (all of it, across resumes: the metrics log's earlier lines count
    too)."""
    from train.sample import generate_text  # here: `python -m train.sample` runs cleanly

    lead = jax.process_index() == 0
    whole = log.whole_run
    if lead:
        plot_losses(whole, out / "loss.png", title=run_title(config))
    s = config.sample
    if s.num_samples > 0 and jax.process_count() > 1:  # whole arrays on every host
        params = multihost_utils.process_allgather(params, tiled=True)
    if s.num_samples > 0 and lead:
        try:
            tokenizer = data.tokenizer
        except OSError as err:  # e.g. GPT-2's encoding offline: the run itself is done
            print(f"warning: no samples.txt: {one_line(str(err))}", file=sys.stderr)
        else:
            texts = generate_text(model.merge(params), tokenizer, data.vocab_size,
                                  start=s.start, num_samples=s.num_samples,
                                  max_new_tokens=s.tokens, temperature=s.temperature,
                                  top_k=s.top_k, seed=config.run.seed)
            (out / "samples.txt").write_text("\n---------------\n".join(texts) + "\n")
    evals = [h for h in whole if "val_loss" in h]
    steady = rates[1:] or rates  # the first interval includes compilation
    final = {"step": config.run.max_iters,
             "best_val_loss": min((h["val_loss"] for h in evals), default=None),
             "train_loss": evals[-1]["train_loss"] if evals else None,
             "val_loss": evals[-1]["val_loss"] if evals else None,
             "tokens_per_sec": statistics.median(steady) if steady else None}
    mfus = [h["mfu"] for h in log.history if h.get("mfu") is not None]
    final["mfu"] = statistics.median(mfus[1:] or mfus) if mfus else None
    return RunResult(final, log.history, out)
