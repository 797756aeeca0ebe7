"""Run metrics: the JSON-lines logs (metrics and its trackers, K-FAC refresh events),
throughput and MFU, the progress bar, the plots (losses, refreshes on the learning-rate
curve), a memory check.

MFU follows nanoGPT: FLOPs per token `6N + 12·L·H·Q·T` (N = parameters without the
position table, MoE experts counted at `top_k / n_experts`), divided by the peak bf16
FLOP/s of the devices (a small table by device kind; none for CPUs, where MFU is left
out of the log and the output).

`check_memory` refuses, before anything is compiled, a step whose memory cannot fit:
a lower bound (parameters, optimizer state, gradients, the residual stream saved for the
backward pass, one attention-score and one logits tensor) against the devices' memory.

Every line of the log can also go to experiment trackers (`--tensorboard`,
`--wandb_project`): its numeric values, tagged `train/<key>` (`train/loss`, `train/lr`,
`train/tokens_per_sec`...) or `eval/<key>` for the evaluations (`eval/train_loss`,
`eval/val_loss`), at the line's step. Process 0 alone opens them (`open_trackers`).

The loss plot draws a benchmark's target where the run is that benchmark's task
(`loss_target`): modded-nanogpt Track 3's mean val loss 3.28 for the `track3` preset's
network and validation on GPT-2 tokens, whatever the optimizer and step count.

Example:
  >>> peak_flops_per_device("NVIDIA H100 80GB HBM3")
  989000000000000.0
  >>> peak_flops_per_device("cpu") is None
  True

References:
  Karpathy, "nanoGPT" (model.py estimate_mfu), https://github.com/karpathy/nanoGPT, 2023.
  Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (appendix B, MFU),
  https://arxiv.org/abs/2204.02311, 2022.
  TensorBoard, "Event file format" (`tensorboard/compat/proto/event.proto`),
  https://github.com/tensorflow/tensorboard, 2017-; T. Huang, "tensorboardX",
  https://github.com/lanpa/tensorboardX, 2017-.
  Weights & Biases, "wandb.init" and "Resume a run", https://docs.wandb.ai/guides/runs/,
  2024.
  Jordan et al., modded-nanogpt Track 3 (optimization), README (the 3.28 target),
  https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
  2026.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from optax_snoo.kfac import refresh_events
from train.data import GPT2_VOCAB_SIZE
from train.optimizers import Monitor

__all__ = [
    "COMPILING_BAR",
    "EVAL_TAGS",
    "LOSS_TARGETS",
    "PEAK_FLOPS",
    "TASK_KEYS",
    "LossTarget",
    "MetricsLog",
    "RefreshLog",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "available_memory",
    "check_memory",
    "check_trackers",
    "flops_per_token",
    "loss_target",
    "open_trackers",
    "peak_flops_per_device",
    "plot_losses",
    "plot_refresh_events",
    "restart_clock",
    "run_name",
    "run_title",
    "show_compiling",
    "step_memory_bytes",
    "tracker_scalars",
]

# Dense bf16 tensor-core peaks per device (vendor data sheets); matched as substrings of
# `jax.Device.device_kind`, first match wins.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10", 125e12), ("V100", 125e12), ("T4", 65e12), ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of `device_kind`, or `None` when unknown (CPUs)."""
    for name, flops in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def flops_per_token(params: Any, config: Any) -> float:
    """nanoGPT's training FLOPs per token, `6N + 12·L·H·Q·T`.

    Args:
      params: the GPT's parameter tree (pure dict from `nnx.split`).
      config: its `models.GPTConfig`.
    """
    n = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if names and names[0] == "wpe":
            continue
        scale = config.top_k / config.n_experts if "experts" in names else 1.0
        n += scale * math.prod(leaf.shape)
    head_dim = config.n_embd // config.n_head
    return 6 * n + 12 * config.n_layer * config.n_head * head_dim * config.block_size


