"""SkewAdam (Malik 2026, arXiv 2607.19058) against a float64 NumPy reference, properties,
roles, the optax matrix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo._src.skew_adam import (
    DEFAULT_POLICIES,
    RolePolicy,
    ScaleBySecondMomentState,
    ScaleBySkewAdamState,
    assign_roles,
    resolve_policies,
    scale_by_second_moment,
    scale_by_skew_adam,
    skew_adam,
    skew_adam_roles,
)
from references.error import assert_as_accurate, run_in_float64

# A small MoE-shaped tree: 2-D and 1-D backbone, an (E, R, C) expert stack, a 2-D router.
SHAPES = {"wte": (6, 5), "ln": (5,), "moe": {"experts": (3, 4, 5), "router": (5, 3)}}
ROLE_OF = {"wte": "backbone", "ln": "backbone", "moe/experts": "experts", "moe/router": "router"}


def _flat(tree):
    return {"wte": tree["wte"], "ln": tree["ln"],
            "moe/experts": tree["moe"]["experts"], "moe/router": tree["moe"]["router"]}


def _unflat(flat):
    return {"wte": flat["wte"], "ln": flat["ln"],
            "moe": {"experts": flat["moe/experts"], "router": flat["moe/router"]}}


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                        is_leaf=lambda s: isinstance(s, tuple))


def make_grads(steps, seed=1):
    """float32 gradients with structure that exercises every branch of the paper's update:
    rows of very different scale (the factored row normalisation and the eps clamp), spikes
    (update clipping: RMS(u) > 1), and quiet stretches (the clamp on c and v)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        scale = 1.0
        if t % 17 == 5:
            scale = 30.0        # spike: v lags behind, RMS(u) > 1
        elif 60 <= t < 70:
            scale = 1e-3        # quiet: c, v fall under a large eps
        g = {}
        for name, shape in _flat(SHAPES).items():
            row_scale = np.exp(rng.uniform(-3, 1, size=(*shape[:-1], 1))) if len(shape) > 1 else 1
            g[name] = (scale * row_scale * rng.normal(size=shape)).astype(np.float32)
        out.append(g)
    return out


def reference(params, grads, *, lr_fn, b1, b2, eps, wd, policies, clip=1.0):
    """The paper's update (Malik 2026, steps 1-4 of its algorithm) in float64, written from
    the text; returns the params after each step and
    how often the clip and the eps clamps fired."""
    p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
    state = {}
    stats = {"clipped": 0, "unclipped": 0, "clamped": 0}
    history = []
    for step, g_tree in enumerate(grads):
        t = step + 1
        lr = lr_fn(step)
        for name in p:
            pol = policies[ROLE_OF[name]]
            g = np.asarray(g_tree[name], np.float64)
            st = state.setdefault(name, {})
            # 1. second moment -> den
            if pol.factored and g.ndim >= 2:
                r = b2 * st.get("r", 0.0) + (1 - b2) * np.mean(g * g, axis=-1)
                c = b2 * st.get("c", 0.0) + (1 - b2) * np.mean(g * g, axis=-2)
                st["r"], st["c"] = r, c
                r_norm = r / np.maximum(np.mean(r, axis=-1, keepdims=True), 1e-15)
                stats["clamped"] += int(np.sum(r_norm < eps) + np.sum(c < eps))
                row = np.sqrt(np.maximum(r_norm, eps))
                col = np.sqrt(np.maximum(c, eps))
                den = row[..., :, None] * col[..., None, :]
            else:
                v = b2 * st.get("v", 0.0) + (1 - b2) * g * g
                st["v"] = v
                stats["clamped"] += int(np.sum(v < eps))
                den = np.sqrt(np.maximum(v, eps))
            # 2. numerator
            if pol.momentum:
                mom = b1 * st.get("m", 0.0) + (1 - b1) * g
                st["m"] = mom
                u = mom * np.sqrt(1 - b2**t) / (1 - b1**t)
            else:
                u = g * np.sqrt(1 - b2**t)
            # 3. divide, clip per tensor
            u = u / den
            rms = np.sqrt(np.mean(u * u))
            stats["clipped" if rms > clip else "unclipped"] += 1
            u = u / max(1.0, rms / clip)
            # 4. decoupled weight decay, then the step
            if pol.weight_decay:
                p[name] = p[name] * (1 - lr * wd)
            p[name] = p[name] - lr * u
        history.append(dict(p))
    return history, stats


def linear_lr(step):
    """What `optax.linear_schedule(2e-2, 2e-3, 150)` should give at update `step`."""
    return 2e-2 + (2e-3 - 2e-2) * min(step, 150) / 150


