"""`recipes.track3_klsoap` (#19) and `recipes.track3_klsoap_power_decay` (#25) against a
float64 numpy transcription of modded-nanogpt Track 3's KL-SOAP-H (#19's log
`klsoap-h-b1095_sh090-K3125-seed-1.full.txt`, whose optimizer code #25's
`train_gpt_simple_klsoap_h_lr_power_decay.py` repeats: `init_2d_klsoap_state_`,
`_update_eigen_sqrt_inv_`, `update_2d_klsoap_preconditioner_`, `refresh_klsoap_basis_`,
`klsoap_direction`, `KLSOAPH.step`, `scale_invariant_update_`, the aux AdamW and each
log's `set_hparams`), on PyTorch's (out, in) layout, over runs that cross the aux
cooldown's start and the whole matrix decay. After every update the weights, the first
moment (the log keeps it in the eigenbasis: compared in the weights' basis), the factors
``L``, ``R``, the second moment and the eigenvalue inverse roots are compared.

As for SOAP-H (`test_recipes_track3_soaph`): each matrix's first gradient is a rectangular
diagonal (both sides' `eigh` return signed axis vectors on the rank-deficient Gram), the
aspect ratios are <= 2, and one matrix's gradients are 1e-8 so that eps counts. The
inverse roots' clamp at 4000 is reached only when a factor's eigenvalue has decayed below
6.25e-8: a second comparison runs both sides with ``shampoo_beta=0.5`` so that the 1e-8
matrix reaches it within the run. Constants: `references.track3_constants.R19`, `R25`;
controls (one constant moved) must fail."""

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
from references.track3_constants import R19, R25

T = 40
HORIZON25 = round(R25.schedule_steps * T / R25.steps)  # #25's 3125 at 3040, scaled: 41


def eta(progress, cooldown_frac, power=1.0, floor=0.0):
    """#19's `set_hparams` (log:414-424; power 1, floor 0) and #25's (log:422-433)."""
    if progress < 1 - cooldown_frac:
        return 1.0
    x = (1 - progress) / cooldown_frac
    return floor + (1 - floor) * x ** power


def schedules(record, horizon=None):
    """Per step, (matrix lr multiplier, aux multiplier) of a record at T steps."""
    if record == "19":
        return lambda t: (eta(t / T, R19.cooldown_frac), eta(t / T, R19.adam_cooldown_frac))
    h = horizon or HORIZON25
    return lambda t: (eta(t / h, R25.cooldown_frac, R25.lr_power, R25.klsoap_lr_floor),
                      eta(t / h, R25.adam_cooldown_frac, R25.lr_power, R25.adam_lr_floor))


def initial_orthogonal_matrix(m):
    """`_initial_orthogonal_matrix` (log:175-183)."""
    m = 0.5 * (m + m.T)
    return np.flip(np.linalg.eigh(m + 1e-30 * np.eye(m.shape[0]))[1], 1)


def nan_to_num(x):
    return np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


