"""The training loop, `run(config)`, read top to bottom like nanoGPT's train.py.

`run` is three parts under one `contextlib.ExitStack`: `_setup` (every check that can
fail before anything is written, then the model, state, data and the things to close),
`_train` (the loop), and the teardown the stack does however the run ends. Per step,
`step_actions` (a pure function) says what to do: evaluate and checkpoint -> forward/
backward over the micro-batches -> clip -> update (the learning-rate schedule lives in
the optimizer) -> log. Outputs go to `out_dir`: `config.json`, `metrics.jsonl`,
`checkpoints/`, `loss.png`, `samples.txt`.

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

import contextlib
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from train.checkpoint import Checkpointer, check_compatible, saved_tokenizer
from train.config import (
    RunConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    flat_dict,
    model_config,
)
from train.data import BatchPrefetcher, TokenDataset, open_dataset
from train.errors import one_line
from train.metrics import (
    COMPILING_BAR,
    MetricsLog,
    check_memory,
    check_trackers,
    flops_per_token,
    loss_target,
    open_trackers,
    peak_flops_per_device,
    plot_losses,
    restart_clock,
    run_title,
    show_compiling,
)
from train.nonfinite import check_bad_steps
from train.optimizers import (
    Monitor,
    TrainOptimizer,
    build_optimizer,
    check_optimizer,
)
from train.sharding import (
    batch_sharding,
    check_batch_size,
    make_mesh,
    process_rows,
    put_batch,
    replica_zero,
    tree_shardings,
)
from train.state import TrainState
from train.step import (
    ModelDef,
    TrainStep,
    create_train_state,
    make_eval_step,
    make_readout,
    make_train_step,
    param_shardings,
)
from train.tokenizer import describe_meta, prompt_ids, read_prompt

__all__ = ["RunResult", "StepActions", "eval_due", "run", "run_tokenizer",
           "schedule_change", "step_actions"]


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the last metrics, every logged line, and where outputs went."""

    final: dict[str, Any]
    history: list[dict[str, Any]]
    out_dir: Path


# ---------------------------------------------------------------- what a step does


@dataclasses.dataclass(frozen=True)
class StepActions:
    """What the loop does at a step.

    Attributes:
      evaluate: before the step's update, evaluate (and log both splits' losses).
      save: then write a checkpoint (only with `evaluate`: it stores the val loss).
      log: after the update, log the train metrics (a host sync).
      last: the run ends here, with no update.
    """

    evaluate: bool
    save: bool
    log: bool
    last: bool


def eval_due(step: int, run: RunConfig) -> bool:
    """The evaluation cadence: whether `step` is an evaluation step of its own
    (`RunConfig.is_cadence_step`: every `eval_interval` steps, every `eval_interval_tail`
    in the last `eval_tail_frac` of the run); `step_actions` adds the save steps and the
    last."""
    return run.is_cadence_step(step)


def step_actions(step: int, *, start: int, run: RunConfig,
                 cadence: Callable[[int, RunConfig], bool] = eval_due) -> StepActions:
    """What the loop does at `step` of a run that starts (or resumes) at `start`.

    A checkpoint is saved every `checkpoint_every` steps and at the last step, and every
    save step is evaluated; `cadence(step, run)` adds evaluations between them. The step
    a resumed run starts from was evaluated and saved by the run before: neither again.
    A fresh run evaluates step 0 (and with `max_iters=0` also saves it).
    """
    last = step == run.max_iters
    done_before = run.resume and step == start  # the previous run evaluated and saved it
    save = not done_before and (step > start or last) and (
        step % run.checkpoint_every == 0 or last)
    evaluate = not done_before and (cadence(step, run) or save or last)
    log = not last and ((step + 1) % run.log_interval == 0 or step + 1 == run.max_iters)
    return StepActions(evaluate=evaluate, save=save, log=log, last=last)


def schedule_end(config: TrainConfig) -> int:
    """The step where `config`'s learning-rate schedule reaches its final value (a
    cosine's ``lr_decay_iters`` when set, else ``max_iters``)."""
    decay = config.optimizer.resolved().get("lr_decay_iters")
    return config.run.max_iters if decay is None else decay


