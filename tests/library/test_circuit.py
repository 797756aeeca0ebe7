"""`scale_by_circuit_ov` (Track 3 record #41, Circuit-Muon) against a float64 numpy
transcription of the record's ``circuit_muon`` one update at a time, with controls that
must fail; its properties; the optax matrix (tests/optax_matrix.py); bad input.

The coupling is checked here as the function the record applies to each (attn.v,
attn.proj) pair between its per-leg directions and its radial scale / u/w floor; #41's
whole stack is `recipes.track3_circuit_muon` (test_recipes_track3_circuit_muon.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import OVHeads, circuit_ov_heads, scale_by_circuit_ov
from references.error import assert_as_accurate, in_float64, relative_error
from references.track3_constants import R41

H, HD, D = 4, 8, 16  # heads, head width, model width: V (H*HD, D), O (D, H*HD) as PyTorch


def record_circuit_muon(uV, uO, WV, WO, head_dim, lam, *, controls=()):
    """The record's ``circuit_muon`` (log:591-631) in numpy at the inputs' dtype, PyTorch
    layout: ``WV (H*hd, D)`` heads on rows, ``WO (D, H*hd)`` heads on columns. ``controls``
    break it on purpose: "swap" (own instead of partner scalar), "no_renorm", "no_gauge",
    "gauge_sign"."""
    g = np.asarray(R41.guard, uV.dtype)
    hd = head_dim
    nh = WV.shape[0] // hd
    WVh, WOh = WV.reshape(nh, hd, WV.shape[1]), WO.reshape(WO.shape[0], nh, hd)
    uVh, uOh = uV.reshape(nh, hd, uV.shape[1]), uO.reshape(uO.shape[0], nh, hd)
    sqV, sqO = (WVh ** 2).sum(axis=(1, 2)), (WOh ** 2).sum(axis=(0, 2))
    s_V = 1 / np.sqrt(np.maximum(sqV / hd + lam, g))
    s_O = 1 / np.sqrt(np.maximum(sqO / hd + lam, g))
    if "swap" in controls:
        s_V, s_O = s_O, s_V
    nV, nO = np.linalg.norm(uVh), np.linalg.norm(uOh)
    uVh = uVh * s_O[:, None, None]
    uOh = uOh * s_V[None, :, None]
    if "no_renorm" not in controls:
        uVh = uVh * (nV / np.maximum(np.linalg.norm(uVh), g))
        uOh = uOh * (nO / np.maximum(np.linalg.norm(uOh), g))
    aV = (WVh * uVh).sum(axis=(1, 2))
    aO = (WOh * uOh).sum(axis=(0, 2))
    x = (aV - aO) / np.maximum(sqV + sqO + 2.0 * hd * lam, g)
    x = 0 * x if "no_gauge" in controls else -x if "gauge_sign" in controls else x
    uVh = uVh - x[:, None, None] * WVh
    uOh = uOh + x[None, :, None] * WOh
    return uVh.reshape(uV.shape), uOh.reshape(uO.shape)


def torch_layout_heads(num_heads=H):
    return {"v": OVHeads("attn", "value", num_heads, axis=0),
            "o": OVHeads("attn", "output", num_heads, axis=-1), "mlp": None}


def inputs(step, dtype=np.float64):
    """Weights and directions of one update; heads of unequal norms (the coupling's point),
    the output projection zero at step 0 (the damping's floor alone), one zero direction."""
    rng = np.random.default_rng(100 + step)
    head_scale = np.repeat(np.array([0.3, 1.0, 2.0, 0.7]) * (1 + 0.1 * step), HD)
    WV = rng.normal(size=(H * HD, D)) * head_scale[:, None] / np.sqrt(D)
    WO = rng.normal(size=(D, H * HD)) / head_scale[None, :] / np.sqrt(H * HD)
    if step == 0:
        WO = 0 * WO
    uV, uO = rng.normal(size=WV.shape), rng.normal(size=WO.shape)
    if step == 1:
        uO = 0 * uO
    mlp = rng.normal(size=(D, 3 * D))
    return [x.astype(dtype) for x in (WV, WO, uV, uO, mlp)]


def ours(WV, WO, uV, uO, mlp, damping=R41.damping, heads=None):
    params = {"v": WV, "o": WO, "mlp": mlp}
    updates = {"v": uV, "o": uO, "mlp": 3 * mlp}
    tx = scale_by_circuit_ov(heads or torch_layout_heads(), damping)
    out, _ = jax.jit(tx.update)(jax.tree.map(jnp.asarray, updates), tx.init(params),
                               jax.tree.map(jnp.asarray, params))
    return jax.tree.map(np.asarray, out)


STEPS = 8
CONTROLS = {
    "damping x1.05": dict(lam=R41.damping * 1.05),
    "head width x2": dict(head_dim=2 * HD),
    "own scalar": dict(controls=("swap",)),
    "no renormalisation": dict(controls=("no_renorm",)),
    "no gauge": dict(controls=("no_gauge",)),
    "gauge sign": dict(controls=("gauge_sign",)),
}


def test_matches_the_record_in_float64_and_controls_fail():
    worst = 0.0
    control_min = dict.fromkeys(CONTROLS, np.inf)
    with in_float64():
        for step in range(STEPS):
            WV, WO, uV, uO, mlp = inputs(step)
            got = ours(WV, WO, uV, uO, mlp)
            np.testing.assert_array_equal(got["mlp"], 3 * mlp)  # unmarked: untouched
            ref = record_circuit_muon(uV, uO, WV, WO, HD, R41.damping)
            for g, r in zip((got["v"], got["o"]), ref, strict=True):
                assert g.dtype == np.float64
                if np.linalg.norm(r) == 0:
                    np.testing.assert_array_equal(g, 0.0)
                    continue
                worst = max(worst, relative_error(g, r))
            for name, kw in CONTROLS.items():
                bad = record_circuit_muon(uV, uO, WV, WO, **{"head_dim": HD,
                                                             "lam": R41.damping, **kw})
                # the best a control does over the two legs: all of it must be wrong
                err = max(relative_error(g, b) for g, b in zip((got["v"], got["o"]), bad,
                                                              strict=True)
                          if np.linalg.norm(b) > 0)
                control_min[name] = min(control_min[name], err)
    tol = 1e-12  # float64 rounding of a few dozen operations on 16x32 matrices
    assert worst <= tol, worst
    for name, err in control_min.items():
        # max over steps would let one lucky step pass: each step must separate
        assert err > 1e3 * tol, (name, err)


def test_flax_layout_by_path_rules_matches_the_record():
    """Flax kernels (transposed) found by `circuit_ov_heads`' default patterns; an MLP
    ``c_proj`` is left alone; a second layer is paired by its own prefix."""
    with in_float64():
        WV, WO, uV, uO, mlp = inputs(3)
        WV2, WO2, uV2, uO2, _ = inputs(4)
        params = {"blocks": {str(i): {"attn": {"c_v": {"kernel": wv.T},
                                                "c_proj": {"kernel": wo.T}},
                                       "mlp": {"c_proj": {"kernel": mlp}}}
                             for i, (wv, wo) in enumerate(((WV, WO), (WV2, WO2)))}}
        updates = {"blocks": {str(i): {"attn": {"c_v": {"kernel": uv.T},
                                                 "c_proj": {"kernel": uo.T}},
                                        "mlp": {"c_proj": {"kernel": 2 * mlp}}}
                              for i, (uv, uo) in enumerate(((uV, uO), (uV2, uO2)))}}
        tx = scale_by_circuit_ov(circuit_ov_heads(H), R41.damping)
        got = tx.update(updates, tx.init(params), params)[0]["blocks"]
        for i, (wv, wo, uv, uo) in enumerate(((WV, WO, uV, uO), (WV2, WO2, uV2, uO2))):
            rv, ro = record_circuit_muon(uv, uo, wv, wo, HD, R41.damping)
            assert relative_error(np.asarray(got[str(i)]["attn"]["c_v"]["kernel"]).T, rv) < 1e-12
            assert relative_error(np.asarray(got[str(i)]["attn"]["c_proj"]["kernel"]).T,
                                  ro) < 1e-12
            np.testing.assert_array_equal(got[str(i)]["mlp"]["c_proj"]["kernel"], 2 * mlp)


def test_stacked_layers_are_each_their_own_circuit():
    """A scanned model's ``(L, D, N*hd)`` / ``(L, N*hd, D)`` kernels: each layer's slice
    is coupled as the record couples that layer alone."""
    with in_float64():
        layers = [inputs(s) for s in (2, 5, 6)]
        stack = lambda i: np.stack([layer[i] for layer in layers])
        params = {"attn": {"c_v": {"kernel": stack(0).swapaxes(1, 2)},
                           "c_proj": {"kernel": stack(1).swapaxes(1, 2)}}}
        updates = {"attn": {"c_v": {"kernel": stack(2).swapaxes(1, 2)},
                            "c_proj": {"kernel": stack(3).swapaxes(1, 2)}}}
        tx = scale_by_circuit_ov(circuit_ov_heads(H), R41.damping)
        got = tx.update(updates, tx.init(params), params)[0]["attn"]
        for i, (WV, WO, uV, uO, _) in enumerate(layers):
            rv, ro = record_circuit_muon(uV, uO, WV, WO, HD, R41.damping)
            assert relative_error(np.asarray(got["c_v"]["kernel"][i]).T, rv) < 1e-12
            assert relative_error(np.asarray(got["c_proj"]["kernel"][i]).T, ro) < 1e-12


def test_float32_is_as_accurate_as_the_records_formula_in_float32():
    """Ours in float32 misses the float64 record by no more than the record's own formula
    computed in float32 (numpy) does, up to `references.error`'s factor."""
    for step in range(3):
        args64 = inputs(step)
        WV, WO, uV, uO, mlp = (x.astype(np.float32) for x in args64)
        got = ours(WV, WO, uV, uO, mlp)
        peer = record_circuit_muon(uV, uO, WV, WO, HD, np.float32(R41.damping))
        ref = record_circuit_muon(*(x.astype(np.float64) for x in (uV, uO, WV, WO)), HD,
                                  R41.damping)
        assert got["v"].dtype == np.float32
        assert_as_accurate((got["v"], got["o"]), peer, ref, what=f"step {step}")


def _head_sums(WV, dV, WO, dO):
    """Per head ``<W_V,h, dV_h>`` and ``<W_O,h, dO_h>`` (PyTorch layout)."""
    return ((WV * dV).reshape(H, HD, D).sum(axis=(1, 2)),
            (WO * dO).reshape(D, H, HD).sum(axis=(0, 2)))


def test_properties():
    with in_float64():
        WV, WO, uV, uO, mlp = inputs(5)
        # Without damping the step keeps each head's trace gap to first order.
        got = ours(WV, WO, uV, uO, mlp, damping=0.0)
        a_v, a_o = _head_sums(WV, got["v"], WO, got["o"])
        np.testing.assert_allclose(a_v - a_o, 0.0, atol=1e-12 * np.abs(a_v).max())
        # With damping, the gap moves by x_h * 2 hd lam (the record's denominator).
        got = ours(WV, WO, uV, uO, mlp)
        whitened = record_circuit_muon(uV, uO, WV, WO, HD, R41.damping,
                                       controls=("no_gauge",))
        b_v, b_o = _head_sums(WV, *whitened[:1], WO, *whitened[1:])
        sq = (WV ** 2).reshape(H, -1).sum(1) + (WO ** 2).reshape(D, H, HD).sum((0, 2))
        x = (b_v - b_o) / (sq + 2 * HD * R41.damping)
        a_v, a_o = _head_sums(WV, got["v"], WO, got["o"])
        np.testing.assert_allclose(a_v - a_o, x * 2 * HD * R41.damping, rtol=1e-9)
        # The gauge step leaves each head's dM_h = dO_h W_V,h + W_O,h dV_h unchanged.
        dM = lambda dv, do: np.stack([
            do[:, h * HD:(h + 1) * HD] @ WV[h * HD:(h + 1) * HD]
            + WO[:, h * HD:(h + 1) * HD] @ dv[h * HD:(h + 1) * HD] for h in range(H)])
        np.testing.assert_allclose(dM(got["v"], got["o"]), dM(*whitened), atol=1e-12)
        # Odd and homogeneous of degree 1 in the two updates: a plain lr commutes with it.
        neg = ours(WV, WO, -0.3 * uV, -0.3 * uO, mlp)
        np.testing.assert_allclose(neg["v"], -0.3 * got["v"], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(neg["o"], -0.3 * got["o"], rtol=1e-12, atol=1e-15)
        # Heads of equal norms: the whitening is one factor per leg, undone by the renorm.
        WVe = WV / np.linalg.norm(WV.reshape(H, -1), axis=1).repeat(HD)[:, None]
        WOe = WO / np.linalg.norm(WO.reshape(D, H, HD), axis=(0, 2)).repeat(HD)[None, :]
        got = ours(WVe, WOe, uV, uO, mlp)
        a_v, a_o = _head_sums(WVe, uV, WOe, uO)
        x = (a_v - a_o) / (2 + 2 * HD * R41.damping)
        np.testing.assert_allclose(got["v"], uV - np.repeat(x, HD)[:, None] * WVe, rtol=1e-12)
        np.testing.assert_allclose(got["o"], uO + np.repeat(x, HD)[None, :] * WOe, rtol=1e-12)


MATRIX_PARAMS = {"attn": {"c_v": {"kernel": 0.3 * jax.random.normal(jax.random.key(1), (8, 8))},
                          "c_proj": {"kernel": 0.2 * jax.random.normal(jax.random.key(2), (8, 8))}},
                 "mlp": {"c_proj": {"kernel": 0.1 * jnp.ones((8, 4))}}}


def circuit_sgd(damping=R41.damping, heads=None):
    return optax.chain(scale_by_circuit_ov(heads or circuit_ov_heads(2), damping),
                       optax.scale(-0.05))


def test_optax_matrix(tmp_path):
    tx = circuit_sgd()
    f64 = dict(float64=tx)  # stateless: the float64 run is the transform itself
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=2)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=2)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=1, steps_after=2)
    # check_partition flattens the tree to g0, g1, g2 (c_proj, c_v, mlp in path order)
    flat = circuit_ov_heads(2, value=r"(^|/)g1$", output=r"(^|/)g0$")
    m.check_partition(circuit_sgd(heads=flat), MATRIX_PARAMS, steps=2,
                      float64=circuit_sgd(heads=flat))


