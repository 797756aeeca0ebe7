"""Track 3's recipes (`track3_record`, `track3_soap_muon`, `muonh`, `muloco_normuonh`,
`track3_newton_muon`) against float64 numpy transcriptions of their records' steps
(#46, #44, #5, #13, #15), on a tiny Track-3-like tree with this repository's GPT names,
plus how they compose (jit, Orbax, `eval_params`)."""

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
N = 29  # the record's 2900 steps / 100: every step constant is x/100, rounded

# #46's Adam groups: (flat lr, PowerCool c at t_end 2900, b2, bias correction).
C = recipes.TRACK3_POWER_COOL_C
ADAM46 = {"gains": (0.01, C["vectors"], 0.99, False),
          "attn_proj_bias": (0.01, C["vectors"], 0.9965, False),
          "vectors": (0.01, C["vectors"], 0.997, False),
          "embed": (0.3, C["embed"], 0.99, True),
          "head": (1 / 320, C["head"], 0.99, True)}


def init_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {n: 0.3 * rng.standard_normal(s) + (1.0 if g == "gains" else 0.0)
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


def momentum46(t, n=N):
    """#44/#46's `_muon_mu_at_step`: 0.85 -> 0.95 over 300, back over the last 200 (/100)."""
    warm, cool = round(300 * n / 2900), round(200 * n / 2900)
    if t < warm:
        return 0.85 + 0.1 * t / warm
    if t > n - cool:
        return 0.95 - 0.1 * (t - (n - cool)) / cool
    return 0.95


class Record46:
    """#46's training loop on float64 weights: EMA_Nesterov around (AdamW, Muon with SOAP
    and the radius steps, Adam), the tail EMA after each step; ``full=False`` is the
    SOAP-Muon part alone (#44's Muon, no radius steps, no wrappers)."""

    def __init__(self, weights, n=N, full=True):
        self.p, self.n, self.full = {k: w.copy() for k, w in weights.items()}, n, full
        self.m = {k: np.zeros_like(w) for k, w in weights.items()}
        self.v = {k: np.zeros_like(w) for k, w in weights.items()}
        fade = (round(1375 * n / 2900), round(1625 * n / 2900))
        self.soap = {k: RefSoapMuon(s[1], s[0], 1, ref_gram_norm, g == "gated", fade)
                     for k, (s, g) in PARAMS.items() if g in MUON}
        self.buf = {k: np.zeros_like(w) for k, w in weights.items()}
        self.prev = {k: w.copy() for k, w in weights.items()}
        self.ema = None
        self.prefill, self.stop = round(300 * n / 2900), round(1950 * n / 2900)
        self.start, self.tau = round(2400 * n / 2900), max(1.0, 150 * n / 2900)

    def lr(self, lr0, c, t):  # PowerCool stretched to t_end = n
        return power_cool(lr0, c * (2900 / self.n) ** 1.2, self.n, t)

    def beta(self, t):  # nesterov_step's lookahead at iteration t
        if not (self.full and self.prefill <= t < self.stop):
            return 0.0
        return 0.3 * self.lr(0.3, C["embed"], max(t - 1, 0)) / 0.3

    def step(self, grads, t):
        b = self.beta(t)
        self.p = {k: w + b * self.buf[k] for k, w in self.p.items()}
        for k, g in grads.items():
            group = PARAMS[k][1]
            if group in MUON:
                w = self.p[k].T  # (out, in)
                update = self.soap[k].step(g.T, momentum46(t, self.n), t)
                lr = self.lr(0.0375, C["muon"], t)
                if self.full:
                    w = ref_muon_step(w, update, lr, brake=0.5, floor=0.3825,
                                      floor_per="fan_out", pin="first_order", cwd=0.025,
                                      stats=None)
                else:
                    w = w - lr * update
                self.p[k] = w.T
            else:
                lr0, c, b2, corrected = ADAM46[group]
                self.p[k], self.m[k], self.v[k] = adam_step(
                    self.p[k], g, self.m[k], self.v[k], t + 1, self.lr(lr0, c, t), 0.8, b2,
                    1e-10, bias_correction=corrected)
        if not self.full:
            return
        self.buf = {k: 0.99 * self.buf[k] + 0.01 * (self.p[k] - self.prev[k]) for k in self.p}
        self.prev = {k: w.copy() for k, w in self.p.items()}
        if self.start <= t + 1 < self.n:  # the tail EMA, lazily initialised
            if self.ema is None:
                self.ema = {k: w.copy() for k, w in self.p.items() if PARAMS[k][1] != "embed"}
            else:
                self.ema = {k: e + (self.p[k] - e) / self.tau for k, e in self.ema.items()}

    def readout(self):
        if self.ema is None:
            return self.p
        return {k: 0.4 * w + 0.6 * self.ema[k] if k in self.ema else w
                for k, w in self.p.items()}


def run_against(tx, ref, steps, check):
    grads = gradients(steps)
    params = nest(ref.p)
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, params)
        params = optax.apply_updates(params, u)
        ref.step(g, t)
        check(params, state, t)
    return params, state