CASES = {
    # The paper's defaults for the betas/eps, constant lr.
    "defaults": dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, policies=None),
    # Fast EMAs, a schedule and a large eps so that the clamps fire.
    "clamped": dict(lr=optax.linear_schedule(2e-2, 2e-3, 150), lr_ref=linear_lr,
                    b1=0.8, b2=0.95, eps=1e-2, wd=0.05, policies=None),
    # The paper's "uniform" ablation: momentum and factored statistics for every role.
    "uniform": dict(lr=1e-2, b1=0.5, b2=0.999, eps=1e-8, wd=0.1, policies="uniform"),
}
STEPS = 120


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case):
    c = CASES[case]
    params = make_params()
    grads = make_grads(STEPS)
    lr_fn = c.get("lr_ref", lambda _: c["lr"])
    policies = resolve_policies(c["policies"])
    expected, stats = reference(params, grads, lr_fn=lr_fn, b1=c["b1"], b2=c["b2"],
                                eps=c["eps"], wd=c["wd"], policies=policies)
    # The reference must exercise clipping (both ways) and, for "clamped", the eps clamp.
    assert stats["clipped"] >= 10 and stats["unclipped"] >= 10, stats
    if case == "clamped":
        assert stats["clamped"] >= 20, stats

    tx = skew_adam(c["lr"], b1=c["b1"], b2=c["b2"], eps=c["eps"], weight_decay=c["wd"],
                   policies=c["policies"])
    state = tx.init(params)
    update = jax.jit(tx.update)
    p = params
    for t, g in enumerate(grads):
        u, state = update(_unflat({k: jnp.asarray(v) for k, v in g.items()}), state, p)
        p = optax.apply_updates(p, u)
        got = _flat(p)
        for name in got:
            np.testing.assert_allclose(np.asarray(got[name], np.float64), expected[t][name],
                                       rtol=1e-5, atol=1e-6, err_msg=f"{name} at step {t}")


