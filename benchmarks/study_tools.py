"""What every study of the trainer shares (`benchmarks.study`, `benchmarks.snoo_scaling`).

A stack's config (a registered optimizer, `@key=value` overrides or an alias) and one
training run of it in a scratch folder; the one-sided t-tests over seeds; where reports
go, the line that says where and when they ran, and a compilation cache shared by the
runs of one invocation.

References:
  Welch, "The generalization of Student's problem when several different population
  variances are involved", Biometrika 34, 1947.
  Student, "The probable error of a mean", Biometrika 6, 1908.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "ALIASES",
    "RESULTS",
    "compilation_cache",
    "fmt_or_dash",
    "machine_line",
    "paired_one_sided",
    "renamed_stack",
    "stack_config",
    "train_one",
    "welch_one_sided",
]

#: Where the reports go: `benchmarks/results/`.
RESULTS = Path(__file__).resolve().parent / "results"

#: Stacks that need more than a registry name.
ALIASES: dict[str, str] = {
    "snoo_muon_smooth": "snoo_muon@muon_smoothing=0.2",
}


def renamed_stack(stack: str) -> str:
    """`stack` (`name@key=value...`) with the old optimizer and key names of
    `train.config.RENAMED` made new: the stacks of results saved before the renames."""
    from train.config import RENAMED, RENAMED_MEANING, renamed

    name, *overrides = stack.split("@")
    for key, _, _ in (o.partition("=") for o in overrides):
        if key in RENAMED_MEANING:  # its value would mean something else under the new name
            raise ValueError(f"stack {stack!r}: {renamed(key)}")
    overrides = [RENAMED["key"].get(key, key) + eq + value
                 for key, eq, value in (o.partition("=") for o in overrides)]
    return "@".join([RENAMED["optimizer"].get(name, name), *overrides])


def stack_config(preset: str, stack: str, *, seed: int, steps: int, eval_interval: int,
                 out_dir: str):
    """The `TrainConfig` of one run: `preset` (with its own `@key=value` overrides, for
    every stack), the stack's optimizer and overrides. A cosine ends at `steps`."""
    from train.config import override, parse_args

    preset_name, *common = preset.split("@")
    name, *overrides = ALIASES.get(stack, stack).split("@")
    args = [f"--preset={preset_name}", f"--optimizer={name}"] + [
        f"--{o}" for o in (*common, *overrides)]
    config = parse_args(args)
    if "lr_decay_iters" in config.optimizer.resolved():  # not a preset's own end
        config = override(config, lr_decay_iters=None)
    return override(
        config, seed=seed, max_iters=steps, eval_interval=eval_interval,
        checkpoint_every=max(steps, 1), out_dir=out_dir, progress=False, num_samples=0)


def train_one(preset: str, stack: str, *, seed: int, steps: int,
              eval_interval: int, whole_val: bool = False) -> dict[str, Any]:
    """One training run in a scratch folder: its val curve, final loss and speed, and with
    `whole_val` its final checkpoint's loss on the whole val split (`whole_val_loss`)."""
    import train
    from train.evaluate import evaluate_split

    scratch = tempfile.mkdtemp(prefix="optax_snoo_study_")
    try:
        result = train.run(stack_config(preset, stack, seed=seed, steps=steps,
                                        eval_interval=eval_interval, out_dir=scratch))
        whole = evaluate_split(scratch)["loss"] if whole_val else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    curve = [(h["step"], h["val_loss"]) for h in result.history if "val_loss" in h]
    aux = [h["aux_loss"] for h in result.history if "aux_loss" in h]
    return {"seed": seed, "val_loss": result.final["val_loss"], "curve": curve,
            "wall_s": result.final["wall_s"], "tokens_per_sec": result.final["tokens_per_sec"],
            "aux_loss": statistics.mean(aux[-10:]) if aux else None,
            **({"whole_val_loss": whole} if whole_val else {})}


def _student_t_cdf(t: float, nu: float) -> float:
    """`P(T_ν <= t)` through the regularized incomplete beta function:
    `P(T_ν <= t) = I_{ν/(ν+t²)}(ν/2, 1/2) / 2` for `t <= 0`, by symmetry above."""
    tail = 0.5 * float(jax.scipy.special.betainc(
        jnp.float32(nu / 2), jnp.float32(0.5), jnp.float32(nu / (nu + t * t))))
    return tail if t <= 0 else 1.0 - tail


def _degenerate(diff: float) -> tuple[float, float]:
    """`(t, p)` when the standard error is 0: certain unless the means are equal."""
    return (-math.inf if diff < 0 else math.inf if diff > 0 else 0.0,
            0.0 if diff < 0 else 1.0 if diff > 0 else 0.5)


def welch_one_sided(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """`(t, p)` of Welch's t-test of mean(a) < mean(b) (one-sided), with the
    Welch-Satterthwaite degrees of freedom. Needs at least two values on each side."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a t-test needs >= 2 seeds per side, got {len(a)} and {len(b)}")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    diff = statistics.mean(a) - statistics.mean(b)
    if se == 0.0:
        return _degenerate(diff)
    nu = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff / se, _student_t_cdf(diff / se, nu)


def paired_one_sided(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """`(t, p)` of the paired t-test of mean(a - b) < 0 (one-sided, n - 1 degrees of
    freedom). Pairs are runs with the same seed, so the same init and the same batches:
    the seed-to-seed spread cancels, which an unpaired test cannot use."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"a paired t-test needs >= 2 pairs, got {len(a)} and {len(b)} values")
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d))
    if se == 0.0:
        return _degenerate(statistics.mean(d))
    return statistics.mean(d) / se, _student_t_cdf(statistics.mean(d) / se, len(d) - 1)


def fmt_or_dash(value: float | None, spec: str) -> str:
    """`value` formatted with `spec`, or "-" for a missing value (a table cell)."""
    return "-" if value is None else format(value, spec)


def machine_line() -> str:
    """Date, host, CPUs, jax and load now: where and when a grid ran."""
    return (f"{datetime.date.today().isoformat()}; {platform.node() or 'host'}, "
            f"{os.cpu_count()} CPUs, jax {jax.__version__} on {jax.devices()[0].platform}; "
            f"load average {os.getloadavg()[0]:.1f} at the end")


@contextlib.contextmanager
def compilation_cache(directory: str):
    """Seeds of one stack compile the same programs: cache them in `directory` (unless a
    cache is already set), and restore the previous settings afterwards."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    if saved[names[0]] is None:
        for name, value in zip(names, (directory, 0.0, 0), strict=True):
            jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
