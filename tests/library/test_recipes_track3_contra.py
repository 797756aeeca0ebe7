"""`recipes.track3_normuon_floor` (#9), `recipes.track3_contra_muon` (#11) and
`recipes.track3_aurora` (#17) against a float64 numpy transcription of their logs'
optimizer (`zeropower_via_newtonschulz5`, #17's `aurora_orthogonalize`,
`scale_to_unit_operator_norm`, `muon_update`, `Muon.step`'s u/w floor, the aux AdamW,
`set_hparams`), on PyTorch's (out, in) layout, over a run that crosses the cooldown.
Constants from `references.track3_constants.R9`/`R11`/`R17`; controls (one constant
moved) must fail the comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R9, R11, R17

T = 20


def zeropower(G):
    """`zeropower_via_newtonschulz5` in float64."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[-2] > G.shape[-1] else X


def aurora(G, iterations, beta, eps=R17.aurora_eps):
    """`aurora_orthogonalize` (#17 log:186-212): polar(D G) of the tall orientation."""
    m, n = G.shape
    if m == n:
        return zeropower(G)
    transposed = m < n
    if transposed:
        G, m, n = G.T, n, m
    D = 1.0 / np.maximum(np.linalg.norm(G, axis=-1, keepdims=True), eps)
    for k in range(iterations):
        U = zeropower(D * G)
        if k < iterations - 1:
            row_sq = np.maximum((U * U).sum(axis=-1, keepdims=True), eps * eps)
            D = D * (n / m / row_sq) ** beta
    return U.T if transposed else U


def unit_operator_norm(G, iterations=R11.power_iterations, eps=R11.power_eps):
    """`scale_to_unit_operator_norm` (#11 log:207-217)."""
    v = np.ones(G.shape[-1])
    v = v / max(np.linalg.norm(v), eps)
    for _ in range(iterations):
        u = G @ v
        u = u / max(np.linalg.norm(u), eps)
        v = G.T @ u
        v = v / max(np.linalg.norm(v), eps)
    return G / max(np.linalg.norm(G @ v), eps)


@dataclasses.dataclass
class Record:
    groups: dict
    R: type = R9
    contra: float | None = None
    muon_lr: float = R9.muon_lr
    beta2: float | None = R9.beta2
    aurora: tuple[int, float] | None = None  # (pp_iterations, pp_beta) of #17
    target_uw: float = R9.target_uw
    iterations: int = R11.power_iterations
    cooldown_frac: float = R9.cooldown_frac

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {}
        for n, x in w.items():
            if self.groups[n] == "muon":
                tall = x.shape[0] >= x.shape[1]
                sm = np.zeros((x.shape[0], 1)) if tall else np.zeros((1, x.shape[1]))
                state[n] = [np.zeros_like(x), sm]
            else:
                state[n] = [np.zeros_like(x), np.zeros_like(x)]
        out = []
        for step, grads in enumerate(grads_by_step):
            progress = step / T
            cf = self.cooldown_frac
            eta = 1.0 if progress < 1 - cf else (1 - progress) / cf
            for n, g in grads.items():
                a, b = state[n]
                if self.groups[n] == "muon":
                    mu, lr = self.R.muon_mu, self.muon_lr * eta
                    a += (1 - mu) * (g - a)
                    update = g + mu * (a - g)
                    normalized = unit_operator_norm(update, self.iterations)
                    update = (zeropower(update) if self.aurora is None
                              else aurora(update, *self.aurora))
                    if self.contra is not None:
                        fro = np.linalg.norm(update)
                        update = update - self.contra / 2 * normalized
                        update = update * fro / max(np.linalg.norm(update), 1e-10)
                    update = update * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
                    if self.beta2 is not None:
                        axis = -1 if update.shape[-2] >= update.shape[-1] else -2
                        var = (update * update).mean(axis=axis, keepdims=True)
                        b *= self.beta2
                        b += (1 - self.beta2) * var
                        vnorm = np.linalg.norm(update)
                        update = update / np.sqrt(np.maximum(b, 1e-10))
                        update = update * (vnorm / max(np.linalg.norm(update), 1e-10))
                    p_fro = max(np.linalg.norm(w[n]), 1e-8)
                    u_fro = max(np.linalg.norm(update), 1e-8)
                    if u_fro / p_fro < self.target_uw:
                        update = update * (self.target_uw * p_fro / u_fro)
                    w[n] = w[n] - lr * update
                else:
                    (b1, b2), t, lr = self.R.adam_betas, step + 1, self.groups[n] * eta
                    a += (1 - b1) * (g - a)
                    b *= b2
                    b += (1 - b2) * g * g
                    denom = np.sqrt(b) / np.sqrt(1 - b2**t) + self.R.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * a / denom
            out.append(dict(w))
        return out