@dataclasses.dataclass
class RecordKL:
    """KLSOAPH and the aux AdamW on float64 torch-layout weights; `groups`: name -> "kl"
    or the aux lr. `factors="gram"` (a control) takes SOAP's Gram EMA instead of the KL
    targets; `first_step=True` (a control) steps at the first update too."""

    groups: dict
    schedule: object
    lr: float = R19.lr
    beta1: float = R19.beta1
    beta2: float = R19.beta2
    shampoo_beta: float = R19.shampoo_beta
    eps: float = R19.eps
    freq: int = R19.precondition_frequency
    init_factor: float = R19.init_factor
    max_inverse_root: float = R19.max_inverse_root
    factors: str = "kl"
    first_step: bool = False

    def update_inverse_root(self, inv, diag):  # _update_eigen_sqrt_inv_, log:218-223
        old = nan_to_num(1 / np.square(inv))
        eigen = self.shampoo_beta * old + (1 - self.shampoo_beta) * diag
        root = np.minimum(1 / np.sqrt(np.maximum(eigen, R19.eigen_floor)), self.max_inverse_root)
        return nan_to_num(root)

    def klsoap(self, w, g, s, lr):  # KLSOAPH.step, log:284-302
        rows, cols = g.shape
        if not s:  # init_2d_klsoap_state_, log:196-215
            s.update(step=0, L=g @ g.T / cols, R=g.T @ g / rows, m=np.zeros_like(g),
                     V=np.zeros_like(g))
            s["QL"], s["QR"] = initial_orthogonal_matrix(s["L"]), initial_orthogonal_matrix(s["R"])
            s["inv"] = [np.full(rows, self.init_factor ** -0.5),
                        np.full(cols, self.init_factor ** -0.5)]
            if not self.first_step:
                return w  # continue: no step at the first update
        s["step"] += 1
        QL, QR, beta = s["QL"], s["QR"], self.shampoo_beta
        P = QL.T @ g @ QR                                    # klsoap_direction, :261-266
        s["m"] = s["m"] * self.beta1 + (1 - self.beta1) * P
        s["V"] = s["V"] * self.beta2 + (1 - self.beta2) * P * P
        U = QL @ (s["m"] / (np.sqrt(s["V"]) + self.eps)) @ QR.T
        inv_left, inv_right = s["inv"]                       # :227-248
        if self.factors == "kl":
            rw = (QR.T @ g.T) * inv_right[:, None]
            left_target = rw.T @ rw / cols
            lw = (QL.T @ g) * inv_left[:, None]
            right_target = lw.T @ lw / rows
        else:
            left_target, right_target = g @ g.T, g.T @ g
        s["L"] = s["L"] * beta + (1 - beta) * left_target
        s["R"] = s["R"] * beta + (1 - beta) * right_target
        s["L"], s["R"] = 0.5 * (s["L"] + s["L"].T), 0.5 * (s["R"] + s["R"].T)
        left_diag = np.square(P * inv_right[None, :]).mean(1)
        right_diag = np.square(P * inv_left[:, None]).mean(0)
        s["inv"] = [self.update_inverse_root(inv_left, left_diag),
                    self.update_inverse_root(inv_right, right_diag)]
        if s["step"] % self.freq == 0:                       # refresh_klsoap_basis_, :251-258
            m = QL @ s["m"] @ QR.T
            s["QL"] = np.linalg.qr(s["L"] @ QL)[0]
            s["QR"] = np.linalg.qr(s["R"] @ QR)[0]
            s["m"] = s["QL"].T @ m @ s["QR"]
        p_norm = np.linalg.norm(w)                            # scale_invariant_update_
        new = w - lr * U * p_norm / max(np.linalg.norm(U), R19.hyperball_eps)
        return new / max(np.linalg.norm(new), R19.hyperball_eps) * p_norm

    def run(self, weights, grads_by_step):
        w, state, out = dict(weights), {}, []
        for step, grads in enumerate(grads_by_step):
            kl_scale, adam_scale = self.schedule(step)
            for n, g in grads.items():
                if self.groups[n] == "kl":
                    w[n] = self.klsoap(w[n], g, state.setdefault(n, {}), self.lr * kl_scale)
                else:
                    m, v, t = state.get(n, (np.zeros_like(g), np.zeros_like(g), 0))
                    w[n], m, v = adam_step(w[n], g, m, v, t + 1, self.groups[n] * adam_scale,
                                           *R19.adam_betas, R19.adam_eps,
                                           bias_correction=True)
                    state[n] = (m, v, t + 1)
            stats = {}
            for n, s in state.items():
                if isinstance(s, dict):
                    stats[n] = dict(m=s["QL"] @ s["m"] @ s["QR"].T, V=s["V"], L=s["L"],
                                    R=s["R"], inv_out=s["inv"][0], inv_in=s["inv"][1])
            out.append((dict(w), stats))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes and the records' group
    "wte/embedding": ((16, 8), R19.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R19.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "kl"),
    "blocks/0/attn/c_q/bias": ((16,), R19.vector_lr),
    "blocks/0/attn/c_k/kernel": ((16, 16), "kl"),     # gradients x 1e-8: eps counts
    "blocks/0/mlp/c_fc/kernel": ((16, 32), "kl"),
    "blocks/0/mlp/c_proj/kernel": ((32, 16), "kl"),
    "lm_head/kernel": ((16, 16), R19.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "kl"]
SMALL = "blocks/0/attn/c_k/kernel"
RECIPES = {"19": recipes.track3_klsoap, "25": recipes.track3_klsoap_power_decay}


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


def _path(path):
    return "/".join(str(getattr(k, "key", k)) for k in path)


def soap_state(state):
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, SoapState))
             if isinstance(s, SoapState)]
    assert len(found) == 1
    return found[0]


