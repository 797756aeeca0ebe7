"""`recipes.track3_soaph` against a float64 numpy transcription of modded-nanogpt Track 3
result #27's optimizer (its script `train_gpt_simple_soaph.py`: `_initial_orthogonal_matrix`,
`soap_update`, `SOAPH._init_state/_refresh_q/_step_param`, `scale_invariant_update_`, the
aux AdamW, `_eta`/`set_hparams`), on PyTorch's (out, in) layout (our (in, out) kernels
transposed in and back), over a run that crosses the aux groups' cooldown start and the
matrices' whole power decay. After every update the weights, the first moment, the Gram
factors and the second moment in the eigenbasis are compared (the bases themselves only
up to their columns' signs, which the update does not see).

Eigenbases of rank-deficient Grams are arbitrary on the null space (LAPACK-dependent) and
SOAP's elementwise division there is not rotation-invariant: the first gradient of every
matrix is a rectangular diagonal with distinct entries (`references.soap.first_gradient`),
so both sides' `eigh` return signed axis vectors, and the matrices' aspect ratios are <= 2,
so the second random gradient makes every Gram full rank. One matrix's gradients are
scaled to 1e-8 so that SOAP's eps counts. Every constant is typed in from the log
(`references.track3_constants.R27`); controls (one constant moved) must fail."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import SoapState, recipes
from references.error import run_in_float64
from references.soap import first_gradient
from references.track3 import adam_step, flatten, nest
from references.track3_constants import R27

T = 40  # aux groups flat for steps 0-23, then linear to 0; matrices (1 - t/41)^1.25
LR_STEPS = round(R27.lr_steps * T / R27.steps)  # the record's 3200 at 3125, scaled: 41


def eta(progress, cooldown_frac, power, floor):
    """`_eta` (log:520-525)."""
    if progress < 1.0 - cooldown_frac:
        return 1.0
    x = max(0.0, (1.0 - progress) / cooldown_frac)
    return floor + (1.0 - floor) * x ** power


def initial_orthogonal_matrix(m):
    """`_initial_orthogonal_matrix` (log:175-183): eigh of the symmetrised matrix, flipped."""
    m = 0.5 * (m + m.T)
    return np.flip(np.linalg.eigh(m + 1e-30 * np.eye(m.shape[0]))[1], 1)


def sorted_qr(gram, q):
    """SOAP-Muon's refresh (#44/#46's `soap_basis_qr`): a control, #27 does not sort."""
    order = np.argsort(-np.diag(q.T @ gram @ q), kind="stable")
    return np.linalg.qr(gram @ q[:, order])[0]


@dataclasses.dataclass
class Record27:
    """#27's SOAPH and aux AdamW on float64 torch-layout weights; `groups`: name -> "soap"
    or the aux lr. The controls: `beta_v` moves only the square buffer's decay,
    `beta_lr` only the Gram factors', `refresh` replaces `_refresh_q`."""

    groups: dict
    lr: float = R27.lr
    lr_steps: int = LR_STEPS
    lr_power: float = R27.lr_power
    momentum: float = R27.momentum
    beta_v: float = R27.ema_beta
    beta_lr: float = R27.ema_beta
    eps: float = R27.eps
    q_freq: int = R27.q_freq
    adam_cooldown_frac: float = R27.adam_cooldown_frac
    refresh: str = "qr"

    def soap(self, w, g, state):  # SOAPH._step_param, log:316-363
        if not state:  # _init_state, log:271-292: bases from this gradient
            state.update(step=0, m=np.zeros_like(g), V=np.zeros_like(g),
                         L=np.zeros((g.shape[0],) * 2), R=np.zeros((g.shape[1],) * 2),
                         QL=initial_orthogonal_matrix(g @ g.T),
                         QR=initial_orthogonal_matrix(g.T @ g))
        state["step"] += 1
        s = state
        s["m"] = s["m"] + (1 - self.momentum) * (g - s["m"])            # lerp_, :200
        s["L"] = s["L"] * self.beta_lr + (1 - self.beta_lr) * (g @ g.T)  # :205-210
        s["R"] = s["R"] * self.beta_lr + (1 - self.beta_lr) * (g.T @ g)  # :212-217
        PM = s["QL"].T @ s["m"] @ s["QR"]                                # :220
        PG = s["QL"].T @ g @ s["QR"]                                     # :221
        s["V"] = s["V"] * self.beta_v + (1 - self.beta_v) * PG * PG      # :224-228
        U = s["QL"] @ (PM / (np.sqrt(s["V"]) + self.eps)) @ s["QR"].T   # :231-232
        if s["step"] % self.q_freq == 0:                                 # _refresh_q, :295-313
            if self.refresh == "qr":
                s["QL"] = np.linalg.qr(s["L"] @ s["QL"])[0]
                s["QR"] = np.linalg.qr(s["R"] @ s["QR"])[0]
            elif self.refresh == "sorted":
                s["QL"], s["QR"] = sorted_qr(s["L"], s["QL"]), sorted_qr(s["R"], s["QR"])
            else:  # "eigh": the exact eigenbasis
                s["QL"] = initial_orthogonal_matrix(s["L"])
                s["QR"] = initial_orthogonal_matrix(s["R"])
        p_norm = np.linalg.norm(w)                                       # :164-168
        new = w - self.lr_now * U * p_norm / max(np.linalg.norm(U), R27.hyperball_eps)
        return new / max(np.linalg.norm(new), R27.hyperball_eps) * p_norm

    def run(self, weights, grads_by_step):
        w, state, out = dict(weights), {}, []
        for step, grads in enumerate(grads_by_step):
            self.lr_now = self.lr * eta(step / self.lr_steps, 1.0, self.lr_power, R27.lr_floor)
            scale = eta(step / T, self.adam_cooldown_frac, 1.0, 0.0)
            for n, g in grads.items():
                if self.groups[n] == "soap":
                    w[n] = self.soap(w[n], g, state.setdefault(n, {}))
                else:  # torch.optim.AdamW, no decay
                    m, v, t = state.get(n, (np.zeros_like(g), np.zeros_like(g), 0))
                    w[n], m, v = adam_step(w[n], g, m, v, t + 1, self.groups[n] * scale,
                                           *R27.adam_betas, R27.adam_eps, bias_correction=True)
                    state[n] = (m, v, t + 1)
            out.append((dict(w), {n: {k: s[k] for k in ("m", "V", "L", "R")}
                                  for n, s in state.items() if isinstance(s, dict)}))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes and #27's group
    "wte/embedding": ((16, 8), R27.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R27.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "soap"),
    "blocks/0/attn/c_q/bias": ((16,), R27.vector_lr),
    "blocks/0/attn/c_k/kernel": ((16, 16), "soap"),     # gradients x 1e-8: eps counts
    "blocks/0/mlp/c_fc/kernel": ((16, 32), "soap"),
    "blocks/0/mlp/c_proj/kernel": ((32, 16), "soap"),
    "lm_head/kernel": ((16, 16), R27.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "soap"]
