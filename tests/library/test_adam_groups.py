"""The Adam groups of `optax_snoo.muon` (the one Muon + Adam builder) and `scale_by_adam`
with the bias correction on or off, against a float64 numpy Adam written from the
formulas (Kingma & Ba; PyTorch's AdamW for the decoupled decay, ``p ← p(1 - lr·wd)``;
modded-nanogpt Track 3 record #46's uncorrected ``Adam`` class), step by step over many
steps, with per-group learning-rate and weight-decay schedules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
from optax_matrix import nest
from optax_snoo import AdamGroup, adam_group, muon, scale_by_adam
from optax_snoo._src.muon_adam import group_labels
from references.error import assert_as_accurate, program_text, run_in_float64

MODDED = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
          (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))  # modded-nanogpt's triples


def ref_ns(x):
    X = np.asarray(x, np.float64)
    transposed = X.shape[-2] > X.shape[-1]
    X = X.T if transposed else X
    X = X / (np.linalg.norm(X) + 1e-7)
    for a, b, c in MODDED:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


class RefAdam:
    """One Adam group in float64: moments, optional bias correction and Nesterov,
    decoupled decay multiplied by the learning rate."""

    def __init__(self, lr, b1, b2, eps, wd=0.0, bias_correction=True, nesterov=False):
        self.lr = lr if callable(lr) else (lambda t: lr)
        self.wd = wd if callable(wd) else (lambda t: wd)
        self.b1, self.b2, self.eps = b1, b2, eps
        self.bc, self.nesterov = bias_correction, nesterov
        self.m, self.v = {}, {}

    def direction(self, k, g, t):
        """Adam's direction at 0-based step t (before lr and decay)."""
        b1, b2 = self.b1, self.b2
        self.m[k] = b1 * self.m.get(k, 0.0) + (1 - b1) * g
        self.v[k] = b2 * self.v.get(k, 0.0) + (1 - b2) * g * g
        c1, c1_next, c2 = ((1 - b1 ** (t + 1), 1 - b1 ** (t + 2), 1 - b2 ** (t + 1)) if self.bc
                           else (1.0, 1.0, 1.0))
        m = (b1 * self.m[k] / c1_next + (1 - b1) * g / c1) if self.nesterov else self.m[k] / c1
        return m / (np.sqrt(self.v[k] / c2) + self.eps)

    def step(self, k, p, g, t):
        lr, wd = self.lr(t), self.wd(t)
        return p * (1 - lr * wd) - lr * self.direction(k, g, t)  # torch.optim.AdamW order


def test_scale_by_adam_bias_correction_on_is_optax():
    g = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    ours, theirs = scale_by_adam(0.8, 0.95, 1e-10), optax.scale_by_adam(0.8, 0.95, 1e-10)
    s1, s2 = ours.init(g), theirs.init(g)
    up1, up2 = jax.jit(ours.update), jax.jit(theirs.update)
    # optax's own program, so bit for bit its numbers and state.
    assert program_text(up1.lower(g, s1)) == program_text(up2.lower(g, s2))
    for _ in range(3):
        (u1, s1), (u2, s2) = up1(g, s1), up2(g, s2)
        jax.tree.map(np.testing.assert_array_equal, (u1, s1), (u2, s2))


