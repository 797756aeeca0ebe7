"""Newton-Muon (modded-nanogpt Track 3 record #15) against a float64 numpy reference
written from the record's code, step by step over 130 steps (refreshes at updates 63 and
127): `precondition_by_input_covariance` alone, and the whole `newton_muon` stack (with a
float32 Newton-Schulz, since the record's bf16 iteration has no float64 counterpart).
Tall, wide and square kernels, a 2-block input, q/k/v sharing one input, a scanned stack;
the optax matrix (jit, bf16, inject_hyperparams, partition, 8 devices, Orbax); the
statistics from the K-FAC capture; bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import optax_matrix as m
from library.support import check_runs, kfac_problems, materialise
from optax_snoo import (
    input_covariance_from_stats,
    input_covariance_refresh_due,
    kfac,
    newton_muon,
    precondition_by_input_covariance,
)
from optax_snoo.kfac import LayerStats
from references.error import assert_as_accurate, run_in_float64

N = 24       # tokens per batch
BLOCK = 8    # block_size: the 16-wide input of "mlp/c_proj" is 2 blocks
SHARED = (("c_q", "c_k", "c_v"),)
# Our (in, out) kernels: tall (6, 4), wide (4, 12), square q (8, 8); k, v (8, 4) read q's
# input; mlp c_proj (16, 4) in 2 blocks; a scanned stack of 2 layers (2, 6, 5).
SHAPES = {"attn/c_q/kernel": (8, 8), "attn/c_k/kernel": (8, 4), "attn/c_v/kernel": (8, 4),
          "tall/kernel": (6, 4), "wide/kernel": (4, 12), "mlp/c_proj/kernel": (16, 4),
          "scan/kernel": (2, 6, 5)}
STATS_OF = {"attn/c_q/kernel": "attn/c_q/kernel", "attn/c_k/kernel": "attn/c_q/kernel",
            "attn/c_v/kernel": "attn/c_q/kernel", "tall/kernel": "tall/kernel",
            "wide/kernel": "wide/kernel", "mlp/c_proj/kernel": "mlp/c_proj/kernel",
            "scan/kernel": "scan/kernel"}
FACTORS = sorted(set(STATS_OF.values()))


def nest(flat):
    out = {}
    for path, x in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = x
    return out


def flat(tree):
    return {"/".join(str(k.key) for k in path): x
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def activations(step: int) -> dict[str, np.ndarray]:
    """Each factor's layer inputs at `step`: anisotropic and correlated (so P matters)."""
    rng = np.random.default_rng(100 + step)
    out = {}
    for path in FACTORS:
        shape = SHAPES[path]
        d, stack = shape[-2], shape[:-2]
        mix = np.random.default_rng(7).normal(size=(d, d)) * np.logspace(-1, 1, d)
        out[path] = rng.normal(size=(*stack, N, d)) @ mix
    return out


def stats_at(step: int) -> dict[str, LayerStats]:
    """What `kfac.value_grad_and_stats` returns for those inputs (`LayerStats`)."""
    out = {}
    for path, x in activations(step).items():
        scanned = x.ndim == 3
        dy = np.zeros((*x.shape[:-1], SHAPES[path][-1]))
        out[path] = LayerStats(jnp.asarray(x, jnp.float32), jnp.asarray(dy, jnp.float32),
                               has_bias=path == "tall/kernel", scanned=scanned)
    return out


