"""SOAP: Adam in the eigenbasis of the gradient's two Kronecker factors.

`scale_by_soap` keeps, per matrix ``G`` (PyTorch's ``(out, in)`` view of the leaf: rows
are the fan_out axis of ``matrix_axes``, as in `soap_whitening`; other axes are a batch),
a first moment ``m`` in the parameter's basis, two factors ``L`` (out x out) and ``R``
(in x in), their eigenbases ``Q_L``, ``Q_R`` and a second moment ``V`` in that basis, and
returns the direction, with ``t`` the update count from 0::

    t = 0:  Q_L, Q_R = eigenvectors of G Gᵀ, Gᵀ G          (eigh, decreasing eigenvalue)
    m ← β₁ m + (1-β₁) G                                     (no bias correction)
    L ← β L + (1-β) G Gᵀ;   R ← β R + (1-β) Gᵀ G            (β = shampoo_beta)
    P = Q_Lᵀ G Q_R;   V ← β₂ V + (1-β₂) P²
    U = Q_L (Q_Lᵀ m Q_R / (sqrt(V) + eps)) Q_Rᵀ
    (t+1) % precondition_frequency == 0:  Q_L ← qr(L Q_L).Q;  Q_R ← qr(R Q_R).Q

The refresh is one power iteration and a QR step from the last basis (the columns keep
their order; ``V`` stays as it is). This is SOAP as modded-nanogpt Track 3 result #27
(SOAP-H) writes it: the bases come from the first gradient at the first update, ``L`` and
``R`` are zero before it, and nothing is bias-corrected (Vyas et al.'s SOAP bias-corrects
``m`` and ``V`` and makes no step at the first update; on the hyperball, which normalises
the step, bias correction only moves the weight of ``eps``). Put `radius_steps` after it
for the hyperball; `soap` is that chain.

``factor_update="kl"`` is KL-SOAP (Lin et al. 2025) as Track 3 results #19 and #25
(KL-SOAP-H) write it: the first update only builds the statistics (no step; ``m`` and ``V``
leave that gradient out) from ``L = G Gᵀ/in``, ``R = Gᵀ G/out``, their eigenbases and
``d_L = d_R = 1/0.1`` (``0.1^{-1/2}`` as their inverse roots); later updates make the same
Adam step and replace the factors' statistics by their KL-whitened ones, with ``P`` the
projected gradient and the previous ``d``::

    L ← β L + (1-β) G Q_R diag(1/d_R) Q_Rᵀ Gᵀ / in
    R ← β R + (1-β) Gᵀ Q_L diag(1/d_L) Q_Lᵀ G / out
    d_L ← β d_L + (1-β) mean_i (P_{oi}² / d_R,i);   d_R ← β d_R + (1-β) mean_o (P_{oi}² / d_L,o)
    (each d's inverse root clamped to [0, 4000], d floored at 1e-30; L, R symmetrised)

and the refresh at the ``s``-th step when ``s % precondition_frequency == 0`` (``s = t``:
the first update is not a step). The log keeps ``m`` in the eigenbasis and rotates it with
the basis; keeping it in the parameter's basis is the same (the bases are orthogonal).

The eigenbasis and its refresh are SOAP-Muon's (`soap_whitening`), one implementation in
``soap_muon.py``. Statistics are float32 (float64 for float64 params), as the record's.

Everything but the first moment is a function of each matrix alone, a `MatrixPrecondition`
run by `scale_by_muon`'s exchange (``muon_sharding.py``, with no Newton-Schulz after it):
on params split over a mesh (FSDP) each whole matrix's gradient and first moment travel to
one owner device (one all-to-all in, one back), which keeps that matrix's factors, bases
and ``V``; the partitioner would instead gather every matrix to every device for its Gram
products.

At the first update the bases are the first gradient's singular vectors, so ``Q_Lᵀ G Q_R``
is diagonal up to rounding: off the diagonal ``U``'s entries are that rounding over
``sqrt(V) + eps``, about ``±(1-β₁)/sqrt(1-β₂)`` wherever it exceeds ``eps`` (in float32 on
the record's summed-loss gradients: nearly everywhere), about 0 in float64. The log has
the same first step; a float32 and a float64 run of it agree only where ``eps`` is far
above float32's rounding of ``G``. On a non-square matrix the first Gram of the longer
side is rank-deficient and its eigenbasis there is arbitrary (LAPACK's choice), which
SOAP's elementwise division does not forgive either.

References:
  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024 (ICLR 2025).

  Lin et al., `Understanding and Improving Shampoo and SOAP via Kullback-Leibler
  Minimization <https://arxiv.org/abs/2509.03378>`_, 2025.

  modded-nanogpt Track 3 result #27, SOAP-H (`results/20260518_soaph/
  train_gpt_simple_soaph.py <https://github.com/KellerJordan/modded-nanogpt/tree/master/
  records/track_3_optimization>`_: ``soap_update``, ``SOAPH``, ``_initial_orthogonal_matrix``,
  ``scale_invariant_update_``), 2026; results #19 and #25, KL-SOAP-H
  (`results/20260508_klsoap_h_clean_tuple_sweep/b1095_sh090/*.txt`,
  `results/20260511_klsoap_h_lr_power_decay/train_gpt_simple_klsoap_h_lr_power_decay.py`:
  ``init_2d_klsoap_state_``, ``update_2d_klsoap_preconditioner_``, ``refresh_klsoap_basis_``,
  ``klsoap_direction``, ``KLSOAPH``), 2026.
"""

