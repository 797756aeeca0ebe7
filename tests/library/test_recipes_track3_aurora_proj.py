"""`recipes.track3_aurora_proj` (Track 3 result #30) against a float64 numpy transcription
of its log's optimizer (`zeropower_via_newtonschulz5` with Aurora on wide matrices,
`soap_precondition_momentum`, `soap_update_preconditioner`, `norm_preserving_blend`,
`muon_update`, `scale_radial_update`, the u/w floor, `target_radius_after_update`,
`rescale_to_radius`, `Muon.step`, the AdamW groups, `_lr`, `_muon_mu_at_step`,
`contra_coeff_for_step`), on PyTorch's (out, in) layout, one update at a time over a
61-step run (the record's 3050 / 50) that crosses every schedule boundary: the momentum's
warm-up (6) and cool-down (59-60), Muon's and Adam's PowerCool (13, 33), the Contra ramp
(50), SOAP's first basis (0) and its refreshes (10, 20, ...). Constants from
`references.track3_constants.R30` (file and line each); controls (one constant moved a
few percent) must fail the comparison."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import optax_snoo
from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R30

T = 61  # R30.schedule_steps / 50: every step constant of the recipe is x/50, rounded

# ---- the log's optimizer in float64 numpy ((out, in) layout; log:NNN its lines) --------
def gram_norm(x, eps=R30.gram_eps):  # log:261-264 gram_frobenius_norm_estimate
    gram = x.T @ x if x.shape[0] > x.shape[1] else x @ x.T
    return max(np.sqrt(np.linalg.norm(gram)), eps)


def ns_inner(X):  # log:266-272 _ns_inner
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def zeropower(G, aurora):  # log:279-312 zeropower_via_newtonschulz5
    """``aurora = (K, beta)``: the log's Aurora rounds on a wide matrix; ``None``: plain."""
    rows, cols = G.shape
    if aurora is not None and rows < cols:
        K, beta = aurora
        Xt = G.T
        target = Xt.shape[1] / Xt.shape[0]
        D = 1.0 / np.maximum(np.linalg.norm(Xt, axis=-1, keepdims=True), R30.aurora_eps)
        for k in range(K):
            wide = (D * Xt).T
            U = ns_inner(wide / gram_norm(wide, NS_EPS)).T
            if k < K - 1:
                row_sq = np.maximum((U ** 2).sum(-1, keepdims=True), R30.aurora_eps ** 2)
                D = D * (target / row_sq) ** beta
        return U.T
    X = G.T if rows > cols else G
    X = ns_inner(X / gram_norm(X, NS_EPS))
    return X.T if rows > cols else X