def test_inject_hyperparams_and_nnx():
    state = m.check_inject_hyperparams(circuit_sgd, MATRIX_PARAMS, dict(damping=0.01),
                                       steps=2, float64=True)
    assert float(state.hyperparams["damping"]) == pytest.approx(0.01)
    # nnx's MLP: l1 (8, 16) as the value leg, l2 (16, 4) as the output leg, 2 heads of 8
    heads = circuit_ov_heads(2, value=r"l1/kernel$", output=r"l2/kernel$")
    tx = optax.chain(scale_by_circuit_ov(heads), optax.sgd(0.05))
    m.check_nnx_optimizer(tx, steps=5)


@pytest.mark.parametrize("make, params, message", [
    (lambda: scale_by_circuit_ov(circuit_ov_heads(2), -1e-3), None, "damping must be >= 0"),
    (lambda: scale_by_circuit_ov(circuit_ov_heads(2), lambda c: 1e-3), None,
     "not a schedule"),
    (lambda: circuit_ov_heads(0), None, "num_heads must be an int >= 1"),
    (lambda: circuit_ov_heads(2, value="("), None, "invalid pattern"),
    (lambda: scale_by_circuit_ov(circuit_ov_heads(3)), MATRIX_PARAMS, "does not divide"),
    (lambda: scale_by_circuit_ov(circuit_ov_heads(2, value="nothing")), MATRIX_PARAMS,
     "no parameter path matches the value pattern"),
    (lambda: scale_by_circuit_ov(circuit_ov_heads(2, output="nothing")), MATRIX_PARAMS,
     "expected exactly one value and one output"),
    (lambda: scale_by_circuit_ov(circuit_ov_heads(2, output="c_proj/kernel$")),
     MATRIX_PARAMS, "expected exactly one value and one output"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "value", 2), "o": OVHeads("a", "output", 4)}),
     {"v": jnp.ones((4, 8)), "o": jnp.ones((8, 4))}, "each head needs one value and one"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "query", 2), "o": None}),
     {"v": jnp.ones((4, 8)), "o": jnp.ones((8, 4))}, "role must be one of"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "value", 2), "o": OVHeads("a", "output", 2)}),
     {"v": jnp.ones((2, 4, 8)), "o": jnp.ones((8, 4))}, "stack different leading axes"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "value", 2, axis=0),
                                  "o": OVHeads("a", "output", 2)}),
     {"v": jnp.ones((2, 4, 8)), "o": jnp.ones((2, 8, 4))}, "one of the last two axes"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "value", 2), "o": OVHeads("a", "output", 2)}),
     {"v": jnp.ones((8,)), "o": jnp.ones((8, 4))}, "must be a matrix"),
    (lambda: scale_by_circuit_ov({"v": OVHeads("a", "value", 2)}),
     {"v": jnp.ones((4, 8)), "o": jnp.ones((8, 4))}, "params' structure"),
])
def test_bad_input(make, params, message):
    with pytest.raises(ValueError, match=message):
        tx = make()
        tx.init(params)


def test_update_needs_params():
    tx = scale_by_circuit_ov(circuit_ov_heads(2))
    with pytest.raises(ValueError, match="needs params"):
        tx.update(MATRIX_PARAMS, tx.init(MATRIX_PARAMS))
