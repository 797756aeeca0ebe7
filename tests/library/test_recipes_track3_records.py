"""Track 3's recipes (`track3_record`, `track3_soap_muon`, `muonh`, `muloco_normuonh`,
`track3_newton_muon`) against float64 numpy transcriptions of their records' steps
(#46, #44, #5, #13, #15) on a tiny Track-3-like tree with this repository's GPT names.

Every number of a record is typed in from the record's script (`references.track3_constants`,
file and line each), never read from the library. Each comparison has a control: the same
recipe with one hyperparameter moved by a few percent must fail it by a wide margin
(``notes/checking-against-records.md``). Then the recipes' tables and PowerCool schedules
against the records' numbers, and how the recipes compose (Snoo, Orbax, `eval_params`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo import recipes
from references.muon import RefMuon, ref_ns
from references.radius import ref_muon_step, ref_scale_invariant_update
from references.soap import RefSoapMuon, first_gradient, ref_gram_norm
from references.track3 import adam_step, flatten, nest, power_cool, stable_cooldown
from references.track3_constants import NS_COEFFICIENTS, R5, R13, R15, R44, R46

# Our GPT's paths, their (in, out) shapes and #46's group ("muon", "gated" = Muon with
# the trust gate, or the Adam group's name).
PARAMS = {
    "wte/embedding": ((16, 8), "embed"),
    "ln_embed/scale": ((8,), "gains"),
    "blocks/0/ln_1/scale": ((8,), "gains"),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), "vectors"),
    "blocks/0/attn/c_proj/kernel": ((8, 8), "gated"),
    "blocks/0/attn/c_proj/bias": ((8,), "attn_proj_bias"),
    "blocks/0/mlp/c_fc/kernel": ((8, 16), "muon"),
    "blocks/0/mlp/c_proj/kernel": ((16, 8), "muon"),
    "ln_f/scale": ((8,), "gains"),
    "lm_head/kernel": ((8, 16), "head"),
    "lm_head/bias": ((16,), "vectors"),
}
MUON = ("muon", "gated")
N = 29  # the records' 2900 steps / 100: every step constant is x/100, rounded


def adam46(rec):
    """#44/#46's Adam groups: (flat lr, PowerCool c at t_end 2900, b2, bias correction)."""
    return {"gains": (rec.gains[0], rec.vector_c, rec.gains[1], False),
            "attn_proj_bias": (rec.attn_proj_bias[0], rec.vector_c, rec.attn_proj_bias[1],
                               False),
            "vectors": (rec.vectors[0], rec.vector_c, rec.vectors[1], False),
            "embed": (rec.embed_lr, rec.embed_c, rec.embed_head_betas[1], True),
            "head": (rec.head_lr, rec.head_c, rec.embed_head_betas[1], True)}


def init_weights(seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    return {n: scale * rng.standard_normal(s) + (1.0 if g == "gains" else 0.0)
            for n, (s, g) in PARAMS.items()}


def gradients(steps, seed=1):
    """Per step, a gradient per leaf; the Muon leaves' first is `first_gradient` (distinct
    Gram eigenvalues: SOAP's first eigenbasis is then the same in numpy and JAX). The
    MLP is 2x (not 4x) wide so that two gradients fill each Gram's rank: with a null space
    the power-QR basis there is arbitrary (numpy's and XLA's QR differ) and the record's
    ``V`` floor 1e-16 magnifies the rounding noise ``M`` has in it."""
    rng = np.random.default_rng(seed)
    return [{n: first_gradient(s, rng) if t == 0 and g in MUON else rng.standard_normal(s)
             for n, (s, g) in PARAMS.items()} for t in range(steps)]


def scaled(rec, steps, n):
    """A record's step constant at a run of ``n`` steps (of its ``rec.steps``)."""
    return round(steps * n / rec.steps)


def momentum46(rec, t, n=N):
    """#44/#46's `_muon_mu_at_step`: mu_min -> mu_max over the warm-up, back over the
    cool-down at the end (both scaled to n steps)."""
    warm, cool = scaled(rec, rec.mu_warmup, n), scaled(rec, rec.mu_cooldown, n)
    span = rec.mu_max - rec.mu_min
    if t < warm:
        return rec.mu_min + span * t / warm
    if t > n - cool:
        return rec.mu_max - span * (t - (n - cool)) / cool
    return rec.mu_max


# ---- the comparisons ---------------------------------------------------------------------
RTOL, ATOL = 2e-5, 5e-6  # float32 against float64: the worst measured is 1.8e-6 (weights <= 4.7)
#: A control's error must exceed the tolerance by this factor: a comparison it does not
#: separate from its tolerance would not mean anything.
CONTROL = 10.0


class Worst:
    """The largest ``|ours - ref| / (ATOL + RTOL·|ref|)`` seen (1 = at the tolerance), and
    where."""

    def __init__(self):
        self.ratio, self.where = 0.0, "nowhere"

    def add(self, ours, ref, msg):
        for k, want in ref.items():
            ratio = float(np.max(np.abs(ours[k] - want) / (ATOL + RTOL * np.abs(want))))
            if not ratio <= self.ratio:  # NaN too
                self.ratio, self.where = ratio, f"{msg} {k}"
        return self

    def __repr__(self):
        return f"Worst({self.ratio:.3g} at {self.where})"


def run_against(tx, ref, steps, check, **update_args):
    """Run ``tx`` and ``ref`` on the same gradients; ``check(params, state, t)`` compares."""
    grads = gradients(steps)
    params = nest(ref.p)
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, params, **update_args)
        params = optax.apply_updates(params, u)
        ref.step(g, t)
        check(params, state, t)
    return params, state


