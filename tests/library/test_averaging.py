"""ema_nesterov, tail_ema, eval_params and snoo(sync="end") against float64 references
written from modded-nanogpt Track 3's code: class `EMA_Nesterov` (#40/#46: nesterov_step,
lookahead_step, step, accum_lookahead), the `_tailema` blocks of #46's training loop, and
#13's `NesterovOuterOptimizer.maybe_outer_step/_outer_step`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo import ema_nesterov, eval_params, snoo, tail_ema

SHAPES = {"embed": (5, 3), "w": (4, 6), "b": (6,)}
CURV = {n: 0.5 + np.arange(np.prod(s)).reshape(s) / np.prod(s) for n, s in SHAPES.items()}


def init_params():
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    return {n: jax.random.normal(k, s, jnp.float32)
            for (n, s), k in zip(SHAPES.items(), keys, strict=True)}


def noise(t):
    keys = jax.random.split(jax.random.key(500 + t), len(SHAPES))
    return {n: 0.3 * np.asarray(jax.random.normal(k, s), np.float64)
            for (n, s), k in zip(SHAPES.items(), keys, strict=True)}


def grad_at(point, t):
    """Gradient of a quadratic plus noise at `point`: it depends on where it is taken."""
    nz = noise(t)
    return {n: CURV[n] * np.asarray(point[n], np.float64) + nz[n] for n in SHAPES}


def as_f32(tree):
    return {n: jnp.asarray(x, jnp.float32) for n, x in tree.items()}


def close(ours, ref, msg, rtol=2e-5, atol=2e-6):
    for n in SHAPES:
        np.testing.assert_allclose(np.asarray(ours[n], np.float64), ref[n], rtol=rtol,
                                   atol=atol, err_msg=f"{msg} {n}")


def lr(t):
    return 0.1 if t < 8 else 0.1 * (1.0 - (t - 8) / 10.0)


# ---- EMA-Nesterov ---------------------------------------------------------------------

BETA0, GAMMA, PREFILL, STOP, MOM, T = 0.6, 0.7, 3, 9, 0.5, 14


def record_lr_ratio(t):
    # The record's lookahead reads the lr set on the previous step (set_hparams runs after
    # nesterov_step), 1 before the first.
    return lr(max(t - 1, 0)) / lr(0)


def record_ema_nesterov(p, grad, steps):
    """#40's `EMA_Nesterov` around SGD with momentum, in float64 on one set of weights `p`
    (a dict) with `grad(point, step)`: the point each gradient is taken at, and the weights
    validation sees after each step."""
    prev = {n: x.copy() for n, x in p.items()}
    buf = {n: np.zeros_like(x) for n, x in p.items()}
    mom = {n: np.zeros_like(x) for n, x in p.items()}
    points, evals = [], []
    for it in range(steps):
        # nesterov_step: lookahead while prefill <= it < rest (it + 1 > prefill).
        if it + 1 > PREFILL and it < STOP:
            p = {n: p[n] + BETA0 * record_lr_ratio(it) * buf[n] for n in p}
        points.append(p)
        g = grad(p, it)
        # step: the inner optimizer steps from the lookahead point, then accum_lookahead.
        mom = {n: g[n] + MOM * mom[n] for n in p}
        p = {n: p[n] - lr(it) * mom[n] for n in p}
        buf = {n: GAMMA * buf[n] + (1 - GAMMA) * (p[n] - prev[n]) for n in p}
        prev = {n: p[n].copy() for n in p}
        evals.append(p)  # validation at the top of the next iteration: no lookahead yet
    return points, evals


def lr_sched(t):
    return jnp.where(t < 8, 0.1, 0.1 * (1.0 - (t - 8) / 10.0))


def ours_ema_nesterov():
    ratio = lambda t: lr_sched(jnp.maximum(t - 1, 0)) / 0.1
    return ema_nesterov(optax.sgd(lr_sched, momentum=MOM), beta0=BETA0, gamma=GAMMA,
                        prefill=PREFILL, stop=STOP, lr_ratio=ratio)


def test_ema_nesterov_matches_record():
    tx = ours_ema_nesterov()
    params = init_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    readout = jax.jit(eval_params)
    points, evals = record_ema_nesterov({n: np.asarray(x, np.float64) for n, x in params.items()},
                                        grad_at, T)
    for it in range(T):
        close(params, points[it], f"gradient point at step {it}")
        updates, state = update(as_f32(grad_at(params, it)), state, params)
        params = optax.apply_updates(params, updates)
        close(readout(params, state), evals[it], f"eval weights after step {it}")
        active_next = PREFILL <= it + 1 < STOP
        assert (float(state.lookahead) != 0.0) == active_next, (it, float(state.lookahead))
        if not active_next:  # outside the window the params are the weights to evaluate
            np.testing.assert_array_equal(np.asarray(readout(params, state)["w"]),
                                          np.asarray(params["w"]))


# ---- tail-EMA -------------------------------------------------------------------------

START, END, TAU, LAM = 4, 9, 3.0, 0.6


def test_tail_ema_matches_record():
    mask = {"embed": False, "w": True, "b": True}
    tx = optax.chain(optax.sgd(0.05), tail_ema(START, TAU, LAM, END, mask=mask))
    params = init_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    readout = jax.jit(eval_params)
    ema = None
    for step in range(12):
        updates, state = update(as_f32(grad_at(params, step)), state, params)
        params = optax.apply_updates(params, updates)
        w = {n: np.asarray(x, np.float64) for n, x in params.items()}
        # #46: after the step, while START <= step + 1 < END (lazy init, then ema += (w-ema)/TAU).
        if START <= step + 1 < END:
            if ema is None:
                ema = {n: w[n].copy() for n in w if n != "embed"}
            else:
                ema = {n: ema[n] + (w[n] - ema[n]) / TAU for n in ema}
        # Evaluation: (1 - λ) w + λ ema on every param but the embedding, once ema exists.
        ref = {n: (1 - LAM) * w[n] + LAM * ema[n] if ema is not None and n in ema else w[n]
               for n in w}
        close(readout(params, state), ref, f"readout after step {step}")
    assert ema is not None


# ---- snoo(sync="end") = MuLoCo --------------------------------------------------------

def test_snoo_sync_end_matches_muloco():
    k, outer_lr, outer_mom, inner_lr = 3, 0.7, 0.5, 0.05
    tx = snoo(optax.sgd(inner_lr), outer_lr, outer_mom, k, sync="end")
    params = init_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    hinted = jax.jit(tx.update, static_argnames="snoo_sync")
    h_params, h_state = params, tx.init(params)
    # NesterovOuterOptimizer: snapshot, buffer u, inner_step_count.
    p = {n: np.asarray(x, np.float64) for n, x in params.items()}
    snap = {n: x.copy() for n, x in p.items()}
    u = {n: np.zeros_like(x) for n, x in p.items()}
    inner_count = 0
    syncs = []
    for t in range(4 * k):
        g = grad_at(p, t)
        p = {n: p[n] - inner_lr * g[n] for n in p}
        inner_count += 1  # maybe_outer_step
        synced = inner_count >= k
        if synced:
            for n in p:
                delta = snap[n] - p[n]
                u[n] = outer_mom * u[n] + outer_lr * delta
                p[n] = snap[n] - outer_mom * u[n] - outer_lr * delta
            snap = {n: x.copy() for n, x in p.items()}
            inner_count = 0
        syncs.append(synced)
        assert optax_snoo.snoo_is_sync_step(t, k, "end") == synced
        updates, state = update(as_f32(grad_at(params, t)), state, params)
        params = optax.apply_updates(params, updates)
        close(params, p, f"step {t}")
        updates, h_state = hinted(as_f32(grad_at(h_params, t)), h_state, h_params,
                                  snoo_sync=optax_snoo.snoo_is_sync_step(t, k, "end"))
        h_params = optax.apply_updates(h_params, updates)
        # The hinted program and the traced one, against this loop's float64 reference.
        m.assert_runs_agree(h_params, params, p)
    assert syncs == [False, False, True] * 4  # the last update is a sync
    with pytest.raises(ValueError, match="sync"):
        snoo(optax.sgd(0.1), sync="middle")


def test_snoo_sync_end_outer_schedule_counts_syncs_before():
    """The outer schedules see the number of earlier syncs, 0 at the first one."""
    seen = []

    def eta(c):
        jax.debug.callback(lambda c: seen.append(int(c)), c)
        return 0.5

    tx = snoo(optax.sgd(0.1), eta, 0.0, 2, sync="end")
    params, state = {"w": jnp.ones(2)}, None
    state = tx.init(params)
    for t in range(6):
        updates, state = tx.update({"w": jnp.ones(2)}, state, params,
                                   snoo_sync=optax_snoo.snoo_is_sync_step(t, 2, "end"))
        params = optax.apply_updates(params, updates)
    # Read on every update, used on the syncs (updates 1, 3, 5); never negative.
    assert seen[1::2] == [0, 1, 2] and min(seen) == 0, seen


# ---- eval_params anywhere in a state --------------------------------------------------

def test_eval_params_finds_nested_readouts():
    """ema_nesterov(chain(adam, tail_ema)) in a partition group, under MultiSteps and
    inject_hyperparams: eval_params applies the lookahead removal, then the blend, on that
    group only."""
    inner = optax.chain(optax.adam(0.05), tail_ema(2, 2.0, 0.5))
    group = optax.inject_hyperparams(ema_nesterov, static_args=("prefill", "stop"))(
        inner=inner, beta0=0.5, gamma=0.8, prefill=1, stop=100)
    labels = {"embed": "sgd", "w": "ours", "b": "ours"}
    tx = optax.MultiSteps(optax.partition({"ours": group, "sgd": optax.sgd(0.1)}, labels), 2)
    params = init_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(8):
        updates, state = update(as_f32(grad_at(params, t)), state, params)
        params = optax.apply_updates(params, updates)
    ens = state.inner_opt_state.inner_states["ours"].inner_state.inner_state
    tail = ens.inner_state[1]
    assert int(ens.count) == 4 and float(ens.lookahead) > 0 and float(tail.blend) == 0.5
    w = {n: np.asarray(params[n], np.float64) for n in ("w", "b")}
    ref = {n: w[n] - 0.5 * np.asarray(ens.displacement[n], np.float64) for n in w}
    ref = {n: 0.5 * ref[n] + 0.5 * np.asarray(tail.ema[n], np.float64) for n in ref}
    ev = jax.jit(eval_params)(params, state)
    for n in ("w", "b"):
        np.testing.assert_allclose(np.asarray(ev[n], np.float64), ref[n], rtol=1e-6,
                                   atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ev["embed"]), np.asarray(params["embed"]))
    no_readout = eval_params(params, optax.adam(0.1).init(params))
    m.assert_trees_equal(no_readout, params)


# ---- eval_params over replicas: each replica's own readout -----------------------------

REPLICAS = 3


def replica_grad(r):
    """Replica r's gradient: its own noise scale and offset, so the replicas' weights, EMAs
    and lookahead buffers all differ."""
    return lambda point, t: {n: g + r * noise(t)[n] - 0.3 * r
                             for n, g in grad_at(point, t).items()}


def replica_params():
    return [{n: (1.0 + 0.5 * r) * np.asarray(x, np.float64) for n, x in init_params().items()}
            for r in range(REPLICAS)]


def stacked(trees):
    return {n: jnp.asarray(np.stack([t[n] for t in trees]), jnp.float32) for n in SHAPES}


def replica(tree, r):
    return {n: tree[n][r] for n in SHAPES}


def test_eval_params_over_replicas_tail_ema():
    """After the EMA has moved away from the weights, each replica evaluates its own blend
    (1 - λ)·w_r + λ·ema_r: not the weights, not replica 0's EMA."""
    mask = {"embed": False, "w": True, "b": True}
    tx = optax_snoo.over_replicas(optax.chain(optax.sgd(0.05),
                                              tail_ema(START, TAU, LAM, END, mask=mask)))
    ref = replica_params()
    params = stacked(ref)
    state = tx.init(params)
    update = jax.jit(tx.update)
    readout = jax.jit(eval_params)
    grads = [replica_grad(r) for r in range(REPLICAS)]
    emas = [None] * REPLICAS
    for step in range(END + 2):
        g = stacked([grads[r](replica(params, r), step) for r in range(REPLICAS)])
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        ev = readout(params, state)
        for r in range(REPLICAS):
            ref[r] = {n: ref[r][n] - 0.05 * x for n, x in grads[r](ref[r], step).items()}
            if START <= step + 1 < END:  # #46's lazy init, then ema += (w - ema)/TAU
                emas[r] = ({n: ref[r][n].copy() for n in ("w", "b")} if emas[r] is None else
                           {n: e + (ref[r][n] - e) / TAU for n, e in emas[r].items()})
            blend = {n: (1 - LAM) * ref[r][n] + LAM * emas[r][n] if emas[r] is not None and
                     n in emas[r] else ref[r][n] for n in SHAPES}
            close(replica(ev, r), blend, f"replica {r} readout after step {step}")
    # The check can fail: the blend is far (>> the tolerance) from the weights, and from
    # what replica 0's EMA would give on the other replicas.
    for r in range(1, REPLICAS):
        w, e = ref[r]["w"], emas[r]["w"]
        assert np.max(np.abs(LAM * (e - w))) > 1e-2
        assert np.max(np.abs(LAM * (e - emas[0]["w"]))) > 1e-2