@pytest.mark.parametrize("nesterov", [False, True])
def test_scale_by_adam_without_bias_correction_matches_reference(nesterov):
    """Record #46's 1-D Adam: m, v lerped from zero and used as they are."""
    rng = np.random.default_rng(0)
    tx = scale_by_adam(0.8, 0.99, 1e-10, nesterov=nesterov, bias_correction=False)
    ref = RefAdam(1.0, 0.8, 0.99, 1e-10, bias_correction=False, nesterov=nesterov)
    state, update = tx.init({"b": jnp.zeros(7)}), jax.jit(tx.update)
    for t in range(80):
        g = rng.standard_normal(7) * (1 + t % 5)
        u, state = update({"b": jnp.asarray(g, jnp.float32)}, state)
        # atol: m is a float32 sum of O(1) gradients, so where it cancels to ~1e-3 its
        # absolute error (~1e-7) is a large part of it.
        np.testing.assert_allclose(np.asarray(u["b"], np.float64), ref.direction("b", g, t),
                                   rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    assert int(state.count) == 80 and isinstance(state, optax.ScaleByAdamState)


# A GPT-like tree: a Muon matrix and, for the Adam groups, an embedding, a head, a bias
# and a norm scale.
SHAPES = {"wte/embedding": (12, 6), "blocks/0/attn/c_q/kernel": (6, 10),
          "blocks/0/attn/c_q/bias": (10,), "blocks/0/ln_1/scale": (6,),
          "lm_head/kernel": (6, 12)}
STEPS = 60


def flatten(tree):
    return {optax_snoo.labels.path_to_str(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_adam_groups_match_float64_reference_over_many_steps():
    """Three groups with their own lr schedules, betas, eps, weight decay (one scheduled)
    and bias correction on (embedding, head) and off (1-D, Nesterov), beside Muon."""
    cool = lambda peak, xp: (lambda t: peak * xp.minimum(1.0, 2.0 * (1 - t / STEPS)))
    wd_sched = optax.linear_schedule(0.02, 0.0, STEPS)
    groups = [
        AdamGroup(r"(^|/)(bias|scale)$", cool(0.01, jnp), b1=0.8, b2=0.99, eps=1e-10,
                  bias_correction=False, nesterov=True, name="vectors"),
        AdamGroup(r"(^|/)wte(/|$)", cool(0.3, jnp), b1=0.8, b2=0.95, eps=1e-10,
                  weight_decay=0.01, name="embed"),
        AdamGroup(r"(^|/)lm_head(/|$)", 0.004, b1=0.9, b2=0.95, eps=1e-8,
                  weight_decay=wd_sched, name="head"),
    ]
    refs = {
        "vectors": RefAdam(cool(0.01, np), 0.8, 0.99, 1e-10, bias_correction=False,
                           nesterov=True),
        "embed": RefAdam(cool(0.3, np), 0.8, 0.95, 1e-10, wd=0.01),
        "head": RefAdam(0.004, 0.9, 0.95, 1e-8, wd=lambda t: 0.02 * (1 - t / STEPS)),
    }
    group_of = {"wte/embedding": "embed", "lm_head/kernel": "head",
                "blocks/0/attn/c_q/bias": "vectors", "blocks/0/ln_1/scale": "vectors"}
    tx = muon(0.02, beta=0.9, weight_decay=0.05, ns_dtype=jnp.float32, adam_groups=groups)
    rng = np.random.default_rng(1)
    ref_p = {n: 0.5 * rng.standard_normal(s) for n, s in SHAPES.items()}
    params = nest(ref_p)
    state = tx.init(params)
    assert sorted(state.inner_states) == ["embed", "head", "muon", "vectors"]
    update, mom = jax.jit(tx.update), np.zeros(SHAPES["blocks/0/attn/c_q/kernel"])
    for t in range(STEPS):
        grads = {n: rng.standard_normal(s) * (1 + t % 3) for n, s in SHAPES.items()}
        u, state = update(nest(grads), state, params)
        params = optax.apply_updates(params, u)
        for n, g in grads.items():
            if n in group_of:
                ref_p[n] = refs[group_of[n]].step(n, ref_p[n], g, t)
            else:  # Muon: 0.9 EMA-Nesterov momentum, shape scale sqrt(10/6), wd 0.05
                mom = 0.9 * mom + 0.1 * g
                o = ref_ns(0.9 * mom + 0.1 * g) * np.sqrt(10 / 6)
                ref_p[n] = ref_p[n] * (1 - 0.02 * 0.05) - 0.02 * o
        ours = flatten(params)
        for n in SHAPES:
            np.testing.assert_allclose(ours[n], ref_p[n], rtol=1e-5, atol=2e-6,
                                       err_msg=f"step {t}, {n}")


def test_default_single_group_is_optax_adamw():
    """No adam_groups: one group "adam" from the adam_* arguments, optax.adamw's numbers."""
    params = {"b": jnp.linspace(-1.0, 1.0, 5), "w": jnp.ones((4, 4))}
    labels = {"b": "adam", "w": "muon"}
    tx = muon(0.02, adam_learning_rate=3e-3, adam_b1=0.8, adam_b2=0.95, adam_eps=1e-10,
              adam_weight_decay=0.1, labels=labels)
    adamw = optax.adamw(3e-3, 0.8, 0.95, 1e-10, weight_decay=0.1)
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 2)), params) for i in range(3)]

    def run_adamw(p, grads):  # its updates of "b" (on float64 values: their computation)
        state, update, out = adamw.init(p), jax.jit(adamw.update), []
        for g in grads:
            u, state = update(g["b"], state, p)
            out.append(u)
        return out

    exact = run_in_float64(run_adamw, params["b"], grads)
    s1, s2 = tx.init(params), adamw.init(params["b"])
    assert sorted(s1.inner_states) == ["adam", "muon"]
    for i, g in enumerate(grads):
        (u1, s1), (u2, s2) = tx.update(g, s1, params), adamw.update(g["b"], s2, params["b"])
        # Another program (a partition, the decay as its own transform): as accurate.
        assert_as_accurate(u1["b"], u2, exact[i], what=f"update {i}")