class Tracker(Protocol):
    """Where `MetricsLog` sends each line's scalars besides the file: TensorBoard, W&B."""

    def write(self, step: int | None, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


#: The tracker tags of the evaluation keys; every other key is `train/<key>`.
EVAL_TAGS = {"train_loss": "eval/train_loss", "val_loss": "eval/val_loss"}


def tracker_scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a log line by tracker tag (`step` and non-numbers left out).

    Example:
      >>> tracker_scalars({"step": 10, "loss": 2.5, "lr": 1e-3, "note": "x"})
      {'train/loss': 2.5, 'train/lr': 0.001}
      >>> tracker_scalars({"step": 10, "val_loss": 2.0})
      {'eval/val_loss': 2.0}
    """
    return {EVAL_TAGS.get(key, f"train/{key}"): float(value) for key, value in entry.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}


def _import_tracker(module: str, flag: str) -> Any:
    """Import a tracker's package, or raise one line naming the flag and the install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        why = ("which is not installed" if err.name == module
               else f"which failed to import ({err})")
        raise ModuleNotFoundError(
            f"{flag} needs the {module} package, {why}: pip install {module} (or, in the "
            "repository's checkout, pip install -e '.[tracking]')", name=module) from None


class TensorBoardTracker:
    """Scalars to TensorBoard event files in `logdir`, through tensorboardX's
    `SummaryWriter` (flushed after every line, so a killed run keeps what it logged).

    Args:
      logdir: the event files' folder (`out_dir/tensorboard`).
      purge_step: a resumed run's first step to log again (TensorBoard hides the events
        of the killed run from that step on); `None` for a fresh run.
    """

    def __init__(self, logdir: str | os.PathLike, *, purge_step: int | None = None):
        writer = _import_tracker("tensorboardX", "--tensorboard").SummaryWriter
        self.writer = writer(logdir=str(logdir), purge_step=purge_step)

    def write(self, step: int | None, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Scalars to a Weights & Biases run (`wandb.init`, `run.log(..., step=)`, `run.finish`).

    The run's id is kept in `out_dir/wandb_run_id`, so `--resume` continues the same W&B
    run (`resume="allow"`); W&B drops lines at steps it already holds, which a resumed run
    logs again with the same values.

    Args:
      project: the W&B project.
      name: the run's name (the out_dir's name).
      config: the run's settings, shown with the run.
      out_dir: the run's folder (W&B writes its files under `out_dir/wandb`).
      resume: continue the run whose id `out_dir` holds (a new one if it holds none).
    """

    def __init__(self, project: str, *, name: str, config: Mapping[str, Any],
                 out_dir: str | os.PathLike, resume: bool = False):
        wandb = _import_tracker("wandb", "--wandb_project")
        id_file = Path(out_dir) / "wandb_run_id"
        run_id = (id_file.read_text().strip() if resume and id_file.is_file()
                  else secrets.token_hex(4))
        self.run = wandb.init(project=project, name=name, config=dict(config),
                              dir=str(out_dir), id=run_id,
                              resume="allow" if resume else None)
        id_file.write_text(run_id + "\n")

    def write(self, step: int | None, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def check_trackers(run_config: Any) -> None:
    """Raise (one line) when a tracker that `run_config` asks for is not installed.

    Every process checks, though process 0 alone writes: so all of them stop together,
    and none waits for the others in a collective.

    Args:
      run_config: the `RunConfig` (`tensorboard`, `wandb_project`).

    Raises:
      ModuleNotFoundError: naming the flag and the `pip install` that provides it.
    """
    if run_config.tensorboard:
        _import_tracker("tensorboardX", "--tensorboard")
    if run_config.wandb_project is not None:
        _import_tracker("wandb", "--wandb_project")


def run_name(config: Any) -> str:
    """A run's name: its out_dir's last part (`out/adamw` -> `adamw`)."""
    path = Path(config.run.out_dir)
    return path.name or path.resolve().name


def open_trackers(config: Any, out_dir: str | os.PathLike, *, start: int = 0
                  ) -> list[Tracker]:
    """The trackers `config.run` asks for (call on process 0 only).

    Args:
      config: the `TrainConfig` (W&B gets its flat keys as the run's config).
      out_dir: the run's folder.
      start: the step a resumed run restarts from.
    """
    from train.config import flat_dict

    r, trackers = config.run, []
    if r.tensorboard:
        trackers.append(TensorBoardTracker(Path(out_dir) / "tensorboard",
                                           purge_step=start + 1 if r.resume else None))
    if r.wandb_project is not None:
        trackers.append(WandbTracker(r.wandb_project, name=run_name(config),
                                     config=flat_dict(config), out_dir=out_dir,
                                     resume=r.resume))
    return trackers


class MetricsLog:
    """Append-only `metrics.jsonl` (one JSON object per line) plus the in-memory history,
    each line's numbers also sent to `trackers` (`tracker_scalars`).

    Args:
      path: the log file.
      append: continue the file (a resumed run); its lines become `earlier`. Otherwise
        the file starts empty.
      trackers: TensorBoard / W&B writers (`open_trackers`); `close()` closes them.

    Attributes:
      history: the entries written through this object (this invocation).
      earlier: the entries the file held when it was opened with `append`.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False,
                 trackers: Sequence[Tracker] = ()):
        self.path = Path(path)
        self.trackers = list(trackers)
        self.history: list[dict[str, Any]] = []
        self.earlier: list[dict[str, Any]] = []
        if not append:
            self.path.write_text("")
        elif self.path.is_file():
            self.earlier = [json.loads(x) for x in self.path.read_text().splitlines()
                            if x.strip()]

    @property
    def whole_run(self) -> list[dict[str, Any]]:
        """Every entry of the run, across resumes: `earlier + history`."""
        return self.earlier + self.history

    def write(self, **entry: Any) -> dict[str, Any]:
        """Record `entry` (JSON-serialisable values) and return it."""
        self.history.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.trackers:
            scalars = tracker_scalars(entry)
            for tracker in self.trackers:
                tracker.write(entry.get("step"), scalars)
        return entry

    def close(self) -> None:
        """Flush and close the trackers (the file is closed after every line)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


#: The bar while a step compiles: count and elapsed time, no rate or ETA (a step's time
#: would be the compilation's). `restart_clock` restores tqdm's default format.
COMPILING_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def show_compiling(bar: Any) -> None:
    """Show a `tqdm` bar as "compiling", without rate or ETA, until `restart_clock`."""
    if bar.disable:
        return
    bar.bar_format = COMPILING_BAR
    bar.set_description_str("compiling")


def restart_clock(bar: Any) -> None:
    """Count a `tqdm` bar's rate and ETA from now, its count kept and its description
    ("compiling") cleared: the time before was compilation, not steps.

    `tqdm.reset` restarts the clock and the rate's averages, but it draws the bar at a
    count of 0 with the old `initial`: a negative rate and ETA. So that drawing is skipped;
    the bar is drawn once its count is back, with no rate or ETA until a timed step.
    """
    if bar.disable:
        return
    n = bar.n
    bar.refresh = lambda *args, **kwargs: None  # reset's drawing at 0
    try:
        bar.reset(total=bar.total)
    finally:
        del bar.refresh
    bar.n = bar.last_print_n = bar.initial = n
    bar.bar_format = None
    bar.set_description_str("")


def run_title(config: Any) -> str:
    """The plot's title: the run's name, then its optimizer and the model's shape (the
    command line's keys; a mixture of experts's on a third line).

    Example:
      >>> from train.config import TrainConfig, override
      >>> print(run_title(override(TrainConfig(), out_dir="out/adamw", optimizer="adamw")))
      adamw
      adamw, n_layer=4, n_embd=128, n_head=4, block_size=64

    Args:
      config: the `TrainConfig`.
    """
    m = config.model
    moe = (f"\nmoe_every={m.moe_every}, n_experts={m.n_experts}, top_k={m.top_k}"
           if m.moe_every else "")
    return (f"{run_name(config)}\n{config.optimizer.name}, n_layer={m.n_layer}, "
            f"n_embd={m.n_embd}, n_head={m.n_head}, block_size={m.block_size}{moe}")


class LossTarget(NamedTuple):
    """A benchmark's val-loss target and the task it is set on.

    Attributes:
      value: the target val loss.
      name: the benchmark, for the plot's legend.
      preset: the preset whose task it is (its `TASK_KEYS`).
      vocab_size: the vocabulary of the task's data (its tokenizer's).
    """

    value: float
    name: str
    preset: str
    vocab_size: int


#: The targets the loss plot knows: modded-nanogpt Track 3's mean val loss < 3.28
#: (records/track_3_optimization/README.md) on FineWeb's GPT-2 tokens, the `track3`
#: preset's data. The `track3_cpu` twin has none: its target is measured from its
#: baseline (`benchmarks.track3`).
LOSS_TARGETS: tuple[LossTarget, ...] = (LossTarget(3.28, "Track 3", "track3", GPT2_VOCAB_SIZE),)
#: What makes a preset's task, beside its data's vocabulary: the network's shape and the
#: validation set (the optimizer, its hyperparameters and the step count may differ).
TASK_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "val_tokens")


def loss_target(config: Any, vocab_size: int) -> LossTarget | None:
    """The target of the benchmark whose task `config` runs on data of `vocab_size` ids,
    or None (`LOSS_TARGETS`: the config's `TASK_KEYS` equal the target preset's).

    Example:
      >>> from train.config import get_preset
      >>> loss_target(get_preset("track3"), 50257).value
      3.28
      >>> loss_target(get_preset("track3_cpu"), 65) is None
      True

    Args:
      config: the run's `TrainConfig`.
      vocab_size: the number of token ids of its data (before any padding).
    """
    from train.config import flat_dict, get_preset

    keys = flat_dict(config)
    for target in LOSS_TARGETS:
        task = flat_dict(get_preset(target.preset))
        if vocab_size == target.vocab_size and all(keys[k] == task[k] for k in TASK_KEYS):
            return target
    return None


def plot_losses(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
                title: str | None = None, target: LossTarget | None = None) -> Any:
    """Save train/val loss against step (the logged train loss and both eval losses).

    Draws on a bare `matplotlib.figure.Figure`, so pyplot's global backend (a notebook's
    inline backend, say) is left alone.

    Args:
      history: the log's lines.
      path: the image file.
      title: above the plot (`run_title`: run name, optimizer, model shape).
      target: a benchmark's target val loss (`loss_target`), drawn as a dashed line
        labelled with its value.

    Returns:
      The `matplotlib.figure.Figure`.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if title:
        ax.set_title(title, fontsize=10)
    series = (("loss", "train (batch)", 0.4), ("train_loss", "train (eval)", 1.0),
              ("val_loss", "val (eval)", 1.0))
    for key, label, alpha in series:
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, alpha=alpha,
                    marker="o" if key != "loss" else None)
    if target is not None:
        ax.axhline(target.value, color="k", lw=0.8, ls="--",
                   label=f"{target.name} target {target.value:g}")
    _save(fig, ax, "cross-entropy (nats/token)", path)
    return fig