class Record46:
    """#46's training loop on float64 weights: EMA_Nesterov around (AdamW, Muon with SOAP
    and the radius steps, Adam), the tail EMA after each step. ``rec=R44``: #44's loop (its
    scalar u/w floor, no decay, no tail EMA); ``full=False`` the SOAP-Muon part alone
    (without the radius steps and EMA-Nesterov)."""

    def __init__(self, weights, n=N, full=True, rec=R46):
        self.p = {k: w.copy() for k, w in weights.items()}
        self.n, self.full, self.rec = n, full, rec
        self.adam = adam46(rec)
        self.m = {k: np.zeros_like(w) for k, w in weights.items()}
        self.v = {k: np.zeros_like(w) for k, w in weights.items()}
        fade = (scaled(rec, rec.trust_fade_start, n), scaled(rec, rec.trust_fade_end, n))
        self.soap = {k: RefSoapMuon(s[1], s[0], 1, ref_gram_norm, g == "gated", fade)
                     for k, (s, g) in PARAMS.items() if g in MUON}
        self.buf = {k: np.zeros_like(w) for k, w in weights.items()}
        self.prev = {k: w.copy() for k, w in weights.items()}
        self.ema = None
        self.stats = {"bind": 0, "free": 0, "outward": 0, "inward": 0}  # the radius steps'
        if full:
            self.prefill = scaled(rec, rec.lookahead_prefill, n)
            self.stop = scaled(rec, rec.lookahead_stop, n)
            self.start = n if rec.tail_start is None else scaled(rec, rec.tail_start, n)
            if rec.tail_start is not None:
                self.tau = max(1.0, rec.tail_tau * n / rec.steps)

    def lr(self, lr0, c, t):  # PowerCool stretched to t_end = n
        return power_cool(lr0, c * (self.rec.steps / self.n) ** self.rec.power, self.n, t,
                          self.rec.power)

    def beta(self, t):  # nesterov_step's lookahead at iteration t
        if not (self.full and self.prefill <= t < self.stop):
            return 0.0
        rec = self.rec  # the embedding group's lr ratio, as set on the previous step
        return rec.lookahead * self.lr(rec.embed_lr, rec.embed_c, max(t - 1, 0)) / rec.embed_lr

    def step(self, grads, t):
        rec, b = self.rec, self.beta(t)
        self.p = {k: w + b * self.buf[k] for k, w in self.p.items()}
        for k, g in grads.items():
            group = PARAMS[k][1]
            if group in MUON:
                w = self.p[k].T  # (out, in)
                update = self.soap[k].step(g.T, momentum46(rec, t, self.n), t, rec.soap_beta)
                lr = self.lr(rec.muon_lr, rec.muon_c, t)
                if self.full:
                    w = ref_muon_step(w, update, lr, brake=rec.brake, floor=rec.target_uw,
                                      floor_per="fan_out" if rec is R46 else "matrix",
                                      pin="first_order", cwd=rec.cwd,
                                      stats=self.stats)
                else:
                    w = w - lr * update
                self.p[k] = w.T
            else:
                lr0, c, b2, corrected = self.adam[group]
                self.p[k], self.m[k], self.v[k] = adam_step(
                    self.p[k], g, self.m[k], self.v[k], t + 1, self.lr(lr0, c, t), rec.adam_b1,
                    b2, rec.adam_eps, bias_correction=corrected)
        if not self.full:
            return
        ema = rec.lookahead_ema
        self.buf = {k: ema * self.buf[k] + (1 - ema) * (self.p[k] - self.prev[k]) for k in self.p}
        self.prev = {k: w.copy() for k, w in self.p.items()}
        if self.start <= t + 1 < self.n:  # the tail EMA, lazily initialised
            if self.ema is None:
                self.ema = {k: w.copy() for k, w in self.p.items() if PARAMS[k][1] != "embed"}
            else:
                self.ema = {k: e + (self.p[k] - e) / self.tau for k, e in self.ema.items()}

    def readout(self):
        if self.ema is None:
            return self.p
        lam = self.rec.tail_lambda
        return {k: (1 - lam) * w + lam * self.ema[k] if k in self.ema else w
                for k, w in self.p.items()}