def test_unmatched_leaf_and_bad_groups_raise():
    params = {"w": jnp.ones((4, 4)), "ln": {"scale": jnp.ones(4)}}
    tx = muon(0.02, adam_groups=[AdamGroup("lm_head", 0.01)])
    with pytest.raises(ValueError, match=r"parameter 'ln/scale' matches no Adam group "
                                         r"\['lm_head'\]"):
        tx.init(params)
    with pytest.raises(ValueError, match="names must be distinct and not 'muon'"):
        muon(0.02, adam_groups=[AdamGroup("a", 0.1, name="x"), AdamGroup("b", 0.1, name="x")])
    with pytest.raises(ValueError, match="names must be distinct and not 'muon'"):
        muon(0.02, adam_groups=[AdamGroup("a", 0.1, name="muon")])
    with pytest.raises(ValueError, match="adam_b2.*given beside adam_groups"):
        muon(0.02, adam_b2=0.95, adam_groups=[AdamGroup(".*", 0.1)])
    with pytest.raises(ValueError, match="at least one AdamGroup"):
        muon(0.02, adam_groups=[])
    with pytest.raises(ValueError, match="expected AdamGroup"):
        muon(0.02, adam_groups=[(".*", 0.1)])
    with pytest.raises(ValueError, match=r"AdamGroup 'embed': learning_rate must be >= 0"):
        muon(0.02, adam_groups=[AdamGroup("wte", -0.1, name="embed")])
    with pytest.raises(ValueError, match=r"AdamGroup '\.\*': b2 must be in \[0, 1\)"):
        adam_group(AdamGroup(".*", 0.1, b2=1.0))
    with pytest.raises(ValueError, match="not a valid regex"):
        adam_group(AdamGroup("(", 0.1))


def test_claim_takes_muon_leaves_and_keeps_adams_first_match_order():
    """A model naming its embedding ``tok_emb`` and head ``out``: the default labels give
    their matrices to Muon; a claiming group takes them back, while a 1-D leaf its pattern
    also matches (``out/bias``) stays in the first Adam group it matches."""
    params = {"tok_emb": jnp.ones((16, 4)), "h": {"kernel": jnp.ones((4, 4))},
              "out": {"kernel": jnp.ones((4, 16)), "bias": jnp.ones(16)}}
    groups = [AdamGroup(r"(^|/)bias$", 0.01, name="vectors"),
              AdamGroup("tok_emb", 0.3, name="embed", claim=True),
              AdamGroup("^out/", 0.004, name="head", claim=True)]
    want = {"tok_emb": "embed", "h": {"kernel": "muon"},
            "out": {"kernel": "head", "bias": "vectors"}}
    assert group_labels(groups)(params) == want
    unclaimed = [g._replace(claim=False) for g in groups]
    assert group_labels(unclaimed)(params)["out"]["kernel"] == "muon"
    state = muon(0.02, adam_groups=groups).init(params)
    assert not isinstance(state.inner_states["head"].inner_state[0].mu["out"]["kernel"],
                          optax.MaskedNode)


def test_required_group_matching_nothing_names_it_its_pattern_and_labels():
    params = {"tok_emb": jnp.ones((16, 4)), "h": {"kernel": jnp.ones((4, 4))},
              "b": jnp.ones(4)}
    tx = muon(0.02, adam_groups=[AdamGroup("wte", 0.3, name="embed", required=True),
                                 AdamGroup(".*", 0.01, name="rest")])
    with pytest.raises(ValueError, match=r"^Adam group 'embed' matches no parameter "
                                         r"\(pattern 'wte'\).*labels=") as err:
        tx.init(params)
    assert "\n" not in str(err.value)
    # Not required: the group may stay empty.
    muon(0.02, adam_groups=[AdamGroup("wte", 0.3, name="embed"),
                            AdamGroup(".*", 0.01, name="rest")]).init(params)
