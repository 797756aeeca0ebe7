"""Snoo (Kallusky et al., modded-nanogpt PR #128) written out in numpy around numpy SGD and
AdamW, and the tree they run on (shared by `library.test_snoo`, `library.test_diloco` and
`library.test_recipes_track3_records`)."""

import numpy as np

# The tree the Snoo and DiLoCo tests run these references on.
SHAPES = {"w": (6, 4), "b": (4,), "stack": (2, 3, 5)}


class NumpySGD:
    def __init__(self, lr):
        self.lr = lr

    def init(self, p):
        return None

    def update(self, g, state, p):
        return {k: -self.lr * g[k] for k in g}, state


class NumpyAdamW:
    """optax.adamw's formula: bias-corrected moments, eps outside the sqrt, decoupled wd."""

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd

    def init(self, p):
        return {"t": 0, "m": {k: np.zeros_like(v) for k, v in p.items()},
                "v": {k: np.zeros_like(v) for k, v in p.items()}}

    def update(self, g, s, p):
        t = s["t"] + 1
        m = {k: self.b1 * s["m"][k] + (1 - self.b1) * g[k] for k in g}
        v = {k: self.b2 * s["v"][k] + (1 - self.b2) * g[k] ** 2 for k in g}
        u = {}
        for k in g:
            mh = m[k] / (1 - self.b1 ** t)
            vh = v[k] / (1 - self.b2 ** t)
            u[k] = -self.lr * (mh / (np.sqrt(vh) + self.eps) + self.wd * p[k])
        return u, {"t": t, "m": m, "v": v}


def numpy_snoo(inner, params, grads, lr, mom, k):
    """Snoo written out: inner step, then at t % k == 0 Nesterov SGD on slow - fast."""
    p = {kk: v.copy() for kk, v in params.items()}
    slow = {kk: v.copy() for kk, v in p.items()}
    buf = {kk: np.zeros_like(v) for kk, v in p.items()}
    s = inner.init(p)
    history = []
    for t, g in enumerate(grads):
        u, s = inner.update(g, s, p)
        fast = {kk: p[kk] + u[kk] for kk in p}
        if t % k == 0:
            n = t // k
            eta = lr(n) if callable(lr) else lr
            mu = mom(n) if callable(mom) else mom
            for kk in p:
                d = slow[kk] - fast[kk]
                buf[kk] = mu * buf[kk] + d
                slow[kk] = slow[kk] - eta * (d + mu * buf[kk])
            p = {kk: slow[kk].copy() for kk in p}
        else:
            p = fast
        history.append(p)
    return history
