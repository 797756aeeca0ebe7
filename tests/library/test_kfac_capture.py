"""`optax_snoo.kfac.value_grad_and_stats`: K-FAC statistics read from the loss's jaxpr.

Against hand-written perturbation references (a Flax NNX model of `nnx.Linear` and
`nnx.Einsum`, expert stacks, bf16 compute), a custom-VJP matmul whose backward must be
kept, our GPT (against the gradient identity ``∇W = Σ xᵀ dy``), the error paths, and
`curvature_from_stats` against a float64 per-expert numpy reference.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_snoo import kfac
from optax_snoo._src.utils import path_to_str
from references.error import assert_as_accurate, run_in_float64

RNG = np.random.default_rng(0)


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.normal(size=shape), dtype)


def assert_close(actual, expected, rtol=1e-5, atol=1e-7, what=""):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol, err_msg=what)


# ------------------------------------------------------------------------- flax nnx
def test_nnx_linear_and_einsum_against_hand_computed_statistics():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 6, rngs=rngs)
            self.heads = nnx.Einsum("btd,dnh->btnh", (6, 2, 3), (2, 3), rngs=rngs)
            self.out = nnx.Linear(6, 5, use_bias=False, rngs=rngs)

        def __call__(self, x):
            h = jnp.tanh(self.fc(x))
            h = jax.nn.gelu(self.heads(h)).reshape(*x.shape[:-1], 6)
            return self.out(h)

    model = Net(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    x, y = _normal(3, 4, 4), jnp.asarray(RNG.integers(0, 5, (3, 4)))

    def loss_fn(p, x, y):
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads, stats = jax.jit(kfac.value_grad_and_stats, static_argnums=0)(
        loss_fn, params, x, y)

    # By hand: the same network with explicit zero perturbations on the layer outputs.
    def by_hand(p, perts, x):
        fc, heads, out = p["fc"], p["heads"], p["out"]
        y1 = x @ fc["kernel"] + fc["bias"] + perts[0]
        h = jnp.tanh(y1)
        y2 = jnp.einsum("btd,dnh->btnh", h, heads["kernel"]) + heads["bias"] + perts[1]
        h2 = jax.nn.gelu(y2).reshape(3, 4, 6)
        y3 = h2 @ out["kernel"] + perts[2]
        ce = optax.softmax_cross_entropy_with_integer_labels(y3, y).mean()
        return ce, (x, h, h2)

    reference = jax.jit(jax.value_and_grad(by_hand, argnums=(0, 1), has_aux=True))
    perts = [jnp.zeros((3, 4, 6)), jnp.zeros((3, 4, 2, 3)), jnp.zeros((3, 4, 5))]
    (ref_loss, inputs), (ref_grads, dys) = reference(params, perts, x)
    # Another float32 program of it: the capture as accurate as it against it in float64.
    (loss64, inputs64), (grads64, dys64) = run_in_float64(reference, params, perts, x)
    assert sorted(stats) == ["fc/kernel", "heads/kernel", "out/kernel"]
    assert_as_accurate(loss, ref_loss, loss64, what="loss")
    assert_as_accurate(grads, ref_grads, grads64, what="grads")
    for i, path, d_in, d_out, bias in ((0, "fc/kernel", 4, 6, True),
                                       (1, "heads/kernel", 6, 6, True),
                                       (2, "out/kernel", 6, 5, False)):
        s = stats[path]
        assert s.inputs.shape == (12, d_in) and s.out_grads.shape == (12, d_out), path
        assert s.has_bias == bias, path
        flat = lambda a, d: np.reshape(a, (12, d))
        assert_as_accurate(s.inputs, flat(inputs[i], d_in), flat(inputs64[i], d_in),
                           what=f"{path} inputs")
        assert_as_accurate(s.out_grads, flat(dys[i], d_out), flat(dys64[i], d_out),
                           what=f"{path} out_grads")

    # One line to K-FAC; the Einsum kernel (6, 2, 3) with its (2, 3) bias is not a 2-D
    # "kernel", so the layers template comes from the statistics' shapes.
    curvature = kfac.curvature_from_stats(stats)
    tx = kfac.kfac(0.1, refresh=kfac.every(1, first=0), layers=jax.eval_shape(
        kfac.curvature_from_stats, stats))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    assert kfac.refresh_events(state)[0]["refresh"] == 1
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


# ---------------------------------------------------------------- layouts and dtypes
def test_expert_stack_and_einsum_layouts():
    """Expert stack (E, in, out) with E a batch axis of the product, and a kernel whose
    d_in spans two axes ("ecnh,nhd->ecd")."""
    p = {"experts": {"w": _normal(3, 4, 5)}, "proj": {"kernel": _normal(2, 5, 4)}}
    x = _normal(3, 6, 4)                           # (E, C, d)

    def loss_fn(p, x, perts=None):
        add = (lambda i, y: y) if perts is None else (lambda i, y: y + perts[i])
        h = add(0, jnp.einsum("eci,eio->eco", x, p["experts"]["w"]))       # (E, C, 5)
        h = jnp.tanh(h).reshape(3, 6, 1, 5) * jnp.ones((1, 1, 2, 1))        # (E, C, n, h)
        z = add(1, jnp.einsum("ecnh,nhd->ecd", h, p["proj"]["kernel"]))     # (E, C, 4)
        return jnp.sum(jnp.sin(z)), (x, h)

    _, grads, stats = kfac.value_grad_and_stats(lambda p: loss_fn(p, x)[0], p)
    perts = [jnp.zeros((3, 6, 5)), jnp.zeros((3, 6, 4))]
    reference = jax.jit(lambda p, x, perts: jax.value_and_grad(
        lambda pt: loss_fn(p, x, pt), has_aux=True)(perts))
    (_, (_, h_ref)), dys = reference(p, x, perts)
    (_, (_, h64)), dys64 = run_in_float64(reference, p, x, perts)
    e = stats["experts/w"]
    assert e.inputs.shape == (3, 6, 4) and e.out_grads.shape == (3, 6, 5)
    np.testing.assert_array_equal(e.inputs, x)  # the data itself: no arithmetic
    assert_as_accurate(e.out_grads, dys[0], dys64[0], what="expert out_grads")
    q = stats["proj/kernel"]
    assert q.inputs.shape == (18, 10) and q.out_grads.shape == (18, 4)
    assert_as_accurate(q.inputs, h_ref.reshape(18, 10), h64.reshape(18, 10), what="inputs")
    assert_as_accurate(q.out_grads, dys[1].reshape(18, 4), dys64[1].reshape(18, 4),
                       what="out_grads")
    # The gradient identity per expert: ∇W_e = x_eᵀ dy_e.
    assert_close(jnp.einsum("eci,eco->eio", e.inputs, e.out_grads), grads["experts"]["w"],
                 rtol=1e-5, atol=1e-6)
    assert_close(jnp.einsum("ti,to->io", q.inputs, q.out_grads),
                 grads["proj"]["kernel"].reshape(10, 4), rtol=1e-5, atol=1e-6)


def test_contracting_axis_first_and_lhs_kernel():
    """x ``(d, tokens)`` contracted on its first axis, and the kernel as the left operand
    (``W ᵀ``-free layouts written either way round)."""
    p = {"a": {"kernel": _normal(4, 3)}, "b": {"kernel": _normal(3, 2)}}
    xt = _normal(4, 7)

    def f(p, perts, xt):
        y = jax.lax.dot_general(xt, p["a"]["kernel"], (((0,), (0,)), ((), ()))) + perts[0]
        # kernel on the left: out = (kernel free, x free) = (2, 7)
        z = jax.lax.dot_general(p["b"]["kernel"], jnp.tanh(y), (((0,), (1,)), ((), ())))
        z = z + perts[1]
        return jnp.sum(jnp.cos(z)), jnp.tanh(y)

    perts = [jnp.zeros((7, 3)), jnp.zeros((2, 7))]
    _, _, stats = kfac.value_grad_and_stats(lambda p: f(p, [0.0, 0.0], xt)[0], p)
    reference = jax.jit(lambda p, perts, xt: jax.value_and_grad(
        lambda pt: f(p, pt, xt), has_aux=True)(perts))
    (_, h), dys = reference(p, perts, xt)
    (_, h64), dys64 = run_in_float64(reference, p, perts, xt)
    np.testing.assert_array_equal(stats["a/kernel"].inputs, xt.T)  # the data itself
    assert_as_accurate(stats["a/kernel"].out_grads, dys[0], dys64[0], what="a out_grads")
    assert_as_accurate(stats["b/kernel"].inputs, h, h64, what="b inputs")
    assert_as_accurate(stats["b/kernel"].out_grads, dys[1].T, dys64[1].T, what="b out_grads")


def test_bf16_compute_through_casts():
    """Kernels cast to bf16 before the product (convert_element_type) are captured; the
    statistics are in the product's dtypes and equal the perturbation reference."""
    p = {"l1": {"kernel": _normal(8, 16)}, "l2": {"kernel": _normal(16, 4)}}
    x = _normal(5, 8)

    def f(p, perts):
        bf = lambda a: a.astype(jnp.bfloat16)
        h = bf(x) @ bf(p["l1"]["kernel"]) + perts[0]
        h = jax.nn.relu(h)
        y = (h @ bf(p["l2"]["kernel"])).astype(jnp.float32) + perts[1]
        return jnp.mean(y ** 2), h

    perts = [jnp.zeros((5, 16), jnp.bfloat16), jnp.zeros((5, 4), jnp.float32)]
    _, _, stats = jax.jit(lambda p: kfac.value_grad_and_stats(
        lambda p: f(p, [0, 0])[0], p))(p)
    (_, h), dys = jax.jit(jax.value_and_grad(lambda pt: f(p, pt), has_aux=True))(perts)
    s1, s2 = stats["l1/kernel"], stats["l2/kernel"]
    assert s1.inputs.dtype == jnp.bfloat16 and s1.out_grads.dtype == jnp.bfloat16
    assert_close(s1.inputs, x.astype(jnp.bfloat16))
    assert_close(s1.out_grads, dys[0], rtol=1e-2, atol=1e-4)
    assert_close(s2.inputs, h)
    assert s2.out_grads.dtype == jnp.bfloat16          # the product's output dtype


