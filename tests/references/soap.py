"""SOAP-Muon in float64 numpy, in PyTorch's (out, in) layout, written from modded-nanogpt
Track 3 record #46's log code (`soap_precondition_momentum`, `soap_update_preconditioner`,
`soap_eigenbasis`, `soap_basis_qr`, `trust_gate`, `bounded_trust_gate`,
`norm_preserving_blend`, `gram_frobenius_norm_estimate`, `zeropower_via_newtonschulz5`,
`Muon.step`), and the first gradient that makes its eigenbases comparable (shared by
`library.test_soap_muon` and `library.test_recipes_track3_records`)."""

from __future__ import annotations

import numpy as np


def ref_gram_norm(x, eps):
    gram = x.T @ x if x.shape[0] > x.shape[1] else x @ x.T
    return max(np.sqrt(np.linalg.norm(gram)), eps)


def ref_frob_norm(x, eps):
    return max(np.linalg.norm(x), eps)


def ref_newton_schulz(g):
    """zeropower_via_newtonschulz5: Gram-Frobenius normalisation, (2, -1.5, 0.5) x 12."""
    X = g.T if g.shape[0] > g.shape[1] else g
    X = X / ref_gram_norm(X, 1e-7)
    for _ in range(12):
        A = X @ X.T
        X = 2 * X + (-1.5 * A + 0.5 * A @ A) @ X
    return X.T if g.shape[0] > g.shape[1] else X


# Line numbers: records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/
# train_gpt_cwd_SOTA.py of modded-nanogpt (#46), whose SOAP-Muon is #44's.


def ref_cos(a, b, eps=1e-8):  # :313 tensor_cosine
    return np.sum(a * b) / max(np.linalg.norm(a) * np.linalg.norm(b), eps)


def ref_trust_gate(raw, soap, grad, step, fade_start, fade_end):
    raw_grad, soap_grad, soap_raw = ref_cos(raw, grad), ref_cos(soap, grad), ref_cos(soap, raw)
    agree = np.clip((soap_raw - 0.2) / (1 - 0.2), 0, 1)  # :91, :324 ATTN_TRUST_MIN_AGREE
    align = np.clip((soap_grad - 0.0) / max(raw_grad - 0.0, 1e-8), 0, 1)  # :92, :325-326
    gate = np.clip(agree * align, 0, 1)
    if step < fade_start:  # :332-341 early_trust_floor_for_step
        floor = 0.45  # :87 ATTN_EARLY_TRUST_FLOOR
    elif step >= fade_end:
        floor = 0.0
    else:
        floor = 0.45 * (fade_end - step) / (fade_end - fade_start)
    cap = 0.85 if step < fade_end else 1.0  # :88 ATTN_EARLY_TRUST_CAP; :343-346
    return np.clip(gate, floor, cap)


class RefSoapMuon:
    """One matrix of record #46's Muon.step with SOAP (radius steps left out)."""

    def __init__(self, out, inn, freq, norm, gated, fade):
        self.mom = np.zeros((out, inn))
        self.L, self.R = np.zeros((out, out)), np.zeros((inn, inn))
        self.QL = self.QR = None
        self.V = np.zeros((out, inn))
        self.soap_step = 0
        self.freq, self.norm, self.gated, self.fade = freq, norm, gated, fade

    def step(self, grad, mu, step, beta=0.9, beta2=None):
        """``beta2``: decay of ``V`` (SOAP's, Vyas et al.); ``None``: ``beta`` (the record)."""
        beta2 = beta if beta2 is None else beta2
        self.mom += (1 - mu) * (grad - self.mom)           # momentum.lerp_(grad, 1 - mu)
        M = grad + mu * (self.mom - grad)                  # grad.lerp(momentum, mu)
        if self.QL is None:
            D = M
        else:
            P = self.QL.T @ M @ self.QR
            self.V = beta2 * self.V + (1 - beta2) * P ** 2
            # :405, :412 clamp_min(eps * eps) with eps=1e-8; :86 SOAP_DENOM_POWER 0.5
            D = self.QL @ (P / np.maximum(self.V, 1e-16) ** 0.5) @ self.QR.T
            D = D * (self.norm(M, 1e-8) / self.norm(D, 1e-8))  # :414
        if self.gated:
            gate = ref_trust_gate(M, D, grad, step, *self.fade)
            B = M + (D - M) * gate
            D = B * (ref_gram_norm(M, 1e-8) / ref_gram_norm(B, 1e-8))
        out, inn = M.shape
        update = ref_newton_schulz(D) * max(1, out / inn) ** 0.5
        # soap_update_preconditioner, after the step
        self.L += (1 - beta) * (grad @ grad.T - self.L)
        self.R += (1 - beta) * (grad.T @ grad - self.R)
        if self.QL is None:
            self.QL = np.flip(np.linalg.eigh(self.L)[1], 1)
            self.QR = np.flip(np.linalg.eigh(self.R)[1], 1)
        elif self.soap_step > 0 and self.soap_step % self.freq == 0:
            order = np.argsort(-np.diag(self.QL.T @ self.L @ self.QL), kind="stable")
            self.V = self.V[order]
            self.QL = np.linalg.qr(self.L @ self.QL[:, order])[0]
            order = np.argsort(-np.diag(self.QR.T @ self.R @ self.QR), kind="stable")
            self.V = self.V[:, order]
            self.QR = np.linalg.qr(self.R @ self.QR[:, order])[0]
        self.soap_step += 1
        return update


def first_gradient(shape, rng):
    """A rectangular diagonal (per matrix) with distinct entries, in our (in, out) layout."""
    g = np.zeros(shape)
    k = min(shape[-2:])
    values = 1.0 + 0.5 * np.arange(k) + 0.1 * rng.random(k)
    idx = np.arange(k)
    g[..., idx, idx] = values
    return g
