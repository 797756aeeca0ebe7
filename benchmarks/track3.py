"""modded-nanogpt Track 3's protocol as a tool: `python -m benchmarks.track3 --optimizers=A,B
--seeds=n --preset=track3_cpu`.

Runs each optimizer `n` seeds with the trainer (one `python -m train` process a run, the
preset's data order, validation and cadence), then applies the benchmark's statistics
(records/track_3_optimization/README.md) to the val losses at the evaluation steps:

- one-sample rule: at an evaluation step, `(target - mean) * sqrt(n) >= c`; the benchmark's
  `c = 0.004` is `z * sigma` with `z = 3.09` (one-sided p < 0.001) and `sigma = 0.0013`,
  its seed-to-seed std of the final loss. On the twin `sigma` is measured: the std of the
  first optimizer's (the baseline's) final losses over its seeds, which needs at least 3
  of them (`--sigma` gives it instead), and `c = 3.09 sigma`. An optimizer's result is the
  first evaluation step where the rule holds.
- target: the benchmark picked 3.28, a loss its baseline reaches at its planned step count;
  here (unless `--target`) the baseline's mean final loss plus `c / sqrt(n)`, rounded up to
  3 decimals: the smallest 3-decimal target the baseline passes at its last step.
- pairwise rule, for each pair (old = the earlier in `--optimizers`):
  `(old mean - new mean + (old steps - new steps) / 100 * d) / sqrt(1/n_old + 1/n_new) >= c`,
  each at its own result step (both at their last step where one has no result); `d` is
  the loss the baseline loses per 100 fewer steps near the target (the benchmark
  measured 0.0045), here the least-squares slope of the baseline's mean val loss over the
  evaluations of the last `--slope_frac` of the run (an approximation: the benchmark
  compared runs of different lengths).
- beside the rules, a paired t-test of each optimizer against the baseline by seed; where
  every pair differs by the same amount it reports no t and no p ("all differences
  equal"), not a certainty.

A run is reused only when everything that decides its result is what was asked for: its
key (`run_key.json` beside its `metrics.jsonl`) holds the trainer's whole resolved config
(`train.config.config_to_dict` of the preset, the optimizer, the seed and every
`--set`/`--set_for` option, less where outputs go and how progress shows), the data (each
file's size, and a content hash of those up to 16 MiB) and the code (a content hash of
the tracked sources of `optax_snoo/`, `models/` and `train/`, and the versions of jax,
optax, flax and numpy). Runs live in `<runs_dir>/<preset>/<optimizer>/<12 hex digits of
that key without the seed>/seed<k>`, so different options never share a folder; a folder
whose key file is missing or differs is trained again, and `--rerun` always trains again.

Every name, option, count and path is checked before the first run: a mistake ends with
one `error: ...` line on stderr and exit status 2, as `python -m train` does.

Writes `<out>.json`, `<out>.md` and `<out>.png`, by default under `out/track3_reports/`
(outside the repository's committed `benchmarks/results/`: pass `--out=benchmarks/results/
NAME` to replace a committed report on purpose).

Example:
  $ python -m benchmarks.track3 --optimizers=track3_baseline,snoo_track3_baseline \\
        --seeds=5 --preset=track3_cpu

References:
  Jordan et al., modded-nanogpt Track 3 (optimization), README (rules, statistics) and
  train_gpt_simple.py,
  https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
  2026.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: One-sided z of the benchmark's p < 0.001 (0.004 = Z_999 x 0.0013, rounded).
Z_999 = statistics.NormalDist().inv_cdf(0.999)
#: The benchmark's own constants (README of records/track_3_optimization).
BENCHMARK_SIGMA, BENCHMARK_THRESHOLD, BENCHMARK_PER_100 = 0.0013, 0.004, 0.0045
#: Fewest baseline seeds whose std is taken as sigma (two give a std of one difference).
MIN_SIGMA_SEEDS = 3
#: Track 3's table as far as the recipe registry has it: recipe -> (the table's row, its
#: steps to 3.28, trainer options the row's own network needs). `--table` runs these,
#: #36 first (the baseline); records/track_3_optimization/README.md of modded-nanogpt.
TRACK3_TABLE: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "track3_baseline": ("36", 3250, ()),
    "track3_adam": ("2", 5625, ()),
    "adamh": ("4", 4875, ("init=hyperball",)),
    "muonh": ("5", 3325, ("init=hyperball",)),
    "track3_muon_squared": ("7", 3325, ()),
    "muloco_normuonh": ("13", 3210, ("init=hyperball",)),
    "track3_normuon_floor": ("9", 3250, ()),
    "track3_contra_muon": ("11", 3225, ()),
    "track3_aurora": ("17", 3175, ()),
    "track3_pmuon": ("18", 3225, ()),
    "track3_sinksoap": ("26", 3090, ()),
    "track3_dynmuon": ("28", 3175, ()),
    "track3_contra_soft_muon": ("20", 3030, ()),
    "track3_soda": ("32", 3000, ()),
    "track3_muown": ("23", 3125, ()),
    "track3_contra_normuown": ("31", 2995, ()),
    # K-FAC-style capture refuses the summed loss: the mean (Muon is scale-free).
    "track3_newton_muon": ("15", 3275, ("loss_reduction=mean",)),
    # #44 as it ran (`track3_soap_muon`, its SOAP-Muon part alone, is an ablation).
    "track3_soap_muon_record": ("44", 2750, ()),
    "track3_record": ("46", 2690, ()),
    "track3_spectral_descent": ("22", 8225, ()),
    "track3_psgd": ("33", 3400, ("init=hyperball",)),
    "track3_shampoo": ("21", 4100, ()),
    "track3_shampoo_pinv": ("35", 3375, ()),
    "track3_soaph": ("27", 3125, ("init=hyperball",)),
    "track3_klsoap": ("19", 3125, ("init=hyperball",)),
    "track3_klsoap_power_decay": ("25", 3040, ("init=hyperball",)),
    "track3_aurora_proj": ("30", 2930, ("init=cgi",)),
    "track3_rre": ("34", 2925, ("init=cgi",)),
    "track3_tail_refinterp": ("38", 2900, ("init=cgi",)),
    "track3_ema_nesterov_aurora": ("40", 2890, ("init=cgi",)),
    # #42's init: #40's without the Rademacher gains, with zero biases.
    "track3_aurora_ema_ref": ("42", 2860, ("init=depth_fc",)),
    "track3_circuit_muon": ("41", 2875, ("init=cgi",)),
    "track3_tail_phase_readout": ("43", 2850, ("init=cgi",)),
}


def table_options(name: str, preset: str, extra: Sequence[str] = ()) -> list[str]:
    """The trainer options `--table` gives row `name` on `preset` (with the `--set` options
    `extra`): its network's (`TRACK3_TABLE`), and, for a recipe whose `gradient_scale`
    turns the summed loss's gradient into the mean token's (DynMuon, #28: the record's
    1/(8*64*1024)), the run's own: one over its tokens per step with the summed loss, 1
    with the mean, where that differs from the record's: the power map's
    ``(scale ||v||)^p`` is not scale-free (on the twin's 2,048-token steps the record's
    constant makes its updates 4x larger once p is -0.25).
    """
    from optax_snoo import recipes
    from train.config import parse_args

    options = list(TRACK3_TABLE[name][2])
    recipe = recipes.get(name)
    if "gradient_scale" in recipe.hyperparameters.names():
        config = parse_args([f"--preset={preset}", f"--optimizer={name}", *extra])
        tokens = config.data.batch_size * config.data.grad_accum * config.model.block_size
        scale = 1 / tokens if config.optimizer.loss_reduction == "sum" else 1.0
        if scale != recipe.defaults.gradient_scale:
            options.append(f"gradient_scale={scale!r}")
    return options


#: The exit status of a user's mistake (`train.errors.MISTAKE_EXIT_STATUS`, argparse's).
MISTAKE_EXIT_STATUS = 2


# ------------------------------------------------------------------------ statistics


def threshold(sigma: float, z: float = Z_999) -> float:
    """`c = z * sigma`: the one-sample rule's right-hand side (benchmark: 3.09 x 0.0013)."""
    if not sigma > 0:
        raise ValueError(f"sigma={sigma!r}: expected a seed-to-seed std > 0")
    return z * sigma


