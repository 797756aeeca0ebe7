"""Checkpoints: an Orbax `CheckpointManager` keeping the latest and the best (val loss) steps.

A checkpoint is a `Composite` of two items:
- `state`: `StandardSave` of the whole train state (params, optimizer state, step, RNG key
  data), restored with the current run's shardings;
- `meta`: `JsonSave` of the resolved config, the vocabulary and the data position (the
  step: batches are a function of `(seed, step)`).

Saving is asynchronous; a step already on disk is never overwritten. Before restoring,
the saved config's model and optimizer fields are compared with the current ones.

Example:
  >>> ckpt = Checkpointer("/tmp/run/checkpoints")          # doctest: +SKIP
  >>> ckpt.save(100, state, {"config": {...}}, val_loss=1.9)  # doctest: +SKIP
  >>> state, meta = ckpt.restore(ckpt.latest_step(), like=state)  # doctest: +SKIP

References:
  Orbax checkpointing, "CheckpointManager",
  https://orbax.readthedocs.io/en/latest/guides/checkpoint/api_refactor.html, 2024.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from train.config import group_fields

__all__ = ["Checkpointer", "check_compatible"]


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                     groups: Iterable[str] = ("model", "optimizer"), where: str = "") -> None:
    """Raise if the saved and current configs differ in any field of `groups`.

    Args:
      saved: config dict stored in a checkpoint.
      current: config dict of this run.
      groups: config groups that must match (`train.config.GROUPS`).
      where: the checkpoint's location, for the message.

    Raises:
      ValueError: listing every differing key with both values.
    """
    diffs = [f"{key}: checkpoint has {saved.get(key, '<missing>')!r}, this run has "
             f"{current.get(key)!r}"
             for group in groups for key in group_fields(group)
             if saved.get(key, "<missing>") != current.get(key)]
    if diffs:
        location = f" in {where}" if where else ""
        raise ValueError(f"cannot resume from the checkpoint{location}: its config differs "
                         f"in {len(diffs)} field(s):\n  " + "\n  ".join(diffs) +
                         "\nRun with the checkpoint's values or choose another --out_dir.")


class Checkpointer:
    """Latest + best-by-val-loss checkpoints of a train state, in `directory`.

    Args:
      directory: where the step folders live (created on first save).
      async_save: write in a background thread (`wait` blocks until done).
    """

    def __init__(self, directory: str | os.PathLike, *, async_save: bool = True):
        self.directory = Path(directory).absolute()
        policy = ocp.checkpoint_managers.AnyPreservationPolicy([
            ocp.checkpoint_managers.LatestN(1),
            # BestN keeps the LARGEST metric unless reverse=True.
            ocp.checkpoint_managers.BestN(get_metric_fn=lambda m: m["val_loss"],
                                          reverse=True, n=1),
        ])
        options = ocp.CheckpointManagerOptions(preservation_policy=policy,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

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
        if step in self.manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
            metrics=metrics)

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
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
