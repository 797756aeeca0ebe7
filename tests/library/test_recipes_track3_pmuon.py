"""`recipes.track3_pmuon` against a float64 numpy transcription of modded-nanogpt Track 3
result #18's optimizer (its log's script: `zeropower_via_newtonschulz5`,
`_streaming_cov_power`, `pmuon_update`, `Muon.step`, the aux AdamW, `set_hparams`), on
PyTorch's (out, in) layout (our (in, out) kernels transposed in and back), over a run that
crosses the cooldown. Every number is typed in from the log
(`references.track3_constants.R18`); controls (one constant moved a few percent) must fail
the comparison.

The transcription (`references.pmuon.RefPMuon`) starts each basis where
``pmuon_precondition(seed=0)`` documents it does (the record's is an unseeded
``torch.randn``); a control starts elsewhere. The matrices' aspect ratios are at most 2
and the first gradient of a non-square matrix is zero outside its leading square block:
a longer side's first covariance is then singular on exact axis vectors (its rounding
there is exact zeros in both programs; elsewhere the basis of a null space is made of
rounding and the next update's orthogonal iteration starts from it), and full rank from
the second update on. One matrix's gradient is small (1e-3), so that its covariance is near
the damping and ``damping``, ``eps`` and Newton-Schulz's epsilon act.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.pmuon import RefPMuon
from references.track3 import flatten, nest
from references.track3_constants import R18

T = 40  # flat for steps 0-11, then the cooldown


@dataclasses.dataclass
class Record18:
    """#18's Muon and aux AdamW on float64 torch-layout weights; `groups`: name -> "muon"
    or the aux lr."""

    groups: dict
    muon_lr: float = R18.muon_lr
    muon_wd: float = R18.muon_wd
    mu: float = R18.muon_mu
    beta: float = R18.beta
    gamma: float = R18.gamma
    damping: float = R18.damping
    eps: float = R18.eps
    cooldown_frac: float = R18.cooldown_frac
    seed: int = 0

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {n: [np.zeros_like(x), np.zeros_like(x)] for n, x in w.items()}
        muon = {n: RefPMuon(*x.shape, mu=self.mu, beta=self.beta, gamma=self.gamma,
                            damping=self.damping, eps=self.eps, seed=self.seed)
                for n, x in w.items() if self.groups[n] == "muon"}
        out = []
        for step, grads in enumerate(grads_by_step):
            progress, cf = step / T, self.cooldown_frac
            eta = 1.0 if progress < 1 - cf else (1 - progress) / cf
            for n, g in grads.items():
                if self.groups[n] == "muon":  # pmuon_update, then Muon.step
                    lr = self.muon_lr * eta
                    w[n] = w[n] * (1 - lr * self.muon_wd) - lr * muon[n].update(g)
                else:  # torch.optim.AdamW, no decay
                    a, b = state[n]
                    (b1, b2), t, lr = R18.adam_betas, step + 1, self.groups[n] * eta
                    a += (1 - b1) * (g - a)
                    b *= b2
                    b += (1 - b2) * g * g
                    denom = np.sqrt(b) / np.sqrt(1 - b2**t) + R18.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * a / denom
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes, #18's group and the gradient's size
    "wte/embedding": ((16, 8), R18.embed_lr, 1.0),
    "blocks/0/ln_1/scale": ((8,), R18.vector_lr, 1.0),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon", 700.0),
    "blocks/0/attn/c_q/bias": ((8,), R18.vector_lr, 1.0),
    "blocks/0/mlp/c_fc/kernel": ((8, 16), "muon", 700.0),  # a summed loss's size
    "blocks/0/mlp/c_proj/kernel": ((16, 8), "muon", 1e-3),  # near the damping
    "lm_head/kernel": ((8, 16), R18.head_lr, 1.0),
}
MATRICES = [n for n, (_, g, _) in PARAMS.items() if g == "muon"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _, _) in PARAMS.items()}
    grads = [{n: size * rng.standard_normal(s) for n, (s, _, size) in PARAMS.items()}
             for _ in range(T)]
    for n in MATRICES:  # the first gradient on the leading square block only
        short = min(PARAMS[n][0])
        block = np.zeros(PARAMS[n][0])
        block[:short, :short] = 1.0
        grads[0][n] = grads[0][n] * block
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_pmuon(T, ns_dtype="float64", **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        update = jax.jit(tx.update)
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(weights, grads, **control):
    groups = {n: g for n, (_, g, _) in PARAMS.items()}
    return Record18(groups, **control).run(torch_layout(weights),
                                           [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


@pytest.fixture(scope="module")
def run_ours():
    weights, grads = problem()
    return weights, grads, ours(weights, grads)


def test_track3_pmuon_matches_result_18_in_float64(run_ours):
    weights, grads, got = run_ours
    assert worst(got, reference(weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(muon_lr=R18.muon_lr * 1.03), dict(muon_wd=R18.muon_wd * 1.1), dict(mu=0.94),
    dict(beta=0.94), dict(gamma=0.31), dict(damping=1.1e-6), dict(eps=1e-5),
    dict(cooldown_frac=0.68), dict(seed=1)])
def test_a_moved_constant_fails_the_comparison(run_ours, control):
    weights, grads, got = run_ours
    assert worst(got, reference(weights, grads, **control)) > 1e-8


def test_the_defaults_are_result_18s():
    t = recipes.track3_pmuon.defaults
    assert (t.muon_learning_rate, t.muon_weight_decay, t.muon_momentum, t.covariance_beta,
            t.covariance_power, t.covariance_damping, t.covariance_eps, t.cooldown_frac) == (
        R18.muon_lr, R18.muon_wd, R18.muon_mu, R18.beta, R18.gamma, R18.damping, R18.eps,
        R18.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R18.embed_lr, R18.head_lr, R18.vector_lr, R18.adam_betas, R18.adam_eps)
    assert recipes.track3_pmuon.record_steps == R18.steps