def test_eval_params_over_replicas_ema_nesterov():
    """Each replica's lookahead removed with its own displacement buffer (#40 per replica)."""
    tx = optax_snoo.over_replicas(ours_ema_nesterov())
    start = replica_params()
    params = stacked(start)
    state = tx.init(params)
    update = jax.jit(tx.update)
    readout = jax.jit(eval_params)
    grads = [replica_grad(r) for r in range(REPLICAS)]
    records = [record_ema_nesterov(start[r], grads[r], T) for r in range(REPLICAS)]
    for it in range(T):
        for r, (points, _) in enumerate(records):
            close(replica(params, r), points[it], f"replica {r} gradient point at step {it}")
        g = stacked([grads[r](replica(params, r), it) for r in range(REPLICAS)])
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        ev = readout(params, state)
        for r, (_, evals) in enumerate(records):
            close(replica(ev, r), evals[it], f"replica {r} eval weights after step {it}")
    # The check can fail: inside the window the lookahead moved the weights away from
    # what is evaluated, differently on each replica.
    points = [p for p, _ in records]
    gap = lambda r: points[r][STOP - 1]["w"] - records[r][1][STOP - 2]["w"]
    assert all(np.max(np.abs(gap(r))) > 1e-2 for r in range(REPLICAS))
    assert all(np.max(np.abs(gap(r) - gap(0))) > 1e-2 for r in range(1, REPLICAS))