def _save(fig: Any, ax: Any, ylabel: str, path: str | os.PathLike) -> None:
    """Label a plot of a quantity against the step and write it."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class RefreshLog(Monitor):
    """Rows of `refresh_events.jsonl` (`optax_snoo.kfac.refresh_events`' rows: refresh
    count, step, lr, eigenvalue range of A and G, clipped count) and `refresh_events.png`.

    Args:
      path: the JSONL file.
      start: the step training starts from; a resumed run (``start > 0``) keeps the
        existing rows of earlier steps (later ones are redone) and continues their counter.
      plot: `rows -> None`, drawing the figure at `finish` (`None`: no figure).
    """

    def __init__(self, path: str | os.PathLike, *, start: int = 0,
                 plot: Callable[[list[dict[str, Any]]], None] | None = None):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if start > 0 and self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines()
                    if line.strip()]
            self.rows = [row for row in rows if row["step"] < start]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self._count = self.rows[-1]["refresh"] if self.rows else 0
        self._pending: list[Any] = []
        self._plot = plot

    def add(self, observed: Any) -> None:
        """Keep one step's K-FAC scalars (the K-FAC stacks' `observe` hook, in
        `train.kfac_trainer`; device arrays, nothing is read)."""
        self._pending.append(observed)

    def flush(self) -> list[dict[str, Any]]:
        """Fetch the kept events (one transfer) and write a row per new refresh.

        Refreshes are at most one per step, so a counter that grew since the previous kept
        event marks that step's refresh (of the first K-FAC transform). Returns the new
        rows.
        """
        observed, self._pending = jax.device_get(self._pending), []
        new = []
        for rows in map(refresh_events, observed):
            if not rows:
                raise ValueError("the optimizer takes curvature= but has no K-FAC state")
            if rows[0]["refresh"] > self._count:
                self._count = rows[0]["refresh"]
                new.append(rows[0])
        if new:
            with self.path.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in new)
            self.rows += new
        return new

    def finish(self) -> None:
        """Write the last rows, then the figure."""
        self.flush()
        if self._plot is not None:
            self._plot(self.rows)


def plot_refresh_events(rows: Sequence[dict[str, Any]], schedule: Callable[[Any], Any],
                        total_steps: int, path: str | os.PathLike) -> None:
    """Save the learning-rate curve with a marker at every refresh (`rows` of the log)."""
    from matplotlib.figure import Figure  # not pyplot: a notebook's backend stays as it is

    steps = np.arange(max(total_steps, 1))
    lrs = np.asarray(jax.vmap(schedule)(steps))
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.plot(steps, lrs, color="0.3", label="learning rate (K-FAC group)")
    if rows:
        ax.scatter([r["step"] for r in rows], [r["lr"] for r in rows], color="C3", s=18,
                   zorder=3, label=f"refresh ({len(rows)})")
    _save(fig, ax, "learning rate", path)


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def step_memory_bytes(gpt_config: Any, tx: Any, *, batch_size: int) -> dict[str, int]:
    """A lower bound on the memory of one train step, by part, in bytes (no compilation).

    Parameters and optimizer state come from abstract shapes (`jax.eval_shape`);
    gradients are one parameter-sized float32 tree; activations are the residual stream
    saved per layer, `L·B·T·D` in the compute dtype, plus the larger of one attention-score
    tensor `B·H·T·T` (compute dtype) and the float32 logits `B·T·V`.

    Args:
      gpt_config: the `models.GPTConfig`.
      tx: the optax transformation (its state is sized with `eval_shape`).
      batch_size: sequences per micro-batch `B`.

    Returns:
      `{"params", "opt_state", "grads", "activations"}` in bytes.
    """
    from flax import nnx

    import models

    def init():
        model = models.GPT(gpt_config, rngs=nnx.Rngs(0))
        return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])

    params = jax.eval_shape(init)
    try:
        opt_state = _nbytes(jax.eval_shape(tx.init, params))
    except Exception:  # an optimizer that cannot be traced abstractly: state not counted
        opt_state = 0
    c = gpt_config
    compute = jax.numpy.dtype(c.dtype).itemsize
    B, T = batch_size, c.block_size
    activations = (c.n_layer * B * T * c.n_embd * compute
                   + max(B * c.n_head * T * T * compute, B * T * c.vocab_size * 4))
    return {"params": _nbytes(params), "opt_state": opt_state,
            "grads": sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(params)),
            "activations": activations}


def _host_available() -> int:
    """The host's available physical memory in bytes (`MemAvailable`, else free pages)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(devices: Sequence[Any]) -> tuple[int, str] | None:
    """`(bytes, where)`: the memory `devices` can use together, or `None` when unknown.

    Accelerators: each device's `bytes_limit`, summed. CPUs share their host's memory:
    its available physical memory (`MemAvailable`), once per host however many CPU
    devices it holds. With several processes, this process's devices stand for the rest
    (the same hardware on every host).
    """
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    hosts = len({d.process_index for d in devices})
    if all(d.platform == "cpu" for d in devices):
        per_host = _host_available()
        where = "available on this host" if hosts == 1 else f"available on {hosts} hosts"
        return per_host * hosts, where
    limits = []
    for d in local:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    total = sum(limits) * len(devices) // len(local)
    return total, f"on {len(devices)} {local[0].device_kind} device(s)"


def check_memory(config: Any, gpt_config: Any, tx: Any, devices: Sequence[Any]) -> None:
    """Raise before compiling when a train step surely cannot fit in `devices`' memory.

    Args:
      config: the `TrainConfig` (for `batch_size` and the message).
      gpt_config: its `models.GPTConfig`.
      tx: the optimizer.
      devices: the devices of the mesh.

    Raises:
      ValueError: naming `--block_size` and `--batch_size`, with the estimate by part and
        the memory available.
    """
    available = available_memory(devices)
    if available is None or available[0] <= 0:
        return
    limit, where = available
    parts = step_memory_bytes(gpt_config, tx, batch_size=config.data.batch_size)
    need = sum(parts.values())
    if need <= limit:
        return
    gib = lambda n: f"{n / 2**30:,.1f} GiB"
    detail = ", ".join(f"{name} {gib(n)}" for name, n in parts.items())
    raise ValueError(
        f"--block_size={gpt_config.block_size} with --batch_size={config.data.batch_size}: a "
        "train "
        f"step needs at least {gib(need)} ({detail}), more than the {gib(limit)} {where}; "
        "lower --block_size or --batch_size (--grad_accum keeps the tokens per step), or "
        "shrink the model")
