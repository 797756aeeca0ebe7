"""Stochastic and dithered rounding (Gupta et al. 2015; Malik 2026): statistics, the
formula, exactness of `optax.apply_updates`, overflow, composition with optax and skew_adam,
the optax matrix."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import skew_adam
from optax_snoo.rounding import (
    RoundingState,
    by_name,
    dithered_rounding,
    round_dithered,
    round_stochastic,
    stochastic_rounding,
)

BF16 = ml_dtypes.bfloat16


def bf16_bits(x):
    return np.asarray(x, BF16).view(np.uint16)


def from_bits(bits):
    return np.asarray(bits, np.uint16).view(BF16)


def bf16_away_from_zero(x):
    """The bf16 neighbour of bf16 values `x` one step away from zero (sign-magnitude bits)."""
    return from_bits(bf16_bits(x) + 1)


def uniform_draws(key, t, shapes):
    """The documented draw scheme of optax_snoo.rounding."""
    keys = jax.random.split(jax.random.fold_in(jax.random.key(key), t), len(shapes))
    return [np.asarray(jax.random.uniform(k, s, jnp.float32)) for k, s in zip(keys, shapes,
                                                                              strict=True)]


def new_value(p, u):
    """The value being rounded: `p + u` in float32 (as a float64 array)."""
    return (np.asarray(p, np.float32) + np.asarray(u, np.float32)).astype(np.float64)


def apply_once(tx, params, updates):
    new_updates, state = jax.jit(tx.update)(updates, tx.init(params), params)
    return optax.apply_updates(params, new_updates), new_updates, state


# ----------------------------------------------------------------------------- statistics

N = 1 << 15
CASES = [(1.0, 0.1), (1.0, 0.5), (-3.5, 0.83), (0.0123, 0.3), (448.0, 0.97), (-2e-30, 0.6),
         (5.0, 0.0)]


def test_stochastic_rounding_is_unbiased_and_returns_a_neighbour():
    params, updates, expect = {}, {}, {}
    for i, (lo, frac) in enumerate(CASES):
        lo_b = np.asarray(lo, BF16)
        hi_b = bf16_away_from_zero(lo_b)
        # Cross-check the bit-level neighbour with nextafter in bf16.
        assert jnp.nextafter(jnp.bfloat16(lo_b), jnp.bfloat16(np.sign(lo) * np.inf)) == hi_b
        lo64, hi64 = float(lo_b), float(hi_b)
        x = np.float32(lo64 + frac * (hi64 - lo64))
        params[f"c{i}"] = jnp.full((N,), lo_b, jnp.bfloat16)
        updates[f"c{i}"] = jnp.full((N,), np.float32(x - np.float32(lo64)), jnp.float32)
        expect[f"c{i}"] = (lo64, hi64, float(x))
    new, _, _ = apply_once(stochastic_rounding(key=7), params, updates)
    for name, (lo, hi, x) in expect.items():
        r = np.asarray(new[name], np.float64)
        assert new[name].dtype == jnp.bfloat16
        assert set(np.unique(r)) <= {lo, hi}, (name, np.unique(r))
        f = (x - lo) / (hi - lo)
        sigma = abs(hi - lo) * np.sqrt(f * (1 - f) / N)
        assert abs(r.mean() - x) <= 5 * sigma + 1e-12 * abs(x), (name, r.mean(), x, sigma)
        if 0 < f < 1:
            assert 0 < np.mean(r == hi) < 1


def test_stochastic_rounding_is_unbiased_for_tiny_values():
    """|x| < ~2^-118: the distance to the bf16 neighbours is a float32 subnormal (flushed to
    zero by XLA:CPU), yet the rounding must stay unbiased. Through the transform (p = 0,
    u = x, normal float32) and directly on float32 subnormals."""
    cases = []
    for lo, frac in ((2e-38, 0.3), (5e-37, 0.7), (-3e-36, 0.45), (1e-39, 0.6), (-3e-40, 0.2)):
        lo_bits = int(np.asarray(lo, np.float32).view(np.uint32)) & 0xFFFF0000
        x_bits = lo_bits | int(frac * 2**16)
        cases.append((np.uint32(lo_bits).view(np.float32), np.uint32(x_bits).view(np.float32),
                      np.uint32(lo_bits + 0x10000).view(np.float32)))
    params = {f"c{i}": jnp.zeros((N,), jnp.bfloat16) for i in range(3)}
    updates = {f"c{i}": jnp.full((N,), cases[i][1], jnp.float32) for i in range(3)}
    new, _, _ = apply_once(stochastic_rounding(key=2), params, updates)
    results = [np.asarray(new[f"c{i}"], np.float64) for i in range(3)]
    uniform = jax.random.uniform(jax.random.key(5), (N,), jnp.float32)
    for _, x, _ in cases[3:]:                       # float32 subnormals
        results.append(np.asarray(jax.jit(round_stochastic, static_argnums=2)(
            jnp.full((N,), x, jnp.float32), uniform, jnp.bfloat16), np.float64))
    for (lo, x, hi), r in zip(cases, results, strict=True):
        lo, x, hi = float(lo), float(x), float(hi)
        assert set(np.unique(r)) <= {lo, hi}, (x, np.unique(r))
        f = (x - lo) / (hi - lo)
        sigma = abs(hi - lo) * np.sqrt(f * (1 - f) / N)
        assert abs(r.mean() - x) <= 5 * sigma, (x, r.mean(), sigma)


def test_stochastic_rounding_keeps_small_updates_in_expectation():
    """SGD steps of 1e-4 on bf16 weights at 1.0 (half-spacing 2^-9 ≈ 2e-3): nearest rounding
    never moves them; stochastic rounding moves their mean by the sum of the steps."""
    params = {"w": jnp.ones((4096,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4096,), jnp.bfloat16)}
    steps = 100
    for tx, moved in ((optax.sgd(1e-4), False),
                      (optax.chain(optax.sgd(1e-4), stochastic_rounding(key=3)), True)):
        p, state, update = params, tx.init(params), jax.jit(tx.update)
        for _ in range(steps):
            u, state = update(grads, state, p)
            p = optax.apply_updates(p, u)
        mean = float(jnp.mean(p["w"].astype(jnp.float32)))
        if moved:
            # Each step's rounding error has std <= 2^-8/2; 5 sigma over 4096 weights.
            assert abs(mean - (1 - steps * 1e-4)) < 5 * np.sqrt(steps) * 2**-9 / 64
        else:
            assert mean == 1.0


# ----------------------------------------------------------------------------- formulas

def realistic(seed, n=20000):
    """bf16 params and float32 updates from tiny to 40% of the parameter, some that zero the
    parameter, and zero parameters."""
    rng = np.random.default_rng(seed)
    p = (rng.normal(size=n) * np.exp(rng.uniform(-8, 3, size=n))).astype(BF16)
    rel = np.exp(rng.uniform(np.log(1e-6), np.log(0.4), size=n)) * rng.choice([-1, 1], size=n)
    u = (p.astype(np.float32) * rel).astype(np.float32)
    u[:50] = -p[:50].astype(np.float32)
    p[50:100] = 0
    u[50:100] = rng.normal(size=50).astype(np.float32) * 1e-3
    return {"w": jnp.asarray(p)}, {"w": jnp.asarray(u)}


def near_boundary(d64, lo_mask=None):
    """Elements whose f64 value is within 4 float32 ulps of a bf16 rounding boundary: there
    the float32 computation may legitimately round the other way."""
    delta = 4 * np.spacing(np.abs(d64).astype(np.float32)).astype(np.float64)
    return (d64 - delta).astype(BF16) != (d64 + delta).astype(BF16)


def test_dithered_rounding_matches_spec_formula():
    params, updates = realistic(0)
    for t in range(2):
        tx = dithered_rounding(key=11)
        state = tx.init(params)
        update = jax.jit(tx.update)
        for _ in range(t + 1):
            u, state = update(updates, state, params)
        new = optax.apply_updates(params, u)
        x = new_value(params["w"], updates["w"])
        (U,) = uniform_draws(11, t, [x.shape])
        d64 = x + (U.astype(np.float64) - 0.5) * np.abs(x) * 2.0**-7       # the paper's dither
        ref = d64.astype(BF16)
        got = np.asarray(new["w"])
        mismatch = got.astype(np.float64) != ref.astype(np.float64)
        ambiguous = near_boundary(d64)
        assert not np.any(mismatch & ~ambiguous), np.flatnonzero(mismatch & ~ambiguous)[:5]
        assert ambiguous.mean() < 1e-3
        assert int(state.count) == t + 1


def stochastic_reference(x, U):
    """Given the draws: the nearest bf16 value, or its other neighbour on x's side with
    probability |x - nearest| / spacing."""
    nearest = x.astype(BF16)
    n64 = nearest.astype(np.float64)
    toward_zero = np.abs(x) < np.abs(n64)
    bits = bf16_bits(nearest).astype(np.int32)
    other_bits = np.where(toward_zero, bits - 1, bits + 1)
    other_bits = np.where(n64 == 0, np.where(x < 0, 0x8001, 0x0001), other_bits)
    other = from_bits(other_bits).astype(np.float64)
    prob = np.abs(x - n64) / np.abs(other - n64)
    return np.where(prob > U, other, n64), prob


def test_stochastic_rounding_matches_reference_and_apply_updates_is_exact():
    params, updates = realistic(1)
    new, emitted, _ = apply_once(stochastic_rounding(key=5), params, updates)
    x = new_value(params["w"], updates["w"])
    (U,) = uniform_draws(5, 0, [x.shape])
    ref, prob = stochastic_reference(x, U)
    got = np.asarray(new["w"], np.float64)
    mismatch = got != ref
    assert not np.any(mismatch & (np.abs(U - prob) > 1e-6)), np.flatnonzero(mismatch)[:5]
    # apply_updates (p + u' in bf16) reproduces r exactly: u' = r - p is representable.
    assert emitted["w"].dtype == jnp.bfloat16
    r_again = np.asarray(params["w"], np.float64) + np.asarray(emitted["w"], np.float64)
    np.testing.assert_array_equal(got, r_again)


@pytest.mark.parametrize("make", [stochastic_rounding, dithered_rounding])
def test_apply_updates_exact_for_float32_params_with_bf16_target(make):
    """Float32 params on the bf16 grid stay on it; p + u' in float32 is exactly r."""
    params, updates = realistic(2)
    params = {"w": params["w"].astype(jnp.float32)}
    new, emitted, _ = apply_once(make(key=1, dtype=jnp.bfloat16), params, updates)
    r = np.asarray(new["w"])
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, r.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(r, np.asarray(params["w"]) + np.asarray(emitted["w"]))
    x = new_value(params["w"], updates["w"])
    np.testing.assert_array_less(np.abs(r - x), np.abs(x) * 2.0**-6 + 1e-38)


