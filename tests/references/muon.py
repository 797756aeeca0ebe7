"""Muon in float64 numpy, written from Jordan's Muon post (2024) and the modded-nanogpt
records, independent of the library: its own coefficient tables, Newton-Schulz, momentum,
smoothing, shape scale, weight decay, NorMuon and AdamW (shared by `library.test_muon`,
`library.test_muon_sharded` and `library.test_recipes_track3_records`)."""

from __future__ import annotations

import numpy as np

# Newton-Schulz coefficient tables, copied from the modded-nanogpt records (not from the library).
KELLER = ((3.4445, -4.7750, 2.0315),) * 5
MODDED = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def ref_ns(x, triples, eps=1e-7):
    """Newton-Schulz (a, b, c iterations after Frobenius normalisation), float64, last two axes."""
    X = np.asarray(x, np.float64)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = np.swapaxes(X, -1, -2)
    X = X / (np.linalg.norm(X, axis=(-2, -1), keepdims=True) + eps)
    for a, b, c in triples:
        A = X @ np.swapaxes(X, -1, -2)
        B = b * A + c * A @ A
        X = a * X + B @ X
    return np.swapaxes(X, -1, -2) if transposed else X


def ref_scalar_ns(s, triples):
    """What the iteration does to one (normalised) singular value: the composed polynomial."""
    for a, b, c in triples:
        s = a * s + b * s**3 + c * s**5
    return s


def const(v):
    return v if callable(v) else (lambda t: v)


class RefMuon:
    """Muon momentum, Newton-Schulz, shape scale and smoothing for the Muon leaves, AdamW
    (decoupled wd times lr) for the others."""

    def __init__(self, params, labels, *, lr, beta, triples, nesterov=True,
                 bias_correction=False, wd=0.0, wd_mul=None, lr_mul=None, smoothing=None,
                 smoothing_form="ema", adam_lr=None, b1=0.9, b2=0.999, eps=1e-8, adam_wd=0.0,
                 shape_scale="modded", beta2=None, cautious=False):
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.labels, self.triples = labels, triples
        self.lr, self.beta = const(lr), const(beta)
        self.adam_lr = const(lr if adam_lr is None else adam_lr)
        self.sigma = None if smoothing is None else const(smoothing)
        self.nesterov, self.bc, self.form = nesterov, bias_correction, smoothing_form
        self.wd, self.wd_mul, self.lr_mul = wd, wd_mul or {}, lr_mul or {}
        self.b1, self.b2, self.eps, self.adam_wd = b1, b2, eps, adam_wd
        self.shape_scale = shape_scale
        self.beta2, self.cautious = None if beta2 is None else const(beta2), cautious
        self.nu = {}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.s = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.t = 0

    def step(self, grads):
        t, updates = self.t, {}
        for k, p in self.p.items():
            g = np.asarray(grads[k], np.float64)
            if self.labels[k] == "muon":
                beta = self.beta(t)
                self.m[k] = beta * self.m[k] + (1 - beta) * g
                if self.bc and self.nesterov:
                    v = (beta * self.m[k] / (1 - beta ** (t + 2))
                         + (1 - beta) * g / (1 - beta ** (t + 1)))
                elif self.bc:
                    v = self.m[k] / (1 - beta ** (t + 1))
                else:
                    v = beta * self.m[k] + (1 - beta) * g if self.nesterov else self.m[k]
                o = ref_ns(v, self.triples)
                if self.beta2 is not None:
                    o = self.normuon(k, o, self.beta2(t))
                if self.sigma is not None:
                    sigma = self.sigma(t)
                    self.s[k] = sigma * self.s[k] + (1 - sigma) * o
                    o = self.s[k] if self.form == "ema" else sigma * self.s[k] + (1 - sigma) * o
                fan_in, fan_out = p.shape[-2], p.shape[-1]
                lr, wd = self.lr(t) * self.lr_mul.get(k, 1.0), self.wd * self.wd_mul.get(k, 1.0)
                scale = (np.sqrt(max(1.0, fan_out / fan_in)) if self.shape_scale == "modded"
                         else 0.2 * np.sqrt(max(fan_in, fan_out)))  # Moonlight's
                new = p * (1 - lr * wd * self.decays(o, p)) - lr * scale * o
            else:
                self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
                self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
                mhat = self.m[k] / (1 - self.b1 ** (t + 1))
                vhat = self.v[k] / (1 - self.b2 ** (t + 1))
                lr = self.adam_lr(t)
                u = mhat / (np.sqrt(vhat) + self.eps)
                new = p - lr * (u + self.adam_wd * self.decays(u, p) * p)
            updates[k] = new - p
            self.p[k] = new
        self.t += 1
        return updates

    def decays(self, u, p):
        """Where the decay applies: everywhere, or (cautious, Chen et al. 2025 and the
        record's `_cautious_wd_and_update_inplace`) where update and weight agree in sign."""
        return (u * p >= 0).astype(np.float64) if self.cautious else 1.0

    def normuon(self, k, o, beta2):
        """The record's `_apply_normuon_variance_reduction`, on its (out, in) layout: our
        (..., in, out) matrices transposed, the mean square over the last axis when rows >=
        cols, else over the second to last; the EMA; divided by its root (floor 1e-10);
        rescaled to the Frobenius norm it had."""
        m = np.swapaxes(o, -1, -2)
        red = -1 if m.shape[-2] >= m.shape[-1] else -2
        q = np.mean(m * m, axis=red, keepdims=True)
        self.nu[k] = beta2 * self.nu.get(k, np.zeros_like(q)) + (1 - beta2) * q
        d = m / np.sqrt(np.maximum(self.nu[k], 1e-10))
        norm = lambda x: np.sqrt(np.sum(x * x, axis=(-2, -1), keepdims=True))
        return np.swapaxes(d * norm(m) / np.maximum(norm(d), 1e-10), -1, -2)
