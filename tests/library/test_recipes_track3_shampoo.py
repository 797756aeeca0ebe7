"""`recipes.track3_shampoo` (#21) and `recipes.track3_shampoo_pinv` (#35) against a float64
numpy transcription of the code that ran: the ``distributed_shampoo/`` package committed in
modded-nanogpt Track 3's ``results/20260513_shampoo_1_4_power/`` (`DistributedShampoo.step`,
`_compute_search_directions`, `_compute_filtered_grad_list`, `_precondition_and_grafting`,
`_apply_decoupled_or_corrected_weight_decay`; `BaseShampooPreconditionerList.
update_preconditioners` / `_update_factor_matrices` / `_precondition_grad`,
`amortized_computation`; `matrix_inverse_root` with `EigenConfig` and its
`PerturbationConfig` (#21) or `PseudoInverseConfig` (#35); `AdagradPreconditionerList` as
`AdamPreconditionerConfig`), with each log's optimizer setup, `set_hparams` and the aux
`torch.optim.AdamW`, on PyTorch's (out, in) layout (our (in, out) kernels transposed in and
back).

The record's matrices (768 to 3072 wide) are neither blocked nor merged by its
``max_preconditioner_dim=8192``; this transcription is that 2-D path (the package would
flatten these small test matrices to 1-D). The run crosses every root refresh (#21: updates
5, 10, 15, 20; before 5 Adam's direction alone) and the cooldown (from update 6 of 20). The
non-square gradients live on one 16-wide block of their long side for the first three
updates, so the long-side factor is exactly rank-deficient there (both `eigh`s give exact
zero eigenvalues, which #35's pseudo-inverse drops: a damped root is tested by #21); one
matrix's gradient is scaled by 1e-6 so the factors' epsilon and bias correction matter, one
bias's by 1e-10 so AdamW's eps does. Every constant is typed in from the logs
(`references.track3_constants.R21`, `R35`); controls (one constant moved) must fail.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

from optax_snoo import recipes
from references.error import run_in_float64
from references.track3 import adam_step, flatten, nest, stable_cooldown
from references.track3_constants import R21, R35

T = 20


def inverse_root(A, root, epsilon, pseudo_inverse):
    """`matrix_inverse_root` -> `matrix_inverse_root_eigen` (EigenConfig, default
    `perturb_before_computation=True`) -> `matrix_inverse_root_from_eigendecomposition`."""
    if epsilon != 0:                                   # _matrix_perturbation (is_eigenvalues=False)
        A = A + epsilon * np.eye(A.shape[0])
    lam, q = np.linalg.eigh(A)                         # torch.linalg.eigh: the lower triangle
    if pseudo_inverse:                                 # PseudoInverseConfig(): atol 0, rtol 0
        cutoff = max(0.0, 0.0 * max(lam.max(), 0.0))
        drop = lam <= cutoff
        inv = np.where(drop, 0.0, np.where(drop, 1.0, lam) ** (-1.0 / root))
    else:                                              # PerturbationConfig
        lam_min = lam.min()
        if lam_min < epsilon:
            lam = lam + (-lam_min)
            lam = lam + epsilon
        inv = lam ** (-1.0 / root)
    return q * inv[None, :] @ q.T


@dataclasses.dataclass
class RecordShampoo:
    """`DistributedShampoo(lr, betas, epsilon, weight_decay, DECOUPLED, frequency,
    start_preconditioning_step=-1, grafting_config=AdamPreconditionerConfig(beta2, eps))` on
    float64 torch-layout weights, and the aux AdamW; `groups`: name -> "shampoo" or the aux
    peak lr."""

    groups: dict
    lr: float
    betas: tuple
    epsilon: float
    weight_decay: float
    frequency: int
    pseudo_inverse: bool
    graft_b2: float
    graft_eps: float
    cooldown_frac: float = R21.cooldown_frac
    root: float = R21.root                            # 1 / (2 * order), order 2
    factor_bias_correction: bool = True

    def run(self, weights, grads_by_step):
        w = dict(weights)
        b1, b2 = self.betas
        start = self.frequency                        # start_preconditioning_step=-1
        state, out = {}, []
        for step, grads in enumerate(grads_by_step):
            eta = stable_cooldown(step, T, self.cooldown_frac)              # set_hparams
            t = step + 1                                                    # STEP.add_(1)
            amortized = (t % self.frequency == 0 and t > start) or t == start
            use_grafting_method = t < start
            for n, g in grads.items():
                if self.groups[n] != "shampoo":                 # torch.optim.AdamW, no decay
                    m, v, k = state.get(n, (np.zeros_like(g), np.zeros_like(g), 0))
                    w[n], m, v = adam_step(w[n], g, m, v, k + 1, self.groups[n] * eta,
                                           *R21.adam_betas, R21.adam_eps, bias_correction=True)
                    state[n] = (m, v, k + 1)
                    continue
                if n not in state:
                    k0, k1 = g.shape
                    state[n] = dict(L=np.zeros((k0, k0)), R=np.zeros((k1, k1)),
                                    Linv=np.eye(k0), Rinv=np.eye(k1), V=np.zeros_like(g),
                                    M=np.zeros_like(g))
                s = state[n]
                # update_preconditioners: factors (weighting 1 - b2), then the roots
                s["L"] = s["L"] * b2 + (1 - b2) * np.tensordot(g, g, ([1], [1]))
                s["R"] = s["R"] * b2 + (1 - b2) * np.tensordot(g, g, ([0], [0]))
                bc2 = 1.0 - b2**t if self.factor_bias_correction else 1.0
                if amortized:
                    s["Linv"] = inverse_root(s["L"] / bc2, self.root, self.epsilon,
                                             self.pseudo_inverse)
                    s["Rinv"] = inverse_root(s["R"] / bc2, self.root, self.epsilon,
                                             self.pseudo_inverse)
                s["V"] = s["V"] * self.graft_b2 + (1 - self.graft_b2) * g * g  # Adam graft
                # _compute_filtered_grad_list: beta3 == beta1, lerp_, bias correction
                s["M"] = s["M"] + (1 - b1) * (g - s["M"])
                m_hat = s["M"] / (1.0 - b1 * b1 ** (t - 1))
                adam = m_hat / (np.sqrt(s["V"] / (1.0 - self.graft_b2**t)) + self.graft_eps)
                if use_grafting_method:
                    p = adam
                else:                             # _precondition_grad: tensordot over dim 0
                    p = np.tensordot(np.tensordot(m_hat, s["Linv"], ([0], [0])), s["Rinv"],
                                     ([0], [0]))
                    p = p * (np.linalg.norm(adam) / (np.linalg.norm(p) + 1e-16))
                p = p + self.weight_decay * w[n]                  # DECOUPLED
                w[n] = w[n] + (-self.lr * eta) * p
            out.append(dict(w))
        return out


def record(constants, **control):
    c = constants
    return dict(lr=c.lr, betas=c.betas, epsilon=c.epsilon, weight_decay=c.weight_decay,
                frequency=c.frequency, pseudo_inverse=c.pseudo_inverse, graft_b2=c.graft_b2,
                graft_eps=c.graft_eps, cooldown_frac=c.cooldown_frac) | control


PARAMS = {  # our GPT's paths, (in, out) shapes and the record's group
    "wte/embedding": ((16, 8), R21.embed_lr),
    "blocks/0/ln_1/scale": ((8,), R21.vector_lr),
    "blocks/0/attn/c_q/kernel": ((16, 16), "shampoo"),
    "blocks/0/attn/c_q/bias": ((16,), R21.vector_lr),
    "blocks/0/mlp/c_fc/kernel": ((16, 48), "shampoo"),
    "blocks/0/mlp/c_proj/kernel": ((48, 16), "shampoo"),
    "lm_head/kernel": ((16, 16), R21.head_lr),
}
MATRICES = [n for n, (_, g) in PARAMS.items() if g == "shampoo"]
TINY = {"blocks/0/mlp/c_proj/kernel": 1e-6, "blocks/0/attn/c_q/bias": 1e-10}


def torch_layout(tree):
    return {n: (x.T if n in MATRICES else x) for n, x in tree.items()}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = {n: 0.1 * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
    grads = []
    for step in range(T):
        g = {n: TINY.get(n, 1.0) * rng.standard_normal(s) for n, (s, _) in PARAMS.items()}
        for n in MATRICES:  # the first updates on one 16-wide block of the long side
            long_axis = int(np.argmax(PARAMS[n][0]))
            if step < 3 and PARAMS[n][0][long_axis] > 16:
                keep = np.zeros(PARAMS[n][0][long_axis], bool)
                keep[16 * step:16 * (step + 1)] = True
                g[n] = g[n] * np.expand_dims(keep, 1 - long_axis)
        grads.append(g)
    return weights, grads


def ours(recipe, weights, grads, **hyperparameters):
    def run(w, gs):
        tx = recipe(T, **hyperparameters)
        params = nest(w, dtype=None)
        state, out = tx.init(params), []
        for g in gs:
            updates, state = tx.update(nest(g, dtype=None), state, params)
            params = optax.apply_updates(params, updates)
            out.append(params)
        return out
    return [torch_layout(flatten(p)) for p in run_in_float64(run, weights, grads)]


def reference(constants, weights, grads, **control):
    groups = {n: g for n, (_, g) in PARAMS.items()}
    return RecordShampoo(groups, **record(constants, **control)).run(
        torch_layout(weights), [torch_layout(g) for g in grads])


def worst(a_steps, b_steps):
    return max(np.max(np.abs(a[n] - b[n]) / (np.abs(b[n]) + 1e-3))
               for a, b in zip(a_steps, b_steps, strict=True) for n in b)


@pytest.fixture(scope="module")
def runs():
    weights, grads = problem()
    return (weights, grads, ours(recipes.track3_shampoo, weights, grads),
            ours(recipes.track3_shampoo_pinv, weights, grads))


def test_track3_shampoo_matches_result_21_in_float64(runs):
    weights, grads, got, _ = runs
    assert worst(got, reference(R21, weights, grads)) < 1e-10


def test_track3_shampoo_pinv_matches_result_35_in_float64(runs):
    weights, grads, _, got = runs
    assert worst(got, reference(R35, weights, grads)) < 1e-10


@pytest.mark.parametrize("control", [
    dict(lr=R21.lr * 1.03), dict(betas=(0.91, R21.betas[1])), dict(betas=(R21.betas[0], 0.96)),
    dict(epsilon=R21.epsilon * 4), dict(weight_decay=R21.weight_decay * 1.03),
    dict(frequency=4), dict(root=4.1), dict(graft_b2=0.96), dict(graft_eps=R21.graft_eps * 4),
    dict(cooldown_frac=0.68), dict(factor_bias_correction=False)])
def test_a_moved_constant_fails_the_result_21_comparison(runs, control):
    weights, grads, got, _ = runs
    assert worst(got, reference(R21, weights, grads, **control)) > 1e-8


@pytest.mark.parametrize("control", [
    dict(lr=R35.lr * 1.03), dict(betas=(0.91, R35.betas[1])), dict(betas=(R35.betas[0], 0.91)),
    dict(weight_decay=R35.weight_decay * 1.03), dict(frequency=2), dict(root=4.1),
    dict(graft_b2=0.91), dict(pseudo_inverse=False, epsilon=1e-12)])
def test_a_moved_constant_fails_the_result_35_comparison(runs, control):
    weights, grads, _, got = runs
    assert worst(got, reference(R35, weights, grads, **control)) > 1e-8


def test_the_defaults_are_the_records():
    for recipe, c, steps in ((recipes.track3_shampoo, R21, R21.steps),
                             (recipes.track3_shampoo_pinv, R35, R35.steps)):
        t = recipe.defaults
        assert (t.shampoo_learning_rate, (t.shampoo_b1, t.shampoo_b2), t.shampoo_epsilon,
                t.shampoo_weight_decay, t.precondition_frequency, t.pseudo_inverse,
                t.graft_b2, t.graft_eps, t.cooldown_frac) == (
            c.lr, c.betas, c.epsilon, c.weight_decay, c.frequency, c.pseudo_inverse,
            c.graft_b2, c.graft_eps, c.cooldown_frac)
        assert (t.embed_learning_rate, t.head_learning_rate, t.vector_learning_rate,
                (t.adam_b1, t.adam_b2), t.adam_eps) == (
            c.embed_lr, c.head_lr, c.vector_lr, c.adam_betas, c.adam_eps)
        assert recipe.record_steps == steps


def test_the_first_updates_have_exactly_rank_deficient_factors():
    """The construction above: one 16-wide block of the long side per update for three
    updates, so #35's first roots meet exact zero eigenvalues (32 of 48 at update 1)."""
    _, grads = problem()
    g = grads[0]["blocks/0/mlp/c_fc/kernel"]  # (in 16, out 48)
    assert np.sum(np.linalg.eigvalsh(g.T @ g) == 0.0) == 32
    assert np.all(np.linalg.eigvalsh(sum(x["blocks/0/mlp/c_fc/kernel"].T
                                         @ x["blocks/0/mlp/c_fc/kernel"]
                                         for x in grads[:3])) > 0)