@pytest.mark.parametrize("make", [stochastic_rounding, dithered_rounding])
def test_float32_params_pass_through(make):
    params = {"w": jnp.linspace(-1, 1, 7), "b": jnp.ones((3,))}
    grads = jax.tree.map(lambda x: 0.3 * x + 0.1, params)
    plain, updates, _ = apply_once(optax.adamw(1e-2), params, grads)
    # The rounding alone on AdamW's updates (one program, no arithmetic on float32
    # params): its updates are those, bit for bit, and so are the new params.
    rounded, emitted, _ = apply_once(make(key=0), params, updates)
    m.assert_trees_equal(emitted, updates)
    m.assert_trees_equal(rounded, plain)


def sterbenz(p, r):
    """Where r - p is exact in bf16 (Sterbenz's lemma), so apply_updates returns r exactly."""
    p, r = np.abs(p) * np.sign(p), np.asarray(r)
    same_sign = np.sign(p) == np.sign(r)
    return (p == 0) | (r == 0) | (same_sign & (np.abs(r) <= 2 * np.abs(p))
                                  & (np.abs(p) <= 2 * np.abs(r)))


def test_skew_adam_with_rounding_on_bf16_params():
    """skew_adam(rounding=...) rounds the float32 new value `p + u` that skew_adam computes
    (obtained here with `rounding=optax.identity()`). Small weights under a large learning
    rate leave the Sterbenz domain: there apply_updates' own rounding of `p + (r - p)` is off
    by at most about 2^-8 of the step, as the module docstring says."""
    # One backbone matrix keeps the compile small; the rounding does not depend on roles.
    params = {"wte": jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.bfloat16)}
    grads = m.random_grads(params, 0)
    _, u32, _ = apply_once(skew_adam(1e-2, rounding=optax.identity()), params, grads)
    assert u32["wte"].dtype == jnp.float32
    (U,) = uniform_draws(9, 0, [params["wte"].shape])
    p = np.asarray(params["wte"], np.float64)
    x = new_value(params["wte"], u32["wte"])
    for kind, make in (("stochastic", stochastic_rounding), ("dithered", dithered_rounding)):
        new, emitted, _ = apply_once(skew_adam(1e-2, rounding=make(key=9)), params, grads)
        assert emitted["wte"].dtype == jnp.bfloat16
        got = np.asarray(new["wte"], np.float64)
        if kind == "stochastic":
            ref, prob = stochastic_reference(x, U)
            ambiguous = np.abs(U - prob) < 1e-5
        else:
            d64 = x + (U.astype(np.float64) - 0.5) * np.abs(x) * 2.0**-7
            ref, ambiguous = d64.astype(BF16).astype(np.float64), near_boundary(d64)
        inside = sterbenz(p, ref)
        close = np.abs(got - ref) <= 2.0**-8 * (np.abs(ref - p) + np.abs(ref))
        ok = np.where(inside, (got == ref) | ambiguous, close)
        assert ok.all(), (kind, np.flatnonzero(~ok)[:5])
        assert inside.sum() > 10 * (~inside).sum() > 0, (inside.sum(), (~inside).sum())