from __future__ import annotations

import functools
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
from optax_snoo._src.soap_muon import SoapMatrixState, _eigenbasis, _mm, _power_qr
from optax_snoo._src.utils import (
    check_int_at_least,
    check_positive,
    check_unit_interval,
    path_to_str,
    state_dtype,
    value_at,
)

__all__ = ["FACTOR_UPDATES", "SoapState", "scale_by_soap", "soap"]

#: ``scale_by_soap``'s factor statistics: SOAP's Gram EMAs, or KL-SOAP's whitened ones.
FACTOR_UPDATES = ("gram", "kl")
# KL-SOAP's constants (#19's log: init_factor=0.1, clamp_min(1e-30), clamp(max=4000.0)).
_KL_INIT = 0.1
_KL_FLOOR = 1e-30
_KL_MAX_INVERSE_ROOT = 4000.0


class SoapState(NamedTuple):
    """State of `scale_by_soap`.

    Attributes:
      count: number of updates so far (int32).
      mu: per leaf, the first moment ``m`` in the parameter's layout (float32, float64 for
        float64 params).
      matrices: per leaf, a `SoapMatrixState` in the ``(..., out, in)`` view (``out`` the
        fan_out axis, the leaf's other axes first): ``gram_out`` ``L``, ``gram_in`` ``R``,
        ``basis_out`` ``Q_L``, ``basis_in`` ``Q_R`` (identities until the first update),
        ``second_moment`` ``V`` (entry ``[.., o, i]`` belongs to the ``o``-th column of
        ``Q_L`` and the ``i``-th of ``Q_R``); ``optax.EmptyState()`` for a leaf whose
        matrices go to owners on a mesh (their state is in ``owned``).
      kl_inverse_roots: with ``factor_update="kl"``, per leaf, the pair
        ``(d_L^{-1/2}, d_R^{-1/2})``, shapes ``(..., out)`` and ``(..., in)`` (or
        ``optax.EmptyState()`` for a leaf on owners); otherwise ``optax.EmptyState()``.
      owned: the owners' flat states of the matrices split over a mesh, one row per
        device (`OwnedPreconditionState.owned`); ``()`` when none is.
    """

    count: jax.Array
    mu: Any
    matrices: Any
    kl_inverse_roots: Any
    owned: tuple[jax.Array, ...] = ()


