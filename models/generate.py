"""Autoregressive sampling with a key/value cache (temperature, top-k)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.gpt import GPT


def sample_token(
    logits_BV: jax.Array,
    key: jax.Array,
    temperature: float | jax.Array,
    top_k: int | jax.Array | None = None,
    valid_vocab: int | jax.Array | None = None,
) -> jax.Array:
    """Draw one token per row from ``softmax(logits / temperature)`` over the top-k logits.

    As nanoGPT: logits below the k-th largest are removed (ties with it are kept).
    ``temperature == 0`` is greedy (argmax). Ids ``>= valid_vocab`` (vocabulary padding)
    are removed first, so they are never drawn. ``temperature``, ``top_k`` and
    ``valid_vocab`` may be traced values, so changing them does not recompile. Float64
    logits (a float64 model's) are perturbed by the float32 draw's Gumbel noise, so they
    sample what float32 logits of the same values do.

    Args:
      logits_BV: logits of the next token.
      key: PRNG key.
      temperature: softmax temperature ``> 0``, or ``0`` for argmax.
      top_k: number of logits to keep, or ``None`` for all.
      valid_vocab: number of real token ids, or ``None`` for all ``V``.

    Returns:
      ``(B,)`` int32 tokens.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from models.generate import sample_token
      >>> logits = jnp.array([[0.0, 1.0, 9.0]])  # id 2 is padding
      >>> int(sample_token(logits, jax.random.key(0), 0.0, valid_vocab=2)[0])
      1
    """
    logits_BV = logits_BV.astype(jnp.promote_types(jnp.float32, logits_BV.dtype))
    V = logits_BV.shape[-1]
    if valid_vocab is not None:
        logits_BV = jnp.where(jnp.arange(V) < valid_vocab, logits_BV, -jnp.inf)
    if top_k is not None:
        kth_B1 = jax.lax.dynamic_index_in_dim(jnp.sort(logits_BV, axis=-1), V - top_k, axis=-1)
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    temperature = jnp.asarray(temperature, logits_BV.dtype)
    hot = temperature > 0
    scaled_BV = logits_BV / jnp.where(hot, temperature, 1.0)
    if scaled_BV.dtype == jnp.float32:
        sampled_B = jax.random.categorical(key, scaled_BV, axis=-1)
    else:  # categorical's Gumbel noise in float32, so float64 logits sample as float32 ones
        noise_BV = jax.random.gumbel(key, scaled_BV.shape, jnp.float32)
        sampled_B = jnp.argmax(scaled_BV + noise_BV, axis=-1)
    return jnp.where(hot, sampled_B, jnp.argmax(logits_BV, axis=-1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "use_cache"))
def _generate(graphdef, state, tokens_BT, rng, temperature, top_k, valid_vocab, *,
              max_new_tokens, use_cache):
    model = nnx.merge(graphdef, state)
    B, T0 = tokens_BT.shape
    S = model.config.block_size
    total = T0 + max_new_tokens
    buf_BL = jnp.zeros((B, total), jnp.int32).at[:, :T0].set(tokens_BT.astype(jnp.int32))

    def sample(logits_BV, i):
        return sample_token(logits_BV, jax.random.fold_in(rng, i), temperature, top_k,
                            valid_vocab)

    # New token i is predicted from the T0 + i tokens before it; a cache of absolute
    # positions serves it while T0 + i <= block_size, later steps re-run a window.
    n_cached = min(max_new_tokens, max(0, S - T0 + 1)) if use_cache else 0
    if n_cached:
        logits_BTV, cache = model.decode(tokens_BT, model.init_cache(B, S), 0)
        tok_B = sample(logits_BTV[:, -1], 0)
        buf_BL = buf_BL.at[:, T0].set(tok_B)

        def cached_step(carry, i):
            buf_BL, cache, tok_B = carry
            logits_B1V, cache = model.decode(tok_B[:, None], cache, T0 + i - 1)
            tok_B = sample(logits_B1V[:, 0], i)
            buf_BL = jax.lax.dynamic_update_slice(buf_BL, tok_B[:, None], (0, T0 + i))
            return (buf_BL, cache, tok_B), None

        if n_cached > 1:
            (buf_BL, _, _), _ = jax.lax.scan(
                cached_step, (buf_BL, cache, tok_B), jnp.arange(1, n_cached)
            )
    if n_cached == max_new_tokens:
        return buf_BL

    W = min(total, S)

    def window_step(buf_BL, i):
        cur = T0 + i  # tokens known so far
        start = jnp.clip(cur - S, 0, total - W)
        window_BW = jax.lax.dynamic_slice(buf_BL, (0, start), (B, W))
        logits_BWV = model(window_BW, dropless=True)
        logits_BV = jax.lax.dynamic_index_in_dim(logits_BWV, cur - 1 - start, 1, keepdims=False)
        tok_B = sample(logits_BV, i)
        return jax.lax.dynamic_update_slice(buf_BL, tok_B[:, None], (0, cur)), None

    buf_BL, _ = jax.lax.scan(window_step, buf_BL, jnp.arange(n_cached, max_new_tokens))
    return buf_BL


def generate(
    model: GPT,
    tokens_BT: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng: jax.Array,
    use_cache: bool = True,
    valid_vocab: int | None = None,
) -> jax.Array:
    """Sample ``max_new_tokens`` tokens after ``tokens_BT`` (nanoGPT's ``generate``).

    Each new token is drawn from ``softmax(logits / temperature)`` over the ``top_k``
    most likely tokens, conditioned on the last ``block_size`` tokens. With
    ``use_cache`` the keys and values of past positions are kept (one prefill of the
    prompt, then one token per step) while the whole sequence fits in ``block_size``;
    beyond it positions shift at every step (absolute learned positions), so the
    remaining tokens are computed from the full window, as without the cache. MoE blocks
    run dropless so a token's output never depends on the rest of the batch; hence the
    result equals ``use_cache=False`` up to floating-point rounding of the logits.
    Compiled once per model structure, shapes, ``max_new_tokens`` and ``use_cache``
    (``temperature``, ``top_k`` and ``valid_vocab`` are traced). A vocabulary padded to a
    multiple (``vocab_size > valid_vocab``) never yields a padding id: those logits are
    masked before sampling.

    Args:
      model: the GPT.
      tokens_BT: int prompt, ``T >= 1``.
      max_new_tokens: number of tokens to append (``>= 0``).
      temperature: softmax temperature ``> 0``, or ``0`` for greedy decoding.
      top_k: keep only the ``top_k`` largest logits (``None``: all).
      rng: PRNG key; step ``i`` uses ``jax.random.fold_in(rng, i)``.
      use_cache: use the key/value cache.
      valid_vocab: number of real token ids (the unpadded vocabulary); ids
        ``>= valid_vocab`` are never sampled. ``None``: ``model.config.vocab_size``.

    Returns:
      ``(B, T + max_new_tokens)`` int32 tokens: the prompt followed by the samples.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import models
      >>> model = models.GPT(models.GPTConfig(n_layer=2), rngs=nnx.Rngs(0))
      >>> out = models.generate(model, jnp.zeros((1, 4), jnp.int32), 8, top_k=5,
      ...                       rng=jax.random.key(0))
      >>> out.shape
      (1, 12)
    """
    tokens_BT = jnp.asarray(tokens_BT)
    if tokens_BT.ndim != 2 or tokens_BT.shape[1] < 1:
        raise ValueError(f"tokens_BT must have shape (B, T) with T >= 1, got {tokens_BT.shape}.")
    if type(max_new_tokens) is not int or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}.")
    padded = model.config.vocab_size
    if valid_vocab is None:
        valid_vocab = padded
    if type(valid_vocab) is not int or not 1 <= valid_vocab <= padded:
        raise ValueError(f"valid_vocab must be None or an int in [1, vocab_size={padded}], "
                         f"got {valid_vocab!r}.")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= valid_vocab):
        raise ValueError(f"top_k must be None or an int in [1, {valid_vocab}] (the real "
                         f"vocabulary), got {top_k!r}.")
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef, state, tokens_BT, rng,
        jnp.float32(temperature), jnp.int32(padded if top_k is None else top_k),
        jnp.int32(valid_vocab), max_new_tokens=max_new_tokens, use_cache=use_cache,
    )
