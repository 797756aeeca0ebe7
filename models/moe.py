"""Mixture-of-experts feed-forward block: top-k router, capacity-based dispatch, experts.

Routing (per token, in float32; float64 in a float64 model): ``logits = x @ router`` ``(N, E)``,
``probs = softmax(logits)``, the ``top_k`` largest probabilities pick the experts.
Gate weights: for ``top_k > 1`` the chosen probabilities are renormalised to sum to one
(Mixtral/GShard); for ``top_k == 1`` the raw probability is kept (Switch), otherwise the
gate would be the constant 1 and the router would get no gradient from the main loss.

Dispatch (Switch/GShard style, no expert computes a token it was not given). Each expert
has ``C = ceil(capacity_factor * N * top_k / E)`` slots for the ``N = B * T`` tokens of
a batch (at most ``N``). Assignments are served in a causal priority order: time step
first, then choice rank, then sequence (all first choices at position 0, all second
choices at position 0, then position 1, ...). An assignment's slot is its rank among
the assignments to the same expert (a cumulative sum of one-hot choices), so whether a
token is dropped never depends on later positions: the model stays causal
(GShard's order, all first choices before any second choice, would let a future token
evict an earlier token's second choice). Assignments that find their expert full are
dropped: that expert's contribution is zero for the token, the remaining gate weights
are NOT renormalised, and if all of a token's choices are dropped the block outputs
zero for it, so the residual stream passes it through unchanged. Tokens are gathered
into ``(E, C, D)`` buffers (empty slots are zeros), the experts run as batched einsums
on them, and the outputs are gathered back and summed with the gate weights.
``dropless=True`` sets ``C = N`` (nothing is ever dropped; used for generation so that
a token's output does not depend on the rest of the batch).

Auxiliary losses, each sown (already scaled by its coefficient) as
``nnx.Intermediate`` ``"aux_loss"``:

- Switch load balancing: ``aux_loss_coef * E * sum_e f_e P_e``, with ``f_e`` the fraction
  of all ``N * top_k`` assignments that chose expert ``e`` (before capacity drops) and
  ``P_e`` the mean router probability of ``e``. Under uniform routing it equals
  ``aux_loss_coef``, whatever ``top_k``.
- router z-loss (only when ``z_loss_coef > 0``):
  ``z_loss_coef * mean_tokens(logsumexp(logits)^2)``.

References:
  Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
  Mixture-of-Experts Layer", https://arxiv.org/abs/1701.06538, 2017.
  Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and
  Automatic Sharding", https://arxiv.org/abs/2006.16668, 2020.
  Fedus, Zoph, Shazeer, "Switch Transformers: Scaling to Trillion Parameter Models with
  Simple and Efficient Sparsity", https://arxiv.org/abs/2101.03961, 2021.
  Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert Models",
  https://arxiv.org/abs/2202.08906, 2022.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig
from models.layers import INIT_STD, Dense, gelu, param, residual_std, sow


class Routing(NamedTuple):
    """Where each of ``N`` tokens goes (tokens in ``(B, T)`` row-major order).

    Attributes:
      logits: router logits ``(N, E)``, float32.
      probs: router probabilities ``(N, E)``, float32.
      experts: ``(N, K)`` chosen experts, most probable first.
      gates: ``(N, K)`` gate weights (float32; zero where the choice was dropped).
      slots: ``(N, K)`` flat slot ``e * C + c`` of each choice among the ``E * C`` slots,
        or ``E * C`` where the choice was dropped.
      slot_tokens: ``(E, C)`` the token in each slot, or ``N`` for an empty slot.
    """

    logits: jax.Array
    probs: jax.Array
    experts: jax.Array
    gates: jax.Array
    slots: jax.Array
    slot_tokens: jax.Array


def route(logits_BTE: jax.Array, top_k: int, capacity: int) -> Routing:
    """Top-k routing with per-expert capacity, in causal priority (see the module docstring).

    Args:
      logits_BTE: router logits for ``B`` sequences of ``T`` tokens and ``E`` experts.
      top_k: experts per token.
      capacity: slots per expert ``C``.

    Returns:
      The :class:`Routing` of the ``N = B * T`` tokens.
    """
    B, T, E = logits_BTE.shape
    N, K = B * T, top_k
    logits_NE = logits_BTE.reshape(N, E).astype(jnp.promote_types(jnp.float32, logits_BTE.dtype))
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    gates_NK, experts_NK = jax.lax.top_k(probs_NE, K)
    if K > 1:
        gates_NK = gates_NK / jnp.sum(gates_NK, axis=-1, keepdims=True)
    # Rank of each assignment among those to the same expert, in (time, choice, sequence)
    # order.
    onehot_TKBE = jax.nn.one_hot(experts_NK.reshape(B, T, K).transpose(1, 2, 0), E, dtype=jnp.int32)
    rank_TKBE = jnp.cumsum(onehot_TKBE.reshape(T * K * B, E), axis=0).reshape(T, K, B, E) - 1
    rank_NK = jnp.sum(rank_TKBE * onehot_TKBE, axis=-1).transpose(2, 0, 1).reshape(N, K)
    keep_NK = rank_NK < capacity
    slots_NK = jnp.where(keep_NK, experts_NK * capacity + rank_NK, E * capacity)
    tokens_NK = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, K))
    slot_tokens_EC = (
        jnp.full((E * capacity + 1,), N, jnp.int32)  # the last entry collects the drops
        .at[slots_NK.reshape(-1)]
        .set(tokens_NK.reshape(-1))[: E * capacity]
        .reshape(E, capacity)
    )
    gates_NK = jnp.where(keep_NK, gates_NK, 0.0)
    return Routing(logits_NE, probs_NE, experts_NK, gates_NK, slots_NK, slot_tokens_EC)


def load_balance_loss(probs_NE: jax.Array, experts_NK: jax.Array) -> jax.Array:
    """Switch load-balancing loss (unscaled): ``E * sum_e f_e P_e``; 1 under uniform routing.

    Args:
      probs_NE: router probabilities.
      experts_NK: chosen experts (all ``K`` choices count, before capacity drops).

    Returns:
      A float32 scalar.
    """
    E = probs_NE.shape[-1]
    f_E = jnp.mean(jax.nn.one_hot(experts_NK, E, dtype=probs_NE.dtype), axis=(0, 1))
    P_E = jnp.mean(probs_NE, axis=0)
    return E * jnp.sum(f_E * P_E)


def router_z_loss(logits_NE: jax.Array) -> jax.Array:
    """Router z-loss (unscaled): ``mean(logsumexp(logits)^2)`` over tokens.

    Args:
      logits_NE: router logits.

    Returns:
      A float32 scalar.
    """
    logits_NE = logits_NE.astype(jnp.promote_types(jnp.float32, logits_NE.dtype))
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_NE, axis=-1)))


class Experts(nnx.Module):
    """``E`` feed-forward experts applied to their ``(E, C, D)`` token buffers.

    Parameters ``w_fc`` ``(E, D, F)``, ``w_proj`` ``(E, F, D)`` and for SwiGLU ``w_gate``
    ``(E, D, F)``; no biases. Init as the dense MLP (``w_proj`` is a residual output
    projection: std ``0.02 / sqrt(2 n_layer)``).

    Args:
      config: the model configuration (``n_experts``, ``expert_hidden_dim``, ``mlp``).
      rngs: random streams.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        E, D, F = config.n_experts, config.n_embd, config.expert_hidden_dim
        dt = config.params_dtype
        self.w_fc = param(rngs.params(), (E, D, F), ("expert", "embed", "expert_mlp"), dt, INIT_STD)
        self.w_gate = (
            param(rngs.params(), (E, D, F), ("expert", "embed", "expert_mlp"), dt, INIT_STD)
            if config.mlp == "swiglu"
            else None
        )
        self.w_proj = param(
            rngs.params(), (E, F, D), ("expert", "expert_mlp", "embed"), dt,
            residual_std(config, F, "mlp_proj")
        )
        self.dtype = config.compute_dtype

    def _matmul(self, name: str, x_ECI: jax.Array) -> jax.Array:
        w_EIO = getattr(self, name)[...].astype(self.dtype)
        x_ECI = x_ECI.astype(self.dtype)
        return jnp.einsum("eci,eio->eco", x_ECI, w_EIO)

    def __call__(self, x_ECD: jax.Array) -> jax.Array:
        h_ECF = self._matmul("w_fc", x_ECD)
        if self.w_gate is None:
            h_ECF = gelu(h_ECF)
        else:
            h_ECF = jax.nn.silu(self._matmul("w_gate", x_ECD)) * h_ECF
        return self._matmul("w_proj", h_ECF)