def compare_record_46(recipe=recipes.track3_record, rec=R46, tail=6, scale=0.3, **moved):
    """All 29 steps of the 1/100 schedule: lookahead from 3 to 20, trust-gate fade 14-16,
    momentum cool-down from 27, the tail EMA from 24 (#46); weights and readout."""
    ref = Record46(init_weights(scale=scale), rec=rec)
    tx = recipe(N, ns_dtype="float32", **moved)
    worst, seen = Worst(), {"lookahead": 0, "tail": 0}

    def check(params, state, t):
        ours, readout = flatten(params), flatten(optax_snoo.eval_params(params, state))
        # Our params are the next gradient's point: the record's weights + β_{t+1}·b.
        ahead = {k: w + ref.beta(t + 1) * ref.buf[k] for k, w in ref.p.items()}
        worst.add(ours, ahead, f"params after step {t}")
        worst.add(readout, ref.readout(), f"readout after step {t}")
        seen["lookahead"] += ref.beta(t + 1) != 0
        seen["tail"] += ref.ema is not None

    run_against(tx, ref, N, check)
    assert seen == {"lookahead": 17, "tail": tail}  # both windows were exercised
    assert all(ref.stats.values()), ref.stats  # the floor and the brake acted, and did not
    return worst


def compare_record_44_as_it_ran(**moved):
    """#44's loop over all 29 steps: #46's without RowFloor (its floor is per matrix), the
    cautious decay and the tail EMA. Weights of std 0.8: the floor binds on the MLP's
    matrices (u/w about 0.31) and not on attention's (0.44)."""
    return compare_record_46(recipes.track3_soap_muon_record, R44, tail=0, scale=0.8, **moved)


def soap_state(state):
    """Each Muon leaf's per-matrix SOAP statistics in ``track3_soap_muon``'s state."""
    leaves = state.inner_states["muon"].inner_state[0].precondition.leaves
    is_state = lambda x: isinstance(x, optax_snoo.SoapMatrixState | optax.MaskedNode)
    flat = jax.tree_util.tree_flatten_with_path(leaves, is_leaf=is_state)[0]
    return {optax_snoo.labels.path_to_str(p): s for p, s in flat
            if isinstance(s, optax_snoo.SoapMatrixState)}


def compare_record_44(steps=18, **moved):
    """#44's SOAP-Muon and Adam groups over the trust gate's floor (to step 14): weights,
    and the per-matrix Grams ``L = E[G Gᵀ]``, ``R = E[Gᵀ G]`` in the record's layout."""
    ref = Record46(init_weights(), full=False, rec=R44)
    tx = recipes.track3_soap_muon(N, ns_dtype="float32", **moved)
    worst = Worst()

    def check(params, state, t):
        worst.add(flatten(params), ref.p, f"step {t}")
        grams = soap_state(state)
        assert sorted(grams) == sorted(ref.soap)
        for k, s in grams.items():
            worst.add({"L": np.asarray(s.gram_out, np.float64),
                       "R": np.asarray(s.gram_in, np.float64)},
                      {"L": ref.soap[k].L, "R": ref.soap[k].R}, f"step {t} {k} Gram")

    run_against(tx, ref, steps, check)
    return worst


# #5 / #13's aux AdamW groups: the record's lr of each of our leaves' groups.
def aux_lr(rec):
    return {"embed": rec.embed_lr, "head": rec.head_lr, "gains": rec.vector_lr,
            "attn_proj_bias": rec.vector_lr, "vectors": rec.vector_lr}