def grads_at(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(500 + step)
    return {p: rng.normal(size=s) for p, s in SHAPES.items()}


PARAMS = nest({p: jnp.asarray(np.random.default_rng(1).normal(size=s) * 0.1, jnp.float32)
               for p, s in SHAPES.items()})
PARAMS_FLAT = flat(PARAMS)
TRACK3_NEWTON_SCHULZ = ((2.0, -1.5, 0.5),) * 12   # zeropower_via_newtonschulz5 of Track 3


# ----------------------------------------------------------- the float64 record reference
class RecordPreconditioner:
    """Record #15's `accum_xtx_`, `attach_preconditioner`, `_refresh_preconditioner` and
    `_precondition_grads` in float64, in PyTorch's (out, in) layout."""

    def __init__(self, refresh_interval=64, alpha=0.05, damping=0.2, block=BLOCK):
        self.every, self.alpha, self.damping, self.block = refresh_interval, alpha, damping, block
        self.cov, self.inv, self.has_inv = {}, {}, False
        for path in FACTORS:
            *stack, d, _ = SHAPES[path]
            n = d // block if d > block else 1
            b = d // n
            self.cov[path] = np.broadcast_to(0.001 * np.eye(b), (*stack, n, b, b)).copy()
            self.inv[path] = np.broadcast_to(np.eye(b), (*stack, n, b, b)).copy()

    def step(self, step, grads_torch, x_by_factor):
        if (step + 1) % self.every == 0:       # precond_flag_for_step: hooks on, refresh
            for path, x in x_by_factor.items():
                *stack, n, b, _ = self.cov[path].shape
                xs = x.reshape(*stack, x.shape[-2], n, b)            # accum_xtx_ blocks
                k = np.einsum("...tib,...tic->...ibc", xs, xs) / x.shape[-2]
                cov = self.cov[path] + self.alpha * (k - self.cov[path])   # lerp_(K, 0.05)
                reg = np.trace(cov, axis1=-2, axis2=-1) / b * self.damping + 1e-8
                self.cov[path] = cov
                self.inv[path] = np.linalg.inv(cov + reg[..., None, None] * np.eye(b))
            self.has_inv = True
        if not self.has_inv:
            return grads_torch
        out = {}
        for path, g in grads_torch.items():                       # g: (*stack, out, in)
            inv = self.inv[STATS_OF[path]]
            *stack, n, b, _ = inv.shape
            gb = g.reshape(*stack, g.shape[-2], n, b)
            out[path] = np.einsum("...oib,...ibc->...oic", gb, inv).reshape(g.shape)
        return out


def record_muon(g, momentum, mu=0.95):
    """`muon_update` (EMA-form Nesterov, 12 x (2, -1.5, 0.5), shape scale), float64."""
    momentum += (1 - mu) * (g - momentum)
    u = g + mu * (momentum - g)
    x = np.swapaxes(u, -1, -2) if u.shape[-2] > u.shape[-1] else u
    x = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    for _ in range(12):
        a = x @ np.swapaxes(x, -1, -2)
        x = 2 * x + (-1.5 * a + 0.5 * a @ a) @ x
    x = np.swapaxes(x, -1, -2) if u.shape[-2] > u.shape[-1] else x
    return x * max(1, g.shape[-2] / g.shape[-1]) ** 0.5


to_torch = lambda a: np.swapaxes(a, -1, -2)


_covariances = jax.jit(functools.partial(input_covariance_from_stats, layers=FACTORS))


@functools.cache
def covariance_arg(step):
    return _covariances(stats_at(step))


# ------------------------------------------------------------------ against the reference
def test_preconditioner_matches_the_record_over_130_steps():
    tx = precondition_by_input_covariance(block_size=BLOCK, shared_inputs=SHARED)
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    ref = RecordPreconditioner()
    for t in range(130):
        grads = grads_at(t)
        updates, state = update(nest({p: jnp.asarray(g, jnp.float32) for p, g in grads.items()}),
                                state, PARAMS, input_covariance=covariance_arg(t))
        want = ref.step(t, {p: to_torch(g) for p, g in grads.items()}, activations(t))
        got = flat(updates)
        for p in SHAPES:
            if t < 63:   # before the first refresh: the gradient itself, bit for bit
                np.testing.assert_array_equal(got[p], np.float32(grads[p]))
            else:
                np.testing.assert_allclose(got[p], to_torch(want[p]), rtol=2e-5, atol=2e-5,
                                           err_msg=f"{p} at step {t}")
        assert int(state.refreshes) == (t >= 63) + (t >= 127)
    covariances = flat(state.covariances)
    assert sorted(covariances) == FACTORS          # one factor for q, k and v
    for p in FACTORS:
        np.testing.assert_allclose(covariances[p], ref.cov[p], rtol=1e-5, atol=1e-7)
    assert covariances["mlp/c_proj/kernel"].shape == (2, BLOCK, BLOCK)
    assert covariances["scan/kernel"].shape == (2, 1, 6, 6)


def test_newton_muon_matches_the_record_over_130_steps():
    lr, wd = 0.02, 0.025
    tx = newton_muon(lr, block_size=BLOCK, shared_inputs=SHARED, weight_decay=wd,
                     coefficients=TRACK3_NEWTON_SCHULZ, ns_dtype=jnp.float32)
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    params = PARAMS
    ref = RecordPreconditioner()
    weights = {p: to_torch(np.asarray(w, np.float64)) for p, w in flat(PARAMS).items()}
    momenta = {p: np.zeros_like(w) for p, w in weights.items()}
    for t in range(130):
        grads = grads_at(t)
        updates, state = update(nest({p: jnp.asarray(g, jnp.float32) for p, g in grads.items()}),
                                state, params, input_covariance=covariance_arg(t))
        params = optax.apply_updates(params, updates)
        pre = ref.step(t, {p: to_torch(g) for p, g in grads.items()}, activations(t))
        for p, w in weights.items():
            u = record_muon(pre[p], momenta[p])
            weights[p] = w * (1 - lr * wd) - lr * u
        if t in (62, 63, 64, 128, 129):
            for p, w in flat(params).items():
                np.testing.assert_allclose(to_torch(w), weights[p], rtol=1e-4, atol=2e-5,
                                           err_msg=f"{p} after step {t}")


def test_shared_factor_equals_separate_factors_with_equal_inputs():
    """q, k and v read one input: one factor (q's) gives what three copies would."""
    params = nest({p: PARAMS_FLAT[p] for p in ("attn/c_q/kernel", "attn/c_k/kernel",
                                                "attn/c_v/kernel")})
    x = activations(0)["attn/c_q/kernel"]
    k = jnp.asarray(x.T @ x / N, jnp.float32)
    shared = precondition_by_input_covariance(refresh_every=1, shared_inputs=SHARED)
    separate = precondition_by_input_covariance(refresh_every=1)
    grads = m.random_grads(params, 0)
    u1, s1 = jax.jit(shared.update)(grads, shared.init(params),
                                    input_covariance={"attn/c_q/kernel": k})
    apart = lambda g, p, k: jax.jit(separate.update)(g, separate.init(p), input_covariance={
        f"attn/{n}/kernel": k for n in ("c_q", "c_k", "c_v")})
    u2, s2 = apart(grads, params, k)
    # One factor and three are other programs: as accurate as the three (float64 of them).
    assert_as_accurate(u1, u2, run_in_float64(lambda *a: apart(*a)[0], grads, params, k))
    assert list(s1.covariances["attn"]) == ["c_q"]
    assert sorted(s2.covariances["attn"]) == ["c_k", "c_q", "c_v"]
    # Only the group's first present kernel is read: without q, k's entry is the factor.
    no_q = {"attn": {n: params["attn"][n] for n in ("c_k", "c_v")}}
    s3 = shared.init(no_q)
    assert list(s3.covariances["attn"]) == ["c_k"]


def test_none_on_a_refresh_step_recomputes_from_the_kept_average():
    params = {"w": {"kernel": PARAMS_FLAT["tall/kernel"]}}
    tx = precondition_by_input_covariance(refresh_every=2, damping=0.5)
    x = activations(0)["tall/kernel"]
    k = {"w/kernel": jnp.asarray(x.T @ x / N, jnp.float32)}
    g, update = m.random_grads(params, 0), jax.jit(tx.update)
    _, state = update(g, tx.init(params), input_covariance=None)
    assert int(state.refreshes) == 0
    _, state = update(g, state, input_covariance=k)           # refresh 1 (update 1)
    c = np.asarray(state.covariances["w"]["kernel"])
    _, state = update(g, state, input_covariance=k)           # not a refresh: ignored
    u, state = update(g, state, input_covariance=None)        # refresh 2, no statistics
    np.testing.assert_array_equal(state.covariances["w"]["kernel"], c)
    c64 = c[0].astype(np.float64)
    p = np.linalg.inv(c64 + (0.5 * np.trace(c64) / 6 + 1e-8) * np.eye(6))
    np.testing.assert_allclose(u["w"]["kernel"], p @ np.asarray(g["w"]["kernel"], np.float64),
                               rtol=1e-5, atol=1e-6)
    assert int(state.refreshes) == 2


def test_failed_cholesky_leaves_the_gradient_unchanged():
    """Record: a factor whose Cholesky fails gets the identity (`info != 0`)."""
    params = {"w": {"kernel": PARAMS_FLAT["attn/c_q/kernel"]}}
    tx = precondition_by_input_covariance(refresh_every=1, ema_decay=0.0)
    g = m.random_grads(params, 0)
    u, state = tx.update(g, tx.init(params),
                         input_covariance={"w/kernel": -jnp.eye(8)})   # not a covariance
    # Exactly g: the identity times g is exact in float32 (products by 1 and 0, sums with 0).
    m.assert_trees_equal(u, g)
    assert int(state.refreshes) == 1


def test_refresh_schedule_is_the_records():
    assert [s for s in range(200) if input_covariance_refresh_due(s)] == [63, 127, 191]
    assert [s for s in range(9) if input_covariance_refresh_due(s, 3)] == [2, 5, 8]


# ---------------------------------------------------------------------- the optax matrix
SMALL = {"a": {"kernel": PARAMS_FLAT["tall/kernel"]}, "b": {"kernel": PARAMS_FLAT["wide/kernel"],
                                                              "bias": jnp.zeros(12)}}
SMALL_K = {"a/kernel": covariance_arg(0)["tall/kernel"],
           "b/kernel": covariance_arg(1)["wide/kernel"]}
TX = precondition_by_input_covariance(refresh_every=2)


def test_jit_matches_eager_and_bf16_params():
    one, one_k = {"a": SMALL["a"]}, {"a/kernel": SMALL_K["a/kernel"]}
    p_jit, s_jit, _ = m.run(TX, one, 2, input_covariance=one_k)
    p_eager, _, _ = m.run(TX, one, 2, jit=False, input_covariance=one_k)
    # TX on float64 params is its float64 computation (its state follows the params).
    assert_as_accurate(p_jit, p_eager, m.float64_run(TX, one, 2, input_covariance=one_k))
    assert int(s_jit.refreshes) == 1
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), SMALL)
    state = TX.init(low)
    for t in range(2):
        u, state = jax.jit(TX.update)(m.random_grads(low, t), state, input_covariance=SMALL_K)
        assert all(x.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(x)))
                   for x in jax.tree.leaves(u))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.covariances))


