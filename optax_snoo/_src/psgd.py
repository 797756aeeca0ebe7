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

The factors, their fitting step and ``O`` are functions of each matrix alone, a
`MatrixPrecondition` run by `scale_by_muon`'s exchange (``muon_sharding.py``, no
Newton-Schulz after it): on params split over a mesh (FSDP) each whole matrix's ``M̂``,
gradient and probes travel to one owner device (one all-to-all in, one back), which keeps
its factors, instead of the partitioner gathering every matrix to every device for
``Q_a U Q_bᵀ``. The momentum and the probes are made where each leaf lies (the probes
drawn for the whole leaf as on one device, so a matrix's draws never depend on which
device owns it).

References:
  Li, `Preconditioned Stochastic Gradient Descent <https://arxiv.org/abs/1512.04202>`_,
  2015/2018; Li, `Black Box Lie Group Preconditioners for SGD
  <https://arxiv.org/abs/2211.04422>`_, 2022; modded-nanogpt Track 3 result #33
  (`results/20260527_psgd/train_psgd.py
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  ``init_psgd``, ``spectral_norm``, ``psgd_update_precond``, ``PSGDKron``), 2026
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.muon_sharding import (
    MatrixPrecondition,
    owners_work,
)
from optax_snoo._src.newton_schulz import _check_matrix_axes
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.utils import (
    check_non_negative,
    check_positive,
    check_unit_interval,
    path_to_str,
    state_dtype,
    value_at,
)

__all__ = ["PSGDKronState", "psgd_kron", "psgd_probes", "psgd_spectral_norm",
           "scale_by_psgd_kron"]

#: The log's damping ``torch.finfo(torch.float32).eps`` on ``|M̂|`` in the fitted input.
FLOAT32_EPS = float(jnp.finfo(jnp.float32).eps)


class PSGDKronState(NamedTuple):
    """The update count, a JAX key, and per leaf the momentum and the two factors
    (``q_a`` over ``matrix_axes[0]``, ``q_b`` over ``matrix_axes[1]``, batch axes first);
    the factors are ``optax.EmptyState()`` for a leaf whose matrices go to owners on a
    mesh, their state then in ``owned`` (`OwnedPreconditionState.owned`, ``()`` when none
    does)."""

    count: jax.Array
    key: jax.Array
    mu: Any
    q_a: Any
    q_b: Any
    owned: tuple[jax.Array, ...] = ()


class _Factors(NamedTuple):
    """One stack's factors ``(..., a, a)`` and ``(..., b, b)``."""

    q_a: jax.Array
    q_b: jax.Array


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


def _precondition(m_hat: jax.Array, inputs: tuple[jax.Array, jax.Array, jax.Array],
                  st: _Factors, count: jax.Array, flags: Any, *, precond_lr: Any,
                  damping: float) -> tuple[jax.Array, _Factors]:
    """Matrices ``(..., a, b)``: the first update's ``Q = s₀ I``, one fitting step of the
    factors on ``(U, V)`` and ``O = (Q_aᵀQ_a) M̂ (Q_bᵀQ_b)``; ``inputs`` the raw gradient
    and the probes ``(G, ν, V)``. A `MatrixPrecondition`'s ``apply``: under a mesh each
    matrix's owner runs it on the whole matrix."""
    del flags
    dt = st.q_a.dtype
    g, nu, v = (x.astype(dt) for x in inputs)
    m_hat = m_hat.astype(dt)
    s0 = (jnp.maximum(jnp.mean(g ** 4, axis=(-2, -1)), 1e-24) ** (-1 / 32))[..., None, None]
    first = count == 0
    qa = jnp.where(first, st.q_a * s0, st.q_a)
    qb = jnp.where(first, st.q_b * s0, st.q_b)
    qa, qb = _fit(qa, qb, m_hat + damping * jnp.abs(m_hat) * nu, v,
                  jnp.asarray(value_at(precond_lr, count), dt))
    mT = lambda x: jnp.swapaxes(x, -1, -2)
    return (mT(qa) @ qa) @ m_hat @ (mT(qb) @ qb), _Factors(qa, qb)


def _init_factors(batch: int, a: int, b: int, dtype: Any) -> _Factors:
    """``batch`` pairs of identities (scaled by ``s₀`` at the first update)."""
    dt = state_dtype(None, dtype)
    eye = lambda n: jnp.broadcast_to(jnp.eye(n, dtype=dt), (batch, n, n))
    return _Factors(eye(a), eye(b))


def scale_by_psgd_kron(
    b1: float = 0.95,
    precond_lr: float | optax.Schedule = 1.0,
    *,
    damping: float = FLOAT32_EPS,
    seed: int = 0,
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """PSGD Kron's whitened direction ``O = (Q_aᵀQ_a) M̂ (Q_bᵀQ_b)`` (see the module).

    The momentum and the probes are made where each leaf lies; the factors, their fit and
    ``O`` run as `scale_by_muon`'s per-matrix precondition does: on params split over a
    mesh, each whole matrix's ``M̂``, gradient and probes go to one device (its owner, one
    all-to-all in and one back for all the matrices), which keeps its factors
    (`PSGDKronState.owned`), so no collective gathers a matrix to every device; elsewhere,
    per leaf, same-shape matrices batched.

    Args:
      b1: the momentum's decay ``β`` (Track 3 #33: 0.95), in [0, 1); bias-corrected.
      precond_lr: the factors' step ``η`` (#33: 1.0), > 0, or a schedule of the count.
      damping: ``δ`` on ``|M̂|⊙ν`` in the fitted input (#33: float32's eps), >= 0.
      seed: seeds the state's key for the normal probes.
      matrix_axes: the two axes of each leaf that form the matrix (other axes: a batch).
      shard_matrices: send the matrices of leaves split over a mesh to owners (as
        `scale_by_muon`'s ``shard_newton_schulz``); False: leave them to the partitioner.
      newton_schulz_plan: where the leaves live under ``jax.jit``, as in `scale_by_muon`
        (`NewtonSchulzPlan.from_params(params)`); init and update must see the same.
      mesh: the mesh for leaves of unknown sharding, as in `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `PSGDKronState`; every leaf needs at
      least two axes; ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for ``b1`` outside [0, 1), a non-positive ``precond_lr``, a negative
        ``damping``, equal or non-integer ``matrix_axes``, a ``newton_schulz_plan`` that is
        not a `NewtonSchulzPlan`; at ``init`` for a leaf with fewer than two axes.

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
    matrix_axes = _check_matrix_axes(matrix_axes)
    per_matrix = MatrixPrecondition(_init_factors, functools.partial(
        _precondition, precond_lr=precond_lr, damping=damping))

    # the exchange reads (fan_in, fan_out): its (fan_out, fan_in) view is our (a, b)
    owners = owners_work("scale_by_psgd_kron", per_matrix, (matrix_axes[1], matrix_axes[0]),
                         newton_schulz_plan=newton_schulz_plan, mesh=mesh,
                         shard_matrices=shard_matrices)

    def init_fn(params):
        def check(path, p):
            if jnp.ndim(p) < 2:
                raise ValueError(f"scale_by_psgd_kron needs leaves with at least two axes; "
                                 f"{jax.tree_util.keystr(path)} has shape {jnp.shape(p)}")
        jax.tree_util.tree_map_with_path(check, params)  # MaskedNode leaves have no leaves

        per_leaf, treedef, owned = owners.init(params)
        mu = jax.tree.map(lambda p: jnp.zeros_like(  # (keeps p's sharding)
            p, dtype=state_dtype(None, p)), params)
        return PSGDKronState(jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed), mu,
                             *_factor_trees(per_leaf, treedef), owned)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        leaves = [g for _, g in with_paths]
        mus = treedef.flatten_up_to(state.mu)
        factors = [optax.EmptyState() if isinstance(a, optax.EmptyState) else _Factors(a, b)
                   for a, b in zip(treedef.flatten_up_to(state.q_a),
                                   treedef.flatten_up_to(state.q_b), strict=True)]
        new_mu, m_hats, inputs = [], [], []
        for (path, g), mu in zip(with_paths, mus, strict=True):
            dt = mu.dtype
            g32 = g.astype(dt)
            mu = b1 * mu + (1 - b1) * g32  # the log's lerp_(g, 1 - b1)
            new_mu.append(mu)
            m_hats.append(mu / (1 - jnp.asarray(b1, dt) ** count.astype(dt)))
            # drawn for the whole leaf where it lies: a matrix's draws never depend on
            # which device owns it
            shape = jnp.moveaxis(g32, matrix_axes, (-2, -1)).shape
            v, nu = psgd_probes(state.key, state.count, jax.tree_util.keystr(path), shape, dt)
            back = lambda x: jnp.moveaxis(x, (-2, -1), matrix_axes)
            inputs.append((g32, back(nu), back(v)))
        dtype = jnp.result_type(jnp.float32, *[m.dtype for m in mus])
        paths = [path_to_str(p) for p, _ in with_paths]
        directions, factors, owned = owners.run(
            m_hats, paths, list(zip(leaves, mus, strict=True)), grads=inputs,
            leaf_states=factors, owned=state.owned, count=state.count, dtype=dtype)
        out = [o.astype(g.dtype) for o, g in zip(directions, leaves, strict=True)]
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        return unflat(out), PSGDKronState(count, state.key, unflat(new_mu),
                                          *_factor_trees(factors, treedef), owned)

    return optax.GradientTransformation(init_fn, update_fn)