def schedule_change(saved: TrainConfig, config: TrainConfig, step: int) -> str | None:
    """A one-line warning when resuming at `step` moves the schedule's end (a new
    `--max_iters` stretches or shrinks it, and every step constant of a record's recipe
    with it), with the logged learning rate's jump; else None."""
    old, new = schedule_end(saved), schedule_end(config)
    if old == new:
        return None
    lr_old = float(build_optimizer(saved).learning_rate(step))
    lr_new = float(build_optimizer(config).learning_rate(step))
    keep = (f"; to keep the first run's end pass --lr_decay_iters={old}"
            if "lr_decay_iters" in config.optimizer.resolved() else "")
    return (f"warning: resuming at step {step} with --max_iters={config.run.max_iters} (the "
            f"checkpoint's run had {saved.run.max_iters}): --optimizer="
            f"{config.optimizer.name}'s schedules now end at step {new}, not {old}, so the "
            f"logged lr at step {step} goes from {lr_old:.4g} to {lr_new:.4g}{keep}")


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class _Run:
    """What the setup builds and the loop and the finish use (closed by `run`'s stack)."""

    config: TrainConfig
    out: Path
    data: TokenDataset
    mesh: Any
    model: ModelDef
    optimizer: TrainOptimizer
    state: TrainState
    start: int
    replica0: Callable[[Any], Any]
    readout: Callable[[TrainState], Any]
    train_step: TrainStep
    eval_step: Callable[..., Any]
    evals: dict[str, Any]
    ckpt: Checkpointer
    log: MetricsLog
    monitor: Monitor
    batches: BatchPrefetcher
    meta: dict[str, Any]
    prompt: str
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None


def run(config: TrainConfig) -> RunResult:
    """Train `config` and return the final metrics and the logged history.

    Whatever ends the run (success, a mistake found at the start, an exception at any
    step, a `KeyboardInterrupt`), the prefetch thread, the progress bar, the trackers and
    the checkpointer are closed on the way out, and the checkpoints already written stay
    intact (a pending write is finished first).
    """
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        r = _setup(config, stack)
        progress = stack.enter_context(_Progress(r))
        state = _train(r, progress)
        r.ckpt.close()  # the last writes on disk (or their error) before the outputs
        r.monitor.finish()
        result = _finish(r, state, progress.rates)
    result.final["wall_s"] = time.perf_counter() - t_start
    return result


def check_accelerator(config: TrainConfig) -> None:
    """Refuse a run that asks for an accelerator (`--require_accelerator`, the GPU-sized
    presets) when every device is a CPU, in one line naming the flag that overrides."""
    if not config.run.require_accelerator or jax.default_backend() != "cpu":
        return
    m, d = config.model, config.data
    tokens = d.batch_size * d.grad_accum * m.block_size
    raise ValueError(
        f"this run is sized for GPUs ({m.n_layer} layers x {m.n_embd}, {tokens:,} tokens a "
        f"step, {config.run.max_iters:,} steps) and this machine's devices are CPUs: use a "
        "CPU preset (shakespeare_char_cpu; Track 3's 2-core twin is --preset=track3_cpu), or "
        "pass --require_accelerator=false to run it here anyway")


def _setup(config: TrainConfig, stack: contextlib.ExitStack) -> _Run:
    """Check everything that can be checked before any work, then build the run; each
    thing that must be closed is entered on `stack`."""
    check_accelerator(config)  # a GPU-sized run on a CPU: before anything is written
    check_optimizer(config)  # a run too short for its recipe
    check_trackers(config.run)  # tensorboardX / wandb installed, if asked for
    mesh = make_mesh(config)
    out = Path(config.run.out_dir)
    _check_writable(out)
    data = open_dataset(config.data.path)  # headers, sizes and ids checked: before compiling
    config = dataclasses.replace(config, model=model_config(config, data.vocab_size))
    prompt = _checked_prompt(config, data)  # a bad --sample_start: now, not after the run
    d, r = config.data, config.run
    # Told where the params will live (Muon's plan); bad optimizer values: here.
    optimizer = build_optimizer(config, params=param_shardings(config.model, mesh))
    check_batch_size(d.batch_size, mesh)  # the last config error: before anything is written
    check_memory(config, config.model, optimizer.replica_tx,  # before any compile
                 list(mesh.devices.flat))
    model, state = create_train_state(config.model, optimizer.replica_tx, seed=r.seed, mesh=mesh)
    shardings = tree_shardings(state, mesh)
    # Evaluation, sampling and the FLOPs count see replica 0 (all of the params without
    # DiLoCo replicas): its fast weights, as a single-replica Snoo run evaluates its own.
    replica0, params0_shardings = replica_zero(shardings.params, mesh)
    params0_shapes = jax.eval_shape(replica0, state.params)
    ckpt = Checkpointer(out / "checkpoints")
    stack.push(_closing(ckpt))
    tokenizer, tokenizer_file = run_tokenizer(data)
    state, start = _start(config, ckpt, state, tokenizer)
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
    stack.callback(log.close)  # the trackers (W&B's run ends here)
    tokens_per_step = d.batch_size * d.grad_accum * config.model.block_size
    return _Run(
        config=config, out=out, data=data, mesh=mesh, model=model, optimizer=optimizer,
        state=state, start=start, replica0=replica0,
        readout=make_readout(state.opt_state),  # the weights the optimizer says to evaluate
        train_step=make_train_step(model, optimizer, mesh=mesh, state_shardings=shardings,
                                   max_bad_steps=r.max_bad_steps,
                                   loss_reduction=config.optimizer.loss_reduction),
        eval_step=make_eval_step(model, mesh=mesh, params_shardings=params0_shardings),
        evals=evals, ckpt=ckpt, log=log, monitor=optimizer.monitor(out, start),
        batches=stack.enter_context(BatchPrefetcher(train_batch, enabled=d.prefetch)),
        meta={"config": config_to_dict(config), "tokenizer": tokenizer,
              "vocab_size": data.vocab_size, "seed": r.seed},
        prompt=prompt, tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_token(params0_shapes, config.model) * tokens_per_step,
        peak_flops=peak_flops_per_device(jax.devices()[0].device_kind))


