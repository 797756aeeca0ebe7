"""PyTorch weights in and out: modded-nanogpt Track 3's ``train_gpt_simple.py`` ``GPT``.

The file's ``state_dict`` names map one to one onto our parameter paths (its ``(out, in)``
``weight`` matrices are our ``(in, out)`` ``kernel``\\ s transposed):

=========================================  ==============================================
``train_gpt_simple.py``                    ours (``nnx.state(model, nnx.Param)``)
=========================================  ==============================================
``embed.weight`` ``(V, D)``                ``wte/embedding`` ``(V, D)``
``norm1.gains``                            ``ln_embed/scale``
``blocks.<i>.norm1.gains``, ``norm2``      ``blocks/<i>/ln_1/scale``, ``ln_2``
``blocks.<i>.attn.{q,k,v,proj}.weight``    ``blocks/<i>/attn/{c_q,c_k,c_v,c_proj}/kernel``
``blocks.<i>.attn.{q,k,v,proj}.bias``      ``blocks/<i>/attn/{c_q,c_k,c_v,c_proj}/bias``
``blocks.<i>.mlp.{fc,proj}.weight/bias``   ``blocks/<i>/mlp/{c_fc,c_proj}/kernel/bias``
``norm2.gains``                            ``ln_f/scale``
``proj.weight`` ``(V, D)``, ``proj.bias``  ``lm_head/kernel`` ``(D, V)``, ``lm_head/bias``
``blocks.<i>.attn.rotary.angular_freq``    (a buffer: checked against ours, not a parameter)
=========================================  ==============================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import half_truncated_frequencies
from models.config import GPTConfig
from models.gpt import GPT, stack_blocks

_LINEARS = {"attn.q": "attn/c_q", "attn.k": "attn/c_k", "attn.v": "attn/c_v",
            "attn.proj": "attn/c_proj", "mlp.fc": "mlp/c_fc", "mlp.proj": "mlp/c_proj"}
_TOP = {"embed.weight": "wte/embedding", "norm1.gains": "ln_embed/scale",
        "norm2.gains": "ln_f/scale", "proj.weight": "lm_head/kernel", "proj.bias": "lm_head/bias"}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_ROTARY = re.compile(r"blocks\.(\d+)\.attn\.rotary\.angular_freq")
_COMPILED_PREFIX = "_orig_mod."  # torch.compile(model)'s state_dict prefix


def _our_path(name: str) -> tuple[str, bool] | None:
    """Our parameter path for a PyTorch name, and whether its matrix is transposed."""
    if name in _TOP:
        return _TOP[name], name == "proj.weight"
    match = _BLOCK.fullmatch(name)
    if match is None:
        return None
    layer, rest = match.groups()
    if rest in ("norm1.gains", "norm2.gains"):
        return f"blocks/{layer}/ln_{rest[4]}/scale", False
    module, _, leaf = rest.rpartition(".")
    if module in _LINEARS and leaf in ("weight", "bias"):
        kind = "kernel" if leaf == "weight" else "bias"
        return f"blocks/{layer}/{_LINEARS[module]}/{kind}", leaf == "weight"
    return None


def _torch_names(config: GPTConfig) -> dict[str, tuple[str, bool]]:
    """Every PyTorch parameter name of ``config``'s GPT -> (our unrolled path, transposed)."""
    names = list(_TOP)
    for i in range(config.n_layer):
        names += [f"blocks.{i}.norm1.gains", f"blocks.{i}.norm2.gains"]
        names += [f"blocks.{i}.{m}.{leaf}" for m in _LINEARS for leaf in ("weight", "bias")]
    return {name: _our_path(name) for name in names}


