"""add_decoupled_weight_decay against float64 numpy references, step by step.

The chain under test is the one every alias uses: direction -> decay -> learning rate,
here ``chain(scale_by_sign, add_decoupled_weight_decay, scale_by_learning_rate)`` (the
sign gives exact zeros in the update where the gradient is 0, which the cautious mask
must decay). Each reference follows the formula ``p <- p - lr·(u + wd·mul·p·m)`` with
``m = 1`` or, cautiously, ``m = [u·p >= 0]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_snoo import DecoupledWeightDecayState, add_decoupled_weight_decay, muon

STEPS = 40
LR = 0.05
SHAPES = {"mlp": (4, 6), "attn": (5,), "stack": (2, 3, 3)}
MUL = {"mlp": 2.0, "attn": 1.0, "stack": 0.5}


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    params["attn"][0] = 0.0  # an exact zero weight
    return params


def make_grads(seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        g = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
        for v in g.values():  # exact zeros in the update (scale_by_sign keeps them)
            v.reshape(-1)[rng.integers(v.size)] = 0.0
        out.append(g)
    return out


def run(tx: optax.GradientTransformation, params, grads):
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    step = jax.jit(tx.update)
    trajectory = []
    for g in grads:
        u, state = step(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, u)
        trajectory.append(jax.tree.map(np.asarray, params))
    return trajectory, state


def reference(params, grads, wd_of_step, mul=None, cautious=False):
    p = {k: v.astype(np.float64) for k, v in params.items()}
    trajectory = []
    for t, g in enumerate(grads):
        wd = wd_of_step(t)
        new = {}
        for k in p:
            u = np.sign(g[k].astype(np.float64))
            m = (u * p[k] >= 0) if cautious else 1.0
            factor = 1.0 if mul is None else mul[k]
            new[k] = p[k] - LR * (u + wd * factor * p[k] * m)
        p = new
        trajectory.append(p)
    return trajectory


def chain(decay: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.chain(optax.scale_by_sign(), decay, optax.scale_by_learning_rate(LR))


def assert_trajectories_close(got, want):
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {t}, leaf {k}")


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("with_mul", [False, True])
def test_float_weight_decay_matches_reference(cautious, with_mul):
    params, grads = make_params(), make_grads()
    mul = MUL if with_mul else None
    tx = chain(add_decoupled_weight_decay(0.3, mul, cautious=cautious))
    got, state = run(tx, params, grads)
    assert_trajectories_close(got, reference(params, grads, lambda t: 0.3, mul, cautious))
    assert state[1] == optax.EmptyState()  # float decay: no state (checkpoints unchanged)


def test_callable_multiplier_equals_tree():
    params, grads = make_params(), make_grads()[:5]
    by_fn = chain(add_decoupled_weight_decay(
        0.3, lambda p: jax.tree.map(lambda _: 2.0, p)))
    by_tree = chain(add_decoupled_weight_decay(0.3, {k: 2.0 for k in SHAPES}))
    for a, b in zip(run(by_fn, params, grads)[0], run(by_tree, params, grads)[0], strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("cautious", [False, True])
def test_schedule_weight_decay_matches_reference(cautious):
    params, grads = make_params(), make_grads()
    schedule = optax.linear_schedule(0.5, 0.0, STEPS)
    tx = chain(add_decoupled_weight_decay(schedule, MUL, cautious=cautious))
    got, state = run(tx, params, grads)
    want = reference(params, grads, lambda t: 0.5 * (1 - t / STEPS), MUL, cautious)
    assert_trajectories_close(got, want)
    assert isinstance(state[1], DecoupledWeightDecayState)
    assert int(state[1].count) == STEPS


def test_cautious_mask_on_exact_zeros_and_signs():
    p = jnp.array([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 2.0])
    u = jnp.array([1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 0.0])
    tx = add_decoupled_weight_decay(0.1, cautious=True)
    out, _ = tx.update(u, tx.init(p), p)
    # agree: decay; disagree: none; p = 0: wd·p = 0; u = 0: decayed (u·p >= 0).
    np.testing.assert_allclose(np.asarray(out), [1.1, -1.1, -1.0, 1.0, 1.0, 0.0, 0.2],
                               rtol=1e-6)
    # Tiny entries of opposite sign whose float32 product underflows are still told apart.
    tiny_p, tiny_u = jnp.array([1e-30]), jnp.array([-1e-30])
    out, _ = tx.update(tiny_u, tx.init(tiny_p), tiny_p)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tiny_u))


def test_bf16_params_sum_formed_in_float32():
    params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in make_params().items()}
    tx = add_decoupled_weight_decay(0.37, MUL)
    state = tx.init(params)
    for g in make_grads()[:10]:
        u = {k: jnp.asarray(np.sign(v), jnp.bfloat16) * 1.37 for k, v in g.items()}
        out, state = tx.update(u, state, params)
        for k in SHAPES:
            assert out[k].dtype == jnp.bfloat16
            u32, p32 = np.asarray(u[k], np.float32), np.asarray(params[k], np.float32)
            want = (u32 + np.float32(0.37) * np.float32(MUL[k]) * p32).astype(jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want))
        params = optax.apply_updates(params, jax.tree.map(lambda x: -LR * x, out))


def test_masked_nodes_inside_partition_are_skipped():
    params, grads = make_params(), make_grads()
    labels = {"mlp": "decay", "attn": "plain", "stack": "decay"}
    seen = []

    def mul(p):  # sees the params with the other group's leaves masked out
        seen.append(type(p["attn"]))
        return jax.tree.map(lambda _: 2.0, p)

    tx = optax.partition({"decay": chain(add_decoupled_weight_decay(0.3, mul)),
                          "plain": chain(optax.identity())}, labels)
    got, _ = run(tx, params, grads)
    want = reference(params, grads, lambda t: 0.3, {"mlp": 2.0, "attn": 0.0, "stack": 2.0})
    assert_trajectories_close(got, want)
    assert seen and all(s is optax.MaskedNode for s in seen)


def test_optax_style_mask():
    params, grads = make_params(), make_grads()
    mask = {"mlp": True, "attn": False, "stack": True}
    tx = chain(add_decoupled_weight_decay(0.3, mask=mask))
    got, _ = run(tx, params, grads)
    want = reference(params, grads, lambda t: 0.3, {"mlp": 1.0, "attn": 0.0, "stack": 1.0})
    assert_trajectories_close(got, want)


def test_inject_hyperparams_and_jit():
    params, grads = make_params(), make_grads()
    tx = optax.chain(
        optax.scale_by_sign(),
        optax.inject_hyperparams(add_decoupled_weight_decay)(weight_decay=0.3, multiplier=MUL,
                                                             cautious=True),
        optax.scale_by_learning_rate(LR))
    got, state = run(tx, params, grads)
    assert_trajectories_close(got, reference(params, grads, lambda t: 0.3, MUL, True))
    # The injected rate can be changed in the state (as a trainer would do).
    state[1].hyperparams["weight_decay"] = jnp.asarray(0.0)
    u, _ = jax.jit(tx.update)(grads[0], state, jax.tree.map(jnp.asarray, params))
    np.testing.assert_allclose(np.asarray(u["mlp"]), -LR * np.sign(grads[0]["mlp"]))


def test_zero_weight_decay_is_a_no_op_without_params():
    u = {"w": jnp.ones(3)}
    tx = add_decoupled_weight_decay(0, cautious=True)
    assert tx.update(u, tx.init(u))[0] is u


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0.*got -0\.1"):
        add_decoupled_weight_decay(-0.1)
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0"):
        add_decoupled_weight_decay(jnp.asarray(-1.0))
    tx = add_decoupled_weight_decay(0.1)
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


# ------------------------------------------------------------------ muon(...) wiring
def test_muon_adam_group_is_bit_identical_to_adamw():
    params = {"w": jnp.ones((4, 4)), "b": jnp.linspace(-1.0, 1.0, 5)}
    labels = {"w": "muon", "b": "adam"}
    for nesterov in (False, True):
        ours = muon(0.02, adam_learning_rate=3e-3, adam_weight_decay=0.1,
                    adam_nesterov=nesterov, labels=labels)
        # muon(...)'s Adam group used to be optax.adamw; the Muon group is unchanged.
        old = optax.partition(
            {"muon": optax.identity(),
             "adam": optax.adamw(3e-3, weight_decay=0.1, nesterov=nesterov)}, labels)
        s_ours, s_old = ours.init(params), old.init(params)
        adam_state = lambda s: s.inner_states["adam"].inner_state
        assert (jax.tree.structure(adam_state(s_ours))
                == jax.tree.structure(adam_state(s_old)))
        p = params
        for t in range(5):
            g = jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1)), p)
            u1, s_ours = ours.update(g, s_ours, p)
            u2, s_old = old.update(g, s_old, p)
            np.testing.assert_array_equal(np.asarray(u1["b"]), np.asarray(u2["b"]))
            p = optax.apply_updates(p, u1)


def test_muon_cautious_weight_decay_in_both_groups():
    # The gradient is positive everywhere, so both groups' updates are too (the Muon one
    # is the orthogonalised rank-1 matrix of ones): u·p < 0 on the "neg" leaves, > 0 on
    # the "pos" ones.
    params = {"wneg": -jnp.ones((4, 4)), "wpos": jnp.ones((4, 4)),
              "bneg": -jnp.ones((4,)), "bpos": jnp.ones((4,))}
    labels = {"wneg": "muon", "wpos": "muon", "bneg": "adam", "bpos": "adam"}
    grads = jax.tree.map(jnp.ones_like, params)
    kw = dict(adam_learning_rate=0.01, labels=labels)
    plain = muon(0.02, **kw)
    u0, _ = plain.update(grads, plain.init(params), params)
    assert all(bool(jnp.all(-u0[k] > 0)) for k in params)  # -update is the direction
    tx = muon(0.02, weight_decay=0.5, adam_weight_decay=0.5, cautious_weight_decay=True, **kw)
    u, _ = tx.update(grads, tx.init(params), params)
    for k in ("wneg", "bneg"):  # disagree: not decayed
        np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(u0[k]))
    for k, lr in (("wpos", 0.02), ("bpos", 0.01)):  # agree: decayed by lr·wd·p
        np.testing.assert_allclose(np.asarray(u[k]), np.asarray(u0[k]) - lr * 0.5,
                                   rtol=1e-6)
    loud = muon(0.02, weight_decay=0.5, adam_weight_decay=0.5, **kw)
    u2, _ = loud.update(grads, loud.init(params), params)
    np.testing.assert_allclose(np.asarray(u2["wneg"]), np.asarray(u0["wneg"]) + 0.02 * 0.5,
                               rtol=1e-6)