def one_sample_score(losses: Sequence[float], target: float) -> float:
    """`(target - mean) * sqrt(n)` of the `n` seeds' losses at one evaluation step."""
    if not len(losses):
        raise ValueError("losses: expected at least one run")
    return (target - float(np.mean(losses))) * math.sqrt(len(losses))


def first_significant_step(steps: Sequence[int], losses_by_seed: Sequence[Sequence[float]],
                           target: float, c: float) -> int | None:
    """The first of `steps` where `one_sample_score(losses at it, target) >= c`, or None.

    Args:
      steps: the evaluation steps, increasing.
      losses_by_seed: one row per seed, one loss per step (the same steps for every seed:
        the benchmark forbids per-run choices).
    """
    table = np.asarray(losses_by_seed, np.float64)
    if table.ndim != 2 or table.shape[1] != len(steps):
        raise ValueError(f"losses_by_seed: expected (seeds, {len(steps)}) losses, got shape "
                         f"{table.shape}")
    for j, step in enumerate(steps):
        if one_sample_score(table[:, j], target) >= c:
            return int(step)
    return None


def pairwise_score(old: tuple[float, int, int], new: tuple[float, int, int],
                   per_100: float) -> float:
    """`(old mean - new mean + (old steps - new steps)/100 * per_100) / sqrt(1/n_old +
    1/n_new)`; `old`, `new` are `(mean loss, runs, steps)`. The new result is better when
    this is at least the one-sample threshold `c`."""
    (old_loss, n_old, old_steps), (new_loss, n_new, new_steps) = old, new
    step_term = (old_steps - new_steps) / 100 * per_100
    return (old_loss - new_loss + step_term) / math.sqrt(1 / n_old + 1 / n_new)


def loss_per_100_steps(steps: Sequence[int], mean_losses: Sequence[float]) -> float:
    """The loss lost per 100 fewer steps: `-100 x` the least-squares slope of the losses
    against the steps (>= 0 for a falling curve)."""
    if len(steps) < 2:
        raise ValueError("loss_per_100_steps: expected at least two evaluations")
    slope = np.polyfit(np.asarray(steps, np.float64), np.asarray(mean_losses, np.float64), 1)[0]
    return float(-100 * slope)


def target_from_baseline(final_losses: Sequence[float], c: float, decimals: int = 3) -> float:
    """The smallest target with `decimals` decimals that the baseline's final losses pass:
    `mean + c / sqrt(n)` rounded up (3.28 played this role for the benchmark's 3.2787,
    n = 10)."""
    need = float(np.mean(final_losses)) + c / math.sqrt(len(final_losses))
    scale = 10 ** decimals
    return math.ceil(need * scale - 1e-9) / scale


def steps_to_target(steps: Sequence[int], losses: Sequence[float],
                    target: float) -> int | None:
    """One run's first evaluation step with `loss <= target`, or None (a per-seed figure
    for the paired test; the benchmark's own result is `first_significant_step`)."""
    for step, loss in zip(steps, losses, strict=True):
        if loss <= target:
            return int(step)
    return None


def paired_t_test(base: Mapping[int, float | None],
                  other: Mapping[int, float | None]) -> dict:
    """Two-sided paired t-test of `other - base` over the seeds both define (not None).

    Args:
      base, other: `{seed: value}` (a final loss, or steps to the target).

    Returns:
      `{"n", "mean_diff", "std_diff", "t", "p", "seeds", "note"}`: the pairs' mean and std
      (ddof 1) of `other - base`, `t = mean / (std / sqrt(n))` and its two-sided p under
      Student's t with `n - 1` degrees of freedom. `t` and `p` are None, with `note`
      saying why, below two pairs ("fewer than two pairs") and when every difference is
      the same ("all differences equal": the t-test's std is zero, so it says nothing;
      a `p` of 0 would claim a certainty that a handful of seeds cannot give). `note` is
      None when `t` and `p` are given.

    Example:
      >>> paired_t_test({0: 1.0, 1: 2.0}, {0: 1.5, 1: 2.5})["note"]
      'all differences equal'
    """
    from scipy import stats

    seeds = sorted(s for s in base if s in other and base[s] is not None
                   and other[s] is not None)
    diff = np.array([other[s] - base[s] for s in seeds], np.float64)
    out = {"n": len(seeds), "seeds": seeds,
           "mean_diff": float(diff.mean()) if len(seeds) else None,
           "std_diff": float(diff.std(ddof=1)) if len(seeds) > 1 else None,
           "t": None, "p": None, "note": None}
    if len(seeds) < 2:
        out["note"] = "fewer than two pairs"
        return out
    values = np.abs(np.array([[base[s], other[s]] for s in seeds], np.float64))
    # equal up to float64 rounding: each difference is within 2 eps max|value| of exact
    if np.ptp(diff) <= 4 * np.finfo(np.float64).eps * values.max():
        out["note"] = "all differences equal"
        return out
    t = out["mean_diff"] / (out["std_diff"] / math.sqrt(len(seeds)))
    out["t"], out["p"] = float(t), float(2 * stats.t.sf(abs(t), len(seeds) - 1))
    return out


