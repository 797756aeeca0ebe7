"""A GPT in float64: the float64 reference (`references.error`) of a float32 GPT's own
computation, for tests that compare two float32 programs of one model (sharded and
unsharded, scanned and unrolled, cached and full, two attention implementations).

`models.GPTConfig` takes float64 dtypes under jax's x64 mode and computes in float64
everything a float32 model computes in float32 (softmax, norms, logits), with the same
function (the same eps, the same parameter values); call these inside
`references.error.in_float64()`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models

#: Every dtype field of a `models.GPTConfig` (and of a trainer config's model) in float64.
FLOAT64_DTYPES = dict(dtype="float64", param_dtype="float64", embed_dtype="float64",
                      residual_dtype="float64")


def float64_config(config: models.GPTConfig) -> models.GPTConfig:
    """`config` with every dtype float64 (inside `in_float64()`)."""
    return dataclasses.replace(config, **FLOAT64_DTYPES)


def float64_model(model: models.GPT) -> models.GPT:
    """A float64 GPT holding `model`'s parameter values exactly (inside `in_float64()`)."""
    model64 = models.GPT(float64_config(model.config), rngs=nnx.Rngs(0))
    state = nnx.state(model64, nnx.Param)
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.replace_by_pure_dict(
        state, jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), values))
    nnx.update(model64, state)
    return model64
