"""`recipes.track3_contra_soft_muon` against a float64 numpy transcription of modded-nanogpt
Track 3 result #20's optimizer (its log's `gram_frobenius_norm_estimate`,
`zeropower_via_newtonschulz5`, `soft_via_newtonschulz5`, `scale_to_unit_operator_norm`,
`contra_coeff_for_step`, `soft_blend_for_step`, `muon_update`, `soap_precondition_momentum`,
`norm_preserving_blend`, `soap_update_preconditioner`, `soap_basis_qr`, `Muon.step`'s u/w
floor, the aux AdamW, `_lr`/`set_hparams`) on PyTorch's (out, in) layout. The run of T=40
steps crosses every step constant at the record's fractions (scaled from its 3040 steps):
Muon's and Adam's PowerCool knees, Contra-Muon's fade, Soft-Muon's rise and cap, and three
SOAP basis refreshes. Constants from `references.track3_constants.R20`; controls (one
constant moved) must fail the comparison."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.soap import first_gradient
from references.track3 import flatten, nest
from references.track3_constants import NS_COEFFICIENTS, R20

T = 40


def scaled(steps, n=T):
    """A step constant of the record at a run of ``n`` of its 3040 steps."""
    return round(steps * n / R20.steps)


def gram_norm(x, eps=R20.gram_eps):
    """`gram_frobenius_norm_estimate` (log:260-263)."""
    gram = x.T @ x if x.shape[-2] > x.shape[-1] else x @ x.T
    return max(np.sqrt(np.linalg.norm(gram)), eps)


def iterates(G):
    """`soft_via_newtonschulz5`'s basis (log:298-317): the normalised input and the 12
    iterates of (2, -1.5, 0.5); its last is `zeropower_via_newtonschulz5` (log:265-282)."""
    tall = G.shape[-2] > G.shape[-1]
    X = G.T if tall else G
    X = X / gram_norm(X, R20.ns_eps)
    basis = [X]
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
        basis.append(X)
    return [x.T for x in basis] if tall else basis


def soft(G, weights=R20.soft_weights, constant=R20.soft_constant):
    """`soft_via_newtonschulz5` with scale "none" (log:298-335)."""
    basis = iterates(G)
    out = constant * basis[-1]
    for coeff, term in zip(weights, basis[:-1], strict=True):
        out = out + coeff * term
    return out


def ramp(step, start, end):
    """`_linear_ramp` (log:510-513)."""
    if end <= start:
        return 1.0 if step >= end else 0.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


@dataclasses.dataclass
class Record:
    """#20's `Muon` (MLP+V SOAP) and `AdamW`, at T steps: the step constants scaled,
    PowerCool's c rescaled so that each flat part ends at the record's fraction."""

    contra_coeff: float = R20.contra_coeff
    contra_end: int = R20.contra_end
    soft_start: int = R20.soft_start
    soft_end: int = R20.soft_end
    soft_ceil: float = R20.soft_ceil
    soft_weights: tuple = R20.soft_weights
    beta2: float = R20.beta2
    normuon_gram: bool = True  # the log keeps ‖·‖₄ (vnorm = gram_frobenius_norm_estimate)
    target_uw: float = R20.target_uw
    muon_c: float = R20.muon_c
    t_end: int = R20.t_end
    soap_beta: float = R20.soap_beta
    soap_frequency: int = R20.soap_frequency
    v_blend: float = R20.v_blend
    v_denom_floor: float = R20.v_denom_floor

    def lr(self, step, lr0, c):
        """`_lr` (log:760-764) with c at the scaled t_end."""
        t_end = scaled(self.t_end)
        c = c * (self.t_end / t_end) ** R20.power
        return min(lr0, c * max(0.0, t_end - step) ** R20.power)

    def muon_update(self, update, st, step):
        """`muon_update` (log:522-546); ``st["sm"]`` the second moment."""
        normalized = update / gram_norm(update)
        ns = iterates(update)[-1]
        n = gram_norm(ns)
        cc = self.contra_coeff * (1.0 - ramp(step, R20.contra_hold_end, scaled(self.contra_end)))
        contra = ns + cc * normalized
        contra = contra * n / gram_norm(contra)
        s = soft(update, self.soft_weights)
        s = s * n / gram_norm(s)
        blend = min(self.soft_ceil, ramp(step, scaled(self.soft_start), scaled(self.soft_end)))
        u = contra + (s - contra) * blend
        u = u * n / gram_norm(u)
        u = u * max(1, u.shape[-2] / u.shape[-1]) ** 0.5
        axis = -1 if u.shape[-2] >= u.shape[-1] else -2
        st["sm"] += (1 - self.beta2) * ((u * u).mean(axis=axis, keepdims=True) - st["sm"])
        norm = gram_norm if self.normuon_gram else (lambda x: max(np.linalg.norm(x), 1e-10))
        vnorm = norm(u)
        u = u / np.sqrt(np.maximum(st["sm"], 1e-10))
        return u * (vnorm / norm(u))

    def soap(self, M, st, is_v):
        """`soap_precondition_momentum` (log:471-487), then V's `norm_preserving_blend`
        with gate 1 (log:445-449, :600-608)."""
        eps = R20.soap_eps
        if st["QL"] is not None:
            P = st["QL"].T @ M @ st["QR"]
            st["V"] = self.soap_beta * st["V"] + (1 - self.soap_beta) * P**2
            denom = np.maximum(st["V"], eps * eps) ** R20.soap_denom_power
            if is_v:
                floor = max(np.sqrt(np.mean(denom**2)) * self.v_denom_floor, eps)
                denom = np.maximum(denom, floor)
            D = st["QL"] @ (P / denom) @ st["QR"].T
            if is_v:
                D = self.v_blend * D + (1 - self.v_blend) * M
            M_out = D * (gram_norm(M, eps) / gram_norm(D, eps))
        else:
            M_out = M
        if is_v:
            M_out = M_out * (gram_norm(M, eps) / gram_norm(M_out, eps))
        return M_out

    def soap_statistics(self, grad, st):
        """`soap_update_preconditioner` (log:489-500) with `soap_eigenbasis` and
        `soap_basis_qr` (log:451-469), after the step."""
        b = self.soap_beta
        st["L"] += (1 - b) * (grad @ grad.T - st["L"])
        st["R"] += (1 - b) * (grad.T @ grad - st["R"])
        if st["QL"] is None:
            st["QL"] = np.flip(np.linalg.eigh(st["L"])[1], 1)
            st["QR"] = np.flip(np.linalg.eigh(st["R"])[1], 1)
        elif st["soap_step"] > 0 and st["soap_step"] % self.soap_frequency == 0:
            order = np.argsort(-np.diag(st["QL"].T @ st["L"] @ st["QL"]), kind="stable")
            st["V"] = st["V"][order]
            st["QL"] = np.linalg.qr(st["L"] @ st["QL"][:, order])[0]
            order = np.argsort(-np.diag(st["QR"].T @ st["R"] @ st["QR"]), kind="stable")
            st["V"] = st["V"][:, order]
            st["QR"] = np.linalg.qr(st["R"] @ st["QR"][:, order])[0]
        st["soap_step"] += 1

    def pulled(self, name, p, step):
        """The hidden matrix the step is subtracted from: #20's ``p`` itself (#32 mixes it
        toward its start there)."""
        return p

    def run(self, weights, grads_by_step):
        w, state, out = dict(weights), {}, []
        for n, x in w.items():
            group = PARAMS[n][1]
            if group in MUON:
                out_n, in_n = x.shape
                tall = out_n >= in_n
                state[n] = dict(mom=np.zeros_like(x),
                                sm=np.zeros((out_n, 1)) if tall else np.zeros((1, in_n)),
                                L=np.zeros((out_n, out_n)), R=np.zeros((in_n, in_n)),
                                QL=None, QR=None, V=np.zeros_like(x), soap_step=0)
            else:
                state[n] = dict(m=np.zeros_like(x), v=np.zeros_like(x))
        for step, grads in enumerate(grads_by_step):
            for n, g in grads.items():
                group, st = PARAMS[n][1], state[n]
                if group in MUON:
                    st["mom"] += (1 - R20.muon_mu) * (g - st["mom"])
                    M = g + R20.muon_mu * (st["mom"] - g)
                    if group != "plain":
                        M = self.soap(M, st, is_v=group == "soap_v")
                    u = self.muon_update(M, st, step)
                    p_fro = max(np.linalg.norm(w[n]), 1e-8)
                    u_fro = max(np.linalg.norm(u), 1e-8)
                    if u_fro / p_fro < self.target_uw:
                        u = u * (self.target_uw * p_fro / u_fro)
                    w[n] = self.pulled(n, w[n], step) - self.lr(step, R20.muon_lr,
                                                                 self.muon_c) * u
                    if group != "plain":
                        self.soap_statistics(g, st)
                else:
                    lr0, c = ADAM[group]
                    (b1, b2), t, lr = R20.adam_betas, step + 1, self.lr(step, lr0, c)
                    st["m"] += (1 - b1) * (g - st["m"])
                    st["v"] = b2 * st["v"] + (1 - b2) * g * g
                    denom = np.sqrt(st["v"]) / np.sqrt(1 - b2**t) + R20.adam_eps
                    w[n] = w[n] - lr / (1 - b1**t) * st["m"] / denom
            out.append(dict(w))
        return out


ADAM = {"embed": (R20.embed_lr, R20.embed_c), "head": (R20.head_lr, R20.head_c),
        "vectors": (R20.vector_lr, R20.vector_c)}
MUON = ("plain", "soap_mlp", "soap_v")
PARAMS = {  # our (in, out) layout; the MLP 2x wide so that two gradients fill its Grams
    "wte/embedding": ((32, 16), "embed"),
    "blocks/0/ln_1/scale": ((16,), "vectors"),
    "blocks/0/attn/c_q/kernel": ((16, 16), "plain"),
    "blocks/0/attn/c_q/bias": ((16,), "vectors"),
    "blocks/0/attn/c_v/kernel": ((16, 16), "soap_v"),
    "blocks/0/attn/c_proj/kernel": ((16, 16), "plain"),
    "blocks/0/mlp/c_fc/kernel": ((16, 32), "soap_mlp"),
    "blocks/0/mlp/c_proj/kernel": ((32, 16), "soap_mlp"),
    "lm_head/kernel": ((16, 32), "head"),
    "lm_head/bias": ((32,), "vectors"),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g in MUON]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0, scale=0.1):
    """Weights, and per step a gradient per leaf; the SOAP matrices' first is a
    rectangular diagonal (distinct Gram eigenvalues: both sides' first eigenbases are
    the axes)."""
    rng = np.random.default_rng(seed)
    weights = {n: scale * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: first_gradient(s, rng) if t == 0 and g.startswith("soap")
              else rng.standard_normal(s) for n, (s, g) in PARAMS.items()} for t in range(T)]
    return weights, grads


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_contra_soft_muon(T, ns_dtype="float64", **hyperparameters)
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
def runs():
    """Ours on both problems (the u/w floor inactive at scale 0.1, binding at 3)."""
    return {scale: ours(*problem(scale=scale)) for scale in (0.1, 3.0)}


@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_matches_its_record_in_float64(runs, scale):
    assert worst(runs[scale], reference(*problem(scale=scale))) < 1e-10


@pytest.mark.parametrize("control", [
    dict(contra_coeff=-0.205), dict(contra_coeff=0.0), dict(contra_end=2100),
    dict(soft_start=2400), dict(soft_end=2900), dict(soft_ceil=0.78), dict(soft_ceil=0.0),
    dict(soft_weights=(*R20.soft_weights[:-1], 0.12)), dict(beta2=0.96),
    dict(target_uw=0.39), dict(muon_c=R20.muon_c * 1.03), dict(t_end=3150),
    dict(soap_beta=0.91), dict(soap_frequency=9), dict(v_blend=0.93), dict(v_denom_floor=0.6),
    dict(v_blend=1.0, v_denom_floor=0.0)])
def test_a_moved_constant_fails_the_comparison(runs, control):
    assert worst(runs[3.0], reference(*problem(scale=3.0), **control)) > 1e-6


def test_the_norm_normuon_keeps_is_the_logs(runs):
    """NorMuon-lite keeps ‖·‖₄ (the log's vnorm), not the Frobenius norm (#11's): seen
    where the u/w floor does not rescale the step (at scale 3 it binds on every matrix)."""
    assert worst(runs[0.1], reference(*problem(scale=0.1), normuon_gram=False)) > 1e-6


def test_the_defaults_are_the_records():
    t = recipes.track3_contra_soft_muon.defaults
    assert recipes.track3_contra_soft_muon.record_steps == R20.steps
    assert (t.muon_learning_rate, t.muon_momentum, t.muon_beta2, t.uw_floor) == (
        R20.muon_lr, R20.muon_mu, R20.beta2, R20.target_uw)
    assert (t.power_cool_end, t.power_cool_power, t.muon_power_cool_c, t.embed_power_cool_c,
            t.head_power_cool_c, t.vector_power_cool_c) == (
        R20.t_end, R20.power, R20.muon_c, R20.embed_c, R20.head_c, R20.vector_c)
    assert (-t.contra_muon / 2, t.contra_end, t.soft_power, t.soft_start, t.soft_end,
            t.soft_cap) == (R20.contra_coeff, R20.contra_end, R20.soft_p, R20.soft_start,
                            R20.soft_end, R20.soft_ceil)
    assert (t.soap_beta, t.soap_frequency, t.v_soap_blend, t.v_soap_denom_floor) == (
        R20.soap_beta, R20.soap_frequency, R20.v_blend, R20.v_denom_floor)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R20.embed_lr, R20.head_lr, R20.vector_lr, R20.adam_betas, R20.adam_eps)


def test_the_learning_rates_at_the_records_length_are_its_power_cool():
    """At 3040 steps every group's schedule is the log's ``_lr`` at every step."""
    stack = recipes.track3_contra_soft_muon.stack(R20.steps)
    steps = np.arange(R20.steps)
    want = [min(R20.muon_lr, R20.muon_c * max(0.0, R20.t_end - s) ** R20.power)
            for s in steps]
    np.testing.assert_allclose(np.asarray(stack.learning_rate(steps)), want, rtol=1e-6)