def test_inject_hyperparams():
    kwargs = dict(ema_decay=0.9, damping=0.3, refresh_every=2)
    injected = optax.inject_hyperparams(precondition_by_input_covariance,
                                        static_args=("refresh_every",))(**kwargs)
    plain = precondition_by_input_covariance(**kwargs)
    p1, _, _ = m.run(plain, SMALL, 4, input_covariance=SMALL_K)
    p2, state, _ = m.run(injected, SMALL, 4, input_covariance=SMALL_K)
    assert_as_accurate(p2, p1, m.float64_run(plain, SMALL, 4, input_covariance=SMALL_K))
    assert float(state.hyperparams["damping"]) == pytest.approx(0.3)


def test_partition_group_equals_the_transform_alone():
    labels = {"a": {"kernel": "nm"}, "b": {"kernel": "sgd", "bias": "sgd"}}
    part = optax.partition({"nm": TX, "sgd": optax.sgd(0.1)}, labels)
    p_part, _, _ = m.run(part, SMALL, 3, input_covariance=SMALL_K)
    one = {"a/kernel": SMALL_K["a/kernel"]}
    p_ref, _, _ = m.run(TX, {"a": SMALL["a"]}, 3, input_covariance=one)
    assert_as_accurate(p_part["a"], p_ref["a"],
                       m.float64_run(TX, {"a": SMALL["a"]}, 3, input_covariance=one)["a"])
    p_sgd, _, _ = m.run(optax.sgd(0.1), SMALL, 3)
    assert_as_accurate(p_part["b"], p_sgd["b"], m.float64_run(optax.sgd(0.1), SMALL, 3)["b"])


