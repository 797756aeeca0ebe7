"""PSGD Kron: Kronecker-factored whitening preconditioners fitted by their own gradient step.

`scale_by_psgd_kron` keeps, per matrix ``G`` of shape ``(a, b)`` (the last two axes of a
leaf by default; other axes are a batch), bias-corrected momentum and two upper-triangular
factors ``Q_a`` (a x a) and ``Q_b`` (b x b), and returns the direction::

    M ← β M + (1 - β) G,   M̂ = M / (1 - β^t)
    r = sqrt(max|Q_b| / max|Q_a|);  Q_a ← r Q_a;  Q_b ← Q_b / r       (balance)
    U = M̂ + δ|M̂|⊙ν,  ν, V ~ N(0, 1)                                  (δ = 2^-23)
    A = Q_a U Q_bᵀ,   B = Q_a^{-T} V Q_b^{-1}                          (triangular solves)
    Q_a ← Q_a - η / ‖AAᵀ + BBᵀ‖₂ · triu(AAᵀ - BBᵀ) Q_a
    Q_b ← Q_b - η / ‖AᵀA + BᵀB‖₂ · triu(AᵀA - BᵀB) Q_b
    O = (Q_aᵀ Q_a) M̂ (Q_bᵀ Q_b)

``‖·‖₂`` is estimated as the log does, by one and a half power iterations: with
``s = ‖X‖_∞`` (the largest absolute row sum) and ``X ← X/s``, start from the column of
largest norm, ``x = X x₀ / ‖X x₀‖``, estimate ``s·‖X x‖`` (0 for a zero matrix). The factors
start, at the first update, as ``Q = s₀ I`` with
``s₀ = max(mean(G⁴), 1e-24)^(-1/32)`` from that first gradient. The preconditioner is
fitted at every update (the log's update probability is 1).

Put `radius_steps` after it for the hyperball of Track 3 #33
(``radius_steps(lr, brake=None, floor=None, pin="current", cautious_weight_decay=0.0)``:
``W' = W - lr‖W‖O/‖O‖`` renormalised to ``‖W‖``); `psgd_kron` is that chain.

Where ours differs from the log: the log works on a PyTorch ``(out, in)`` weight, we on
the leaf's ``matrix_axes`` (a Flax kernel is ``(in, out)``, so our ``Q_a`` is the log's
``Q1``): every formula above is unchanged under transposition (``Aᵀ = Q_b Uᵀ Q_aᵀ``), so it
is the same method. The normal draws ``ν, V`` come from a JAX key kept in the state (the
log's come from torch's generator), one key per update and leaf path (`psgd_probes`).
The state and the computation are float32 (as the log's ``grad.float()``), float64 for
float64 params.

References:
  Li, `Preconditioned Stochastic Gradient Descent <https://arxiv.org/abs/1512.04202>`_,
  2015/2018; Li, `Black Box Lie Group Preconditioners for SGD
  <https://arxiv.org/abs/2211.04422>`_, 2022; modded-nanogpt Track 3 result #33
  (`results/20260527_psgd/train_psgd.py
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  ``init_psgd``, ``spectral_norm``, ``psgd_update_precond``, ``PSGDKron``), 2026
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.newton_schulz import _check_matrix_axes
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.utils import (
    check_non_negative,
    check_positive,
    check_unit_interval,
    state_dtype,
    value_at,
)

__all__ = ["PSGDKronState", "psgd_kron", "psgd_probes", "psgd_spectral_norm",
           "scale_by_psgd_kron"]

#: The log's damping ``torch.finfo(torch.float32).eps`` on ``|M̂|`` in the fitted input.
FLOAT32_EPS = float(jnp.finfo(jnp.float32).eps)


class PSGDKronState(NamedTuple):
    """The update count, a JAX key, and per leaf the momentum and the two factors
    (``q_a`` over ``matrix_axes[0]``, ``q_b`` over ``matrix_axes[1]``, batch axes first)."""

    count: jax.Array
    key: jax.Array
    mu: Any
    q_a: Any
    q_b: Any


def psgd_spectral_norm(x: jax.Array) -> jax.Array:
    """The log's 1.5-power-iteration estimate of ``‖X‖₂`` for a symmetric PSD ``X``
    (``(..., n, n)``): ``s = max row abs sum``, ``X/s``, start at the column of largest norm,
    one multiply and normalise, then ``s·‖X x‖``; 0 where ``s = 0``."""
    scale = jnp.max(jnp.sum(jnp.abs(x), axis=-1), axis=-1)
    safe = jnp.where(scale == 0, 1.0, scale)
    y = x / safe[..., None, None]
    col = jnp.argmax(jnp.sum(y * y, axis=-2), axis=-1)
    v = jnp.take_along_axis(y, col[..., None, None], axis=-1)[..., 0]
    v = jnp.einsum("...ij,...j->...i", y, v)
    v = v / jnp.where(jnp.linalg.norm(v, axis=-1) == 0, 1.0,
                      jnp.linalg.norm(v, axis=-1))[..., None]
    est = scale * jnp.linalg.norm(jnp.einsum("...ij,...j->...i", y, v), axis=-1)
    return jnp.where(scale == 0, 0.0, est)


def psgd_probes(key: jax.Array, count: Any, path: str, shape: tuple[int, ...], dtype: Any
                ) -> tuple[jax.Array, jax.Array]:
    """The normal draws ``(V, ν)`` of the leaf at ``path`` (its ``jax.tree_util.keystr``) at
    update ``count`` (from 0): ``fold_in(fold_in(key, count), crc32(path))``, split in two,
    drawn in float32 and cast to ``dtype`` (so float64 params run the same draws)."""
    k = jax.random.fold_in(jax.random.fold_in(key, count), zlib.crc32(path.encode()) & 0x7FFFFFFF)
    kv, knu = jax.random.split(k)
    draw = lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype)
    return draw(kv), draw(knu)


def _fit(q_a, q_b, u, v, precond_lr):
    """One balance and one gradient step of the factors on ``(U, V)`` (batched)."""
    amax = lambda q: jnp.max(jnp.abs(q), axis=(-2, -1))[..., None, None]
    r = jnp.sqrt(amax(q_b) / amax(q_a))
    q_a, q_b = q_a * r, q_b / r
    mT = lambda x: jnp.swapaxes(x, -1, -2)
    a = q_a @ u @ mT(q_b)
    # B = Q_a^{-T} V Q_b^{-1}: Q_aᵀ X = V, then Q_bᵀ Bᵀ = Xᵀ
    solve = jax.scipy.linalg.solve_triangular
    x = solve(q_a, v, trans="T", lower=False)
    b = mT(solve(q_b, mT(x), trans="T", lower=False))
    aat, bbt = a @ mT(a), b @ mT(b)
    ell_a = psgd_spectral_norm(aat + bbt)[..., None, None]
    new_a = q_a - precond_lr / ell_a * jnp.triu(aat - bbt) @ q_a
    ata, btb = mT(a) @ a, mT(b) @ b
    ell_b = psgd_spectral_norm(ata + btb)[..., None, None]
    new_b = q_b - precond_lr / ell_b * jnp.triu(ata - btb) @ q_b
    return new_a, new_b


def scale_by_psgd_kron(
    b1: float = 0.95,
    precond_lr: float | optax.Schedule = 1.0,
    *,
    damping: float = FLOAT32_EPS,
    seed: int = 0,
    matrix_axes: tuple[int, int] = (-2, -1),
) -> optax.GradientTransformation:
    """PSGD Kron's whitened direction ``O = (Q_aᵀQ_a) M̂ (Q_bᵀQ_b)`` (see the module).

    Args:
      b1: the momentum's decay ``β`` (Track 3 #33: 0.95), in [0, 1); bias-corrected.
      precond_lr: the factors' step ``η`` (#33: 1.0), > 0, or a schedule of the count.
      damping: ``δ`` on ``|M̂|⊙ν`` in the fitted input (#33: float32's eps), >= 0.
      seed: seeds the state's key for the normal probes.
      matrix_axes: the two axes of each leaf that form the matrix (other axes: a batch).

    Returns:
      An ``optax.GradientTransformation`` with state `PSGDKronState`; every leaf needs at
      least two axes; ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for ``b1`` outside [0, 1), a non-positive ``precond_lr``, a negative
        ``damping``, equal or non-integer ``matrix_axes``; at ``init`` for a leaf with fewer
        than two axes.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_psgd_kron
      >>> tx = scale_by_psgd_kron()
      >>> p = {"w": jnp.ones((4, 3))}
      >>> u, _ = tx.update(p, tx.init(p))
      >>> u["w"].shape
      (4, 3)
    """
    check_unit_interval("b1", b1)
    if not callable(precond_lr):
        check_positive("precond_lr", precond_lr)
    check_non_negative("damping", damping)
    _check_matrix_axes(matrix_axes)

    masked = lambda x: isinstance(x, optax.MaskedNode)

    def to_mat(x):
        return jnp.moveaxis(x, matrix_axes, (-2, -1))

    def from_mat(x):
        return jnp.moveaxis(x, (-2, -1), matrix_axes)

    def init_fn(params):
        def check(path, p):
            if not masked(p) and jnp.ndim(p) < 2:
                raise ValueError(f"scale_by_psgd_kron needs leaves with at least two axes; "
                                 f"{jax.tree_util.keystr(path)} has shape {jnp.shape(p)}")
        jax.tree_util.tree_map_with_path(check, params, is_leaf=masked)

        def eye(p, axis):
            if masked(p):
                return p
            m = to_mat(jnp.zeros(jnp.shape(p)))
            n = m.shape[axis]
            return jnp.broadcast_to(jnp.eye(n, dtype=state_dtype(None, p)),
                                    (*m.shape[:-2], n, n))
        mu = jax.tree.map(lambda p: p if masked(p) else jnp.zeros_like(  # (keeps p's sharding)
            p, dtype=state_dtype(None, p)), params, is_leaf=masked)
        return PSGDKronState(jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed), mu,
                             jax.tree.map(lambda p: eye(p, -2), params, is_leaf=masked),
                             jax.tree.map(lambda p: eye(p, -1), params, is_leaf=masked))

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        eta = value_at(precond_lr, state.count)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=masked)
        paths = [jax.tree_util.keystr(path) for path, _ in paths_leaves]
        leaves = [x for _, x in paths_leaves]
        mus, qas, qbs = (treedef.flatten_up_to(t) for t in (state.mu, state.q_a, state.q_b))
        out, new_mu, new_qa, new_qb = [], [], [], []
        for path, g, mu, qa, qb in zip(paths, leaves, mus, qas, qbs, strict=True):
            if masked(g):
                out.append(g), new_mu.append(mu), new_qa.append(qa), new_qb.append(qb)
                continue
            dt = mu.dtype
            g32 = g.astype(dt)
            mu = b1 * mu + (1 - b1) * g32  # the log's lerp_(g, 1 - b1)
            m_hat = to_mat(mu / (1 - jnp.asarray(b1, dt) ** count.astype(dt)))
            gm = to_mat(g32)
            s0 = jnp.maximum(jnp.mean(gm ** 4, axis=(-2, -1)), 1e-24) ** (-1 / 32)
            first = state.count == 0
            qa = jnp.where(first, qa * s0[..., None, None], qa)
            qb = jnp.where(first, qb * s0[..., None, None], qb)
            v, nu = psgd_probes(state.key, state.count, path, m_hat.shape, dt)
            qa, qb = _fit(qa, qb, m_hat + damping * jnp.abs(m_hat) * nu, v,
                          jnp.asarray(eta, dt))
            mT = lambda x: jnp.swapaxes(x, -1, -2)
            o = (mT(qa) @ qa) @ m_hat @ (mT(qb) @ qb)
            out.append(from_mat(o).astype(g.dtype))
            new_mu.append(mu), new_qa.append(qa), new_qb.append(qb)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        return unflat(out), PSGDKronState(count, state.key, unflat(new_mu), unflat(new_qa),
                                          unflat(new_qb))

    return optax.GradientTransformation(init_fn, update_fn)


def psgd_kron(
    learning_rate: float | optax.Schedule,
    b1: float = 0.95,
    precond_lr: float | optax.Schedule = 1.0,
    *,
    damping: float = FLOAT32_EPS,
    seed: int = 0,
    pin: str | None = "current",
    matrix_axes: tuple[int, int] = (-2, -1),
) -> optax.GradientTransformation:
    """Track 3 #33's matrix optimizer: `scale_by_psgd_kron` then the hyperball step
    ``radius_steps(learning_rate, brake=None, floor=None, pin=pin,
    cautious_weight_decay=0.0)`` (``pin="current"``: ``W' = W - lr‖W‖O/‖O‖`` rescaled to
    ``‖W‖``, the log's ``p_norm`` taken each step; ``None``: plain ``W - lr·O``).

    The log adds 1e-10 to ``‖O‖`` and ``‖W'‖`` (``hyperball_eps="add"``; MuonH clamps).
    ``update`` needs ``params``.
    """
    return optax.chain(
        scale_by_psgd_kron(b1, precond_lr, damping=damping, seed=seed, matrix_axes=matrix_axes),
        radius_steps(learning_rate, brake=None, floor=None, pin=pin, cautious_weight_decay=0.0,
                     matrix_axes=matrix_axes, hyperball_eps="add"))
