"""`recipes.track3_soda` (Track 3 result #32) against a float64 numpy transcription of its
script's optimizer: #20's `Muon.step` and AdamW (`test_recipes_track3_soft_muon.Record`: #32's
script is #20's with every constant kept, SODA added) and #32's SODA mix in `Muon.step`
(log:63-77 `soda_fade_multiplier`, :603-604 the anchor, :647-650 ``lam`` and the mix of the
hidden matrix toward it after the update and its u/w floor are formed, before
``p.add_(update, alpha=-lr)``). The run of T=40 steps crosses #20's step constants and both
ends of the fade (2000 and 2750 scaled: 26 and 36); controls must fail. Constants from
`references.track3_constants.R20` / `R32`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
import pytest

from library.test_recipes_track3_soft_muon import (
    MATRICES,
    Record,
    T,
    problem,
    scaled,
    torch_layout,
    worst,
)
from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R20, R32


@dataclasses.dataclass
class RecordSoda(Record):
    """#20's steps with #32's SODA mix of each hidden matrix toward its initial value."""

    strength: float = R32.strength
    fade_start: int = R32.fade_start
    fade_end: int = R32.fade_end
    fade_shape: str = R32.fade_shape
    offset: int = R32.offset

    def fade(self, step):  # soda_fade_multiplier (log:69-77)
        start, end = scaled(self.fade_start), scaled(self.fade_end)
        if step < start:
            return 1.0
        if step >= end:
            return 0.0
        x = (step - start) / (end - start)
        return 1.0 - x if self.fade_shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))

    def pulled(self, name, p, step):  # log:647-650
        lam = min(max(self.strength * self.fade(step) / (step + self.offset), 0.0), 1.0)
        return p * (1 - lam) + self.anchor[name] * lam

    def run(self, weights, grads_by_step):
        self.anchor = {n: weights[n].copy() for n in MATRICES}  # log:603-604
        return super().run(weights, grads_by_step)


@functools.cache
def ours(scale, name="track3_soda"):
    def run(w, gs):
        tx = recipes.get(name)(T, ns_dtype="float64")
        params = nest(w, dtype=None)
        state, out, update = tx.init(params), [], jax.jit(tx.update)
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, *problem(scale=scale))]


def reference(scale, **control):
    weights, grads = problem(scale=scale)
    return RecordSoda(**control).run(torch_layout(weights), [torch_layout(g) for g in grads])


@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_matches_its_record_in_float64(scale):
    """At scale 0.1 the u/w floor is inactive, at 3 it binds on every matrix (#20's test)."""
    assert (scaled(R32.fade_start), scaled(R32.fade_end)) == (26, 36)
    assert worst(ours(scale), reference(scale)) < 1e-10


@pytest.mark.parametrize("scale", [0.1, 3.0])
@pytest.mark.parametrize("control", [
    dict(strength=1.03), dict(strength=0.0), dict(fade_start=2100), dict(fade_end=2800),
    dict(fade_shape="linear"), dict(offset=1), dict(soft_ceil=0.78)])
def test_a_moved_constant_fails_the_comparison(control, scale):
    assert worst(ours(scale), reference(scale, **control)) > 1e-6


def test_a_moved_floor_fails_where_it_binds():
    """At scale 3 the u/w floor binds on every matrix (at 0.1 it is inactive)."""
    assert worst(ours(3.0), reference(3.0, target_uw=0.39)) > 1e-6


def test_only_the_hidden_matrices_are_pulled_and_only_until_the_fade_ends():
    """#20's recipe (no pull) gives the same embedding, head and 1-D leaves at every step, and
    its hidden matrices up to the first pull (update 1: the pull at update 0 is toward the
    weights themselves), not after."""
    soda, base = ours(0.1), ours(0.1, "track3_contra_soft_muon")
    adam = [n for n in soda[0] if n not in MATRICES]
    assert max(np.max(np.abs(a[n] - b[n])) for a, b in zip(soda, base, strict=True)
               for n in adam) == 0.0
    assert worst(soda[:1], base[:1]) < 1e-12
    assert worst(soda[1:2], base[1:2]) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_soda.defaults
    assert (t.soda_strength, t.soda_fade_start, t.soda_fade_end) == (
        R32.strength, R32.fade_start, R32.fade_end)
    assert recipes.track3_soda.record_steps == R32.steps == R20.steps  # #20's schedule
    base = recipes.track3_contra_soft_muon.defaults
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)} == (
        dataclasses.asdict(base))


def test_a_fade_that_does_not_end_after_it_starts_is_refused():
    with pytest.raises(ValueError, match="soda_fade_start"):
        recipes.track3_soda(T, soda_fade_start=2750, soda_fade_end=2750)
