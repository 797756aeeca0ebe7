"""Optimizer-state accounting, on real states or on `jax.eval_shape` trees.

`state_bytes` and `state_bytes_by_group` measure a state (arrays or
`jax.ShapeDtypeStruct`s: nothing is allocated); `skew_adam_state_bytes_by_role`,
`adamw_state_bytes` and `muon_state_bytes` are the closed-form predictions of the SkewAdam
paper's memory table (N. Malik, "Where Should Optimizer State Live? Tiered State
Allocation for Memory-Efficient Mixture-of-Experts Training",
https://arxiv.org/abs/2607.19058, 2026), from parameter shapes alone.

Example, the state of a model too large to allocate::

    shapes = jax.eval_shape(model_init)            # ShapeDtypeStructs
    state = jax.eval_shape(skew_adam().init, shapes)
    state_bytes(state, statistics_only=True) == skew_adam_state_bytes(shapes)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.skew_adam import (
    RolePolicy,
    RolesArg,
    is_factored,
    resolve_policies,
    role_labeller,
)


def _leaf_bytes(leaf: Any, statistics_only: bool) -> int:
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    if dtype is None or shape is None:
        return 0
    # jnp.issubdtype: numpy's own does not count bfloat16 or float8 as floating.
    if statistics_only and not jnp.issubdtype(dtype, jnp.inexact):
        return 0
    return math.prod(shape) * dtype.itemsize


def state_bytes(state: Any, *, statistics_only: bool = False) -> int:
    """Bytes held by the array leaves of an optimizer state.

    Works on real states and on `jax.eval_shape` trees of `jax.ShapeDtypeStruct`.
    `optax.MaskedNode`, `None` and empty states hold no leaves and count 0; typed PRNG keys
    count their key data (8 bytes for threefry); non-array leaves count 0.

    Args:
      state: any pytree (an optax state, an `nnx.Optimizer`'s `opt_state`, ...).
      statistics_only: count only floating-point leaves (the statistics), leaving out step
        counters, PRNG keys and other integer leaves. Note that `optax.inject_hyperparams`
        stores its hyperparameters as floating-point scalars.

    Returns:
      The number of bytes.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo.memory import state_bytes
      >>> params = {"w": jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}
      >>> state_bytes(jax.eval_shape(optax.adam(1e-3).init, params))  # 8N + a count
      8000004

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    return sum(_leaf_bytes(x, statistics_only) for x in jax.tree.leaves(state))


def state_bytes_by_group(state: Any, *, statistics_only: bool = False) -> dict[str, int]:
    """Bytes per group of the `optax.partition` states inside `state`.

    Every `optax.PartitionState` found in `state` (through chains, `inject_hyperparams`,
    `MultiSteps`, ...) contributes its groups; groups of the same name are summed. For a
    `skew_adam` state the groups are the roles.

    Args:
      state: a pytree holding at least one `optax.PartitionState`.
      statistics_only: as in `state_bytes`.

    Returns:
      A dict from group name to bytes.

    Raises:
      ValueError: if `state` holds no `optax.PartitionState`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from optax_snoo.memory import state_bytes_by_group
      >>> from optax_snoo import skew_adam
      >>> params = {"w": jnp.zeros((4, 8)), "experts": jnp.zeros((2, 4, 8))}
      >>> state = skew_adam().init(params)
      >>> state_bytes_by_group(state, statistics_only=True)
      {'backbone': 176, 'experts': 96, 'router': 0}

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    is_partition = lambda x: isinstance(x, optax.PartitionState)
    partitions = [x for x in jax.tree.leaves(state, is_leaf=is_partition) if is_partition(x)]
    if not partitions:
        raise ValueError("state_bytes_by_group: the state holds no optax.PartitionState")
    out: dict[str, int] = {}
    for part in partitions:
        for group, inner in part.inner_states.items():
            out[group] = out.get(group, 0) + state_bytes(inner, statistics_only=statistics_only)
    return out


def _policy_bytes(shape: tuple[int, ...], policy: RolePolicy) -> int:
    itemsize = np.dtype(policy.stats_dtype).itemsize
    numel = math.prod(shape)
    total = itemsize * numel if policy.momentum else 0
    if is_factored(shape, policy.factored):
        total += itemsize * math.prod(shape[:-2]) * (shape[-2] + shape[-1])
    else:
        total += itemsize * numel
    return total


def skew_adam_state_bytes_by_role(params: Any, roles: RolesArg = None,
                                  policies: str | Mapping[str, RolePolicy] | None = None
                                  ) -> dict[str, int]:
    """SkewAdam's optimizer-state bytes per role, from parameter shapes.

    Per parameter: `4·numel` for the momentum (roles with momentum), plus `4·(R + C)` per
    matrix for a factored second moment (times the leading batch size, e.g. E for an
    `(E, R, C)` expert stack) or `4·numel` for a full one (4 = the itemsize of the
    policy's `stats_dtype`). Step counters are not counted.

    Args:
      params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
      roles: as in `optax_snoo.skew_adam`.
      policies: as in `optax_snoo.skew_adam`.

    Returns:
      A dict from every role with a policy to its bytes (0 for roles with no parameter).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.memory import skew_adam_state_bytes_by_role
      >>> params = {"w": jnp.zeros((4, 8)), "experts": jnp.zeros((2, 4, 8))}
      >>> skew_adam_state_bytes_by_role(params)  # w: 4·32 + 4·12; experts: 4·2·12
      {'backbone': 176, 'experts': 96, 'router': 0}

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    table = resolve_policies(policies, roles)
    labels = role_labeller(roles, table)(params)
    out = dict.fromkeys(table, 0)
    for role, p in zip(jax.tree.leaves(labels), jax.tree.leaves(params), strict=True):
        out[role] += _policy_bytes(tuple(p.shape), table[role])
    return out


def skew_adam_state_bytes(params: Any, roles: RolesArg = None,
                          policies: str | Mapping[str, RolePolicy] | None = None) -> int:
    """Total of `skew_adam_state_bytes_by_role`.

    Args:
      params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
      roles: as in `optax_snoo.skew_adam`.
      policies: as in `optax_snoo.skew_adam`.

    Returns:
      The predicted bytes of SkewAdam's statistics.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.memory import skew_adam_state_bytes
      >>> skew_adam_state_bytes({"experts": jnp.zeros((2, 4, 8))})
      96

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    return sum(skew_adam_state_bytes_by_role(params, roles, policies).values())


def _num_params(params: Any) -> int:
    return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def adamw_state_bytes(params: Any) -> int:
    """AdamW's state: two float32 moments, 8 bytes per parameter (counters not counted).

    Args:
      params: a pytree of arrays or `jax.ShapeDtypeStruct`s.

    Returns:
      `8·N` for N parameters.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.memory import adamw_state_bytes
      >>> adamw_state_bytes({"w": jnp.zeros((4, 8))})
      256

    References:
      I. Loshchilov, F. Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    return 8 * _num_params(params)


def muon_state_bytes(params: Any) -> int:
    """Muon's (and Lion's) state: one float32 momentum, 4 bytes per parameter.

    Args:
      params: a pytree of arrays or `jax.ShapeDtypeStruct`s.

    Returns:
      `4·N` for N parameters.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.memory import muon_state_bytes
      >>> muon_state_bytes({"w": jnp.zeros((4, 8))})
      128

    References:
      K. Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """
    return 4 * _num_params(params)


def soap_muon_state_bytes(params: Any, matrix_axes: tuple[int, int] = (-2, -1)) -> int:
    """SOAP-Muon's state (`optax_snoo.soap_muon`), from parameter shapes, float32.

    Per matrix of ``fan_in x fan_out`` (each matrix of a stack alike): Muon's momentum
    and SOAP's ``V`` (``4·2·fan_in·fan_out``), the Gram EMAs ``L`` (``fan_out²``) and
    ``R`` (``fan_in²``) and their eigenbases ``Q_L``, ``Q_R`` (as large again):
    ``4·(2·in·out + 2·(out² + in²))`` bytes. Counters are not counted. For the record's
    768 x 3072 MLP matrix that is 10.5x Muon's momentum.

    Args:
      params: a pytree of matrices and matrix stacks (arrays or `jax.ShapeDtypeStruct`s).
      matrix_axes: the ``(fan_in, fan_out)`` axes, as given to `soap_muon`.

    Returns:
      The predicted bytes of the statistics.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.memory import soap_muon_state_bytes
      >>> soap_muon_state_bytes({"w": jnp.zeros((4, 8))})  # 4·(2·32 + 2·(64 + 16))
      896

    References:
      Jordan et al., `modded-nanogpt Track 3 records #44, #46
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026.
    """
    total = 0
    for p in jax.tree.leaves(params):
        shape = tuple(p.shape)
        fan_in, fan_out = (shape[a] for a in matrix_axes)
        batch = math.prod(shape) // (fan_in * fan_out)
        total += 4 * batch * (2 * fan_in * fan_out + 2 * (fan_out ** 2 + fan_in ** 2))
    return total