def _adam_in_eigenbasis(G: jax.Array, M: jax.Array, st: SoapMatrixState, beta2: Any,
                        eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(U, P, V)``: the direction from the first moment ``M``, the projected gradient
    ``P = Q_Lᵀ G Q_R`` and the new second moment."""
    rotate = lambda X: _mm("...ji,...jk,...kl->...il", st.basis_out, X, st.basis_in)
    P = rotate(G)
    V = beta2 * st.second_moment + (1 - beta2) * jnp.square(P)
    U = _mm("...ij,...jk,...lk->...il", st.basis_out, rotate(M) / (jnp.sqrt(V) + eps),
            st.basis_in)
    return U, P, V


def _soap_matrices(M: jax.Array, G: jax.Array, state: tuple, count: jax.Array, flags: Any,
                   *, kl: bool, b2: Any, shampoo_beta: Any, eps: float,
                   precondition_frequency: int) -> tuple[jax.Array, tuple]:
    """SOAP on a stack of matrices ``(..., out, in)`` (the module's formulas): ``M`` the
    new first moment, ``G`` the gradient, ``state`` ``(SoapMatrixState, KL inverse roots
    or ())``; returns the direction and the new state. A `MatrixPrecondition`'s ``apply``:
    under a mesh each matrix's owner runs it on the whole matrix."""
    del flags
    st, roots = state
    dt = st.gram_out.dtype
    beta2 = jnp.asarray(value_at(b2, count), dt)
    beta = beta2 if shampoo_beta is None else jnp.asarray(value_at(shampoo_beta, count), dt)
    M, G = M.astype(dt), G.astype(dt)

    def refreshed(step, L, R, basis_out, basis_in):
        return jax.lax.cond(step % precondition_frequency == 0,
                            lambda: (_power_qr(L, basis_out), _power_qr(R, basis_in)),
                            lambda: (basis_out, basis_in))

    if not kl:
        gram_out = _mm("...ij,...kj->...ik", G, G)
        gram_in = _mm("...ji,...jk->...ik", G, G)
        # The first update builds the bases from its own gradient's Grams.
        basis_out, basis_in = jax.lax.cond(
            count == 0, lambda: (_eigenbasis(gram_out), _eigenbasis(gram_in)),
            lambda: (st.basis_out, st.basis_in))
        L = beta * st.gram_out + (1 - beta) * gram_out
        R = beta * st.gram_in + (1 - beta) * gram_in
        U, _, V = _adam_in_eigenbasis(G, M, SoapMatrixState(
            st.gram_out, st.gram_in, basis_out, basis_in, st.second_moment), beta2, eps)
        basis_out, basis_in = refreshed(count + 1, L, R, basis_out, basis_in)
        return U, (SoapMatrixState(L, R, basis_out, basis_in, V), roots)

    out, inn = G.shape[-2:]

    def build():  # init_2d_klsoap_state_: statistics only, no step
        L = _mm("...ij,...kj->...ik", G, G) / inn
        R = _mm("...ji,...jk->...ik", G, G) / out
        root = jnp.asarray(_KL_INIT ** -0.5, dt)
        return (jnp.zeros_like(G),
                (SoapMatrixState(L, R, _eigenbasis(L), _eigenbasis(R), st.second_moment),
                 tuple(jnp.full_like(r, root) for r in roots)))

    def step():
        U, P, V = _adam_in_eigenbasis(G, M, st, beta2, eps)
        root_out, root_in = roots
        # update_2d_klsoap_preconditioner_: targets whitened by the other side's roots
        right = _mm("...ij,...jk->...ik", G, st.basis_in) * root_in[..., None, :]
        left = _mm("...ji,...jk->...ik", st.basis_out, G) * root_out[..., :, None]
        L = beta * st.gram_out + (1 - beta) * _mm("...ij,...kj->...ik", right, right) / inn
        R = beta * st.gram_in + (1 - beta) * _mm("...ji,...jk->...ik", left, left) / out
        sym = lambda X: 0.5 * (X + jnp.swapaxes(X, -1, -2))
        L, R = sym(L), sym(R)
        diag_out = jnp.mean(jnp.square(P * root_in[..., None, :]), axis=-1)
        diag_in = jnp.mean(jnp.square(P * root_out[..., :, None]), axis=-2)

        def new_root(r, d):
            old = jnp.nan_to_num(1 / jnp.square(r), nan=0.0, posinf=0.0, neginf=0.0)
            lam = beta * old + (1 - beta) * d
            r = jnp.minimum(jax.lax.rsqrt(jnp.maximum(lam, _KL_FLOOR)), _KL_MAX_INVERSE_ROOT)
            return jnp.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0)

        basis_out, basis_in = refreshed(count, L, R, st.basis_out, st.basis_in)
        return U, (SoapMatrixState(L, R, basis_out, basis_in, V),
                   (new_root(root_out, diag_out), new_root(root_in, diag_in)))

    return jax.lax.cond(count == 0, build, step)


def _soap_init(batch: int, out: int, inn: int, dtype: Any, *, kl: bool) -> tuple:
    """The state of ``batch`` matrices ``(out, in)``: zero factors and ``V``, identity
    bases, and with ``kl`` zero inverse roots."""
    dt = jnp.promote_types(dtype, jnp.float32)
    eye = lambda n: jnp.broadcast_to(jnp.eye(n, dtype=dt), (batch, n, n))
    st = SoapMatrixState(jnp.zeros((batch, out, out), dt), jnp.zeros((batch, inn, inn), dt),
                         eye(out), eye(inn), jnp.zeros((batch, out, inn), dt))
    roots = (jnp.zeros((batch, out), dt), jnp.zeros((batch, inn), dt)) if kl else ()
    return st, roots


def scale_by_soap(
    b1: float | optax.Schedule = 0.95,
    b2: float | optax.Schedule = 0.9,
    *,
    shampoo_beta: float | optax.Schedule | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 1,
    factor_update: str = "gram",
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """SOAP's direction ``U = Q_L (Q_Lᵀ m Q_R / (sqrt(V) + eps)) Q_Rᵀ`` (see the module).

    The first moment is updated where each leaf lies; everything else is a function of
    each matrix alone and runs as `scale_by_muon`'s per-matrix precondition does: on
    params split over a mesh, the gradient and the first moment of each whole matrix go
    to one device (its owner, one all-to-all in and one back for all the matrices), which
    keeps that matrix's factors, bases and ``V`` (`SoapState.owned`), so no collective
    gathers a matrix to every device; elsewhere, per leaf, same-shape matrices batched.

    Args:
      b1: decay ``β₁`` of the first moment (Track 3 #27: 0.95), in [0, 1), or a schedule.
      b2: decay ``β₂`` of ``V`` (#27: 0.9), in [0, 1), or a schedule.
      shampoo_beta: decay ``β`` of the factors ``L``, ``R``; ``None``: ``b2`` (#27's one
        ``ema_beta``).
      eps: added to ``sqrt(V)`` (#27: 1e-8), > 0.
      precondition_frequency: refresh the bases every this many updates (#27: 1).
      factor_update: ``"gram"`` (SOAP, #27) or ``"kl"`` (KL-SOAP, #19, #25; its first
        update only builds the statistics and returns zeros), see the module.
      matrix_axes: ``(fan_in, fan_out)`` axes of every leaf (Flax ``(in, out)`` kernels:
        ``(-2, -1)``), as in `scale_by_muon`; other axes are a batch of matrices.
      shard_matrices: send the matrices of leaves split over a mesh to owners (as
        `scale_by_muon`'s ``shard_newton_schulz``); False: leave them to the partitioner.
      newton_schulz_plan: where the leaves live under ``jax.jit``, as in `scale_by_muon`
        (`NewtonSchulzPlan.from_params(params)`); init and update must see the same.
      mesh: the mesh for leaves of unknown sharding, as in `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation`` with state `SoapState`; every leaf needs at
      least two axes; ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for a decay outside [0, 1), a non-positive ``eps`` or
        ``precondition_frequency``, an unknown ``factor_update``, bad ``matrix_axes``; at
        ``init`` for a leaf with fewer than two axes.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_soap
      >>> tx = scale_by_soap()
      >>> params = {"w": jnp.ones((4, 3))}
      >>> state = tx.init(params)
      >>> state.matrices["w"].gram_out.shape  # L over the fan_out axis (3)
      (3, 3)
      >>> updates, state = tx.update({"w": jnp.eye(4, 3)}, state)
      >>> updates["w"].shape
      (4, 3)
    """
    check_unit_interval("scale_by_soap: b1", b1)
    check_unit_interval("scale_by_soap: b2", b2)
    check_unit_interval("scale_by_soap: shampoo_beta", shampoo_beta, allow_none=True)
    check_positive("scale_by_soap: eps", eps)
    check_int_at_least("scale_by_soap: precondition_frequency", precondition_frequency, 1)
    if factor_update not in FACTOR_UPDATES:
        raise ValueError(f"scale_by_soap: factor_update must be one of {FACTOR_UPDATES}, got "
                         f"{factor_update!r}")
    kl = factor_update == "kl"
    fan_in, fan_out = _check_matrix_axes(matrix_axes)
    precondition = MatrixPrecondition(
        functools.partial(_soap_init, kl=kl),
        functools.partial(_soap_matrices, kl=kl, b2=b2, shampoo_beta=shampoo_beta, eps=eps,
                          precondition_frequency=precondition_frequency))

    owners = owners_work("scale_by_soap", precondition, (fan_in, fan_out),
                         newton_schulz_plan=newton_schulz_plan, mesh=mesh,
                         shard_matrices=shard_matrices)

    def init_fn(params: optax.Params) -> SoapState:
        def check(path, p):
            if jnp.ndim(p) < 2:
                raise ValueError(f"scale_by_soap needs leaves with at least two axes (a matrix "
                                 f"or a stack); {jax.tree_util.keystr(path)} has shape "
                                 f"{jnp.shape(p)}: send it to another optimizer")
            if not all(-jnp.ndim(p) <= a < jnp.ndim(p) for a in (fan_in, fan_out)) or (
                    fan_in % jnp.ndim(p) == fan_out % jnp.ndim(p)):
                raise ValueError(f"matrix_axes {matrix_axes} do not name two axes of "
                                 f"{jax.tree_util.keystr(path)}, shape {jnp.shape(p)}")
        jax.tree_util.tree_map_with_path(check, params)  # MaskedNode leaves have no leaves

        per_leaf, treedef, owned = owners.init(params)
        mu = jax.tree.map(lambda p: jnp.zeros_like(  # keeps p's sharding
            p, dtype=state_dtype(None, p)), params)
        return SoapState(jnp.zeros([], jnp.int32), mu, *_split_states(per_leaf, treedef, kl),
                         owned)

    def update_fn(updates, state: SoapState, params=None):
        del params
        count = state.count
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths, grads = [path_to_str(p) for p, _ in with_paths], [g for _, g in with_paths]
        mus = treedef.flatten_up_to(state.mu)
        grads = [g.astype(mu.dtype) for g, mu in zip(grads, mus, strict=True)]
        moments = []
        for g, mu in zip(grads, mus, strict=True):
            beta1 = jnp.asarray(value_at(b1, count), mu.dtype)
            new = beta1 * mu + (1 - beta1) * g  # the log's lerp_(grad, 1 - β₁)
            # KL-SOAP's first update leaves the gradient out of the moments
            moments.append(jnp.where(count == 0, mu, new) if kl else new)
        matrices = treedef.flatten_up_to(state.matrices)
        roots = (treedef.flatten_up_to(state.kl_inverse_roots) if kl
                 else [()] * len(grads))
        leaf_states = [m if isinstance(m, optax.EmptyState) else (m, r)
                       for m, r in zip(matrices, roots, strict=True)]
        dtype = jnp.result_type(jnp.float32, *[m.dtype for m in mus])
        directions, leaf_states, owned = owners.run(
            moments, paths, list(zip(grads, mus, strict=True)), grads=grads,
            leaf_states=leaf_states, owned=state.owned, count=count, dtype=dtype)
        out = [u.astype(g.dtype) for u, (_, g) in zip(directions, with_paths, strict=True)]
        return treedef.unflatten(out), SoapState(
            optax.safe_increment(count), treedef.unflatten(moments),
            *_split_states(leaf_states, treedef, kl), owned)

    return optax.GradientTransformation(init_fn, update_fn)


def _split_states(per_leaf: list[Any], treedef: Any, kl: bool) -> tuple[Any, Any]:
    """``(matrices, kl_inverse_roots)`` trees from the per-leaf ``(SoapMatrixState,
    roots)`` pairs (``optax.EmptyState()`` for both where a leaf's matrices are owned)."""
    split = [(s, s) if isinstance(s, optax.EmptyState) else s for s in per_leaf]
    return (treedef.unflatten([m for m, _ in split]),
            treedef.unflatten([r for _, r in split]) if kl else optax.EmptyState())


def soap(
    learning_rate: float | optax.Schedule,
    b1: float | optax.Schedule = 0.95,
    b2: float | optax.Schedule = 0.9,
    *,
    shampoo_beta: float | optax.Schedule | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 1,
    factor_update: str = "gram",
    pin: str | None = "current",
    matrix_axes: tuple[int, int] = (-2, -1),
    shard_matrices: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    """SOAP on the hyperball (Track 3 #27's matrix optimizer; #19's and #25's with
    ``factor_update="kl"``): `scale_by_soap` then
    ``radius_steps(learning_rate, brake=None, floor=None, pin=pin,
    cautious_weight_decay=0.0)`` (``shard_matrices``, ``newton_schulz_plan`` and ``mesh``
    are `scale_by_soap`'s).

    ``pin="current"``: ``W' = W - lr‖W‖U/max(‖U‖, 1e-10)`` rescaled to ``‖W‖`` (the log's
    ``scale_invariant_update_``, ``‖W‖`` taken each step; a zero matrix stays zero);
    ``"initial"``: the radius recorded at ``init``; ``None``: plain ``W - lr·U``.
    ``update`` needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import soap
      >>> params = {"w": jnp.eye(4, 3)}
      >>> tx = soap(0.018)
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((4, 3))}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> round(float(jnp.linalg.norm(params["w"])) ** 2, 4)  # ‖W‖² = 3 kept
      3.0
    """
    return optax.chain(
        scale_by_soap(b1, b2, shampoo_beta=shampoo_beta, eps=eps,
                      precondition_frequency=precondition_frequency,
                      factor_update=factor_update, matrix_axes=matrix_axes,
                      shard_matrices=shard_matrices, newton_schulz_plan=newton_schulz_plan,
                      mesh=mesh),
        radius_steps(learning_rate, brake=None, floor=None, pin=pin, cautious_weight_decay=0.0,
                     matrix_axes=matrix_axes))