PARAMS = {
    "wte/embedding": ((16, 8), R9.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R9.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "muon"),
    "blocks/0/attn/c_q/bias": ((16,), R9.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((16, 48), "muon"),
    "blocks/0/mlp/c_proj/kernel": ((48, 16), "muon"),
    "lm_head/kernel": ((8, 16), R9.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "muon"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0, scale=0.1):
    rng = np.random.default_rng(seed)
    weights = {n: scale * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    return weights, grads


def ours(recipe, weights, grads):
    def run(w, gs):
        tx = recipe(T, ns_dtype="float64")
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        for g in gs:
            updates, state = tx.update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(weights, grads, **control):
    groups = {n: g for n, (_, g) in PARAMS.items()}
    return Record(groups, **control).run(torch_layout(weights), [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


R17_REF = dict(R=R17, contra=R17.contra_muon, muon_lr=R17.muon_lr, beta2=R17.beta2,
               target_uw=R17.target_uw, iterations=R17.power_iterations,
               cooldown_frac=R17.cooldown_frac, aurora=(R17.pp_iterations, R17.pp_beta))
CASES = [(recipes.track3_normuon_floor, dict()),
         (recipes.track3_contra_muon, dict(R=R11, contra=R11.contra_muon)),
         (recipes.track3_aurora, R17_REF)]


@pytest.mark.parametrize("scale", [0.1, 3.0])  # the u/w floor inactive / active
@pytest.mark.parametrize("recipe,ref", CASES)
def test_matches_its_record_in_float64(recipe, ref, scale):
    weights, grads = problem(scale=scale)
    assert worst(ours(recipe, weights, grads), reference(weights, grads, **ref)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(contra=0.41), dict(contra=None), dict(muon_lr=R11.muon_lr * 1.03), dict(beta2=0.96),
    dict(target_uw=0.36), dict(iterations=4), dict(cooldown_frac=0.68)])
def test_a_moved_constant_fails_the_comparison(control):
    weights, grads = problem(scale=3.0)
    ref = dict(R=R11, contra=R11.contra_muon) | control
    assert worst(ours(recipes.track3_contra_muon, weights, grads),
                 reference(weights, grads, **ref)) > 1e-6


@pytest.mark.parametrize("control", [
    dict(aurora=None), dict(aurora=(1, R17.pp_beta)), dict(aurora=(3, R17.pp_beta)),
    dict(aurora=(2, 0.45)), dict(beta2=0.95), dict(contra=0.41), dict(target_uw=0.36)])
def test_a_moved_constant_fails_the_aurora_comparison(control):
    weights, grads = problem(scale=3.0)
    assert worst(ours(recipes.track3_aurora, weights, grads),
                 reference(weights, grads, **(R17_REF | control))) > 1e-6


def test_aurora_defaults_are_the_records():
    t = recipes.track3_aurora.defaults
    assert (t.aurora_iterations, t.aurora_beta, t.muon_beta2, t.contra_muon, t.uw_floor,
            t.muon_learning_rate, t.muon_momentum, t.cooldown_frac) == (
        R17.pp_iterations, R17.pp_beta, R17.beta2, R17.contra_muon, R17.target_uw,
        R17.muon_lr, R17.muon_mu, R17.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R17.embed_lr, R17.head_lr, R17.vector_lr, R17.adam_betas, R17.adam_eps)
    assert recipes.track3_aurora.record_steps == R17.steps


def test_the_defaults_are_the_records():
    for recipe, R in ((recipes.track3_normuon_floor, R9), (recipes.track3_contra_muon, R11)):
        t = recipe.defaults
        assert (t.muon_learning_rate, t.muon_momentum, t.muon_beta2, t.uw_floor,
                t.cooldown_frac) == (R.muon_lr, R.muon_mu, R.beta2, R.target_uw,
                                     R.cooldown_frac)
        assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
                (t.adam_b1, t.adam_b2), t.adam_eps) == (
            R.embed_lr, R.head_lr, R.vector_lr, R.adam_betas, R.adam_eps)
        assert recipe.record_steps == R.steps
    assert recipes.track3_normuon_floor.defaults.contra_muon is None
    assert recipes.track3_contra_muon.defaults.contra_muon == R11.contra_muon