class RecordMuonH:
    """#5 MuonH / #8 NorMuonH (``rec=R13``: NorMuonH with #13's outer Nesterov every
    ``sync_interval`` updates): hyperball steps on the Muon leaves, AdamW on the rest."""

    def __init__(self, weights, total, rec=R5, k=None):
        self.p = {n: w.copy() for n, w in weights.items()}
        self.total, self.rec, self.k = total, rec, k
        self.m = {n: np.zeros_like(w) for n, w in weights.items()}
        self.v = {n: np.zeros_like(w) for n, w in weights.items()}
        self.normuon = (RefMuon({}, {}, lr=0, beta=0, triples=()) if rec is R13 else None)
        self.snap = {n: w.copy() for n, w in weights.items()}
        self.u = {n: np.zeros_like(w) for n, w in weights.items()}
        self.inner_count = 0

    def step(self, grads, t):
        rec, mu = self.rec, self.rec.muon_mu
        b1, b2 = rec.adam_betas
        for n, g in grads.items():
            group = PARAMS[n][1]
            if group in MUON:
                self.m[n] = mu * self.m[n] + (1 - mu) * g
                o = ref_ns(mu * self.m[n] + (1 - mu) * g, NS_COEFFICIENTS)
                if self.normuon is not None:
                    o = self.normuon.normuon(n, o, rec.muon_beta2)
                lr = rec.muon_lr * stable_cooldown(t, self.total, rec.muon_cooldown_frac)
                self.p[n] = ref_scale_invariant_update(self.p[n], o, lr)
            else:
                lr = aux_lr(rec)[group] * stable_cooldown(t, self.total, rec.adam_cooldown_frac)
                self.p[n], self.m[n], self.v[n] = adam_step(
                    self.p[n], g, self.m[n], self.v[n], t + 1, lr, b1, b2, rec.adam_eps,
                    bias_correction=True)
        if self.k is None:
            return
        self.inner_count += 1  # NesterovOuterOptimizer.maybe_outer_step
        if self.inner_count >= self.k:
            olr, om = rec.outer_lr, rec.outer_momentum
            for n in self.p:
                delta = self.snap[n] - self.p[n]
                self.u[n] = om * self.u[n] + olr * delta
                self.p[n] = self.snap[n] - om * self.u[n] - olr * delta
            self.snap = {n: w.copy() for n, w in self.p.items()}
            self.inner_count = 0


def compare_record_5(**moved):
    """10 updates; each matrix keeps its initial norm (the hyperball)."""
    T = 10
    ref = RecordMuonH(init_weights(), T)
    tx = recipes.muonh(T, ns_dtype="float32", **moved)
    radius = {k: np.linalg.norm(w) for k, w in ref.p.items() if PARAMS[k][1] in MUON}
    worst = Worst()

    def check(params, state, t):
        ours = flatten(params)
        worst.add(ours, ref.p, f"step {t}")
        worst.add({k: np.linalg.norm(ours[k]) for k in radius}, radius, f"radius at {t}")

    run_against(tx, ref, T, check)
    return worst


def compare_record_13(**moved):
    """Outer steps after updates 3, 6, 9 (k = 3): the last update is a sync."""
    T, k = 9, 3
    ref = RecordMuonH(init_weights(), T, rec=R13, k=k)
    tx = recipes.muloco_normuonh(T, snoo_k=k, ns_dtype="float32", **moved)
    worst = Worst()
    run_against(tx, ref, T, lambda params, state, t: worst.add(flatten(params), ref.p,
                                                                f"step {t}"))
    return worst


# #15's Muon groups: our kernel -> the record's (lr, wd).
GROUPS15 = {"blocks/0/attn/c_q/kernel": R15.qkv, "blocks/0/attn/c_proj/kernel": R15.attn_proj,
            "blocks/0/mlp/c_fc/kernel": R15.mlp_fc, "blocks/0/mlp/c_proj/kernel": R15.mlp_proj}


def layer_inputs(t, tokens=32):
    """Each Muon kernel's inputs at step t: anisotropic and correlated, so that the
    preconditioner (and its damping) matter."""
    rng = np.random.default_rng(1000 + t)
    out = {}
    for n in GROUPS15:
        d = PARAMS[n][0][0]
        mix = np.random.default_rng(d).normal(size=(d, d)) * np.logspace(-1, 1, d)
        out[n] = rng.normal(size=(tokens, d)) @ mix
    return out


def compare_record_15(steps=8, refresh=3, **moved):
    """#15's preconditioned Muon in its four groups and the aux AdamW, refreshing the
    inverse input covariances at updates 2 and 5 (``refresh=3``; the record: every 64th),
    the statistics given on those updates only. In our (in, out) layout the inverse
    multiplies the gradient from the left (the record's ``grad @ inv`` on (out, in))."""
    w = init_weights()
    ref = {n: x.copy() for n, x in w.items()}
    mom = {n: np.zeros_like(x) for n, x in w.items()}
    sq = {n: np.zeros_like(x) for n, x in w.items()}
    cov = {n: R15.initial_cov * np.eye(PARAMS[n][0][0]) for n in GROUPS15}
    inv = {}
    mu, (b1, b2) = R15.muon_mu, R15.adam_betas
    tx = recipes.track3_newton_muon(steps, ns_dtype="float32", newton_refresh_every=refresh,
                                    **moved)
    params = nest(w)
    state, update = tx.init(params), jax.jit(tx.update)
    worst = Worst()
    for t, g in enumerate(gradients(steps)):
        eta = stable_cooldown(t, steps, R15.cooldown_frac)
        statistics = None
        if (t + 1) % refresh == 0:  # precond_flag_for_step, then _refresh_preconditioner
            x = layer_inputs(t)
            statistics = {n: jnp.asarray(x[n].T @ x[n] / len(x[n]), jnp.float32) for n in x}
            for n, xs in x.items():
                cov[n] = cov[n] + R15.ema_alpha * (xs.T @ xs / len(xs) - cov[n])
                d = len(cov[n])
                reg = np.trace(cov[n]) / d * R15.damping + R15.damping_eps
                inv[n] = np.linalg.inv(cov[n] + reg * np.eye(d))
        for n, x in g.items():
            if n in GROUPS15:
                x = inv[n] @ x if n in inv else x
                lr, wd = GROUPS15[n][0] * eta, GROUPS15[n][1]
                mom[n] = mu * mom[n] + (1 - mu) * x
                o = ref_ns(mu * mom[n] + (1 - mu) * x, NS_COEFFICIENTS)
                scale = max(1.0, x.shape[1] / x.shape[0]) ** 0.5  # (in, out): out/in
                ref[n] = ref[n] * (1 - lr * wd) - lr * scale * o
            else:
                lr = aux_lr(R15)[PARAMS[n][1]] * eta
                ref[n], mom[n], sq[n] = adam_step(ref[n], x, mom[n], sq[n], t + 1, lr, b1, b2,
                                                  R15.adam_eps, bias_correction=True)
        u, state = update(nest(g), state, params, input_covariance=statistics)
        params = optax.apply_updates(params, u)
        worst.add(flatten(params), ref, f"step {t}")
    assert sorted(inv) == sorted(GROUPS15)  # every group was preconditioned
    return worst


