"""`recipes.track3_muown` against a float64 numpy transcription of modded-nanogpt Track 3
result #23's optimizer (its log's `zeropower_via_polar_express_long`, `_wn_pre_ns`,
`_wn_recompose`, `_smoothstep_v_norm`, `MuownDP._init_state_2d` and `MuownDP.step`, the
aux AdamW, `lr_eta`/`set_hparams`) on PyTorch's (out, in) layout, over a run that crosses
the cooldown and the whole V-norm smoothstep, with zero-initialised projections (their
rows get the record's gain sqrt(0.33) at the first update). Constants from
`references.track3_constants.R23`; controls (one constant moved) must fail the
comparison."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R23

T = 20


def polar_express(G, coeffs=R23.polar_express, steps=R23.ns_steps):
    """`zeropower_via_polar_express_long` (log:182-196) in float64."""
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / (np.linalg.norm(X) + R23.ns_eps)
    for step in range(steps):
        a, b, c = coeffs[min(step, len(coeffs) - 1)]
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if G.shape[0] > G.shape[1] else X


@dataclasses.dataclass
class Record:
    """#23's `MuownDP` and `AdamW` at T steps (the V-norm schedule over the run, as the
    log's ``v_norm_schedule_steps=train_steps``)."""

    lr: float = R23.muown_lr
    momentum: float = R23.momentum
    direction_scale: float = R23.direction_scale
    gain_betas: tuple = R23.gain_betas
    target: float = R23.v_norm_target
    mlp_proj_mult: float = R23.mlp_proj_mult
    zero_row_norm: float = R23.zero_row_norm
    coeffs: tuple = R23.polar_express
    cooldown_frac: float = R23.cooldown_frac
    schedule_steps: int = T

    def eta(self, step):
        """`lr_eta` (log:489-494)."""
        progress = step / T
        return 1.0 if progress < 1 - self.cooldown_frac else (1 - progress) / self.cooldown_frac

    def init_matrix(self, W):
        """`MuownDP._init_state_2d` (log:271-284)."""
        raw = np.linalg.norm(W, axis=1, keepdims=True)
        norm = np.where(raw <= R23.v_norm_eps, self.zero_row_norm,
                        np.maximum(raw, R23.v_norm_eps))
        return dict(g=norm.copy(), v_norm=norm.copy(), v_norm_init=norm.copy(),
                    m_v=np.zeros_like(W), m_g=np.zeros_like(norm), v_g=np.zeros_like(norm),
                    step=0)

    def step_matrix(self, name, W, grad, st, lr):
        """`MuownDP.step` (log:286-363) for one matrix."""
        st["step"] += 1
        step, g, v_norm = st["step"], st["g"], st["v_norm"]
        u = W / g                                                  # _wn_pre_ns, log:199-205
        v = u * v_norm
        grad_g = (grad * u).sum(axis=1, keepdims=True)
        grad_v = (g / v_norm) * (grad - u * grad_g)
        st["m_v"] = self.momentum * st["m_v"] + grad_v
        update = polar_express(grad_v + self.momentum * st["m_v"], self.coeffs)
        scale = self.direction_scale * max(update.shape) ** 0.5
        v_new = v - lr * scale * update
        b1, b2 = self.gain_betas
        st["m_g"] = b1 * st["m_g"] + (1 - b1) * grad_g
        st["v_g"] = b2 * st["v_g"] + (1 - b2) * grad_g * grad_g
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        st["g"] = g - lr * (st["m_g"] / bc1) / (np.sqrt(st["v_g"] / bc2) + R23.gain_eps)
        W = st["g"] * (v_new / np.maximum(np.linalg.norm(v_new, axis=1, keepdims=True),
                                          R23.v_norm_eps))         # _wn_recompose, log:208
        target = self.target * (self.mlp_proj_mult if "mlp/c_proj" in name else 1.0)
        p = min(max(step - 1, 0) / (self.schedule_steps - 1), 1.0)  # log:213-220
        progress = p * p * (3.0 - 2.0 * p)
        st["v_norm"] = st["v_norm_init"] + (target - st["v_norm_init"]) * progress
        return W

    def run(self, weights, grads_by_step):
        w, state, out = dict(weights), {}, []
        for n, x in w.items():
            state[n] = (self.init_matrix(x) if PARAMS[n][1] == "muown"
                        else dict(m=np.zeros_like(x), v=np.zeros_like(x)))
        for step, grads in enumerate(grads_by_step):
            eta = self.eta(step)
            for n, g in grads.items():
                group, st = PARAMS[n][1], state[n]
                if group == "muown":
                    w[n] = self.step_matrix(n, w[n], g, st, self.lr * eta)
                else:
                    (b1, b2), t, lr = R23.adam_betas, step + 1, group * eta
                    st["m"] = b1 * st["m"] + (1 - b1) * g
                    st["v"] = b2 * st["v"] + (1 - b2) * g * g
                    denom = np.sqrt(st["v"]) / np.sqrt(1 - b2**t) + R23.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * st["m"] / denom
            out.append(dict(w))
        return out


