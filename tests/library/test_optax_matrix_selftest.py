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


def test_grid_comparison_counts_steps_and_refuses_values_off_the_grid():
    """`grid=`: one bf16 step per rounding passes, two after one rounding or a value off
    the grid fail; steps are counted across zero and signs as the values are ordered."""
    a = jnp.asarray([-1.0, -0.0, 0.0, 1.0, 3.0], jnp.bfloat16)
    one_up = jnp.asarray([jnp.nextafter(x, jnp.bfloat16(jnp.inf)) for x in a], jnp.bfloat16)
    assert m.grid_steps(a, one_up, jnp.bfloat16).tolist() == [1, 1, 1, 1, 1]
    assert m.grid_steps(jnp.bfloat16(-1.0), jnp.bfloat16(1.0), jnp.bfloat16) == 2 * 0x3F80
    f32 = lambda x: {"x": jnp.asarray(x, jnp.float32)}
    m.assert_runs_agree(f32(one_up), f32(a), grid=jnp.bfloat16, steps=1)
    two_up = jnp.asarray([jnp.nextafter(x, jnp.bfloat16(jnp.inf)) for x in one_up],
                         jnp.bfloat16)
    with pytest.raises(AssertionError, match="2 grid steps apart after 1 roundings"):
        m.assert_runs_agree(f32(two_up), f32(a), grid=jnp.bfloat16, steps=1)
    with pytest.raises(AssertionError, match="off the bfloat16 grid"):
        m.assert_runs_agree(f32(a.astype(jnp.float32) * (1 + 1e-4)), f32(a), grid=jnp.bfloat16)
