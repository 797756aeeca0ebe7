"""`rre_extrapolation` against a float64 numpy transcription of modded-nanogpt Track 3 result
#34's code (`references.track3_constants.R34`'s script: `rre_extrapolate` and
`Muon._maybe_extrapolate`, called after each Muon step on the whole Muon group), over a run
with three extrapolations, capped and uncapped; controls (one constant moved, the textbook
RRE point, a momentum reset, per-tensor extrapolation, every leaf extrapolated) must fail the
comparison; its properties and the optax matrix.

#34's base stack (#30: Aurora on mlp.proj, radial brake, Contra-Muon ramp, SOAP on MLP+V) is
not in the library, so the inner optimizer here is a small stand-in (decayed weights, then
SGD with momentum) on a noisy quadratic: what is checked is the extrapolation, its schedule
and that the inner optimizer's momentum is kept across it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import eval_params, rre_extrapolation
from references.error import run_in_float64
from references.track3_constants import R34

T = 40
# Three extrapolations (after updates 25, 30, 35) at #34's every/history, stop at 37.
START, STOP = 22, 37
MAX_REL = 0.4  # binds at some of this run's extrapolations, not all (checked below)
SHAPES = {"embed": (16, 8), "attn_q": (8, 8), "mlp_fc": (24, 8), "mlp_proj": (8, 24)}
HIDDEN = {n: n != "embed" for n in SHAPES}  # #34 extrapolates the Muon group only
LR, WD, MOMENTUM = 0.05, 0.1, 0.9


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.5 * rng.standard_normal(s) for n, s in SHAPES.items()}
    curv = {n: 0.5 + rng.random(s) for n, s in SHAPES.items()}
    noise = [{n: 0.3 * rng.standard_normal(s) for n, s in SHAPES.items()} for _ in range(T)]
    return weights, curv, noise


def grad_at(p, t, curv, noise):
    return {n: curv[n] * p[n] + noise[t][n] for n in SHAPES}


def ours(weights, curv, noise, **kwargs):
    config = dict(start=START, stop=STOP, every=R34.every, history=R34.history,
                  damping=R34.damping, max_relative=MAX_REL,
                  regularization=R34.regularization) | kwargs

    def run(w, curv, noise):
        tx = optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, MOMENTUM),
                         optax.masked(rre_extrapolation(**config), HIDDEN))
        params, state, out = w, tx.init(w), []
        update = jax.jit(tx.update)
        for t in range(T):
            updates, state = update(grad_at(params, t, curv, noise), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return run_in_float64(run, weights, curv, noise)


def rre_extrapolate(iterates, regularization, damping, textbook=False):
    """`rre_extrapolate` (script:660-688) in float64 (``textbook``: a control, Sidi's
    ``Σ c_j x_j`` instead)."""
    k = len(iterates) - 1
    if k < 2:
        return iterates[-1].copy()
    diffs = [iterates[i + 1] - iterates[i] for i in range(k)]
    U = np.stack(diffs)
    G = U @ U.T
    reg = regularization * max(np.trace(G), 0) / k + 1e-10
    G = G + reg * np.eye(k)
    coeffs = np.linalg.solve(G, np.ones(k))
    coeff_sum = coeffs.sum()
    if not np.isfinite(coeff_sum) or abs(coeff_sum) < 1e-12:
        return iterates[-1].copy()
    coeffs = coeffs / coeff_sum
    if textbook:
        extrapolated = sum(c * x for c, x in zip(coeffs, iterates[:-1], strict=True))
    else:
        gamma = np.flip(np.cumsum(np.flip(coeffs, 0)), 0)
        extrapolated = iterates[-1] - (gamma @ U)
    if damping != 1.0:
        extrapolated = iterates[-1] + damping * (extrapolated - iterates[-1])  # lerp
    if not np.all(np.isfinite(extrapolated)):
        return iterates[-1].copy()
    return extrapolated


@functools.cache
def ours_default():
    """`ours` on `problem()`, computed once for the comparison and every control."""
    return ours(*problem())


class Record34:
    """#34's `_maybe_extrapolate` (script:1113-1186) after each step of the stand-in inner
    optimizer, its step count as `Muon.step_count` (script:1263-1264)."""

    def __init__(self, start=START, stop=STOP, every=R34.every, history=R34.history,
                 damping=R34.damping, max_rel=MAX_REL, regularization=R34.regularization,
                 textbook=False, reset_momentum=R34.reset_momentum, per_tensor=False,
                 hidden=HIDDEN):
        self.start, self.stop, self.every, self.history = start, stop, every, history
        self.damping, self.max_rel, self.regularization = damping, max_rel, regularization
        self.textbook, self.reset_momentum, self.per_tensor = textbook, reset_momentum, per_tensor
        self.names = [n for n in SHAPES if hidden[n]]
        self.rels = []

    def flatten(self, p):
        return np.concatenate([p[n].reshape(-1) for n in self.names])

    def unflatten(self, p, flat):
        offset = 0
        for n in self.names:
            p[n] = flat[offset:offset + p[n].size].reshape(p[n].shape)
            offset += p[n].size

    def extrapolate(self, checkpoints):
        if not self.per_tensor:
            return rre_extrapolate(checkpoints, self.regularization, self.damping,
                                   self.textbook)
        out, offset = [], 0  # a control: "rre_tensor", each matrix alone
        for n in self.names:
            size = int(np.prod(SHAPES[n]))
            out.append(rre_extrapolate([c[offset:offset + size] for c in checkpoints],
                                       self.regularization, self.damping))
            offset += size
        return np.concatenate(out)

    def maybe_extrapolate(self, p, buf, step_count):
        next_step = step_count + 1
        if next_step < self.start:
            return
        if self.stop and next_step > self.stop:  # extrap_after_stop_every = 0
            return
        current = self.flatten(p)
        self.checkpoints.append(current)
        if len(self.checkpoints) > self.history:
            self.checkpoints.pop(0)
        if next_step % self.every != 0 or len(self.checkpoints) < self.history:
            return
        extrapolated = self.extrapolate(self.checkpoints)
        delta = extrapolated - current
        current_norm = max(np.linalg.norm(current), 1e-12)
        extrap_rel = np.linalg.norm(delta) / current_norm
        self.rels.append(extrap_rel)
        if self.max_rel > 0 and extrap_rel > self.max_rel:
            delta = delta * (self.max_rel / max(extrap_rel, 1e-12))
            extrapolated = current + delta
        self.unflatten(p, extrapolated)
        self.checkpoints = [extrapolated.copy()]
        final = self.stop and next_step + self.every > self.stop
        if self.reset_momentum and not final:
            for n in self.names:
                buf[n][...] = 0.0

    def run(self, weights, curv, noise):
        p = {n: w.copy() for n, w in weights.items()}
        buf = {n: np.zeros_like(w) for n, w in p.items()}
        self.checkpoints, out = [], []
        for step_count in range(T):
            g = grad_at(p, step_count, curv, noise)
            for n in p:
                buf[n] = (g[n] + WD * p[n]) + MOMENTUM * buf[n]
                p[n] = p[n] - LR * buf[n]
            self.maybe_extrapolate(p, buf, step_count)
            out.append({n: x.copy() for n, x in p.items()})
        return out


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_rre_extrapolation_matches_result_34_in_float64():
    weights, curv, noise = problem()
    record = Record34()
    assert worst(ours_default(), record.run(weights, curv, noise)) < 1e-10
    # Three moves, the cap binding at some and not at others: both branches are compared.
    assert len(record.rels) == 3
    assert min(record.rels) < MAX_REL < max(record.rels), record.rels


@pytest.mark.parametrize("control", [
    dict(damping=0.85), dict(max_rel=MAX_REL * 1.05), dict(history=5), dict(every=4),
    dict(start=START + 1), dict(stop=34), dict(regularization=1e-2), dict(textbook=True),
    dict(reset_momentum=True), dict(per_tensor=True), dict(hidden={n: True for n in SHAPES})])
def test_a_moved_constant_fails_the_comparison(control):
    weights, curv, noise = problem()
    ref = Record34(**control).run(weights, curv, noise)
    assert worst(ours_default(), ref) > 1e-6


def test_the_records_schedule():
    """#34's settings move the weights after updates 2825, 2830, ..., 2925: 21 moves, the
    last at the claim step (the log's ``extrap_count:21`` at step 2925)."""
    tx = rre_extrapolation(R34.start, R34.stop, R34.every, R34.history, R34.damping,
                           R34.max_rel, R34.regularization)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)._replace(count=jnp.asarray(R34.start - 2, jnp.int32))
    update = jax.jit(tx.update)
    moved = []
    for t in range(R34.start - 1, R34.stop + 10):
        u = {"w": jnp.full(3, (t % 7) * 1e-3 + 1e-3 * t ** 0.5)}
        new, state = update(u, state, params)
        if not np.array_equal(np.asarray(new["w"]), np.asarray(u["w"])):
            moved.append(t)
        params = optax.apply_updates(params, new)
    assert moved == list(range(2825, 2926, 5)), moved


PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": jnp.linspace(-1.0, 1.0, 6)}


def test_properties():
    # Outside its window the update passes bitwise; the params are what is evaluated.
    inner = optax.adam(0.1)
    late, _, _ = m.run(optax.chain(inner, rre_extrapolation(start=50)), PARAMS, 6)
    alone, _, _ = m.run(inner, PARAMS, 6)
    m.assert_trees_equal(late, alone)
    tx = optax.chain(inner, rre_extrapolation(start=1, every=3, history=3, max_relative=0.0))
    moved, state, history = m.run(tx, PARAMS, 3)
    _, _, plain = m.run(inner, PARAMS, 3)
    assert not np.allclose(np.asarray(history[-1]["a"]), np.asarray(plain[-1]["a"]))
    m.assert_trees_equal(eval_params(moved, state), moved)
    # The cap: a move of at most max_relative of the weights' norm (jointly over leaves).
    tx = optax.chain(inner, rre_extrapolation(start=1, every=3, history=3, max_relative=1e-3))
    _, _, capped = m.run(tx, PARAMS, 3)
    _, s2, before = m.run(tx, PARAMS, 2)
    step = m.random_grads(PARAMS, 2)

    post = optax.apply_updates(before[-1], inner.update(step, s2[0], before[-1])[0])
    norm = lambda tree: float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                                          for x in jax.tree.leaves(tree))))
    gap = jax.tree.map(lambda x, y: x - y, capped[-1], post)
    assert norm(gap) == pytest.approx(1e-3 * norm(post), rel=1e-3)
    # Under optax.masked the other leaves are not moved.
    masked = optax.chain(inner, optax.masked(
        rre_extrapolation(start=1, every=3, history=3, max_relative=0.0), {"a": True, "b": False}))
    out, _, _ = m.run(masked, PARAMS, 3)
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(plain[-1]["b"]))


