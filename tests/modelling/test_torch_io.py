"""``models.from_torch`` / ``models.to_torch`` on the state dicts users have: torch tensors
of bfloat16 and float16 (``model.bfloat16()``, ``model.half()``), read bit for bit; the
one-line refusals; writable outputs."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models

torch = pytest.importorskip("torch")

ROTARY = "blocks.0.attn.rotary.angular_freq"


def config(**dtypes) -> models.GPTConfig:
    return models.track3_config(n_layer=1, n_embd=32, head_dim=16, vocab_size=64,
                                block_size=8, **dtypes)


F32 = dict(dtype="float32", param_dtype="float32", embed_dtype=None, residual_dtype="float32")


def random_state_dict(dtype, seed: int = 0) -> dict:
    """The file's names and shapes (read off ``to_torch``), every tensor N(0, 1) in
    ``dtype``, and the rotary buffer as the file keeps it (float32)."""
    shapes = models.to_torch(models.GPT(config(), rngs=nnx.Rngs(0)), config())
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in shapes.items()
          if "rotary" not in k}
    sd[ROTARY] = torch.from_numpy(shapes[ROTARY])
    return sd


def bits(tensor):
    """A tensor's bits (an integer view of the same width), so -0.0 and NaNs count."""
    width = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.contiguous().view(width)


@pytest.mark.parametrize("dtype, dtypes", [
    (torch.bfloat16, {}),  # the record's own dtypes: float32 params, a bfloat16 table
    (torch.bfloat16, dict(F32, param_dtype="bfloat16", embed_dtype="bfloat16")),
    (torch.float16, F32),
    (torch.float16, dict(F32, param_dtype="float16")),
])
def test_bf16_and_fp16_state_dicts_round_trip_bit_exactly(dtype, dtypes):
    sd = random_state_dict(dtype)
    model = models.from_torch(sd, config(**dtypes))
    assert model.blocks[0].attn.c_q.kernel.dtype == config(**dtypes).params_dtype
    assert model.wte.embedding.dtype == config(**dtypes).embeddings_dtype
    back = models.to_torch(model, config(**dtypes))
    assert set(back) == set(sd)
    for name, value in sd.items():
        if "rotary" not in name:
            again = torch.from_numpy(back[name]).to(dtype)
            assert torch.equal(bits(again), bits(value)), name
    # the values themselves, not only a consistent pair: the head's kernel is proj.weight.T
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...], np.float32),
                                  sd["proj.weight"].float().numpy().T)


def test_a_float16_tensor_into_a_bfloat16_parameter_is_cast_to_the_parameters_dtype():
    sd = random_state_dict(torch.float16)
    model = models.from_torch(sd, config())  # the embedding table is bfloat16
    assert model.wte.embedding.dtype == jnp.bfloat16
    want = jnp.asarray(sd["embed.weight"].numpy(), jnp.bfloat16)  # one rounding, fp16 -> bf16
    np.testing.assert_array_equal(np.asarray(model.wte.embedding[...]), np.asarray(want))


def test_tensors_that_need_grad_and_a_bfloat16_rotary_buffer_are_accepted():
    sd = random_state_dict(torch.float32)
    sd = {k: v.requires_grad_(True) if "rotary" not in k else v for k, v in sd.items()}
    sd[ROTARY] = sd[ROTARY].bfloat16()  # gpt.bfloat16() rounds the buffer too
    model = models.from_torch(sd, config(**F32))
    np.testing.assert_array_equal(np.asarray(model.wte.embedding[...]),
                                  sd["embed.weight"].detach().numpy())


def test_a_value_that_is_not_a_float_array_is_named_with_its_conversion():
    sd = random_state_dict(torch.float32)
    with pytest.raises(ValueError, match=r"^from_torch: blocks.0.mlp.fc.weight \(Tensor of "
                                         r"dtype torch.float8_e4m3fn\) is not readable as an "
                                         r".*; pass it as tensor.float\(\)$"):
        models.from_torch({**sd, "blocks.0.mlp.fc.weight":
                           sd["blocks.0.mlp.fc.weight"].to(torch.float8_e4m3fn)}, config())
    with pytest.raises(ValueError, match=r"^from_torch: proj.bias has dtype int64, expected a "
                                         r"floating-point array"):
        models.from_torch({**sd, "proj.bias": torch.zeros(64, dtype=torch.int64)}, config())
    with pytest.raises(ValueError, match=r"^from_torch: proj.weight has shape \(64, 31\), "
                                         r"expected \(64, 32\) for lm_head/kernel"):
        models.from_torch({**sd, "proj.weight": torch.zeros(64, 31, dtype=torch.bfloat16)},
                          config())


def test_the_rotary_check_says_which_key_and_how_far_its_values_are():
    sd = random_state_dict(torch.float32)
    wrong = sd[ROTARY].clone()
    wrong[1] += 0.25
    with pytest.raises(ValueError, match=rf"^from_torch: {ROTARY} is not the half-truncated "
                                         r"rotary's frequencies for head_dim 16: its values "
                                         r"differ by up to 0.25 \(relative tolerance 1e-06\)$"):
        models.from_torch({**sd, ROTARY: wrong}, config())
    with pytest.raises(ValueError, match=rf"^from_torch: {ROTARY} has shape \(6,\), expected "
                                         r"\(8,\) \(the half-truncated rotary's frequencies "
                                         r"for head_dim 16\)$"):
        models.from_torch({**sd, ROTARY: sd[ROTARY][:6]}, config())
    # a bfloat16 buffer is held to bfloat16's rounding, not float32's
    off = sd[ROTARY].double() * (1 + 2.0 ** -6)
    with pytest.raises(ValueError, match=r"relative tolerance 0.0078"):
        models.from_torch({**sd, ROTARY: off.bfloat16()}, config())


def test_to_torch_returns_writable_arrays_the_caller_owns():
    model = models.GPT(config(), rngs=nnx.Rngs(0))
    before = np.asarray(model.ln_f.scale[...]).copy()
    sd = models.to_torch(model, config())
    assert all(v.flags.writeable and v.flags.c_contiguous and v.flags.owndata
               for v in sd.values())
    sd["norm2.gains"][:] = 7.0  # not the model's buffer
    np.testing.assert_array_equal(np.asarray(model.ln_f.scale[...]), before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a non-writable array
        tensors = {k: torch.from_numpy(v) for k, v in sd.items()}
    assert tensors["embed.weight"].dtype == torch.float32
