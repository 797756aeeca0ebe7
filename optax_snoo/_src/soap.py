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

The eigenbasis and its refresh are SOAP-Muon's (`soap_whitening`), one implementation in
``soap_muon.py``. Statistics are float32 (float64 for float64 params), as the record's.

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

  modded-nanogpt Track 3 result #27, SOAP-H (`results/20260518_soaph/
  train_gpt_simple_soaph.py <https://github.com/KellerJordan/modded-nanogpt/tree/master/
  records/track_3_optimization>`_: ``soap_update``, ``SOAPH``, ``_initial_orthogonal_matrix``,
  ``scale_invariant_update_``), 2026.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.newton_schulz import _check_matrix_axes
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.soap_muon import SoapMatrixState, _eigenbasis, _mm, _power_qr
from optax_snoo._src.utils import (
    check_int_at_least,
    check_positive,
    check_unit_interval,
    state_dtype,
    value_at,
)

__all__ = ["SoapState", "scale_by_soap", "soap"]


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
        ``Q_L`` and the ``i``-th of ``Q_R``).
    """

    count: jax.Array
    mu: Any
    matrices: Any


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def scale_by_soap(
    b1: float | optax.Schedule = 0.95,
    b2: float | optax.Schedule = 0.9,
    *,
    shampoo_beta: float | optax.Schedule | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 1,
    matrix_axes: tuple[int, int] = (-2, -1),
) -> optax.GradientTransformation:
    """SOAP's direction ``U = Q_L (Q_Lᵀ m Q_R / (sqrt(V) + eps)) Q_Rᵀ`` (see the module).

    Args:
      b1: decay ``β₁`` of the first moment (Track 3 #27: 0.95), in [0, 1), or a schedule.
      b2: decay ``β₂`` of ``V`` (#27: 0.9), in [0, 1), or a schedule.
      shampoo_beta: decay ``β`` of the factors ``L``, ``R``; ``None``: ``b2`` (#27's one
        ``ema_beta``).
      eps: added to ``sqrt(V)`` (#27: 1e-8), > 0.
      precondition_frequency: refresh the bases every this many updates (#27: 1).
      matrix_axes: ``(fan_in, fan_out)`` axes of every leaf (Flax ``(in, out)`` kernels:
        ``(-2, -1)``), as in `scale_by_muon`; other axes are a batch of matrices.

    Returns:
      An ``optax.GradientTransformation`` with state `SoapState`; every leaf needs at
      least two axes; ``optax.MaskedNode`` leaves pass through.

    Raises:
      ValueError: for a decay outside [0, 1), a non-positive ``eps`` or
        ``precondition_frequency``, bad ``matrix_axes``; at ``init`` for a leaf with fewer
        than two axes.

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
    fan_in, fan_out = _check_matrix_axes(matrix_axes)

    def axes(x: Any) -> tuple[int, int]:
        nd = jnp.ndim(x)
        return fan_out % nd, fan_in % nd

    def to_mat(x: jax.Array) -> jax.Array:  # the record's (..., out, in) view
        return jnp.moveaxis(x, axes(x), (-2, -1))

    def from_mat(x: jax.Array, like: jax.Array) -> jax.Array:
        return jnp.moveaxis(x, (-2, -1), axes(like))

    def init_fn(params: optax.Params) -> SoapState:
        def check(path, p):
            if _masked(p):
                return
            if jnp.ndim(p) < 2:
                raise ValueError(f"scale_by_soap needs leaves with at least two axes (a matrix "
                                 f"or a stack); {jax.tree_util.keystr(path)} has shape "
                                 f"{jnp.shape(p)}: send it to another optimizer")
            if not all(-jnp.ndim(p) <= a < jnp.ndim(p) for a in (fan_in, fan_out)) or (
                    fan_in % jnp.ndim(p) == fan_out % jnp.ndim(p)):
                raise ValueError(f"matrix_axes {matrix_axes} do not name two axes of "
                                 f"{jax.tree_util.keystr(path)}, shape {jnp.shape(p)}")
        jax.tree_util.tree_map_with_path(check, params, is_leaf=_masked)

        def matrices(p):
            if _masked(p):
                return p
            dt = state_dtype(None, p)
            shape = jax.eval_shape(to_mat, jax.ShapeDtypeStruct(jnp.shape(p), dt)).shape
            *batch, out, inn = shape
            eye = lambda n: jnp.broadcast_to(jnp.eye(n, dtype=dt), (*batch, n, n))
            return SoapMatrixState(jnp.zeros((*batch, out, out), dt),
                                   jnp.zeros((*batch, inn, inn), dt), eye(out), eye(inn),
                                   jnp.zeros((*batch, out, inn), dt))

        mu = jax.tree.map(lambda p: p if _masked(p) else jnp.zeros_like(  # keeps p's sharding
            p, dtype=state_dtype(None, p)), params, is_leaf=_masked)
        return SoapState(jnp.zeros([], jnp.int32), mu,
                         jax.tree.map(matrices, params, is_leaf=_masked))

    def leaf(g, mu, st: SoapMatrixState, count, beta1, beta2, beta):
        dt = mu.dtype
        mu = beta1 * mu + (1 - beta1) * g.astype(dt)  # the log's lerp_(grad, 1 - β₁)
        G, M = to_mat(g.astype(dt)), to_mat(mu)
        gram_out = _mm("...ij,...kj->...ik", G, G)
        gram_in = _mm("...ji,...jk->...ik", G, G)
        # The first update builds the bases from its own gradient's Grams.
        basis_out, basis_in = jax.lax.cond(
            count == 0, lambda: (_eigenbasis(gram_out), _eigenbasis(gram_in)),
            lambda: (st.basis_out, st.basis_in))
        L = beta * st.gram_out + (1 - beta) * gram_out
        R = beta * st.gram_in + (1 - beta) * gram_in
        rotate = lambda X: _mm("...ji,...jk,...kl->...il", basis_out, X, basis_in)
        P = rotate(G)
        V = beta2 * st.second_moment + (1 - beta2) * jnp.square(P)
        U = _mm("...ij,...jk,...lk->...il", basis_out, rotate(M) / (jnp.sqrt(V) + eps),
                basis_in)
        basis_out, basis_in = jax.lax.cond(
            (count + 1) % precondition_frequency == 0,
            lambda: (_power_qr(L, basis_out), _power_qr(R, basis_in)),
            lambda: (basis_out, basis_in))
        return from_mat(U, g).astype(g.dtype), mu, SoapMatrixState(L, R, basis_out, basis_in, V)

    def update_fn(updates, state: SoapState, params=None):
        del params
        count = state.count
        beta1, beta2 = value_at(b1, count), value_at(b2, count)
        beta = beta2 if shampoo_beta is None else value_at(shampoo_beta, count)
        leaves, treedef = jax.tree.flatten(updates, is_leaf=_masked)
        mus = treedef.flatten_up_to(state.mu)
        mats = treedef.flatten_up_to(state.matrices)
        out, new_mu, new_mats = [], [], []
        for g, mu, st in zip(leaves, mus, mats, strict=True):
            if _masked(g):
                out.append(g), new_mu.append(mu), new_mats.append(st)
                continue
            dt = mu.dtype
            u, mu, st = leaf(g, mu, st, count, *(jnp.asarray(b, dt) for b in (beta1, beta2,
                                                                                beta)))
            out.append(u), new_mu.append(mu), new_mats.append(st)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        return unflat(out), SoapState(optax.safe_increment(count), unflat(new_mu),
                                      unflat(new_mats))

    return optax.GradientTransformation(init_fn, update_fn)


def soap(
    learning_rate: float | optax.Schedule,
    b1: float | optax.Schedule = 0.95,
    b2: float | optax.Schedule = 0.9,
    *,
    shampoo_beta: float | optax.Schedule | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 1,
    pin: str | None = "current",
    matrix_axes: tuple[int, int] = (-2, -1),
) -> optax.GradientTransformation:
    """SOAP on the hyperball (Track 3 #27's matrix optimizer): `scale_by_soap` then
    ``radius_steps(learning_rate, brake=None, floor=None, pin=pin,
    cautious_weight_decay=0.0)``.

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
                      precondition_frequency=precondition_frequency, matrix_axes=matrix_axes),
        radius_steps(learning_rate, brake=None, floor=None, pin=pin, cautious_weight_decay=0.0,
                     matrix_axes=matrix_axes))