def test_bf16_params_decay_in_float32():
    """Decoupled weight decay on bf16 params: the float32 new value `p(1 - lr·wd) - lr·u` (before
    any rounding) from the exact bf16 `p`; `wd·p` must not be rounded to bf16 first
    (optax.add_decayed_weights multiplies in the param dtype: 2^-9 relative error)."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    grads = make_grads(1)
    lr, wd = 1e-2, 0.3
    p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    (expected,), _ = reference(p64, grads, lr_fn=lambda _: lr, b1=0.9, b2=0.999, eps=1e-8,
                               wd=wd, policies=resolve_policies(None))
    tx = skew_adam(lr, weight_decay=wd, rounding=optax.identity())
    u, _ = jax.jit(tx.update)(_unflat({k: jnp.asarray(v) for k, v in grads[0].items()}),
                              tx.init(params), params)
    for name, got in _flat(u).items():
        assert got.dtype == jnp.float32
        want = expected[name] - _flat(p64)[name]
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-8,
                                   err_msg=name)


def test_router_has_no_weight_decay_and_experts_do():
    """With zero gradients only the weight decay moves parameters."""
    params = make_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = skew_adam(0.1, weight_decay=0.5)
    u, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    new = optax.apply_updates(params, u)
    np.testing.assert_array_equal(new["moe"]["router"], params["moe"]["router"])
    for name in ("wte", "ln"):
        np.testing.assert_allclose(new[name], params[name] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_allclose(new["moe"]["experts"], params["moe"]["experts"] * 0.95, rtol=1e-6)


def test_state_layout_per_role_and_presets():
    params = make_params()

    def inner(state):
        return {role: s.inner_state[0] for role, s in state[0].inner_states.items()}

    none = optax.MaskedNode()
    init = lambda tx: jax.eval_shape(tx.init, params)  # structure, shapes, dtypes only
    st = inner(init(skew_adam()))
    bb = st["backbone"]
    assert isinstance(bb, ScaleBySkewAdamState)
    assert bb.mu["wte"].shape == (6, 5) and bb.mu["ln"].shape == (5,)
    assert bb.v_row["wte"].shape == (6,) and bb.v_col["wte"].shape == (5,)
    assert bb.v["wte"] == none
    assert bb.v["ln"].shape == (5,) and bb.v_row["ln"] == none    # 1-D: full
    ex = st["experts"]
    assert isinstance(ex, ScaleBySecondMomentState)               # no momentum
    assert ex.v_row["moe"]["experts"].shape == (3, 4)             # per expert
    assert ex.v_col["moe"]["experts"].shape == (3, 5)
    assert ex.v["moe"]["experts"] == none
    assert st["router"].v["moe"]["router"].shape == (5, 3)        # full
    assert st["router"].v_row["moe"]["router"] == none
    for leaf in jax.tree.leaves(st):
        assert leaf.dtype in (jnp.float32, jnp.int32)

    st = inner(init(skew_adam(policies="expert_momentum")))
    assert isinstance(st["experts"], ScaleBySkewAdamState)
    assert st["experts"].mu["moe"]["experts"].shape == (3, 4, 5)
    st = inner(init(skew_adam(policies="factored_router")))
    assert st["router"].v_row["moe"]["router"].shape == (5,)
    st = inner(init(skew_adam(policies={"experts": RolePolicy(momentum=True, factored=False)})))
    assert st["experts"].v["moe"]["experts"].shape == (3, 4, 5)


def test_bf16_params_keep_float32_statistics():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    tx = skew_adam(1e-2)
    for leaf in jax.tree.leaves(jax.eval_shape(tx.init, params)):
        assert leaf.dtype in (jnp.float32, jnp.int32)
    # (updates in the param dtype: the matrix's check_dtype_preserved)


def test_factored_equals_full_for_rank_one_squared_gradients():
    """For g = a bᵀ the factored estimate R·Cᵀ/mean(R) is exact, so the factored and full
    second moments give the same direction (when the eps clamp is inactive)."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.zeros((2, 6, 4))}
    a = rng.uniform(0.5, 2, size=(2, 6, 1))
    b = rng.uniform(0.5, 2, size=(2, 1, 4))
    # g² = s² a² b² stays rank one per expert; signs and the scale s change every step.
    gs = [{"w": np.asarray(rng.uniform(0.2, 3) * rng.choice([-1, 1], size=(2, 6, 4)) * a * b,
                           np.float32)} for _ in range(20)]

    def directions(params, gs):  # statistics in the params' dtype (float64: the reference)
        kw = dict(stats_dtype=params["w"].dtype)
        fac, full = scale_by_second_moment(0.9, **kw), scale_by_second_moment(
            0.9, factored=False, **kw)
        sf, sg = fac.init(params), full.init(params)
        fac_update, full_update = jax.jit(fac.update), jax.jit(full.update)
        out = []
        for g in gs:
            (uf, sf), (ug, sg) = fac_update(g, sf), full_update(g, sg)
            out.append((uf, ug))
        return out

    # Factored and full statistics round differently: as accurate as the full one
    # against its float64 computation.
    exact = run_in_float64(directions, params, gs)
    for t, ((uf, ug), (_, ug64)) in enumerate(zip(directions(params, gs), exact, strict=True)):
        assert_as_accurate(uf, ug, ug64, what=f"step {t}")


def test_expert_stack_is_factored_per_expert():
    """An (E, R, C) stack's direction equals that of E separate (R, C) matrices."""
    rng = np.random.default_rng(4)
    gs = [(rng.normal(size=(3, 4, 5)) * rng.uniform(0.1, 3, size=(3, 1, 1))).astype(np.float32)
          for _ in range(10)]

    def directions(gs):  # statistics in the gradients' dtype (float64: the reference)
        tx = scale_by_skew_adam(0.9, 0.99, stats_dtype=gs[0].dtype)
        stack = {"e": jnp.zeros((3, 4, 5), gs[0].dtype)}
        split = {f"e{i}": jnp.zeros((4, 5), gs[0].dtype) for i in range(3)}
        s1, s2 = tx.init(stack), tx.init(split)
        update = jax.jit(tx.update)
        out = []
        for g in gs:
            u1, s1 = update({"e": g}, s1)
            u2, s2 = update({f"e{i}": g[i] for i in range(3)}, s2)
            out.append(([u1["e"][i] for i in range(3)], [u2[f"e{i}"] for i in range(3)]))
        return out

    # One stacked reduction rounds otherwise than three: as accurate as the separate
    # matrices against their float64 computation.
    exact = run_in_float64(directions, gs)
    for t, ((u1, u2), (_, u64)) in enumerate(zip(directions(gs), exact, strict=True)):
        assert_as_accurate(u1, u2, u64, what=f"step {t}")


def test_first_step_is_the_sign_for_full_second_moment():
    """t = 1: u = g·sqrt(1-β2)/sqrt((1-β2) g²) = sign(g), with or without momentum."""
    g = {"v": jnp.asarray([0.3, -2.0, 5.0])}
    for momentum in (True, False):
        tx = scale_by_skew_adam(momentum=momentum)
        u, _ = tx.update(g, tx.init(g))
        np.testing.assert_allclose(u["v"], [1.0, -1.0, 1.0], rtol=1e-6)