def summarize(curves: Mapping[str, Mapping[int, Mapping[int, float]]], *,
              target: float | None = None, sigma: float | None = None,
              slope_frac: float = 0.2) -> dict:
    """The protocol's figures from `curves[optimizer][seed][step] = val loss`.

    The first optimizer is the baseline (sigma, target and the per-100-steps term come
    from it unless given; a measured sigma needs `MIN_SIGMA_SEEDS` baseline seeds). Steps
    are those every run of an optimizer evaluated.

    Raises:
      ValueError: no optimizer, or sigma to measure from fewer than `MIN_SIGMA_SEEDS`
        baseline seeds.
    """
    names = list(curves)
    if not names:
        raise ValueError("curves: expected at least one optimizer")
    table = {}
    for name in names:
        seeds = sorted(curves[name])
        steps = sorted(set.intersection(*(set(curves[name][s]) for s in seeds)))
        table[name] = (seeds, steps, np.array([[curves[name][s][t] for t in steps]
                                               for s in seeds]))
    base_seeds, base_steps, base = table[names[0]]
    if sigma is None:
        if len(base_seeds) < MIN_SIGMA_SEEDS:
            raise ValueError(f"sigma: measuring it needs at least {MIN_SIGMA_SEEDS} baseline "
                             f"seeds, got {len(base_seeds)}; pass sigma")
        sigma = float(np.std(base[:, -1], ddof=1))
    c = threshold(sigma)
    if target is None:
        target = target_from_baseline(base[:, -1], c)
    last = base_steps[-1]
    window = [j for j, t in enumerate(base_steps) if t >= (1 - slope_frac) * last]
    per_100 = loss_per_100_steps([base_steps[j] for j in window], base[:, window].mean(0))
    out = {"target": target, "sigma": sigma, "threshold": c, "z": Z_999,
           "per_100_steps": per_100, "slope_window": [base_steps[window[0]], last],
           "optimizers": {}}
    for name in names:
        seeds, steps, losses = table[name]
        step = first_significant_step(steps, losses, target, c)
        at = steps.index(step) if step is not None else len(steps) - 1
        out["optimizers"][name] = {
            "seeds": seeds, "steps": steps, "losses": losses.tolist(),
            "mean": losses.mean(0).tolist(),
            "std": (losses.std(0, ddof=1) if len(seeds) > 1 else 0 * losses[0]).tolist(),
            "result_step": step, "result_mean": float(losses[:, at].mean()),
            "final_mean": float(losses[:, -1].mean()),
            "final_std": float(losses[:, -1].std(ddof=1)) if len(seeds) > 1 else None,
            "score_at_final": one_sample_score(losses[:, -1], target)}
    pairs = []
    for i, old in enumerate(names):
        for new in names[i + 1:]:
            o, n = out["optimizers"][old], out["optimizers"][new]
            # at each one's result step; where one has none, both at their last step
            at_result = o["result_step"] is not None and n["result_step"] is not None
            key = ("result_mean", "result_step") if at_result else ("final_mean", "last")
            a, b = ((r[key[0]], len(r["seeds"]), r["steps"][-1] if key[1] == "last" else
                     r[key[1]]) for r in (o, n))
            score, reverse = pairwise_score(a, b, per_100), pairwise_score(b, a, per_100)
            pairs.append({"old": old, "new": new, "at": "result" if at_result else "final",
                          "score": score, "better": score >= c, "reverse_score": reverse,
                          "old_better": reverse >= c})
    out["pairs"] = pairs
    for name in names:
        o = out["optimizers"][name]
        o["seed_steps_to_target"] = {
            seed: steps_to_target(o["steps"], row, target)
            for seed, row in zip(o["seeds"], o["losses"], strict=True)}
    base = out["optimizers"][names[0]]
    base_final = {s: row[-1] for s, row in zip(base["seeds"], base["losses"], strict=True)}
    out["paired"] = {}
    for name in names[1:]:
        o = out["optimizers"][name]
        final = {s: row[-1] for s, row in zip(o["seeds"], o["losses"], strict=True)}
        out["paired"][name] = {
            "final_loss": paired_t_test(base_final, final),
            "steps_to_target": paired_t_test(base["seed_steps_to_target"],
                                             o["seed_steps_to_target"])}
    return out




# ------------------------------------------------------------------------- run keys

#: Trainer keys that choose where a run's outputs go or how its progress shows, never its
#: result: left out of its key.
UNKEYED = ("out_dir", "progress", "tensorboard", "wandb_project")
#: Trainer keys this tool sets itself (refused in `--set`/`--set_for`), with its flag.
OWN_KEYS = {"preset": "--preset", "optimizer": "--optimizers", "seed": "--seeds/--seeds_for",
            "out_dir": "--runs_dir", "resume": "--rerun (a run is reused whole or rerun)"}
