"""K-FAC capture of kernels beyond ``(in, out)`` matmuls: other layouts, shared kernels and
convolutions (`optax_snoo.kfac.value_grad_and_stats`, `curvature_from_stats`, the
transform's ``kernel_axes``), against float64 numpy references and the same layers in the
``(in, out)`` layout.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo import kfac
from references.error import assert_as_accurate, run_in_float64
from references.kfac import operator

RNG = np.random.default_rng(0)


def _normal(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _kfac_update(loss_fn, params, args, mode, num_tokens=None):
    """One K-FAC direction (refresh at step 0) with every captured kernel preconditioned;
    the layers template comes from the captured statistics, layouts included."""
    _, grads, stats = kfac.value_grad_and_stats(loss_fn, params, *args)
    curvature = kfac.curvature_from_stats(stats, num_tokens=num_tokens)
    tx = kfac.scale_by_kfac(damping=1e-2, refresh=kfac.every(1, first=0), mode=mode,
                            layers=jax.eval_shape(lambda: curvature))
    updates, _ = tx.update(grads, tx.init(params), params, curvature=curvature)
    return updates, curvature


def _f64(x):
    return np.asarray(x, np.float64)


def _float64_update(loss_fn, params, args, mode, num_tokens=None):
    """`_kfac_update` of dense ``(in, out...)`` layers in float64, the reference of the
    layouts compared with them: the capture under x64, ``A = x̃ᵀx̃/n``, ``G = M² dyᵀdy/n``
    (M = num_tokens, default n), and the damped solve of ``[kernel; bias]``."""
    _, grads, stats = run_in_float64(
        lambda p, a: kfac.value_grad_and_stats(loss_fn, p, *a), params, args)
    updates, curvature = {}, {}
    for path, st in stats.items():
        name = path.removesuffix("/kernel")
        kernel = grads[name]["kernel"]
        x, dy = st.inputs.reshape(-1, kernel.shape[0]), st.out_grads.reshape(len(st.inputs), -1)
        n = len(x)
        full = kernel.reshape(kernel.shape[0], -1)
        if st.has_bias:
            x = np.concatenate([x, np.ones((n, 1))], axis=1)
            full = np.concatenate([full, grads[name]["bias"].reshape(1, -1)])
        g = (n if num_tokens is None else num_tokens) * dy
        a, g = x.T @ x / n, g.T @ g / n
        curvature[path] = kfac.LayerCurvature(a, g)
        u = (operator(a, g, 1e-2, mode) @ full.reshape(-1)).reshape(full.shape)
        updates[name] = {"kernel": u[:kernel.shape[0]].reshape(kernel.shape)}
        if st.has_bias:
            updates[name]["bias"] = u[-1].reshape(grads[name]["bias"].shape)
    return updates, curvature


def test_transposed_layouts_match_the_in_out_layer():
    """A PyTorch ``(out, in)`` kernel with a bias (``x @ W.T + b``) and a kernel whose
    contracting axis is in the middle (``(o1, in, o2)``) get the factors and, in both
    modes, the update of the same layers stored as ``(in, out)``, in their own layout."""
    x = _normal(7, 6)
    w1, b1, w2 = _normal(5, 6) * 0.5, _normal(5) * 0.1, _normal(2, 5, 3) * 0.5
    torch_like = {"l1": {"kernel": w1, "bias": b1}, "l2": {"kernel": w2}}
    flax_like = {"l1": {"kernel": w1.T, "bias": b1},
                 "l2": {"kernel": jnp.transpose(w2, (1, 0, 2))}}

    def torch_loss(p, x):
        h = jnp.tanh(x @ p["l1"]["kernel"].T + p["l1"]["bias"])
        return jnp.mean(jnp.sin(jnp.einsum("ni,aib->nab", h, p["l2"]["kernel"])))

    def flax_loss(p, x):
        h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
        return jnp.mean(jnp.sin(jnp.einsum("ni,iab->nab", h, p["l2"]["kernel"])))

    stats = kfac.value_grad_and_stats(torch_loss, torch_like, x)[2]
    assert stats["l1/kernel"].kernel_axes == (1, 0) and stats["l1/kernel"].has_bias
    assert stats["l2/kernel"].kernel_axes == (1, 0, 2)
    # A from the float64 inputs: [x; 1] [x; 1]ᵀ / N.
    x1 = np.concatenate([_f64(x), np.ones((7, 1))], axis=1)
    # Both layouts' float32 programs against the (in, out) layers' computation in float64.
    for mode in ("pi", "eigen"):
        u_t, c_t = _kfac_update(torch_loss, torch_like, (x,), mode)
        u_f, c_f = _kfac_update(flax_loss, flax_like, (x,), mode)
        u64, c64 = _float64_update(flax_loss, flax_like, (x,), mode)
        np.testing.assert_allclose(c64["l1/kernel"].a, x1.T @ x1 / 7, rtol=1e-12)
        for name in ("l1/kernel", "l2/kernel"):
            for f in ("a", "g"):
                assert_as_accurate(getattr(c_t[name], f), getattr(c_f[name], f),
                                   getattr(c64[name], f), what=f"{mode} {name} {f}")
        back = {"l1": {"kernel": u_t["l1"]["kernel"].T, "bias": u_t["l1"]["bias"]},
                "l2": {"kernel": jnp.transpose(u_t["l2"]["kernel"], (1, 0, 2))}}
        assert_as_accurate(back, u_f, u64, what=mode)
        # Preconditioned at all: not the gradient.
        g = jax.grad(torch_loss)(torch_like, x)["l1"]["kernel"]
        assert not np.allclose(_f64(u_t["l1"]["kernel"]), _f64(g), rtol=1e-2)


def test_shared_kernel_gets_the_expand_sum_of_its_uses():
    """A kernel read by two products: A the mean of the uses' A, G the sum of their G
    (K-FAC-expand), against float64 sums over each use's inputs and output gradients."""
    w = _normal(4, 4) * 0.5
    x = _normal(6, 4)

    def loss_fn(p, perts=(0.0, 0.0)):
        h1 = x @ p["w"]["kernel"] + perts[0]
        h2 = jnp.tanh(h1) @ p["w"]["kernel"] + perts[1]
        return jnp.mean(jnp.sin(h2).sum(-1)), jnp.tanh(h1)

    p = {"w": {"kernel": w}}
    _, grads, stats = kfac.value_grad_and_stats(lambda p: loss_fn(p)[0], p)
    s = stats["w/kernel"]
    assert s.uses == 2 and s.inputs.shape == (12, 4)
    (_, h), dys = jax.value_and_grad(lambda pt: loss_fn(p, pt), has_aux=True)(
        (jnp.zeros((6, 4)), jnp.zeros((6, 4))))
    xs, gs = [_f64(x), _f64(h)], [6 * _f64(d) for d in dys]     # g = M ∂L/∂y, M = 6
    a_ref = sum(u.T @ u / 6 for u in xs) / 2
    g_ref = sum(u.T @ u / 6 for u in gs)
    c = kfac.curvature_from_stats(stats)["w/kernel"]
    np.testing.assert_allclose(_f64(c.a), a_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_f64(c.g), g_ref, rtol=1e-5, atol=1e-7)
    # The gradient is the sum over uses: Σ_uses xᵀ dy.
    np.testing.assert_allclose(_f64(s.inputs).T @ _f64(s.out_grads), _f64(grads["w"]["kernel"]),
                               rtol=1e-5, atol=1e-7)