def _train(r: _Run, progress: _Progress) -> TrainState:
    """The loop: per step, evaluate and checkpoint when due, then one update (forward and
    backward over the micro-batches, clip, update: one jitted call), then log when due."""
    state, run_config = r.state, r.config.run
    for step in range(r.start, run_config.max_iters + 1):
        due = step_actions(step, start=r.start, run=run_config)
        if due.evaluate:
            val_loss = _evaluate(r, state, step, progress)
            if due.save:  # never after max_bad_steps bad steps in a row
                _check_bad_steps(int(state.bad_steps), r.config, step, r.ckpt)
                r.ckpt.save(step, state, {**r.meta, "step": step, "val_loss": val_loss},
                            val_loss=val_loss)
            progress.restart_interval()  # the next rate counts steps only
        if due.last:
            break
        hints = r.optimizer.update_kwargs(step)  # static: Snoo's sync or no-sync step
        with progress.step(hints):
            state, metrics = r.train_step(state, *r.batches.get(step), **hints)
        r.monitor.add(metrics.pop("observed"))  # kept on device, read when logging
        if due.log:  # the only host sync outside evaluations
            _log_train(r, step + 1, metrics, progress)
    return state


def _evaluate(r: _Run, state: TrainState, step: int, progress: _Progress) -> float:
    """Both splits' losses at `step` (replica 0's params), logged; returns the val loss."""
    params0 = r.replica0(r.readout(state))
    losses = {split: float(r.eval_step(params0, *batches)) for split, batches in r.evals.items()}
    r.log.write(step=step, train_loss=losses["train"], val_loss=losses["val"])
    progress.write(f"step {step}: train loss {losses['train']:.4f}, val loss "
                   f"{losses['val']:.4f}{progress.speed()}")
    return losses["val"]


def _log_train(r: _Run, step: int, metrics: dict, progress: _Progress) -> None:
    """Log the train metrics after update `step` (and the throughput since the last log);
    stop on too many bad steps or a failed checkpoint write."""
    r.monitor.flush()
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    rate = progress.interval_rate(r.tokens_per_step)
    mfu = (rate * r.flops_per_step / r.tokens_per_step / (r.peak_flops * r.mesh.size)
           if r.peak_flops else None)
    progress.mfu = mfu
    r.log.write(step=step, **metrics, tokens_per_sec=rate,
                **({} if mfu is None else {"mfu": mfu}))
    progress.note_skipped(step, metrics["skipped_steps"], metrics["bad_steps"])
    _check_bad_steps(int(metrics["bad_steps"]), r.config, step, r.ckpt)
    r.ckpt.check_for_errors()  # a failed asynchronous write stops the run now
    progress.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{rate:,.0f}")


