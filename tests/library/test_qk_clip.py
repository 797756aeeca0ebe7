"""QK-clip (MuonClip): the transform against a float64 numpy reference, the model's max
logits against a direct computation, the trainer's accumulation, flag and metric, and a
model driven into large logits that the clip keeps at tau."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import optax_snoo
from optax_snoo import QKHeads, qk_clip_heads, scale_by_qk_clip
from references.error import EPS32, ULPS, assert_as_accurate, run_in_float64
from train import config as tc
from train.errors import MISTAKE_EXIT_STATUS
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import _plain_grad_fn, create_train_state, make_train_step

D, H, TAU = 8, 3, 10.0


def attn_params(rng, n, k, bias=True):
    """One attention layer as models.GPT lays it out, plus an unrelated leaf."""
    layer = {"c_q": {"kernel": rng.normal(size=(D, n * H))},
             "c_k": {"kernel": rng.normal(size=(D, k * H))},
             "c_v": {"kernel": rng.normal(size=(D, k * H))}}
    if bias:
        for name, heads in (("c_q", n), ("c_k", k), ("c_v", k)):
            layer[name]["bias"] = rng.normal(size=(heads * H,))
    return {"blocks": {"0": {"attn": layer}}, "wte": rng.normal(size=(5, D))}


def reference_clip(params, max_logits, tau, n, k):
    """The per-head rule written out in float64, head by head (the module's docstring)."""
    out = jax.tree.map(lambda a: np.array(a, np.float64), params)
    attn = out["blocks"]["0"]["attn"]
    gamma = [min(1.0, tau / s) if s > 0 else 1.0 for s in max_logits]
    group = n // k
    for j in range(k):
        g = min(gamma[j * group:(j + 1) * group])
        for leaf in attn["c_k"].values():
            leaf[..., j * H:(j + 1) * H] *= np.sqrt(g)
        for i in range(group):
            h = j * group + i
            for leaf in attn["c_q"].values():
                leaf[..., h * H:(h + 1) * H] *= gamma[h] / np.sqrt(g)
    return out


def sgd_with_clip(heads, lr=0.1):
    return jax.jit(lambda g, s, p, ml: optax.chain(optax.sgd(lr), scale_by_qk_clip(TAU, heads))
                   .update(g, s, p, max_logits=ml))


@pytest.mark.parametrize("n, k", [(4, 4), (4, 2), (4, 1)])
def test_matches_float64_reference_over_steps(n, k):
    rng = np.random.default_rng(n * 10 + k)
    p64 = attn_params(rng, n, k)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p64)
    tx = optax.chain(optax.sgd(0.1), scale_by_qk_clip(TAU, qk_clip_heads(n, k)))
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, ml: tx.update(g, s, p, max_logits=ml))
    for _ in range(5):
        grads64 = jax.tree.map(lambda a: rng.normal(size=a.shape), p64)
        max_logits = rng.uniform(0.0, 3 * TAU, size=n)  # some heads above tau, some below
        grads = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), grads64)
        u, state = update(grads, state, params, {"blocks/0/attn": jnp.asarray(max_logits)})
        params = optax.apply_updates(params, u)
        p64 = reference_clip(jax.tree.map(lambda p, g: p - 0.1 * g, p64, grads64),
                             max_logits, TAU, n, k)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5),
                     params, p64)