def assert_close(ours, ref, msg, rtol=2e-5, atol=5e-6):
    """Float32 against float64: the worst error measured is 1.8e-6 (weights up to 4.7)."""
    for k in PARAMS:
        np.testing.assert_allclose(ours[k], ref[k], rtol=rtol, atol=atol, err_msg=f"{msg} {k}")


def test_track3_record_matches_record_46():
    """All 29 steps of the 1/100 schedule: lookahead from 3 to 20, trust-gate fade 14-16,
    momentum cool-down from 27, the tail EMA from 24. Float32 (iteration included) against
    float64 (`assert_close`)."""
    ref = Record46(init_weights())
    tx = recipes.track3_record(N, ns_dtype=jnp.float32)
    seen = {"lookahead": 0, "tail": 0}

    def check(params, state, t):
        ours, readout = flatten(params), flatten(optax_snoo.eval_params(params, state))
        # Our params are the next gradient's point: the record's weights + β_{t+1}·b.
        ahead = {k: w + ref.beta(t + 1) * ref.buf[k] for k, w in ref.p.items()}
        assert_close(ours, ahead, f"params after step {t}")
        assert_close(readout, ref.readout(), f"readout after step {t}")
        seen["lookahead"] += ref.beta(t + 1) != 0
        seen["tail"] += ref.ema is not None

    run_against(tx, ref, N, check)
    assert seen == {"lookahead": 17, "tail": 6}  # both windows were exercised


def test_track3_soap_muon_matches_record_44_soap_muon():
    ref = Record46(init_weights(), full=False)
    tx = recipes.track3_soap_muon(N, ns_dtype=jnp.float32)
    run_against(tx, ref, 18, lambda params, state, t: assert_close(
        flatten(params), ref.p, f"step {t}"))


AUX = {"embed": 0.3, "head": 1 / 320, "gains": 0.01, "attn_proj_bias": 0.01, "vectors": 0.01}


class RecordMuonH:
    """#5 MuonH / #8 NorMuonH (``normuon``) with #13's outer Nesterov every ``k`` updates
    (``k=None``: none): hyperball steps on the Muon leaves, AdamW (0.8, 0.95) on the rest."""

    def __init__(self, weights, total, normuon=False, k=None):
        self.p, self.total, self.k = {n: w.copy() for n, w in weights.items()}, total, k
        self.m = {n: np.zeros_like(w) for n, w in weights.items()}
        self.v = {n: np.zeros_like(w) for n, w in weights.items()}
        self.normuon = RefMuon({}, {}, lr=0, beta=0, triples=()) if normuon else None
        self.snap = {n: w.copy() for n, w in weights.items()}
        self.u = {n: np.zeros_like(w) for n, w in weights.items()}
        self.inner_count = 0

    def step(self, grads, t):
        for n, g in grads.items():
            group = PARAMS[n][1]
            if group in MUON:
                self.m[n] = 0.95 * self.m[n] + 0.05 * g
                o = ref_ns(0.95 * self.m[n] + 0.05 * g, recipes.TRACK3_COEFFICIENTS)
                if self.normuon is not None:
                    o = self.normuon.normuon(n, o, 0.95)
                lr = 0.018 * (1 - t / self.total)
                self.p[n] = ref_scale_invariant_update(self.p[n], o, lr)
            else:
                lr = AUX[group] * stable_cooldown(t, self.total, 0.4)
                self.p[n], self.m[n], self.v[n] = adam_step(
                    self.p[n], g, self.m[n], self.v[n], t + 1, lr, 0.8, 0.95, 1e-10,
                    bias_correction=True)
        if self.k is None:
            return
        self.inner_count += 1  # NesterovOuterOptimizer.maybe_outer_step
        if self.inner_count >= self.k:
            for n in self.p:
                delta = self.snap[n] - self.p[n]
                self.u[n] = 0.5 * self.u[n] + 0.7 * delta
                self.p[n] = self.snap[n] - 0.5 * self.u[n] - 0.7 * delta
            self.snap = {n: w.copy() for n, w in self.p.items()}
            self.inner_count = 0