COMPARISONS = {"track3_record": compare_record_46, "track3_soap_muon": compare_record_44,
               "track3_soap_muon_record": compare_record_44_as_it_ran,
               "muonh": compare_record_5, "muloco_normuonh": compare_record_13,
               "track3_newton_muon": compare_record_15}


@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_recipe_matches_its_record(name):
    worst = COMPARISONS[name]()
    assert worst.ratio <= 1, worst


# One hyperparameter of each recipe moved by a few percent (or #15's damping 0.2 -> 0.02):
# the comparison must fail by far more than its tolerance.
CONTROLS = [
    ("track3_record", dict(brake=0.52)),
    ("track3_soap_muon", dict(soap_beta=0.91)),
    ("track3_soap_muon_record", dict(floor=0.39)),
    ("muonh", dict(muon_learning_rate=0.0185)),
    ("muloco_normuonh", dict(snoo_learning_rate=0.72)),
    ("track3_newton_muon", dict(newton_damping=0.21)),
    ("track3_newton_muon", dict(newton_damping=0.02)),
]


@pytest.mark.parametrize("name, moved", CONTROLS, ids=lambda v: str(v))
def test_a_moved_hyperparameter_fails_the_comparison(name, moved):
    worst = COMPARISONS[name](**moved)
    assert worst.ratio > CONTROL, worst


# ---- the recipes' tables and schedules are the records' -----------------------------------
SOAP_TABLE = lambda r: dict(
    muon_learning_rate=r.muon_lr, embed_learning_rate=r.embed_lr,
    head_learning_rate=r.head_lr, vector_learning_rate=r.gains[0],
    power_cool_power=r.power, muon_power_cool_c=r.muon_c, embed_power_cool_c=r.embed_c,
    head_power_cool_c=r.head_c, vector_power_cool_c=r.vector_c, adam_b1=r.adam_b1,
    gains_b2=r.gains[1], attn_proj_bias_b2=r.attn_proj_bias[1], vectors_b2=r.vectors[1],
    embed_b2=r.embed_head_betas[1], head_b2=r.embed_head_betas[1], adam_eps=r.adam_eps,
    muon_momentum=r.mu_max, muon_momentum_start=r.mu_min,
    muon_momentum_warmup_steps=r.mu_warmup, muon_momentum_cooldown_steps=r.mu_cooldown,
    soap_beta=r.soap_beta, trust_floor=r.trust_floor, trust_fade_start=r.trust_fade_start,
    trust_fade_end=r.trust_fade_end, trust_cap=r.trust_cap, trust_cap_until=r.trust_fade_end)
AUX_TABLE = lambda r: dict(embed_learning_rate=r.embed_lr, head_learning_rate=r.head_lr,
                           vector_learning_rate=r.vector_lr, adam_b1=r.adam_betas[0],
                           adam_b2=r.adam_betas[1], adam_eps=r.adam_eps)