@pytest.mark.parametrize("n, k", [(4, 4), (4, 2)])
def test_each_query_heads_logits_scale_by_exactly_gamma(n, k):
    """q_h . k_j(h) = x Wq_h Wk_j^T x': the product Wq_h Wk_j^T scales by min(1, tau/S_h)."""
    rng = np.random.default_rng(1)
    params = jax.tree.map(jnp.asarray, attn_params(rng, n, k, bias=False))
    max_logits = np.array([5.0, 40.0, 10.0, 20.0])
    u, _ = scale_by_qk_clip(TAU, qk_clip_heads(n, k)).update(
        jax.tree.map(jnp.zeros_like, params), optax.EmptyState(), params,
        max_logits={"blocks/0/attn": max_logits})
    new = optax.apply_updates(params, u)

    def products(p):
        wq, wk = (np.asarray(p["blocks"]["0"]["attn"][c]["kernel"], np.float64)
                  for c in ("c_q", "c_k"))
        return [wq[:, h * H:(h + 1) * H] @ wk[:, (h // (n // k)) * H:][:, :H].T
                for h in range(n)]

    for h, (before, after) in enumerate(zip(products(params), products(new), strict=True)):
        np.testing.assert_allclose(after, min(1.0, TAU / max_logits[h]) * before, rtol=1e-5)


def test_heads_below_tau_and_other_leaves_are_untouched_exactly_in_bf16():
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), attn_params(rng, 4, 2))
    grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.bfloat16), params)
    tx = optax.chain(optax.sgd(0.1), scale_by_qk_clip(TAU, qk_clip_heads(4, 2)))
    plain, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params), params)
    # key group 0 (query heads 0, 1) below tau; group 1 has head 3 above it
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params,
                              max_logits={"blocks/0/attn": jnp.array([1.0, TAU, 3.0, 4 * TAU])})
    assert jax.tree.all(jax.tree.map(lambda a: a.dtype == jnp.bfloat16, u))
    attn, plain_attn = u["blocks"]["0"]["attn"], plain["blocks"]["0"]["attn"]
    for name, cols in (("c_q", slice(0, 2 * H)), ("c_k", slice(0, H))):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(attn[name][leaf][..., cols],
                                          plain_attn[name][leaf][..., cols])
            assert not np.array_equal(attn[name][leaf][..., cols.stop:],
                                      plain_attn[name][leaf][..., cols.stop:])
    np.testing.assert_array_equal(u["wte"], plain["wte"])
    np.testing.assert_array_equal(attn["c_v"]["kernel"], plain_attn["c_v"]["kernel"])


def test_explicit_heads_tree_with_heads_on_axis_0():
    """A user's own layout: the key kernel stored (heads, D), marked by a QKHeads tree."""
    rng = np.random.default_rng(3)
    params = {"wq": jnp.asarray(rng.normal(size=(D, 2 * H))),
              "wk": jnp.asarray(rng.normal(size=(2 * H, D))), "other": jnp.ones(3)}
    heads = {"wq": QKHeads("mine", "query", 2), "wk": QKHeads("mine", "key", 2, axis=0),
             "other": None}
    u, _ = scale_by_qk_clip(TAU, heads).update(
        jax.tree.map(jnp.zeros_like, params), optax.EmptyState(), params,
        max_logits={"mine": jnp.array([4 * TAU, 1.0])})
    new = optax.apply_updates(params, u)
    np.testing.assert_allclose(new["wq"][:, :H], params["wq"][:, :H] / 2, rtol=1e-6)
    np.testing.assert_allclose(new["wk"][:H], params["wk"][:H] / 2, rtol=1e-6)
    np.testing.assert_array_equal(new["wk"][H:], params["wk"][H:])


def test_max_logits_reach_the_clip_through_snoo():
    """Snoo forwards extra args: with k=1, lr=1, momentum=0 it is its inner chain."""
    rng = np.random.default_rng(4)
    params = jax.tree.map(jnp.asarray, attn_params(rng, 4, 2))
    grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), params)
    inner = optax.chain(optax.sgd(0.1), scale_by_qk_clip(TAU, qk_clip_heads(4, 2)))
    wrapped = optax_snoo.snoo(inner, learning_rate=1.0, momentum=0.0, k=1)
    ml = {"blocks/0/attn": jnp.array([1.0, 2 * TAU, 3.0, 4 * TAU])}
    want, _ = inner.update(grads, inner.init(params), params, max_logits=ml)
    got, _ = jax.jit(wrapped.update)(grads, wrapped.init(params), params, max_logits=ml)
    # Snoo's update is the fast weights minus the slow ones, (p + u) - p in float32: two
    # roundings of half an ulp of p + u, besides the inner chain's own (jitted here, op by
    # op there: at most three half-ulp roundings of p or u each): 4 ulps of |p| + |u|.
    jax.tree.map(lambda a, b, p: np.testing.assert_array_less(
        np.abs(np.asarray(a, np.float64) - b), ULPS * EPS32 * (np.abs(p) + np.abs(b)) + 1e-30),
        got, want, params)
    plain, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params), params)
    assert not np.allclose(got["blocks"]["0"]["attn"]["c_q"]["kernel"],
                           plain["blocks"]["0"]["attn"]["c_q"]["kernel"])