def _patches_f64(x, kh, kw, stride, pad, dil):
    """Explicit receptive fields of an NHWC input, features ordered (c, kh, kw)."""
    x = np.pad(_f64(x), ((0, 0), pad[0], pad[1], (0, 0)))
    b, hp, wp, c = x.shape
    oh = (hp - dil[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wp - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((b, oh, ow, c, kh, kw))
    for i in range(oh):
        for j in range(ow):
            for u in range(kh):
                for v in range(kw):
                    out[:, i, j, :, u, v] = x[:, i * stride[0] + u * dil[0],
                                              j * stride[1] + v * dil[1], :]
    return out.reshape(b * oh * ow, c * kh * kw), oh * ow


def test_conv_factors_against_explicit_patches_and_nnx_conv():
    """``lax.conv_general_dilated`` (NHWC/HWIO, strides, padding, dilation, bias): A from
    explicit float64 patches with the bias coordinate, G = S·M²·mean(dy dyᵀ) (KFC's
    spatial sum), ``∇W = Σ patchesᵀ dy`` in the kernel's own layout; a 1-D ``nnx.Conv``
    (Flax's kernel ``(w, in, out)``) is captured under its path."""
    from flax import nnx

    x = _normal(3, 6, 5, 2)
    p = {"conv": {"kernel": _normal(3, 2, 2, 4) * 0.5, "bias": _normal(4) * 0.1}}
    kw = dict(window_strides=(2, 1), padding=((1, 1), (0, 1)), rhs_dilation=(1, 2),
              dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss_fn(p, pert=0.0):
        y = jax.lax.conv_general_dilated(x, p["conv"]["kernel"], **kw) + p["conv"]["bias"]
        return jnp.mean(jnp.sum(jnp.sin(y + pert), axis=(1, 2, 3)))   # mean over examples

    _, grads, stats = kfac.value_grad_and_stats(loss_fn, p)
    s = stats["conv/kernel"]
    patches, locations = _patches_f64(x, 3, 2, (2, 1), ((1, 1), (0, 1)), (1, 2))
    assert s.kernel_axes == (2, 0, 1, 3) and s.has_bias and s.locations == locations == 12
    np.testing.assert_allclose(_f64(s.inputs), patches, rtol=1e-6, atol=1e-7)
    y_shape = jax.eval_shape(lambda: jax.lax.conv_general_dilated(
        x, p["conv"]["kernel"], **kw)).shape
    dy = jax.grad(lambda t: loss_fn(p, t))(jnp.zeros(y_shape))
    dy = _f64(dy).reshape(-1, 4)
    np.testing.assert_allclose(_f64(s.out_grads), dy, rtol=1e-6, atol=1e-9)
    grad_w = (patches.T @ dy).reshape(2, 3, 2, 4).transpose(1, 2, 0, 3)   # (c,kh,kw,o) -> HWIO
    np.testing.assert_allclose(_f64(grads["conv"]["kernel"]), grad_w, rtol=1e-5, atol=1e-7)
    c = kfac.curvature_from_stats(stats)["conv/kernel"]
    a1 = np.concatenate([patches, np.ones((len(patches), 1))], axis=1)
    n = len(patches)
    np.testing.assert_allclose(_f64(c.a), a1.T @ a1 / n, rtol=1e-5, atol=1e-7)
    m = 3                                                # examples of the mean loss
    np.testing.assert_allclose(_f64(c.g), locations * m * m * dy.T @ dy / n, rtol=1e-5,
                               atol=1e-9)
    assert c.kernel_axes == (2, 0, 1, 3)

    conv = nnx.Conv(2, 3, kernel_size=(3,), strides=2, padding="SAME", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(conv, nnx.Param)
    params = nnx.to_pure_dict(params)
    xs = _normal(2, 9, 2)
    stats = kfac.value_grad_and_stats(
        lambda q: jnp.mean(nnx.merge(graphdef, q)(xs) ** 2), params)[2]
    s = stats["kernel"]
    assert s.inputs.shape == (2 * 5, 2 * 3) and s.has_bias and s.kernel_axes == (1, 0, 2)


def test_one_by_one_conv_update_is_the_dense_update():
    """A 1x1 convolution is a matmul over the positions: with the dense layer's M set to
    KFC's ``M·√S`` the factors agree, and the transform's update, computed in the conv
    kernel's ``(1, 1, in, out)`` layout, is the dense update, in both modes."""
    x = _normal(3, 2, 2, 4)                          # S = 4 positions, B = 3
    w, b = _normal(4, 5) * 0.5, _normal(5) * 0.1

    def conv_loss(p):
        y = jax.lax.conv_general_dilated(x, p["c"]["kernel"], (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jnp.sum(jnp.tanh(y + p["c"]["bias"]), axis=(1, 2, 3)))

    def dense_loss(p, x=x):  # (x an argument for the float64 reference)
        y = x.reshape(3, 4, 4) @ p["c"]["kernel"] + p["c"]["bias"]
        return jnp.mean(jnp.sum(jnp.tanh(y), axis=(1, 2)))

    conv_p = {"c": {"kernel": w.reshape(1, 1, 4, 5), "bias": b}}
    dense_p = {"c": {"kernel": w, "bias": b}}
    for mode in ("pi", "eigen"):
        u_c, c_c = _kfac_update(conv_loss, conv_p, (), mode)
        u_d, c_d = _kfac_update(dense_loss, dense_p, (), mode, num_tokens=3 * math.sqrt(4))
        u64, c64 = _float64_update(dense_loss, dense_p, (x,), mode, num_tokens=3 * math.sqrt(4))
        for f in ("a", "g"):
            assert_as_accurate(getattr(c_c["c/kernel"], f), getattr(c_d["c/kernel"], f),
                               getattr(c64["c/kernel"], f), what=f"{mode} {f}")
        assert u_c["c"]["kernel"].shape == (1, 1, 4, 5)
        as_dense = {"c": {"kernel": u_c["c"]["kernel"].reshape(4, 5), "bias": u_c["c"]["bias"]}}
        assert_as_accurate(as_dense, u_d, u64, what=mode)
    # A template without the layout refuses the conv's curvature, naming the fix.
    tx = kfac.kfac(0.1, layers={"c/kernel": kfac.LayerCurvature(
        jnp.zeros((5, 5)), jnp.zeros((5, 5)))})
    state = tx.init(conv_p)
    try:
        tx.update(conv_p, state, conv_p, curvature=c_c)
    except ValueError as e:
        assert "kernel axes (2, 0, 1, 3)" in str(e) and "eval_shape" in str(e), e
    else:
        raise AssertionError("expected a ValueError")
    assert optax.tree_utils.tree_norm(u_c) > 0


def test_scanned_layers_match_the_unrolled_stack():
    """An ``nnx.scan`` over a stack of ``nnx.Linear`` (kernel ``(L, in, out)``, bias
    ``(L, out)``) gets per-layer factors stacked ``(L, ...)`` and, preconditioned as a
    stack, the update of the same layers unrolled as separate leaves."""
    from flax import nnx

    n_layers, d = 3, 4

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return nnx.Linear(d, d, rngs=nnx.Rngs(key))

    graphdef, stacked = nnx.split(make(jax.random.split(jax.random.key(0), n_layers)),
                                  nnx.Param)
    stacked = {"blocks": nnx.to_pure_dict(stacked), "head": {"kernel": _normal(d, 2)}}
    x = _normal(5, 6, d)

    def scanned_loss(p, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return jnp.tanh(layer(h))
        h = body(x, nnx.merge(graphdef, p["blocks"]))
        return jnp.mean(jnp.sin(h @ p["head"]["kernel"]))

    unrolled = {f"l{i}": {"kernel": stacked["blocks"]["kernel"][i],
                          "bias": stacked["blocks"]["bias"][i]} for i in range(n_layers)}
    unrolled["head"] = stacked["head"]

    def unrolled_loss(p, x):
        h = x
        for i in range(n_layers):
            h = jnp.tanh(h @ p[f"l{i}"]["kernel"] + p[f"l{i}"]["bias"])
        return jnp.mean(jnp.sin(h @ p["head"]["kernel"]))

    assert kfac.describe(scanned_loss, stacked, x)["blocks/kernel"] == (
        "dense, d_in 4, d_out 4, scanned stack (3,), with bias blocks/bias")
    u_s, c_s = _kfac_update(scanned_loss, stacked, (x,), "pi")
    u_u, c_u = _kfac_update(unrolled_loss, unrolled, (x,), "pi")
    u64, c64 = _float64_update(unrolled_loss, unrolled, (x,), "pi")
    assert c_s["blocks/kernel"].a.shape == (3, 5, 5)
    for i in range(n_layers):
        for f in ("a", "g"):
            assert_as_accurate(getattr(c_s["blocks/kernel"], f)[i],
                               getattr(c_u[f"l{i}/kernel"], f), getattr(c64[f"l{i}/kernel"], f),
                               what=f"layer {i} {f}")
        for leaf in ("kernel", "bias"):
            assert_as_accurate(u_s["blocks"][leaf][i], u_u[f"l{i}"][leaf], u64[f"l{i}"][leaf],
                               what=f"layer {i} {leaf}")
