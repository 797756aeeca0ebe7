"""K-FAC (Martens & Grosse 2015) in float64 numpy: the factor EMA, refreshes and the
damped solves of `scale_by_kfac`, and the dense operator a cached inverse applies (shared
by `library.test_kfac_transform` and `library.test_kfac_distributed`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax


class ReferenceKfac:
    """K-FAC in float64 numpy: weight-normalised factor EMA (on every `stats_every`-th
    step, with decay rho^stats_every), refresh per the policy oracle (only once statistics
    exist), exact or pi damping on the refreshed snapshot, identity before the first
    refresh. `layers`: name -> (kernel shape, number of stack axes, has_bias)."""

    def __init__(self, layers, rho, damping, mode, should_refresh, stats_every=1):
        self.layers = layers
        self.rho, self.damping, self.mode, self.should_refresh = rho, damping, mode, should_refresh
        self.stats_every = stats_every
        self.weight = 0.0
        self.factors = {n: None for n in layers}
        self.snapshot = None
        self.last_step, self.last_lr = -1, 0.0
        self.refreshes = []

    def _solve(self, grad, a, g, lam):
        return (operator(a, g, lam, self.mode) @ grad.reshape(-1)).reshape(grad.shape)

    def update(self, t, grads, curvature, lr):
        if t % self.stats_every == 0:
            self._average(curvature)
        if self.weight > 0 and self.should_refresh(t, lr, self.last_step, self.last_lr):
            self.snapshot = {n: f for n, f in self.factors.items()}
            self.last_step, self.last_lr = t, lr
            self.refreshes.append(t)
        return self._precondition(grads)

    def _average(self, curvature):
        self.weight = self.rho ** self.stats_every * self.weight + 1.0
        frac = 1.0 / self.weight
        for n in self.layers:
            a_b, g_b = (np.asarray(x, np.float64) for x in curvature[n]["kernel"])
            if self.factors[n] is None:
                self.factors[n] = (np.zeros_like(a_b), np.zeros_like(g_b))
            a, g = self.factors[n]
            self.factors[n] = ((1 - frac) * a + frac * a_b, (1 - frac) * g + frac * g_b)

    def _precondition(self, grads):
        out = {k: np.asarray(v, np.float64) for k, v in grads.items() if k not in self.layers}
        for n, (shape, nstack, has_bias) in self.layers.items():
            kernel = np.asarray(grads[n]["kernel"], np.float64)
            full = kernel
            if has_bias:
                bias = np.asarray(grads[n]["bias"], np.float64)
                full = np.concatenate([kernel, bias[..., None, :]], axis=-2)
            if self.snapshot is not None:
                a, g = self.snapshot[n]
                if nstack:
                    full = np.stack([self._solve(full[e], a[e], g[e], self.damping)
                                     for e in range(shape[0])])
                else:
                    full = self._solve(full, a, g, self.damping)
            out[n] = {"kernel": full[..., :shape[-2], :]}
            if has_bias:
                out[n]["bias"] = full[..., -1, :]
        return out


def operator(a, g, lam, mode):
    """The damped inverse as a dense matrix on row-major ``vec(grad)``, ``grad (d_a, d_g)``:
    exact ``(A ⊗ G + λI)⁻¹`` ("eigen"), or pi damping's ``Â⁻¹ ⊗ Ĝ⁻¹`` with
    ``Â = A + π√λ I``, ``Ĝ = G + √λ/π I``, ``π² = (tr A / d_a) / (tr G / d_g)`` ("pi")."""
    a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
    if mode == "eigen":
        return np.linalg.inv(np.kron(a, g) + lam * np.eye(len(a) * len(g)))
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
    a_hat = a + pi * np.sqrt(lam) * np.eye(len(a))
    g_hat = g + np.sqrt(lam) / pi * np.eye(len(g))
    return np.kron(np.linalg.inv(a_hat), np.linalg.inv(g_hat))


def cached_operator(inverse):
    """The same dense matrix from a cached `PiInverse` (``a_inv ⊗ g_inv``) or
    `EigenInverse` (``K diag(scale) Kᵀ``, ``K = q_a ⊗ q_g``), in float64, per stack entry:
    equal for any choice of eigenvector signs or bases of repeated eigenvalues."""
    f = lambda x: np.asarray(x, np.float64)
    if hasattr(inverse, "a_inv"):
        a_inv, g_inv = f(inverse.a_inv), f(inverse.g_inv)
        stack = a_inv.shape[:-2]
        ops = [np.kron(a_inv[i], g_inv[i]) for i in np.ndindex(stack)]
    else:
        q_a, q_g, scale = f(inverse.q_a), f(inverse.q_g), f(inverse.scale)
        stack = q_a.shape[:-2]
        ops = []
        for i in np.ndindex(stack):
            k = np.kron(q_a[i], q_g[i])
            ops.append(k @ np.diag(scale[i].reshape(-1)) @ k.T)
    return np.stack(ops).reshape(*stack, *ops[0].shape)


def fixed_curvature_kfac(curvature, learning_rate, *, damping, momentum=0.9, weight_decay=0.0,
                         mode="pi"):
    """`kfac(learning_rate, damping=, momentum=, weight_decay=, mode=)` for a curvature that
    every step passes unchanged and a refresh at step 0, written in jnp: the factor EMA of
    identical batches is that curvature and every refresh inverts it, so each layer's
    ``[kernel; bias]`` is multiplied by the dense damped inverse (`operator`, float64),
    then kfac's momentum, decoupled decay and learning rate. Under jax's x64 it is that
    K-FAC's computation in float64 (the library's K-FAC is float32 only). `curvature`:
    ``{layer: {"kernel": LayerCurvature}}``; the ``curvature=`` argument is ignored."""
    ops = {name: operator(c["kernel"].a, c["kernel"].g, damping, mode)
           for name, c in curvature.items()}

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        out = dict(updates)
        for name, op in ops.items():
            layer = updates.get(name)
            if layer is None or isinstance(layer.get("kernel"), optax.MaskedNode):
                continue  # another group's layer (optax.partition)
            kernel, bias = layer["kernel"], layer.get("bias")
            has_bias = bias is not None and not isinstance(bias, optax.MaskedNode)
            full = kernel.reshape(kernel.shape[0], -1)
            if has_bias:
                full = jnp.concatenate([full, bias.reshape(1, -1)])
            y = (jnp.asarray(op, full.dtype) @ full.reshape(-1)).reshape(full.shape)
            out[name] = {**layer, "kernel": y[:kernel.shape[0]].reshape(kernel.shape)}
            if has_bias:
                out[name]["bias"] = y[-1].reshape(bias.shape)
        return out, state

    direction = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    return optax.chain(direction,
                       optax.identity() if not momentum else optax.trace(decay=momentum),
                       optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))


def dense_factors64(stats, num_tokens, stride=1, offset=0):
    """`optax_snoo.kfac.curvature_from_stats` of dense layers in float64 numpy (the library
    computes its factors in float32 whatever its inputs): over every `stride`-th token
    from `offset`, ``A = x̃ᵀx̃ / n`` with ``x̃ = [x; 1]`` for a bias and ``G = gᵀg / n``
    with ``g = M ∂L/∂y`` (M = `num_tokens`, the loss's; n the tokens used)."""
    from optax_snoo import kfac

    out = {}
    for path, s in stats.items():
        assert s.locations == s.uses == 1 and not s.scanned, path
        x = np.asarray(s.inputs, np.float64)[offset::stride]
        g = num_tokens * np.asarray(s.out_grads, np.float64)[offset::stride]
        if s.has_bias:
            x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
        out[path] = kfac.LayerCurvature(x.T @ x / len(x), g.T @ g / len(g), s.kernel_axes)
    return out