# ----------------------------------------------------------------------------- roles

def test_default_roles_by_path():
    tree = {"h0": {"attn": 0, "moe": {"experts": {"w1": 0}, "router": {"kernel": 0}}}, "wte": 0}
    assert assign_roles(tree) == {
        "h0": {"attn": "backbone", "moe": {"experts": {"w1": "experts"},
                                           "router": {"kernel": "router"}}},
        "wte": "backbone"}


def test_custom_rules_regex_and_new_roles():
    params = make_params()
    rules = [(re.compile(r"^wte$"), "embed"), ("experts", "experts"), ("router", "router")]
    tx = skew_adam(1e-2, roles=rules,
                   policies={"embed": RolePolicy(momentum=False, factored=False)})
    state = jax.eval_shape(tx.init, params)
    assert set(state[0].inner_states) == {"backbone", "experts", "router", "embed"}
    embed = state[0].inner_states["embed"].inner_state[0]
    assert embed.v["wte"].shape == (6, 5) and embed.v["ln"] == optax.MaskedNode()
    jax.eval_shape(tx.update, params, state, params)  # traces the update


def test_roles_callable():
    params = make_params()
    # Everything is an expert: then the result equals the "experts" policy on every leaf.
    everything_experts = lambda p: jax.tree.map(lambda _: "experts", p)
    tx = skew_adam(1e-2, roles=everything_experts)
    p1, _, _ = m.run(tx, params, 3)
    chain = lambda dtype: optax.chain(
        scale_by_skew_adam(momentum=False, stats_dtype=dtype), optax.clip_by_block_rms(1.0),
        optax.add_decayed_weights(0.05), optax.scale_by_learning_rate(1e-2))
    p2, _, _ = m.run(chain(jnp.float32), params, 3)
    # Another program (a partition of one role): as accurate as the chain, against the
    # chain's float64 run.
    m.assert_runs_agree(p1, p2, m.float64_run(chain(jnp.float64), params, 3),
                        what="roles callable")


def test_skew_adam_roles_describes_the_role_of_every_path():
    params = make_params()
    assert skew_adam_roles(params) == {"ln": "backbone", "moe/experts": "experts",
                                       "moe/router": "router", "wte": "backbone"}
    assert optax_snoo.skew_adam_roles is skew_adam_roles
    # The same labelling as the optimizer's: its partition holds exactly these leaves.
    rules = [(re.compile(r"^wte$"), "embed"), ("router", "router")]
    got = skew_adam_roles(params, rules)
    assert got == {"ln": "backbone", "moe/experts": "backbone", "moe/router": "router",
                   "wte": "embed"}
    tx = skew_adam(1e-2, roles=rules, policies={"embed": RolePolicy(momentum=False)})
    state = jax.eval_shape(tx.init, params)
    for role, inner in state[0].inner_states.items():
        moments = inner.inner_state[0]
        held = {optax_snoo.labels.path_to_str(path)
                for path, x in jax.tree_util.tree_leaves_with_path(moments.v_row)
                + jax.tree_util.tree_leaves_with_path(moments.v)}
        assert held == {name for name, r in got.items() if r == role}, role
    everything = lambda p: jax.tree.map(lambda _: "experts", p)
    assert set(skew_adam_roles(params, everything).values()) == {"experts"}


def test_string_role_patterns_match_as_substrings_not_regexes():
    tree = {"moe.experts": 0, "moeXexperts": 0, "a+b": 0}
    assert assign_roles(tree, [("moe.experts", "experts"), ("a+b", "router")]) == {
        "moe.experts": "experts", "moeXexperts": "backbone", "a+b": "router"}
    assert assign_roles({"r": 0}, [["r", "router"]]) == {"r": "router"}  # list pairs too


def test_callable_roles_under_inject_hyperparams_say_to_use_static_args():
    roles = optax_snoo.labels.label_by_rules([("experts", "experts")], default="backbone")
    for fn in (roles, lambda p: {"wte": "backbone"}):
        tx = optax.inject_hyperparams(skew_adam)(learning_rate=1e-3, roles=fn)
        with pytest.raises(TypeError, match=r"static_args=\('roles'"):
            tx.init(MATRIX_PARAMS)


