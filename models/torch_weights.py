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

import dataclasses
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
    unrolled = dataclasses.replace(config, scan_layers=False)
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


def _as_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a numpy array of its own dtype, bit for bit; a torch tensor of any
    dtype numpy lacks (bfloat16) through its bits, so nothing rounds before the cast."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        tensor = value.detach().cpu().contiguous()
        if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16; ml_dtypes' has
            import torch  # the tensor's own library: present whenever a tensor is

            return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
        value = tensor
    try:
        array = np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as error:
        raise ValueError(f"from_torch: {name} ({type(value).__name__} of dtype "
                         f"{getattr(value, 'dtype', '?')}) is not readable as an array "
                         f"({str(error).splitlines()[0]}); pass it as tensor.float()") from None
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"from_torch: {name} has dtype {array.dtype}, expected a "
                         "floating-point array (float32, bfloat16, float16, float64)")
    return array


def _check_rotary(name: str, value: np.ndarray, config: GPTConfig) -> None:
    if config.rotary != "half_truncated":
        raise ValueError(f"from_torch: {name} is a rotary buffer but config.rotary is "
                         f"{config.rotary!r}; the file's network needs rotary='half_truncated'")
    ours = np.asarray(half_truncated_frequencies(config.head_dim), np.float64)
    what = f"the half-truncated rotary's frequencies for head_dim {config.head_dim}"
    if np.shape(value) != ours.shape:
        raise ValueError(f"from_torch: {name} has shape {np.shape(value)}, expected "
                         f"{ours.shape} ({what})")
    # float32's rounding of the file's own computation, or the buffer dtype's (model.bfloat16())
    rtol = max(1e-6, float(jnp.finfo(value.dtype).eps))
    value = np.asarray(value, np.float64)
    if not np.allclose(value, ours, rtol=rtol, atol=0):
        raise ValueError(f"from_torch: {name} is not {what}: its values differ by up to "
                         f"{np.max(np.abs(value - ours)):.3g} (relative tolerance {rtol:.3g})")


def from_torch(state_dict: Mapping[str, Any], config: GPTConfig) -> GPT:
    """Our GPT holding the weights of a ``train_gpt_simple.py`` ``state_dict``.

    Each ``(out, in)`` ``weight`` becomes an ``(in, out)`` ``kernel`` (the embedding table
    stays ``(V, D)``), every array is cast to our parameter's dtype (``config``'s
    ``embed_dtype`` for the table; a bfloat16 tensor into a bfloat16 or float32 parameter,
    or a float16 one into a float16 or float32 parameter, keeps its exact value), and with
    ``config.scan_layers`` the blocks are stacked (:func:`models.stack_blocks`). The rotary
    buffers (``...rotary.angular_freq``) are checked against
    :func:`models.attention.half_truncated_frequencies` and not stored. A
    ``torch.compile``\\ d model's ``_orig_mod.`` prefix is accepted. The arrays land
    unsharded on the default device (``jax.device_put`` them onto a mesh if needed).

    Args:
      state_dict: PyTorch parameter names (``embed.weight``, ``blocks.0.attn.q.weight``,
        ...) to arrays as a user has them: ``model.state_dict()``'s torch tensors of any
        floating dtype (bfloat16 and float16 read bit for bit, on any device), numpy or
        jax arrays (``ml_dtypes`` bfloat16 too), or anything ``np.asarray`` reads.
      config: the model's configuration, normally :func:`models.track3_config` with the
        checkpoint's shape; its parameter tree must be the file's.

    Returns:
      The :class:`models.GPT` (an ``nnx.Module``; its parameters are
      ``nnx.state(model, nnx.Param)``).

    Raises:
      ValueError: names missing from ``state_dict`` or not in ``config``'s model (listed),
        an array whose shape is not the parameter's, a value that is not a floating-point
        array (its name and the conversion to make), or a rotary buffer whose shape or
        values are not the frequencies ``config`` computes.

    Example:
      >>> from flax import nnx
      >>> import models
      >>> cfg = models.track3_config(n_layer=1, n_embd=32, head_dim=16, vocab_size=64,
      ...                            block_size=8)
      >>> sd = models.to_torch(models.GPT(cfg, rngs=nnx.Rngs(0)), cfg)  # the file's names
      >>> sd["blocks.0.attn.q.weight"].shape, sd["proj.weight"].shape
      ((32, 32), (64, 32))
      >>> model = models.from_torch(sd, cfg)
      >>> model.lm_head.kernel.shape, model.wte.embedding.dtype
      ((32, 64), dtype(bfloat16))

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
            _check_rotary(name, _as_array(name, value), config)
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
        given_value = _as_array(name, given[name])
        value = given_value.T if transpose else given_value
        want = expected[path]
        if value.shape != tuple(want.shape):
            raise ValueError(f"from_torch: {name} has shape {given_value.shape}, expected "
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
      A dict from the file's names to float32 numpy arrays, C-contiguous, writable and
      owned by the caller (changing one changes no parameter of the model).

    Raises:
      ValueError: a parameter the file's network does not have, or one it needs missing.

    Example:
      >>> from flax import nnx
      >>> import models
      >>> cfg = models.track3_config(n_layer=1, n_embd=32, head_dim=16, vocab_size=64,
      ...                            block_size=8)
      >>> sd = models.to_torch(models.GPT(cfg, rngs=nnx.Rngs(0)), cfg)
      >>> sd["embed.weight"].dtype, sd["blocks.0.mlp.fc.weight"].shape, len(sd)
      (dtype('float32'), (128, 32), 20)

      In PyTorch: ``gpt.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})``.
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
        # a copy of our own: writable (torch.from_numpy shares it) and not the model's buffer
        out[name] = np.array(value.T if transpose else value, order="C", copy=True)
    if config.rotary == "half_truncated":
        freq = np.asarray(half_truncated_frequencies(config.head_dim))
        for i in range(config.n_layer):
            out[f"blocks.{i}.attn.rotary.angular_freq"] = freq.copy()
    return out
