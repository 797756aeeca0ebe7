"""Checkpoints: an Orbax `CheckpointManager` keeping the latest and the best (val loss) steps.

A checkpoint is a `Composite` of two items:
- `state`: `StandardSave` of the whole train state (params, optimizer state, step, RNG key
  data), restored with the current run's shardings;
- `meta`: `JsonSave` of the resolved config, the data's tokenizer (`tokenizer`, a
  `train.tokenizer` description) and vocabulary size, and the data position (the step:
  batches are a function of `(seed, step)`).

Saving is asynchronous; a step already on disk is never overwritten, and Orbax writes
each step into a temporary folder renamed only when complete, so a killed process leaves
the earlier steps whole (its temporary folder is removed at the next start). The two
latest steps are kept besides the best (lowest val loss), also across resumes: each
step's val loss is written with it (Orbax's `metrics` item), so a later run's manager
ranks the steps an earlier run wrote. Two latest, so a damaged latest step has a fallback:
`restore_latest` warns, moves the damaged folder to `<directory>_damaged/`, and restores
the newest step that reads back. A failed write (e.g. a full disk) raises
`CheckpointSaveError` naming the steps still on disk. Before restoring, the saved
config's model and optimizer fields are compared with the current ones.

Example:
  >>> ckpt = Checkpointer("/tmp/run/checkpoints")          # doctest: +SKIP
  >>> ckpt.save(100, state, {"config": {...}}, val_loss=1.9)  # doctest: +SKIP
  >>> state, meta = ckpt.restore(ckpt.latest_step(), like=state)  # doctest: +SKIP

References:
  Orbax checkpointing, "CheckpointManager",
  https://orbax.readthedocs.io/en/latest/guides/checkpoint/api_refactor.html, 2024.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from optax_snoo import recipes
from optax_snoo._src.recipes.stacks import ScheduleHyperparameters
from train.config import TrainConfig, flat_dict, group_fields

__all__ = ["CheckpointSaveError", "CheckpointWarning", "Checkpointer", "check_compatible",
           "saved_tokenizer"]


class CheckpointWarning(UserWarning):
    """A checkpoint on disk could not be read back and was set aside."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (e.g. a full disk); the earlier ones are intact."""


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                     groups: Iterable[str] = ("model", "optimizer"), where: str = "") -> None:
    """Raise if the saved and current configs differ in any field of `groups`.

    A key the saved config lacks (added since it was written) is compared at its
    default, which is how that run trained.

    Args:
      saved: flat config dict stored in a checkpoint.
      current: config dict of this run.
      groups: config groups that must match (`train.config.GROUPS`).
      where: the checkpoint's location, for the message.

    Raises:
      ValueError: listing every differing key with both values (on one line).
    """
    # A key the checkpoint's version did not have yet ran at its default.
    given, saved = saved, {**flat_dict(TrainConfig()), **saved}
    diffs = [f"{key}: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
             for group in groups for key in group_fields(group)
             if saved.get(key) != current.get(key)]
    if "optimizer" in groups and saved.get("optimizer") == current.get("optimizer"):
        diffs += _hyperparameter_diffs(given, current, recipes.get(current["optimizer"]))
    if diffs:
        location = f" in {where}" if where else ""
        raise ValueError(f"cannot resume from the checkpoint{location}: its config differs "
                         f"in {len(diffs)} field(s): " + "; ".join(diffs) +
                         ". Run with the checkpoint's values or choose another --out_dir.")


#: The schedule's shape, which a resume may change as it may `max_iters` (the loop warns
#: when that moves the logged lr).
_SCHEDULE_KEYS = frozenset(f.name for f in dataclasses.fields(ScheduleHyperparameters))


def _hyperparameter_diffs(saved: Mapping[str, Any], current: Mapping[str, Any],
                          recipe: recipes.Recipe) -> list[str]:
    """The recipe's hyperparameters (not its schedule's shape) that differ; one that
    either side lacks (added since, or not read there) is at the recipe's default."""
    defaults = recipe.defaults
    diffs = []
    for key in recipe.hyperparameters.names():
        if key in _SCHEDULE_KEYS:
            continue
        old, new = (values.get(key, getattr(defaults, key)) for values in (saved, current))
        if old != new:
            diffs.append(f"{key}: checkpoint has {old!r}, this run has {new!r}")
    return diffs


def _val_loss(metrics: Mapping[str, float]) -> float:
    return metrics["val_loss"]


