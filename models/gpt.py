"""The GPT: pre-norm transformer blocks (dense or MoE), learned positions, tied head by
default; the options of :class:`models.GPTConfig` also make modded-nanogpt's Track-3 network
(:func:`models.track3_config`).

Shapes: ``B`` batch, ``T`` time, ``D`` width, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import CausalSelfAttention, KVCache
from models.config import GPTConfig
from models.layers import MLP, Dense, Embed, dropout, embed_std, head_std, matmul, norm
from models.moe import MoE


class Block(nnx.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (``moe`` in an MoE block); the
    sums in ``config.residual_dtype``.

    Args:
      config: the model configuration.
      layer: index of the block (decides dense vs MoE).
      rngs: random streams.
    """

    def __init__(self, config: GPTConfig, layer: int, *, rngs: nnx.Rngs):
        self.ln_1 = norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln_2 = norm(config, config.n_embd)
        moe = config.is_moe_block(layer)
        self.mlp = None if moe else MLP(config, rngs=rngs)
        self.moe = MoE(config, rngs=rngs) if moe else None
        self.dropout_rate = config.dropout

    def __call__(
        self,
        x_BTD: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        cache: KVCache | None = None,
        pos: jax.Array | int = 0,
        dropless: bool = False,
        max_logits: bool = False,
    ) -> tuple[jax.Array, KVCache | None]:
        """Apply the block to the residual stream; returns it and the cache.

        ``max_logits``: the attention sows its per-head max logits (see
        :class:`CausalSelfAttention`)."""
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        dt = x_BTD.dtype  # the residual stream's: each branch is added in it
        y_BTD, cache = self.attn(self.ln_1(x_BTD), cache, pos, max_logits=max_logits)
        x_BTD = x_BTD + dropout(y_BTD, self.dropout_rate, keys[0]).astype(dt)
        h_BTD = self.ln_2(x_BTD)
        y_BTD = self.mlp(h_BTD) if self.moe is None else self.moe(h_BTD, dropless=dropless)
        return x_BTD + dropout(y_BTD, self.dropout_rate, keys[1]).astype(dt), cache