def test_sharded_params_replicated_factors():
    mesh = m.mesh8()
    sharded = m.shard_params(SMALL, mesh)
    state = TX.init(sharded)
    assert all(x.sharding.is_fully_replicated
               for x in jax.tree.leaves((state.covariances, state.inverses)))
    with jax.set_mesh(mesh):
        p, state, _ = m.run(TX, sharded, 3, state=state, input_covariance=SMALL_K)
    p_ref, _, _ = m.run(TX, SMALL, 3, input_covariance=SMALL_K)
    assert_as_accurate(p, p_ref, m.float64_run(TX, SMALL, 3, input_covariance=SMALL_K))
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(sharded), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    assert all(x.sharding.is_fully_replicated
               for x in jax.tree.leaves((state.covariances, state.inverses)))


def test_orbax_roundtrip_mid_interval(tmp_path):
    """Saved after 3 updates (refresh at update 1), resumed for 3 (refreshes at 3, 5)."""
    m.check_orbax_roundtrip(TX, SMALL, tmp_path, steps_before=3, steps_after=3,
                            input_covariance=SMALL_K)


# ------------------------------------------------------------- statistics from the capture
def test_statistics_from_the_capture():
    """q/k/v read one normed input, the MLP's 16-wide hidden feeds c_proj: K = xᵀx/N of
    the activations the model computed (bias coordinate dropped)."""
    rng = np.random.default_rng(0)
    p = {n: {"kernel": jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32),
             "bias": jnp.zeros(s[1])}
         for n, s in (("c_q", (8, 8)), ("c_k", (8, 4)), ("c_fc", (8, 16)), ("c_proj", (16, 8)))}
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)

    def loss_fn(p, x):
        dense = lambda n, h: h @ p[n]["kernel"] + p[n]["bias"]
        h = jnp.tanh(x)
        att = jnp.tanh(dense("c_q", h)).sum(-1) * jnp.tanh(dense("c_k", h)).sum(-1)
        return jnp.mean(dense("c_proj", jax.nn.relu(dense("c_fc", h)) ** 2)) + jnp.mean(att)

    _, _, stats = jax.jit(lambda p, x: kfac.value_grad_and_stats(loss_fn, p, x))(p, x)
    k = input_covariance_from_stats(stats, layers=["c_q/kernel", "c_proj/kernel"])
    assert sorted(k) == ["c_proj/kernel", "c_q/kernel"]
    h = np.tanh(np.asarray(x, np.float64)).reshape(10, 8)
    np.testing.assert_allclose(k["c_q/kernel"], h.T @ h / 10, rtol=1e-5, atol=1e-6)
    a = h @ np.asarray(p["c_fc"]["kernel"], np.float64)
    a = np.maximum(a, 0) ** 2
    np.testing.assert_allclose(k["c_proj/kernel"], a.T @ a / 10, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no statistics for 'c_v/kernel'"):
        input_covariance_from_stats(stats, layers=["c_v/kernel"])
    torch_layout = {"w/kernel": LayerStats(jnp.ones((3, 2)), jnp.ones((3, 4)),
                                           kernel_axes=(1, 0))}
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        input_covariance_from_stats(torch_layout)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(ema_decay=1.0), "ema_decay"), (dict(damping=-0.1), "damping"),
    (dict(refresh_every=0), "refresh_every"), (dict(block_size=0), "block_size"),
    (dict(shared_inputs=("c_q", "c_k")), "shared_inputs"), (dict(layers="a/kernel"), "layers"),
    (dict(initial_scale=0.0), "initial_scale"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        precondition_by_input_covariance(**kwargs)


def test_bad_trees():
    g = m.random_grads(SMALL, 0)
    state = TX.init(SMALL)
    with pytest.raises(ValueError, match="needs the input_covariance= extra argument"):
        TX.update(g, state)
    with pytest.raises(ValueError, match="no entry for b/kernel"):
        TX.update(g, state, input_covariance={"a/kernel": SMALL_K["a/kernel"]})
    with pytest.raises(ValueError, match=r"has shape \(4, 4\), expected \(6, 6\)"):
        TX.update(g, state, input_covariance={"a/kernel": SMALL_K["b/kernel"],
                                              "b/kernel": SMALL_K["b/kernel"]})
    with pytest.raises(ValueError, match="c/kernel, which is not a params leaf"):
        TX.update(g, state, input_covariance={**SMALL_K, "c/kernel": jnp.eye(2)})
    with pytest.raises(ValueError, match="not a multiple of block_size=5"):
        precondition_by_input_covariance(block_size=5).init(SMALL)
    with pytest.raises(ValueError, match="shares the input of"):
        precondition_by_input_covariance(shared_inputs=(("a", "b"),)).init(SMALL)
    with pytest.raises(ValueError, match="not a leaf of the params"):
        precondition_by_input_covariance(layers=["z/kernel"]).init(SMALL)


# --------------------------------------------------------------------------- properties
@settings(max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit,
                                                                    Phase.generate),
          suppress_health_check=[HealthCheck.too_slow])
