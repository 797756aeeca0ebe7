"""`pull_to_init` (SODA's anchor correction) against a float64 numpy transcription of
modded-nanogpt Track 3 result #32's code (`references.track3_constants.R32`'s log:
`soda_fade_multiplier`, and `Muon.step`'s ``soda_anchor``, ``lam`` and the mix before
``p.add_(update, alpha=-lr)``), over a run that crosses both ends of the cosine fade; controls
(one constant moved, the mix before the update is computed) must fail the comparison; its
properties and the optax matrix.

#32's base stack (#20: Contra-Muon to Soft-Muon, SOAP on MLP+V, NorMuon-lite, u/w floor) is
not in the library, so the inner optimizer here is a small stand-in whose update reads the
params as #20's u/w floor does (decayed weights, then SGD with momentum): what is checked is
the pull and where it sits relative to the inner update."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import eval_params, pull_to_init
from references.error import run_in_float64
from references.track3_constants import R32

T = 40
# #32's fade at the same fractions of a 40-step run: 2000/3040 and 2750/3040 of 40.
FADE_START = round(R32.fade_start * T / R32.steps)   # 26
FADE_END = round(R32.fade_end * T / R32.steps)       # 36
SHAPES = {"embed": (16, 8), "attn_q": (8, 8), "mlp_fc": (24, 8), "mlp_proj": (8, 24)}
HIDDEN = {n: n != "embed" for n in SHAPES}  # #32 pulls the Muon group only
LR, WD, MOMENTUM = 0.05, 0.1, 0.9


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.5 * rng.standard_normal(s) for n, s in SHAPES.items()}
    curv = {n: 0.5 + rng.random(s) for n, s in SHAPES.items()}
    noise = [{n: 0.3 * rng.standard_normal(s) for n, s in SHAPES.items()} for _ in range(T)]
    return weights, curv, noise


def grad_at(p, t, curv, noise):
    """A quadratic's gradient plus noise: it depends on where it is taken."""
    return {n: curv[n] * p[n] + noise[t][n] for n in SHAPES}


def fade(step, start=FADE_START, end=FADE_END):
    return optax.join_schedules([optax.constant_schedule(1.0),
                                 optax.cosine_decay_schedule(1.0, end - start)], [start])(step)


def ours(weights, curv, noise, strength=None):
    def run(w, curv, noise):
        tx = optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, MOMENTUM),
                         optax.masked(pull_to_init(fade if strength is None else strength),
                                      HIDDEN))
        params, state, out = w, tx.init(w), []
        update = jax.jit(tx.update)
        for t in range(T):
            updates, state = update(grad_at(params, t, curv, noise), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return run_in_float64(run, weights, curv, noise)


@functools.cache
def ours_default():
    """`ours` on `problem()`, computed once for the comparison and every control."""
    return ours(*problem())


class Record32:
    """#32's SODA in float64: `soda_fade_multiplier` (log:69-77) and `Muon.step`
    (log:603-604 anchor, 647-651 lam, the mix, the update), with the stand-in inner."""

    def __init__(self, strength=R32.strength, fade_start=FADE_START, fade_end=FADE_END,
                 shape=R32.fade_shape, offset=R32.offset, mix_first=False, hidden=HIDDEN):
        self.strength, self.start, self.end, self.shape = strength, fade_start, fade_end, shape
        self.offset, self.mix_first, self.hidden = offset, mix_first, hidden

    def soda_fade_multiplier(self, step):
        if step < self.start:
            return 1.0
        if step >= self.end:
            return 0.0
        x = (step - self.start) / (self.end - self.start)
        if self.shape == "linear":
            return 1.0 - x
        return 0.5 * (1.0 + math.cos(math.pi * x))

    def run(self, weights, curv, noise):
        p = {n: w.copy() for n, w in weights.items()}
        anchor = {n: p[n].copy() for n in p if self.hidden[n]}  # state["soda_anchor"]
        buf = {n: np.zeros_like(w) for n, w in p.items()}
        out = []
        for step_count in range(T):
            g = grad_at(p, step_count, curv, noise)
            soda_scale = self.strength * self.soda_fade_multiplier(step_count)
            lam = min(max(soda_scale / (step_count + self.offset), 0.0), 1.0)
            if self.mix_first:  # a control: the update computed from the mixed weights
                p = {n: p[n] * (1 - lam) + lam * anchor[n] if n in anchor else p[n] for n in p}
            for n in p:
                buf[n] = (g[n] + WD * p[n]) + MOMENTUM * buf[n]
                update = LR * buf[n]
                if n in anchor and not self.mix_first:
                    # p.mul_(1 - lam).add_(state["soda_anchor"], alpha=lam)
                    p[n] = p[n] * (1 - lam) + lam * anchor[n]
                p[n] = p[n] - update  # p.add_(update, alpha=-group["lr"])
            out.append({n: x.copy() for n, x in p.items()})
        return out


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_pull_to_init_matches_result_32_in_float64():
    weights, curv, noise = problem()
    assert worst(ours_default(), Record32().run(weights, curv, noise)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(strength=1.03), dict(fade_start=FADE_START + 1), dict(fade_end=FADE_END - 1),
    dict(shape="linear"), dict(offset=1), dict(mix_first=True),
    dict(hidden={n: True for n in SHAPES})])
