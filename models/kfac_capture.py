"""Deprecated: `models.value_grad_and_stats` is `optax_snoo.kfac.value_grad_and_stats`
(which reads the layers from the loss's jaxpr, so the model needs no taps) with the old
calling convention. Kept only until `train/step.py` calls the library directly."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from models.gpt import GPT, forward
from optax_snoo import kfac


def value_grad_and_stats(
    loss_fn: Callable[..., Any],
    model: GPT,
    tokens_BT: jax.Array,
    *args: Any,
    dropout_key: jax.Array | None = None,
    has_aux: bool = False,
) -> tuple[Any, nnx.State, dict[str, tuple[jax.Array, jax.Array]]]:
    """Deprecated: use ``optax_snoo.kfac.value_grad_and_stats``.

    ``loss_fn(logits_BTV, aux_loss, *args)``; returns ``(loss, grads, stats)`` with
    ``grads`` an ``nnx.State`` of the ``nnx.Param`` gradients and ``stats`` a dict from
    kernel path to ``(inputs, out_grads)``: ``(B, T, d)`` for dense matrices (the untied
    head and routers included), the ``(E, C, d)`` dispatch buffers for expert stacks.
    """
    warnings.warn("models.value_grad_and_stats is deprecated: use "
                  "optax_snoo.kfac.value_grad_and_stats", DeprecationWarning, stacklevel=2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits_BTV, aux_loss, _ = forward(nnx.merge(graphdef, params, rest), tokens_BT,
                                          dropout_key=dropout_key)
        return loss_fn(logits_BTV, aux_loss, *args)

    value, grads, stats = kfac.value_grad_and_stats(loss, params, has_aux=has_aux)
    B, T = tokens_BT.shape
    out = {}
    for path, s in stats.items():
        if s.inputs.ndim == 2:           # dense: tokens back to (B, T)
            out[path] = (s.inputs.reshape(B, T, -1), s.out_grads.reshape(B, T, -1))
        else:
            out[path] = (s.inputs, s.out_grads)
    return value, grads, out
