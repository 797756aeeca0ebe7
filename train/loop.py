"""The training loop, `run(config)`, read top to bottom like nanoGPT's train.py.

Per step: (the learning-rate schedule lives in the optimizer) -> evaluate and checkpoint
-> forward/backward over the micro-batches -> clip -> update -> log. Outputs go to
`out_dir`: `config.json`, `metrics.jsonl`, `checkpoints/`, `loss.png`, `samples.txt`.

Example:
  >>> from train.config import get_preset
  >>> import dataclasses
  >>> config = dataclasses.replace(get_preset("shakespeare_char_cpu"), max_iters=20)
  >>> result = run(config)  # doctest: +SKIP
  >>> result.final["val_loss"]  # doctest: +SKIP

References:
  Karpathy, "nanoGPT" (train.py), https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

from optax_snoo import snoo_is_sync_step
from train import kfac_trainer
from train.checkpoint import Checkpointer, check_compatible
from train.config import TrainConfig, config_to_dict, model_config
from train.data import CharDataset
from train.metrics import MetricsLog, flops_per_token, peak_flops_per_device, plot_losses
from train.optimizers import build_optimizer, learning_rate_schedule, needs_curvature
from train.sample import generate_text
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_eval_step, make_train_step

__all__ = ["RunResult", "run"]


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the last metrics, every logged line, and where outputs went."""

    final: dict[str, Any]
    history: list[dict[str, Any]]
    out_dir: Path


def _start(config: TrainConfig, ckpt: Checkpointer, state: Any, data: CharDataset):
    """Restore the latest checkpoint for `--resume` (checking it fits), else step 0."""
    latest = ckpt.latest_step()
    if not config.resume:
        if latest is not None:
            raise FileExistsError(f"{ckpt.directory} already holds checkpoints (latest step "
                                  f"{latest}); pass --resume to continue or choose another "
                                  "--out_dir")
        return state, 0
    if latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory}")
    meta = ckpt.restore_meta(latest)
    check_compatible(meta["config"], config_to_dict(config), where=str(ckpt.directory))
    if meta["vocab"] != data.chars:
        raise ValueError(f"cannot resume from {ckpt.directory}: the corpus vocabulary differs "
                         f"({len(meta['vocab'])} vs {len(data.chars)} characters)")
    state, _ = ckpt.restore(latest, like=state)
    return state, latest