@pytest.mark.parametrize("make, match", [
    (lambda p: scale_by_qk_clip(0.0, qk_clip_heads(4)), "tau must be > 0, got 0.0"),
    (lambda p: scale_by_qk_clip(-1, qk_clip_heads(4)), "tau must be > 0, got -1"),
    (lambda p: scale_by_qk_clip(TAU, qk_clip_heads(4, 3)), "num_heads=4 must be a multiple"),
    (lambda p: scale_by_qk_clip(TAU, qk_clip_heads(4, key=r"nothing$")).init(p),
     "'blocks/0/attn' has a query leaf but no key leaf"),
    (lambda p: scale_by_qk_clip(TAU, qk_clip_heads(5)).init(p),
     "num_heads=5 does not divide axis -1 of size 12"),
    (lambda p: scale_by_qk_clip(TAU, {"blocks": {"0": {"attn": {
        "c_q": {"kernel": QKHeads("a", "query", 4), "bias": None},
        "c_k": {"kernel": QKHeads("a", "key", 3), "bias": None},
        "c_v": {"kernel": None, "bias": None}}}}, "wte": None}).init(p),
     "'a': 4 query heads are not a multiple of its 3 key heads"),
    (lambda p: scale_by_qk_clip(TAU, {"wte": None}).init(p), "heads must have the params'"),
    (lambda p: scale_by_qk_clip(TAU, qk_clip_heads(4, query=r"nope", key=r"no")).init(p),
     "no parameter path matches the query pattern 'nope'"),
])
def test_construction_and_init_errors_name_the_value(make, match):
    params = jax.tree.map(jnp.asarray, attn_params(np.random.default_rng(0), 4, 4))
    with pytest.raises(ValueError, match=match):
        make(params)


@pytest.mark.parametrize("max_logits, match", [
    (None, "needs max_logits="),
    ({"blocks/1/attn": jnp.ones(4)}, "no entry for layer 'blocks/0/attn'"),
    ({"blocks/0/attn": jnp.ones(2)}, r"has shape \(2,\); expected \(4,\)"),
])
def test_bad_max_logits_fail_at_trace_time(max_logits, match):
    params = jax.tree.map(jnp.asarray, attn_params(np.random.default_rng(0), 4, 2))
    tx = scale_by_qk_clip(TAU, qk_clip_heads(4, 2))
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda u, p: tx.update(u, optax.EmptyState(), p, max_logits=max_logits))(
            params, params)


# ------------------------------------------------------------------------------- model


