"""`recipes.track3_psgd` against a float64 numpy transcription of modded-nanogpt Track 3
result #33's optimizer (its script `train_psgd.py`: `init_psgd`, `spectral_norm`,
`psgd_update_precond`, `PSGDKron.step` with its hyperball, the aux AdamW, `get_psgd_lr`,
`get_adam_lr_scale`), on PyTorch's (out, in) layout (our (in, out) kernels transposed in and
back), over a run that crosses the aux groups' cooldown. The reference is fed the normal
draws ours makes (`optax_snoo.psgd_probes`, transposed); every constant is typed in from the
log (`references.track3_constants.R33`); controls (one constant moved) must fail."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from optax_snoo import psgd_probes, recipes
from references.error import in_float64, run_in_float64
from references.track3 import flatten, nest
from references.track3_constants import R33

T = 20  # aux groups flat for steps 0-9, then linear to 0.1


def spectral_norm(A):
    """`spectral_norm` (log:174-184)."""
    scale = np.abs(A).sum(1).max()
    if scale == 0:
        return scale
    A = A / scale
    x = A[:, (A * A).sum(0).argmax()]
    x = A @ x
    x = x / np.linalg.norm(x)
    return scale * np.linalg.norm(A @ x)


def solve_upper(U, b):
    """Back substitution for ``U x = b`` (columns of ``b``), U upper triangular."""
    n = U.shape[0]
    x = np.zeros_like(b)
    for i in range(n - 1, -1, -1):
        x[i] = (b[i] - U[i, i + 1:] @ x[i + 1:]) / U[i, i]
    return x


def solve_lower(L, b):
    """Forward substitution for ``L x = b``, L lower triangular."""
    x = np.zeros_like(b)
    for i in range(L.shape[0]):
        x[i] = (b[i] - L[i, :i] @ x[:i]) / L[i, i]
    return x


@dataclasses.dataclass
class Record33:
    """#33's PSGDKron and aux AdamW on float64 torch-layout weights; `groups`: name ->
    "psgd" or the aux lr; `probes[step][name]`: the (v, nu) draws in torch layout."""

    groups: dict
    probes: list
    psgd_lr: float = R33.psgd_lr
    precond_lr: float = R33.precond_lr
    b1: float = R33.b1
    damping: float = R33.damping
    init_power: float = R33.init_power
    adam_final_scale: float = R33.adam_final_scale
    exact_norm: bool = False

    def norm2(self, A):
        return np.linalg.norm(A, 2) if self.exact_norm else spectral_norm(A)

    def fit(self, Q0, Q1, U, v):  # psgd_update_precond, log:187-207
        r = np.sqrt(np.abs(Q1).max() / np.abs(Q0).max())
        Q0, Q1 = Q0 * r, Q1 / r
        A = Q0 @ U @ Q1.T
        B = solve_lower(Q0.T, v)                  # solve_triangular(Q0.mT, v, upper=False)
        B = solve_lower(Q1.T, B.T).T              # B Q1 = B_prev (left=False, upper=True)
        AAt, BBt = A @ A.T, B @ B.T
        Q0 = Q0 - self.precond_lr / self.norm2(AAt + BBt) * np.triu(AAt - BBt) @ Q0
        AtA, BtB = A.T @ A, B.T @ B
        Q1 = Q1 - self.precond_lr / self.norm2(AtA + BtB) * np.triu(AtA - BtB) @ Q1
        return Q0, Q1

    def run(self, weights, grads_by_step):
        w = dict(weights)
        state = {}
        out = []
        for step, grads in enumerate(grads_by_step):
            lr = self.psgd_lr * (1 - step / T)                          # get_psgd_lr
            cs = int(T * (1 - R33.adam_cooldown_frac))                  # get_adam_lr_scale
            scale = 1.0 if step < cs else 1.0 - (step - cs) / (T - cs) * (1 - self.adam_final_scale)
            for n, g in grads.items():
                if self.groups[n] == "psgd":                            # PSGDKron.step
                    if n not in state:                                  # init_psgd
                        s = max(np.mean(np.abs(g) ** 4), R33.init_floor) ** self.init_power
                        state[n] = [np.eye(g.shape[0]) * s, np.eye(g.shape[1]) * s,
                                    np.zeros_like(g), 0]
                    Q0, Q1, m, t = state[n]
                    t += 1
                    m = m + (1 - self.b1) * (g - m)                     # lerp_
                    update = m / (1 - self.b1**t)
                    v, nu = self.probes[step][n]
                    Q0, Q1 = self.fit(Q0, Q1, update + self.damping * np.abs(update) * nu, v)
                    u = (Q0.T @ Q0) @ update @ (Q1.T @ Q1)
                    p_norm = np.linalg.norm(w[n])
                    new_p = w[n] - lr * u * (p_norm / (np.linalg.norm(u) + R33.norm_eps))
                    w[n] = new_p / (np.linalg.norm(new_p) + R33.norm_eps) * p_norm
                    state[n] = [Q0, Q1, m, t]
                else:  # torch.optim.AdamW, no decay
                    m, vv, t = state.get(n, [np.zeros_like(g), np.zeros_like(g), 0])
                    (b1, b2), t, alr = R33.adam_betas, t + 1, self.groups[n] * scale
                    m = m + (1 - b1) * (g - m)
                    vv = b2 * vv + (1 - b2) * g * g
                    denom = np.sqrt(vv) / np.sqrt(1 - b2**t) + R33.adam_eps
                    w[n] = w[n] - alr / (1 - b1**t) * m / denom
                    state[n] = [m, vv, t]
            out.append(dict(w))
        return out


PARAMS = {  # our GPT's paths, (in, out) shapes and #33's group
    "wte/embedding": ((16, 8), R33.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R33.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "psgd"),
    "blocks/0/attn/c_q/bias": ((16,), R33.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((16, 48), "psgd"),
    "blocks/0/mlp/c_proj/kernel": ((48, 16), "psgd"),
    "lm_head/kernel": ((16, 16), R33.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "psgd"]


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = [{n: rng.standard_normal(s) for n, (s, _) in PARAMS.items()} for _ in range(T)]
    return weights, grads


def probes():
    """Ours' draws per step and matrix, in torch layout, as float64 numpy."""
    key = jax.random.PRNGKey(0)
    with in_float64():
        out = []
        for step in range(T):
            draws = {}
            for n in MATRICES:
                path = "".join(f"['{k}']" for k in n.split("/"))
                v, nu = psgd_probes(key, step, path, PARAMS[n][0], np.float64)
                draws[n] = (np.asarray(v).T, np.asarray(nu).T)
            out.append(draws)
    return out


