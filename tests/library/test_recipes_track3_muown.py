"""`recipes.track3_muown` (#23) and `recipes.track3_contra_normuown` (#31) against a
float64 numpy transcription of modded-nanogpt Track 3 results #23's and #31's optimizers
(their logs' `zeropower_via_polar_express_long`, `_wn_pre_ns`, `_wn_recompose`,
`_smoothstep_v_norm` / `_power_v_norm`, #31's `scale_to_unit_operator_norm`,
`contra_coeff_schedule` and `_normuon_renorm`, `MuownDP._init_state_2d` and
`MuownDP.step`, the aux AdamW, `lr_eta`/`set_hparams`) on PyTorch's (out, in) layout, over
a run that crosses the cooldown, the whole V-norm schedule and #31's Contra-Muon fade,
with zero-initialised projections (their rows get the records' gain sqrt(0.33) at the
first update). Constants from `references.track3_constants.R23`/`R31`; controls (one
constant moved) must fail the comparison."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R23, R31

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


def unit_operator_norm(G, iterations=R31.power_iterations, eps=R31.power_eps):
    """#31's `scale_to_unit_operator_norm` (log:190-200)."""
    v = np.ones(G.shape[-1])
    v = v / max(np.linalg.norm(v), eps)
    for _ in range(iterations):
        u = G @ v
        u = u / max(np.linalg.norm(u), eps)
        v = G.T @ u
        v = v / max(np.linalg.norm(v), eps)
    return G / max(np.linalg.norm(G @ v), eps)


def scaled(steps, record_steps):
    """A step constant of a record at a run of T of its steps."""
    return round(steps * T / record_steps)


@dataclasses.dataclass
class Record:
    """#23's (by default) or #31's `MuownDP` and `AdamW` at T steps: #23's V-norm schedule
    runs over the run (``v_norm_schedule_steps=train_steps``), #31's step constants are
    scaled from its 3000 steps."""

    R: type = R23
    lr: float = R23.muown_lr
    momentum: float = R23.momentum
    direction_scale: float = R23.direction_scale
    gain_betas: tuple = R23.gain_betas
    target: float = R23.v_norm_target
    mults: tuple = (("mlp/c_proj", R23.mlp_proj_mult),)  # V_NORM_FAMILY_MULT by path
    zero_row_norm: float = R23.zero_row_norm
    coeffs: tuple = R23.polar_express
    cooldown_frac: float = R23.cooldown_frac
    lr_steps: int = T               # #31: LR_SCHEDULE_STEPS
    lr_power: float = 1.0           # #31: LR_POWER
    schedule_steps: int = T
    radius_power: float | None = None  # None: #23's smoothstep; #31: p^0.9
    contra: tuple | None = None     # #31: (CONTRA_MUON, CONTRA_TO_NORMAL_END_STEP)
    normuon_beta2: float | None = None  # #31: NOR_MUON_BETA2

    def eta(self, step):
        """`lr_eta` (#23 log:489-494; #31 log:566-571)."""
        progress = step / self.lr_steps
        if progress < 1 - self.cooldown_frac:
            return 1.0
        return ((1 - progress) / self.cooldown_frac) ** self.lr_power

    def direction(self, st, update_pre_ns, step):
        """Polar Express, then #31's Contra-Muon and NorMuon-lite (log:377-395)."""
        update = polar_express(update_pre_ns, self.coeffs)
        if self.contra is not None:
            c, end = self.contra
            coeff = (c / 2) * (1.0 - min(1.0, max(0.0, step / end)))  # log:202-209
            if coeff != 0.0:
                fro = max(np.linalg.norm(update), 1e-10)
                update = update - coeff * unit_operator_norm(update_pre_ns)
                update = update * (fro / max(np.linalg.norm(update), 1e-10))
        if self.normuon_beta2 is not None:  # _normuon_renorm, log:240-253
            axis = -1 if update.shape[-2] >= update.shape[-1] else -2
            var = (update * update).mean(axis=axis, keepdims=True)
            st["sm"] = st["sm"] + (1 - self.normuon_beta2) * (var - st["sm"])
            vnorm = np.linalg.norm(update)
            update = update / np.sqrt(np.maximum(st["sm"], 1e-10))
            update = update * (vnorm / max(np.linalg.norm(update), 1e-10))
        return update

    def init_matrix(self, W):
        """`MuownDP._init_state_2d` (log:271-284)."""
        raw = np.linalg.norm(W, axis=1, keepdims=True)
        norm = np.where(raw <= R23.v_norm_eps, self.zero_row_norm,
                        np.maximum(raw, R23.v_norm_eps))
        tall = W.shape[0] >= W.shape[1]
        return dict(g=norm.copy(), v_norm=norm.copy(), v_norm_init=norm.copy(),
                    m_v=np.zeros_like(W), m_g=np.zeros_like(norm), v_g=np.zeros_like(norm),
                    sm=np.zeros((W.shape[0], 1)) if tall else np.zeros((1, W.shape[1])),
                    step=0)

    def step_matrix(self, name, W, grad, st, lr, global_step):
        """`MuownDP.step` (log:286-363) for one matrix."""
        st["step"] += 1
        step, g, v_norm = st["step"], st["g"], st["v_norm"]
        u = W / g                                                  # _wn_pre_ns, log:199-205
        v = u * v_norm
        grad_g = (grad * u).sum(axis=1, keepdims=True)
        grad_v = (g / v_norm) * (grad - u * grad_g)
        st["m_v"] = self.momentum * st["m_v"] + grad_v
        update = self.direction(st, grad_v + self.momentum * st["m_v"], global_step)
        scale = self.direction_scale * max(update.shape) ** 0.5
        v_new = v - lr * scale * update
        b1, b2 = self.gain_betas
        st["m_g"] = b1 * st["m_g"] + (1 - b1) * grad_g
        st["v_g"] = b2 * st["v_g"] + (1 - b2) * grad_g * grad_g
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        st["g"] = g - lr * (st["m_g"] / bc1) / (np.sqrt(st["v_g"] / bc2) + R23.gain_eps)
        W = st["g"] * (v_new / np.maximum(np.linalg.norm(v_new, axis=1, keepdims=True),
                                          R23.v_norm_eps))         # _wn_recompose, log:208
        target = self.target * dict(self.mults).get(name.split("/", 2)[2][:-7], 1.0)
        p = min(max(step - 1, 0) / (self.schedule_steps - 1), 1.0)  # #23 log:213, #31 :255
        progress = p * p * (3.0 - 2.0 * p) if self.radius_power is None else p**self.radius_power
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
                    w[n] = self.step_matrix(n, w[n], g, st, self.lr * eta, step)
                else:
                    lr0 = getattr(self.R, f"{group}_lr")
                    (b1, b2), t, lr = self.R.adam_betas, step + 1, lr0 * eta
                    st["m"] = b1 * st["m"] + (1 - b1) * g
                    st["v"] = b2 * st["v"] + (1 - b2) * g * g
                    denom = np.sqrt(st["v"]) / np.sqrt(1 - b2**t) + self.R.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * st["m"] / denom
            out.append(dict(w))
        return out