@dataclasses.dataclass
class Record:
    """#30's `Muon.step` and AdamW, with the constants a control may move."""

    contra: float = R30.contra_coeff
    contra_end: int = R30.contra_end
    aurora: tuple | None = (R30.aurora_k, R30.aurora_beta)
    v_blend: float = R30.v_blend
    v_floor: float = R30.v_denom_floor
    soap_frequency: int = R30.soap_frequency
    soap_beta: float = R30.soap_beta
    target_uw: float = R30.target_uw
    brake: float = R30.brake
    muon_lr: float = R30.muon_lr
    mu_warmup: int = R30.mu_warmup
    mu_cooldown: int = R30.mu_cooldown
    adam_b2: float = R30.adam_betas[1]
    soap_on: tuple = ("mlp_fc", "mlp_proj", "v")
    total: int = T  # FINAL_SCHEDULE_STEPS of the run; every step constant scaled to it
    schedule_steps: int = R30.schedule_steps  # the record's FINAL_SCHEDULE_STEPS
    train_steps: int = R30.train_steps        # the record's FINAL_TRAIN_STEPS

    def __post_init__(self):
        self.seen = dict(floor_binds=0, floor_free=0, outward=0, inward=0, v_floor=0,
                         refresh=0)

    def scaled(self, steps):
        return round(steps * self.total / self.schedule_steps)

    def lr(self, lr0, c, step):  # log:837-841 _lr at FINAL_SCHEDULE_STEPS = total
        c = c * (self.schedule_steps / self.total) ** R30.power
        return min(lr0, c * max(0.0, self.total - step) ** R30.power)

    def mu(self, step):  # log:849-858 _muon_mu_at_step(step, FINAL_TRAIN_STEPS)
        warm, cool = self.scaled(self.mu_warmup), self.scaled(self.mu_cooldown)
        cd_start = self.scaled(self.train_steps) - cool
        if step < warm:
            return R30.mu_min + step / warm * (R30.mu_max - R30.mu_min)
        if step > cd_start:
            return R30.mu_max - (step - cd_start) / cool * (R30.mu_max - R30.mu_min)
        return R30.mu_max

    def contra_coeff(self, step):  # log:558-565 (CONTRA_HOLD_END_STEP = 0)
        ramp = min(1.0, max(0.0, (step - R30.contra_hold_end) / self.scaled(self.contra_end)))
        return self.contra * (1.0 - ramp)

    def soap_precondition(self, M, s, blend, floor):  # log:527-543
        if s["QL"] is None:
            return M
        P = s["QL"].T @ M @ s["QR"]
        s["V"] = self.soap_beta * s["V"] + (1 - self.soap_beta) * P ** 2
        denom = np.maximum(s["V"], R30.soap_eps ** 2) ** R30.soap_denom_power
        if floor > 0:
            f = max(np.sqrt(np.mean(denom ** 2)) * floor, R30.soap_eps)
            self.seen["v_floor"] += bool(np.any(denom < f))
            denom = np.maximum(denom, f)
        pre = s["QL"] @ (P / denom) @ s["QR"].T
        if blend != 1.0:
            pre = blend * pre + (1 - blend) * M
        return pre * (gram_norm(M, R30.soap_eps) / gram_norm(pre, R30.soap_eps))

    def soap_statistics(self, g, s):  # log:545-556 soap_update_preconditioner (after use)
        b = self.soap_beta
        s["L"] += (1 - b) * (g @ g.T - s["L"])
        s["R"] += (1 - b) * (g.T @ g - s["R"])
        if s["QL"] is None:  # log:505-511 soap_eigenbasis
            s["QL"] = np.flip(np.linalg.eigh(s["L"])[1], 1)
            s["QR"] = np.flip(np.linalg.eigh(s["R"])[1], 1)
        elif s["step"] > 0 and s["step"] % self.soap_frequency == 0:  # log:513-525
            self.seen["refresh"] += 1
            order = np.argsort(-np.diag(s["QL"].T @ s["L"] @ s["QL"]), kind="stable")
            s["V"] = s["V"][order]
            s["QL"] = np.linalg.qr(s["L"] @ s["QL"][:, order])[0]
            order = np.argsort(-np.diag(s["QR"].T @ s["R"] @ s["QR"]), kind="stable")
            s["V"] = s["V"][:, order]
            s["QR"] = np.linalg.qr(s["R"] @ s["QR"][:, order])[0]
        s["step"] += 1

    def direction(self, name, g, s, step):  # log:642-674 Muon.step up to muon_update
        mu = self.mu(step)
        s["mom"] += (1 - mu) * (g - s["mom"])
        M = g + mu * (s["mom"] - g)
        kind = KIND[name]
        soap = kind in self.soap_on
        if soap and kind == "v":  # log:656-671: attention SOAP, gate 1
            pre = self.soap_precondition(M, s, self.v_blend, self.v_floor)
            M = pre * (gram_norm(M, 1e-8) / gram_norm(pre, 1e-8))  # norm_preserving_blend
        elif soap:
            M = self.soap_precondition(M, s, 1.0, 0.0)
        # log:570-598 muon_update (soft-Muon blend 0, NorMuon-lite with beta2 = 1)
        normalized = M / gram_norm(M)
        ns = zeropower(M, self.aurora)
        size = gram_norm(ns)
        ns = self.tempered(normalized, ns, size, step)
        update = ns + self.contra_coeff(step) * normalized
        update = update * size / gram_norm(update)
        update = update * size / gram_norm(update)
        update = update * max(1, update.shape[0] / update.shape[1]) ** 0.5
        var = (update ** 2).mean(-1 if update.shape[0] >= update.shape[1] else 0, keepdims=True)
        s["nu"] += (1 - R30.nor_beta2) * (var - s["nu"])
        vnorm = gram_norm(update)
        update = update / np.sqrt(np.maximum(s["nu"], 1e-10))
        return update * (vnorm / gram_norm(update))

    def couple(self, directions, w):
        """Between the directions and the step sizes (#41's Circuit-Muon goes here)."""
        return directions

    def finish(self, p, update, g, s, step):  # log:675-688 Muon.step after muon_update
        soap = KIND[s["name"]] in self.soap_on
        # log:476-490 scale_radial_update
        coeff = np.sum(update * p) / max(np.sum(p * p), 1e-12)
        self.seen["outward" if coeff < 0 else "inward"] += 1
        scale = self.brake_at(step) if coeff < 0 else R30.inward
        update = (update - coeff * p) + scale * coeff * p
        # log:676-682 the u/w floor
        p_fro, u_fro = max(np.linalg.norm(p), 1e-8), max(np.linalg.norm(update), 1e-8)
        target_uw = self.floor_at(step)
        binds = u_fro / p_fro < target_uw
        self.seen["floor_binds" if binds else "floor_free"] += 1
        if binds:
            update = update * (target_uw * p_fro / u_fro)
        lr = self.lr(self.muon_lr, R30.muon_c, step)
        before = max(np.linalg.norm(p), 1e-8)  # log:492-503: the radius pin
        target = max(before - lr * np.sum(update * p) / before, 1e-8)
        p = p - lr * update
        p = p * (target / max(np.linalg.norm(p), 1e-8))
        if soap:
            self.soap_statistics(g, s)
        return p

    def adam(self, name, p, g, s, step):  # torch AdamW, bias-corrected, no decay
        lr0, c = ADAM[GROUP[name]]
        (b1, _), b2, t = R30.adam_betas, self.adam_b2, step + 1
        s["m"] += (1 - b1) * (g - s["m"])
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        denom = np.sqrt(s["v"]) / np.sqrt(1 - b2 ** t) + R30.adam_eps
        return p - self.lr(lr0, c, step) / (1 - b1 ** t) * s["m"] / denom

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {}
        for n, x in w.items():
            if GROUP[n] == "muon":
                out, inn = x.shape
                state[n] = dict(name=n, mom=np.zeros_like(x), L=np.zeros((out, out)),
                                R=np.zeros((inn, inn)), V=np.zeros_like(x), QL=None, QR=None,
                                step=0, nu=np.zeros((out, 1)) if out >= inn
                                else np.zeros((1, inn)))
            else:
                state[n] = dict(m=np.zeros_like(x), v=np.zeros_like(x))
        out = []
        for step, grads in enumerate(grads_by_step):
            # each matrix's direction from the weights before the step (their order is free)
            directions = self.couple({n: self.direction(n, g, state[n], step)
                                      for n, g in grads.items() if GROUP[n] == "muon"}, w)
            for n, g in grads.items():
                w[n] = (self.finish(w[n], directions[n], g, state[n], step) if n in directions
                        else self.adam(n, w[n], g, state[n], step))
            self.after_step(w, step)
            out.append(dict(w))
        return out

    def tempered(self, normalized, polar, polar_norm, step):
        """The polar `muon_update` continues with (#38 tempers it here)."""
        return polar

    def brake_at(self, step):
        """`scale_radial_update`'s outward scale (#38 ramps it)."""
        return self.brake

    def floor_at(self, step):
        """The u/w floor's target (#38 ramps it)."""
        return self.target_uw

    def after_step(self, w, step):
        """The end of `Muon.step` (#34 extrapolates here)."""