PARAMS = {  # our (in, out) layout
    "wte/embedding": ((32, 16), R23.embed_lr),
    "blocks/0/ln_1/scale": ((16,), R23.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "muown"),
    "blocks/0/attn/c_q/bias": ((16,), R23.vector_lr),
    "blocks/0/attn/c_proj/kernel": ((16, 16), "muown"),
    "blocks/0/mlp/c_fc/kernel": ((16, 48), "muown"),
    "blocks/0/mlp/c_proj/kernel": ((48, 16), "muown"),
    "lm_head/kernel": ((16, 32), R23.head_lr),
    "lm_head/bias": ((32,), R23.vector_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "muown"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    """The record's init (its projections zero, the other matrices normal with std
    sqrt(0.33/fan_in)) and one gradient per leaf and step."""
    rng = np.random.default_rng(seed)
    weights = {}
    for n, (s, _) in PARAMS.items():
        if n.endswith("c_proj/kernel"):
            weights[n] = np.zeros(s)
        elif n in MATRICES:
            weights[n] = rng.standard_normal(s) * (0.33 / s[0]) ** 0.5
        else:
            weights[n] = 0.1 * rng.standard_normal(s)
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_muown(T, ns_dtype="float64", **hyperparameters)
        params = nest(w, dtype=None)
        state, out, update = tx.init(params), [], jax.jit(tx.update)
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(weights, grads, **control):
    return Record(**control).run(torch_layout(weights), [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


@pytest.fixture(scope="module")
def run():
    return ours(*problem())


def test_matches_its_record_in_float64(run):
    assert worst(run, reference(*problem())) < 1e-10


@pytest.mark.parametrize("control", [
    dict(lr=R23.muown_lr * 1.03), dict(momentum=0.94), dict(direction_scale=0.21),
    dict(gain_betas=(0.91, 0.95)), dict(gain_betas=(0.9, 0.96)), dict(target=2.75),
    dict(mlp_proj_mult=3.0), dict(zero_row_norm=0.6), dict(schedule_steps=T + 2),
    dict(coeffs=(*R23.polar_express[:-1], (1.9, -1.25, 0.375))), dict(cooldown_frac=0.68)])
def test_a_moved_constant_fails_the_comparison(run, control):
    assert worst(run, reference(*problem(), **control)) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_muown.defaults
    assert recipes.track3_muown.record_steps == R23.steps
    assert (t.muon_learning_rate, t.muon_momentum, t.radius_target, t.mlp_proj_radius_mult,
            (t.gain_b1, t.gain_b2), t.gain_eps, t.cooldown_frac) == (
        R23.muown_lr, R23.momentum, R23.v_norm_target, R23.mlp_proj_mult, R23.gain_betas,
        R23.gain_eps, R23.cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R23.embed_lr, R23.head_lr, R23.vector_lr, R23.adam_betas, R23.adam_eps)
    pe = recipes.MUOWN_POLAR_EXPRESS
    assert len(pe) == R23.ns_steps and pe[:8] == R23.polar_express
    assert set(pe[7:]) == {R23.polar_express[-1]}