# #5's aux groups are embed / head / every 1-D parameter.
AUX_PATTERNS = {"vectors": r"(^|/)(bias|scale)$", "embed": recipes.TRACK3_ADAM_PATTERNS["embed"],
                "head": recipes.TRACK3_ADAM_PATTERNS["head"]}


def test_muonh_matches_record_5():
    T = 10
    ref = RecordMuonH(init_weights(), T)
    tx = recipes.muonh(T, ns_dtype=jnp.float32, adam_patterns=AUX_PATTERNS)
    radius = {k: np.linalg.norm(w) for k, w in ref.p.items() if PARAMS[k][1] in MUON}

    def check(params, state, t):
        ours = flatten(params)
        assert_close(ours, ref.p, f"step {t}")
        for k, r in radius.items():  # the hyperball: each matrix keeps its initial norm
            np.testing.assert_allclose(np.linalg.norm(ours[k]), r, rtol=1e-5)

    run_against(tx, ref, T, check)


def test_muloco_normuonh_matches_record_13():
    """Outer steps after updates 3, 6, 9 (k = 3): the last update is a sync."""
    T, k = 9, 3
    ref = RecordMuonH(init_weights(), T, normuon=True, k=k)
    tx = recipes.muloco_normuonh(T, sync_every=k, ns_dtype=jnp.float32,
                                 adam_patterns=AUX_PATTERNS)
    run_against(tx, ref, T, lambda params, state, t: assert_close(
        flatten(params), ref.p, f"step {t}"))


def test_track3_newton_muon_groups_match_record_15():
    """#15's per-group Muon lr/wd and aux AdamW over the steps before the first refresh
    (the preconditioner is the identity until then; `test_newton_muon` checks it)."""
    T = 6
    lr_wd = {"blocks/0/attn/c_q/kernel": (0.020, 0.025),
             "blocks/0/attn/c_proj/kernel": (0.025, 0.025),
             "blocks/0/mlp/c_fc/kernel": (0.030, 0.0375),
             "blocks/0/mlp/c_proj/kernel": (0.030, 0.025)}
    w = init_weights()
    ref = {n: x.copy() for n, x in w.items()}
    mom = {n: np.zeros_like(x) for n, x in w.items()}
    sq = {n: np.zeros_like(x) for n, x in w.items()}
    tx = recipes.track3_newton_muon(T, ns_dtype=jnp.float32, adam_patterns=AUX_PATTERNS)
    params = nest(w)
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(gradients(T)):
        eta = stable_cooldown(t, T, 0.7)
        for n, x in g.items():
            if n in lr_wd:
                lr, wd = lr_wd[n][0] * eta, lr_wd[n][1]
                mom[n] = 0.95 * mom[n] + 0.05 * x
                o = ref_ns(0.95 * mom[n] + 0.05 * x, recipes.TRACK3_COEFFICIENTS)
                scale = max(1.0, x.shape[1] / x.shape[0]) ** 0.5  # (in, out): out/in
                ref[n] = ref[n] * (1 - lr * wd) - lr * scale * o
            else:
                lr = AUX[PARAMS[n][1]] * eta
                ref[n], mom[n], sq[n] = adam_step(ref[n], x, mom[n], sq[n], t + 1, lr, 0.8,
                                                  0.95, 1e-10, bias_correction=True)
        u, state = update(nest(g), state, params, input_covariance=None)
        params = optax.apply_updates(params, u)
        assert_close(flatten(params), ref, f"step {t}")


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
    inner = {"track3_soap_muon": lambda: recipes.track3_soap_muon(N, ns_dtype=jnp.float32),
             "muonh": lambda: recipes.muonh(T, ns_dtype=jnp.float32,
                                            adam_patterns=AUX_PATTERNS),
             "track3_record": lambda: recipes.track3_record(N, ns_dtype=jnp.float32)}[name]
    weights, grads = init_weights(), gradients(T)
    ref = numpy_snoo(_BlackBox(inner()), weights, grads, 0.7, 0.5, k)
    tx, params = optax_snoo.snoo(inner(), 0.7, 0.5, k), nest(weights)
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, params)
        params = optax.apply_updates(params, u)
        assert_close(flatten(params), ref[t], f"{name} step {t}")


