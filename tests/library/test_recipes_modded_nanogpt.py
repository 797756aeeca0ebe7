"""modded-nanogpt's GPT-2 Medium record stack (PR #128: Snoo around Muon and three Adam
groups on the stable cooldown) against a float64 reference, and the general `snoo_muon`
recipe as Snoo around `optax_snoo.muon`. (The schedules: `test_schedules`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
from optax_matrix import nest
from optax_snoo import recipes
from optax_snoo.recipes import modded_nanogpt, modded_nanogpt_muon
from references.error import program_text


def reference_multiplier(t, T, cooldown_frac, final):
    x = t / T
    return 1.0 if x < 1 - cooldown_frac else (1 - x) / cooldown_frac * (1 - final) + final


PARAMS = {
    "wte": {"embedding": jnp.ones((16, 8)) * 0.1},
    "blocks": [{"attn": {"c_q": {"kernel": jnp.eye(8)}},
                "mlp": {"c_fc": {"kernel": jnp.ones((8, 32)) * 0.1}},
                "ln_1": {"scale": jnp.ones(8)}}],
    "lm_head": {"kernel": jnp.ones((8, 16)) * 0.1},
}


def test_groups_get_their_learning_rates():
    """Without Snoo, with zero momentum, Adam's first step is lr·sign(g) per group."""
    tx = modded_nanogpt_muon(100, muon_weight_decay=0.0)
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


def test_adam_patterns_without_a_match_are_an_error():
    tx = modded_nanogpt(10, adam_patterns={"vectors": r"(^|/)bias$"})
    match = r"parameter 'blocks/0/ln_1/scale' matches no Adam group \[.*'\(\^\|/\)bias\$'\]"
    with pytest.raises(ValueError, match=match):
        tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"adam_patterns: expected keys among \['embed', "
                                         r"'head', 'vectors'\], got \['mlp'\]"):
        modded_nanogpt(10, adam_patterns={"mlp": "mlp"})


@pytest.mark.parametrize("use_snoo", [False, True])
def test_record_weight_decay_is_doubled_on_mlp_weights(use_snoo):
    """The record's wd 0.01 with wd_mul 2.0 on MLP weights, times the scheduled
    Muon lr. Zero gradients isolate the decay (NS(0) = 0, Adam's step is 0); with Snoo the
    first update is the inner one times η(1 + μ) (Snoo syncs at t = 0)."""
    tx = (modded_nanogpt if use_snoo else modded_nanogpt_muon)(100)
    grads = jax.tree.map(jnp.zeros_like, PARAMS)
    updates, _ = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
    outer = 0.68 * (1 + 0.37) if use_snoo else 1.0
    block, updated = PARAMS["blocks"][0], updates["blocks"][0]
    for module, name, wd_mul in [("mlp", "c_fc", 2.0), ("attn", "c_q", 1.0)]:
        p = np.asarray(block[module][name]["kernel"], np.float64)
        np.testing.assert_allclose(np.asarray(updated[module][name]["kernel"]),
                                   -outer * 0.027 * 0.01 * wd_mul * p, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(updated["ln_1"]["scale"]), 0.0)


# ---------------------------------------------------------------- the whole stack, float64
MODDED = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
          (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))  # the record's NS coefficients


