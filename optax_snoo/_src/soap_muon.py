"""SOAP-Muon: Muon's momentum whitened in SOAP's eigenbasis before Newton-Schulz.

`soap_whitening` is the whitening, a `MatrixPrecondition` for `scale_by_muon`'s
``precondition=`` (a function of each matrix alone, run on its owner under the sharded
plan, each device's matrices batched: one product per matrix shape, one basis refresh
per Gram size); `soap_muon`
chains it into Muon with the Gram-Frobenius normalisation of the iteration and a
learning rate. `trust_gate_floor` and
`trust_gate_cap` are the record's bounds of the trust gate.

References:
  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024

  Jordan et al., `modded-nanogpt Track 3 (optimization) records #14, #16, #44, #46
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.muon_sharding import MatrixPrecondition
from optax_snoo._src.newton_schulz import Coefficients, gram_frobenius_norm
from optax_snoo._src.schedules import trust_gate_cap, trust_gate_floor
from optax_snoo._src.utils import (
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_unit_interval,
    value_at,
)

NORM_MATCHES = ("gram", "frobenius")
_HIGHEST = jax.lax.Precision.HIGHEST

TrustGateLeaves = bool | Callable[[str], bool] | Any


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=_HIGHEST)


def _gram_norm(x: jax.Array, eps: float = 1e-8) -> jax.Array:
    return gram_frobenius_norm(x, eps)


def _frobenius_norm(x: jax.Array, eps: float = 1e-8) -> jax.Array:
    return jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)), eps)


def _cosine(a: jax.Array, b: jax.Array, eps: float = 1e-8) -> jax.Array:
    dot = jnp.sum(a * b, axis=(-2, -1), keepdims=True)
    return dot / jnp.maximum(_frobenius_norm(a, 0.0) * _frobenius_norm(b, 0.0), eps)


def _eigenbasis(gram: jax.Array) -> jax.Array:
    """Eigenvectors by decreasing eigenvalue (the record's flipped ``eigh``)."""
    return jnp.flip(jnp.linalg.eigh(gram)[1], axis=-1)


def _sorted_power_qr(gram: jax.Array, basis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One refresh of a basis: its columns sorted by decreasing ``diag(Qᵀ L Q)``, then
    ``qr(L Q)``; returns (new basis, the sort order, to permute ``V`` by). ``L Q`` is
    formed once: sorting ``Q``'s columns sorts ``L Q``'s alike."""
    product = _mm("...ij,...jk->...ik", gram, basis)
    order = jnp.argsort(-jnp.sum(basis * product, axis=-2), axis=-1)
    q, _ = jnp.linalg.qr(jnp.take_along_axis(product, order[..., None, :], axis=-1))
    return q, order


def _by_size(mats: list[jax.Array]) -> dict[tuple[int, Any], list[int]]:
    """Indices of the ``(..., n, n)`` arrays in ``mats``, grouped by ``n`` and dtype."""
    sizes: dict[tuple[int, Any], list[int]] = {}
    for i, x in enumerate(mats):
        sizes.setdefault((x.shape[-1], x.dtype), []).append(i)
    return sizes


def _batched(fn: Callable[..., Any], members: list[int], *lists: list[jax.Array]
             ) -> tuple[jax.Array, ...] | jax.Array:
    """``fn`` once on the arrays ``lists[j][members]`` stacked as ``(-1, n, n)``."""
    flat = lambda xs: (xs[members[0]].reshape(-1, *xs[members[0]].shape[-2:])
                       if len(members) == 1 else jnp.concatenate(
                           [xs[i].reshape(-1, *xs[i].shape[-2:]) for i in members]))
    return fn(*(flat(xs) for xs in lists))


def _unbatch(y: jax.Array, members: list[int], likes: list[jax.Array], out: list[Any],
             trailing: int) -> None:
    """Cut ``y`` (stacked as `_batched` stacked ``likes[members]``) back into ``out``,
    each piece with its ``like``'s batch axes and ``y``'s ``trailing`` axes."""
    start = 0
    for i in members:
        batch = likes[i].shape[:-2]
        n = math.prod(batch)
        out[i] = y[start:start + n].reshape(*batch, *y.shape[y.ndim - trailing:])
        start += n


def _refresh_bases(refresh: jax.Array, grams: list[jax.Array], bases: list[jax.Array],
                   second: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    """The bases of every stack's two sides (``grams``/``bases``: ``L_0, R_0, L_1, R_1,
    ...``) for ``refresh`` 0 (build: ``eigh``), 1 (sorted power-QR, the ``V`` s permuted)
    or 2 (keep), in one ``lax.switch`` with one batched ``eigh`` or QR per Gram size."""
    sizes = _by_size(grams)

    def build(ops: tuple) -> tuple:
        gs, _, vs = ops
        out: list[Any] = [None] * len(gs)
        for members in sizes.values():
            _unbatch(_batched(_eigenbasis, members, gs), members, gs, out, 2)
        return out, vs

    def power_qr(ops: tuple) -> tuple:
        gs, qs, vs = ops
        out: list[Any] = [None] * len(gs)
        orders: list[Any] = [None] * len(gs)
        for members in sizes.values():
            q, order = _batched(_sorted_power_qr, members, gs, qs)
            _unbatch(q, members, gs, out, 2)
            _unbatch(order, members, gs, orders, 1)
        vs = [jnp.take_along_axis(jnp.take_along_axis(v, rows[..., :, None], axis=-2),
                                  cols[..., None, :], axis=-1)
              for v, rows, cols in zip(vs, orders[0::2], orders[1::2], strict=True)]
        return out, vs

    keep = lambda ops: (ops[1], ops[2])
    return jax.lax.switch(refresh, (build, power_qr, keep), (grams, bases, second))


def _power_qr(gram: jax.Array, basis: jax.Array) -> jax.Array:
    """One refresh of a basis in its columns' order: ``qr(L Q).Q`` (SOAP's refresh as
    Track 3 #19, #25, #27 write it: no sort, so no permutation of the second moment)."""
    return jnp.linalg.qr(_mm("...ij,...jk->...ik", gram, basis))[0]


class SoapMatrixState(NamedTuple):
    """State of `soap_whitening` for a batch of matrices ``(..., out, in)``: the record's
    layout, ``out`` our fan_out axis and ``in`` our fan_in axis; the batch is the leaf's
    other axes (e.g. experts). Float32 (float64 for float64 params).

    Attributes:
      gram_out: ``L``, the EMA of ``G Gᵀ`` over the fan_out axis, ``(..., out, out)``
        (the record's row side of its ``(out, in)`` weights).
      gram_in: ``R``, the EMA of ``Gᵀ G`` over the fan_in axis, ``(..., in, in)``.
      basis_out: ``Q_L``, the eigenbasis of ``L`` (columns, by decreasing eigenvalue),
        ``(..., out, out)``; the identity until the first update builds it.
      basis_in: ``Q_R``, the eigenbasis of ``R``, ``(..., in, in)``.
      second_moment: ``V``, the EMA of the squared projected momentum
        ``(Q_Lᵀ M Q_R)²``, ``(..., out, in)`` (entry ``[.., o, i]`` belongs to the
        ``o``-th column of ``Q_L`` and the ``i``-th of ``Q_R``).
    """

    gram_out: jax.Array
    gram_in: jax.Array
    basis_out: jax.Array
    basis_in: jax.Array
    second_moment: jax.Array


def _whiten_stacks(Ms: list[jax.Array], Gs: list[jax.Array], states: list[SoapMatrixState],
                   count: jax.Array, gated: list[Any], *, beta: Any, beta2: Any,
                   precondition_frequency: int, denom_power: float, eps: float,
                   denom_floor: float, blend: float,
                   norm: Callable[[jax.Array], jax.Array], floor: Any, cap: Any,
                   trust: tuple[float, float, float]
                   ) -> tuple[list[jax.Array], list[SoapMatrixState]]:
    """The whitening of stacks of matrices ``(..., out, in)`` and their new statistics:
    the one implementation, per device over all its matrices (the leaves it keeps, or
    the matrices it owns). Each stack is whitened on its own (one batched product per
    stack), the bases of every stack refreshed together (one ``eigh`` or QR per Gram
    size, `_refresh_bases`). ``gated``: per stack, numpy bools of its batch's shape
    (which matrices the trust gate blends)."""
    beta = value_at(beta, count)
    beta2 = beta if beta2 is None else value_at(beta2, count)
    refresh = jnp.where(count == 0, 0, jnp.where(count % precondition_frequency == 0, 1, 2))
    first = count == 0
    Ds, grams, bases, second = [], [], [], []
    for M, G, st, gate in zip(Ms, Gs, states, gated, strict=True):
        dt = st.gram_out.dtype
        M, G, V = M.astype(dt), G.astype(dt), st.second_moment
        P = _mm("...ji,...jk,...kl->...il", st.basis_out, M, st.basis_in)
        V_new = beta2 * V + (1 - beta2) * jnp.square(P)
        denom = jnp.power(jnp.maximum(V_new, eps * eps), denom_power)
        if denom_floor > 0:  # each matrix's denominators floored at a fraction of their RMS
            rms = jnp.sqrt(jnp.mean(jnp.square(denom), axis=(-2, -1), keepdims=True))
            denom = jnp.maximum(denom, jnp.maximum(denom_floor * rms, eps))
        D = _mm("...ij,...jk,...lk->...il", st.basis_out, P / denom, st.basis_in)
        if blend != 1:
            D = blend * D + (1 - blend) * M
        D = D * (norm(M) / norm(D))
        D, V = jnp.where(first, M, D), jnp.where(first, V, V_new)
        gate = np.asarray(gate, bool)
        if gate.any():
            bounds = (value_at(floor, count), value_at(cap, count))
            blended = _trust_blend(M, D, G, bounds, trust, norm)
            D = blended if gate.all() else jnp.where(gate[..., None, None], blended, D)
        Ds.append(D)
        # Statistics after use: they whiten the next update.
        grams += [beta * st.gram_out + (1 - beta) * _mm("...ij,...kj->...ik", G, G),
                  beta * st.gram_in + (1 - beta) * _mm("...ji,...jk->...ik", G, G)]
        bases += [st.basis_out, st.basis_in]
        second.append(V)
    bases, second = _refresh_bases(refresh, grams, bases, second)
    return Ds, [SoapMatrixState(*grams[2 * k:2 * k + 2], *bases[2 * k:2 * k + 2], V)
                for k, V in enumerate(second)]


def _whiten_matrices(M: jax.Array, G: jax.Array, st: SoapMatrixState, count: jax.Array,
                     gated: Any, **settings: Any) -> tuple[jax.Array, SoapMatrixState]:
    """`_whiten_stacks` on one stack of matrices ``(..., out, in)`` (``gated``: numpy
    bools of the batch's shape)."""
    Ds, states = _whiten_stacks([M], [G], [st], count, [gated], **settings)
    return Ds[0], states[0]


def _matrix_whitening(beta: Any, beta2: Any, precondition_frequency: int,
                      denom_power: float, eps: float, denom_floor: float, blend: float,
                      norm_match: str, trust_min_agree: float,
                      trust_min_grad_align: float, trust_power: float, trust_floor: Any,
                      trust_cap: Any) -> dict[str, Any]:
    """The checked settings of `_whiten_stacks`."""
    if not isinstance(denom_floor, int | float):
        raise ValueError(f"denom_floor must be a number >= 0, got {denom_floor!r}.")
    check_unit_interval("beta", beta)
    check_unit_interval("beta2", beta2, allow_none=True)
    check_int_at_least("precondition_frequency", precondition_frequency, 1)
    check_non_negative("denom_power", denom_power)
    check_positive("eps", eps)
    check_non_negative("denom_floor", denom_floor)
    if not (isinstance(blend, int | float) and 0 < blend <= 1):
        raise ValueError(f"blend must be a number in (0, 1], got {blend!r}.")
    check_unit_interval("trust_min_agree", trust_min_agree)
    check_positive("trust_power", trust_power)
    if norm_match not in NORM_MATCHES:
        raise ValueError(f"norm_match must be one of {NORM_MATCHES}, got {norm_match!r}.")
    return dict(
        beta=beta, beta2=beta2,
        precondition_frequency=precondition_frequency, denom_power=denom_power, eps=eps,
        denom_floor=float(denom_floor), blend=float(blend),
        norm=_gram_norm if norm_match == "gram" else _frobenius_norm,
        floor=trust_gate_floor() if trust_floor is None else trust_floor,
        cap=trust_gate_cap() if trust_cap is None else trust_cap,
        trust=(trust_min_agree, trust_min_grad_align, trust_power))


def soap_whitening(
    beta: float | optax.Schedule = 0.9,
    *,
    beta2: float | optax.Schedule | None = None,
    precondition_frequency: int = 1,
    denom_power: float = 0.5,
    eps: float = 1e-8,
    denom_floor: float = 0.0,
    blend: float = 1.0,
    norm_match: str = "gram",
    trust_gate: TrustGateLeaves = None,
    trust_min_agree: float = 0.2,
    trust_min_grad_align: float = 0.0,
    trust_power: float = 1.0,
    trust_floor: float | optax.Schedule | None = None,
    trust_cap: float | optax.Schedule | None = None,
) -> MatrixPrecondition:
    r"""SOAP's whitening of Muon's momentum (modded-nanogpt Track 3, records #14 to #46).

    A `MatrixPrecondition` for `scale_by_muon(precondition=...)`: a function of each
    matrix alone, its Newton-Schulz input ``M`` (the Nesterov momentum), its raw gradient
    ``G`` and its own statistics, so that under `scale_by_muon`'s sharded plan each device
    whitens the whole matrices it owns (their statistics kept there), beside their
    Newton-Schulz. Per matrix, in the record's ``(out, in)`` terms, with ``t`` the update
    count::

        t = 0:  D = M                                    # no basis yet
        t > 0:  P = Q_Lᵀ M Q_R                           # momentum in the eigenbasis
                V = β₂ V + (1-β₂) P²                     # no bias correction
                Δ = max(V, eps²)^p                       # p = denom_power
                Δ = max(Δ, max(f·rms(Δ), eps))          # if f = denom_floor > 0
                D̃ = Q_L (P / Δ) Q_Rᵀ
                D̃ = a D̃ + (1-a) M                         # if a = blend < 1
                D = D̃ · g(M) / g(D̃)                      # g: norm_match (below)
        trust-gated leaves:  D = blend(M, D, G)          # below
        then, statistics for the next update:
                L = β L + (1-β) G Gᵀ;   R = β R + (1-β) Gᵀ G
                t = 0:  Q_L, Q_R = eigenvectors of L, R (eigh, decreasing eigenvalue)
                t > 0 and t % precondition_frequency == 0, for each side:
                        sort Q's columns by decreasing diag(Qᵀ L Q), permute V's
                        rows (columns) alike, Q = qr(L Q).Q  # one power iteration

    ``g(X) = max(‖XᵀX‖_F^{1/2}, 1e-8)`` (``norm_match="gram"``, #44/#46) or
    ``max(‖X‖_F, 1e-8)`` (``"frobenius"``, #14). It differs from SOAP (Vyas et al.):
    ``V`` tracks the projected *Nesterov momentum*, there is no Adam first moment in the
    eigenbasis, ``V`` is permuted but not re-projected when the basis rotates, and the
    basis uses the statistics of the previous updates (they are updated after use).

    **Layout.** The record's weights are PyTorch ``(out, in)``; `scale_by_muon`'s
    ``matrix_axes = (fan_in, fan_out)`` name a leaf's matrix axes (Flax ``(in, out)``
    kernels by default) and the whitening sees each matrix as ``(fan_out, fan_in)``, so
    ``L`` (the record's row Gram, ``G Gᵀ``) is over our fan_out axis and ``R`` over our
    fan_in axis, whatever the axes' positions. Other axes are a batch (expert stacks):
    each matrix has its own statistics and basis. The state is a `SoapMatrixState` per
    leaf in `OwnedPreconditionState.leaves` (``V`` in the ``(…, out, in)`` layout), or,
    for leaves whose matrices go to owners under the sharded plan, flattened on the owners
    in `OwnedPreconditionState.owned`. Statistics are float32 (float64 for float64
    params).

    **Batching.** Each device whitens all the matrices it keeps or owns in one call:
    matrices of one shape as one stack, and the basis refresh of every matrix side at
    once, one batched ``eigh`` (first update) or QR (refresh) per Gram size, e.g. two
    per step for a transformer's ``d``- and ``4d``-wide Grams instead of two per matrix;
    the per-matrix result, to float32 rounding. ``L Q`` is formed once per refresh (the
    sort permutes its columns as it permutes ``Q``'s).

    **Trust gate** (#16; in #44/#46 on ``attn.proj`` only), on the leaves ``trust_gate``
    selects: with ``cos`` the Frobenius cosine per matrix,
    ``agree = clip((cos(D, M) - a)/(1 - a), 0, 1)`` (``a = trust_min_agree``),
    ``align = clip((cos(D, G) - c)/max(cos(M, G) - c, 1e-8), 0, 1)``
    (``c = trust_min_grad_align``), ``gate = clip(agree·align, 0, 1)^power``, clipped to
    ``[trust_floor(t), trust_cap(t)]``, and ``D = B · g(M)/g(B)`` with
    ``B = M + gate (D - M)``: SOAP is trusted when it still points along the momentum and
    is at least as aligned with the gradient.

    Args:
      beta: decay of the Gram EMAs ``L``, ``R`` (record: 0.9), or a schedule.
      beta2: decay of ``V``; ``None``: ``beta`` (as the record).
      precondition_frequency: refresh the basis every this many updates (#44/#46: 1;
        #14: 10).
      denom_power: ``p`` in ``V^p`` (0.5: Adam's square root).
      eps: ``V`` is floored at ``eps²`` (record: 1e-8).
      denom_floor: ``f``: each matrix's denominators ``Δ`` are floored at ``f`` times
        their root mean square, so no eigen-direction with a tiny ``V`` is magnified
        beyond ``1/f`` of the typical (#16's attention SOAP, ``ATTN_SOAP_DENOM_FLOOR``;
        #20's and #30's ``attn.v``: 0.55); 0: none.
      blend: ``a`` in (0, 1]: the whitened momentum mixed with the momentum before the
        norm match (#20's and #30's ``attn.v``: ``V_SOAP_BLEND`` 0.95, from PR #283); 1:
        none.
      norm_match: ``"gram"`` or ``"frobenius"`` (above).
      trust_gate: which leaves are gated: ``None``/``False`` (none), ``True`` (all), a
        callable of the leaf's path string (``"blocks/0/attn/c_proj/kernel"``) returning
        a bool, or a tree of bools with the params' structure.
      trust_min_agree: ``a`` above (record: 0.2).
      trust_min_grad_align: ``c`` above (record: 0).
      trust_power: exponent of the gate (record: 1).
      trust_floor: lower bound of the gate, float or schedule; ``None``: the record's
        `trust_gate_floor` (0.45, fading to 0 over updates 1375 to 1625).
      trust_cap: upper bound, float or schedule; ``None``: the record's
        `trust_gate_cap` (0.85 until update 1625, then 1).

    Returns:
      A `MatrixPrecondition` for `scale_by_muon(precondition=...)`, whose per-matrix
      state is a `SoapMatrixState`; the update count is `MuonState`'s.

    Raises:
      ValueError: for ``beta``/``beta2`` outside [0, 1), a non-positive
        ``precondition_frequency``, ``eps`` or ``trust_power``, a negative
        ``denom_power`` or ``denom_floor``, ``blend`` outside (0, 1],
        ``trust_min_agree`` outside [0, 1), an unknown ``norm_match``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_muon, soap_whitening
      >>> params = {"w": jnp.ones((8, 4))}
      >>> tx = scale_by_muon(precondition=soap_whitening(),
      ...                    ns_normalization="gram_frobenius")
      >>> state = tx.init(params)
      >>> state.precondition.leaves["w"].gram_out.shape  # L over the fan_out axis (4)
      (4, 4)
      >>> updates, state = tx.update({"w": jnp.eye(8, 4)}, state, params)

    References:
      Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
      <https://arxiv.org/abs/2409.11321>`_, 2024

      Jordan et al., `modded-nanogpt Track 3 records #14 (SOAP on MLP), #16 (trust gate),
      #44 (all hidden matrices, every-step basis), #46
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    settings = _matrix_whitening(beta, beta2, precondition_frequency, denom_power, eps,
                                 denom_floor, blend, norm_match, trust_min_agree,
                                 trust_min_grad_align, trust_power, trust_floor, trust_cap)
    return MatrixPrecondition(_init_matrices, functools.partial(_whiten_matrices, **settings),
                              functools.partial(_gated_leaves, trust_gate),
                              functools.partial(_whiten_stacks, **settings))


def _gated_leaves(trust_gate: TrustGateLeaves, paths: list[str], treedef: Any) -> list[bool]:
    """Per leaf, whether the trust gate applies (``trust_gate`` as documented)."""
    if trust_gate is None or isinstance(trust_gate, bool):
        return [bool(trust_gate)] * len(paths)
    if callable(trust_gate):
        return [bool(trust_gate(p)) for p in paths]
    return [bool(b) for b in treedef.flatten_up_to(trust_gate)]


def _init_matrices(batch: int, out: int, inn: int, dtype: Any) -> SoapMatrixState:
    """Zero statistics, identity bases, of ``batch`` matrices ``(out, in)``."""
    dt = jnp.promote_types(dtype, jnp.float32)
    eye = lambda n: jnp.broadcast_to(jnp.eye(n, dtype=dt), (batch, n, n))
    return SoapMatrixState(jnp.zeros((batch, out, out), dt), jnp.zeros((batch, inn, inn), dt),
                           eye(out), eye(inn), jnp.zeros((batch, out, inn), dt))


def _trust_blend(M: jax.Array, D: jax.Array, G: jax.Array, bounds: tuple[Any, Any],
                 trust: tuple[float, float, float],
                 norm: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Record #16's trust gate: ``M + gate (D - M)``, rescaled to ``M``'s norm."""
    min_agree, min_align, power = trust
    agree = jnp.clip((_cosine(D, M) - min_agree) / (1 - min_agree), 0.0, 1.0)
    denom = jnp.maximum(_cosine(M, G) - min_align, 1e-8)
    align = jnp.clip((_cosine(D, G) - min_align) / denom, 0.0, 1.0)
    gate = jnp.clip(agree * align, 0.0, 1.0)
    if power != 1.0:
        gate = gate ** power
    gate = jnp.clip(gate, bounds[0], bounds[1])
    blended = M + gate * (D - M)
    return blended * (norm(M) / norm(blended))


def soap_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float | optax.Schedule = 0.95,
    soap_beta: float | optax.Schedule = 0.9,
    precondition_frequency: int = 1,
    denom_power: float = 0.5,
    eps: float = 1e-8,
    norm_match: str = "gram",
    trust_gate: TrustGateLeaves = None,
    trust_floor: float | optax.Schedule | None = None,
    trust_cap: float | optax.Schedule | None = None,
    coefficients: Coefficients = "track3",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    mu_dtype: jax.typing.DTypeLike | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> optax.GradientTransformation:
    r"""SOAP-Muon on matrices and matrix stacks (modded-nanogpt Track 3 #44's Muon part).

    ``chain(scale_by_muon(beta, precondition=soap_whitening(...),
    ns_normalization="gram_frobenius", coefficients=coefficients, ...),
    scale_by_learning_rate(learning_rate))``: the Nesterov momentum whitened in the
    eigenbasis of the gradient's two Gram EMAs, rescaled to its Gram norm, then
    orthogonalised by Newton-Schulz (the record's ``(2, -1.5, 0.5)`` twelve times on the
    Gram-Frobenius-normalised input) and scaled by the matrix shape. Every leaf is a
    matrix or a stack: send 0-D/1-D leaves, embeddings and the head elsewhere with
    ``optax.partition``.

    Args:
      learning_rate: float or schedule (record #44: 0.0375 on PowerCool).
      beta: Muon's momentum or a schedule (record: 0.85 -> 0.95 warm-up and cool-down).
      soap_beta: decay of the Gram EMAs and ``V`` (record: 0.9).
      precondition_frequency: basis refresh period (record: 1).
      denom_power: ``p`` in ``V^p`` (record: 0.5).
      eps: ``V`` floor ``eps²`` (record: 1e-8).
      norm_match: ``"gram"`` (record) or ``"frobenius"``.
      trust_gate: leaves to trust-gate (record: the attention output projections), see
        `soap_whitening`.
      trust_floor: the gate's lower bound (default: the record's `trust_gate_floor`).
      trust_cap: the gate's upper bound (default: the record's `trust_gate_cap`).
      coefficients: Newton-Schulz triples or a preset name (see `orthogonalize`).
      ns_dtype: dtype of the Newton-Schulz iteration (record: bfloat16).
      matrix_axes: ``(fan_in, fan_out)`` axes of every leaf.
      shape_scale: as in `scale_by_muon` (record: ``"modded"``).
      mu_dtype: dtype of Muon's momentum buffer (``None``: float32, float64 for float64
        params; see `scale_by_muon`).
      shard_newton_schulz: as in `scale_by_muon`.
      newton_schulz_plan: as in `scale_by_muon`.
      mesh: as in `scale_by_muon`.

    Returns:
      An ``optax.GradientTransformation``: a chain whose first state is a `MuonState`
      with the whitening's `OwnedPreconditionState` in its ``precondition`` field.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import soap_muon
      >>> params = {"blocks": {"attn_proj": jnp.ones((8, 8)), "fc": jnp.ones((8, 32))}}
      >>> tx = soap_muon(0.0375, trust_gate=lambda path: path.endswith("attn_proj"))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)

    References:
      Jordan et al., `modded-nanogpt Track 3 records #14, #16, #44, #46
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026

      Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
      <https://arxiv.org/abs/2409.11321>`_, 2024
    """
    check_non_negative("learning_rate", learning_rate)
    whitening = soap_whitening(
        soap_beta, precondition_frequency=precondition_frequency, denom_power=denom_power,
        eps=eps, norm_match=norm_match, trust_gate=trust_gate, trust_floor=trust_floor,
        trust_cap=trust_cap)
    return optax.chain(
        scale_by_muon(beta, precondition=whitening, ns_normalization="gram_frobenius",
                      coefficients=coefficients, ns_dtype=ns_dtype, matrix_axes=matrix_axes,
                      shape_scale=shape_scale, mu_dtype=mu_dtype,
                      shard_newton_schulz=shard_newton_schulz,
                      newton_schulz_plan=newton_schulz_plan, mesh=mesh),
        optax.scale_by_learning_rate(learning_rate))