def _orbax_leftover(unraisable: Any) -> bool:
    """An unfinished Orbax read coroutine, or its callback after the event loop closed."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    err = unraisable.exc_value
    return isinstance(err, RuntimeError) and str(err) == "Event loop is closed"


@contextlib.contextmanager
def _quiet_failed_reads():
    """Drop the reports of a failed read's leftovers (each with TensorStore's whole spec).

    A damaged step makes Orbax abandon one read coroutine per array; when collected, each
    would print an "Exception ignored in" traceback. The failure itself is reported once,
    as a `CheckpointWarning`; the leftovers are collected here, under this hook.
    """
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _orbax_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = previous


class Checkpointer:
    """Latest + best-by-val-loss checkpoints of a train state, in `directory`.

    Args:
      directory: where the step folders live (created on first save).
      async_save: write in a background thread (`wait` blocks until done).
      read_only: only read (sampling, evaluation): `directory` must exist and nothing
        is created, cleaned up or deleted in it.

    Raises:
      FileNotFoundError: `read_only` and `directory` is not a folder.
    """

    def __init__(self, directory: str | os.PathLike, *, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"no checkpoints folder {self.directory}")
        policy = ocp.checkpoint_managers.AnyPreservationPolicy([
            ocp.checkpoint_managers.LatestN(2),  # a fallback if the newest is damaged
            # BestN keeps the LARGEST metric unless reverse=True.
            ocp.checkpoint_managers.BestN(get_metric_fn=_val_loss, reverse=True, n=1),
        ])
        # `best_fn` makes Orbax write each step's metrics to disk (without it they live
        # only in memory, and a resumed run's policy sees the earlier steps as metric-less
        # and keeps them all); the preservation policy above still decides what is kept.
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, best_fn=_val_loss, best_mode="min",
            enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only,
            create=False)  # `save` creates it: a run that fails to start leaves no folder
        self.read_only = read_only
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: list[int] = []  # saves started and not yet confirmed on disk
        self._closed = False

    def steps(self) -> list[int]:
        """Steps with a checkpoint on disk, ascending."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or `None`."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: Mapping[str, Any],
             val_loss: float | None = None) -> None:
        """Start writing `state` and `meta` at `step` (asynchronously).

        Raises:
          FileExistsError: if `step` is already saved (checkpoints are never overwritten).
        """
        if self.read_only:
            raise PermissionError(f"{self.directory} was opened read-only")
        if step in self.manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending.append(step)
        with self._save_errors():  # also raises a failure of the previous async write
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
                metrics=metrics)

    @contextlib.contextmanager
    def _save_errors(self):
        """Turn a failure while writing into `CheckpointSaveError` naming what is safe."""
        try:
            yield
        except Exception as err:
            with contextlib.suppress(Exception):  # let other pending writes land first
                self.manager.wait_until_finished()
            self.manager.reload()
            safe = self.steps()
            failed, self._pending = [s for s in self._pending if s not in safe], []
            raise CheckpointSaveError(
                f"writing checkpoint step(s) {failed} to "
                f"{self.directory} failed: {err}. The checkpoints already there are intact "
                f"(steps {safe}); free space or fix the directory, then continue with "
                "--resume.") from err

    def check_for_errors(self) -> None:
        """Raise `CheckpointSaveError` now if a finished asynchronous write failed."""
        with self._save_errors():
            self.manager.check_for_errors()

    def restore_latest(self, like: Any, check: Callable[[dict[str, Any]], None] = lambda m: None,
                       ) -> tuple[Any, dict[str, Any], int]:
        """Restore the newest step that reads back, setting damaged newer steps aside.

        Args:
          like: as in `restore`.
          check: called with each step's meta before its state is read; what it raises
            (e.g. a config mismatch) propagates: it is not damage.

        Returns:
          `(state, meta, step)`.

        Raises:
          FileNotFoundError: no step could be read; lists every step's error.
        """
        failures = []
        with _quiet_failed_reads():
            found = self._restore_newest(like, check, failures)
        if found is not None:
            return found
        raise FileNotFoundError(f"no checkpoint in {self.directory} could be restored:\n  "
                                + "\n  ".join(failures or ["(there are none)"]))

    def _restore_newest(self, like, check, failures):
        for step in reversed(self.steps()):
            try:
                meta = self.restore_meta(step)
            except Exception as err:  # any read failure is damage
                failures.append(self._set_aside(step, err))
                continue
            check(meta)
            try:
                state, meta = self.restore(step, like)
            except Exception as err:
                failures.append(self._set_aside(step, err))
                continue
            return state, meta, step
        return None

    def _set_aside(self, step: int, err: Exception) -> str:
        """Warn about a damaged step and move its folder out of the manager's way."""
        source = self.directory / str(step)
        target = self.directory.with_name(self.directory.name + "_damaged") / (
            f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint set aside {step}")
        self.manager.reload()
        reason = (str(err).splitlines() or [""])[0][:200]
        message = f"step {step} ({source}): {type(err).__name__}: {reason}"
        warnings.warn(f"checkpoint {message}; it cannot be restored and was moved to "
                      f"{target}; trying an earlier step", CheckpointWarning, stacklevel=4)
        return message

    def restore_meta(self, step: int) -> dict[str, Any]:
        """The JSON item of `step` (config, vocabulary, data position)."""
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restore `step` into the structure, dtypes and shardings of the tree `like`.

        Returns:
          `(state, meta)`.

        Raises:
          ValueError: if the saved tree does not fit `like` (the message names both).
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"checkpoint step {step} in {self.directory} does not match this "
                             f"run's train state: {err}") from None
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        with self._save_errors():
            self.manager.wait_until_finished()
        self._pending = []

    def close(self) -> None:
        """Finish pending saves and the clean-up of leftover temporary folders, and release
        the manager (once: a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            # Orbax awaits its clean-up thread only in `save`: a run stopped before its
            # first save (a refused --resume) would exit with it running, and the thread
            # would print a traceback at interpreter shutdown.
            cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
            if cleanup is not None:
                cleanup.result()
        finally:
            self.manager.close()


def saved_tokenizer(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer description in a checkpoint's JSON item (`train.tokenizer.from_meta`
    reads it); checkpoints written before token datasets stored the characters (`vocab`)."""
    if "tokenizer" in meta:
        return dict(meta["tokenizer"])
    return {"kind": "chars", "chars": meta["vocab"]}