def tiny_gpt(n_kv_head=None, bias=True, seed=0):
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=32, block_size=16,
                           vocab_size=32, dtype="float32", bias=bias)
    return models.GPT(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_model_max_logits_equal_a_direct_computation(n_kv_head):
    model = tiny_gpt(n_kv_head)
    tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 32)
    _, _, max_logits = nnx.jit(lambda m, t: models.forward(m, t, max_logits=True))(model, tokens)
    assert models.forward(model, tokens)[2] is None
    attn, N, K = model.blocks[0].attn, 4, n_kv_head or 4
    x = model.blocks[0].ln_1(model.wte(tokens) + model.wpe(jnp.arange(16)))
    q = np.asarray(attn.c_q(x), np.float64).reshape(3, 16, N, -1)
    k = np.asarray(attn.c_k(x), np.float64).reshape(3, 16, K, -1)
    k = np.repeat(k, N // K, axis=2)  # query head n reads key head n // (N / K)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((16, 16), bool)), s, -np.inf)
    np.testing.assert_allclose(max_logits["blocks/0/attn"], s.max(axis=(0, 2, 3)), rtol=1e-5)


def test_clip_keeps_a_model_driven_into_large_logits_at_tau():
    """Adam at lr 0.05 on one fixed batch drives the max logit of a tiny GPT past 10 in 30
    steps. The clip reads the logits of the step's own forward pass, before the update it
    clips, so the next step's logits exceed tau by at most that update's own growth of
    them: head n's new max is gamma_n S_n(p + u) <= tau max(1, S_n(p + u) / S_n(p)). That
    margin is measured each step (one more forward pass) and must hold, and the run ends
    well below the unclipped one."""
    tau = 4.0
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    graphdef, params, rest = nnx.split(tiny_gpt(bias=False), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    adam, clip = optax.adam(0.05), scale_by_qk_clip(tau, qk_clip_heads(4))

    def loss(p):
        logits, _, ml = models.forward(nnx.merge(graphdef, p, rest), inputs, max_logits=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), ml

    @jax.jit
    def step(p, state, clipped):
        (_, ml), grads = jax.value_and_grad(loss, has_aux=True)(p)
        u, state = adam.update(grads, state, p)
        growth = loss(optax.apply_updates(p, u))[1]["blocks/0/attn"] / ml["blocks/0/attn"]
        u = jax.lax.cond(clipped, lambda: clip.update(u, optax.EmptyState(), p,
                                                      max_logits=ml)[0], lambda: u)
        return optax.apply_updates(p, u), state, jnp.max(ml["blocks/0/attn"]), jnp.max(growth)

    def run(clipped):
        p, state, measured, growth = params, adam.init(params), [], []
        for _ in range(30):
            p, state, m, g = step(p, state, clipped)
            measured.append(float(m))
            growth.append(float(g))
        return np.array(measured), np.array(growth)

    (without, _), (with_clip, growth) = run(False), run(True)
    assert without[-1] > 2.5 * tau
    assert np.all(with_clip[1:] <= tau * np.maximum(1.0, growth[:-1]) * (1 + 1e-5))
    assert with_clip[-1] <= 1.3 * tau and with_clip.max() < without.max() / 1.5


# ----------------------------------------------------------------------------- trainer


def tiny_config(corpus, out_dir, **overrides) -> tc.TrainConfig:
    base = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, dtype="float32",
                optimizer="adamw", learning_rate=1e-2, final_lr_scale=0.1, warmup_iters=0,
                max_iters=3, eval_interval=3, eval_iters=1, log_interval=1,
                checkpoint_every=3, mesh_data=1, num_samples=0, progress=False,
                vocab_multiple=8, data=str(corpus), out_dir=str(out_dir))
    return tc.override(tc.TrainConfig(), **{**base, **overrides})


def test_step_clips_with_the_max_over_micro_batches(corpus, tmp_path):
    """grad_accum=2: the update gets the elementwise max of the micro-batches' logits (not
    their mean), and the step logs its largest as max_logit."""
    config = tiny_config(corpus, tmp_path, grad_accum=2, qk_clip_tau=1e-3)
    spec = build_optimizer(config)
    assert spec.max_logits
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, 40), spec.tx, seed=0, mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh))
    xy = np.random.default_rng(0).integers(0, 40, (2, 2, 4, 16)).astype(np.int32)

    params = jax.device_get(state.params)
    grad_fn = jax.jit(_plain_grad_fn(model, params, max_logits=True))
    outs = [grad_fn(params, xy[0, a], xy[1, a], None, 0)[1] for a in range(2)]
    grads = jax.tree.map(lambda a, b: (a + b) / 2, outs[0][0], outs[1][0])
    per_batch = [o[1]["max_logits"]["blocks/0/attn"] for o in outs]
    assert not np.allclose(per_batch[0], per_batch[1]) and np.min(per_batch) > 1e-3
    expected_max = {"blocks/0/attn": jnp.maximum(*per_batch)}
    update = jax.jit(lambda tx, ml: optax.apply_updates(
        params, tx.update(grads, tx.init(params), params, **ml)[0]), static_argnums=0)
    want = update(spec.tx, {"max_logits": expected_max})

    new_state, metrics = step(state, put_batch(xy[0], batch_sharding(mesh)),
                              put_batch(xy[1], batch_sharding(mesh)))
    np.testing.assert_allclose(metrics["max_logit"], np.max(per_batch), rtol=1e-6)
    # The step's own program (its accumulation, its fusions): as accurate as this update,
    # against the update of these gradients and logits in float64.
    exact = run_in_float64(jax.jit(lambda p, g, ml: optax.apply_updates(
        p, spec.tx.update(g, spec.tx.init(p), p, max_logits=ml)[0])),
        params, grads, expected_max)
    assert_as_accurate(jax.device_get(new_state.params), want, exact)
    # the clip is active: the query kernel differs from the unclipped AdamW update
    unclipped = update(build_optimizer(tc.override(config, qk_clip_tau=0.0)).tx, {})
    get = lambda t: t["blocks"][0]["attn"]["c_q"]["kernel"]
    assert not np.allclose(get(want), get(unclipped))


