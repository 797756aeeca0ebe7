"""Shampoo: Kronecker-factored root-inverse preconditioning, grafted onto Adam's step size.

`scale_by_shampoo` keeps, per matrix ``G`` of shape ``(a, b)`` (the leaf's ``matrix_axes``;
other axes are a batch), the two Kronecker factors, their inverse roots, a filtered
gradient and (for Adam grafting) Adam's second moment, and returns, at update ``t`` (from 1)::

    L ← β₂ L + (1 - β₂) G Gᵀ,   R ← β₂ R + (1 - β₂) Gᵀ G            (every update)
    every refresh:  L⁻ = root(L / (1 - β₂ᵗ)),  R⁻ = root(R / (1 - β₂ᵗ))  (else kept)
    M ← β₁ M + (1 - β₁) G,   M̂ = M / (1 - β₁ᵗ)
    P = L⁻ M̂ R⁻                                                      (Shampoo)
    V ← β_g V + (1 - β_g) G²,   A = M̂ / (sqrt(V / (1 - β_gᵗ)) + ε_g)  (Adam graft)
    out = A                                  while t < start
          P · ‖A‖_F / (‖P‖_F + 1e-16)        after

``root(X)`` is ``X^(-e)`` (``e = root_exponent``, 1/4 per factor of a matrix: ``1/(2·order)``)
through an eigendecomposition ``X + εI = Q diag(λ) Qᵀ`` and ``Q diag(f(λ)) Qᵀ``:

- damped (``pseudo_inverse=False``, ``ε > 0``): if ``min λ < ε`` the spectrum is shifted to
  ``λ - min λ + ε``; ``f(λ) = λ^(-e)``;
- pseudo-inverse (``pseudo_inverse=True``, ``ε = 0``): ``f(λ) = 0`` where
  ``λ <= rank_rtol · max(max λ, 0)`` (0 by default: only the non-positive eigenvalues are
  dropped), else ``λ^(-e)``.

The roots are refreshed (under ``lax.cond``; with ``frequency = start = 1`` at every
update, with no branch) at update ``t = start`` and at every later ``t`` divisible by
``frequency``; before ``start`` the roots are still the identity and the update is Adam's
direction alone (with ``grafting=None``: the filtered gradient ``M̂``). ``start`` defaults
to ``frequency``. With ``use_bias_correction=False`` neither
``M`` nor the factors are bias-corrected (Adam's graft always is). A root that comes out
non-finite keeps the previous one: JAX's ``eigh`` reports a failure with NaNs, where the
library's raises, is retried in float64 and, failing again, keeps the previous root (the
library stops the run on non-finite factors; here the factors and the update then carry
the NaNs on).

This is Meta's ``DistributedShampoo`` as modded-nanogpt Track 3 results #21 and #35 run it
(``RootInvShampooPreconditionerConfig`` with the default eigendecomposition root, and
``PseudoInverseConfig`` for #35; ``AdamPreconditionerConfig`` grafting; ``beta3 = beta1``,
no Nesterov, no iterate averaging). Not ported: its blocking of dimensions above
``max_preconditioner_dim`` (the records' 8192 exceeds every dimension of the model) and its
merging of small dimensions (a parameter with fewer than 8192 entries is flattened to one
dimension there; here every leaf is treated as a matrix), its other configurations
(eigenvalue-corrected, KL-Shampoo, coupled Newton roots, trace scaling). Grafting is
inside this transform rather than `optax_snoo.kfac.graft` because Meta's graft divides the
*filtered* gradient by the second moment of the *raw* gradient, and replaces Shampoo's
direction outright before the first root. The arithmetic is float32 (float64 for float64
params), as the library's default float32 factor matrices.

The factors, their roots and ``L⁻ M̂ R⁻`` are functions of each matrix alone, a
`MatrixPrecondition` run by `scale_by_muon`'s exchange (``muon_sharding.py``, no
Newton-Schulz after it): on params split over a mesh (FSDP) each whole matrix's gradient and
``M̂`` travel to one owner device (one all-to-all in, one back), which keeps its factors and
roots, instead of the partitioner gathering every matrix to every device for ``G Gᵀ``; the
moments and the graft stay where each leaf lies (the graft's norms: scalar all-reduces).

Put the learning rate and the decoupled weight decay after it (``-lr·(out + wd·W)``, the
library's ``WeightDecayType.DECOUPLED``): `shampoo` is that chain.

References:
  Gupta, Koren, Singer, `Shampoo: Preconditioned Stochastic Tensor Optimization
  <https://arxiv.org/abs/1802.09568>`_, 2018; Anil et al., `Scalable Second Order
  Optimization for Deep Learning <https://arxiv.org/abs/2002.09018>`_, 2020 (grafting,
  preconditioning frequency); Shi et al., `A Distributed Data-Parallel PyTorch
  Implementation of the Distributed Shampoo Optimizer
  <https://arxiv.org/abs/2309.06497>`_, 2023; modded-nanogpt Track 3 results #21
  (`results/20260513_shampoo_1_4_power
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  whose ``distributed_shampoo/`` copy is the code that ran) and #35
  (``results/sh-origpinv-s3375-...-130563a2-b40b-43c1-8fb4-b7a3bbfa5969.txt``), 2026
"""

