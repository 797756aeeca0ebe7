"""`recipes.track3_baseline` against a float64 numpy transcription of modded-nanogpt Track 3
record #36's optimizer step (`train_gpt_simple.py`: `zeropower_via_newtonschulz5`,
`muon_update`, `Muon.step`, `torch.optim.AdamW` with its three groups, `set_hparams`), run
on PyTorch's (out, in) layout: our (in, out) kernels are transposed into it and back. Every
number of #36 is typed in from its script (`references.track3_constants.R36`); a control
(the cooldown moved by a few percent) must fail the comparison."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import optax_snoo
from optax_matrix import nest
from optax_snoo import recipes
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R36

T = 12  # total steps: flat for steps 0-3 (t/T < 0.3), then the linear cooldown


def eta(step, total=T, cooldown_frac=R36.cooldown_frac):
    progress = step / total
    return 1.0 if progress < 1 - cooldown_frac else (1 - progress) / cooldown_frac


def zeropower(G):
    """`zeropower_via_newtonschulz5` of #36 in float64."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[-2] > G.shape[-1] else X


class Record36:
    """#36's two optimizers on float64 torch-layout weights."""

    def __init__(self, weights, groups):
        self.w, self.groups = weights, groups  # name -> "muon" | (group lr)
        self.momentum = {n: np.zeros_like(w) for n, w in weights.items()}
        self.exp_avg = {n: np.zeros_like(w) for n, w in weights.items()}
        self.exp_avg_sq = {n: np.zeros_like(w) for n, w in weights.items()}

    def step(self, grads, step):
        e = eta(step)
        for n, g in grads.items():
            p = self.w[n]
            if self.groups[n] == "muon":
                lr, mu = R36.muon_lr * e, R36.muon_mu
                m = self.momentum[n] = self.momentum[n] + (1 - mu) * (g - self.momentum[n])
                update = zeropower(g + mu * (m - g))  # grad.lerp_(momentum, mu)
                update = update * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
                self.w[n] = p * (1 - lr * R36.muon_wd) - lr * update
            else:  # torch.optim.AdamW, step count t = step + 1
                lr, (b1, b2), t = self.groups[n] * e, R36.adam_betas, step + 1
                eps, wd = R36.adam_eps, R36.adam_wd
                p = p * (1 - lr * wd)
                self.exp_avg[n] = b1 * self.exp_avg[n] + (1 - b1) * g
                self.exp_avg_sq[n] = b2 * self.exp_avg_sq[n] + (1 - b2) * g * g
                step_size = lr / (1 - b1**t)
                denom = np.sqrt(self.exp_avg_sq[n]) / np.sqrt(1 - b2**t) + eps
                self.w[n] = p - step_size * self.exp_avg[n] / denom


# Our GPT's paths, their (in, out) shapes and #36's group: "muon", or the AdamW group's lr.
PARAMS = {
    "wte/embedding": ((16, 8), R36.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R36.vector_lr),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), R36.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "muon"),
    "blocks/0/mlp/c_fc/bias": ((24,), R36.vector_lr),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "muon"),
    "ln_f/scale": ((8,), R36.vector_lr),
    "lm_head/kernel": ((8, 16), R36.head_lr),
    "lm_head/bias": ((16,), R36.vector_lr),  # every 1-D parameter is in #36's 1-D group
}
KERNEL = lambda n: n.endswith("kernel")  # (in, out) here, (out, in) in the record


RTOL, ATOL = 1e-5, 1e-6  # float32 (Newton-Schulz included) against float64


