"""Skipping train steps whose loss or gradients are not finite.

A step is *bad* when its loss or the global norm of its gradients is NaN or Inf (the norm
is Inf/NaN as soon as one gradient entry is). A bad step leaves the whole train state
(params, optimizer state including Snoo's slow copy and momentum, step, RNG) unchanged;
only three counters move: `bad_steps` (consecutive bad steps, reset by a good one),
`skipped_steps` (all skipped steps of the run) and what the optimizer's own skip rule
moves (`optax_snoo.skip_update`: Snoo's `count`). A skipped step keeps its slot in Snoo's
period (a sync that falls on it is dropped, the next comes k steps later), so Snoo's
count is always the trainer's step and the host knows every sync step without reading
the device (`TrainOptimizer.update_kwargs(step)`). Once `bad_steps` reaches
`max_bad_steps` every later step is skipped too (latched), and the host raises
`NonFiniteError` at its next sync point (a log line or a checkpoint), before saving, so
the last good checkpoint stays the latest.

The optimizer update runs under `lax.cond(ok, update, keep)`: a good step computes the
new state once, with no select over its leaves, and a bad one returns the old state. (A
per-leaf `jnp.where(ok, new, old)` fuses into elementwise updates, but not into values
that come out of a conditional, such as K-FAC's cached inverses: there it cost an extra
pass and copies of that state; see README.md, "Reliability".)

Example:
  >>> import jax.numpy as jnp
  >>> state = TrainState.start({"w": jnp.ones(2)}, (), seed=0)
  >>> update = lambda s: s._replace(params={"w": s.params["w"] * jnp.nan})
  >>> kept, _ = update_if_finite(state, update, jnp.float32(jnp.nan), jnp.float32(1.0),
  ...                            max_bad_steps=3)
  >>> kept.params["w"].tolist(), int(kept.bad_steps), int(kept.skipped_steps)
  ([1.0, 1.0], 1, 1)

References:
  Optax, "optax.apply_if_finite" (skip updates with non-finite values, count them),
  https://optax.readthedocs.io/en/latest/api/optimizer_wrappers.html, 2024.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import optax_snoo
from train.state import TrainState

__all__ = ["NonFiniteError", "check_bad_steps", "update_if_finite"]


class NonFiniteError(FloatingPointError):
    """Training stopped: too many consecutive steps with a non-finite loss or gradient."""


def update_if_finite(state: TrainState, update: Callable[[TrainState], TrainState],
                     loss: jax.Array, grad_norm: jax.Array, *, max_bad_steps: int
                     ) -> tuple[TrainState, dict]:
    """`update(state)` if `loss` and `grad_norm` are finite (and not latched), else `state`.

    Args:
      state: the train state before the update.
      update: maps the state to the updated one (same structure and dtypes; its counters
        are set here afterwards); it runs inside `lax.cond`, only on a good step.
      loss: the step's scalar loss.
      grad_norm: the global norm of the step's gradients (before clipping).
      max_bad_steps: consecutive bad steps after which every step is skipped.

    Returns:
      `(state, flags)`: the kept state with updated counters, and float32 metrics
      `skipped` (1.0 when this step was skipped), `bad_steps`, `skipped_steps`.
    """
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (state.bad_steps < max_bad_steps)
    kept = jax.lax.cond(ok, update, _keep, state)
    kept = kept._replace(bad_steps=jnp.where(ok, 0, state.bad_steps + 1).astype(jnp.int32),
                         skipped_steps=state.skipped_steps + (~ok).astype(jnp.int32))
    flags = {"skipped": (~ok).astype(jnp.float32),
             "bad_steps": kept.bad_steps.astype(jnp.float32),
             "skipped_steps": kept.skipped_steps.astype(jnp.float32)}
    return kept, flags


def _keep(state: TrainState) -> TrainState:
    """The state of a skipped step: unchanged but for what `optax_snoo.skip_update` moves
    in the optimizer state (Snoo's counts: its period goes on)."""
    return state._replace(opt_state=optax_snoo.skip_update(state.opt_state))


def check_bad_steps(bad_steps: int, *, max_bad_steps: int, step: int,
                    checkpoints: list[int]) -> None:
    """Raise `NonFiniteError` if `bad_steps` reached `max_bad_steps` (host side).

    Args:
      bad_steps: the state's consecutive bad-step counter.
      max_bad_steps: the limit (`--max_bad_steps`).
      step: the loop's current step, for the message.
      checkpoints: steps saved so far (they are untouched), for the message.
    """
    if bad_steps >= max_bad_steps:
        kept = f"checkpoints on disk: steps {checkpoints}" if checkpoints else "no checkpoint"
        raise NonFiniteError(
            f"stopping at step {step}: {bad_steps} consecutive steps had a non-finite loss or "
            f"gradient (--max_bad_steps={max_bad_steps}). Each was skipped, so the train "
            f"state and every checkpoint hold only good steps ({kept}). Check the data, lower "
            "the learning rate, or continue from the latest checkpoint with --resume.")