# ----------------------------------------------------------------------------- overflow

def values_near_the_largest(dtype):
    """float32 values from two spacings below the largest finite value of `dtype` up to
    float32's largest, both signs, and the float32 values right next to them."""
    big = float(jnp.finfo(dtype).max)
    below = float(np.nextafter(np.nextafter(np.asarray(big, dtype), 0, dtype=dtype), 0))
    x = np.linspace(below, float(np.finfo(np.float32).max), 4001).astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(0)),
                        np.float32([big, np.finfo(np.float32).max])])
    return np.concatenate([x, -x]), big


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("round_fn", [round_stochastic, round_dithered])
def test_finite_values_near_the_largest_never_round_to_inf(round_fn, dtype):
    x, big = values_near_the_largest(dtype)
    rng = np.random.default_rng(0)
    for uniform in (np.zeros_like(x), np.full_like(x, 1 - 2.0**-24), rng.random(x.size)):
        r = np.asarray(round_fn(jnp.asarray(x), jnp.asarray(uniform, jnp.float32), dtype),
                       np.float64)
        assert np.isfinite(r).all(), x[~np.isfinite(r)][:4]
        assert (np.abs(r) <= big).all()
        if round_fn is round_stochastic:
            # Beyond the largest finite value: that value, with the sign of x. (The dither
            # may first move a value back inside, so only the bound holds for it.)
            beyond = np.abs(x.astype(np.float64)) > big
            np.testing.assert_array_equal(r[beyond], np.sign(x[beyond]) * big)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("round_fn", [round_stochastic, round_dithered])