def test_bad_input():
    with pytest.raises(ValueError, match="inner"):
        ema_nesterov(optax.sgd)
    with pytest.raises(ValueError, match="gamma"):
        ema_nesterov(optax.sgd(0.1), gamma=1.0)
    with pytest.raises(ValueError, match="prefill"):
        ema_nesterov(optax.sgd(0.1), prefill=-1)
    with pytest.raises(ValueError, match="start"):
        tail_ema(0)
    with pytest.raises(ValueError, match="end"):
        tail_ema(5, end=5)
    with pytest.raises(ValueError, match="horizon"):
        tail_ema(5, horizon=0.5)
    with pytest.raises(ValueError, match="blend"):
        tail_ema(5, blend=1.5)
    with pytest.raises(ValueError, match="needs params"):
        tx = tail_ema(1)
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


MATRIX_PARAMS = {"a": jnp.ones((8, 4)), "b": jnp.linspace(-1.0, 1.0, 6)}


@pytest.mark.parametrize("which", ["ema_nesterov", "tail_ema"])
def test_optax_matrix(which, tmp_path):
    if which == "ema_nesterov":
        tx = ema_nesterov(optax.adam(1e-2), prefill=1, stop=5, gamma=0.9,
                          lr_ratio=optax.linear_schedule(1.0, 0.5, 6))
    else:
        tx = optax.chain(optax.adam(1e-2), tail_ema(2, 2.0, 0.6))
    f64 = dict(float64=tx, float32_state=True)  # (its buffers stay float32: issue 34.3)
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=4, **f64)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=3)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=3)
    m.check_multisteps(tx, MATRIX_PARAMS, steps=2, **f64)
    m.check_partition(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_nnx_optimizer(tx, steps=5)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, MATRIX_PARAMS, tmp_path, steps_before=3, steps_after=3)
    if which == "tail_ema":
        m.check_inject_hyperparams(lambda horizon, blend: tail_ema(2, horizon, blend),
                                   MATRIX_PARAMS, dict(horizon=2.0, blend=0.6), steps=4,
                                   float64=True, float32_state=True)
    else:
        m.check_inject_hyperparams(
            lambda beta0, gamma: ema_nesterov(optax.sgd(0.1), beta0, gamma, 1, 5),
            MATRIX_PARAMS, dict(beta0=0.3, gamma=0.9), steps=4, float64=True,
            float32_state=True)


def test_properties():
    params = init_params()
    grads = as_f32(grad_at(params, 0))
    inner = optax.adam(0.1)
    ref, _ = inner.update(grads, inner.init(params), params)
    # beta0 = 0: exactly the inner optimizer, and the params are the weights to evaluate.
    tx = ema_nesterov(inner, beta0=0.0, prefill=0)
    first, state = tx.update(grads, tx.init(params), params)
    m.assert_trees_equal(first, ref)
    moved = optax.apply_updates(params, first)
    _, state = tx.update(grads, state, moved)
    m.assert_trees_equal(eval_params(moved, state), moved)
    # tail_ema never changes the update, and blend = 0 evaluates the params.
    tx = tail_ema(1, 2.0, 0.0)
    state = tx.init(params)
    out, state = tx.update(ref, state, params)
    m.assert_trees_equal(out, ref)
    m.assert_trees_equal(eval_params(params, state), params)