TABLES = {
    "track3_soap_muon": (R44.steps, SOAP_TABLE(R44)),
    "track3_soap_muon_record": (R44.steps, dict(
        SOAP_TABLE(R44), brake=R44.brake, floor=R44.target_uw, lookahead=R44.lookahead,
        lookahead_ema=R44.lookahead_ema, lookahead_start=R44.lookahead_prefill,
        lookahead_stop=R44.lookahead_stop)),
    "track3_record": (R46.steps, dict(
        SOAP_TABLE(R46), brake=R46.brake, floor=R46.target_uw, cautious_weight_decay=R46.cwd,
        lookahead=R46.lookahead, lookahead_ema=R46.lookahead_ema,
        lookahead_start=R46.lookahead_prefill, lookahead_stop=R46.lookahead_stop,
        tail_start=R46.tail_start, tail_horizon=R46.tail_tau, tail_blend=R46.tail_lambda)),
    "muonh": (R5.steps, dict(AUX_TABLE(R5), muon_learning_rate=R5.muon_lr,
                             muon_momentum=R5.muon_mu, muon_beta2=None,
                             adam_cooldown_frac=R5.adam_cooldown_frac)),
    "muloco_normuonh": (R13.steps, dict(
        AUX_TABLE(R13), muon_learning_rate=R13.muon_lr, muon_momentum=R13.muon_mu,
        muon_beta2=R13.muon_beta2, adam_cooldown_frac=R13.adam_cooldown_frac,
        snoo_learning_rate=R13.outer_lr, snoo_momentum=R13.outer_momentum,
        snoo_k=R13.sync_interval)),
    "track3_newton_muon": (R15.steps, dict(
        AUX_TABLE(R15), muon_momentum=R15.muon_mu, newton_refresh_every=R15.refresh_interval,
        newton_ema_decay=1 - R15.ema_alpha, newton_damping=R15.damping,
        cooldown_frac=R15.cooldown_frac,
        **{f"{g}_{what}": getattr(R15, g)[i] for g in ("qkv", "attn_proj", "mlp_fc", "mlp_proj")
           for i, what in enumerate(("learning_rate", "weight_decay"))})),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_recipe_defaults_are_the_records_constants(name):
    """Every default the record has, digit for digit (a wrong digit in a PowerCool c, a
    beta, a step constant fails here), and the record's length."""
    steps, want = TABLES[name]
    recipe = recipes.get(name)
    table = recipe.defaults
    got = {k: getattr(table, k) for k in want}
    assert got == want, {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert recipe.record_steps == steps


def record_power_cool(rec, lr0, lr0_record, c, total, t):
    """A record's PowerCool at lr0 for a run of ``total``: the record's c at its own rate
    and length, times lr0/lr0_record, at the record's step ``t·steps/total``."""
    return lr0 / lr0_record * power_cool(lr0_record, c, rec.steps, t * rec.steps / total,
                                         rec.power)


def adam_probe(tx, counts):
    """Each Adam group's applied update at each count, from zero moments and unit
    gradients (the group's lr times its first Adam step): one representative leaf each."""
    leaves = {"embed": "wte/embedding", "head": "lm_head/kernel", "gains": "ln_f/scale",
              "vectors": "blocks/0/attn/c_q/bias",
              "attn_proj_bias": "blocks/0/attn/c_proj/bias"}
    params = nest(init_weights())
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    update = jax.jit(lambda s: tx.update(grads, s, params)[0])
    out = {g: [] for g in leaves}
    for t in counts:
        u = flatten(update(at_count(state, t)))
        for g, leaf in leaves.items():
            out[g].append(float(u[leaf].flat[0]))
    return {g: np.array(v) for g, v in out.items()}


def at_count(state, t):
    """``state`` with every ``count`` field set to ``t`` (the wrappers' and the groups')."""
    is_count = lambda path: bool(path) and getattr(path[-1], "name", None) == "count"
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(t, x.dtype) if is_count(path) else x, state)


def first_adam_step(t, b1, b2, eps, bias_correction):
    """Adam's first step from zero moments with a unit gradient, at count t."""
    m, v = 1 - b1, 1 - b2
    if bias_correction:
        m, v = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
    return m / (np.sqrt(v) + eps)


@pytest.mark.parametrize("name, rec", [("track3_soap_muon", R44), ("track3_record", R46)])
@pytest.mark.parametrize("total", [2900, 290])
def test_power_cool_keeps_the_records_flat_part_at_any_rate(name, rec, total):
    """Every group's PowerCool at twice the record's rate: the record's schedule times 2,
    its flat part ending at the record's step (Muon 513.6 of 2900, Adam 1487.0), scaled to
    the run. A c not rescaled with the rate would leave no flat part at all (at 2900 steps
    the record's own curve starts at 0.047, below a flat rate of 0.075)."""
    hps = dict(muon_learning_rate=2 * rec.muon_lr, embed_learning_rate=2 * rec.embed_lr,
               head_learning_rate=2 * rec.head_lr, vector_learning_rate=2 * rec.gains[0])
    stack = recipes.get(name).stack(total, **hps)
    # Without EMA-Nesterov's lookahead the applied update is the Adam group's own step.
    probed = recipes.get(name).stack(total, **hps, **(
        {"lookahead": 0.0} if name == "track3_record" else {})).tx
    steps = np.arange(0, total + 1)
    muon = np.asarray(jax.jit(jax.vmap(stack.learning_rate))(jnp.asarray(steps)), np.float64)
    want = np.array([record_power_cool(rec, 2 * rec.muon_lr, rec.muon_lr, rec.muon_c, total, t)
                     for t in steps])
    np.testing.assert_allclose(muon, want, rtol=2e-6, atol=0)
    flat_end = rec.steps - (rec.muon_lr / rec.muon_c) ** (1 / rec.power)  # 513.6
    at = flat_end * total / rec.steps
    assert np.all(muon[steps < at - 0.5] == np.float32(2 * rec.muon_lr))
    assert np.all(muon[steps > at + 0.5] < 2 * rec.muon_lr)

    adam_flat_end = rec.steps - (rec.embed_lr / rec.embed_c) ** (1 / rec.power)  # 1487.0
    counts = [0, int(adam_flat_end * total / rec.steps) - 1,
              int(adam_flat_end * total / rec.steps) + 2, (3 * total) // 4, total - 1]
    got = adam_probe(probed, counts)
    for group, (lr0, c, b2, corrected) in adam46(rec).items():
        want = np.array([-record_power_cool(rec, 2 * lr0, lr0, c, total, t) * first_adam_step(
            t, rec.adam_b1, b2, rec.adam_eps, corrected) for t in counts])
        np.testing.assert_allclose(got[group], want, rtol=1e-5, err_msg=group)
        assert got[group][1] == pytest.approx(-2 * lr0 * first_adam_step(
            counts[1], rec.adam_b1, b2, rec.adam_eps, corrected), rel=1e-6), group
        assert abs(got[group][2]) < 2 * lr0 * first_adam_step(
            counts[2], rec.adam_b1, b2, rec.adam_eps, corrected) * (1 - 1e-4), group


# ---- composition -------------------------------------------------------------------------

class _BlackBox:
    """An inner transform run as it is, on float32 copies of the reference's point: what
    Snoo adds around it is the outer step, which `numpy_snoo` writes out in float64."""

    def __init__(self, tx):
        self.tx, self.update_fn = tx, jax.jit(tx.update)

    def init(self, params):
        return self.tx.init(nest(params))

    def update(self, grads, state, params):
        u, state = self.update_fn(nest(grads), state, nest(params))
        return {k: np.asarray(v, np.float64) for k, v in flatten(u).items()}, state


@pytest.mark.parametrize("name", ["track3_soap_muon", "muonh", "track3_record"])
def test_snoo_around_each_frontier_stack(name):
    """`snoo(inner, 0.7, 0.5, k=3)` around SOAP-Muon (#44), the hyperball and #46's stack
    (radius steps, EMA-Nesterov, tail EMA) is Snoo's outer Nesterov step on the inner's
    k-step displacements, the inner's state carried through every sync."""
    from references.snoo import numpy_snoo
    T, k = 12, 3
    inner = {"track3_soap_muon": lambda: recipes.track3_soap_muon(N, ns_dtype="float32"),
             "muonh": lambda: recipes.muonh(T, ns_dtype="float32"),
             "track3_record": lambda: recipes.track3_record(N, ns_dtype="float32")}[name]
    weights, grads = init_weights(), gradients(T)
    ref = numpy_snoo(_BlackBox(inner()), weights, grads, 0.7, 0.5, k)
    tx, params = optax_snoo.snoo(inner(), 0.7, 0.5, k), nest(weights)
    state, update = tx.init(params), jax.jit(tx.update)
    worst = Worst()
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, params)
        params = optax.apply_updates(params, u)
        worst.add(flatten(params), ref[t], f"{name} step {t}")
    assert worst.ratio <= 1, worst


def test_track3_record_state_readouts_and_orbax(tmp_path):
    params = nest(init_weights())
    # At 29 steps the tail EMA starts after update 24 with horizon 1.5 (shorter runs have
    # horizon 1: the EMA would be the weights).
    tx = recipes.track3_record(N, ns_dtype="float32")
    p, state, _ = m.run(tx, params, 26)
    ema_nesterov_state, tail_state = state
    assert isinstance(ema_nesterov_state, optax_snoo.EmaNesterovState)
    assert isinstance(tail_state, optax_snoo.TailEmaState)
    assert tail_state.blend == np.float32(R46.tail_lambda)  # the tail EMA started
    assert isinstance(tail_state.ema["wte"]["embedding"], optax.MaskedNode)  # embed excluded
    readout = optax_snoo.eval_params(p, state)
    assert not np.allclose(readout["lm_head"]["kernel"], p["lm_head"]["kernel"])
    np.testing.assert_array_equal(readout["wte"]["embedding"], p["wte"]["embedding"])
    m.check_orbax_roundtrip(tx, params, tmp_path, steps_before=23, steps_after=3)


def test_step_constants_scale_with_total_steps():
    """The lookahead window and the tail EMA's start at the record's 2900 steps and at
    290 (one tenth)."""
    params = nest(init_weights())
    window = (R46.lookahead_prefill, R46.lookahead_stop, R46.tail_start)
    for n in (R46.steps, R46.steps // 10):
        prefill, stop, start = (scaled(R46, x, n) for x in window)
        at = _wrappers_after(recipes.track3_record(n), params)
        assert at(prefill - 1)[0] == 0.0 and at(prefill)[0] > 0.0, n
        assert at(stop - 1)[0] > 0.0 and at(stop)[0] == 0.0, n
        assert at(start - 1)[1] == 0.0 and at(start)[1] == np.float32(R46.tail_lambda), n


def _wrappers_after(tx, params):
    """``count -> (lookahead β, tail blend λ)`` after update number ``count``."""
    grads = jax.tree.map(jnp.zeros_like, params)
    ema_state, tail_state = tx.init(params)

    @jax.jit
    def after(count):
        s = (ema_state._replace(count=count - 1), tail_state._replace(count=count - 1))
        new = tx.update(grads, s, params)[1]
        return new[0].lookahead, new[1].blend

    return lambda count: tuple(float(x) for x in after(count))


def test_bad_input():
    with pytest.raises(ValueError, match=r"^recipe track3_record: total_steps=3 is below its "
                                         r"minimum of \d+"):
        recipes.track3_record(3)
    with pytest.raises(ValueError, match=r"^adam_patterns: \['embedding'\] are not groups of "
                                         r"this recipe"):
        recipes.track3_record(adam_patterns={"embedding": "wte"})
    with pytest.raises(ValueError, match=r"^recipe track3_record: muon_learning_rate=0\.0: "
                                         "expected a finite number > 0$"):
        recipes.track3_record(muon_learning_rate=0.0)
    stray = nest({"wte/embedding": np.ones((8, 4)), "lm_head/kernel": np.ones((4, 8)),
                  "blocks/0/attn/other/kernel": np.ones((4, 4))})
    tx = recipes.track3_newton_muon()
    with pytest.raises(ValueError, match=r"parameter 'blocks/0/attn/other/kernel' matches no "
                                         r"Muon group"):
        tx.update(stray, tx.init(stray), stray, input_covariance=None)
    with pytest.raises(ValueError, match=r"^'muon_groups' is not a hyperparameter of recipe "
                                         r"track3_newton_muon"):
        recipes.track3_newton_muon(muon_groups=())


def test_patterns_fit_the_track3_network():
    """On `models.track3_config`'s GPT each leaf lands in #46's group for it (the bf16
    embedding included), each hidden matrix has its own SOAP statistics in the record's
    (out, in) layout, and the tail EMA leaves the embedding out. (The trust gate's
    pattern is checked on these names by the #46 comparison.)"""
    from flax import nnx

    import models

    cfg = models.track3_config(n_layer=2, n_embd=32, head_dim=16, vocab_size=64,
                               block_size=16)
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    state = recipes.track3_record(9).init(params)
    owner = {}
    for name, group in state[0].inner_state.inner_states.items():
        mu = group.inner_state[0].mu  # MuonState / ScaleByAdamState, masked to the group
        for path, leaf in jax.tree_util.tree_flatten_with_path(
                mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]:
            if not isinstance(leaf, optax.MaskedNode):
                owner[optax_snoo.labels.path_to_str(path)] = name
    assert set(owner) == set(flatten(params))
    expected = {"wte/embedding": "embed", "ln_embed/scale": "gains", "ln_f/scale": "gains",
                "lm_head/kernel": "head", "lm_head/bias": "vectors",
                "blocks/1/ln_2/scale": "gains", "blocks/1/attn/c_proj/bias": "attn_proj_bias",
                "blocks/1/attn/c_k/bias": "vectors", "blocks/1/mlp/c_fc/bias": "vectors"}
    muon = {p for p in owner if p.startswith("blocks/") and p.endswith("/kernel")}
    assert {p: owner[p] for p in expected} == expected
    assert {p for p, g in owner.items() if g == "muon"} == muon and len(muon) == 12
    grams = soap_state(state[0].inner_state)
    assert set(grams) == muon
    for path, s in grams.items():
        fan_in, fan_out = flatten(params)[path].shape
        assert s.gram_out.shape == (fan_out, fan_out) and s.gram_in.shape == (fan_in, fan_in)
        assert s.second_moment.shape == (fan_out, fan_in)
    tail = flatten(jax.tree.map(lambda e: 0.0 if isinstance(e, optax.MaskedNode) else 1.0,
                                state[1].ema, is_leaf=lambda x: isinstance(x, optax.MaskedNode)))
    assert [p for p, kept in tail.items() if not kept] == ["wte/embedding"]
