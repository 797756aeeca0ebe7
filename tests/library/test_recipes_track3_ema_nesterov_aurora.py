"""`recipes.track3_ema_nesterov_aurora` (Track 3 result #40) against a float64 numpy
transcription of its log's optimizer: #30's `Muon.step` and AdamW
(`test_recipes_track3_aurora_proj.Record`, the same code in #40's log, at #40's
``FINAL_TRAIN_STEPS`` 2900 and ``FINAL_SCHEDULE_STEPS`` 2980) inside its ``EMA_Nesterov``
(log:695-792: ``nesterov_step`` before the gradient, ``accum_lookahead`` after both inner
steps), one update at a time over a 60-step run (the record's 2980 scaled by 60/2980):
the lookahead from update 6 to 38 (300 and 1950 scaled), its lr ratio leaving 1 at the
embedding's PowerCool knee (32), the momentum's warm-up (6) and cool-down (57), the Contra
ramp's end (50), SOAP's bases (0, 10, ...). Both the params (the lookahead point, where the
next gradient is taken) and the weights to evaluate (`optax_snoo.eval_params`, the log's
weights) are compared. Constants from `references.track3_constants.R40`; controls must
fail."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import optax_snoo
from library.test_recipes_track3_aurora_proj import Record, problem, torch_layout, worst
from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R30, R40

T = 60  # the recipe's total_steps: R40.schedule_steps x 60/2980
STEPS = 58  # the run: up to the log's FINAL_TRAIN_STEPS scaled (2900 -> 58), where the
# momentum's cool-down ends (its formula is not meant past it)


@dataclasses.dataclass
class RecordEma(Record):
    """#40's loop: ``EMA_Nesterov`` (log:695-792) around #30's AdamW and Muon. The
    lookahead for update ``it`` is added at the end of update ``it - 1`` (its
    ``nesterov_step`` comes before the next gradient; at ``it = 0`` the buffer is 0), so
    the weights each step appends are the next gradient's point."""

    total: int = T
    schedule_steps: int = R40.schedule_steps
    train_steps: int = R40.train_steps
    lookahead: float = R40.lookahead
    lookahead_ema: float = R40.lookahead_ema
    prefill: int = R40.lookahead_prefill
    stop: int = R40.lookahead_stop
    scheduled: bool = R40.lookahead_scheduled
    ratio_group: str = R40.lookahead_group
    lr_lag: int = 1  # the ratio reads the lr set_hparams set on the previous step

    def __post_init__(self):
        super().__post_init__()
        self.evaluated, self.betas = [], []

    def beta(self, it):  # log:773 nesterov_step, :733-740 lookahead_step
        if not self.scaled(self.prefill) <= it < self.scaled(self.stop):
            return 0.0
        if not self.scheduled:
            return self.lookahead
        lr0, c = {"embed": (R30.embed_lr, R30.embed_c), "muon": (R30.muon_lr, R30.muon_c)}[
            self.ratio_group]
        # log:726-730 get_lr_lambda: param_groups[0]["lr"] / initial_lr (lr0 before step 0)
        return self.lookahead * self.lr(lr0, c, max(it - self.lr_lag, 0)) / lr0

    def run(self, weights, grads_by_step):
        self.prev = {n: x.copy() for n, x in weights.items()}  # log:721 at it = 0
        self.buf = {n: np.zeros_like(x) for n, x in weights.items()}  # log:724
        return super().run(weights, grads_by_step)

    def after_step(self, w, step):
        gamma = self.lookahead_ema
        for n in w:  # log:757-768 accum_lookahead (the weights after the inner steps)
            self.buf[n] = self.buf[n] + (1 - gamma) * ((w[n] - self.prev[n]) - self.buf[n])
            self.prev[n] = w[n].copy()
        self.after_ema_step(w, step)
        self.evaluated.append(dict(w))
        beta = self.beta(step + 1)  # the next update's nesterov_step (log:1029)
        self.betas.append(beta)
        for n in w:
            w[n] = w[n] + beta * self.buf[n]

    def after_ema_step(self, w, step):
        """After ``EMA_Nesterov.step``, before the next lookahead (#43's hooks)."""