def test_cli_run_with_qk_clip_logs_max_logit(corpus, tmp_path):
    from train.__main__ import main

    out = tmp_path / "run"
    flags = {**dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, block_size=16, batch_size=4,
                    dtype="float32", optimizer="muon", max_iters=2, eval_interval=2,
                    eval_iters=1, log_interval=1, checkpoint_every=2, mesh_data=1,
                    num_samples=0, progress=False, data=str(corpus), out_dir=str(out)),
             "qk_clip_tau": 100.0}
    assert main([f"--{k}={v}" for k, v in flags.items()]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [x["max_logit"] for x in lines if "max_logit" in x]
    assert len(logged) == 2 and all(0 < m < 100 for m in logged)


@pytest.mark.parametrize("flags, match", [
    (["--qk_clip_tau=-1"], "qk_clip_tau=-1.0: expected a finite number >= 0"),
    (["--qk_clip_tau=100", "--optimizer=kfac"], "qk_clip_tau=100.0: not supported with "
                                                "--optimizer=kfac"),
])
def test_cli_refuses_bad_qk_clip_in_one_line(flags, match, tmp_path, capsys):
    from train.__main__ import main

    assert main([f"--out_dir={tmp_path / 'run'}", *flags]) == MISTAKE_EXIT_STATUS
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_matrix_qk_clip(tmp_path):
    """The optax matrix, with the logits bound in (the matrix calls `update` without extra
    args): jit = eager, a stable empty state, bf16 kept, `inject_hyperparams(tau)`,
    `MultiSteps`, on an 8-device mesh, through Orbax; and as one group of `partition`
    (the matrix's own partition check renames the leaves, which the heads are found by):
    the attention leaves' updates are the clip's alone, the rest SGD's."""
    import optax_matrix as m

    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                          attn_params(np.random.default_rng(3), 4, 2))
    # numpy: the logits take the params' precision (float64 in the reference runs)
    logits = {"blocks/0/attn": np.asarray([30.0, 5.0, 12.0, 40.0])}  # two heads over TAU

    def bound(tau):
        clip = scale_by_qk_clip(tau, qk_clip_heads(4, 2))
        return optax.GradientTransformation(
            clip.init, lambda u, s, p=None: clip.update(
                u, s, p, max_logits=jax.tree.map(jnp.asarray, logits)))

    tx = bound(TAU)  # stateless: float64=tx
    m.check_jit_matches_eager(tx, params, float64=tx)
    m.check_state_stable(tx, params)
    m.check_dtype_preserved(tx, params)
    m.check_inject_hyperparams(bound, params, dict(tau=TAU), float64=True)
    m.check_multisteps(tx, params, float64=tx)
    m.check_sharded_state(tx, params, float64=tx)
    m.check_orbax_roundtrip(tx, params, tmp_path)
    labels = jax.tree.map_with_path(lambda path, _: "sgd" if "wte" in str(path) else "clip",
                                    params)
    part = optax.partition({"clip": tx, "sgd": optax.sgd(0.1)}, labels)
    grads = jax.tree.map(jnp.ones_like, params)
    u_part, _ = jax.jit(part.update)(grads, part.init(params), params)
    alone = lambda p: jax.jit(tx.update)(jax.tree.map(jnp.ones_like, p), tx.init(p), p)[0]
    # Two programs (XLA fuses, and contracts a*b+c, per program): as accurate as each other.
    m.assert_runs_agree(u_part["blocks"], alone(params)["blocks"],
                        run_in_float64(alone, params)["blocks"])
    np.testing.assert_allclose(u_part["wte"], -0.1 * np.ones_like(params["wte"]))
