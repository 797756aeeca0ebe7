"""K-FAC in the trainer: its train step, the warm start and the refresh event log.

`setup` builds what `train.loop.run` needs for optimizers that take curvature (SPEC §4.3,
strategies 4 and 5): `train.step.make_train_step` with a `curvature_fn`, the warm-started
state and a `RefreshLog`. The curvature train step returns the K-FAC state's latest
`KfacRefreshEvent` with its metrics every step. `RefreshLog` keeps those device scalars
without reading them, and on the trainer's logging steps fetches them in one transfer and
writes one row to `refresh_events.jsonl` per new refresh (new: the event's counter grew).
`plot_refresh_events` draws the refreshes over the learning-rate curve.

Example:
  >>> log = RefreshLog("out/refresh_events.jsonl")  # doctest: +SKIP
  >>> log.add(metrics.pop("kfac_event"))  # every step, no host sync  # doctest: +SKIP
  >>> log.flush()  # on logging steps  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_snoo import kfac as kfac_lib
from train.config import TrainConfig
from train.data import CharDataset
from train.optimizers import kfac_curvature_fn, kfac_schedule
from train.step import make_curvature_estimate, make_train_step

__all__ = ["RefreshLog", "finish", "plot_refresh_events", "setup", "warm_start_state"]


class RefreshLog:
    """Rows of `refresh_events.jsonl`: step, lr, eigenvalue range of A and G, clipped count.

    Args:
      path: the JSONL file.
      start: the step training starts from; a resumed run (``start > 0``) keeps the
        existing rows of earlier steps (later ones are redone) and continues their counter.
    """

    def __init__(self, path: str | os.PathLike, *, start: int = 0):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if start > 0 and self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines()
                    if line.strip()]
            self.rows = [row for row in rows if row["step"] < start]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self._count = self.rows[-1]["refresh"] if self.rows else 0
        self._pending: list[Any] = []

    def add(self, event: Any) -> None:
        """Keep one step's `KfacRefreshEvent` (device arrays; nothing is read yet)."""
        self._pending.append(event)

    def flush(self) -> list[dict[str, Any]]:
        """Fetch the kept events (one transfer) and write a row per new refresh.

        Refreshes are at most one per step, so a counter that grew since the previous kept
        event marks that step's refresh. Returns the new rows.
        """
        events, self._pending = jax.device_get(self._pending), []
        new = []
        for e in events:
            count = int(e.count)
            if count <= self._count:
                continue
            self._count = count
            new.append({"refresh": count, "step": int(e.step), "lr": float(e.learning_rate),
                        "a_eig_max": float(e.a_max), "a_eig_min": float(e.a_min),
                        "g_eig_max": float(e.g_max), "g_eig_min": float(e.g_min),
                        "num_clipped": int(e.num_clipped)})
        if new:
            with self.path.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in new)
            self.rows += new
        return new


def warm_start_state(state: dict, estimate: Callable[[Any, Any, Any], Any],
                     batches: Sequence[tuple[Any, Any]], shardings: Any) -> dict:
    """`state` with its K-FAC factors seeded from `batches` (`optax_snoo.kfac.warm_start`).

    Args:
      state: the train state (step 0).
      estimate: `estimate(params, inputs_ABT, targets_ABT, index) -> curvature` (from
        `train.step.make_curvature_estimate`).
      batches: `(inputs_ABT, targets_ABT)` pairs already placed on the mesh.
      shardings: the train state's shardings (the result is put back on them).
    """
    curvatures = [estimate(state["params"], x, y, jnp.int32(i))
                  for i, (x, y) in enumerate(batches)]
    opt_state = kfac_lib.warm_start(state["opt_state"], curvatures)
    return jax.device_put({**state, "opt_state": opt_state}, shardings)


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
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def setup(config: TrainConfig, model: Any, tx: Any, state: dict, data: CharDataset, *,
          start: int, put: Callable[[Any], Any], out: Path, **step_kwargs: Any
          ) -> tuple[Callable[..., Any], dict, RefreshLog]:
    """The K-FAC train step, the state (warm-started at step 0 when `kfac_warm_start`)
    and the refresh log, for `train.loop.run`.

    Warm-start batches are the train windows of steps `max_iters, max_iters + 1, ...`
    (never used by the run's own steps), one micro-batch of `batch_size` each.
    """
    curvature_fn = kfac_curvature_fn(state["params"], config.kfac_stats_stride)
    train_step = make_train_step(model, tx, curvature_fn=curvature_fn, **step_kwargs)
    if start == 0 and config.kfac_warm_start > 0:
        shardings = step_kwargs["state_shardings"]
        estimate = make_curvature_estimate(model, mesh=step_kwargs["mesh"],
                                           params_shardings=shardings["params"],
                                           curvature_fn=curvature_fn)
        batches = []
        for i in range(config.kfac_warm_start):
            x, y = data.batch("train", config.max_iters + i, batch_size=config.batch_size,
                              block_size=config.block_size, seed=config.seed)
            batches.append((put(x), put(y)))
        state = warm_start_state(state, estimate, batches, shardings)
    lead = jax.process_index() == 0  # in a multi-process run, process 0 writes the log
    return train_step, state, RefreshLog(out / "refresh_events.jsonl" if lead else os.devnull,
                                         start=start)


def finish(config: TrainConfig, events: RefreshLog, out: Path) -> None:
    """Write the last refresh rows and `refresh_events.png`."""
    events.flush()
    if jax.process_index() != 0:
        return
    plot_refresh_events(events.rows, kfac_schedule(config), config.max_iters,
                        out / "refresh_events.png")
