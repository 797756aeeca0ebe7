"""`recipes.track3_adam` against a float64 numpy transcription of modded-nanogpt Track 3
result #2's optimizer step (its log's script: two `torch.optim.AdamW`, `set_hparams` with
every group's warm-up), over a run scaled to cross the warm-up and the cooldown. Every
number is typed in from the log (`references.track3_constants.R2`); controls (one constant
moved by a few percent) must fail the comparison."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R2

T = 68  # the run: warm-up round(250·68/5625) = 3 steps, cooldown from step 21


@dataclasses.dataclass
class Record2:
    """#2's `set_hparams` and AdamW on float64 weights (elementwise: the layout does not
    matter). `groups`: name -> "matrix" or the aux group's lr."""

    groups: dict
    total: int = T
    warmup: int = round(R2.warmup_steps * T / R2.steps)
    cooldown_frac: float = R2.cooldown_frac
    matrix_lr: float = R2.matrix_lr
    matrix_b2: float = R2.matrix_betas[1]

    def lr(self, name, step):
        progress = step / self.total
        eta = 1.0 if progress < 1 - self.cooldown_frac else (1 - progress) / self.cooldown_frac
        warmup = min(1.0, (step + 1) / self.warmup)
        peak = self.matrix_lr if self.groups[name] == "matrix" else self.groups[name]
        return peak * warmup * eta

    def run(self, weights, grads_by_step):
        w = dict(weights)
        m = {n: np.zeros_like(x) for n, x in w.items()}
        v = {n: np.zeros_like(x) for n, x in w.items()}
        out = []
        for step, grads in enumerate(grads_by_step):
            for n, g in grads.items():
                matrix = self.groups[n] == "matrix"
                b1, b2 = ((R2.matrix_betas[0], self.matrix_b2) if matrix else R2.adam_betas)
                eps = R2.matrix_eps if matrix else R2.adam_eps
                wd = R2.matrix_wd if matrix else R2.adam_wd
                lr, t = self.lr(n, step), step + 1
                p = w[n] * (1 - lr * wd)  # AdamW: decay first, then the Adam step
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                denom = np.sqrt(v[n]) / np.sqrt(1 - b2**t) + eps
                w[n] = p - lr / (1 - b1**t) * m[n] / denom
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, shapes and #2's group
    "wte/embedding": ((16, 8), R2.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R2.vector_lr),
    "blocks/0/attn/c_q/kernel": ((8, 8), "matrix"),
    "blocks/0/attn/c_q/bias": ((8,), R2.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "matrix"),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "matrix"),
    "lm_head/kernel": ((8, 16), R2.head_lr),
    "lm_head/bias": ((16,), R2.vector_lr),
}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    for g in grads:  # a gradient far below eps: Adam's eps acts on it
        g["blocks/0/attn/c_q/bias"] = 1e-12 * g["blocks/0/attn/c_q/bias"]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    """Our recipe's weights after each update, in float64."""
    def run(w, gs):
        tx = recipes.track3_adam(T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        for g in gs:
            updates, state = tx.update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [flatten(p) for p in run_in_float64(run, weights, grads)]


def unflatten(flat):
    out = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_track3_adam_matches_result_2_in_float64():
    weights, grads = problem()
    reference = Record2({n: g for n, (_, g) in PARAMS.items()}).run(weights, grads)
    assert worst(ours(weights, grads), reference) < 1e-12


@pytest.mark.parametrize("control", [
    dict(matrix_lr=R2.matrix_lr * 1.03), dict(warmup=4), dict(cooldown_frac=0.68),
    dict(matrix_b2=0.96)])
def test_a_moved_constant_fails_the_comparison(control):
    weights, grads = problem()
    moved = Record2({n: g for n, (_, g) in PARAMS.items()}, **control).run(weights, grads)
    assert worst(ours(weights, grads), moved) > 1e-10


def test_the_groups_and_the_defaults_are_result_2s():
    table = recipes.track3_adam.defaults
    assert (table.matrix_learning_rate, (table.matrix_b1, table.matrix_b2),
            table.matrix_weight_decay, table.warmup_steps) == (
        R2.matrix_lr, R2.matrix_betas, R2.matrix_wd, R2.warmup_steps)
    assert (table.embed_learning_rate, table.head_learning_rate, table.vector_learning_rate,
            (table.adam_b1, table.adam_b2), table.adam_eps, table.cooldown_frac) == (
        R2.embed_lr, R2.head_lr, R2.vector_lr, R2.adam_betas, R2.adam_eps, R2.cooldown_frac)
    assert recipes.track3_adam.record_steps == R2.steps
    shapes = {n: jax.ShapeDtypeStruct(s, np.float32) for n, (s, _) in PARAMS.items()}
    groups = recipes.describe("track3_adam", unflatten(shapes))
    assert {n: ("matrix" if g == "matrices" else g) for n, g in groups.items()} == {
        n: ("matrix" if g == "matrix" else {R2.embed_lr: "embed", R2.head_lr: "head",
                                             R2.vector_lr: "vectors"}[g])
        for n, (_, g) in PARAMS.items()}