#: The trainer's sources, whose content is part of every run's key.
SOURCE_DIRS = ("optax_snoo", "models", "train")
#: The libraries whose versions are part of every run's key.
LIBRARIES = ("jax", "jaxlib", "optax", "flax", "numpy")
#: Data files up to this size are keyed by content hash, larger ones by name and size.
HASHED_DATA_BYTES = 16 << 20
#: The file beside a run's metrics that holds its key.
KEY_FILE = "run_key.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_files(root: Path = ROOT) -> list[str]:
    """The trainer's source files under `root` (`SOURCE_DIRS`), relative and sorted: the
    files git tracks or would track there (`git ls-files`, untracked but not ignored
    included), or outside a git checkout every file but `__pycache__`."""
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached",
                               "--others", "--exclude-standard", "--", *SOURCE_DIRS],
                              capture_output=True, check=True)
        names = sorted({n for n in done.stdout.decode().split("\0") if n})
        if names:
            return names
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted(p.relative_to(root).as_posix() for d in SOURCE_DIRS
                  for p in (root / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def code_version(root: Path = ROOT) -> dict[str, Any]:
    """`{"sources": sha256 over the names and contents of `source_files(root)`,
    "libraries": {name: version}}`: the code a run's result depends on."""
    digest = hashlib.sha256()
    for name in source_files(root):
        path = root / name
        if path.is_file():  # tracked but deleted in the work tree: not part of the code
            digest.update(f"{name}\0{_sha256(path)}\0".encode())
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    return {"sources": digest.hexdigest(), "libraries": versions}


def _file_entry(path: Path, name: str) -> dict[str, Any]:
    size = path.stat().st_size
    return {"name": name, "size": size,
            "sha256": _sha256(path) if size <= HASHED_DATA_BYTES else None}


def data_fingerprint(path: str | None, root: Path = ROOT) -> dict[str, Any]:
    """What a run's data is, as the trainer (started in `root`) finds it: `--data`'s file,
    the files of its folder or glob, or (None) the default tiny-shakespeare corpus; each
    file's name, size and, up to `HASHED_DATA_BYTES`, sha256 (shards: name and size).

    Raises:
      FileNotFoundError: nothing at `path`.
    """
    from train.data import TINYSHAKESPEARE_SHA256, corpus_search_paths

    if path is None:
        found = next((p for p in corpus_search_paths() if p.is_file()), None)
        if found is None:  # the trainer downloads it and checks this digest
            return {"files": [{"name": "input.txt", "sha256": TINYSHAKESPEARE_SHA256}]}
        return {"files": [_file_entry(found, found.name)]}
    where = Path(path) if Path(path).is_absolute() else root / path
    if where.is_file():
        return {"files": [_file_entry(where, where.name)]}
    if where.is_dir():
        files = sorted(p for p in where.rglob("*") if p.is_file())
        return {"files": [_file_entry(p, p.relative_to(where).as_posix()) for p in files]}
    matches = sorted(Path(p) for p in glob.glob(str(where)) if Path(p).is_file())
    if glob.has_magic(str(path)) and matches:
        return {"files": [_file_entry(p, p.name) for p in matches]}
    raise FileNotFoundError(f"--data={path!r}: no such file, folder or glob match (relative "
                            f"paths are read from {root}, where the trainer runs)")


def _canonical(value: Any) -> Any:
    """`value` as JSON reads it back (tuples as lists): what a key file compares to."""
    return json.loads(json.dumps(value, sort_keys=True))


def key_hash(key: Mapping[str, Any]) -> str:
    """The sha256 of a key's canonical JSON."""
    return hashlib.sha256(json.dumps(_canonical(key), sort_keys=True).encode()).hexdigest()


def _without(config: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """`config_to_dict`'s nested dict without the flat `keys` (by `train.config.KEYS`)."""
    from train.config import KEYS

    out = copy.deepcopy(dict(config))
    for key in keys:
        group, name = KEYS[key]
        out.get(group, {}).pop(name, None)
    return out


def _flat(config: Mapping[str, Any], key: str) -> Any:
    from train.config import KEYS

    group, name = KEYS[key]
    return config[group][name]


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Where two JSON values differ, as `path: old -> new` lines."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for k in sorted(set(old) | set(new), key=str)
                for line in _differences(old.get(k, "(absent)"), new.get(k, "(absent)"),
                                         f"{where}.{k}" if where else str(k))]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One planned run: its trainer arguments (without the output folder), its key and
    its folder."""

    label: str
    optimizer: str
    seed: int
    argv: tuple[str, ...]
    key: dict[str, Any]
    folder: Path
    max_iters: int


class RunError(Exception):
    """A trainer run ended with a non-zero status (its exit status and log named)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def trainer_args(preset: str, optimizer: str, seed: int, options: Sequence[str]) -> list[str]:
    """The `python -m train` arguments of one run, less its output folder and progress."""
    return [f"--preset={preset}", f"--optimizer={optimizer}", f"--seed={seed}", *options]


def plan_run(label: str, preset: str, optimizer: str, seed: int, options: Sequence[str],
             runs_dir: Path, *, code: Mapping[str, Any],
             data: dict[str | None, dict[str, Any]], build: bool = True) -> Run:
    """Resolve one run as the trainer will (`train.config.parse_args`), key it and name
    its folder `runs_dir/preset/optimizer/<12 hex of the key without the seed>/seed<k>`.

    Args:
      data: a cache of `data_fingerprint` by `--data` path, filled here.
      build: also build the optimizer (`train.optimizers.build_optimizer(config)`), so a
        refused combination (a run too short for its recipe...) surfaces before any run.

    Raises:
      ValueError: what the trainer refuses at start (a bad key or value, an unknown
        optimizer or preset, an option the optimizer refuses).
      FileNotFoundError: no data at `--data`.
    """
    from train.config import config_to_dict, parse_args
    from train.optimizers import build_optimizer

    argv = trainer_args(preset, optimizer, seed, options)
    config = parse_args(argv)
    if build:
        build_optimizer(config)
    resolved = config_to_dict(config)
    path = _flat(resolved, "data")
    if path not in data:
        _check_data(path)
        data[path] = data_fingerprint(path)
    key = {"config": _without(resolved, UNKEYED), "data": data[path], "code": dict(code)}
    unseeded = copy.deepcopy(key)
    group, name = _seed_field()
    unseeded["config"][group][name] = None
    folder = runs_dir / preset / optimizer / key_hash(unseeded)[:12] / f"seed{seed}"
    return Run(label, optimizer, seed, tuple(argv), _canonical(key), folder,
               int(_flat(resolved, "max_iters")))


def _seed_field() -> tuple[str, str]:
    from train.config import KEYS

    return KEYS["seed"]


def _check_data(path: str | None) -> None:
    """The trainer's own reading of `--data` (layout, headers), before any run."""
    if path is None:
        return  # the shipped corpus, or the trainer downloads and checks it
    from train.data import open_dataset

    open_dataset(path if Path(path).is_absolute() else ROOT / path, check=False)


def key_without_seed(run: Run) -> dict[str, Any]:
    """`run.key` with the seed cleared: the key every seed of a configuration shares."""
    key = copy.deepcopy(run.key)
    group, name = _seed_field()
    key["config"][group][name] = None
    return key


# ------------------------------------------------------------------------------ runs


def read_curve(metrics: Path) -> dict[int, float]:
    """`{step: val_loss}` of a run's `metrics.jsonl`."""
    curve = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "val_loss" in row:
            curve[int(row["step"])] = float(row["val_loss"])
    return curve


def reusable(run: Run) -> bool:
    """Whether `run.folder` holds this run, complete: its key file equals `run.key` and
    its metrics reach `run.max_iters`."""
    key_file, metrics = run.folder / KEY_FILE, run.folder / "metrics.jsonl"
    try:
        return (json.loads(key_file.read_text()) == run.key
                and run.max_iters in read_curve(metrics))
    except (OSError, ValueError):  # missing, unreadable or cut short
        return False


def launch(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    """Run one trainer command in the repository (where relative `--data` paths are read
    from), its output captured."""
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True)


def run_one(run: Run, rerun: bool = False) -> tuple[dict[int, float], float | None]:
    """Train `run` in its own process unless `reusable(run)` (and not `rerun`): its
    val-loss curve and wall time (None when reused).

    The folder is emptied first; the trainer's output goes to its `train.log`, and its key
    file is written only once the run succeeded with the config that was keyed (the
    trainer's own `config.json`), so a failed or interrupted run is never reused.

    Raises:
      RunError: the trainer failed (its status: 2 for a mistake it reported, 1 for a
        crash) or did not evaluate the final step.
      RuntimeError: the trainer resolved another config than the key's (a bug).
    """
    from train.config import COMPUTE_KEYS

    if not rerun and reusable(run):
        return read_curve(run.folder / "metrics.jsonl"), None
    if run.folder.exists():
        shutil.rmtree(run.folder)
    run.folder.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "train", *run.argv, f"--out_dir={run.folder}",
           "--progress=false"]
    t0 = time.perf_counter()
    done = launch(cmd)
    wall = time.perf_counter() - t0
    run.folder.mkdir(parents=True, exist_ok=True)
    log = run.folder / "train.log"
    log.write_text(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode:
        last = next((x for x in reversed(done.stderr.splitlines()) if x.strip()), "")
        raise RunError(f"{run.label} seed {run.seed}: the trainer exited with status "
                       f"{done.returncode} ({last.strip()}); its output: {log}",
                       MISTAKE_EXIT_STATUS if done.returncode == MISTAKE_EXIT_STATUS else 1)
    trained = json.loads((run.folder / "config.json").read_text())
    # the compute keys (attention) are resolved for the backend when the run starts
    diff = _differences(_without(run.key["config"], COMPUTE_KEYS),
                        _canonical(_without(trained, (*UNKEYED, *COMPUTE_KEYS))))
    if diff:
        raise RuntimeError(f"{run.folder}: the trainer ran another config than the one "
                           f"keyed: {'; '.join(diff[:5])}")
    curve = read_curve(run.folder / "metrics.jsonl")
    if run.max_iters not in curve:
        raise RunError(f"{run.label} seed {run.seed}: no val loss at the final step "
                       f"{run.max_iters} in {run.folder / 'metrics.jsonl'}", 1)
    tmp = run.folder / (KEY_FILE + ".tmp")
    tmp.write_text(json.dumps(run.key, indent=1, sort_keys=True) + "\n")
    tmp.replace(run.folder / KEY_FILE)
    return curve, wall


def per_optimizer_options(items: Sequence[str], names: Sequence[str]) -> dict[str, list[str]]:
    """`["opt:key=value", ...]` -> `{opt: ["--key=value", ...]}` (trainer options for one
    optimizer's runs only).

    Raises:
      ValueError: an item not of the form `OPTIMIZER:KEY=VALUE` with `OPTIMIZER` one of
        `names`.
    """
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv or not kv.partition("=")[0] or name not in names:
            raise ValueError(f"--set_for={item!r}: expected OPTIMIZER:KEY=VALUE with "
                             f"OPTIMIZER one of {list(names)}")
        out.setdefault(name, []).append(f"--{kv}")
    return out


def _check_option(flag: str, option: str, shown: str | None = None) -> str:
    """`KEY=VALUE` -> `--KEY=VALUE`, refusing a bare key and the keys the tool sets (the
    message names `flag=shown`, default `flag=option`)."""
    kv, shown = option.removeprefix("--"), option if shown is None else shown
    key, eq, _ = kv.partition("=")
    if not eq or not key:
        raise ValueError(f"{flag}={shown!r}: expected KEY=VALUE (a trainer option)")
    own = key.replace("-", "_")
    if own in OWN_KEYS:
        raise ValueError(f"{flag}={shown!r}: the tool sets --{own} itself; use "
                         f"{OWN_KEYS[own]}")
    return f"--{kv}"


def seed_counts(items: Sequence[str], names: Sequence[str]) -> dict[str, int]:
    """`["opt:N", ...]` (`--seeds_for`) -> `{opt: N}`.

    Raises:
      ValueError: not `OPTIMIZER:N` with `OPTIMIZER` one of `names` and `N >= 1`, or an
        optimizer given twice.
    """
    out: dict[str, int] = {}
    for item in items:
        name, _, n = item.partition(":")
        if name not in names or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--seeds_for={item!r}: expected OPTIMIZER:N with OPTIMIZER one "
                             f"of {list(names)} and N >= 1")
        if name in out:
            raise ValueError(f"--seeds_for={item!r}: {name} already has --seeds_for="
                             f"{name}:{out[name]}")
        out[name] = int(n)
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two sequences (ties at their mean rank), or None
    below three pairs."""
    if len(a) < 3:
        return None
    from scipy import stats

    return float(stats.spearmanr(a, b).statistic)


def track3_table(summary: Mapping[str, Any], optimizers: Mapping[str, str]) -> dict:
    """Track 3's rows beside the twin's figures: per label its row, Track 3's steps, the
    twin's final loss and steps to the target, and Spearman's correlation of Track 3's
    steps with the twin's final losses and with its result steps (a row without a result
    counts as the run's length plus one evaluation: last)."""
    rows = {}
    for label, o in summary["optimizers"].items():
        row, steps, _ = TRACK3_TABLE[optimizers[label]]
        last = o["steps"][-1]
        rows[label] = {"row": row, "track3_steps": steps, "final_mean": o["final_mean"],
                       "result_step": o["result_step"],
                       "result_or_last": o["result_step"] or last + 1}
    t3 = [r["track3_steps"] for r in rows.values()]
    return {"rows": rows,
            "spearman_final_loss": spearman(t3, [r["final_mean"] for r in rows.values()]),
            "spearman_result_step": spearman(t3, [r["result_or_last"] for r in rows.values()])}


def _machine() -> dict:
    info = {"platform": platform.platform(), "load_average": list(os.getloadavg())}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info["cpu"] = next((x.split(":", 1)[1].strip() for x in lscpu.splitlines()
                            if x.startswith("Model name")), "?")
    except OSError:
        info["cpu"] = "?"
    return info


# ---------------------------------------------------------------------------- report


def write_report(summary: dict, out: Path, title: str) -> None:
    """`out.json`, `out.md` (tables), `out.png` (`plot_report`) and, with Track 3's table,
    `out_table.png` (`plot_table`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    opt = summary["optimizers"]
    lines = [f"# {title}", "",
             f"target {summary['target']:.3f}; sigma {summary['sigma']:.5f} (std of the "
             f"baseline's final losses); threshold c = {summary['z']:.3f} x sigma = "
             f"{summary['threshold']:.5f}; loss per 100 steps near the end "
             f"{summary['per_100_steps']:.4f} (fit over steps {summary['slope_window'][0]}-"
             f"{summary['slope_window'][1]})", "",
             "| optimizer | seeds | final val loss (mean ± std) | (target - mean) sqrt(n) at the "
             "end | first step with the one-sample rule | mean loss there |",
             "|---|---|---|---|---|---|"]
    for name, o in opt.items():
        std = "" if o["final_std"] is None else f" ± {o['final_std']:.4f}"
        lines.append(f"| {name} | {len(o['seeds'])} | {o['final_mean']:.4f}{std} | "
                     f"{o['score_at_final']:.4f} | {o['result_step'] or 'none'} | "
                     f"{o['result_mean']:.4f} |")
    if summary.get("table"):
        table, fmt = summary["table"], lambda x: "n/a" if x is None else f"{x:+.2f}"
        ratios = {n: r["ratio"] for n, r in (summary.get("step_time") or {}).get(
            "optimizers", {}).items()}
        paired = summary.get("paired", {})
        lines += ["", "Track 3's table on the twin (Track 3's steps to 3.28 beside the twin's "
                  "figures; paired against the first row by seed):", "",
                  "| # | recipe | Track 3 steps | final val loss | steps to target (protocol) "
                  "| final loss vs baseline (p) | step time / baseline |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in table["rows"].items():
            f = paired.get(name, {}).get("final_loss", {})
            diff = ("-" if not f else f"{f['mean_diff']:+.4f} (p "
                    f"{'n/a' if f.get('p') is None else format(f['p'], '.3g')})")
            ratio = ratios.get(name.split("[")[0])
            lines.append(f"| {r['row']} | {name} | {r['track3_steps']} | "
                         f"{r['final_mean']:.4f} | {r['result_step'] or 'none'} | {diff} | "
                         f"{'-' if ratio is None else format(ratio, '.2f')} |")
        lines += ["", f"Spearman's rank correlation of Track 3's steps with the twin's final "
                  f"losses {fmt(table['spearman_final_loss'])}, with its steps to the target "
                  f"{fmt(table['spearman_result_step'])} (+1: the same order)."]
    lines += ["", "| old | new | compared at | pairwise score (new better) | new better? | "
              "reverse score | old better? |", "|---|---|---|---|---|---|---|"]
    for p in summary["pairs"]:
        at = "result steps" if p["at"] == "result" else "last step (a result is missing)"
        lines.append(f"| {p['old']} | {p['new']} | {at} | {p['score']:.4f} | {p['better']} "
                     f"| {p['reverse_score']:.4f} | {p['old_better']} |")
    if summary.get("paired"):
        base = next(iter(opt))
        lines += ["", f"Paired by seed against {base} (two-sided paired t-test; differences "
                  "are optimizer - baseline, negative = better; steps to the target per seed "
                  "where both runs reach it):", "",
                  "| optimizer | final loss diff (mean ± std) | p | steps to target per seed | "
                  "steps diff (mean, pairs) | p |", "|---|---|---|---|---|---|"]
        fmt = lambda x, f: "n/a" if x is None else format(x, f)
        p_of = lambda test: (f"n/a ({test['note']})" if test.get("note") else
                             fmt(test["p"], ".3g"))
        for name, test in summary["paired"].items():
            f, st = test["final_loss"], test["steps_to_target"]
            per_seed = ", ".join(str(v) if v is not None else "-" for v in
                                 opt[name]["seed_steps_to_target"].values())
            lines.append(f"| {name} | {fmt(f['mean_diff'], '+.4f')} ± "
                         f"{fmt(f['std_diff'], '.4f')} | {p_of(f)} | {per_seed} | "
                         f"{fmt(st['mean_diff'], '+.1f')} ({st['n']}) | {p_of(st)} |")
    if summary.get("step_time"):
        st = summary["step_time"]
        # --flops of the step-time tool: each step's FLOPs from its compiled program
        flops = all("floor" in r for r in st["optimizers"].values())
        lines += ["", f"Step time (`benchmarks.track3_step_time`, {st['date']}, {st['cpu']}, "
                  f"bf16 flags {st['bf16_flags']}, load {st['load'][0][0]:.1f} -> "
                  f"{st['load'][1][0]:.1f}; {st['rounds']} rounds x {st['steps']} steps, "
                  "alternating in one process):", "",
                  "| optimizer | options | ms per step | / baseline | per-round range |"
                  + (" GFLOP (refreshing by eigh) | FLOP floor |" if flops else ""),
                  "|---|---|---|---|---|" + ("---|---|" if flops else "")]
        for name, r in st["optimizers"].items():
            lines.append(f"| {name} | {' '.join(r['options']) or '-'} | "
                         f"{r['ms_per_step']:.0f} | {r['ratio']:.2f} | "
                         f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f} |"
                         + (f" {r['gflop']:.2f} ({r['gflop_eigh']:.2f}) | {r['floor']:.2f} |"
                            if flops else ""))
    lines += ["", "Per-seed val loss at every evaluation:", ""]
    for name, o in opt.items():
        lines.append(f"- {name}: steps {o['steps']}")
        for seed, row in zip(o["seeds"], o["losses"], strict=True):
            lines.append(f"  - seed {seed}: " + ", ".join(f"{x:.4f}" for x in row))
    if summary.get("runs"):
        lines += ["", "Runs (folders named by their key: config, data and code):", ""]
        for name, r in summary["runs"].items():
            lines.append(f"- {name}: {r['folder']}")
    for r in summary.get("reused_from", []):
        lines += ["", f"Curves of {', '.join(r['labels'])} from {r['report']} ({r['check']})."]
    if "machine" in summary:
        m = summary["machine"]
        lines += ["", f"Machine: {m['cpu']}, load average at the end {m['load_average']}; "
                  f"runs' wall times (s): {summary.get('wall_s')}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot_report(summary, title).savefig(out.with_suffix(".png"), dpi=110)
    if summary.get("table"):
        plot_table(summary).savefig(out.with_name(out.name + "_table.png"), dpi=110)


def plot_report(summary: Mapping[str, Any], title: str) -> Any:
    """The report's figure: each optimizer's mean ± std val loss, over the whole run and
    over its second half, its result step dotted, and the target as a dashed line
    labelled with its value in both panels.

    Draws on a bare `matplotlib.figure.Figure` (pyplot's backend is left alone).

    Returns:
      The `matplotlib.figure.Figure`.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for ax, tail in zip(axes, (False, True), strict=True):
        for name, o in summary["optimizers"].items():
            steps, mean, std = np.array(o["steps"]), np.array(o["mean"]), np.array(o["std"])
            keep = steps >= (0.5 * steps[-1] if tail else 0)
            line, = ax.plot(steps[keep], mean[keep], label=f"{name} (n={len(o['seeds'])})")
            ax.fill_between(steps[keep], (mean - std)[keep], (mean + std)[keep], alpha=0.2,
                            color=line.get_color())
            if o["result_step"] is not None:
                ax.axvline(o["result_step"], color=line.get_color(), ls=":")
        ax.axhline(summary["target"], color="k", lw=0.8, ls="--",
                   label=f"target {summary['target']:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.set_title("second half" if tail else title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_table(summary: Mapping[str, Any]) -> Any:
    """Track 3's table against the twin: each row's Track 3 steps to 3.28 (x, log scale)
    and the twin's final val loss (y, mean ± std over the seeds), labelled with its row
    number, the twin's target dashed and Spearman's rho in the title.

    Returns:
      The `matplotlib.figure.Figure`.
    """
    from matplotlib.figure import Figure

    table, opt = summary["table"], summary["optimizers"]
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, r in table["rows"].items():
        o = opt[name]
        ax.errorbar(r["track3_steps"], o["final_mean"], yerr=o["final_std"] or 0.0, fmt="o",
                    ms=4, capsize=2, color="C1" if r["result_step"] else "C0")
        ax.annotate(f"#{r['row']}", (r["track3_steps"], o["final_mean"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.axhline(summary["target"], color="k", lw=0.8, ls="--",
               label=f"the twin's target {summary['target']:.3f}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter("{x:.0f}")
    ax.xaxis.set_minor_formatter("{x:.0f}")
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("Track 3's steps to 3.28 (its table)")
    ax.set_ylabel("the twin's final val loss (orange: reaches its target)")
    rho = table["spearman_final_loss"]
    ax.set_title("Track 3's table on the twin: Spearman's rho "
                 + ("n/a" if rho is None else f"{rho:+.2f}"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------- the tool


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes raise (so they end in the tool's one line, exit 2)."""

    def error(self, message: str):
        raise ValueError(message)


class _Help(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help already ends with its default."""


DESCRIPTION = """\
Runs modded-nanogpt Track 3's optimizer protocol with the trainer: each optimizer for a
number of seeds (one `python -m train` process a run), then the benchmark's statistics
on their val losses (the one-sample rule against a target, the pairwise rule between
optimizers, and a paired t-test by seed against the baseline), written as a JSON, a
Markdown and a PNG report.

A finished run is reused only when its key (the trainer's whole resolved config, the data
and the code) equals the one asked for; runs live in folders named by that key. Every
name, option, count and path is checked before the first run: a mistake ends with one
`error:` line and exit status 2."""

EPILOG = """\
example:
  python -m benchmarks.track3 --optimizers=track3_baseline,snoo_track3_baseline \\
      --seeds=5 --preset=track3_cpu"""


def parser() -> argparse.ArgumentParser:
    """The tool's command line."""
    p = _Parser(prog="python -m benchmarks.track3", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=_Help, add_help=False)
    add = p.add_argument
    add("-h", "--help", action="help", help="Show this help and exit.")
    add("--optimizers", default="track3_baseline,snoo_track3_baseline",
        help="Comma-separated optimizer names from the trainer's registry (python -m train "
             "--help lists them); the first is the baseline, whose seeds give sigma, the "
             "target and the loss per 100 steps. (default: %(default)s)")
    add("--seeds", type=int, default=5,
        help="Runs per optimizer, with --seed=0..N-1 (the seed changes the init only; the "
             "data order is the preset's). (default: %(default)s)")
    add("--preset", default="track3_cpu",
        help="The trainer preset every run starts from. (default: %(default)s)")
    add("--target", type=float, default=None,
        help="The target val loss. (default: the smallest 3-decimal loss the baseline's "
             "seeds pass at its last step, mean + c / sqrt(n) rounded up)")
    add("--sigma", type=float, default=None,
        help="The seed-to-seed std of the final val loss; c = 3.09 sigma. (default: the "
             f"std of the baseline's final losses, which needs at least {MIN_SIGMA_SEEDS} "
             "baseline seeds)")
    add("--slope_frac", type=float, default=0.2,
        help="The last fraction of the baseline's run over which the loss per 100 steps is "
             "fitted; it must hold at least two evaluations. (default: %(default)s)")
    add("--runs_dir", default="out/track3_runs",
        help="Where the runs live, as RUNS_DIR/PRESET/OPTIMIZER/KEY/seedK (relative to the "
             "current folder; relative --data paths are read from the repository, where "
             "the trainer runs). (default: %(default)s)")
    add("--out", default=None,
        help="The report's path without suffix; .json, .md and .png are written. Pass "
             "benchmarks/results/NAME to replace a committed report on purpose. (default: "
             "out/track3_reports/PRESET in the current folder)")
    add("--rerun", action="store_true",
        help="Train every run again, even where a run with the same key is complete. "
             "(default: reuse such runs)")
    add("--step_time", default=None, metavar="JSON",
        help="Add the step-time ratios of this python -m benchmarks.track3_step_time --out "
             "file to the report. (default: none)")
    add("--title", default=None,
        help="The report's title. (default: Track-3 protocol, PRESET)")
    add("--set", action="append", default=[], metavar="KEY=VALUE",
        help="A trainer option for every run (repeatable), e.g. max_iters=200; it is part "
             "of the runs' key. (default: none)")
    add("--set_for", action="append", default=[], metavar="OPTIMIZER:KEY=VALUE",
        help="A trainer option for one optimizer's runs (repeatable), e.g. "
             "muloco_normuonh:init=hyperball; its name in the report carries it. "
             "(default: none)")
    add("--seeds_for", action="append", default=[], metavar="OPTIMIZER:N",
        help="Seeds 0..N-1 for one optimizer instead of --seeds (repeatable). (default: "
             "--seeds for every optimizer)")
    add("--table", action="store_true",
        help="Run Track 3's table as far as the registry has it (TRACK3_TABLE: every row's "
             "recipe with its network's options, #36 first) instead of --optimizers, and "
             "add the table with Track 3's steps and the rank correlation of the two "
             "orders to the report. (default: off)")
    add("--reuse_report", action="append", default=[], metavar="JSON",
        help="Take the curves of the optimizers (and seeds) that an earlier report holds "
             "instead of training them; its runs must have had the same config and data. "
             "Repeatable: a run two reports hold with different curves is refused. "
             "(default: none)")
    return p


@dataclasses.dataclass
class Plan:
    """Everything `main` will do, checked: the runs to train or reuse and the report."""

    args: argparse.Namespace
    labels: list[str]
    runs: list[Run]
    reused: dict[str, dict[int, dict[int, float]]]
    reused_from: list[dict[str, Any]]
    out: Path
    extra: list[str]
    step_time: dict[str, Any] | None
    reused_by: dict[tuple[str, int], str]


def _read_json(flag: str, path: str) -> dict[str, Any]:
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag}={path}: no such file") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag}={path}: not a readable JSON file ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}={path}: expected a JSON object")
    return value


def _check_writable(flag: str, value: object, folder: Path) -> None:
    """`folder` exists (made here) and takes a file: tried, as permissions alone do not
    tell (a read-only mount, root)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag}={value}: cannot write in {folder} ({err.strerror or err})"
                         ) from None


def evaluation_steps(run: Run) -> list[int]:
    """The steps where the trainer evaluates `run` (`train.loop.step_actions` of a fresh
    run: its cadence, its checkpoint steps and the last step)."""
    from train.config import parse_args
    from train.loop import step_actions

    config = parse_args(list(run.argv)).run
    return [s for s in range(run.max_iters + 1)
            if step_actions(s, start=0, run=config).evaluate]


def _check_statistics(args: argparse.Namespace, base: list[Run]) -> None:
    """What `summarize` will need of the baseline, before any run."""
    if args.sigma is None and len(base) < MIN_SIGMA_SEEDS:
        raise ValueError(f"{base[0].label} (the baseline) has {len(base)} seed(s): measuring "
                         f"sigma needs at least {MIN_SIGMA_SEEDS}; pass --seeds (or "
                         f"--seeds_for={base[0].label}:N) with N >= {MIN_SIGMA_SEEDS}, or "
                         "--sigma=VALUE")
    if args.sigma is not None and not (math.isfinite(args.sigma) and args.sigma > 0):
        raise ValueError(f"--sigma={args.sigma}: expected a seed-to-seed std > 0")
    if args.target is not None and not math.isfinite(args.target):
        raise ValueError(f"--target={args.target}: expected a finite val loss")
    if not 0 < args.slope_frac <= 1:
        raise ValueError(f"--slope_frac={args.slope_frac}: expected a fraction in (0, 1]")
    steps = evaluation_steps(base[0])
    window = [s for s in steps if s >= (1 - args.slope_frac) * steps[-1]]
    if len(window) < 2:
        raise ValueError(f"{base[0].label} (the baseline) evaluates at {window} in the last "
                         f"--slope_frac={args.slope_frac} of its {base[0].max_iters} steps; "
                         "the loss per 100 steps needs two evaluations there: raise "
                         "--slope_frac or evaluate more often (--set eval_interval_tail=N)")


def _reuse_all(paths: Sequence[str], args: argparse.Namespace, extra: list[str],
               runs: list[Run]) -> tuple[dict[str, dict[int, dict[int, float]]],
                                         list[dict[str, Any]], dict[tuple[str, int], str]]:
    """The curves every `--reuse_report` gives (`_reuse`), by label and seed, what each
    report gave, and which report gave each run (the first that holds it); a run two
    reports hold with different curves is refused (which one is meant is not said)."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    given: dict[tuple[str, int], str] = {}
    sources = []
    for path in paths:
        held, source = _reuse(path, args, extra, runs)
        for label, by_seed in held.items():
            for seed, curve in by_seed.items():
                if (label, seed) in given and curves[label][seed] != curve:
                    raise ValueError(f"--reuse_report={path}: {label} seed {seed} is also in "
                                     f"--reuse_report={given[label, seed]} with another "
                                     f"curve; pass one of them")
                given.setdefault((label, seed), path)
                curves.setdefault(label, {}).setdefault(seed, curve)
        if source is not None:
            sources.append(source)
    return curves, sources, given


def _reuse(path: str, args: argparse.Namespace, extra: list[str], runs: list[Run]
           ) -> tuple[dict[str, dict[int, dict[int, float]]], dict[str, Any] | None]:
    """The curves `--reuse_report` gives, by label and seed, after checking that its runs
    are the ones asked for."""
    old = _read_json("--reuse_report", path)
    if old.get("preset") != args.preset or "optimizers" not in old:
        raise ValueError(f"--reuse_report={path}: a report of preset {old.get('preset')!r}, "
                         f"not {args.preset!r}")
    wanted: dict[str, list[Run]] = {}
    for run in runs:
        held = old["optimizers"].get(run.label)
        if held is not None and run.seed in held["seeds"]:
            wanted.setdefault(run.label, []).append(run)
    if not wanted:
        return {}, None
    by_key = old.get("runs")
    if by_key is None:  # an older report: no keys, so what it says of its options
        if old.get("extra", []) != extra:
            raise ValueError(f"--reuse_report={path}: its runs had --set options "
                             f"{old.get('extra')}, not {extra}")
        check = "an older report without run keys: preset, --set options and evaluation " \
                "steps checked"
    else:
        check, code_differs = "config and data checked", []
        for label, group in wanted.items():
            held = by_key.get(label, {}).get("key")
            if held is None:
                raise ValueError(f"--reuse_report={path}: no run key for {label} in it")
            ask = key_without_seed(group[0])
            diff = _differences({k: held[k] for k in ("config", "data")},
                                {k: ask[k] for k in ("config", "data")})
            if diff:
                raise ValueError(f"--reuse_report={path}: {label}'s runs there differ from "
                                 f"the ones asked for: {'; '.join(diff[:3])}")
            if held["code"] != ask["code"]:
                code_differs.append(label)
        if code_differs:
            check += f"; trained with another code version: {', '.join(code_differs)}"
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for label, group in wanted.items():
        held = old["optimizers"][label]
        steps = evaluation_steps(group[0])
        if held["steps"] != steps:
            raise ValueError(f"--reuse_report={path}: {label} was evaluated at steps "
                             f"{held['steps'][:3]}...{held['steps'][-2:]}, the runs asked for "
                             f"at {steps[:3]}...{steps[-2:]}")
        curves[label] = {run.seed: dict(zip(held["steps"],
                                            held["losses"][held["seeds"].index(run.seed)],
                                            strict=True)) for run in group}
    return curves, {"report": path, "labels": list(curves), "check": check}


def plan(argv: Sequence[str] | None) -> Plan:
    """Parse and check the command line, and resolve every run; nothing is trained.

    Raises:
      ValueError: any mistake (one line for the user); FileNotFoundError: missing data.
    """
    if str(ROOT) not in sys.path:  # `python benchmarks/track3.py` from anywhere
        sys.path.insert(0, str(ROOT))
    from train.config import get_preset

    args = parser().parse_args(argv)
    get_preset(args.preset)
    extra = [_check_option("--set", kv) for kv in args.set]
    if args.table:
        from optax_snoo import recipes

        table = [n for n in TRACK3_TABLE if n in recipes.REGISTRY]
        args.optimizers = ",".join(table)
        given = {item.partition(":")[0] for item in args.set_for}
        args.set_for = [*args.set_for, *(f"{n}:{o}" for n in table if n not in given
                                          for o in table_options(n, args.preset, extra))]
        args.title = args.title or f"Track 3's table on the twin ({args.preset})"
    names = [x for x in args.optimizers.split(",") if x]
    if not names:
        raise ValueError(f"--optimizers={args.optimizers!r}: expected at least one name")
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--optimizers={args.optimizers!r}: {twice} named twice")
    if args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: expected a count >= 1")
    own = per_optimizer_options(args.set_for, names)
    for item in args.set_for:
        _check_option("--set_for", item.partition(":")[2], shown=item)
    seeds_for = seed_counts(args.seeds_for, names)
    out = Path(args.out if args.out else Path("out", "track3_reports", args.preset)).absolute()
    runs_dir = Path(args.runs_dir).absolute()
    _check_writable("--out", args.out or out, out.parent)
    _check_writable("--runs_dir", args.runs_dir, runs_dir)
    step_time = _read_json("--step_time", args.step_time) if args.step_time else None
    if step_time is not None and not isinstance(step_time.get("optimizers"), dict):
        raise ValueError(f"--step_time={args.step_time}: expected the JSON of python -m "
                         "benchmarks.track3_step_time --out (no 'optimizers' in it)")
    code, data = code_version(), {}
    labels, runs = [], []
    for name in names:
        label = name + "".join(f"[{kv[2:]}]" for kv in own.get(name, []))
        labels.append(label)
        for seed in range(seeds_for.get(name, args.seeds)):
            try:
                runs.append(plan_run(label, args.preset, name, seed,
                                     [*extra, *own.get(name, [])], runs_dir, code=code,
                                     data=data, build=seed == 0))
            except ValueError as err:
                raise ValueError(f"{label}: {err}") from None
    _check_statistics(args, [r for r in runs if r.label == labels[0]])
    reused, reused_from, reused_by = _reuse_all(args.reuse_report, args, extra, runs)
    return Plan(args, labels, runs, reused, reused_from, out, extra, step_time, reused_by)


def _shown(path: Path) -> str:
    """`path` relative to the current folder where it lies in it (a report names no
    machine's absolute paths it need not)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def execute(p: Plan) -> dict:
    """Train (or reuse) the plan's runs, summarize and write the report."""
    args = p.args
    curves: dict[str, dict[int, dict[int, float]]] = {label: {} for label in p.labels}
    walls: dict[str, Any] = {}
    for run in p.runs:
        name = f"{run.label} seed {run.seed}"
        if run.seed in p.reused.get(run.label, {}):
            curve = curves[run.label][run.seed] = p.reused[run.label][run.seed]
            walls[f"{run.label}/{run.seed}"] = "reused"
            print(f"{name}: final val loss {curve[max(curve)]:.4f} (from "
                  f"{p.reused_by[run.label, run.seed]})", flush=True)
            continue
        curve, wall = run_one(run, args.rerun)
        curves[run.label][run.seed] = curve
        walls[f"{run.label}/{run.seed}"] = None if wall is None else round(wall, 1)
        print(f"{name}: final val loss {curve[run.max_iters]:.4f} "
              + (f"(reused {run.folder})" if wall is None else f"({wall:.0f} s)"), flush=True)
    summary = summarize(curves, target=args.target, sigma=args.sigma,
                        slope_frac=args.slope_frac)
    first = {}
    for run in p.runs:
        first.setdefault(run.label, run)
    summary.update(
        preset=args.preset, extra=p.extra, machine=_machine(), wall_s=walls,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        runs={label: {"optimizer": r.optimizer, "options": list(r.argv[3:]),
                      "folder": _shown(r.folder.parent), "key_hash": r.folder.parent.name,
                      "key": key_without_seed(r)} for label, r in first.items()})
    if p.reused_from:
        summary["reused_from"] = p.reused_from
    if p.step_time:
        summary["step_time"] = p.step_time
    if args.table:
        summary["table"] = track3_table(summary, {run.label: run.optimizer for run in p.runs})
    write_report(summary, p.out, args.title or f"Track-3 protocol, {args.preset}")
    print(p.out.with_suffix(".md").read_text())
    print(f"report: {p.out}.{{json,md,png}}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: plan (every mistake refused in one line, exit status 2, before
    any run), then train and report; returns the exit status."""
    from train.errors import one_line

    try:
        checked = plan(argv)
    except (ValueError, OSError) as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return MISTAKE_EXIT_STATUS
    try:
        execute(checked)
    except RunError as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return err.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
