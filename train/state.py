"""The train state: one typed pytree that the step updates and Orbax saves.

`TrainState` is a `NamedTuple`, so JAX flattens it (a pytree, by field name) and Orbax
saves and restores it field by field, under the same names the earlier dict state had:
checkpoints read back either way.

Example:
  >>> import jax.numpy as jnp
  >>> state = TrainState.start({"w": jnp.ones(2)}, (), seed=0)
  >>> int(state.step), int(state.bad_steps), state.params["w"].tolist()
  (0, 0, [1.0, 1.0])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """Everything a run carries from step to step (and a checkpoint holds).

    Attributes:
      params: the model's parameters (a nested dict from `nnx.split`).
      opt_state: the optax state.
      step: updates done (int32 scalar).
      rng: the base PRNG key data (each step folds its number in).
      bad_steps: consecutive steps with a non-finite loss or gradient (`train.nonfinite`).
      skipped_steps: all skipped steps of the run.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    bad_steps: jax.Array
    skipped_steps: jax.Array

    @classmethod
    def start(cls, params: Any, opt_state: Any, *, seed: int) -> TrainState:
        """The state before the first step: step 0, the key of `seed`, counters at 0."""
        return cls(params=params, opt_state=opt_state, step=jnp.int32(0),
                   rng=jax.random.key_data(jax.random.key(seed)),
                   bad_steps=jnp.int32(0), skipped_steps=jnp.int32(0))