def ref_ns(x):
    X = np.asarray(x, np.float64)
    transposed = X.shape[-2] > X.shape[-1]
    X = np.swapaxes(X, -1, -2) if transposed else X
    X = X / (np.linalg.norm(X, axis=(-2, -1), keepdims=True) + 1e-7)
    for a, b, c in MODDED:
        A = X @ np.swapaxes(X, -1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return np.swapaxes(X, -1, -2) if transposed else X


# path -> (shape, group): "muon" or the record's Adam lr.
STACK = {
    "wte/embedding": ((16, 8), 0.3), "lm_head/kernel": ((8, 16), 1 / 320),
    "blocks/0/ln_1/scale": ((8,), 0.015), "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/mlp/c_fc/kernel": ((8, 32), "muon"), "blocks/0/mlp/c_proj/kernel": ((32, 8), "muon"),
    "blocks/0/moe/experts/w_fc": ((3, 8, 12), "muon"),
}


def reference_record(params, grads, T, k):
    """Snoo around Muon (record values) and Adam (0.8, 0.95, 1e-10), all on the stable
    cooldown schedule."""
    p = {n: v.copy() for n, v in params.items()}
    slow, buf = {n: v.copy() for n, v in p.items()}, {n: np.zeros_like(v) for n, v in p.items()}
    m, v = {n: np.zeros_like(x) for n, x in p.items()}, {n: np.zeros_like(x) for n, x in p.items()}
    history = []
    for t, g in enumerate(grads):
        mult = reference_multiplier(t, T, 0.7, 0.0)
        fast = {}
        for n, x in p.items():
            group = STACK[n][1]
            if group == "muon":
                beta = 0.85 + 0.10 * min(t / 300, 1)
                m[n] = beta * m[n] + (1 - beta) * g[n]
                o = ref_ns(beta * m[n] + (1 - beta) * g[n])
                lr, wd_mul = 0.027 * mult, 2.0 if "/mlp/" in n else 1.0
                fast[n] = (x * (1 - lr * 0.01 * wd_mul)
                           - lr * np.sqrt(max(1.0, x.shape[-1] / x.shape[-2])) * o)
            else:
                m[n] = 0.8 * m[n] + 0.2 * g[n]
                v[n] = 0.95 * v[n] + 0.05 * g[n] ** 2
                mh, vh = m[n] / (1 - 0.8 ** (t + 1)), v[n] / (1 - 0.95 ** (t + 1))
                fast[n] = x - group * mult * mh / (np.sqrt(vh) + 1e-10)
        if t % k == 0:
            for n in fast:
                d = slow[n] - fast[n]
                buf[n] = 0.37 * buf[n] + d
                slow[n] = slow[n] - 0.68 * (d + 0.37 * buf[n])
                fast[n] = slow[n].copy()
        p = fast
        history.append(p)
    return history


def test_record_stack_matches_float64_reference():
    T, k = 30, 4
    rng = np.random.default_rng(0)
    params = {n: 0.1 * rng.standard_normal(shape) for n, (shape, _) in STACK.items()}
    grads = [{n: rng.standard_normal(shape) for n, (shape, _) in STACK.items()}
             for _ in range(T)]
    ref = reference_record(params, grads, T, k)
    tx = modded_nanogpt(T, snoo_k=k, ns_dtype="float32")
    ours = nest(params)
    state, update = tx.init(ours), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, ours)
        ours = optax.apply_updates(ours, u)
        flat = {optax_snoo.labels.path_to_str(path): np.asarray(x, np.float64)
                for path, x in jax.tree_util.tree_flatten_with_path(ours)[0]}
        for n, want in ref[t].items():
            np.testing.assert_allclose(flat[n], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {t}, {n}")


@pytest.mark.parametrize("schedule", ["cosine", "stable_cooldown"])
def test_snoo_muon_is_snoo_around_muon(schedule):
    """The `snoo_muon` recipe: the same updates as `snoo(optax_snoo.muon(...))` with one
    undecayed Adam group, both groups on the recipe's schedule of their own peak."""
    T = 6
    params = {"h": {"kernel": jnp.linspace(-1, 1, 24).reshape(4, 6)},
              "wte": {"embedding": jnp.linspace(0, 1, 12).reshape(6, 2)}}
    grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1)), params) for i in range(4)]
    if schedule == "cosine":
        sched = lambda peak: optax_snoo.nanogpt_cosine_schedule(
            peak, warmup_steps=2, decay_steps=T, final_lr_scale=0.1)
        options = dict(warmup_iters=2)
    else:
        sched = lambda peak: optax_snoo.stable_cooldown_schedule(peak, T, 0.5, 0.1)
        options = dict(cooldown_frac=0.5)
    ours = recipes.snoo_muon(T, schedule=schedule, muon_learning_rate=0.02,
                             adam_learning_rate=3e-3, muon_momentum_warmup_steps=3,
                             muon_weight_decay=0.1, adam_b1=0.8, adam_b2=0.95, snoo_k=2,
                             snoo_learning_rate=0.7, snoo_momentum=0.5, **options)
    theirs = optax_snoo.snoo(optax_snoo.muon(
        sched(0.02), beta=optax_snoo.muon_momentum_warmup(0.85, 0.95, 3), weight_decay=0.1,
        adam_learning_rate=sched(3e-3), adam_b1=0.8, adam_b2=0.95, adam_eps=1e-8,
        adam_weight_decay=0.0), 0.7, 0.5, k=2)
    states = [ours.init(params), theirs.init(params)]
    updates = [jax.jit(ours.update), jax.jit(theirs.update)]
    # The recipe builds that stack: one program, so bit for bit the same updates.
    assert (program_text(updates[0].lower(grads[0], states[0], params))
            == program_text(updates[1].lower(grads[0], states[1], params)))
    for g in grads:
        (u1, states[0]), (u2, states[1]) = (update(g, s, params) for update, s in
                                            zip(updates, states, strict=True))
        jax.tree.map(np.testing.assert_array_equal, u1, u2)
        params = optax.apply_updates(params, u1)
    assert sorted(states[0].inner_state.inner_states) == ["adam", "muon"]


@pytest.mark.parametrize("kwargs, match", [
    ({"muon_learning_rate": -1.0}, r"^recipe snoo_muon: muon_learning_rate=-1\.0: expected a "
                                   r"finite number > 0$"),
    ({"adam_learning_rate": ()}, r"^recipe snoo_muon: adam_learning_rate=\(\): expected float$"),
    ({"snoo_k": 0}, r"^recipe snoo_muon: snoo_k=0: expected an integer >= 1$"),
    ({"cooldown_frac": 0.5}, r"^recipe snoo_muon: cooldown_frac is read only with "
                             r"schedule='stable_cooldown', not schedule='cosine'"),
    ({"muon_learning_rat": 0.02}, r"^'muon_learning_rat' is not a hyperparameter of recipe "
                                  r"snoo_muon \(did you mean muon_learning_rate"),
])
def test_snoo_muon_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recipes.snoo_muon(100, **kwargs)