class GPT(nnx.Module):
    """A GPT language model in Flax NNX (nanoGPT's architecture, plus GQA, SwiGLU, MoE).

    Parameters (paths as in ``nnx.state(model, nnx.Param)``; every one carries logical
    axis names, see :mod:`models.sharding`):

    - ``wte/embedding`` ``(V, D)`` and (``position="learned"``) ``wpe/embedding``
      ``(block_size, D)``; (``embed_norm``) ``ln_embed/scale``;
    - ``blocks/<i>/ln_1/scale`` (``/bias`` if ``config.has_norm_bias``), ``blocks/<i>/ln_2/...``;
    - ``blocks/<i>/attn/{c_q,c_k,c_v,c_proj}/kernel`` (and ``bias``);
    - dense blocks: ``blocks/<i>/mlp/{c_fc,c_proj}/kernel`` (+ ``c_gate`` for SwiGLU);
    - MoE blocks: ``blocks/<i>/moe/router/kernel`` ``(D, E)`` float32 and
      ``blocks/<i>/moe/experts/{w_fc,w_proj}`` ``(E, D, F)``/``(E, F, D)``
      (+ ``w_gate`` for SwiGLU);
    - ``ln_f/scale`` (``/bias``) and, untied only, ``lm_head/kernel`` ``(D, V)`` (and
      ``lm_head/bias`` with ``lm_head_bias``).

    With ``config.scan_layers`` the blocks are one stack: ``blocks/<i>/...`` becomes
    ``blocks/...`` with a leading ``(n_layer, ...)`` axis (logical name ``"layers"``,
    replicated), run by ``jax.lax.scan`` (one block compiled, not ``n_layer``); the function
    is the unrolled model's for the same per-layer weights (:func:`stack_blocks`).

    Init as nanoGPT: ``N(0, 0.02)`` for matrices and embeddings, ``0.02 / sqrt(2 n_layer)``
    for residual output projections (``c_proj``, ``w_proj``), zeros for biases, ones for
    norm scales; ``config.init="track3"`` is modded-nanogpt's (see :class:`GPTConfig`). Norms
    and logits are float32 (``config.accumulation_dtype``: float64 in a float64 model), the
    residual stream ``config.residual_dtype`` (float32 by default); matmuls run in
    ``config.dtype``. The options of :class:`GPTConfig` (norm kind,
    ``embed_norm``, ``position``, ``rotary``, ``qk_norm``, ``attn_scale``, ``mlp="relu2"``,
    ``lm_head_bias``, ``logit_softcap``, dtypes) make modded-nanogpt's Track-3 network
    (:func:`models.track3_config`, weights from PyTorch with :func:`models.from_torch`).

    Sharding: the parameters are created sharded when a mesh is set
    (``jax.set_mesh(mesh)``) and the logical names are mapped
    (``nnx.logical_axis_rules(models.logical_rules())``), as in the example of
    :func:`models.logical_rules`; ``nnx.get_abstract_model`` works the same way. With no
    mesh set, the model is created unsharded on the default device (flax's eager
    sharding, which would raise without a mesh, is skipped) and the logical names are
    kept as ``out_sharding`` metadata, for ``nnx.get_partition_spec`` later.

    Calling ``model(tokens)`` is safe anywhere; to get the MoE auxiliary losses call it
    through :func:`forward`.

    Args:
      config: the model configuration.
      rngs: random streams (``params`` is used).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import models
      >>> model = models.GPT(models.GPTConfig(n_layer=2), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((3, 16), jnp.int32)).shape
      (3, 16, 65)

    References:
      Radford et al., "Language Models are Unsupervised Multitask Learners", 2019,
      https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf
      Karpathy, "nanoGPT", https://github.com/karpathy/nanoGPT, 2022.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        config.check_float64()
        D, dt = config.n_embd, config.params_dtype
        emb = dict(param_dtype=config.embeddings_dtype, std=embed_std(config), rngs=rngs)
        self.wte = Embed(config.vocab_size, D, names=("vocab", "embed"), **emb)
        self.wpe = (Embed(config.block_size, D, names=(None, "embed"), **emb)
                    if config.position == "learned" else None)
        self.ln_embed = norm(config, D) if config.embed_norm else None
        if config.scan_layers:
            self.blocks = _stacked_blocks(config, rngs)
        else:
            self.blocks = nnx.List([Block(config, i, rngs=rngs) for i in range(config.n_layer)])
        self.ln_f = norm(config, D)
        self.lm_head = None if config.tie_embeddings else Dense(
            D, config.vocab_size, names=("embed", "vocab"), dtype=config.compute_dtype,
            param_dtype=dt, bias=config.lm_head_bias, std=head_std(config), rngs=rngs,
        )
        self.config = config
        if config.init in ("cgi", "depth_fc"):
            _depth_and_gain_split(self, config, rngs, gain_split=config.init == "cgi")

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        dropless: bool = False,
        max_logits: bool = False,
    ) -> jax.Array:
        """Next-token logits.

        Args:
          tokens_BT: int token ids, ``T <= block_size``.
          dropout_key: PRNG key enabling dropout (``config.dropout``) on the embeddings
            and residual branches; ``None`` (default) is deterministic.
          dropless: MoE blocks give every expert room for all tokens (no drops).
          max_logits: every attention layer also sows its per-query-head max logit
            (read them through :func:`forward`).

        Returns:
          ``logits_BTV`` in float32 (``config.accumulation_dtype``; soft-capped with
          ``config.logit_softcap``).
        """
        seq_len, block_size = tokens_BT.shape[1], self.config.block_size
        if seq_len > block_size:
            raise ValueError(f"Sequence length {seq_len} exceeds config.block_size={block_size}.")
        logits_BTV, _ = self._run(tokens_BT, None, 0, dropout_key, dropless, max_logits)
        return logits_BTV

    def decode(
        self, tokens_BT: jax.Array, cache: tuple[KVCache, ...], pos: jax.Array | int
    ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Logits of ``tokens_BT`` at positions ``[pos, pos + T)`` using a key/value cache.

        MoE blocks run dropless, so the result equals ``model(tokens, dropless=True)`` at
        those positions.

        Args:
          tokens_BT: the new tokens.
          cache: one :class:`KVCache` per block (see :meth:`init_cache`) holding positions
            ``[0, pos)``.
          pos: position of ``tokens_BT[:, 0]``; ``pos + T`` must not exceed the cache length.

        Returns:
          ``(logits_BTV, cache)`` with the new tokens' keys and values written.
        """
        return self._run(tokens_BT, cache, pos, None, True)

    def init_cache(self, batch_size: int, max_len: int | None = None) -> tuple[KVCache, ...]:
        """An empty key/value cache (one :class:`KVCache` per block) of ``max_len`` positions.

        Args:
          batch_size: number of sequences.
          max_len: cache length; defaults to ``config.block_size`` (its maximum).

        Returns:
          A tuple of zero-filled caches in the compute dtype.
        """
        max_len = self.config.block_size if max_len is None else max_len
        if not 0 < max_len <= self.config.block_size:
            raise ValueError(
                f"max_len must be in [1, block_size={self.config.block_size}], got {max_len}."
            )
        return tuple(
            KVCache.zeros(self.config, batch_size, max_len) for _ in range(self.config.n_layer)
        )

    def _run(self, tokens_BT, cache, pos, dropout_key, dropless, max_logits=False):
        cfg = self.config
        cfg.check_float64()  # a float64 model traced without x64 would compute in float32
        acc, T = cfg.accumulation_dtype, tokens_BT.shape[1]
        x_BTD = self.wte(tokens_BT)
        if self.wpe is not None:
            x_BTD = x_BTD.astype(acc) + self.wpe(pos + jnp.arange(T)).astype(acc)
        if self.ln_embed is not None:
            x_BTD = self.ln_embed(x_BTD)
        x_BTD = x_BTD.astype(cfg.stream_dtype)
        if dropout_key is not None:
            x_BTD = dropout(x_BTD, cfg.dropout, jax.random.fold_in(dropout_key, cfg.n_layer))
        if cfg.scan_layers:
            x_BTD, new_cache = self._scan_blocks(x_BTD, cache, pos, dropout_key, dropless,
                                                 max_logits)
        else:
            x_BTD, new_cache = self._unrolled_blocks(x_BTD, cache, pos, dropout_key, dropless,
                                                     max_logits)
        x_BTD = self.ln_f(x_BTD).astype(cfg.compute_dtype)
        if self.lm_head is None:
            wte_VD = self.wte.embedding[...].astype(cfg.compute_dtype)
            logits_BTV = matmul(x_BTD, wte_VD, transpose_w=True, preferred_element_type=acc)
        else:
            logits_BTV = self.lm_head(x_BTD)
        logits_BTV = logits_BTV.astype(acc)
        if cfg.logit_softcap is not None:
            c = cfg.logit_softcap
            logits_BTV = c * logits_BTV * jax.lax.rsqrt(jnp.square(logits_BTV) + c * c)
        return logits_BTV, new_cache

    def _unrolled_blocks(self, x_BTD, cache, pos, dropout_key, dropless, max_logits):
        new_cache = []
        for i, block in enumerate(self.blocks):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            x_BTD, layer_cache = block(
                x_BTD,
                dropout_key=key,
                cache=None if cache is None else cache[i],
                pos=pos,
                dropless=dropless,
                max_logits=max_logits,
            )
            new_cache.append(layer_cache)
        return x_BTD, None if cache is None else tuple(new_cache)

    def _scan_blocks(self, x_BTD, cache, pos, dropout_key, dropless, max_logits):
        if max_logits:
            raise ValueError("max_logits=True needs the unrolled blocks (a scan cannot sow "
                             "per-layer values); build the GPT with scan_layers=False.")
        # The caches travel as one stacked (L, ...) pair, a slice per step, like the weights.
        cache_L = None if cache is None else jax.tree.map(lambda *c: jnp.stack(c), *cache)

        # jax.lax.scan over the blocks' split state rather than nnx.scan over the module:
        # nnx.scan refuses a module captured from an outer trace (the sampler's decode loop).
        graphdef, blocks_L = nnx.split(self.blocks)

        def body(x_BTD, xs):
            block_state, layer, layer_cache = xs
            # The same key per layer as the unrolled loop's fold_in(dropout_key, i).
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, layer)
            return nnx.merge(graphdef, block_state)(
                x_BTD, dropout_key=key, cache=layer_cache, pos=pos, dropless=dropless)

        layers = jnp.arange(self.config.n_layer, dtype=jnp.uint32)
        x_BTD, new_cache_L = jax.lax.scan(body, x_BTD, (blocks_L, layers, cache_L))
        if cache is None:
            return x_BTD, None
        return x_BTD, tuple(KVCache(new_cache_L.k[i], new_cache_L.v[i]) for i in range(len(cache)))


