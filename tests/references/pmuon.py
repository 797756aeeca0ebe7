"""PMuon in float64 numpy, in PyTorch's (out, in) layout, written from modded-nanogpt Track 3
result #18's log code (results/20260507_pmuon/54fc0541-7a62-4772-a8f8-d3a46ad10dba.txt:
`zeropower_via_newtonschulz5`, `_streaming_cov_power`, `pmuon_update`, `Muon.step`), and the
bases' start (shared by `library.test_pmuon` and `library.test_recipes_track3_pmuon`).

The record starts each basis at the Q factor of an unseeded ``torch.randn(n, n)``; here it
is that of ``jax.random.normal(jax.random.key(seed), (n, n))`` in float32, the documented
start of ``pmuon_precondition(seed=...)`` (drawn here, not taken from the library; the
QR's column signs may differ from the library's, which the method does not see).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R18


def zeropower(G):
    """`zeropower_via_newtonschulz5` (log:163-180), in float64."""
    X = G.T if G.shape[-2] > G.shape[-1] else G
    X = X / (np.linalg.norm(X) + NS_EPS)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[-2] > G.shape[-1] else X


def start_basis(n, seed=0):
    """The Q factor of the standard normal (n, n) float32 matrix of ``jax.random.key(seed)``."""
    z = np.asarray(jax.random.normal(jax.random.key(seed), (n, n), jnp.float32), np.float64)
    return np.linalg.qr(z)[0]


def streaming_cov_power(C, Q, gamma, eps=R18.eps):
    """`_streaming_cov_power` (log:182-196): (the power, the new basis)."""
    n = C.shape[0]
    Q, _ = np.linalg.qr(C @ Q, mode="reduced")
    lam = np.maximum((Q * (C @ Q)).sum(axis=0), eps)
    d = lam ** (-gamma)
    res = Q @ np.diag(d) @ Q.T
    res *= n**0.5 / (np.linalg.norm(d) + eps)
    return res, Q


class RefPMuon:
    """One (out, in) matrix of #18's `pmuon_update` and `_streaming_cov_power`: `step(g)`
    returns the matrix Newton-Schulz runs on (``A_neg @ u @ C_neg``)."""

    def __init__(self, out, inn, *, mu=R18.muon_mu, beta=R18.beta, gamma=R18.gamma,
                 damping=R18.damping, eps=R18.eps, seed=0):
        self.mu, self.beta, self.gamma, self.damping, self.eps = mu, beta, gamma, damping, eps
        self.momentum = np.zeros((out, inn))
        self.cov, self.out = np.zeros((inn, inn)), np.zeros((out, out))  # log:239-242
        self.cov_Q, self.out_Q = start_basis(inn, seed), start_basis(out, seed)

    def precondition(self, u):
        """From the Nesterov momentum `u` on (log:205-215, 249-253)."""
        cov_ = u.T @ u
        self.cov = self.beta * self.cov + cov_
        C = cov_ + self.beta * self.cov + self.damping * np.eye(len(cov_))
        out_ = u @ u.T
        self.out = self.beta * self.out + out_
        A = out_ + self.beta * self.out + self.damping * np.eye(len(out_))
        C_neg, self.cov_Q = streaming_cov_power(C, self.cov_Q, self.gamma, self.eps)
        A_neg, self.out_Q = streaming_cov_power(A, self.out_Q, self.gamma, self.eps)
        return A_neg @ u @ C_neg

    def step(self, g):
        self.momentum += (1 - self.mu) * (g - self.momentum)  # momentum_buf.lerp_(grad, 1-mu)
        u = g + self.mu * (self.momentum - g)  # grad.lerp_(momentum_buf, mu): grad is u now
        return self.precondition(u)

    def update(self, g):
        """`Muon.step`'s update before the learning rate (log:253-254)."""
        return zeropower(self.step(g)) * max(1, g.shape[-2] / g.shape[-1]) ** 0.5