SMALL = "blocks/0/attn/c_k/kernel"


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = []
    for t in range(T):
        g = {n: (first_gradient(s, rng) if t == 0 and n in MATRICES else rng.standard_normal(s))
             for n, (s, _) in PARAMS.items()}
        g[SMALL] = 1e-8 * g[SMALL]
        grads.append(g)
    return weights, grads


def soap_states(state):
    """The `SoapState` inside the recipe's state."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, SoapState))
             if isinstance(s, SoapState)]
    assert len(found) == 1
    return found[0]


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_soaph(T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        step = jax.jit(tx.update)
        for g in gs:
            updates, state = step(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            s = soap_states(state)
            mats = {n: m for n, m in flatten_states(s.matrices).items()}
            mu = {n: x for n, x in flatten(_drop_masked(s.mu)).items()}
            out.append((params, {n: dict(m=mu[n], V=mats[n]["second_moment"],
                                         L=mats[n]["gram_out"], R=mats[n]["gram_in"])
                                 for n in MATRICES}))
        return out
    got = run_in_float64(run, weights, grads)
    return [(torch_layout(flatten(p)), {n: dict(st, m=st["m"].T) for n, st in s.items()})
            for p, s in got]


def _drop_masked(tree):
    return jax.tree.map(lambda x: None if isinstance(x, optax.MaskedNode) else x, tree,
                        is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def flatten_states(matrices):
    """Per matrix path, its `SoapMatrixState` fields."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(
            _drop_masked(matrices), is_leaf=lambda x: hasattr(x, "_fields"))[0]:
        if hasattr(x, "_fields"):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            out[name] = {f: np.asarray(getattr(x, f), np.float64) for f in x._fields}
    return out


def reference(weights, grads, **control):
    groups = {n: g for n, (_, g) in PARAMS.items()}
    return Record27(groups, **control).run(torch_layout(weights),
                                           [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    """The largest relative difference of weights and SOAP statistics over all steps."""
    rel = lambda a, b: np.max(np.abs(a - b) / (np.abs(b) + 1e-3 * np.max(np.abs(b))))
    err = 0.0
    for (wa, sa), (wb, sb) in zip(a_steps, b_steps, strict=True):
        err = max(err, max(rel(wa[n], wb[n]) for n in wb))
        err = max(err, max(rel(sa[n][k], sb[n][k]) for n in MATRICES for k in sb[n]))
    return err


@pytest.fixture(scope="module")
def runs():
    weights, grads = problem()
    return weights, grads, ours(weights, grads)


def test_track3_soaph_matches_result_27_in_float64(runs):
    weights, grads, got = runs
    assert worst(got, reference(weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(lr=R27.lr * 1.03), dict(lr_steps=LR_STEPS + 2), dict(lr_power=1.3),
    dict(momentum=0.96), dict(beta_v=0.91), dict(beta_lr=0.91), dict(eps=1.2e-8),
    dict(q_freq=2), dict(refresh="sorted"), dict(refresh="eigh"),
    dict(adam_cooldown_frac=0.42)])
def test_a_moved_constant_fails_the_comparison(runs, control):
    weights, grads, got = runs
    assert worst(got, reference(weights, grads, **control)) > 1e-8


def test_the_defaults_are_result_27s():
    t = recipes.track3_soaph.defaults
    assert (t.soap_learning_rate, t.soap_lr_steps, t.soap_lr_power, t.soap_lr_floor,
            t.soap_b1, t.soap_b2, t.shampoo_beta, t.soap_eps, t.precondition_frequency,
            t.pin, t.adam_cooldown_frac) == (
        R27.lr, R27.lr_steps, R27.lr_power, R27.lr_floor, R27.momentum, R27.ema_beta,
        R27.ema_beta, R27.eps, R27.q_freq, "current", R27.adam_cooldown_frac)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R27.embed_lr, R27.head_lr, R27.vector_lr, R27.adam_betas, R27.adam_eps)
    assert (t.factor_update, t.adam_lr_steps, t.adam_lr_power, t.adam_lr_floor) == (
        "gram", R27.steps, R27.adam_lr_power, R27.adam_lr_floor)
    assert recipes.track3_soaph.record_steps == R27.steps
    assert recipes.track3_soaph.defaults.scaled(T).soap_lr_steps == LR_STEPS
