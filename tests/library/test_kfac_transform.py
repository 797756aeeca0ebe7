"""`scale_by_kfac` step by step against a float64 numpy K-FAC (Martens & Grosse 2015), plus the
refresh mechanics: eigh only inside `lax.cond`, executed only on refresh steps; plans from
`refresh_steps` equal the transform's refreshes; events; warm start; bad trees."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from library.support import LAYERS, TEMPLATE, curvature_at, grads_at, make_params, spd
from optax_snoo._src.kfac import distributed as kfac_distributed
from optax_snoo._src.utils import path_to_str
from optax_snoo.kfac import (
    LayerCurvature,
    ScaleByKfacState,
    by_lr_phase,
    every,
    kfac,
    lr_ratio,
    refresh_events,
    refresh_steps,
    scale_by_kfac,
    warm_start,
)
from references.error import program_text
from references.kfac import ReferenceKfac

STEPS = 120


# The refresh decomposes the factors grouped by size: 5, 6 (l1), 6, 3 (l2), 4, 4 (experts).
FACTOR_SIZES = {5, 6, 3, 4}


def _assert_tree_close(actual, expected, rtol, what):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                            jax.tree.leaves(expected), strict=True):
        y = np.asarray(y, np.float64)
        np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol,
                                   atol=rtol * np.max(np.abs(y)), err_msg=f"{what} {path}")


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, STEPS, end_value=0.05)


def _oracle_every(interval, first):
    return lambda t, lr, last, last_lr: t >= first and (t - first) % interval == 0


def _oracle_ratio(tau, max_interval, min_interval):
    def fire(t, lr, last, last_lr):
        if last < 0:
            return True
        since = t - last
        return since >= min_interval and (abs(lr - last_lr) > tau * abs(last_lr)
                                          or since >= max_interval)
    return fire


CASES = {
    "pi-every": dict(mode="pi", policy=every(7, first=3), oracle=_oracle_every(7, 3),
                     lr_arg=False),
    "pi-lr_ratio-schedule": dict(mode="pi", policy=lr_ratio(0.2, max_interval=15, min_interval=2),
                                 oracle=_oracle_ratio(0.2, 15, 2), lr_arg=False),
    "eigen-lr_ratio-extra-arg": dict(mode="eigen",
                                     policy=lr_ratio(0.2, max_interval=15, min_interval=2),
                                     oracle=_oracle_ratio(0.2, 15, 2), lr_arg=True),
    # statistics on every 3rd step (EMA decay rho^3), refreshes on others too
    "pi-every-stats_every3": dict(mode="pi", policy=every(7, first=3),
                                  oracle=_oracle_every(7, 3), lr_arg=False, stats_every=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_over_many_steps(case):
    cfg = CASES[case]
    rho, lam = 0.9, 0.03
    tx = scale_by_kfac(damping=lam, ema_decay=rho, refresh=cfg["policy"],
                       learning_rate=None if cfg["lr_arg"] else SCHEDULE, mode=cfg["mode"],
                       layers=TEMPLATE, stats_every=cfg.get("stats_every", 1))
    ref = ReferenceKfac(LAYERS, rho, lam, cfg["mode"], cfg["oracle"],
                        cfg.get("stats_every", 1))
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for t in range(STEPS):
        lr = float(np.float32(SCHEDULE(t)))
        grads, curvature = grads_at(t, params), curvature_at(t)
        extra = {"learning_rate": lr} if cfg["lr_arg"] else {}
        updates, state = update(grads, state, params, curvature=curvature, **extra)
        want = ref.update(t, grads, curvature, lr)
        _assert_tree_close(updates, want, 2e-5, f"{case} step {t}")
        seen.append(int(state.event.step))
    assert ref.refreshes, "the reference never refreshed"
    assert sorted(set(s for s in seen if s >= 0)) == ref.refreshes
    assert int(state.event.count) == len(ref.refreshes)
    # The plan printed by refresh_steps is where the transform refreshed.
    assert refresh_steps(cfg["policy"], SCHEDULE, STEPS).tolist() == ref.refreshes
    # The event log of the latest refresh: step, lr and the factor spectra at that step.
    event = refresh_events(state)[0]
    assert event["step"] == ref.refreshes[-1]
    assert event["lr"] == pytest.approx(float(np.float32(SCHEDULE(ref.refreshes[-1]))))
    eig = {k: [np.linalg.eigvalsh(f[i]) for f in ref.snapshot.values()]
           for k, i in (("a", 0), ("g", 1))}
    for k in ("a", "g"):
        assert event[f"{k}_eig_max"] == pytest.approx(max(e.max() for e in eig[k]), rel=1e-4)
        assert event[f"{k}_eig_min"] == pytest.approx(min(e.min() for e in eig[k]), rel=1e-3)
    assert event["num_clipped"] == 0 and event["refresh"] == len(ref.refreshes)


# ------------------------------------------------------------------- refresh mechanics
def _walk_eigh(jaxpr, in_cond=False):
    """(number of eigh equations, number of them inside a cond branch)."""
    total = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "eigh":
            total += 1
            inside += int(in_cond)
        for value in eqn.params.values():
            subs = value if isinstance(value, (tuple, list)) else (value,)
            for sub in subs:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    t, i = _walk_eigh(sub, in_cond or eqn.primitive.name == "cond")
                    total, inside = total + t, inside + i
    return total, inside


@pytest.mark.parametrize("mode", ["pi", "eigen"])
def test_eigh_only_inside_cond(mode):
    tx = scale_by_kfac(refresh=every(3), mode=mode, layers=TEMPLATE)
    params = make_params()
    jaxpr = jax.make_jaxpr(lambda g, s, c: tx.update(g, s, params, curvature=c))(
        grads_at(0, params), tx.init(params), curvature_at(0))
    total, inside = _walk_eigh(jaxpr.jaxpr)
    assert total == len(FACTOR_SIZES), total      # one per factor size (a stacked group)
    assert inside == total


def _eigh_operand_ranks(jaxpr):
    ranks = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "eigh":
            ranks.append(eqn.invars[0].aval.ndim)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    ranks += _eigh_operand_ranks(sub)
    return ranks


def test_stacked_factors_use_unbatched_eigh_on_cpu():
    """Regression: on jax 0.10 XLA:CPU, one refresh with 6 dense layers and 2 expert stacks
    (batched eigh) deadlocked on 2 cores; stacks now go through lax.map, one matrix each."""
    assert jax.default_backend() == "cpu"
    tx = scale_by_kfac(refresh=every(3), layers=TEMPLATE)
    params = make_params()
    jaxpr = jax.make_jaxpr(lambda g, s, c: tx.update(g, s, params, curvature=c))(
        grads_at(0, params), tx.init(params), curvature_at(0))
    assert _eigh_operand_ranks(jaxpr.jaxpr) == [2] * len(FACTOR_SIZES)


def test_refresh_branch_runs_only_on_refresh_steps(monkeypatch):
    """Count real executions of the refresh computation with a host callback."""
    calls = []
    original = kfac_distributed.refresh_group

    def counting(*args, **kwargs):
        jax.debug.callback(lambda: calls.append(1))
        return original(*args, **kwargs)

    monkeypatch.setattr(kfac_distributed, "refresh_group", counting)
    tx = scale_by_kfac(refresh=every(4, first=1), layers=TEMPLATE)
    params = make_params()
    state, update = tx.init(params), jax.jit(tx.update)
    for t in range(11):
        _, state = update(grads_at(t, params), state, params, curvature=curvature_at(t))
    jax.effects_barrier()
    assert len(calls) == 3 * len(FACTOR_SIZES)     # steps 1, 5, 9
    assert int(state.event.count) == 3 and int(state.event.step) == 9


SMALL = {"d": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}, "s": jnp.ones(2)}


def small_curvature(t):
    rng = np.random.default_rng(30_000 + t)
    return {"d": {"kernel": LayerCurvature(spd(rng, (), 4), spd(rng, (), 2))}}


def test_identity_before_first_refresh_and_without_statistics():
    tx = scale_by_kfac(refresh=every(5, first=0))
    state = tx.init(SMALL)
    update = jax.jit(tx.update)
    # No statistics yet (curvature=None): no refresh even at step 0, and identity.
    for t in range(2):
        grads = grads_at(t, SMALL)
        updates, state = update(grads, state, SMALL, curvature=None)
        _assert_tree_close(updates, grads, 0, "identity")
    assert int(state.event.count) == 0 and float(state.factor_weight) == 0.0
    # Statistics from step 2 on: identity until every(5, first=0) fires at step 5.
    for t in range(2, 6):
        grads = grads_at(t, SMALL)
        updates, state = update(grads, state, SMALL, curvature=small_curvature(t))
        if t < 5:
            _assert_tree_close(updates, grads, 0, "identity")
    assert int(state.event.count) == 1 and int(state.event.step) == 5
    assert not np.allclose(np.asarray(updates["d"]["kernel"]), grads["d"]["kernel"])


def test_update_without_curvature_raises():
    """A forgotten curvature= is an error (not a silent first-order step), for the
    transform, the alias, and through optax.partition; curvature=None is the explicit skip."""
    tx = scale_by_kfac(refresh=every(1, first=0))
    with pytest.raises(ValueError, match="curvature="):
        tx.update(SMALL, tx.init(SMALL), SMALL)
    alias = kfac(0.1)
    with pytest.raises(ValueError, match="curvature="):
        alias.update(SMALL, alias.init(SMALL), SMALL)
    part = optax.partition({"k": alias, "o": optax.sgd(0.1)}, {"d": "k", "s": "o"})
    with pytest.raises(ValueError, match="curvature="):
        part.update(SMALL, part.init(SMALL), SMALL)
    _, state = jax.jit(tx.update)(SMALL, tx.init(SMALL), SMALL, curvature=None)
    assert int(state.count) == 1 and float(state.factor_weight) == 0.0


def test_warm_start_seeds_the_factors():
    rho = 0.95
    params = SMALL
    tx = scale_by_kfac(ema_decay=rho, refresh=every(50, first=0))
    batches = [small_curvature(100 + i) for i in range(3)]
    nested = {"inner": (optax.EmptyState(), tx.init(params))}
    seeded = warm_start(nested, batches)
    state = seeded["inner"][1]
    assert float(state.factor_weight) == 3.0
    assert int(state.count) == 0 and int(state.event.count) == 0
    c0 = small_curvature(0)
    _, state = jax.jit(tx.update)(grads_at(0, params), state, params, curvature=c0)
    assert int(state.event.count) == 1 and int(state.event.step) == 0
    frac = 1.0 / (rho * 3.0 + 1.0)
    for name in c0:
        for i in range(2):
            mean = np.mean([np.asarray(b[name]["kernel"][i], np.float64) for b in batches], 0)
            want = (1 - frac) * mean + frac * np.asarray(c0[name]["kernel"][i], np.float64)
            np.testing.assert_allclose(np.asarray(state.factors[name]["kernel"][i]), want,
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no entry"):
        warm_start(nested, [{"other": c0["d"]}])
    with pytest.raises(ValueError, match="no ScaleByKfacState"):
        warm_start(optax.EmptyState(), batches)


def test_by_lr_phase_plan_equals_transform():
    sched = optax.warmup_cosine_decay_schedule(0.0, 1.0, 8, 60, end_value=0.0)
    policy = by_lr_phase(1.0, warmup_steps=8, intervals={"peak": 3, "decay": 6, "tail": 9},
                         peak_tol=0.1, tail_fraction=0.2)
    params = {"d": {"kernel": jnp.ones((2, 2))}}
    curvature = {"d": {"kernel": LayerCurvature(jnp.eye(2), jnp.eye(2))}}
    tx = scale_by_kfac(refresh=policy, learning_rate=sched)
    state, update = tx.init(params), jax.jit(tx.update)
    steps = []
    for _ in range(60):
        before = int(state.event.count)
        _, state = update(params, state, params, curvature=curvature)
        if int(state.event.count) > before:
            steps.append(int(state.event.step))
    assert steps == refresh_steps(policy, sched, 60).tolist()
    assert steps[0] == 8


# ------------------------------------------------------------------ trees and errors
def test_default_layers_dense_kernels_with_bias_siblings():
    params = {"mlp": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
              "head": {"kernel": jnp.ones((4, 2))},
              "odd": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(3)},
              "stack": {"kernel": jnp.ones((2, 3, 4))}, "norm": {"scale": jnp.ones(4)}}
    state = scale_by_kfac().init(params)
    shapes = jax.tree.map(lambda x: x.shape, state.factors)
    assert shapes == {"mlp": {"kernel": LayerCurvature((4, 4), (4, 4))},
                      "head": {"kernel": LayerCurvature((4, 4), (2, 2))},
                      "odd": {"kernel": LayerCurvature((3, 3), (4, 4))}}


def test_multi_axis_kernel_and_nnx_state_paths():
    """A (d_model, heads, head_dim) kernel with d_out = heads·head_dim, in an nnx State."""
    from flax import nnx

    params = nnx.State({"qkv": {"kernel": nnx.Param(jnp.ones((4, 2, 3))),
                                "bias": nnx.Param(jnp.zeros((2, 3)))}})
    template = {"qkv": {"kernel": LayerCurvature(jnp.eye(5), jnp.eye(6))}}
    tx = scale_by_kfac(refresh=every(1, first=0), layers=template, damping=0.0)
    state = tx.init(params)
    a = jnp.diag(jnp.arange(1.0, 6.0))
    curvature = {"qkv": {"kernel": LayerCurvature(a, 2 * jnp.eye(6))}}
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = jax.jit(tx.update)(grads, state, params, curvature=curvature)
    kernel = np.asarray(updates["qkv"]["kernel"][...])
    bias = np.asarray(updates["qkv"]["bias"][...])
    assert kernel.shape == (4, 2, 3) and bias.shape == (2, 3)
    np.testing.assert_allclose(kernel[:, 0, 0], 1 / (2 * np.arange(1.0, 5.0)), rtol=1e-5)
    np.testing.assert_allclose(bias, np.full((2, 3), 1 / 10), rtol=1e-5)


def test_flat_path_string_keys():
    """A flat dict keyed by "a/b/kernel" strings (as a capture helper returns) is the same
    curvature as the nested tree."""
    nested = small_curvature(0)
    flat = {"d/kernel": nested["d"]["kernel"]}
    tx = scale_by_kfac(refresh=every(1, first=0), layers=flat)
    state, update = tx.init(SMALL), jax.jit(tx.update)
    lowered = [update.lower(grads_at(0, SMALL), state, SMALL, curvature=c)
               for c in (flat, nested)]
    # The keys are read before tracing: one program (constants included), so bitwise the
    # same update.
    assert program_text(lowered[0]) == program_text(lowered[1])
    programs = [low.compile() for low in lowered]
    u_flat, s_flat = programs[0](grads_at(0, SMALL), state, SMALL, curvature=flat)
    u_nested, _ = programs[1](grads_at(0, SMALL), state, SMALL, curvature=nested)
    _assert_tree_close(u_flat, u_nested, 0, "flat keys")
    assert int(s_flat.event.count) == 1


def test_bad_curvature_and_layers_raise():
    params = make_params()
    tx = scale_by_kfac(layers=TEMPLATE)
    state = tx.init(params)
    grads = grads_at(0, params)
    good = curvature_at(0)
    missing = {k: v for k, v in good.items() if k != "l2"}
    with pytest.raises(ValueError, match="no LayerCurvature for the K-FAC layer l2/kernel"):
        tx.update(grads, state, params, curvature=missing)
    with pytest.raises(ValueError, match="nope/kernel: no such parameter"):
        tx.update(grads, state, params, curvature={**good, "nope": good["l1"]})
    with pytest.raises(ValueError, match="does not precondition"):
        tx.update(grads, state, params,
                  curvature={**good, "scale": LayerCurvature(jnp.eye(3), jnp.eye(3))})
    bad_shape = {**good, "l2": {"kernel": LayerCurvature(jnp.eye(5), jnp.eye(3))}}
    with pytest.raises(ValueError, match="expected"):
        tx.update(grads, state, params, curvature=bad_shape)
    with pytest.raises(ValueError, match="LayerCurvature"):
        tx.update(grads, state, params, curvature={"l1": {"kernel": jnp.eye(5)}})
    with pytest.raises(ValueError, match="does not fit"):
        scale_by_kfac(layers={"l2": {"kernel": LayerCurvature(jnp.eye(4), jnp.eye(3))}}).init(
            params)
    with pytest.raises(ValueError, match="no sibling leaf l2/bias"):
        scale_by_kfac(layers={"l2": {"kernel": LayerCurvature(jnp.eye(7), jnp.eye(3))}}).init(
            params)
    with pytest.raises(ValueError, match="cannot be split"):
        scale_by_kfac(layers={"x": {"kernel": LayerCurvature(jnp.eye(2), jnp.eye(6))}}).init(
            {"x": {"kernel": jnp.ones((3, 4))}})
    with pytest.raises(ValueError, match="reads the learning rate"):
        scale_by_kfac(refresh=lr_ratio(0.1), layers=TEMPLATE).update(
            grads, state, params, curvature=good)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="exact"), "mode"), (dict(ema_decay=1.0), "ema_decay"),
    (dict(stats_every=0), "stats_every"), (dict(stats_axes="data"), "stats_axes"),
    (dict(damping=-1.0), "damping"), (dict(eig_floor_rel=-1.0), "eig_floor_rel"),
    (dict(refresh="often"), "refresh"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_by_kfac(**kwargs)


def test_long_signatures_are_keyword_only_and_the_old_mask_name_says_renamed():
    with pytest.raises(TypeError, match="positional"):
        scale_by_kfac(1e-3, 0.95)
    with pytest.raises(TypeError, match="positional"):
        kfac(0.1, 1e-3, 0.9)
    with pytest.raises(ValueError, match="weight_decay_mask was renamed mask"):
        kfac(0.1, weight_decay_mask=lambda p: p)


def test_mask_selects_the_decayed_leaves():
    params = make_params()
    mask = jax.tree.map(lambda _: False, params)
    mask["l1"]["kernel"] = True
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = kfac(0.5, momentum=None, weight_decay=0.1, mask=mask, layers=TEMPLATE)
    updates, _ = jax.jit(functools.partial(tx.update, curvature=None))(
        zero, tx.init(params), params)
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        p = params
        for k in path:
            p = p[k.key]
        expected = -0.5 * 0.1 * np.asarray(p) if path_to_str(path) == "l1/kernel" else 0.0
        np.testing.assert_allclose(np.asarray(u), expected, rtol=1e-6, atol=0)


def test_state_is_a_namedtuple_with_count():
    state = scale_by_kfac(layers=TEMPLATE).init(make_params())
    assert isinstance(state, ScaleByKfacState) and int(state.count) == 0
    assert int(state.event.step) == -1


def test_layers_from_params_and_callable_layers():
    from optax_snoo.kfac import layers_from_params

    params = make_params()
    template = layers_from_params(params, ["l1/kernel", "l2/kernel", "experts/kernel"])
    for path, c in template.items():          # bias coordinates and expert stacks
        expected = TEMPLATE[path.split("/")[0]]["kernel"]
        assert (c.a.shape, c.g.shape) == (expected.a.shape, expected.g.shape), path
    # A callable is evaluated at init on the params the transform sees.
    tx = scale_by_kfac(layers=lambda p: layers_from_params(p, ["l1/kernel", "experts/kernel"]))
    state = tx.init(params)
    assert sorted(state.factors) == ["experts", "l1"]
    with pytest.raises(ValueError, match="not a params leaf"):
        layers_from_params(params, ["nope"])
    with pytest.raises(ValueError, match="d_in, d_out"):
        layers_from_params(params, ["scale"])
