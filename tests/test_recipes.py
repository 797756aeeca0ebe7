"""The record's schedule and stack (SPEC §2.5, §1, §2)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
from optax_snoo.recipes import modded_nanogpt, stable_cooldown_schedule


def reference_multiplier(t, T, cooldown_frac, final):
    x = t / T
    return 1.0 if x < 1 - cooldown_frac else (1 - x) / cooldown_frac * (1 - final) + final


@pytest.mark.parametrize("cooldown_frac, final", [(0.7, 0.0), (0.7, 0.01), (1.0, 0.1)])
def test_stable_cooldown_matches_spec(cooldown_frac, final):
    T = 5640
    sched = stable_cooldown_schedule(0.03, T, cooldown_frac, final)
    steps = np.arange(0, T + 1, 7)
    got = np.asarray(jax.vmap(sched)(jnp.asarray(steps)))
    want = np.array([0.03 * reference_multiplier(t, T, cooldown_frac, final) for t in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    assert float(sched(T)) == pytest.approx(0.03 * final, abs=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    ({"total_steps": 0}, "total_steps must be an integer >= 1"),
    ({"cooldown_frac": 0.0}, r"cooldown_frac must be in \(0, 1\]"),
    ({"final_lr_scale": 2.0}, r"final_lr_scale must be in \[0, 1\]"),
])
def test_schedule_bad_input(kwargs, match):
    args = {"peak_value": 0.1, "total_steps": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        stable_cooldown_schedule(**args)


PARAMS = {
    "wte": {"embedding": jnp.ones((16, 8)) * 0.1},
    "blocks": [{"attn": {"c_q": {"kernel": jnp.eye(8)}},
                "mlp": {"c_fc": {"kernel": jnp.ones((8, 32)) * 0.1}},
                "ln_1": {"scale": jnp.ones(8)}}],
    "lm_head": {"kernel": jnp.ones((8, 16)) * 0.1},
}


def test_groups_get_their_learning_rates():
    """Without Snoo, with zero momentum, Adam's first step is lr·sign(g) per group."""
    tx = modded_nanogpt(100, use_snoo=False, muon_weight_decay=0.0)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(updates["lm_head"]["kernel"], -1 / 320, rtol=1e-5)
    np.testing.assert_allclose(updates["wte"]["embedding"], -0.3, rtol=1e-5)
    np.testing.assert_allclose(updates["blocks"][0]["ln_1"]["scale"], -0.015, rtol=1e-5)
    # Muon leaves: an orthogonalised, shape-scaled step (not Adam's sign step).
    q = updates["blocks"][0]["attn"]["c_q"]["kernel"]
    s = np.linalg.svd(np.asarray(q, np.float64) / -0.027, compute_uv=False)
    assert s.max() < 1.5


def test_record_stack_is_snoo_outermost_and_trains():
    tx = modded_nanogpt(50, snoo_k=4)
    state = tx.init(PARAMS)
    assert isinstance(state, optax_snoo.SnooState)
    target = jax.tree.map(lambda p: jnp.zeros_like(p), PARAMS)
    loss = lambda p: sum(jnp.sum((a - b) ** 2) for a, b in
                         zip(jax.tree.leaves(p), jax.tree.leaves(target), strict=True))
    params = PARAMS
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    first = float(loss(params))
    for _ in range(20):
        u, state = step(params, state)
        params = optax.apply_updates(params, u)
    assert float(loss(params)) < 0.5 * first


def test_adam_group_without_match_is_an_error():
    tx = modded_nanogpt(10, adam_groups=((r"lm_head", 0.01),))
    match = r"parameter 'blocks/0/ln_1/scale' matches no Adam group \['lm_head'\]"
    with pytest.raises(ValueError, match=match):
        tx.init(PARAMS)


@pytest.mark.parametrize("use_snoo", [False, True])
def test_record_weight_decay_is_doubled_on_mlp_weights(use_snoo):
    """SPEC §2.2: the record's wd 0.01 with wd_mul 2.0 on MLP weights, times the scheduled
    Muon lr. Zero gradients isolate the decay (NS(0) = 0, Adam's step is 0); with Snoo the
    first update is the inner one times η(1 + μ) (SPEC §1, t = 0 fires)."""
    tx = modded_nanogpt(100, use_snoo=use_snoo)
    grads = jax.tree.map(jnp.zeros_like, PARAMS)
    updates, _ = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
    outer = 0.68 * (1 + 0.37) if use_snoo else 1.0
    block, updated = PARAMS["blocks"][0], updates["blocks"][0]
    for module, name, wd_mul in [("mlp", "c_fc", 2.0), ("attn", "c_q", 1.0)]:
        p = np.asarray(block[module][name]["kernel"], np.float64)
        np.testing.assert_allclose(np.asarray(updated[module][name]["kernel"]),
                                   -outer * 0.027 * 0.01 * wd_mul * p, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(updated["ln_1"]["scale"]), 0.0)
