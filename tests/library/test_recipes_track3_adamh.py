"""`recipes.adamh` against a float64 numpy transcription of modded-nanogpt Track 3 record #4's
optimizer (its log's script: `AdamH.step`, `scale_invariant_update_`, the aux AdamW groups,
`set_hparams`), over a run scaled to cross the warm-up, its drop and the aux cooldown. Every
number is typed in from the log (`references.track3_constants.R4`); controls must fail."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R4

T = 78  # warm-up round(250·78/4875) = 4 steps; the aux cooldown from step 47


@dataclasses.dataclass
class Record4:
    """#4's AdamH and aux AdamW on float64 weights. `groups`: name -> "h" or the aux lr."""

    groups: dict
    total: int = T
    warmup: int = round(R4.warmup_steps * T / R4.steps)
    matrix_lr: float = R4.matrix_lr
    matrix_eps: float = R4.matrix_eps
    aux_cooldown_frac: float = R4.aux_cooldown_frac

    def eta(self, name, step):
        progress = step / self.total
        if self.groups[name] == "h":  # log:321-329, cooldown_frac = 1.0
            return step / self.warmup if step < self.warmup else (1 - progress) / 1.0
        cf = self.aux_cooldown_frac
        return 1.0 if progress < 1 - cf else (1 - progress) / cf

    def run(self, weights, grads_by_step):
        w = dict(weights)
        m = {n: np.zeros_like(x) for n, x in w.items()}
        v = {n: np.zeros_like(x) for n, x in w.items()}
        out = []
        for step, grads in enumerate(grads_by_step):
            for n, g in grads.items():
                h, t = self.groups[n] == "h", step + 1
                b1, b2 = R4.matrix_betas if h else R4.adam_betas
                lr = (self.matrix_lr if h else self.groups[n]) * self.eta(n, step)
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                if h:  # AdamH.step, then scale_invariant_update_
                    update = (m[n] / (1 - b1**t)) / (np.sqrt(v[n] / (1 - b2**t)) + self.matrix_eps)
                    p_norm = np.linalg.norm(w[n])
                    new = w[n] - lr * update * p_norm / max(np.linalg.norm(update),
                                                            R4.hyperball_eps)
                    w[n] = new / max(np.linalg.norm(new), R4.hyperball_eps) * p_norm
                else:  # AdamW, no decay
                    denom = np.sqrt(v[n]) / np.sqrt(1 - b2**t) + R4.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * m[n] / denom
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, shapes and #4's group
    "wte/embedding": ((16, 8), R4.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R4.vector_lr),
    "blocks/0/attn/c_q/kernel": ((8, 8), "h"),
    "blocks/0/attn/c_q/bias": ((8,), R4.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "h"),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "h"),
    "lm_head/kernel": ((8, 16), R4.head_lr),
}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    for g in grads:  # gradients far below each eps: AdamH's 1e-8 and AdamW's 1e-10 act
        g["blocks/0/mlp/c_proj/kernel"] = 1e-9 * g["blocks/0/mlp/c_proj/kernel"]
        g["blocks/0/attn/c_q/bias"] = 1e-12 * g["blocks/0/attn/c_q/bias"]
    return weights, grads


def ours(weights, grads):
    def run(w, gs):
        tx = recipes.adamh(T)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        for g in gs:
            updates, state = tx.update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [flatten(p) for p in run_in_float64(run, weights, grads)]


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def groups():
    return {n: g for n, (_, g) in PARAMS.items()}


def test_adamh_matches_record_4_in_float64():
    weights, grads = problem()
    ours_ = ours(weights, grads)
    assert worst(ours_, Record4(groups()).run(weights, grads)) < 1e-12
    for n, (_, g) in PARAMS.items():  # the hyperball: each matrix keeps its initial norm
        if g == "h":
            np.testing.assert_allclose(np.linalg.norm(ours_[-1][n]),
                                       np.linalg.norm(weights[n]), rtol=1e-13)


@pytest.mark.parametrize("control", [
    dict(matrix_lr=R4.matrix_lr * 1.03), dict(warmup=5), dict(matrix_eps=1e-7),
    dict(aux_cooldown_frac=0.42)])
def test_a_moved_constant_fails_the_comparison(control):
    weights, grads = problem()
    moved = Record4(groups(), **control).run(weights, grads)
    assert worst(ours(weights, grads), moved) > 1e-10


def test_the_defaults_are_record_4s():
    t = recipes.adamh.defaults
    assert (t.matrix_learning_rate, (t.matrix_b1, t.matrix_b2), t.matrix_eps,
            t.warmup_steps) == (R4.matrix_lr, R4.matrix_betas, R4.matrix_eps, R4.warmup_steps)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps, t.adam_cooldown_frac) == (
        R4.embed_lr, R4.head_lr, R4.vector_lr, R4.adam_betas, R4.adam_eps,
        R4.aux_cooldown_frac)
    assert recipes.adamh.record_steps == R4.steps