def ours(weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipes.track3_psgd(T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        for g in gs:
            updates, state = tx.update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(weights, grads, **control):
    groups = {n: g for n, (_, g) in PARAMS.items()}
    return Record33(groups, probes(), **control).run(torch_layout(weights),
                                                     [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


@pytest.fixture(scope="module")
def runs():
    weights, grads = problem()
    return weights, grads, ours(weights, grads)


def test_track3_psgd_matches_result_33_in_float64(runs):
    weights, grads, got = runs
    assert worst(got, reference(weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(psgd_lr=R33.psgd_lr * 1.03), dict(precond_lr=0.97), dict(b1=0.96),
    dict(damping=R33.damping * 4), dict(init_power=-1 / 31), dict(exact_norm=True),
    dict(adam_final_scale=0.12)])
def test_a_moved_constant_fails_the_comparison(runs, control):
    weights, grads, got = runs
    assert worst(got, reference(weights, grads, **control)) > 1e-8


def test_the_defaults_are_result_33s():
    t = recipes.track3_psgd.defaults
    assert (t.psgd_learning_rate, t.psgd_b1, t.precond_lr, t.psgd_damping, t.pin,
            t.adam_cooldown_frac, t.adam_final_lr_scale) == (
        R33.psgd_lr, R33.b1, R33.precond_lr, R33.damping, "current", R33.adam_cooldown_frac,
        R33.adam_final_scale)
    assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
            (t.adam_b1, t.adam_b2), t.adam_eps) == (
        R33.embed_lr, R33.head_lr, R33.vector_lr, R33.adam_betas, R33.adam_eps)
    assert recipes.track3_psgd.record_steps == R33.steps


def test_bad_hyperparameters_fail_at_construction():
    from optax_snoo import scale_by_psgd_kron
    with pytest.raises(ValueError, match="precond_lr"):
        scale_by_psgd_kron(precond_lr=0.0)
    with pytest.raises(ValueError, match="b1"):
        scale_by_psgd_kron(b1=1.0)
    with pytest.raises(ValueError, match="at least two axes"):
        scale_by_psgd_kron().init({"b": np.zeros(3)})