# Our GPT's paths and (in, out) shapes, the log's group and #30's kind of each matrix.
PARAMS = {
    "wte/embedding": ((16, 8), "embed"),
    "blocks/0/ln_1/scale": ((8,), "vectors"),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), "vectors"),
    "blocks/0/attn/c_v/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_proj/kernel": ((8, 8), "muon"),
    "blocks/0/mlp/c_fc/kernel": ((8, 16), "muon"),     # (16, 8) tall: plain polar
    "blocks/0/mlp/c_proj/kernel": ((16, 8), "muon"),   # (8, 16) wide: Aurora
    "lm_head/kernel": ((8, 16), "head"),
    "lm_head/bias": ((16,), "vectors"),
}
GROUP = {n: g for n, (_, g) in PARAMS.items()}
KIND = {"blocks/0/attn/c_q/kernel": "q", "blocks/0/attn/c_v/kernel": "v",
        "blocks/0/attn/c_proj/kernel": "attn_proj", "blocks/0/mlp/c_fc/kernel": "mlp_fc",
        "blocks/0/mlp/c_proj/kernel": "mlp_proj"}
ADAM = {"embed": (R30.embed_lr, R30.embed_c), "head": (R30.head_lr, R30.head_c),
        "vectors": (R30.vector_lr, R30.vector_c)}
MATRICES = list(KIND)


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def first_gradient(shape, rng):
    """A rectangular diagonal with distinct entries: its Grams' eigenbases are the axes,
    the same in numpy and XLA (a random first gradient leaves a null space in the tall
    Gram whose basis each library picks its own way)."""
    g = np.zeros(shape)
    k = min(shape)
    g[np.arange(k), np.arange(k)] = 1.0 + 0.5 * np.arange(k) + 0.1 * rng.random(k)
    return g