PARAMS = {  # our (in, out) layout
    "wte/embedding": ((32, 16), "embed"),
    "blocks/0/ln_1/scale": ((16,), "vector"),
    "blocks/0/attn/c_q/kernel": ((16, 16), "muown"),
    "blocks/0/attn/c_q/bias": ((16,), "vector"),
    "blocks/0/attn/c_proj/kernel": ((16, 16), "muown"),
    "blocks/0/mlp/c_fc/kernel": ((16, 48), "muown"),
    "blocks/0/mlp/c_proj/kernel": ((48, 16), "muown"),
    "lm_head/kernel": ((16, 32), "head"),
    "lm_head/bias": ((32,), "vector"),
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


def ours(weights, grads, recipe=recipes.track3_muown, **hyperparameters):
    def run(w, gs):
        tx = recipe(T, ns_dtype="float64", **hyperparameters)
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
    dict(mults=(("mlp/c_proj", 3.0),)), dict(zero_row_norm=0.6), dict(schedule_steps=T + 2),
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


# ---- #31: Contra-Muon and NorMuon-lite on Muown's directions, powered schedules

R31_REF = dict(
    R=R31, lr=R31.muown_lr, momentum=R31.momentum, gain_betas=R31.gain_betas,
    target=R31.v_norm_target, mults=(("attn/c_proj", R31.attn_proj_mult),
                                     ("mlp/c_fc", R31.mlp_fc_mult),
                                     ("mlp/c_proj", R31.mlp_proj_mult)),
    lr_steps=scaled(R31.lr_schedule_steps, R31.steps), lr_power=R31.lr_power,
    cooldown_frac=R31.cooldown_frac, schedule_steps=scaled(R31.v_norm_steps, R31.steps),
    radius_power=R31.v_norm_power, contra=(R31.contra_muon, scaled(R31.contra_end, R31.steps)),
    normuon_beta2=R31.normuon_beta2)


@pytest.fixture(scope="module")
def run31():
    return ours(*problem(), recipe=recipes.track3_contra_normuown)


def test_contra_normuown_matches_its_record_in_float64(run31):
    assert worst(run31, reference(*problem(), **R31_REF)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(contra=(0.67, scaled(R31.contra_end, R31.steps))),
    dict(contra=(R31.contra_muon, scaled(R31.contra_end, R31.steps) + 2)), dict(contra=None),
    dict(normuon_beta2=0.82), dict(normuon_beta2=None), dict(radius_power=0.95),
    dict(radius_power=None), dict(schedule_steps=R31_REF["schedule_steps"] + 2),
    dict(lr_power=0.95), dict(lr_steps=R31_REF["lr_steps"] + 2), dict(momentum=0.95),
    dict(target=2.55), dict(mults=(("mlp/c_proj", R31.mlp_proj_mult),))])
def test_a_moved_constant_fails_the_contra_normuown_comparison(run31, control):
    assert worst(run31, reference(*problem(), **(R31_REF | control))) > 1e-6


def test_contra_normuowns_defaults_are_the_records():
    t = recipes.track3_contra_normuown.defaults
    assert recipes.track3_contra_normuown.record_steps == R31.steps
    assert (t.muon_learning_rate, t.muon_momentum, t.contra_muon, t.contra_end, t.muon_beta2,
            t.radius_target, t.attn_proj_radius_mult, t.mlp_fc_radius_mult,
            t.mlp_proj_radius_mult, t.radius_steps, t.radius_power, (t.gain_b1, t.gain_b2),
            t.gain_eps) == (
        R31.muown_lr, R31.momentum, R31.contra_muon, R31.contra_end, R31.normuon_beta2,
        R31.v_norm_target, R31.attn_proj_mult, R31.mlp_fc_mult, R31.mlp_proj_mult,
        R31.v_norm_steps, R31.v_norm_power, R31.gain_betas, R31.gain_eps)
    assert (t.schedule_steps, t.cooldown_frac, t.cooldown_power) == (
        R31.lr_schedule_steps, R31.cooldown_frac, R31.lr_power)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R31.embed_lr, R31.head_lr, R31.vector_lr, R31.adam_betas, R31.adam_eps)
