"""`recipes.track3_spectral_descent` against a float64 numpy transcription of modded-nanogpt
Track 3 result #22's optimizer (its log's script: `zeropower_via_newtonschulz5` log:163-180,
`muon_update` log:183-187, `Muon.step` with mu=0 log:197-211, the aux AdamW, `set_hparams`),
on PyTorch's (out, in) layout (our (in, out) kernels transposed in and back), over a run that
crosses the cooldown. Every number is typed in from the log (`references.track3_constants.R22`);
controls (one constant moved a few percent) must fail the comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R22

T = 20  # flat for steps 0-5, then the cooldown


def zeropower(G):
    """`zeropower_via_newtonschulz5` in float64 (log:163-180)."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[-2] > G.shape[-1] else X


@dataclasses.dataclass
class Record22:
    """#22's Muon (mu=0) and aux AdamW on float64 torch-layout weights; `groups`: name -> "muon"
    or the aux lr."""

    groups: dict
    muon_lr: float = R22.muon_lr
    muon_wd: float = R22.muon_wd
    mu: float = R22.muon_mu
    cooldown_frac: float = R22.cooldown_frac

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {n: [np.zeros_like(x), np.zeros_like(x)] for n, x in w.items()}
        out = []
        for step, grads in enumerate(grads_by_step):
            progress = step / T
            cf = self.cooldown_frac
            eta = 1.0 if progress < 1 - cf else (1 - progress) / cf
            for n, g in grads.items():
                a, b = state[n]
                if self.groups[n] == "muon":  # muon_update, then Muon.step
                    lr = self.muon_lr * eta
                    a += (1 - self.mu) * (g - a)                    # momentum.lerp_(grad, 1-mu)
                    update = zeropower(a)
                    update = update * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
                    w[n] = w[n] * (1 - lr * self.muon_wd) - lr * update
                else:  # torch.optim.AdamW, no decay
                    (b1, b2), t, lr = R22.adam_betas, step + 1, self.groups[n] * eta
                    a += (1 - b1) * (g - a)
                    b *= b2
                    b += (1 - b2) * g * g
                    denom = np.sqrt(b) / np.sqrt(1 - b2**t) + R22.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * a / denom
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes and #7's group
    "wte/embedding": ((16, 8), R22.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R22.vector_lr),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), R22.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "muon"),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "muon"),
    "lm_head/kernel": ((8, 16), R22.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "muon"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_spectral_descent(T, ns_dtype="float64", **hyperparameters)
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
    return Record22(groups, **control).run(torch_layout(weights),
                                          [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_track3_spectral_descent_matches_result_7_in_float64():
    weights, grads = problem()
    assert worst(ours(weights, grads), reference(weights, grads)) < 1e-11


@pytest.mark.parametrize("control", [
    dict(muon_lr=R22.muon_lr * 1.03), dict(muon_wd=R22.muon_wd * 1.1), dict(mu=0.05),
    dict(cooldown_frac=0.68)])
def test_a_moved_constant_fails_the_comparison(control):
    weights, grads = problem()
    assert worst(ours(weights, grads), reference(weights, grads, **control)) > 1e-9


def test_the_defaults_are_result_22s():
    t = recipes.track3_spectral_descent.defaults
    assert (t.muon_learning_rate, t.muon_weight_decay, t.cooldown_frac) == (
        R22.muon_lr, R22.muon_wd, R22.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R22.embed_lr, R22.head_lr, R22.vector_lr, R22.adam_betas, R22.adam_eps)
    assert recipes.track3_spectral_descent.record_steps == R22.steps


def test_spectral_descent_is_shampoo_with_betas_0_and_power_quarter():
    """#22's table: SpectralDescent == Muon(mu=0) == Shampoo(betas (0, 0), frequency 1,
    power -1/4). With no accumulation Shampoo's factors are L = G Gᵀ, R = Gᵀ G, and
    L^{-1/4} G R^{-1/4} = U Vᵀ (pseudo-inverse roots on the rank-deficient side); the
    Newton-Schulz iteration's 12 steps of (2, -1.5, 0.5) reach U Vᵀ on a well-conditioned G."""
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    v, _ = np.linalg.qr(rng.standard_normal((24, 16)))
    G = u @ np.diag(np.linspace(0.7, 1.0, 16)) @ v.T               # (16, 24), rank 16

    def root(M, p):  # pseudo-inverse power of a PSD matrix via eigh
        w, q = np.linalg.eigh(M)
        keep = w > w.max() * 1e-12
        return (q[:, keep] * w[keep] ** p) @ q[:, keep].T

    shampoo = root(G @ G.T, -0.25) @ G @ root(G.T @ G, -0.25)
    svd = u @ v.T
    assert np.max(np.abs(shampoo - svd)) < 1e-10
    assert np.max(np.abs(zeropower(G) - svd)) < 1e-6