from __future__ import annotations

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
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_unit_interval,
    concrete_real,
    path_to_str,
    state_dtype,
)
from optax_snoo._src.weight_decay import add_decoupled_weight_decay

__all__ = ["ShampooState", "scale_by_shampoo", "shampoo", "shampoo_inverse_root"]

#: Added to ‖P‖ before grafting's division (the library's ``1e-16``).
GRAFT_NORM_EPS = 1e-16
GRAFTINGS = ("adam", None)


class ShampooState(NamedTuple):
    """The update count and, per leaf: the filtered gradient ``mu``, Adam's second moment
    ``nu`` (``None`` without grafting), the factors ``left`` (over ``matrix_axes[0]``) and
    ``right`` (over ``matrix_axes[1]``), and their inverse roots (batch axes first); the
    four are ``optax.EmptyState()`` for a leaf whose matrices go to owners on a mesh, their
    state then in ``owned`` (`OwnedPreconditionState.owned`, ``()`` when none does)."""

    count: jax.Array
    mu: Any
    nu: Any
    left: Any
    right: Any
    left_root: Any
    right_root: Any
    owned: tuple[jax.Array, ...] = ()


class _Factors(NamedTuple):
    """One stack's factors and inverse roots, ``(..., a, a)`` and ``(..., b, b)``."""

    left: jax.Array
    right: jax.Array
    left_root: jax.Array
    right_root: jax.Array


def shampoo_inverse_root(x: jax.Array, exponent: Any, epsilon: Any = 0.0, *,
                         pseudo_inverse: bool = False, rank_rtol: Any = 0.0) -> jax.Array:
    """``X^(-exponent)`` of symmetric PSD matrices ``x`` (``(..., n, n)``) by ``eigh`` as
    Meta's ``matrix_inverse_root`` (see the module): ``X + εI = Q diag(λ) Qᵀ``; damped:
    ``λ ← λ - min λ + ε`` where ``min λ < ε``; pseudo-inverse: ``λ^(-e)`` set to 0 where
    ``λ <= rank_rtol·max(max λ, 0)``."""
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    lam, q = jnp.linalg.eigh(x + epsilon * eye, symmetrize_input=False)
    exponent = jnp.asarray(exponent, x.dtype)
    if pseudo_inverse:
        cutoff = rank_rtol * jnp.maximum(jnp.max(lam, axis=-1, keepdims=True), 0.0)
        keep = lam > cutoff
        inv = jnp.where(keep, jnp.where(keep, lam, 1.0) ** -exponent, 0.0)
    else:
        lam_min = jnp.min(lam, axis=-1, keepdims=True)
        lam = jnp.where(lam_min < epsilon, (lam - lam_min) + epsilon, lam)
        inv = lam ** -exponent
    return (q * inv[..., None, :]) @ jnp.swapaxes(q, -1, -2)


