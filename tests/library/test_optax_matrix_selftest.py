"""The matrix itself, run on optax.adamw: if these fail, the harness is wrong, not our code."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_matrix as m

PARAMS = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,)), "s": jnp.ones((2, 8, 4))}


def test_matrix_accepts_adamw(tmp_path):
    tx = optax.adamw(1e-2)  # its state follows the params' dtype: float64=tx
    m.check_jit_matches_eager(tx, PARAMS, float64=tx)
    m.check_state_stable(tx, PARAMS)
    m.check_dtype_preserved(tx, PARAMS)
    m.check_inject_hyperparams(optax.adamw, PARAMS, {"learning_rate": 1e-2}, float64=True)
    m.check_multisteps(tx, PARAMS, float64=tx)
    m.check_partition(tx, PARAMS, float64=tx)
    m.check_nnx_optimizer(tx)
    m.check_sharded_state(tx, PARAMS, float64=tx)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path)


def test_matrix_detects_a_broken_transform():
    """A transform that changes state dtype must be caught."""
    def init(params):
        return jnp.zeros((), jnp.int32)

    def update(updates, state, params=None):
        return updates, state.astype(jnp.float32)

    with pytest.raises(AssertionError):
        m.check_state_stable(optax.GradientTransformation(init, update), PARAMS)


def test_matrix_detects_a_program_less_accurate_than_its_peer():
    """A jitted update 1e-3 (relative) off the op-by-op one, 1e-5 of the params, is caught:
    float32 rounds the params within ~1e-7 of the float64 run."""
    tx = optax.adamw(1e-2)
    off = optax.GradientTransformation(
        tx.init, lambda u, s, p=None: jax.tree.map(
            lambda x: x * (1 + 1e-3 * isinstance(x, jax.core.Tracer)), tx.update(u, s, p)))
    with pytest.raises(AssertionError, match="exceeds"):
        m.check_jit_matches_eager(off, PARAMS, float64=tx)