def test_concrete_array_hyperparameters_are_validated():
    # optax.inject_hyperparams hands numeric hyperparameters over as concrete arrays.
    for kw, name in (({"learning_rate": -1.0}, "learning_rate"), ({"b2": 1.5}, "b2"),
                     ({"weight_decay": -0.1}, "weight_decay")):
        tx = optax.inject_hyperparams(skew_adam)(**kw)
        with pytest.raises(ValueError, match=name):
            tx.init(MATRIX_PARAMS)


def test_bad_inputs():
    params = make_params()
    with pytest.raises(ValueError, match="learning_rate"):
        skew_adam(-1e-3)
    for kw in ({"b1": 1.0}, {"b1": -0.1}, {"b2": 1.0}, {"b2": -0.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            skew_adam(1e-3, **kw)
    with pytest.raises(ValueError, match="eps"):
        skew_adam(1e-3, eps=0.0)
    with pytest.raises(TypeError, match="b1"):
        skew_adam(1e-3, b1=optax.constant_schedule(0.9))
    with pytest.raises(ValueError, match="weight_decay"):
        skew_adam(1e-3, weight_decay=-0.1)
    with pytest.raises(ValueError, match="clip_threshold"):
        skew_adam(1e-3, clip_threshold=0.0)
    with pytest.raises(ValueError, match="'expert'"):
        skew_adam(1e-3, policies={"expert": RolePolicy()})
    with pytest.raises(ValueError, match="preset"):
        skew_adam(1e-3, policies="nope")
    with pytest.raises(ValueError, match="without a policy"):
        skew_adam(1e-3, roles=[("norm", "norms")])
    with pytest.raises(ValueError, match="rule"):
        skew_adam(1e-3, roles=[("norm",)])
    with pytest.raises(ValueError, match="rounding"):
        skew_adam(1e-3, rounding="nearest")
    with pytest.raises(TypeError, match="RolePolicy"):
        skew_adam(1e-3, policies={"experts": {"momentum": True}})
    tx = skew_adam(1e-3, roles=lambda p: jax.tree.map(lambda _: "expert", p))
    with pytest.raises(ValueError, match="unknown role"):
        jax.eval_shape(tx.init, params)
    tx = skew_adam(1e-3)
    with pytest.raises(ValueError, match="params"):
        jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params))


def test_default_table_is_the_papers():
    spec = {"backbone": RolePolicy(momentum=True, factored=True, weight_decay=True),
            "experts": RolePolicy(momentum=False, factored=True, weight_decay=True),
            "router": RolePolicy(momentum=False, factored=False, weight_decay=False)}
    assert spec == DEFAULT_POLICIES


# ----------------------------------------------------------------------------- optax matrix

# Shapes chosen so that no factored statistic has the shape of some other parameter
# (the harness checks sharding by shape).
MATRIX_PARAMS = {"wte": jnp.ones((16, 6)), "ln": jnp.ones((12,)),
                 "moe": {"experts": 0.5 * jnp.ones((4, 8, 6)), "router": jnp.ones((6, 4))}}


def test_optax_matrix(tmp_path):
    tx = skew_adam(1e-2)
    # Eager op-by-op dispatch is slow on CPU: a two-leaf tree (backbone matrix with
    # momentum, factored expert stack) covers the eager path.
    # skew_adam keeps float32 statistics for float64 params too: the float64 run's update
    # is then float32-accurate, lr x that on the params, far below their own rounding.
    f64 = dict(float64=tx, float32_state=True)
    m.check_jit_matches_eager(tx, {"w": MATRIX_PARAMS["wte"],
                                   "experts": MATRIX_PARAMS["moe"]["experts"]}, steps=3, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS)
    m.check_dtype_preserved(tx, MATRIX_PARAMS)  # with rounding: tests/library/test_rounding.py
    m.check_multisteps(tx, MATRIX_PARAMS, **f64)
    m.check_partition(tx, MATRIX_PARAMS, **f64)
    m.check_sharded_state(tx, MATRIX_PARAMS, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path)
    # Schedules: see the "clamped" reference case and test_inject_hyperparams.


def test_inject_hyperparams():
    rules = [("experts", "experts"), ("router", "router")]
    state = m.check_inject_hyperparams(
        skew_adam, MATRIX_PARAMS,
        {"learning_rate": optax.linear_schedule(1e-2, 1e-3, 5), "b1": 0.8, "b2": 0.95,
         "weight_decay": 0.1, "roles": rules, "policies": "expert_momentum"},
        static_args=("roles", "policies", "rounding"))
    assert set(state.hyperparams) >= {"learning_rate", "b1", "b2", "weight_decay", "eps"}


def test_nnx_optimizer():
    m.check_nnx_optimizer(skew_adam(1e-2, roles=[("l2", "router")]))