class _Progress:
    """The progress bar (process 0, `--progress`) and the throughput bookkeeping: the
    bar reads "compiling" while a step variant compiles and counts its rate and ETA from
    the end of compilation; the tokens/s of each logging interval."""

    def __init__(self, r: _Run):
        run_config, lead = r.config.run, jax.process_index() == 0
        self.bar = tqdm(total=run_config.max_iters, initial=r.start,
                        disable=not (run_config.progress and lead), dynamic_ncols=True,
                        desc="compiling", bar_format=COMPILING_BAR)
        self.compiled: set = set()  # the train-step variants called so far (Snoo: two)
        self.rates: list[float] = []
        self.mfu: float | None = None
        self.skipped = float(r.state.skipped_steps)
        self.restart_interval()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    @contextlib.contextmanager
    def step(self, hints: dict[str, Any]):
        """Around one train step: a variant's first call compiles, so it gets no rate."""
        variant = tuple(sorted(hints.items()))
        first = variant not in self.compiled
        if first:
            show_compiling(self.bar)
        yield
        self.steps_since += 1
        self.bar.update()
        if first:  # compiled: time from now on
            self.compiled.add(variant)
            restart_clock(self.bar)

    def restart_interval(self) -> None:
        """Time the next interval from now (after an evaluation, or a log)."""
        self.t_last, self.steps_since = time.perf_counter(), 0

    def interval_rate(self, tokens_per_step: int) -> float:
        """Tokens/s since the last interval began (kept in `rates`); a new one begins."""
        rate = self.steps_since * tokens_per_step / (time.perf_counter() - self.t_last)
        self.rates.append(rate)
        self.restart_interval()
        return rate

    def speed(self) -> str:
        """`", N tokens/s, MFU x%"` of the last interval, or `""` before the first."""
        if not self.rates:
            return ""
        mfu = f", MFU {self.mfu:.1%}" if self.mfu is not None else ""
        return f", {self.rates[-1]:,.0f} tokens/s{mfu}"

    def note_skipped(self, step: int, skipped: float, bad_steps: float) -> None:
        """Say when steps were skipped (a non-finite loss or gradient) since the last log."""
        if skipped > self.skipped:
            self.skipped = skipped
            self.write(f"step {step}: skipped {skipped:.0f} step(s) with a non-finite loss "
                       f"or gradient so far ({bad_steps:.0f} in a row)")

    def write(self, line: str) -> None:
        self.bar.write(line)

    def set_postfix(self, **values: str) -> None:
        self.bar.set_postfix(**values)


def _closing(ckpt: Checkpointer) -> Callable[..., bool]:
    """The exit of `ckpt` for an `ExitStack`: close it (pending writes finished first). On
    the way out of an error, an error of the close itself is not raised over it."""
    def exit_(exc_type, exc, tb) -> bool:
        if exc_type is None:
            ckpt.close()
        else:
            with contextlib.suppress(Exception):
                ckpt.close()
        return False

    return exit_


def _checked_prompt(config: TrainConfig, data: TokenDataset) -> str:
    """`--sample_start`'s text (a `FILE:` read), checked against the vocabulary now, so a
    bad prompt stops the run before its first step rather than after its last."""
    s = config.sample
    if s.num_samples == 0:
        return s.start
    prompt = read_prompt(s.start, flag="--sample_start")
    try:
        tokenizer = data.tokenizer
    except OSError:  # e.g. GPT-2's encoding offline: `_finish` says so, the run goes on
        return prompt
    prompt_ids(tokenizer, prompt, flag="--sample_start")
    return prompt


def _start(config: TrainConfig, ckpt: Checkpointer, state: TrainState, tokenizer: dict
           ) -> tuple[TrainState, int]:
    """Restore the newest readable checkpoint for `--resume` (checking it fits), else step 0.

    A damaged newer checkpoint is set aside with a warning (`Checkpointer.restore_latest`);
    the metrics log is cut back to the restored step, so it reads as one run. A resume
    that moves the schedule's end (a new `--max_iters`) says so in one line.
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

    state, meta, step = ckpt.restore_latest(like=state, check=check)
    warning = schedule_change(config_from_dict(meta["config"]), config, step)
    if warning is not None and jax.process_index() == 0:
        print(warning, file=sys.stderr, flush=True)
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


def _check_bad_steps(bad_steps: int, config: TrainConfig, step: int, ckpt: Checkpointer):
    """Stop (pending checkpoint writes finished first) after too many bad steps in a row."""
    if bad_steps >= config.run.max_bad_steps:
        ckpt.wait()
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


def _finish(r: _Run, state: TrainState, rates: list[float]) -> RunResult:
    """Write loss.png and samples.txt (process 0, sampled from replica 0's params);
    summarise the run (all of it, across resumes: the metrics log's earlier lines count
    too)."""
    from train.sample import generate_text  # here: `python -m train.sample` runs cleanly

    config, out, log = r.config, r.out, r.log
    params = r.replica0(r.readout(state))
    lead = jax.process_index() == 0
    whole = log.whole_run
    if lead:
        plot_losses(whole, out / "loss.png", title=run_title(config),
                    target=loss_target(config, r.data.vocab_size))
    s = config.sample
    if s.num_samples > 0 and jax.process_count() > 1:  # whole arrays on every host
        params = multihost_utils.process_allgather(params, tiled=True)
    if s.num_samples > 0 and lead:
        try:
            tokenizer = r.data.tokenizer
        except OSError as err:  # e.g. GPT-2's encoding offline: the run itself is done
            print(f"warning: no samples.txt: {one_line(str(err))}", file=sys.stderr)
        else:
            texts = generate_text(r.model.merge(params), tokenizer, r.data.vocab_size,
                                  start=r.prompt, num_samples=s.num_samples,
                                  max_new_tokens=s.max_new_tokens, temperature=s.temperature,
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