@functools.cache
def problem(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    weights = {n: scale * rng.standard_normal(s) + (1.0 if n.endswith("scale") else 0.0)
               for n, (s, _) in PARAMS.items()}
    grads = [{n: (first_gradient(s, rng) if t == 0 and n in MATRICES
                  else rng.standard_normal(s)) for n, (s, _) in PARAMS.items()}
             for t in range(T)]
    return weights, grads


@functools.cache
def ours(scale=1.0):
    weights, grads = problem(scale=scale)

    def run(w, gs):
        tx = recipes.track3_aurora_proj(T, ns_dtype="float64")
        params = nest(w, dtype=None)
        state, update, out = tx.init(params), jax.jit(tx.update), []
        for g in gs:
            updates, state = update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(scale=1.0, **control):
    weights, grads = problem(scale=scale)
    record = Record(**control)
    steps = record.run(torch_layout(weights), [torch_layout(g) for g in grads])
    return steps, record.seen


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


def test_matches_its_record_in_float64():
    steps, seen = reference()
    assert worst(ours(), steps) < 1e-10
    # every mechanism acted: the floor bound and did not, the brake met both directions,
    # attn.v's denominator floor bound, the SOAP bases were refreshed (steps 10 to 60)
    assert all(seen.values()), seen
    assert seen["refresh"] == 3 * 6  # three SOAP matrices, at updates 10, 20, ..., 60


@pytest.mark.parametrize("control", [
    dict(contra=-0.205), dict(contra_end=2400), dict(aurora=None),
    dict(aurora=(2, R30.aurora_beta)), dict(aurora=(R30.aurora_k, 0.26)),
    dict(v_blend=0.93), dict(v_floor=0.57), dict(soap_frequency=9), dict(soap_beta=0.91),
    dict(target_uw=0.39), dict(brake=0.52), dict(muon_lr=R30.muon_lr * 1.03),
    dict(mu_warmup=350), dict(mu_cooldown=150), dict(adam_b2=0.98),
    dict(soap_on=("mlp_fc", "mlp_proj"))])
def test_a_moved_constant_fails_the_comparison(control):
    assert worst(ours(), reference(**control)[0]) > 1e-6


def test_the_defaults_are_the_records():
    t, r = recipes.track3_aurora_proj.defaults, R30
    assert recipes.track3_aurora_proj.record_steps == r.schedule_steps
    assert (t.RECORD_STEPS, t.train_steps, t.power_cool_power) == (
        r.schedule_steps, r.train_steps, r.power)
    assert (t.muon_learning_rate, t.muon_power_cool_c, t.floor, t.brake) == (
        r.muon_lr, r.muon_c, r.target_uw, r.brake)
    assert (t.embed_learning_rate, t.embed_power_cool_c, t.head_learning_rate,
            t.head_power_cool_c, t.vector_learning_rate, t.vector_power_cool_c) == (
        r.embed_lr, r.embed_c, r.head_lr, r.head_c, r.vector_lr, r.vector_c)
    assert ((t.adam_b1, t.adam_b2), t.adam_eps) == (r.adam_betas, r.adam_eps)
    assert (t.muon_momentum_start, t.muon_momentum, t.muon_momentum_warmup_steps,
            t.muon_momentum_cooldown_steps) == (r.mu_min, r.mu_max, r.mu_warmup,
                                                r.mu_cooldown)
    assert (-t.contra_muon / 2, t.contra_ramp_end) == (r.contra_coeff, r.contra_end)
    assert (t.aurora_iterations, t.aurora_beta) == (r.aurora_k, r.aurora_beta)
    assert (t.soap_beta, t.soap_precondition_frequency, t.v_soap_blend,
            t.v_soap_denom_floor) == (r.soap_beta, r.soap_frequency, r.v_blend,
                                      r.v_denom_floor)


def test_short_runs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="total_steps=5 is below its minimum"):
        recipes.track3_aurora_proj(5)


def test_each_matrix_gets_its_kind_of_direction():
    """The Muon matrices' kinds as #30's code selects them (Aurora on the wide mlp.proj,
    SOAP on MLP + attn.v): read from which `scale_by_muon` of the partition holds each
    leaf's momentum and SOAP statistics."""
    params = nest(problem()[0])
    state = recipes.track3_aurora_proj(T).init(params)
    kinds = state.inner_states["muon"].inner_state[0].inner_states
    owners = {}
    for kind, inner in kinds.items():
        muon_state = inner.inner_state
        for path, leaf in jax.tree_util.tree_flatten_with_path(
                muon_state.mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]:
            if not isinstance(leaf, optax.MaskedNode):
                owners[optax_snoo.labels.path_to_str(path)] = (
                    kind, not isinstance(muon_state.precondition, optax.EmptyState))
    assert owners == {
        "blocks/0/attn/c_q/kernel": ("plain", False),
        "blocks/0/attn/c_proj/kernel": ("plain", False),
        "blocks/0/attn/c_v/kernel": ("attn_v", True),
        "blocks/0/mlp/c_fc/kernel": ("mlp_fc", True),
        "blocks/0/mlp/c_proj/kernel": ("mlp_proj", True)}