def scale_by_shampoo(
    b1: Any = 0.9,
    b2: Any = 0.95,
    *,
    epsilon: Any = 1e-12,
    frequency: int = 5,
    start: int | None = None,
    root_exponent: Any = 0.25,
    pseudo_inverse: bool = False,
    rank_rtol: Any = 0.0,
    grafting: str | None = "adam",
    graft_b2: Any = 0.95,
    graft_eps: Any = 1e-10,
    use_bias_correction: bool = True,
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """Shampoo's direction ``L⁻ M̂ R⁻``, grafted onto Adam's norm (see the module).

    The defaults are Track 3 result #21's; #35's: ``b2=0.9, epsilon=0.0, frequency=1,
    pseudo_inverse=True, graft_b2=0.9, graft_eps=1e-15``.

    Args:
      b1: the filtered gradient's decay ``β₁`` (the library's ``betas[0]``), in [0, 1).
      b2: the factors' decay ``β₂`` (``betas[1]``), in [0, 1] (1: sums, no bias correction).
      epsilon: ``ε`` added to each factor before its root, >= 0; must be 0 with
        ``pseudo_inverse`` and > 0 without it.
      frequency: refresh the roots every ``frequency`` updates (int >= 1).
      start: the first update (from 1) using Shampoo's direction (``None``: ``frequency``);
        >= ``frequency``.
      root_exponent: ``e`` in each factor's ``X^(-e)`` (1/4: ``U = L^(-1/4) M R^(-1/4)``),
        > 0.
      pseudo_inverse: drop the eigenvalues at or below the rank cutoff instead of damping.
      rank_rtol: the pseudo-inverse's cutoff relative to the largest eigenvalue, >= 0.
      grafting: ``"adam"`` (the output has Adam's norm per matrix) or ``None``.
      graft_b2: Adam's second-moment decay for the graft, in [0, 1).
      graft_eps: Adam's epsilon for the graft, >= 0.
      use_bias_correction: bias-correct the filtered gradient and the factors.
      matrix_axes: the two axes of each leaf that form the matrix (other axes: a batch).
      shard_matrices: send the matrices of leaves split over a mesh to owners (as
        `scale_by_muon`'s ``shard_newton_schulz``); False: leave them to the partitioner.
      newton_schulz_plan: where the leaves live under ``jax.jit``, as in `scale_by_muon`
        (`NewtonSchulzPlan.from_params(params)`); init and update must see the same.
      mesh: the mesh for leaves of unknown sharding, as in `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `ShampooState`; every leaf needs at
      least two axes; ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for a hyperparameter outside its range, ``epsilon`` not 0 with
        ``pseudo_inverse`` (or 0 without it), ``start < frequency``, an unknown
        ``grafting``, bad ``matrix_axes``; at ``init`` for a leaf with fewer than two axes.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_shampoo
      >>> tx = scale_by_shampoo(frequency=1)
      >>> p = {"w": jnp.ones((4, 3))}
      >>> u, _ = tx.update(p, tx.init(p))
      >>> u["w"].shape
      (4, 3)
    """
    check_unit_interval("b1", b1)
    b2_value = concrete_real(b2)
    if b2_value is not None and not 0.0 <= b2_value <= 1.0:
        raise ValueError(f"b2 must be in [0, 1], got {b2!r}.")
    check_non_negative("epsilon", epsilon)
    eps_value = concrete_real(epsilon)
    if eps_value is not None and pseudo_inverse and eps_value != 0.0:
        raise ValueError(f"epsilon must be 0.0 with pseudo_inverse=True (the pseudo-inverse "
                         f"drops small eigenvalues instead of damping them), got {epsilon!r}.")
    if eps_value is not None and not pseudo_inverse and eps_value <= 0.0:
        raise ValueError(f"epsilon must be > 0 without pseudo_inverse (a rank-deficient "
                         f"factor has no inverse root), got {epsilon!r}.")
    check_int_at_least("frequency", frequency, 1)
    start = frequency if start is None else start
    check_int_at_least("start", start, frequency)
    check_positive("root_exponent", root_exponent)
    check_non_negative("rank_rtol", rank_rtol)
    if grafting not in GRAFTINGS:
        raise ValueError(f"grafting must be one of {GRAFTINGS}, got {grafting!r}.")
    check_unit_interval("graft_b2", graft_b2)
    check_non_negative("graft_eps", graft_eps)
    matrix_axes = _check_matrix_axes(matrix_axes)

    mT = lambda x: jnp.swapaxes(x, -1, -2)

    def init_factors(batch: int, a: int, b: int, dtype: Any) -> _Factors:
        dt = jnp.promote_types(dtype, jnp.float32)
        eye = lambda n: jnp.broadcast_to(jnp.eye(n, dtype=dt), (batch, n, n))
        return _Factors(jnp.zeros((batch, a, a), dt), jnp.zeros((batch, b, b), dt),
                        eye(a), eye(b))

    def precondition(m_hat: jax.Array, g: jax.Array, st: _Factors, count: jax.Array,
                     flags: Any) -> tuple[jax.Array, _Factors]:
        """Matrices ``(..., a, b)``: the factors from the raw gradient ``g`` (every update),
        their roots (at a refresh) and ``L⁻ M̂ R⁻``; a `MatrixPrecondition`'s ``apply``,
        run on each matrix's owner under a mesh."""
        del flags
        t, dt = count + 1, st.left.dtype
        g, beta2 = g.astype(dt), jnp.asarray(b2, dt)
        weight = jnp.where(beta2 == 1.0, 1.0, 1.0 - beta2).astype(dt)  # β₂ = 1: sums
        left = beta2 * st.left + weight * (g @ mT(g))
        right = beta2 * st.right + weight * (mT(g) @ g)

        def roots():  # from the bias-corrected factors
            bc2 = (jnp.where(beta2 < 1.0, 1.0 - beta2 ** t.astype(dt), 1.0)
                   if use_bias_correction else jnp.ones([], dt)).astype(dt)
            out = []
            for factor, old in ((left, st.left_root), (right, st.right_root)):
                root = shampoo_inverse_root(
                    factor / bc2, root_exponent, jnp.asarray(epsilon, dt),
                    pseudo_inverse=pseudo_inverse, rank_rtol=jnp.asarray(rank_rtol, dt))
                ok = jnp.all(jnp.isfinite(root), axis=(-2, -1), keepdims=True)
                out.append(jnp.where(ok, root, old))  # as the library: keep the old root
            return tuple(out)

        if frequency == start == 1:  # every update refreshes (#35): no branch to keep
            left_root, right_root = roots()
        else:
            refresh = ((t % frequency == 0) & (t > start)) | (t == start)
            left_root, right_root = jax.lax.cond(refresh, roots,
                                                 lambda: (st.left_root, st.right_root))
        return (left_root @ m_hat.astype(dt) @ right_root,
                _Factors(left, right, left_root, right_root))

    per_matrix = MatrixPrecondition(init_factors, precondition)

    # the exchange reads (fan_in, fan_out): its (fan_out, fan_in) view is our (a, b)
    owners = owners_work("scale_by_shampoo", per_matrix, (matrix_axes[1], matrix_axes[0]),
                         newton_schulz_plan=newton_schulz_plan, mesh=mesh,
                         shard_matrices=shard_matrices)

    def init_fn(params):
        def check(path, p):
            if jnp.ndim(p) < 2:
                raise ValueError(f"scale_by_shampoo needs leaves with at least two axes; "
                                 f"{jax.tree_util.keystr(path)} has shape {jnp.shape(p)}")
        jax.tree_util.tree_map_with_path(check, params)  # MaskedNode leaves have no leaves

        per_leaf, treedef, owned = owners.init(params)
        mirror = lambda: jax.tree.map(lambda p: jnp.zeros_like(  # keeps p's sharding
            p, dtype=state_dtype(None, p)), params)
        return ShampooState(jnp.zeros([], jnp.int32), mirror(),
                            mirror() if grafting == "adam" else None,
                            *_factor_trees(per_leaf, treedef), owned)

    def update_fn(updates, state, params=None):
        del params
        t = state.count + 1
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths, leaves = [path_to_str(p) for p, _ in with_paths], [g for _, g in with_paths]
        flat = lambda tree: treedef.flatten_up_to(tree)
        mus = flat(state.mu)
        nus = flat(state.nu) if grafting == "adam" else [None] * len(leaves)
        factors = [optax.EmptyState() if isinstance(s[0], optax.EmptyState) else _Factors(*s)
                   for s in zip(*map(flat, (state.left, state.right, state.left_root,
                                            state.right_root)), strict=True)]

        grads, new_mu, m_hats = [], [], []
        for g, mu in zip(leaves, mus, strict=True):
            dt = mu.dtype
            g32, b1_ = g.astype(dt), jnp.asarray(b1, dt)
            mu = mu + (1 - b1_) * (g32 - mu)  # the library's lerp_(G, 1 - β₁)
            grads.append(g32)
            new_mu.append(mu)
            m_hats.append(mu / (1 - b1_ ** t.astype(dt)) if use_bias_correction else mu)
        dtype = jnp.result_type(jnp.float32, *[m.dtype for m in mus])
        axes = [owners.leaf_axes(g) for g in leaves]
        directions, factors, owned = owners.run(
            m_hats, paths, list(zip(leaves, mus, strict=True)), grads=grads,
            leaf_states=factors, owned=state.owned, count=state.count, dtype=dtype)

        out, new_nu = [], list(nus)
        for i, (p, g) in enumerate(zip(directions, leaves, strict=True)):
            if grafting == "adam":
                dt = mus[i].dtype
                gb2 = jnp.asarray(graft_b2, dt)
                nu = gb2 * nus[i] + (1 - gb2) * grads[i] * grads[i]
                adam = m_hats[i] / (jnp.sqrt(nu / (1 - gb2 ** t.astype(dt)))
                                    + jnp.asarray(graft_eps, dt))
                norm = lambda x, a=axes[i]: jnp.sqrt(jnp.sum(x * x, axis=a, keepdims=True))
                grafted = p * (norm(adam) / (norm(p) + GRAFT_NORM_EPS))
                p = jnp.where(t < start, adam, grafted)
                new_nu[i] = nu
            out.append(p.astype(g.dtype))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        return unflat(out), ShampooState(
            t, unflat(new_mu), unflat(new_nu) if grafting == "adam" else None,
            *_factor_trees(factors, treedef), owned)

    return optax.GradientTransformation(init_fn, update_fn)


def _factor_trees(per_leaf: list[Any], treedef: Any) -> list[Any]:
    """The trees of `ShampooState`'s ``left``, ``right``, ``left_root``, ``right_root``
    from per-leaf `_Factors` (``optax.EmptyState()`` in all four where a leaf is owned)."""
    rows = [(s,) * 4 if isinstance(s, optax.EmptyState) else tuple(s) for s in per_leaf]
    return [treedef.unflatten([r[k] for r in rows]) for k in range(4)]


def shampoo(
    learning_rate: float | optax.Schedule,
    b1: Any = 0.9,
    b2: Any = 0.95,
    *,
    weight_decay: Any = 0.0,
    epsilon: Any = 1e-12,
    frequency: int = 5,
    start: int | None = None,
    root_exponent: Any = 0.25,
    pseudo_inverse: bool = False,
    rank_rtol: Any = 0.0,
    grafting: str | None = "adam",
    graft_b2: Any = 0.95,
    graft_eps: Any = 1e-10,
    use_bias_correction: bool = True,
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """Shampoo as an optimizer: `scale_by_shampoo`, then decoupled weight decay and the
    learning rate, ``W ← W - lr·(out + weight_decay·W)`` (the library's
    ``WeightDecayType.DECOUPLED``: the decay is multiplied by the scheduled lr).

    Track 3 #21: ``shampoo(0.0015 · schedule, weight_decay=0.2)`` (the defaults); #35:
    ``shampoo(0.01 · schedule, b2=0.9, weight_decay=0.1, epsilon=0.0, frequency=1,
    pseudo_inverse=True, graft_b2=0.9, graft_eps=1e-15)``.

    Args:
      learning_rate: the step size ``lr``, or a schedule of the update count (from 0).
      weight_decay: the decoupled decay ``wd`` (>= 0), multiplied by ``lr``.
      b1: the filtered gradient's decay, as `scale_by_shampoo`'s; so are ``b2``,
        ``epsilon``, ``frequency``, ``start``, ``root_exponent``, ``pseudo_inverse``,
        ``rank_rtol``, ``grafting``, ``graft_b2``, ``graft_eps``,
        ``use_bias_correction``, ``matrix_axes``, ``shard_matrices``,
        ``newton_schulz_plan`` and ``mesh``.

    Returns:
      ``optax.chain(scale_by_shampoo(...), add_decoupled_weight_decay(weight_decay),
      optax.scale_by_learning_rate(learning_rate))``.

    Raises:
      ValueError: a negative ``weight_decay``, or as `scale_by_shampoo`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import shampoo
      >>> tx = shampoo(1e-3, weight_decay=0.1, frequency=1)
      >>> params = {"w": jnp.ones((4, 3))}
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> optax.apply_updates(params, updates)["w"].shape
      (4, 3)
    """
    check_non_negative("weight_decay", weight_decay)
    return optax.chain(
        scale_by_shampoo(b1, b2, epsilon=epsilon, frequency=frequency, start=start,
                         root_exponent=root_exponent, pseudo_inverse=pseudo_inverse,
                         rank_rtol=rank_rtol, grafting=grafting, graft_b2=graft_b2,
                         graft_eps=graft_eps, use_bias_correction=use_bias_correction,
                         matrix_axes=matrix_axes, shard_matrices=shard_matrices,
                         newton_schulz_plan=newton_schulz_plan, mesh=mesh),
        add_decoupled_weight_decay(weight_decay),
        optax.scale_by_learning_rate(learning_rate))