@given(kfac_problems(), st.integers(1, 3), st.floats(0.0, 0.99), st.floats(0.0, 1.0),
       st.sampled_from([None, np.nan, np.inf]))
def test_random_trees_run_and_nonfinite_statistics_never_reach_the_params(
        problem, refresh_every, ema_decay, damping, poison):
    """Random trees and dtypes (dense layers among other leaves): finite, param-shaped
    updates and a stable state; a NaN/Inf statistic leaves the covariance average as it
    was (here: every batch poisoned, so C stays C₀)."""
    spec, seed = problem
    params, grads = materialise(spec, seed)
    rng = np.random.default_rng(seed)
    k = {}
    for name, layer in params.items():
        if isinstance(layer, dict) and "kernel" in layer:
            x = rng.standard_normal((7, layer["kernel"].shape[0]))
            if poison is not None:
                x[0, 0] = poison
            k[f"{name}/kernel"] = jnp.asarray(x.T @ x / 7, jnp.float32)
    tx = precondition_by_input_covariance(ema_decay, damping, refresh_every=refresh_every)
    check_runs(tx, params, grads, input_covariance=k)
    if poison is not None:
        state = tx.init(params)
        for g in grads:
            _, state = jax.jit(tx.update)(g, state, params, input_covariance=k)
        for c in jax.tree.leaves(state.covariances):
            np.testing.assert_array_equal(c, np.broadcast_to(1e-3 * np.eye(c.shape[-1]),
                                                             c.shape).astype(np.float32))


def test_snoo_around_newton_muon_forwards_the_statistics():
    """With k=1, η=1, μ=0 Snoo is its inner optimizer: the statistics reach the
    preconditioner through it (2 refreshes in 4 updates)."""
    from optax_snoo import snoo

    # A float32 iteration, so that the float64 run is the same computation.
    make = lambda dtype: newton_muon(0.02, refresh_every=2, adam_learning_rate=1e-2,
                                     ns_dtype=dtype)
    inner = make(jnp.float32)
    p_snoo, s_snoo, _ = m.run(snoo(inner, learning_rate=1.0, momentum=0.0, k=1), SMALL, 4,
                              input_covariance=SMALL_K)
    p_ref, _, _ = m.run(inner, SMALL, 4, input_covariance=SMALL_K)
    # slow + 1·(fast - slow) rounds once more than fast: as accurate as the inner run.
    assert_as_accurate(p_snoo, p_ref,
                       m.float64_run(make(jnp.float64), SMALL, 4, input_covariance=SMALL_K))
    assert int(s_snoo.inner_state[0].inner_state.refreshes) == 2