@functools.cache
def ours(name="track3_ema_nesterov_aurora", total=T, steps=STEPS, **options):
    """Our params after each of ``steps`` updates of a ``total``-step run and the weights
    `optax_snoo.eval_params` reads out."""
    weights, grads = problem()

    def run(w, gs):
        tx = recipes.get(name)(total, ns_dtype="float64", **options)
        params = nest(w, dtype=None)
        state, update, out = tx.init(params), jax.jit(tx.update), []
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append((params, optax_snoo.eval_params(params, state)))
        return out
    out = run_in_float64(run, weights, grads[:steps])
    return ([torch_layout(flatten(p)) for p, _ in out],
            [torch_layout(flatten(e)) for _, e in out])


@functools.cache
def reference(**control):
    weights, grads = problem()
    record = RecordEma(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads[:STEPS]])
    return steps, record


def test_matches_its_record_in_float64():
    steps, record = reference()
    params, evaluated = ours()
    assert worst(params, steps) < 1e-10
    assert worst(evaluated, record.evaluated) < 1e-10
    assert all(record.seen.values()), record.seen  # #30's mechanisms all acted
    # the lookahead acts from update 6 to 38, its lr ratio below 1 from 33 on (the
    # embedding's PowerCool knee, 1568 of 2980 scaled)
    active = [it for it, b in enumerate(record.betas, start=1) if b]
    assert (active[0], active[-1]) == (6, 38)
    assert record.betas[31] == R40.lookahead and 0 < record.betas[37] < 0.8 * R40.lookahead


def test_the_lookahead_is_in_the_params_and_out_of_the_evaluated_weights():
    """Inside the window the params (the gradient's point) lead the evaluated weights by
    ``β b``; outside it they are the same."""
    params, evaluated = ours()
    assert worst(params[10:11], evaluated[10:11]) > 1e-3
    assert worst(params[40:], evaluated[40:]) == 0.0
    assert worst(params[:4], evaluated[:4]) == 0.0


def test_without_the_lookahead_it_is_30s_stack_at_40s_schedule():
    """Before update 6 the run is `track3_aurora_proj`'s with #40's two step constants
    (its record without EMA-Nesterov); the lookahead's first step leaves it."""
    plain, _ = reference(lookahead=0.0)
    params, _ = ours()
    assert worst(params[:5], plain[:5]) < 1e-10
    assert worst(params[5:6], plain[5:6]) > 1e-6


@pytest.mark.parametrize("control", [
    dict(lookahead=0.31), dict(lookahead_ema=0.985), dict(prefill=350), dict(stop=1850),
    dict(scheduled=False), dict(ratio_group="muon"), dict(lr_lag=0), dict(lookahead=0.0),
    dict(train_steps=R30.train_steps), dict(schedule_steps=R30.schedule_steps),
    dict(muon_lr=R30.muon_lr * 1.03), dict(contra=-0.205)])
def test_a_moved_constant_fails_the_comparison(control):
    assert worst(ours()[0], reference(**control)[0]) > 1e-6


def test_the_defaults_are_the_records():
    recipe = recipes.track3_ema_nesterov_aurora
    t, r = recipe.defaults, R40
    assert recipe.record_steps == t.RECORD_STEPS == r.schedule_steps
    assert t.train_steps == r.train_steps
    assert (t.lookahead, t.lookahead_ema, t.lookahead_start, t.lookahead_stop) == (
        r.lookahead, r.lookahead_ema, r.lookahead_prefill, r.lookahead_stop)
    # every other constant is #30's (the two scripts differ in the two step constants)
    base = recipes.track3_aurora_proj.defaults
    moved = {"train_steps"}
    assert {f.name: getattr(t, f.name) for f in dataclasses.fields(base)
            if f.name not in moved} == {
        k: v for k, v in dataclasses.asdict(base).items() if k not in moved}