#: ``init="cgi"`` (modded-nanogpt Track 3 #30): block ``l``'s ``fc`` times
#: ``1 - CGI_FC_DEPTH_ALPHA·l/(n_layer-1)``; its norms' gains ``1 ∓ CGI_GAIN_ALPHA·s``
#: (``init="depth_fc"``, #42's: the depth scale alone).
CGI_FC_DEPTH_ALPHA = 0.30
CGI_GAIN_ALPHA = 0.14


def _depth_and_gain_split(model: GPT, config: GPTConfig, rngs: nnx.Rngs, *,
                          gain_split: bool = True) -> None:
    """#30's changes to nn.Linear's init, on the built blocks (unrolled or stacked): the
    depth scale of each dense block's ``fc`` and, with ``gain_split`` (not #42's, whose
    gains stay one), the channel-gain split of its two norms, one Rademacher sign per
    channel and block shared by ``ln_1`` (``1 - α s``) and ``ln_2`` (``1 + α s``)."""
    L, D = config.n_layer, config.n_embd
    depth = 1.0 - CGI_FC_DEPTH_ALPHA * np.arange(L) / max(L - 1, 1)
    sign = (2.0 * jax.random.bernoulli(rngs.params(), 0.5, (L, D)).astype(jnp.float32) - 1.0
            if gain_split else jnp.zeros((L, D), jnp.float32))

    def set_block(block: Block, depth: Any, sign: jax.Array) -> None:
        if block.mlp is not None:
            kernel = block.mlp.c_fc.kernel
            kernel.value = (kernel.value * depth).astype(kernel.value.dtype)
        if not gain_split:
            return
        for ln, s in ((block.ln_1, -sign), (block.ln_2, sign)):
            ln.scale.value = (1.0 + CGI_GAIN_ALPHA * s).astype(ln.scale.value.dtype)

    if config.scan_layers:
        set_block(model.blocks, jnp.asarray(depth)[:, None, None], sign)
    else:
        for i, block in enumerate(model.blocks):
            set_block(block, float(depth[i]), sign[i])


