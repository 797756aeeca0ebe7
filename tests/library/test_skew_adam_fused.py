"""SkewAdam's fused RMS clipping equals `optax.clip_by_block_rms` after the transform, and
the compiled update keeps no parameter-sized temporary (what makes it as cheap as AdamW)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_snoo import scale_by_skew_adam, skew_adam
from references.error import assert_as_accurate, run_in_float64


@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("factored", [True, False])
def test_fused_clip_equals_clip_by_block_rms(momentum, factored):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
              "e": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
    # threshold 0.3: the RMS of the direction (about 1) exceeds it, so every step clips.
    gs = [jax.tree.map(lambda p, t=t: np.asarray(
        np.random.default_rng(t).normal(size=p.shape) * (1 + 10 * (t == 3)), np.float32),
        params) for t in range(5)]

    def directions(params, gs):  # statistics in the params' dtype (float64: the reference)
        kw = dict(momentum=momentum, factored=factored, stats_dtype=params["w"].dtype)
        fused = scale_by_skew_adam(0.8, 0.95, clip_threshold=0.3, **kw)
        chained = optax.chain(scale_by_skew_adam(0.8, 0.95, **kw), optax.clip_by_block_rms(0.3))
        s1, s2, out = fused.init(params), chained.init(params), []
        for g in gs:
            u1, s1 = jax.jit(fused.update)(g, s1)
            u2, s2 = jax.jit(chained.update)(g, s2)
            out.append((u1, u2))
        return out

    # The fused RMS comes from the statistics, the chained one from u: they round
    # differently, so the fused update is as accurate as the chained one (float64 reference).
    exact = run_in_float64(directions, params, gs)
    for t, ((u1, u2), (_, u64)) in enumerate(zip(directions(params, gs), exact, strict=True)):
        assert_as_accurate(u1, u2, u64, what=f"step {t}")
        rms = jax.tree.map(lambda u: float(jnp.sqrt(jnp.mean(u * u))), u1)
        assert all(abs(r - 0.3) < 1e-5 for r in jax.tree.leaves(rms)), rms

def test_no_parameter_sized_temporaries():
    params = {"attn": jnp.zeros((256, 512)), "ln": jnp.zeros((256,)),
              "moe": {"experts": jnp.zeros((4, 256, 512)), "router": jnp.zeros((256, 4))}}
    for policies in (None, "uniform"):
        tx = skew_adam(1e-3, policies=policies)

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            params, tx.init(params), params).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < 256 * 512 * 4, (policies, temp)  # less than the smallest matrix