# ----------------------------------------------------------------- custom_vjp matmul
@functools.partial(jax.custom_vjp, nondiff_argnums=())
def _marked_matmul(x, w):
    x, w = jax.lax.optimization_barrier((x, w))
    return jax.lax.optimization_barrier(jnp.matmul(x, w, preferred_element_type=jnp.float32))


def _marked_fwd(x, w):
    return _marked_matmul(x, w), (x, w)


def _marked_bwd(res, g):
    x, w = res
    # A marker: the weight gradient is doubled, so a test sees whether this rule ran.
    return (g @ w.T).astype(x.dtype), (2.0 * x.T @ g).astype(w.dtype)


_marked_matmul.defvjp(_marked_fwd, _marked_bwd)


def test_custom_vjp_matmul_is_kept_whole():
    """A custom-VJP call that is one captured matmul keeps its own backward (the doubled
    weight gradient shows it ran); x is read at the call's input, dy at its output."""
    p = {"l": {"kernel": _normal(6, 3)}}
    x = _normal(10, 6)

    def f(p, pert):
        y = _marked_matmul(x, p["l"]["kernel"]) + pert
        return jnp.sum(jnp.sin(y))

    _, grads, stats = jax.jit(lambda p: kfac.value_grad_and_stats(
        lambda p: f(p, 0.0), p))(p)
    dy = jax.grad(lambda pt: f(p, pt))(jnp.zeros((10, 3)))
    # dy = cos(x W) and the marker's 2 xᵀ dy, in float64: what both programs round.
    x64 = np.asarray(x, np.float64)
    dy64 = np.cos(x64 @ np.asarray(p["l"]["kernel"], np.float64))
    assert_as_accurate(grads["l"]["kernel"], 2.0 * x.T @ dy, 2.0 * x64.T @ dy64, what="grad")
    np.testing.assert_array_equal(stats["l/kernel"].inputs, x)  # the data itself
    assert_as_accurate(stats["l/kernel"].out_grads, dy, dy64, what="out_grads")