def compare_record_36(**moved):
    """The largest error over the 12 steps (flat to step 3, then the cooldown), as a
    multiple of the tolerance, and where."""
    rng = np.random.default_rng(0)
    ours = {n: 0.1 * rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
    torch_layout = lambda n, x: x.T if KERNEL(n) else x
    ref = Record36({n: torch_layout(n, x.copy()) for n, x in ours.items()},
                   {n: group for n, (_, group) in PARAMS.items()})
    tx = recipes.track3_baseline(T, ns_dtype="float32", **moved)
    params = nest(ours)
    state = tx.init(params)
    update = jax.jit(tx.update)
    worst = (0.0, None)
    for step in range(T):
        grads = {n: rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
        u, state = update(nest(grads), state, params)
        params = optax.apply_updates(params, u)
        ref.step({n: torch_layout(n, g) for n, g in grads.items()}, step)
        flat = {optax_snoo.labels.path_to_str(p): np.asarray(x, np.float64)
                for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        for n in PARAMS:
            want = torch_layout(n, ref.w[n])
            ratio = float(np.max(np.abs(flat[n] - want) / (ATOL + RTOL * np.abs(want))))
            if not ratio <= worst[0]:
                worst = (ratio, f"step {step}, {n}")
    return worst


def test_track3_baseline_matches_record_36_in_float64():
    worst = compare_record_36()
    assert worst[0] <= 1, worst


@pytest.mark.parametrize("moved", [dict(cooldown_frac=0.68), dict(adam_b2=0.96)])
def test_a_moved_hyperparameter_fails_the_comparison(moved):
    """The control: a hyperparameter moved by a few percent is far outside the tolerance."""
    worst = compare_record_36(**moved)
    assert worst[0] > 10, worst


def test_track3_baseline_defaults_are_record_36s():
    recipe = recipes.track3_baseline
    want = dict(muon_learning_rate=R36.muon_lr, muon_momentum=R36.muon_mu,
                muon_weight_decay=R36.muon_wd, embed_learning_rate=R36.embed_lr,
                head_learning_rate=R36.head_lr, vector_learning_rate=R36.vector_lr,
                adam_b1=R36.adam_betas[0], adam_b2=R36.adam_betas[1], adam_eps=R36.adam_eps,
                adam_weight_decay=R36.adam_wd, cooldown_frac=R36.cooldown_frac)
    assert {k: getattr(recipe.defaults, k) for k in want} == want
    assert recipe.record_steps == R36.steps
    assert recipes.snoo_track3_baseline.record_steps == R36.steps


def test_snoo_track3_baseline_is_snoo_around_it():
    """Snoo's outer step (0.7, 0.5, k=3) on #36's k-step displacements (numpy, float64),
    the inner step the recipe's own run on float32 copies of the reference's point."""
    from references.snoo import numpy_snoo
    from references.track3 import flatten
    rng = np.random.default_rng(3)
    weights = {n: 0.1 * rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
             for _ in range(T)]

    class BlackBox:
        def __init__(self):
            self.tx = recipes.track3_baseline(T, ns_dtype="float32")
            self.update_fn = jax.jit(self.tx.update)

        def init(self, p):
            return self.tx.init(nest(p))

        def update(self, g, s, p):
            u, s = self.update_fn(nest(g), s, nest(p))
            return flatten(u), s

    ref = numpy_snoo(BlackBox(), weights, grads, 0.7, 0.5, 3)
    tx = recipes.snoo_track3_baseline(T, ns_dtype="float32", snoo_learning_rate=0.7,
                                      snoo_momentum=0.5, snoo_k=3)
    params = nest(weights)
    state, update = tx.init(params), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u, state = update(nest(g), state, params)
        params = optax.apply_updates(params, u)
        ours = flatten(params)
        for n in PARAMS:
            np.testing.assert_allclose(ours[n], ref[t][n], rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {t}, {n}")


def test_track3_baseline_groups_and_bad_input():
    params = nest({n: np.zeros(shape) for n, (shape, _) in PARAMS.items()})
    tx = recipes.track3_baseline()
    groups = {"muon": "muon", R36.embed_lr: "embed", R36.head_lr: "head",
              R36.vector_lr: "vectors"}
    state = tx.init(params)
    assert sorted(state.inner_states) == ["embed", "head", "muon", "vectors"]
    for n, (_, group) in PARAMS.items():
        for name, inner in state.inner_states.items():
            node = inner.inner_state[0].mu  # MuonState / ScaleByAdamState, masked
            for key in n.split("/"):
                node = node[key]
            assert isinstance(node, optax.MaskedNode) == (name != groups[group]), (n, name)
    with pytest.raises(ValueError, match=r"^adam_patterns: \['embedding'\] are not groups of "
                                         r"this recipe; its groups are \['vectors', 'embed', "
                                         r"'head'\]$"):
        recipes.track3_baseline(adam_patterns={"embedding": "wte"})
    with pytest.raises(ValueError, match=r"^recipe track3_baseline: head_learning_rate=-1\.0: "
                                         "expected a finite number > 0$"):
        recipes.track3_baseline(head_learning_rate=-1.0)
    router = nest({"wte/embedding": np.zeros((16, 8)), "lm_head/kernel": np.zeros((8, 16)),
                   "blocks/0/moe/router/kernel": np.zeros((8, 4))})
    with pytest.raises(ValueError, match="parameter 'blocks/0/moe/router/kernel' matches no "
                                         "Adam group"):
        recipes.track3_baseline().init(router)
