"""`recipes.track3_baseline` against a float64 numpy transcription of modded-nanogpt Track 3
record #36's optimizer step (`train_gpt_simple.py`: `zeropower_via_newtonschulz5`,
`muon_update`, `Muon.step`, `torch.optim.AdamW` with its three groups, `set_hparams`), run
on PyTorch's (out, in) layout: our (in, out) kernels are transposed into it and back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_snoo
from optax_matrix import nest
from optax_snoo import recipes

T = 12  # total steps: flat for steps 0-3 (t/T < 0.3), then the linear cooldown


def eta(step, total=T, cooldown_frac=0.7):
    progress = step / total
    return 1.0 if progress < 1 - cooldown_frac else (1 - progress) / cooldown_frac


def zeropower(G):
    """`zeropower_via_newtonschulz5` of #36 in float64."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(12):
        A = X @ X.T
        X = 2 * X + (-1.5 * A + 0.5 * A @ A) @ X
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
                lr, mu = 0.025 * e, 0.95
                m = self.momentum[n] = self.momentum[n] + (1 - mu) * (g - self.momentum[n])
                update = zeropower(g + mu * (m - g))  # grad.lerp_(momentum, mu)
                update = update * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
                self.w[n] = p * (1 - lr * 0.05) - lr * update
            else:  # torch.optim.AdamW, step count t = step + 1
                lr, (b1, b2), eps, wd, t = self.groups[n] * e, (0.8, 0.95), 1e-10, 0.001, step + 1
                p = p * (1 - lr * wd)
                self.exp_avg[n] = b1 * self.exp_avg[n] + (1 - b1) * g
                self.exp_avg_sq[n] = b2 * self.exp_avg_sq[n] + (1 - b2) * g * g
                step_size = lr / (1 - b1**t)
                denom = np.sqrt(self.exp_avg_sq[n]) / np.sqrt(1 - b2**t) + eps
                self.w[n] = p - step_size * self.exp_avg[n] / denom


# Our GPT's paths, their (in, out) shapes and #36's group: "muon", or the AdamW group's lr.
PARAMS = {
    "wte/embedding": ((16, 8), 0.7),
    "blocks/0/ln_1/scale": ((8,), 0.015),
    "blocks/0/attn/c_q/kernel": ((8, 8), "muon"),
    "blocks/0/attn/c_q/bias": ((8,), 0.015),
    "blocks/0/mlp/c_fc/kernel": ((8, 24), "muon"),
    "blocks/0/mlp/c_fc/bias": ((24,), 0.015),
    "blocks/0/mlp/c_proj/kernel": ((24, 8), "muon"),
    "ln_f/scale": ((8,), 0.015),
    "lm_head/kernel": ((8, 16), 0.004),
    "lm_head/bias": ((16,), 0.015),  # the record's head bias is in the 1-D group
}
KERNEL = lambda n: n.endswith("kernel")  # (in, out) here, (out, in) in the record


def test_track3_baseline_matches_record_36_in_float64():
    rng = np.random.default_rng(0)
    ours = {n: 0.1 * rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
    torch_layout = lambda n, x: x.T if KERNEL(n) else x
    ref = Record36({n: torch_layout(n, x.copy()) for n, x in ours.items()},
                   {n: group for n, (_, group) in PARAMS.items()})
    tx = recipes.track3_baseline(T, ns_dtype=jnp.float32)
    params = nest(ours)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(T):
        grads = {n: rng.standard_normal(shape) for n, (shape, _) in PARAMS.items()}
        u, state = update(nest(grads), state, params)
        params = optax.apply_updates(params, u)
        ref.step({n: torch_layout(n, g) for n, g in grads.items()}, step)
        flat = {optax_snoo.labels.path_to_str(p): np.asarray(x, np.float64)
                for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        for n in PARAMS:
            np.testing.assert_allclose(flat[n], torch_layout(n, ref.w[n]), rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {step}, {n}")


def test_track3_baseline_groups_and_bad_input():
    params = nest({n: np.zeros(shape) for n, (shape, _) in PARAMS.items()})
    tx = recipes.track3_baseline()
    groups = {"muon": "muon", 0.7: "embed", 0.004: "head", 0.015: "vectors"}
    state = tx.init(params)
    assert sorted(state.inner_states) == ["embed", "head", "muon", "vectors"]
    for n, (_, group) in PARAMS.items():
        for name, inner in state.inner_states.items():
            node = inner.inner_state[0].mu  # MuonState / ScaleByAdamState, masked
            for key in n.split("/"):
                node = node[key]
            assert isinstance(node, optax.MaskedNode) == (name != groups[group]), (n, name)
    with pytest.raises(ValueError, match="adam_patterns: expected the keys"):
        recipes.track3_baseline(adam_patterns={"embed": "wte"})
    with pytest.raises(ValueError, match=r"head_learning_rate must be >= 0"):
        recipes.track3_baseline(head_learning_rate=-1.0)
    router = nest({"blocks/0/moe/router/kernel": np.zeros((8, 4))})
    with pytest.raises(ValueError, match="matches no Adam group"):
        recipes.track3_baseline().init(router)
