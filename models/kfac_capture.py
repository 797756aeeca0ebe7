"""One backward pass that returns the loss, parameter gradients and K-FAC layer statistics.

For every matrix ``y = x W`` of the GPT (dense kernels ``(d_in, d_out)``, the untied
head, routers, and expert stacks ``(E, d_in, d_out)``), the model records its input
``x`` and adds a zero perturbation ``p`` to its output when asked to
(:func:`models.layers.tap_kfac`). The gradient with respect to ``p`` is then ``dL/dy``,
obtained in the same backward pass as the parameter gradients (Flax NNX's
``Module.perturb`` recipe). The tied head (``wte``) and the embeddings are not captured.

Statistics per matrix, keyed by the parameter path (``"blocks/0/attn/c_q/kernel"``):

- dense (including routers and the untied head): ``inputs`` ``(B, T, d_in)`` and
  ``out_grads`` ``(B, T, d_out)``;
- experts: ``inputs`` ``(E, C, d_in)`` (the dispatched buffer: slot ``c`` of expert
  ``e``) and ``out_grads`` ``(E, C, d_out)``; empty slots are zero in both.

Both are in the layer's compute dtype (``config.dtype``; float32 for routers), so cast
them to float32 before accumulating factors. The output gradients are those of the loss
as written: for a mean over ``M`` tokens they are ``1/M`` of the per-token gradients, so
SPEC §4.1's ``g_i = M dL/dy_i`` is ``M * out_grads``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.gpt import GPT, forward
from models.layers import KFACOutput

LossFn = Callable[..., Any]


def kfac_perturbations(
    model: GPT, tokens_BT: jax.Array, *, dropout_key: jax.Array | None = None
) -> nnx.State:
    """Zero perturbations for every captured matrix output, shaped for ``tokens_BT``.

    Shapes come from ``jax.eval_shape``, so no forward pass is run.

    Args:
      model: the GPT.
      tokens_BT: a batch of the shape that will be used.
      dropout_key: the dropout key that will be used (shapes only; ``None`` is fine).

    Returns:
      An ``nnx.State`` of :class:`models.layers.KFACOutput` zeros, to pass as
      ``forward(..., kfac_perturbations=...)``.
    """
    graphdef, state = nnx.split(model)

    def perturbations(state, tokens_BT):
        call = lambda model, tokens_BT: model(tokens_BT, dropout_key=dropout_key)
        _, perturbations = nnx.capture(call, KFACOutput)(nnx.merge(graphdef, state), tokens_BT)
        return perturbations

    shapes = jax.eval_shape(perturbations, state, tokens_BT)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def value_grad_and_stats(
    loss_fn: LossFn,
    model: GPT,
    tokens_BT: jax.Array,
    *args: Any,
    dropout_key: jax.Array | None = None,
    has_aux: bool = False,
) -> tuple[Any, nnx.State, dict[str, tuple[jax.Array, jax.Array]]]:
    """Loss, parameter gradients and ``(inputs, out_grads)`` of every matrix, in one pass.

    Args:
      loss_fn: ``loss_fn(logits_BTV, aux_loss, *args) -> loss`` (a scalar, or
        ``(loss, aux)`` with ``has_aux``); ``aux_loss`` is the MoE auxiliary loss that
        :func:`models.forward` returns (add it to train the router).
      model: the GPT.
      tokens_BT: input tokens.
      *args: passed to ``loss_fn`` (e.g. the targets).
      dropout_key: dropout PRNG key, or ``None``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``(loss, grads, stats)``: ``loss`` as ``loss_fn`` returns it (``(loss, aux)`` with
      ``has_aux``); ``grads`` an ``nnx.State`` of ``nnx.Param`` gradients (as
      ``nnx.grad``); ``stats`` a dict from parameter path to ``(inputs, out_grads)``
      (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import models
      >>> model = models.GPT(models.GPTConfig(n_layer=1), rngs=nnx.Rngs(0))
      >>> x = jnp.zeros((2, 8), jnp.int32)
      >>> def loss_fn(logits, aux, y):
      ...   return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + aux
      >>> loss, grads, stats = models.value_grad_and_stats(loss_fn, model, x, x)
      >>> [s.shape for s in stats["blocks/0/attn/c_q/kernel"]]
      [(2, 8, 128), (2, 8, 128)]

    References:
      Martens and Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
      Curvature", https://arxiv.org/abs/1503.05671, 2015.
    """
    perturbations = kfac_perturbations(model, tokens_BT, dropout_key=dropout_key)

    def total_loss(model, perturbations):
        logits_BTV, aux_loss, inputs = forward(
            model,
            tokens_BT,
            dropout_key=dropout_key,
            capture_kfac=True,
            kfac_perturbations=perturbations,
        )
        out = loss_fn(logits_BTV, aux_loss, *args)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, inputs)

    (loss, (aux, inputs)), (grads, out_grads) = nnx.value_and_grad(
        total_loss, argnums=(0, 1), has_aux=True
    )(model, perturbations)
    out_grads = {
        "/".join(map(str, path)): value.get_value() for path, value in nnx.to_flat_state(out_grads)
    }
    stats = {path: (inputs[path], out_grads[path]) for path in inputs}
    return ((loss, aux) if has_aux else loss), grads, stats
