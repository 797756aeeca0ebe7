"""`recipes.track3_dynmuon` against a float64 numpy transcription of modded-nanogpt Track 3
result #28's optimizer (`train_gpt_simple_dynmuon.py`: `zeropower_via_newtonschulz5`,
`fast_spectral` with order 2, `dynmuon_update`'s gradient scale and summed Nesterov momentum,
`DynMuon.step`'s decay, `get_dynmuon_p`, the aux AdamW, `set_hparams`) on PyTorch's (out, in)
layout, over a run that crosses the cooldown and the power's switch. Constants from
`references.track3_constants.R28`; controls (one constant moved) must fail the comparison.

The gradients are of the summed loss's size (the record divides them by its 524288 tokens),
so ``s^p`` is far from 1 and a wrong scale shows."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R28

T = 40  # p crosses 0 near step 2 of 40 at the record's fractions; cooldown from step 12


def zeropower(G):
    """`zeropower_via_newtonschulz5` in float64."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[-2] > G.shape[-1] else X


def fast_spectral(G, p, epsilon=R28.spectral_eps, order=R28.order):
    """`fast_spectral` (script:226-275)."""
    X, transposed = G, False
    if X.shape[-2] > X.shape[-1]:
        X, transposed = X.T, True
    scale = np.linalg.norm(X) + epsilon
    Xn = X / scale
    Y = zeropower(Xn)
    A = Xn @ Xn.T
    eye = np.eye(A.shape[-1])
    delta, E = 0.5 * p, A - eye
    C = eye + delta * E + (0.5 * delta * (delta - 1.0) * E @ E if order == 2 else 0)
    U = C @ Y * scale**p
    return U.T if transposed else U


def dynmuon_p(step, total, p_max=R28.p_max, p_min=R28.p_min, tau=R28.tau_ratio,
              width=R28.width_ratio):
    """`get_dynmuon_p` (script:468-472)."""
    return p_min + (p_max - p_min) / (1 + math.exp((step / total - tau) / max(width, 1e-8)))


@dataclasses.dataclass
class Record28:
    groups: dict
    muon_lr: float = R28.muon_lr
    muon_wd: float = R28.muon_wd
    mu: float = R28.muon_mu
    gradient_scale: float = R28.gradient_scale
    p_max: float = R28.p_max
    p_min: float = R28.p_min
    tau: float = R28.tau_ratio
    order: int = R28.order
    cooldown_frac: float = R28.cooldown_frac

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {n: [np.zeros_like(x), np.zeros_like(x)] for n, x in w.items()}
        out = []
        for step, grads in enumerate(grads_by_step):
            progress, cf = step / T, self.cooldown_frac
            eta = 1.0 if progress < 1 - cf else (1 - progress) / cf
            p = dynmuon_p(step, T, self.p_max, self.p_min, self.tau)
            for n, g in grads.items():
                a, b = state[n]
                if self.groups[n] == "muon":
                    lr = self.muon_lr * eta
                    g = g * self.gradient_scale
                    a *= self.mu
                    a += g                                    # momentum.mul_(mu).add_(grad)
                    update = fast_spectral(a * self.mu + g, p, order=self.order)
                    update = update * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
                    w[n] = w[n] * (1 - lr * self.muon_wd) - lr * update
                else:  # torch.optim.AdamW, no decay
                    (b1, b2), t, lr = R28.adam_betas, step + 1, self.groups[n] * eta
                    a += (1 - b1) * (g - a)
                    b *= b2
                    b += (1 - b2) * g * g
                    denom = np.sqrt(b) / np.sqrt(1 - b2**t) + R28.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * a / denom
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes and #28's group
    "wte/embedding": ((16, 8), R28.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R28.vector_lr),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), R28.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "muon"),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "muon"),
    "lm_head/kernel": ((8, 16), R28.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "muon"]
#: A summed loss's gradient over the record's batch: ~sqrt(524288) times a token's.
GRAD_SIZE = 700.0


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: GRAD_SIZE * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
             for _ in range(T)]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_dynmuon(T, ns_dtype="float64", **hyperparameters)
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
    return Record28(groups, **control).run(torch_layout(weights),
                                          [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_track3_dynmuon_matches_result_28_in_float64():
    weights, grads = problem()
    assert worst(ours(weights, grads), reference(weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(muon_lr=R28.muon_lr * 1.03), dict(muon_wd=0.03), dict(mu=0.94),
    dict(gradient_scale=2 * R28.gradient_scale), dict(p_max=0.3), dict(p_min=-0.2),
    dict(tau=0.06), dict(order=1), dict(cooldown_frac=0.68)])
def test_a_moved_constant_fails_the_comparison(control):
    weights, grads = problem()
    assert worst(ours(weights, grads), reference(weights, grads, **control)) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_dynmuon.defaults
    assert (t.muon_learning_rate, t.muon_weight_decay, t.muon_momentum, t.gradient_scale,
            t.power_start, t.power_end, t.power_midpoint_frac, t.power_width_frac,
            t.cooldown_frac) == (R28.muon_lr, R28.muon_wd, R28.muon_mu, R28.gradient_scale,
                                 R28.p_max, R28.p_min, R28.tau_ratio, R28.width_ratio,
                                 R28.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R28.embed_lr, R28.head_lr, R28.vector_lr, R28.adam_betas, R28.adam_eps)
    assert recipes.track3_dynmuon.record_steps == R28.steps
