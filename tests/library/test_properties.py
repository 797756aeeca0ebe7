"""Property-based tests (hypothesis) of every public transform on random input.

Random trees (nesting, names, 0-size, scalar, 1-D, matrix and stacked leaves), dtypes
(float32, bfloat16, float16), hyperparameters and schedules: each transform either works
(finite updates shaped like the params; a state whose structure, shapes, dtypes and
shardings stay those of `init`) or raises ValueError/TypeError naming the problem.
Deliberately wrong arguments must raise at construction or `init`, naming the argument.
K-FAC statistics with NaN/Inf never reach the params.

Example counts are small (CI has 2 cores): every example compiles new shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import optax_snoo as osn
from library.support import check_runs, kfac_problems, materialise, trees
from optax_snoo import kfac as okfac

# No shrinking: a failing example is reported as drawn (shrinking recompiles for minutes).
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, print_blob=True,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow])
KFAC_SETTINGS = settings(SETTINGS, max_examples=6)  # two optimizers, eigh: the slowest


def schedules(low, high):
    """A float in [low, high] or a schedule with values in it."""
    value = st.floats(low, high, allow_nan=False)
    return st.one_of(value, st.builds(
        lambda a, b, n: optax.linear_schedule(a, b, n), value, value, st.integers(1, 4)))


def works_or_names_the_problem(build, params, grads, *, expected_words=(), **extra):
    """Run `check_runs`, or accept a ValueError/TypeError whose message names something."""
    try:
        tx = build()
        return check_runs(tx, params, grads, **extra)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert message and any(w in message for w in expected_words), message
        return None


# ----------------------------------------------------------------------------- random trees


@SETTINGS
@given(trees(), schedules(0.0, 1.0), schedules(0.0, 0.95), st.integers(1, 3))
def test_snoo_on_random_trees(spec, lr, momentum, k):
    params, grads = materialise(spec)
    # (optax.adam itself overflows on float16 params: its eps and g^2 underflow to 0.)
    inner = optax.sgd(1e-2, momentum=0.9)
    check_runs(osn.snoo(inner, learning_rate=lr, momentum=momentum, k=k), params, grads)


@SETTINGS
@given(trees(), st.one_of(st.floats(0.0, 0.99), st.just(osn.muon_momentum_warmup(0.85, 0.95,
                                                                                  2))),
       st.sampled_from(["modded", "keller"]), st.sampled_from([jnp.bfloat16, jnp.float32]),
       st.booleans(), st.booleans())
def test_muon_on_random_trees(spec, beta, coefficients, ns_dtype, nesterov, bias_correction):
    params, grads = materialise(spec)
    kw = dict(beta=beta, coefficients=coefficients, ns_dtype=ns_dtype, nesterov=nesterov,
              bias_correction=bias_correction)
    check_runs(osn.muon(optax.linear_schedule(0.02, 0.0, 3), **kw), params, grads)
    # The bare direction is for matrices and stacks: other leaves must be named.
    works_or_names_the_problem(lambda: osn.scale_by_muon(**kw), params, grads,
                               expected_words=("ndim", "matrix", "2-D", "axes", "shape"))


@SETTINGS
@given(trees(), st.floats(0.0, 0.99), st.floats(0.0, 0.999), st.floats(1e-30, 1e-3),
       st.booleans(), st.booleans(), st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_skew_adam_pieces_on_random_trees(spec, b1, b2, eps, momentum, factored, stats_dtype):
    params, grads = materialise(spec)
    check_runs(osn.scale_by_skew_adam(b1, b2, eps, momentum=momentum, factored=factored,
                                      stats_dtype=stats_dtype), params, grads)
    check_runs(osn.scale_by_second_moment(b2, eps, factored=factored,
                                          stats_dtype=stats_dtype), params, grads)


@SETTINGS
@given(trees(), schedules(0.0, 1e-2), schedules(0.0, 0.1),
       st.sampled_from([None, "stochastic", "dithered"]),
       st.one_of(st.none(), st.floats(0.1, 2.0)))
def test_skew_adam_on_random_trees(spec, lr, weight_decay, rounding, clip):
    params, grads = materialise(spec)
    check_runs(osn.skew_adam(lr, weight_decay=weight_decay, rounding=rounding,
                             clip_threshold=clip), params, grads)


@SETTINGS
@given(trees(), st.integers(0, 2**31 - 1), st.sampled_from([None, jnp.bfloat16, jnp.float16]),
       st.sampled_from(["stochastic", "dithered"]))
def test_rounding_on_random_trees(spec, seed, dtype, kind):
    params, grads = materialise(spec)
    rounding = {"stochastic": osn.stochastic_rounding, "dithered": osn.dithered_rounding}[kind]
    out = works_or_names_the_problem(
        lambda: optax.chain(optax.sgd(1e-2), rounding(seed, dtype)), params, grads,
        expected_words=("dtype",))
    if out is not None and dtype is not None:  # rounded values are representable
        for leaf in jax.tree.leaves(out):
            wide = leaf.astype(jnp.float32)
            np.testing.assert_array_equal(wide, wide.astype(dtype).astype(jnp.float32))


@SETTINGS
@given(trees())
def test_skew_adam_roles_on_random_trees(spec):
    params, _ = materialise(spec)
    roles = osn.skew_adam_roles(params)
    paths = ["/".join(str(k.key) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert list(roles) == paths
    for path, role in roles.items():
        want = ("experts" if "experts" in path else "router" if "router" in path
                else "backbone")
        assert role == want, (path, role)
    assert osn.labels.describe(osn.assign_roles(params), params) == roles


FLOAT32S = st.floats(width=32, allow_nan=True, allow_infinity=True)
NEAR_BF16_MAX = st.floats(float(np.float32(3.3e38)), float(np.finfo(np.float32).max), width=32)


@SETTINGS
@given(st.lists(st.one_of(FLOAT32S, NEAR_BF16_MAX, NEAR_BF16_MAX.map(lambda x: -x)),
                min_size=16, max_size=16),
       st.lists(st.floats(0.0, 1.0, exclude_max=True, width=32), min_size=16, max_size=16),
       st.sampled_from(["stochastic", "dithered"]), st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_rounding_keeps_finite_values_finite(values, draws, kind, dtype):
    x = jnp.asarray(values, jnp.float32)
    round_fn = {"stochastic": osn.rounding.round_stochastic,
                "dithered": osn.rounding.round_dithered}[kind]
    r = np.asarray(round_fn(x, jnp.asarray(draws, jnp.float32), dtype), np.float64)
    x = np.asarray(x, np.float64)
    finite = np.isfinite(x)
    assert np.isfinite(r[finite]).all(), x[finite][~np.isfinite(r[finite])]
    np.testing.assert_array_equal(r[~finite], x[~finite])  # ±inf and nan (nan == nan here)


def curvature_for(params, rng, poison=None):
    out = {}
    for name, layer in params.items():
        if isinstance(layer, dict) and "kernel" in layer:
            d_in, d_out = layer["kernel"].shape
            x = rng.standard_normal((7, d_in)).astype(np.float32)
            dy = rng.standard_normal((7, d_out)).astype(np.float32)
            if poison is not None:
                dy[0, 0] = poison
            out[name] = {"kernel": okfac.layer_factors(jnp.asarray(x), jnp.asarray(dy),
                                                       "bias" in layer)}
    return out


@KFAC_SETTINGS
@given(kfac_problems(), schedules(0.0, 1e-2), st.integers(1, 3), st.sampled_from(["pi", "eigen"]),
       st.floats(0.0, 0.99), st.sampled_from([None, "adam"]))
def test_kfac_on_random_trees(problem, damping, refresh, mode, ema_decay, graft):
    spec, seed = problem
    params, grads = materialise(spec, seed)
    rng = np.random.default_rng(seed)
    curvature = curvature_for(params, rng)
    check_runs(okfac.scale_by_kfac(damping=damping, refresh=refresh, mode=mode,
                                   ema_decay=ema_decay), params, grads, curvature=curvature)
    check_runs(okfac.kfac(1e-2, damping=damping, refresh=refresh, mode=mode,
                          ema_decay=ema_decay, graft=graft), params, grads, curvature=curvature)


@KFAC_SETTINGS
@given(kfac_problems(), st.sampled_from([np.nan, np.inf, -np.inf]),
       st.sampled_from(["pi", "eigen"]), st.integers(0, 2))
def test_kfac_nonfinite_statistics_never_reach_the_params(problem, bad, mode, bad_step):
    """A NaN/Inf batch factor (any step, refresh every step) leaves the factors untouched."""
    spec, seed = problem
    params, grads = materialise(spec, seed)
    rng = np.random.default_rng(seed)
    tx = okfac.kfac(1e-2, refresh=1, mode=mode)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(grads):
        curvature = curvature_for(params, rng, poison=bad if t == bad_step else None)
        updates, state = update(g, state, params, curvature=curvature)
        params = optax.apply_updates(params, updates)
        for leaf in jax.tree.leaves((params, state)):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))), t


# ----------------------------------------------------------------------------- wrong arguments

PARAMS = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}

WRONG = [
    ("snoo k=0", lambda: osn.snoo(optax.sgd(0.1), k=0), "k"),
    ("snoo k=2.5", lambda: osn.snoo(optax.sgd(0.1), k=2.5), "k"),
    ("snoo momentum=1", lambda: osn.snoo(optax.sgd(0.1), momentum=1.0), "momentum"),
    ("snoo lr=-1", lambda: osn.snoo(optax.sgd(0.1), learning_rate=-1.0), "learning_rate"),
    ("snoo inner", lambda: osn.snoo("adam"), "inner"),
    ("muon beta=1.5", lambda: osn.scale_by_muon(beta=1.5), "beta"),
    ("muon coefficients", lambda: osn.scale_by_muon(coefficients="fast"), "'fast'"),
    ("muon coefficients=[]", lambda: osn.scale_by_muon(coefficients=[]), "coefficients"),
    ("muon ns_dtype", lambda: osn.scale_by_muon(ns_dtype=jnp.int32), "ns_dtype"),
    ("muon matrix_axes", lambda: osn.scale_by_muon(matrix_axes=(0, 0)), "matrix_axes"),
    ("muon smoothing_form", lambda: osn.scale_by_muon(smoothing_form="x"), "smoothing_form"),
    ("muon 1-D leaf", lambda: osn.scale_by_muon().init({"b": jnp.zeros(3)}), "b"),
    ("skew b2=1", lambda: osn.scale_by_skew_adam(b2=1.0), "b2"),
    ("skew eps=0", lambda: osn.scale_by_skew_adam(eps=0.0), "eps"),
    ("skew policies", lambda: osn.skew_adam(policies="nope"), "policies"),
    ("skew rounding", lambda: osn.skew_adam(rounding="up"), "rounding"),
    ("skew roles", lambda: osn.skew_adam(roles="experts"), "static_args"),
    ("rounding by_name", lambda: osn.rounding.by_name("up"), "'up'"),
    ("second moment b2=-0.1", lambda: osn.scale_by_second_moment(b2=-0.1), "b2"),
    ("rounding dtype", lambda: osn.stochastic_rounding(0, jnp.int8), "dtype"),
    ("rounding key", lambda: osn.dithered_rounding("seed"), "key"),
    ("kfac damping", lambda: okfac.scale_by_kfac(damping=-1.0), "damping"),
    ("kfac ema_decay", lambda: okfac.scale_by_kfac(ema_decay=1.0), "ema_decay"),
    ("kfac refresh=0", lambda: okfac.scale_by_kfac(refresh=0), "interval"),
    ("kfac mode", lambda: okfac.scale_by_kfac(mode="exact"), "mode"),
    ("kfac graft", lambda: okfac.kfac(1e-2, graft="rmsprop"), "graft"),
    ("kfac layers", lambda: okfac.scale_by_kfac(layers={"nope": okfac.LayerCurvature(
        jnp.zeros((4, 4)), jnp.zeros((4, 4)))}).init(PARAMS), "nope"),
]


@pytest.mark.parametrize("name, build, word", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_arguments_raise_naming_them(name, build, word):
    with pytest.raises((ValueError, TypeError)) as err:
        tx = build()
        if isinstance(tx, optax.GradientTransformation):
            tx.init(PARAMS)
    assert word in str(err.value), str(err.value)


def test_kfac_wrong_curvature_is_named():
    tx = okfac.scale_by_kfac()
    state = tx.init(PARAMS)
    bad = {"dense": {"kernel": okfac.LayerCurvature(jnp.eye(5), jnp.eye(4))},
           "ghost": {"kernel": okfac.LayerCurvature(jnp.eye(2), jnp.eye(2))}}
    with pytest.raises(ValueError, match="ghost"):
        tx.update(PARAMS, state, PARAMS, curvature=bad)
    wrong_shape = {"dense": {"kernel": okfac.LayerCurvature(jnp.eye(3), jnp.eye(4))}}
    with pytest.raises(ValueError, match="dense"):
        tx.update(PARAMS, state, PARAMS, curvature=wrong_shape)