def test_track3_record_state_readouts_and_orbax(tmp_path):
    params = nest(init_weights())
    tx = recipes.track3_record(8, ns_dtype=jnp.float32)  # tail EMA from update 7
    p, state, _ = m.run(tx, params, 8)
    ema_nesterov_state, tail_state = state
    assert isinstance(ema_nesterov_state, optax_snoo.EmaNesterovState)
    assert isinstance(tail_state, optax_snoo.TailEmaState)
    assert tail_state.blend == np.float32(0.6)  # the tail EMA started
    assert isinstance(tail_state.ema["wte"]["embedding"], optax.MaskedNode)  # embed excluded
    readout = optax_snoo.eval_params(p, state)
    assert not np.allclose(readout["lm_head"]["kernel"], p["lm_head"]["kernel"])
    np.testing.assert_array_equal(readout["wte"]["embedding"], p["wte"]["embedding"])
    m.check_orbax_roundtrip(tx, params, tmp_path, steps_before=6, steps_after=2)


def test_step_constants_scale_with_total_steps():
    """The lookahead window (300, 1950) and the tail EMA's start (2400) at N = 2900 and at
    N = 290 (one tenth)."""
    params = nest(init_weights())
    for n, prefill, stop, start in ((2900, 300, 1950, 2400), (290, 30, 195, 240)):
        at = _wrappers_after(recipes.track3_record(n), params)
        assert at(prefill - 1)[0] == 0.0 and at(prefill)[0] > 0.0, n
        assert at(stop - 1)[0] > 0.0 and at(stop)[0] == 0.0, n
        assert at(start - 1)[1] == 0.0 and at(start)[1] == np.float32(0.6), n


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
    with pytest.raises(ValueError, match="total_steps"):
        recipes.track3_record(3)
    with pytest.raises(ValueError, match="adam_patterns: expected the keys"):
        recipes.track3_record(adam_patterns={"embed": "wte"})
    with pytest.raises(ValueError, match="muon_learning_rate"):
        recipes.track3_record(muon_learning_rate=0.0)
    stray = nest({"blocks/0/attn/other/kernel": np.ones((4, 4))})
    tx = recipes.track3_newton_muon()
    with pytest.raises(ValueError, match="matches no group"):
        tx.update(stray, tx.init(stray), stray, input_covariance=None)
    with pytest.raises(ValueError, match="muon_groups"):
        recipes.track3_newton_muon(muon_groups=())


def test_patterns_fit_the_track3_network():
    """On `models.track3_config`'s GPT each leaf lands in #46's group for it (the bf16
    embedding included) and the tail EMA leaves the embedding out. (The trust gate's
    pattern is checked on these names by `test_track3_record_matches_record_46`.)"""
    from flax import nnx

    import models

    cfg = models.track3_config(n_layer=2, n_embd=32, head_dim=16, vocab_size=64,
                               block_size=16)
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    state = recipes.track3_record(8).init(params)
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
    tail = flatten(jax.tree.map(lambda e: 0.0 if isinstance(e, optax.MaskedNode) else 1.0,
                                state[1].ema, is_leaf=lambda x: isinstance(x, optax.MaskedNode)))
    assert [p for p, kept in tail.items() if not kept] == ["wte/embedding"]