# ------------------------------------------------------------------------------ GPT
@pytest.mark.parametrize("moe", [0, 2])
def test_gpt_statistics_reproduce_the_gradients(moe):
    """On our GPT (dense with biases; MoE with experts, routers and an untied head) every
    kernel is captured under its path (the tied head as ``wte/embedding`` used transposed),
    its statistics satisfy ``∇W = Σ_tokens xᵀ dy`` (per expert for stacks) against a
    float64 sum, and the head's output gradient is ``(softmax - onehot) / M`` in float64.
    (Equal, bit for bit, to the model's former hand-written taps, in bf16 and float32.)"""
    from flax import nnx

    import models

    cfg = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8, dtype="float32",
                           moe_every=moe, n_experts=4, tie_embeddings=moe == 0,
                           bias=moe == 0)
    graphdef, params, rest = nnx.split(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)

    def loss_fn(p, x, y):
        logits, aux, _ = models.forward(nnx.merge(graphdef, p, rest), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + aux

    _, grads, stats = jax.jit(lambda p: kfac.value_grad_and_stats(
        loss_fn, p, tokens, tokens))(params)
    logits = np.asarray(models.forward(nnx.merge(graphdef, params, rest), tokens)[0],
                        np.float64)
    flat = {"/".join(map(str, k)): v for k, v in
            ((tuple(getattr(q, "key", q) for q in path), leaf) for path, leaf in
             jax.tree_util.tree_flatten_with_path(grads)[0])}
    expected = {k for k in flat if k.endswith("kernel") or "experts" in k}
    tied = "wte/embedding" if cfg.tie_embeddings else "lm_head/kernel"
    assert set(stats) == expected | {tied}
    head = stats[tied]
    assert head.kernel_axes == ((1, 0) if cfg.tie_embeddings else None)
    for path, s in stats.items():
        if path == "wte/embedding":   # its gradient also has the lookup's (a gather) share
            continue
        g = flat[path]
        w = np.einsum("...ti,...to->...io", np.asarray(s.inputs, np.float64),
                      np.asarray(s.out_grads, np.float64))
        bias = path[:-len("kernel")] + "bias"
        assert s.has_bias == (bias in flat), path
        assert_close(w.reshape(g.shape), g, rtol=1e-4, atol=1e-7, what=path)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    onehot = np.eye(cfg.vocab_size)[np.asarray(tokens)]
    assert_close(head.out_grads, ((probs - onehot) / 16).reshape(16, -1), rtol=1e-4, atol=1e-8)


# ------------------------------------------------------------------------ the errors
def test_unsupported_uses_warn_raise_and_describe():
    """Every kernel not captured is named with its reason (a warning; an error when named
    in layers=; the transform's first trace points to describe), and describe lists
    every leaf: the transposed and shared kernels are captured."""
    p = {"t": {"kernel": _normal(4, 4)}, "s": {"kernel": _normal(4, 4)},
         "loop": {"kernel": _normal(4, 4)}, "ok": {"kernel": _normal(4, 2)},
         "scaled": {"kernel": _normal(2, 2)}, "mixed": {"kernel": _normal(2, 2)},
         "grouped": {"kernel": _normal(3, 1, 2)}}   # (W, in / groups, out)
    x = _normal(5, 4)

    def loss_fn(p):
        h = x @ p["t"]["kernel"].T                                                # transposed
        h = jnp.tanh(h @ p["s"]["kernel"]) @ p["s"]["kernel"]                    # shared
        h = jax.lax.scan(lambda c, _: (jnp.tanh(c @ p["loop"]["kernel"]), None), h,
                         None, length=2)[0]
        h = h @ p["ok"]["kernel"]
        h = h @ (2.0 * p["scaled"]["kernel"])                                    # not a kernel use
        h = h @ p["mixed"]["kernel"] + h @ p["mixed"]["kernel"].T                # two layouts
        g = jax.lax.conv_general_dilated(h.reshape(1, 5, 2), p["grouped"]["kernel"], (1,),
                                         "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                         feature_group_count=2)
        return jnp.sum(g)

    with pytest.warns(UserWarning, match="not captured") as record:
        _, _, stats = kfac.value_grad_and_stats(loss_fn, p)
    message = str(record[0].message)
    reasons = {"loop": "scan", "scaled": "only through mul", "mixed": "different layouts",
               "grouped": "feature_group_count=2"}
    for name, words in reasons.items():
        assert re.search(f"{name}/kernel: [^;]*{words}", message), (name, message)
    assert set(stats) == {"t/kernel", "s/kernel", "ok/kernel"}
    assert stats["t/kernel"].kernel_axes == (1, 0) and stats["s/kernel"].uses == 2
    for name, words in reasons.items():
        with pytest.raises(ValueError, match=f"cannot capture {name}/kernel: .*{words}"):
            kfac.value_grad_and_stats(loss_fn, p, layers=[f"{name}/kernel"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, stats = kfac.value_grad_and_stats(loss_fn, p, layers=["ok/kernel", "t/kernel"])
    assert set(stats) == {"ok/kernel", "t/kernel"}
    with pytest.raises(ValueError, match="not paths of params leaves"):
        kfac.value_grad_and_stats(loss_fn, p, layers=["nope/kernel"])
    q = {"unused": {"kernel": _normal(2, 2)}, "ok": p["ok"]}
    with pytest.raises(ValueError, match="unused/kernel: the loss does not read it"):
        kfac.value_grad_and_stats(lambda q: jnp.sum(x @ q["ok"]["kernel"]), q,
                                  layers=["unused/kernel"])
    described = kfac.describe(loss_fn, p)
    assert list(described) == [path_to_str(k) for k, _ in
                               jax.tree_util.tree_flatten_with_path(p)[0]]
    assert described["t/kernel"] == "dense, d_in 4, d_out 4, transposed (1, 0)"
    assert described["s/kernel"] == "dense, d_in 4, d_out 4, shared by 2 products"
    assert described["loop/kernel"].startswith("skipped: a scan body reads it whole")
    # print(describe(...)) is a table: a header, one aligned line per leaf, a count
    table = str(described).splitlines()
    width = max(map(len, described))
    assert table[0] == "leaf".ljust(width) + "  K-FAC" and len(table) == len(described) + 2
    assert table[1:-1] == [f"{k.ljust(width)}  {v}" for k, v in described.items()]
    kinds = [v.split(",")[0].split(":")[0] for v in described.values()]
    assert table[-1].startswith(f"{sum(k == 'dense' for k in kinds)} kernels preconditioned, "
                                f"{kinds.count('skipped')} skipped, ")
    # paths shorter than the header still line up under it
    short = type(described)({"w": "dense, d_in 4, d_out 4", "b": "unused"})
    assert str(short).splitlines() == ["leaf  K-FAC", "w     dense, d_in 4, d_out 4",
                                       "b     unused", "1 kernel preconditioned, 0 skipped, "
                                       "1 other leaf (biases go with their kernel)"]
    # A K-FAC transform told to precondition a kernel the statistics lack says where to look.
    tx = kfac.kfac(0.1, layers=kfac.layers_from_params(p, ["ok/kernel", "scaled/kernel"]))
    state = tx.init(p)
    with pytest.raises(ValueError, match="scaled/kernel.*kfac.describe"):
        tx.update(p, state, p, curvature={"ok/kernel": kfac.curvature_from_stats(stats)[
            "ok/kernel"]})


def test_has_aux_and_args_closed_over():
    p = {"l": {"kernel": _normal(3, 2)}}

    def loss_fn(p, x, n):                      # n: a Python int, used statically
        y = jnp.tile(x, (n, 1)) @ p["l"]["kernel"]
        return jnp.mean(y ** 2), {"rows": y.shape[0]}

    (loss, aux), _, stats = kfac.value_grad_and_stats(loss_fn, p, _normal(4, 3), 2,
                                                      has_aux=True)
    assert aux["rows"] == 8 and stats["l/kernel"].inputs.shape == (8, 3)
    assert loss.shape == ()


# ------------------------------------------------------------ curvature_from_stats
def test_curvature_from_stats_experts_against_float64_per_expert_reference():
    """Per-expert A and G from each expert's routed tokens (empty slots are zero rows),
    with g = M·dy, against float64 numpy; dense layers default to M = their own N."""
    E, C, d_in, d_out, M = 3, 5, 4, 2, 11
    x = np.asarray(RNG.normal(size=(E, C, d_in)), np.float32)
    dy = np.asarray(RNG.normal(size=(E, C, d_out)), np.float32) / M
    filled = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    x[~filled], dy[~filled] = 0.0, 0.0
    stats = {"experts/w": kfac.LayerStats(jnp.asarray(x), jnp.asarray(dy)),
             "dense/kernel": kfac.LayerStats(jnp.asarray(x[0]), jnp.asarray(dy[0]),
                                             has_bias=True)}
    with pytest.raises(ValueError, match="num_tokens"):
        kfac.curvature_from_stats(stats)
    c = kfac.curvature_from_stats(stats, num_tokens=M)
    for e in range(E):
        xe = x[e][filled[e]].astype(np.float64)
        ge = M * dy[e][filled[e]].astype(np.float64)
        n = max(len(xe), 1)
        assert_close(c["experts/w"].a[e], xe.T @ xe / n, rtol=1e-5, atol=1e-6)
        assert_close(c["experts/w"].g[e], ge.T @ ge / n, rtol=1e-5, atol=1e-6)
    xd = np.concatenate([x[0], np.ones((C, 1), np.float32)], 1).astype(np.float64)
    gd = M * dy[0].astype(np.float64)
    assert_close(c["dense/kernel"].a, xd.T @ xd / C, rtol=1e-5, atol=1e-6)
    assert_close(c["dense/kernel"].g, gd.T @ gd / C, rtol=1e-5, atol=1e-6)


def test_curvature_from_stats_token_stride():
    x, dy = _normal(12, 3), _normal(12, 2)
    stats = {"l/kernel": kfac.LayerStats(x, dy)}
    c = jax.jit(lambda o: kfac.curvature_from_stats(stats, num_tokens=12, token_stride=3,
                                                    token_offset=o))(1)
    ref = kfac.layer_factors(x[1::3], dy[1::3], num_tokens=12)
    # Both float32 (K-FAC's factors are): measured against xᵀx/n, (M dy)ᵀ(M dy)/n in float64.
    xs, gs = np.asarray(x, np.float64)[1::3], 12 * np.asarray(dy, np.float64)[1::3]
    assert_as_accurate(c["l/kernel"].a, ref.a, xs.T @ xs / 4, what="a")
    assert_as_accurate(c["l/kernel"].g, ref.g, gs.T @ gs / 4, what="g")
    with pytest.raises(ValueError, match="divide"):
        kfac.curvature_from_stats(stats, token_stride=5)
    with pytest.raises(ValueError, match="token_stride"):
        kfac.curvature_from_stats(stats, token_stride=0)



def test_moe_gpt_experts_preconditioned_per_expert():
    """The MoE GPT's expert stacks go to K-FAC with the dense kernels (an optax.partition
    next to AdamW, `layers` built from the params the group sees): per-expert factors
    from the routed tokens, refreshed, and each expert's update is its own gradient
    preconditioned by its own factors."""
    from flax import nnx

    import models

    cfg = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8, moe_every=2,
                           n_experts=4, dtype="float32")
    graphdef, params, rest = nnx.split(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)

    def loss_fn(p, x, y):
        logits, aux, _ = models.forward(nnx.merge(graphdef, p, rest), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + aux

    from optax_snoo._src.utils import path_to_str
    paths = [path_to_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    kernels = [p for p in paths if ("attn" in p or "experts" in p) and not p.endswith("bias")]
    labels = jax.tree_util.tree_map_with_path(
        lambda k, _: "kfac" if path_to_str(k) in kernels else "adamw", params)
    group = kfac.kfac(0.1, damping=1e-2, refresh=kfac.every(1, first=0), momentum=None,
                      layers=lambda p: kfac.layers_from_params(p, kernels))
    tx = optax.partition({"kfac": group, "adamw": optax.adamw(1e-3)}, labels)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        _, grads, stats = kfac.value_grad_and_stats(loss_fn, params, tokens, tokens,
                                                    layers=kernels)
        curvature = kfac.curvature_from_stats(stats, num_tokens=16)
        updates, state = tx.update(grads, state, params, curvature=curvature)
        return grads, curvature, updates, state

    grads, curvature, updates, state = step(params, state)
    (k_state,) = kfac.kfac_states(state)
    w = "blocks/1/moe/experts/w_fc"
    assert curvature[w].a.shape == (4, 32, 32) and curvature[w].g.shape[0] == 4
    assert kfac.event_row(k_state.event)["refresh"] == 1
    # Expert e's update: its gradient through its own pi-damped inverses (lr 0.1).
    inv = k_state.inverses["blocks"]["1"]["moe"]["experts"]["w_fc"]
    g = grads["blocks"][1]["moe"]["experts"]["w_fc"]         # nnx.List: int keys
    u = updates["blocks"][1]["moe"]["experts"]["w_fc"]
    def pi_damped64(grad, a, g, damping=1e-2):  # (A + π√λ I)⁻¹ ∇ (G + √λ/π I)⁻¹, float64
        grad, a, g = (np.asarray(x, np.float64) for x in (grad, a, g))
        pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
        root = np.sqrt(damping)
        return (np.linalg.solve(a + pi * root * np.eye(len(a)), grad)
                @ np.linalg.inv(g + root / pi * np.eye(len(g))))

    for e in range(4):
        args = g[e], curvature[w].a[e], curvature[w].g[e]
        ref, ref64 = kfac.precondition(*args, 1e-2), pi_damped64(*args)
        # Kept inverses, then two products, against one solve: as accurate as the solve.
        assert_as_accurate(inv.a_inv[e] @ g[e] @ inv.g_inv[e], ref, ref64, what=f"expert {e}")
        assert_as_accurate(u[e], -0.1 * np.asarray(ref, np.float64), -0.1 * ref64,
                           what=f"update {e}")


def test_through_remat_and_custom_jvp_boundaries():
    """Kernels used inside jax.checkpoint and inside a custom_jvp function (not a lone
    matmul: inlined) are captured like top-level ones."""
    p = {"a": {"kernel": _normal(4, 5)}, "b": {"kernel": _normal(5, 3)}}
    x = _normal(6, 4)

    @jax.custom_jvp
    def layer_b(h, w):
        return jnp.tanh(h @ w)

    layer_b.defjvp(lambda primals, tangents: jax.jvp(
        lambda h, w: jnp.tanh(h @ w), primals, tangents))

    def f(p, perts):
        h = jax.checkpoint(lambda x, w: jnp.sin(x @ w + perts[0]))(x, p["a"]["kernel"])
        return jnp.sum(layer_b(h, p["b"]["kernel"]) ** 2), h

    def g(p, perts, x):                   # the same with the perturbation inside layer_b
        h = jnp.sin(x @ p["a"]["kernel"] + perts[0])
        return jnp.sum(jnp.tanh(h @ p["b"]["kernel"] + perts[1]) ** 2), h

    _, grads, stats = kfac.value_grad_and_stats(lambda p: f(p, [0.0])[0], p)
    reference = jax.jit(lambda p, x, perts: jax.value_and_grad(
        lambda pt: g(p, pt, x), has_aux=True)(perts))
    perts = [jnp.zeros((6, 5)), jnp.zeros((6, 3))]
    (_, h), dys = reference(p, x, perts)
    (_, h64), dys64 = run_in_float64(reference, p, x, perts)
    assert set(stats) == {"a/kernel", "b/kernel"}
    np.testing.assert_array_equal(stats["a/kernel"].inputs, x)  # the data itself
    assert_as_accurate(stats["a/kernel"].out_grads, dys[0], dys64[0], what="a out_grads")
    assert_as_accurate(stats["b/kernel"].inputs, h, h64, what="b inputs")
    assert_as_accurate(stats["b/kernel"].out_grads, dys[1], dys64[1], what="b out_grads")
    assert_as_accurate(grads["b"]["kernel"], h.T @ dys[1], h64.T @ dys64[1], what="grad")