def test_bad_input():
    with pytest.raises(ValueError, match="start"):
        rre_extrapolation(0)
    with pytest.raises(ValueError, match="stop"):
        rre_extrapolation(10, stop=9)
    with pytest.raises(ValueError, match="every"):
        rre_extrapolation(10, every=0)
    with pytest.raises(ValueError, match="history"):
        rre_extrapolation(10, history=2)
    with pytest.raises(ValueError, match="damping"):
        rre_extrapolation(10, damping=0.0)
    with pytest.raises(ValueError, match="max_relative"):
        rre_extrapolation(10, max_relative=-1.0)
    with pytest.raises(ValueError, match="regularization"):
        rre_extrapolation(10, regularization=-1.0)
    tx = rre_extrapolation(1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


def test_optax_matrix(tmp_path):
    tx = optax.chain(optax.adam(1e-2), rre_extrapolation(start=1, every=3, history=3,
                                                         max_relative=0.5))
    f64 = dict(float64=tx)  # the kept weights follow the params' dtype
    m.check_jit_matches_eager(tx, PARAMS, steps=4, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=3, **f64)
    m.check_partition(tx, PARAMS, steps=3, **f64)
    m.check_nnx_optimizer(tx, steps=5)
    m.check_sharded_state(tx, PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=2, steps_after=3)
    m.check_inject_hyperparams(
        lambda damping: optax.chain(optax.sgd(0.1), rre_extrapolation(1, None, 3, 3, damping,
                                                                      0.5)),
        PARAMS, dict(damping=0.875), steps=4, float64=True)


def test_the_kept_weights_are_distinct_buffers_a_trainer_can_donate():
    """Each kept slot is its own array (one tree repeated was one buffer in four places:
    a jitted step donating the state, as the trainer's does, refused to run)."""
    tx = rre_extrapolation(start=1)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)  # eagerly, as the trainer builds its state
    assert len({it["w"].unsafe_buffer_pointer() for it in state.iterates}) == 4
    step = jax.jit(lambda s, p: tx.update(p, s, p), donate_argnums=0)
    step(state, params)