def _stacked_blocks(config: GPTConfig, rngs: nnx.Rngs) -> Block:
    """``n_layer`` blocks as one :class:`Block` whose parameters have a leading layer axis
    (logical name ``"layers"``), each layer drawn from its own split of ``rngs``."""

    @nnx.split_rngs(splits=config.n_layer)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(config, 0, rngs=rngs)

    return make(rngs)


def stack_blocks(params: dict) -> dict:
    """An unrolled GPT's parameters as the scanned GPT's (``scan_layers=True``).

    Args:
      params: ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` of a GPT built with
        ``scan_layers=False``: ``params["blocks"]`` maps each layer index to that block's
        parameters.

    Returns:
      The same dict with ``params["blocks"]`` one block's tree whose leaves stack the
      layers ``(n_layer, ...)`` in order, for ``nnx.replace_by_pure_dict`` on a GPT built
      with ``scan_layers=True`` (the same function of its input).

    Example:
      >>> import dataclasses
      >>> from flax import nnx
      >>> import models
      >>> cfg = models.GPTConfig(n_layer=2)
      >>> unrolled = models.GPT(cfg, rngs=nnx.Rngs(0))
      >>> scanned = models.GPT(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
      >>> params = models.stack_blocks(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)))
      >>> state = nnx.state(scanned, nnx.Param)
      >>> nnx.replace_by_pure_dict(state, params)
      >>> nnx.update(scanned, state)
      >>> scanned.blocks.attn.c_q.kernel.shape
      (2, 128, 128)
    """
    blocks = params["blocks"]
    layers = [blocks[i] for i in sorted(blocks, key=int)]
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def forward(
    model: GPT,
    tokens_BT: jax.Array,
    *,
    dropout_key: jax.Array | None = None,
    max_logits: bool = False,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array] | None]:
    """Run the model through ``nnx.capture``: logits, the MoE auxiliary loss and, when
    asked, each attention layer's per-head max logit.

    The model is called only inside ``nnx.capture``, so its MoE blocks can sow their
    auxiliary losses (and its attention layers their max logits) without changing the
    model's state tree.

    Args:
      model: the GPT.
      tokens_BT: int token ids.
      dropout_key: PRNG key enabling dropout, or ``None``.
      max_logits: also return every attention layer's largest pre-softmax logit per query
        head, from the same forward pass (what ``optax_snoo.scale_by_qk_clip`` takes).
        Off, the computation is exactly the one without this option.

    Returns:
      ``(logits_BTV, aux_loss, max_logits)``: float32 logits; the sum of every sown
      auxiliary loss, already scaled by its coefficient (a float32 scalar, 0.0 for a dense
      model); and ``None``, or with ``max_logits=True`` a dict from each attention layer's
      path (``"blocks/0/attn"``, the prefix of its ``c_q``/``c_k`` parameters) to the
      float32 ``(n_head,)`` maximum of ``q . k / sqrt(head_dim)`` (``q . k * attn_scale``,
      after ``qk_norm`` and ``rotary``) over the batch and the causal positions (each
      float64 in a float64 model).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import models
      >>> cfg = models.GPTConfig(n_layer=2, moe_every=2)
      >>> model = models.GPT(cfg, rngs=nnx.Rngs(0))
      >>> logits, aux, _ = models.forward(model, jnp.zeros((2, 8), jnp.int32))
      >>> logits.shape, aux.shape
      ((2, 8, 65), ())
      >>> _, _, max_logits = models.forward(model, jnp.zeros((2, 8), jnp.int32),
      ...                                   max_logits=True)
      >>> sorted(max_logits), max_logits["blocks/0/attn"].shape
      (['blocks/0/attn', 'blocks/1/attn'], (4,))
    """
    call = lambda model, tokens_BT, key: model(tokens_BT, dropout_key=key, max_logits=max_logits)
    logits_BTV, captured = nnx.capture(call, nnx.Intermediate)(model, tokens_BT, dropout_key)
    acc = model.config.accumulation_dtype
    aux_loss = jnp.zeros((), acc)
    layer_max_logits = {}
    for path, value in nnx.to_flat_state(captured):
        if path[-1] == "aux_loss":
            aux_loss = aux_loss + sum(jnp.asarray(v, acc) for v in value.get_value())
        elif path[-1] == "max_logits":
            layer = "/".join(str(part) for part in path[:-1])
            layer_max_logits[layer] = functools.reduce(jnp.maximum, value.get_value())
    return logits_BTV, aux_loss, layer_max_logits if max_logits else None