def test_a_moved_constant_fails_the_comparison(control):
    weights, curv, noise = problem()
    assert worst(ours_default(), Record32(**control).run(weights, curv, noise)) > 1e-6


def test_the_fade_is_the_records():
    record = Record32(fade_start=R32.fade_start, fade_end=R32.fade_end)
    for t in (0, 1999, 2000, 2001, 2375, 2749, 2750, 3039):
        assert float(fade(t, R32.fade_start, R32.fade_end)) == pytest.approx(
            record.soda_fade_multiplier(t), abs=1e-6)


PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": jnp.linspace(-1.0, 1.0, 6)}


def test_properties():
    grads = m.random_grads(PARAMS, 0)
    inner = optax.adam(0.1)
    ref, _ = inner.update(grads, inner.init(PARAMS), PARAMS)
    moved = optax.apply_updates(PARAMS, ref)
    tx = optax.chain(inner, pull_to_init(1.0))
    state = tx.init(PARAMS)
    # The first update leaves the anchor's own point unchanged (a - p = 0).
    first, state = tx.update(grads, state, PARAMS)
    m.assert_trees_equal(first, ref)
    # Strength 0 (the fade's end): exactly the inner update; the weights are evaluated
    # as they are (a move of the training weights, not a readout).
    off, _, _ = m.run(optax.chain(inner, pull_to_init(0.0)), PARAMS, 4)
    alone, _, _ = m.run(inner, PARAMS, 4)
    m.assert_trees_equal(off, alone)
    m.assert_trees_equal(eval_params(moved, state), moved)
    # λ is capped at 1: the weights land on the anchor plus the update.
    big = pull_to_init(100.0)
    u, _ = big.update(ref, big.init(PARAMS), moved)
    m.assert_trees_close(optax.apply_updates(moved, u),
                         optax.apply_updates(PARAMS, ref), rtol=1e-6, atol=1e-6)
    # Under optax.masked the other leaves are not pulled.
    masked = optax.masked(pull_to_init(1.0), {"a": True, "b": False})
    ms = masked.init(PARAMS)
    _, ms = masked.update(ref, ms, PARAMS)
    u, _ = masked.update(ref, ms, moved)
    np.testing.assert_array_equal(np.asarray(u["b"]), np.asarray(ref["b"]))
    assert not np.allclose(np.asarray(u["a"]), np.asarray(ref["a"]))


def test_bad_input():
    with pytest.raises(ValueError, match="strength"):
        pull_to_init(-1.0)
    tx = pull_to_init(1.0)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


def test_optax_matrix(tmp_path):
    tx = optax.chain(optax.adam(1e-2), pull_to_init(optax.linear_schedule(2.0, 0.5, 6)))
    f64 = dict(float64=tx)  # the anchor follows the params' dtype: float64 params, float64 run
    m.check_jit_matches_eager(tx, PARAMS, steps=4, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=2, **f64)
    m.check_partition(tx, PARAMS, steps=3, **f64)
    m.check_nnx_optimizer(tx, steps=5)
    m.check_sharded_state(tx, PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=3, steps_after=3)
    m.check_inject_hyperparams(lambda strength: optax.chain(optax.sgd(0.1),
                                                             pull_to_init(strength)),
                               PARAMS, dict(strength=1.5), steps=4, float64=True)


def test_the_anchor_is_its_own_buffer():
    """A float32 anchor is a copy, not the param's buffer: a trainer donating params and
    state would otherwise donate one buffer twice (as track3_soda did in the trainer)."""
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,), jnp.bfloat16)}
    anchor = pull_to_init().init(params).anchor
    assert anchor["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()
    np.testing.assert_array_equal(anchor["w"], params["w"])