def test_inf_and_nan_map_to_themselves(round_fn, dtype):
    x = jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32)
    for u in (0.0, 0.5, 1 - 2.0**-24):
        r = np.asarray(round_fn(x, jnp.full((3,), u, jnp.float32), dtype), np.float64)
        assert r[0] == np.inf and r[1] == -np.inf and np.isnan(r[2])


def test_a_step_past_the_largest_bf16_keeps_the_param_finite():
    big = float(jnp.finfo(jnp.bfloat16).max)
    params = {"w": jnp.full((256,), big, jnp.bfloat16)}
    tx = optax.chain(optax.sgd(1.0), stochastic_rounding(key=0))
    new, _, _ = apply_once(tx, params, {"w": jnp.full((256,), -big * 2.0**-9, jnp.bfloat16)})
    assert np.asarray(new["w"], np.float64).max() == big


# ----------------------------------------------------------------------------- by_name

@pytest.mark.parametrize("name, make", [("stochastic", stochastic_rounding),
                                        ("dithered", dithered_rounding)])
def test_by_name_builds_the_named_transform(name, make):
    params = {"w": jnp.linspace(1, 2, 64, dtype=jnp.bfloat16)}
    updates = {"w": jnp.full((64,), 1e-3, jnp.float32)}
    for kw in ({}, {"key": 7}, {"key": 7, "dtype": jnp.bfloat16}):
        _, got, _ = apply_once(by_name(name, **kw), params, updates)
        _, want, _ = apply_once(make(**kw), params, updates)
        np.testing.assert_array_equal(got["w"], want["w"])