def _expected_params(config: GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Our unrolled GPT's parameter paths -> shape and dtype (nothing computed)."""
    unrolled = GPTConfig(**{**config.__dict__, "scan_layers": False})
    model = nnx.eval_shape(lambda: GPT(unrolled, rngs=nnx.Rngs(0)))
    return {"/".join(str(k) for k in path): v.get_value()
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _nest(flat: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(int(part) if part.isdigit() else part, {})
        node[leaf] = value
    return tree


def _check_rotary(name: str, value: np.ndarray, config: GPTConfig) -> None:
    if config.rotary != "half_truncated":
        raise ValueError(f"from_torch: {name} is a rotary buffer but config.rotary is "
                         f"{config.rotary!r}; the file's network needs rotary='half_truncated'")
    ours = np.asarray(half_truncated_frequencies(config.head_dim))
    if np.shape(value) != ours.shape or not np.allclose(value, ours, rtol=1e-6, atol=0):
        raise ValueError(f"from_torch: {name} {np.shape(value)} is not the half-truncated "
                         f"rotary's frequencies for head_dim {config.head_dim} {ours.shape}")


def from_torch(state_dict: Mapping[str, Any], config: GPTConfig) -> GPT:
    """Our GPT holding the weights of a ``train_gpt_simple.py`` ``state_dict``.

    Each ``(out, in)`` ``weight`` becomes an ``(in, out)`` ``kernel`` (the embedding table
    stays ``(V, D)``), every array is cast to our parameter's dtype (``config``'s
    ``embed_dtype`` for the table), and with ``config.scan_layers`` the blocks are stacked
    (:func:`models.stack_blocks`). The rotary buffers (``...rotary.angular_freq``) are
    checked against :func:`models.attention.half_truncated_frequencies` and not stored. A
    ``torch.compile``\\ d model's ``_orig_mod.`` prefix is accepted. The arrays land
    unsharded on the default device (``jax.device_put`` them onto a mesh if needed).

    Args:
      state_dict: PyTorch parameter names (``embed.weight``, ``blocks.0.attn.q.weight``,
        ...) to arrays: numpy (``tensor.float().numpy()``: numpy has no bfloat16 in torch),
        or anything ``np.asarray`` reads.
      config: the model's configuration, normally :func:`models.track3_config` with the
        checkpoint's shape; its parameter tree must be the file's.

    Returns:
      The :class:`models.GPT` (an ``nnx.Module``; its parameters are
      ``nnx.state(model, nnx.Param)``).

    Raises:
      ValueError: names missing from ``state_dict`` or not in ``config``'s model (listed),
        or an array whose shape is not the parameter's.

    Example:
      >>> import numpy as np, models
      >>> cfg = models.track3_config(n_layer=1, n_embd=32, head_dim=16, vocab_size=64,
      ...                            block_size=8, dtype="float32", embed_dtype=None,
      ...                            residual_dtype="float32")
      >>> sd = models.to_torch(models.GPT(cfg, rngs=__import__("flax").nnx.Rngs(0)), cfg)
      >>> sd["blocks.0.attn.q.weight"].shape, sd["proj.weight"].shape
      ((32, 32), (64, 32))
      >>> model = models.from_torch(sd, cfg)
      >>> model.lm_head.kernel.shape
      (32, 64)

    References:
      modded-nanogpt Track 3, ``train_gpt_simple.py`` (its ``GPT``),
      https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
      2026.
    """
    expected = _expected_params(config)
    names = {n: p for n, p in _torch_names(config).items() if p[0] in expected}
    given = {name.removeprefix(_COMPILED_PREFIX): value for name, value in state_dict.items()}
    extra = []
    for name, value in given.items():
        if _ROTARY.fullmatch(name) and int(_ROTARY.fullmatch(name).group(1)) < config.n_layer:
            _check_rotary(name, np.asarray(value), config)
        elif name not in names:
            extra.append(name)
    missing = [name for name in names if name not in given]
    unmapped = sorted(set(expected) - {p for p, _ in names.values()})
    if missing or extra or unmapped:
        parts = [f"missing {missing}" if missing else "",
                 f"not in this config's model {sorted(extra)}" if extra else "",
                 f"our parameters with no PyTorch name {unmapped} (config options the file's "
                 "network does not have)" if unmapped else ""]
        raise ValueError("from_torch: the state_dict does not match the config: "
                         + "; ".join(p for p in parts if p))
    flat = {}
    for name, (path, transpose) in names.items():
        value = np.asarray(given[name])
        value = value.T if transpose else value
        want = expected[path]
        if value.shape != tuple(want.shape):
            raise ValueError(f"from_torch: {name} has shape {np.shape(given[name])}, expected "
                             f"{tuple(want.shape)[::-1] if transpose else tuple(want.shape)} "
                             f"for {path} of this config")
        flat[path] = jnp.asarray(value, want.dtype)
    params = _nest(flat)
    if config.scan_layers:
        params = stack_blocks(params)
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    graphdef, param_state, rest = nnx.split(abstract, nnx.Param, ...)
    nnx.replace_by_pure_dict(param_state, params)
    return nnx.merge(graphdef, param_state, rest)


def to_torch(model_or_params: GPT | Mapping[str, Any] | nnx.State, config: GPTConfig
             ) -> dict[str, np.ndarray]:
    """A ``train_gpt_simple.py`` ``state_dict`` (as numpy arrays) of our GPT's weights.

    The reverse of :func:`from_torch`: kernels transposed to ``(out, in)``, every array
    float32 (bf16 parameters widen exactly; ``load_state_dict`` casts each to its
    parameter's dtype, so ``model.load_state_dict({k: torch.from_numpy(v) ...})`` loads
    it into the file's ``GPT``), plus the rotary buffers the file's ``state_dict`` holds.

    Args:
      model_or_params: the :class:`models.GPT`, its ``nnx.state(model, nnx.Param)`` or
        that state's ``nnx.to_pure_dict``.
      config: its configuration (the file's parameter tree, as for :func:`from_torch`).

    Returns:
      A dict from the file's names to float32 numpy arrays.

    Raises:
      ValueError: a parameter the file's network does not have, or one it needs missing.
    """
    if isinstance(model_or_params, nnx.Module):
        model_or_params = nnx.state(model_or_params, nnx.Param)
    params = (nnx.to_pure_dict(model_or_params) if isinstance(model_or_params, nnx.State)
              else model_or_params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    if config.scan_layers:  # one (n_layer, ...) stack per block leaf -> per-layer paths
        stacked, flat = {p: v for p, v in flat.items() if p.startswith("blocks/")}, {
            p: v for p, v in flat.items() if not p.startswith("blocks/")}
        for path, value in stacked.items():
            for i in range(config.n_layer):
                flat[path.replace("blocks/", f"blocks/{i}/", 1)] = value[i]
    names = _torch_names(config)
    ours = {path: (name, transpose) for name, (path, transpose) in names.items()}
    unmapped = sorted(set(flat) - set(ours))
    missing = sorted(path for path in ours if path not in flat)
    if unmapped or missing:
        raise ValueError("to_torch: the parameters are not the file's network: "
                         + "; ".join(p for p in (
                             f"no PyTorch name for {unmapped}" if unmapped else "",
                             f"missing {missing}" if missing else "") if p))
    out = {}
    for path, (name, transpose) in ours.items():
        value = np.asarray(jnp.asarray(flat[path], jnp.float32))
        out[name] = np.ascontiguousarray(value.T if transpose else value)
    if config.rotary == "half_truncated":
        freq = np.asarray(half_truncated_frequencies(config.head_dim))
        for i in range(config.n_layer):
            out[f"blocks.{i}.attn.rotary.angular_freq"] = freq.copy()
    return out