class MoE(nnx.Module):
    """Mixture-of-experts feed-forward block (see the module docstring).

    ``router`` is a float32 :class:`models.layers.Dense` ``(D, E)`` (no bias; float64 in a
    float64 model);
    ``experts`` an :class:`Experts` stack.

    Args:
      config: the model configuration.
      rngs: random streams.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.router = Dense(
            config.n_embd,
            config.n_experts,
            names=("embed", None),
            dtype=config.accumulation_dtype,
            param_dtype=jnp.promote_types(jnp.float32, config.params_dtype),
            bias=False,
            rngs=rngs,
        )
        self.experts = Experts(config, rngs=rngs)
        self.config = config

    def __call__(self, x_BTD: jax.Array, *, dropless: bool = False) -> jax.Array:
        """Route, dispatch, run the experts and combine; sows the auxiliary losses.

        Args:
          x_BTD: block input (normalised residual stream).
          dropless: use ``C = N`` slots per expert so no assignment is dropped.

        Returns:
          The block output ``(B, T, D)`` in the compute dtype.
        """
        cfg = self.config
        B, T, D = x_BTD.shape
        N, E = B * T, cfg.n_experts
        capacity = N if dropless else cfg.expert_capacity(N)
        r = route(self.router(x_BTD), cfg.top_k, capacity)

        x_ND = x_BTD.reshape(N, D).astype(cfg.compute_dtype)
        x_pad_ND = jnp.concatenate([x_ND, jnp.zeros((1, D), x_ND.dtype)])  # row N: empty slot
        y_ECD = self.experts(jnp.take(x_pad_ND, r.slot_tokens, axis=0))
        y_pad_SD = jnp.concatenate([y_ECD.reshape(E * capacity, D), jnp.zeros((1, D), y_ECD.dtype)])
        y_NKD = jnp.take(y_pad_SD, r.slots, axis=0)  # dropped choices read the zero row
        y_ND = jnp.einsum("nk,nkd->nd", r.gates.astype(y_NKD.dtype), y_NKD)

        balance = load_balance_loss(r.probs, r.experts)
        sow(self, nnx.Intermediate, "aux_loss", cfg.aux_loss_coef * balance)
        if cfg.z_loss_coef > 0:
            sow(self, nnx.Intermediate, "aux_loss", cfg.z_loss_coef * router_z_loss(r.logits))
        return y_ND.reshape(B, T, D)