def _factor_trees(per_leaf: list[Any], treedef: Any) -> list[Any]:
    """The trees of `PSGDKronState`'s ``q_a`` and ``q_b`` from per-leaf `_Factors`
    (``optax.EmptyState()`` in both where a leaf is owned)."""
    rows = [(s, s) if isinstance(s, optax.EmptyState) else tuple(s) for s in per_leaf]
    return [treedef.unflatten([r[k] for r in rows]) for k in range(2)]


def psgd_kron(
    learning_rate: float | optax.Schedule,
    b1: float = 0.95,
    precond_lr: float | optax.Schedule = 1.0,
    *,
    damping: float = FLOAT32_EPS,
    seed: int = 0,
    pin: str | None = "current",
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """Track 3 #33's matrix optimizer: `scale_by_psgd_kron` then the hyperball step
    ``radius_steps(learning_rate, brake=None, floor=None, pin=pin,
    cautious_weight_decay=0.0)`` (``pin="current"``: ``W' = W - lr‖W‖O/‖O‖`` rescaled to
    ``‖W‖``, the log's ``p_norm`` taken each step; ``None``: plain ``W - lr·O``;
    ``shard_matrices``, ``newton_schulz_plan`` and ``mesh`` are `scale_by_psgd_kron`'s).

    The log adds 1e-10 to ``‖O‖`` and ``‖W'‖`` (``hyperball_eps="add"``; MuonH clamps).
    ``update`` needs ``params``.
    """
    return optax.chain(
        scale_by_psgd_kron(b1, precond_lr, damping=damping, seed=seed, matrix_axes=matrix_axes,
                           shard_matrices=shard_matrices,
                           newton_schulz_plan=newton_schulz_plan, mesh=mesh),
        radius_steps(learning_rate, brake=None, floor=None, pin=pin, cautious_weight_decay=0.0,
                     matrix_axes=matrix_axes, hyperball_eps="add"))