def stats_of(s: SoapState):
    """Per matrix: m (torch layout), V, L, R and the two inverse-root vectors."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    mu = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(s.mu, is_leaf=masked)[0]
          if not masked(x)}
    mats = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        s.matrices, is_leaf=lambda x: masked(x) or hasattr(x, "_fields"))[0] if not masked(x)}
    roots = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        s.kl_inverse_roots, is_leaf=lambda x: masked(x) or isinstance(x, tuple))[0]
        if not masked(x)}
    return {n: dict(m=mu[n].T, V=mats[n].second_moment, L=mats[n].gram_out,
                    R=mats[n].gram_in, inv_out=roots[n][0], inv_in=roots[n][1])
            for n in MATRICES}


def ours(recipe, weights, grads, **hyperparameters):
    def run(w, gs):
        tx = RECIPES[recipe](T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        step = jax.jit(tx.update)
        for g in gs:
            updates, state = step(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append((params, stats_of(soap_state(state))))
        return out
    return [(torch_layout(flatten(p)), s) for p, s in run_in_float64(run, weights, grads)]


def reference(recipe, weights, grads, horizon=None, **control):
    groups = {n: g for n, (_, g) in PARAMS.items()}
    return RecordKL(groups, schedules(recipe, horizon), **control).run(
        torch_layout(weights), [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    """The largest relative difference of weights and KL-SOAP statistics over all steps."""
    rel = lambda a, b: np.max(np.abs(a - b) / (np.abs(b) + 1e-3 * np.max(np.abs(b)) + 1e-300))
    err = 0.0
    for (wa, sa), (wb, sb) in zip(a_steps, b_steps, strict=True):
        err = max(err, max(rel(wa[n], wb[n]) for n in wb))
        err = max(err, max(rel(np.asarray(sa[n][k]), sb[n][k]) for n in MATRICES
                           for k in sb[n]))
    return err


@pytest.fixture(scope="module")
def problems():
    return problem()


@pytest.fixture(scope="module")
def runs(problems):
    weights, grads = problems
    return {r: ours(r, weights, grads) for r in RECIPES}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_matches_its_result_in_float64(problems, runs, recipe):
    assert worst(runs[recipe], reference(recipe, *problems)) < 1e-10


@pytest.mark.parametrize("recipe, control", [
    ("19", dict(lr=R19.lr * 1.03)), ("19", dict(beta1=0.96)), ("19", dict(beta2=0.91)),
    ("19", dict(shampoo_beta=0.91)), ("19", dict(eps=1.2e-8)), ("19", dict(freq=2)),
    ("19", dict(init_factor=0.11)), ("19", dict(factors="gram")),
    ("19", dict(first_step=True)),
    ("25", dict(horizon=HORIZON25 + 2)), ("25", dict(lr=R19.lr * 1.03))])
def test_a_moved_constant_fails_the_comparison(problems, runs, recipe, control):
    assert worst(runs[recipe], reference(recipe, *problems, **control)) > 1e-8


def test_the_inverse_root_clamp(problems):
    """With shampoo_beta 0.5 on both sides, the 1e-8 matrix's inverse roots reach 4000."""
    weights, grads = problems
    got = ours("19", weights, grads, shampoo_beta=0.5)
    want = reference("19", weights, grads, shampoo_beta=0.5)
    assert np.max(want[-1][1][SMALL]["inv_out"]) == R19.max_inverse_root
    assert worst(got, want) < 1e-10
    moved = reference("19", weights, grads, shampoo_beta=0.5, max_inverse_root=4400.0)
    assert worst(got, moved) > 1e-8


def test_schedule_controls_fail(problems, runs):
    """#25's floors and power, moved one at a time, against its run."""
    weights, grads = problems
    for power, floor_kl, floor_adam in ((1.55, R25.klsoap_lr_floor, R25.adam_lr_floor),
                                        (R25.lr_power, 0.02, R25.adam_lr_floor),
                                        (R25.lr_power, R25.klsoap_lr_floor, 0.05)):
        sched = lambda t, p=power, a=floor_kl, b=floor_adam: (
            eta(t / HORIZON25, R25.cooldown_frac, p, a),
            eta(t / HORIZON25, R25.adam_cooldown_frac, p, b))
        groups = {n: g for n, (_, g) in PARAMS.items()}
        moved = RecordKL(groups, sched).run(torch_layout(weights),
                                            [torch_layout(g) for g in grads])
        assert worst(runs["25"], moved) > 1e-8


def test_the_defaults_are_the_results():
    t = recipes.track3_klsoap.defaults
    assert (t.soap_learning_rate, t.soap_b1, t.soap_b2, t.shampoo_beta, t.soap_eps,
            t.precondition_frequency, t.factor_update, t.pin, t.soap_lr_steps,
            t.soap_lr_power, t.soap_lr_floor, t.adam_cooldown_frac, t.adam_lr_steps,
            t.adam_lr_power, t.adam_lr_floor) == (
        R19.lr, R19.beta1, R19.beta2, R19.shampoo_beta, R19.eps, R19.precondition_frequency,
        "kl", "current", R19.steps, 1.0, 0.0, R19.adam_cooldown_frac, R19.steps, 1.0, 0.0)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R19.embed_lr, R19.head_lr, R19.vector_lr, R19.adam_betas, R19.adam_eps)
    assert recipes.track3_klsoap.record_steps == R19.steps
    t = recipes.track3_klsoap_power_decay.defaults
    assert (t.soap_lr_steps, t.soap_lr_power, t.soap_lr_floor, t.adam_lr_steps,
            t.adam_lr_power, t.adam_lr_floor, t.factor_update) == (
        R25.schedule_steps, R25.lr_power, R25.klsoap_lr_floor, R25.schedule_steps,
        R25.lr_power, R25.adam_lr_floor, "kl")
    assert recipes.track3_klsoap_power_decay.record_steps == R25.steps
    assert t.scaled(T).soap_lr_steps == t.scaled(T).adam_lr_steps == HORIZON25