def test_by_name_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown rounding 'nearest'; expected one of "
                                         r"\['dithered', 'stochastic'\]"):
        by_name("nearest")
    with pytest.raises(ValueError, match="unknown rounding None"):
        by_name(None)


# ----------------------------------------------------------------------------- errors, state

def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        stochastic_rounding(dtype=jnp.int32)
    with pytest.raises(TypeError, match="key"):
        dithered_rounding(key="seed")
    tx = stochastic_rounding()
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


def test_state_holds_key_and_count():
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    state = stochastic_rounding(key=jax.random.key(4)).init(params)
    assert isinstance(state, RoundingState)
    assert state.key.dtype == jnp.uint32
    np.testing.assert_array_equal(state.key, jax.random.key_data(jax.random.key(4)))
    same = stochastic_rounding(key=4).init(params)
    np.testing.assert_array_equal(state.key, same.key)


# ----------------------------------------------------------------------------- optax matrix

# Float32 params on the bf16 grid with dtype=bf16: the rounding is active and the matrix's
# float32 comparisons apply. Distinct shapes (the harness checks sharding by shape).
GRID = {"w": jnp.asarray(np.linspace(-2, 2, 48).reshape(8, 6).astype(BF16), jnp.float32),
        "b": jnp.asarray(np.linspace(0.5, 1, 4).astype(BF16), jnp.float32)}


def sr_adamw(learning_rate=1e-2):
    return optax.chain(optax.adamw(learning_rate),
                       stochastic_rounding(key=0, dtype=jnp.bfloat16))


def test_optax_matrix(tmp_path):
    """The float32 comparisons of two programs on the bf16 grid the rounding leaves: a
    value within float32 rounding of its random threshold may round either way in either
    program, so they may be one bf16 step apart per rounding step (optax_matrix)."""
    tx = sr_adamw()
    m.check_jit_matches_eager(tx, GRID, steps=2, grid=BF16)
    m.check_state_stable(tx, GRID)
    m.check_dtype_preserved(optax.chain(optax.adamw(1e-2), stochastic_rounding()), GRID)
    m.check_multisteps(tx, GRID, grid=BF16)
    m.check_partition(tx, GRID, grid=BF16)
    m.check_sharded_state(tx, GRID, grid=BF16)
    m.check_orbax_roundtrip(tx, GRID, tmp_path)
    m.check_inject_hyperparams(sr_adamw, GRID, {"learning_rate": 1e-2}, grid=BF16)
    m.check_nnx_optimizer(optax.chain(optax.adamw(1e-2), dithered_rounding(dtype=jnp.bfloat16)))