def run(config: TrainConfig) -> RunResult:
    """Train `config` and return the final metrics and the logged history."""
    t_start, out = time.perf_counter(), Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = CharDataset.load(config.data)
    gpt_config = model_config(config, data.vocab_size)
    tx, snoo_k = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(gpt_config, tx, seed=config.seed, mesh=mesh)
    shardings = tree_shardings(state, mesh)
    ckpt = Checkpointer(out / "checkpoints")
    state, start = _start(config, ckpt, state, data)
    (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
    put = lambda x: put_batch(x, batch_sharding(mesh))
    step_kwargs = dict(mesh=mesh, state_shardings=shardings,
                       lr_schedule=learning_rate_schedule(config), snoo=snoo_k is not None)
    events = None
    if needs_curvature(config):  # K-FAC: statistics from the step, refresh events
        train_step, state, events = kfac_trainer.setup(config, model, tx, state, data,
                                                       start=start, put=put, out=out,
                                                       **step_kwargs)
    else:
        train_step = make_train_step(model, tx, **step_kwargs)
    eval_step = make_eval_step(model, mesh=mesh, params_shardings=shardings["params"])
    evals = {split: [put(a) for a in data.eval_batches(
        split, num_batches=config.eval_iters, batch_size=config.batch_size,
        block_size=config.block_size, seed=config.seed)] for split in ("train", "val")}
    log = MetricsLog(out / "metrics.jsonl", append=config.resume)
    tokens_per_step = config.batch_size * config.grad_accum * config.block_size
    peak = peak_flops_per_device(jax.devices()[0].device_kind)
    flops = flops_per_token(state["params"], gpt_config) * tokens_per_step
    meta = {"config": config_to_dict(config), "vocab": data.chars, "seed": config.seed}
    bar = tqdm(total=config.max_iters, initial=start, disable=not config.progress,
               dynamic_ncols=True)
    rates, mfu, best_val, t_last, steps_since = [], None, float("inf"), time.perf_counter(), 0
    for step in range(start, config.max_iters + 1):
        last = step == config.max_iters
        # evaluate and checkpoint (not again at the step a resumed run starts from)
        save = step > start and (step % config.checkpoint_every == 0 or last)
        if (step > start or not config.resume) and (step % config.eval_interval == 0 or save
                                                    or last):
            losses = {s: float(eval_step(state["params"], *evals[s])) for s in evals}
            best_val = min(best_val, losses["val"])
            log.write(step=step, train_loss=losses["train"], val_loss=losses["val"])
            speed = "" if not rates else (
                f", {rates[-1]:,.0f} tokens/s, MFU " + (f"{mfu:.1%}" if mfu else "n/a"))
            bar.write(f"step {step}: train loss {losses['train']:.4f}, val loss "
                      f"{losses['val']:.4f}{speed}")
            if save:
                ckpt.save(step, state, {**meta, "step": step, "val_loss": losses["val"]},
                          val_loss=losses["val"])
            t_last, steps_since = time.perf_counter(), 0
        if last:
            break
        # forward/backward over grad_accum micro-batches -> clip -> update (one jitted call)
        inputs_ABT, targets_ABT = data.batch("train", step, batch_size=config.batch_size,
                                             block_size=config.block_size,
                                             grad_accum=config.grad_accum, seed=config.seed)
        sync = None if snoo_k is None else snoo_is_sync_step(step, snoo_k)
        state, metrics = train_step(state, put(inputs_ABT), put(targets_ABT), sync)
        steps_since += 1
        bar.update()
        if events is not None:  # K-FAC refresh events: kept on device, read when logging
            events.add(metrics.pop("kfac_event"))
        # log (the only host sync outside evaluations)
        if (step + 1) % config.log_interval == 0 or step + 1 == config.max_iters:
            if events is not None:
                events.flush()
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            rate = steps_since * tokens_per_step / (now - t_last)
            rates.append(rate)
            mfu = rate * flops / tokens_per_step / (peak * mesh.size) if peak else None
            log.write(step=step + 1, **metrics, tokens_per_sec=rate, mfu=mfu)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{rate:,.0f}")
            t_last, steps_since = now, 0
    bar.close()
    ckpt.close()
    if events is not None:
        kfac_trainer.finish(config, events, out)
    result = _finish(config, model, state, data, log, rates, best_val, out)
    result.final["wall_s"] = time.perf_counter() - t_start
    return result


def _finish(config, model, state, data, log, rates, best_val, out) -> RunResult:
    """Write loss.png and samples.txt; summarise the run."""
    plot_losses(log.history, out / "loss.png")
    if config.num_samples > 0:
        texts = generate_text(model.merge(state["params"]), data, start=config.sample_start,
                              num_samples=config.num_samples,
                              max_new_tokens=config.sample_tokens,
                              temperature=config.temperature, top_k=config.sample_top_k,
                              seed=config.seed)
        (out / "samples.txt").write_text("\n---------------\n".join(texts) + "\n")
    evals = [h for h in log.history if "val_loss" in h]
    steady = rates[1:] or rates  # the first interval includes compilation
    final = {"step": config.max_iters, "best_val_loss": best_val,
             "train_loss": evals[-1]["train_loss"] if evals else None,
             "val_loss": evals[-1]["val_loss"] if evals else None,
             "tokens_per_sec": statistics.median(steady) if steady else None}
    mfus = [h["mfu"] for h in log.history if h.get("mfu") is not None]
    final["mfu"] = statistics.median(mfus[1:] or mfus) if mfus else "n/a"
    return RunResult(final, log.history, out)
