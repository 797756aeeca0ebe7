"""Registry stacks pass their config through: Muon update smoothing reaches the state."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from optax_snoo import MuonState
from train.config import get_preset, parse_args
from train.optimizers import build_optimizer

PARAMS = {"blocks": {"0": {"mlp": {"c_fc": {"kernel": jnp.ones((8, 16))}}}},
          "ln_f": {"scale": jnp.ones(8)}, "wte": {"embedding": jnp.ones((5, 8))}}


def _muon_states(state):
    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MuonState))
            if isinstance(s, MuonState)]


@pytest.mark.parametrize("name", ["muon", "snoo_muon"])
def test_muon_smoothing_flag_adds_the_buffer(name):
    base = dataclasses.replace(get_preset("shakespeare_char_cpu"), optimizer=name)
    off, = _muon_states(build_optimizer(base)[0].init(PARAMS))
    on, = _muon_states(build_optimizer(dataclasses.replace(base, muon_smoothing=0.2))[0]
                       .init(PARAMS))
    assert isinstance(off.smooth, optax.EmptyState)
    kernel = on.smooth["blocks"]["0"]["mlp"]["c_fc"]["kernel"]
    assert kernel.shape == (8, 16) and kernel.dtype == jnp.float32


def test_muon_smoothing_from_the_command_line():
    assert parse_args(["--muon_smoothing=0.2"]).muon_smoothing == 0.2
    with pytest.raises(ValueError, match="smoothing"):
        build_optimizer(parse_args(["--optimizer=muon", "--muon_smoothing=1.5"]))
