"""`recipes.track3_sinksoap` against a float64 numpy transcription of modded-nanogpt Track 3
result #26's optimizer (its log's script: `gram_eigenbasis`,
`sinkhorn_energy_balance_rect_no_scale`, `scale_update_like_muon`,
`normuon_postcondition_update`, `gram_sinkhorn_normuon_update`, `SinkSOAP.step`'s decay,
the aux AdamW, `set_hparams`) on PyTorch's (out, in) layout, over a run that crosses the
cooldown. Constants from `references.track3_constants.R26`; controls (one constant moved)
must fail the comparison.

The gradients do not depend on the weights (nothing chaotic to hold back), are of the summed
loss's size, and one square matrix's are ~1e-4 so that the balancing's ``eps`` (1e-8 beside
``A²``) matters. The non-square matrices' first three gradients lie on disjoint blocks of
their longer side: a Gram of rank below its size has a null space whose basis ``eigh`` picks
freely, and the momentum's rounding there is amplified by ``1/sqrt(eps)``; with the blocks,
both sides' null spaces are coordinate axes where the momentum is exactly zero, and after
three updates every Gram has full rank."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import adam_step, flatten, nest
from references.track3_constants import R26

T = 40  # the cooldown starts at step 12 of 40 (0.3 of the run)
BLOCK_STEPS = 3  # disjoint blocks of 8 on the 24-long side: full-rank Grams from then on


def gram_eigenbasis(C, eps):
    """`gram_eigenbasis` (log:220-234)."""
    C = 0.5 * (C + C.T) + eps * np.eye(C.shape[0])
    evals, evecs = np.linalg.eigh(C)
    return evecs[:, np.argsort(-evals, kind="stable")]


def sinkhorn(A, steps, eps):
    """`sinkhorn_energy_balance_rect_no_scale` (log:237-291)."""
    m, n = A.shape
    B = A * A + eps
    r, c = np.ones(m), np.ones(n)
    for _ in range(steps):
        r = (1.0 / m) / (B @ c + eps)
        c = (1.0 / n) / (B.T @ r + eps)
    return np.sqrt(r)[:, None] * A * np.sqrt(c)[None, :]


def scale_update_like_muon(update, eps):
    """log:294-310."""
    m, n = update.shape
    target = min(m, n) ** 0.5 * max(1.0, m / n) ** 0.5
    return update * (target / max(np.linalg.norm(update), eps))


def normuon_postcondition(X, second_momentum, beta, eps):
    """`normuon_postcondition_update` (log:313-356); updates ``second_momentum`` in place."""
    m, n = X.shape
    norm = max(np.linalg.norm(X), eps)
    v_mean = np.mean(X * X, axis=-1, keepdims=True) if m >= n else np.mean(
        X * X, axis=-2, keepdims=True)
    second_momentum += (1.0 - beta) * (v_mean - second_momentum)   # lerp_
    X = X * (1.0 / np.maximum(np.sqrt(second_momentum), eps))
    return X * (norm / max(np.linalg.norm(X), eps))


@dataclasses.dataclass
class Record26:
    groups: dict
    muon_lr: float = R26.muon_lr
    muon_wd: float = R26.muon_wd
    mu: float = R26.muon_mu
    gram_beta: float = R26.gram_beta
    normuon_beta: float = R26.normuon_beta
    sinkhorn_steps: int = R26.sinkhorn_steps
    eps: float = R26.eps
    normuon_eps: float = R26.normuon_eps
    normuon_square: bool = R26.normuon_square
    cooldown_frac: float = R26.cooldown_frac

    def muon_update(self, grad, st):
        """`gram_sinkhorn_normuon_update` (log:359-436), nesterov=True."""
        m, n = grad.shape
        st["momentum"] += (1.0 - self.mu) * (grad - st["momentum"])
        M = grad + self.mu * (st["momentum"] - grad)
        st["left"] += (1.0 - self.gram_beta) * (grad @ grad.T - st["left"])
        st["right"] += (1.0 - self.gram_beta) * (grad.T @ grad - st["right"])
        U = gram_eigenbasis(st["left"], self.eps)
        V = gram_eigenbasis(st["right"], self.eps)
        A_bal = sinkhorn(U.T @ M @ V, self.sinkhorn_steps, self.eps)
        update = scale_update_like_muon(U @ A_bal @ V.T, self.eps)
        if m != n or self.normuon_square:
            update = normuon_postcondition(update, st["second"], self.normuon_beta,
                                           self.normuon_eps)
        return update

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {}
        for n, x in w.items():
            if self.groups[n] == "muon":
                rows, cols = x.shape
                state[n] = dict(momentum=np.zeros_like(x), left=np.zeros((rows, rows)),
                                right=np.zeros((cols, cols)),
                                second=np.zeros((rows, 1) if rows >= cols else (1, cols)))
            else:
                state[n] = [np.zeros_like(x), np.zeros_like(x)]
        out = []
        for step, grads in enumerate(grads_by_step):
            progress, cf = step / T, self.cooldown_frac
            eta = 1.0 if progress < 1 - cf else (1 - progress) / cf
            for n, g in grads.items():
                if self.groups[n] == "muon":
                    lr = self.muon_lr * eta
                    update = self.muon_update(g, state[n])
                    w[n] = w[n] * (1 - lr * self.muon_wd) - lr * update
                else:  # torch.optim.AdamW, no decay
                    a, b = state[n]
                    w[n], a, b = adam_step(w[n], g, a, b, step + 1, self.groups[n] * eta,
                                           *R26.adam_betas, R26.adam_eps, bias_correction=True)
                    state[n] = [a, b]
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes, #26's group and the gradients' size
    "wte/embedding": ((16, 8), R26.embed_lr, 700.0),
    "blocks/0/ln_1/scale": ((8,), R26.vector_lr, 700.0),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon", 700.0),
    "blocks/0/attn/c_k/kernel": ((8, 8), "muon", 1e-4),   # A² ~ eps: the eps matters
    "blocks/0/attn/c_q/bias": ((8,), R26.vector_lr, 700.0),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "muon", 700.0),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "muon", 700.0),
    "lm_head/kernel": ((8, 16), R26.head_lr, 700.0),
}
MATRICES = [n for n, (_, g, _) in PARAMS.items() if g == "muon"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def gradient(rng, shape, size, step):
    """``size`` times a normal draw; a non-square matrix's first `BLOCK_STEPS` only on the
    ``step``-th block of 8 of its longer side (class docstring)."""
    g = size * rng.standard_normal(shape)
    if len(shape) == 2 and shape[0] != shape[1] and step < BLOCK_STEPS:
        long_axis = int(np.argmax(shape))
        keep = np.zeros(shape[long_axis], bool)
        keep[8 * step:8 * step + 8] = True
        g = g * (keep[None, :] if long_axis == 1 else keep[:, None])
    return g


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _, _) in PARAMS.items()}
    grads = [{n: gradient(rng, s, size, t) for n, (s, _, size) in PARAMS.items()}
             for t in range(T)]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_sinksoap(T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out, update = tx.init(params), [], jax.jit(tx.update)
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(weights, grads, **control):
    groups = {n: g for n, (_, g, _) in PARAMS.items()}
    return Record26(groups, **control).run(torch_layout(weights),
                                          [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


@pytest.fixture(scope="module")
def run_ours():
    weights, grads = problem()
    return weights, grads, ours(weights, grads)


def test_track3_sinksoap_matches_result_26_in_float64(run_ours):
    weights, grads, got = run_ours
    assert worst(got, reference(weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(muon_lr=R26.muon_lr * 1.03), dict(muon_wd=0.03), dict(mu=0.94), dict(gram_beta=0.94),
    dict(normuon_beta=0.94), dict(sinkhorn_steps=9), dict(eps=2e-8), dict(normuon_square=True),
    dict(cooldown_frac=0.68)])
def test_a_moved_constant_fails_the_comparison(run_ours, control):
    weights, grads, got = run_ours
    assert worst(got, reference(weights, grads, **control)) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_sinksoap.defaults
    assert (t.muon_learning_rate, t.muon_weight_decay, t.muon_momentum, t.gram_beta,
            t.normuon_beta, t.sinkhorn_steps, t.sinkhorn_eps, t.cooldown_frac) == (
        R26.muon_lr, R26.muon_wd, R26.muon_mu, R26.gram_beta, R26.normuon_beta,
        R26.sinkhorn_steps, R26.eps, R26.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R26.embed_lr, R26.head_lr, R26.vector_lr, R26.adam_betas, R26.adam_eps)
    assert recipes.track3_sinksoap.record_steps == R26.steps
