"""Rounding of the new parameter value to a low-precision dtype (e.g. bf16 master weights).

`stochastic_rounding` (unbiased; Gupta et al. 2015, https://arxiv.org/abs/1502.02551) and
`dithered_rounding` (the SkewAdam paper's approximation of it; Malik 2026,
https://arxiv.org/abs/2607.19058) are `GradientTransformation`s placed LAST in a chain;
`by_name("stochastic" | "dithered")` builds either. Given the incoming update `u` and the
params `p`, they compute the new value `x = p + u` in float32, round it to `r` in the
target dtype, and emit `u' = r - p` in the parameter dtype, so that
`optax.apply_updates(p, u')` -- which computes `(p + u').astype(p.dtype)` in the param
dtype -- returns `r`.

Exactness: `r - p` is a difference of two values of the param dtype. By Sterbenz's lemma
it is exactly representable in that dtype whenever `r/2 <= p <= 2r` (same sign: the step
at most doubles or halves the parameter), and trivially when `p` or `r` is zero; then
`p + u' = r` exactly, in any rounding mode. That covers the small steps rounding is for.
A step that moves a parameter further (a weight much smaller than its update, or a sign
change) carries `r - p` rounded to the param dtype, and `apply_updates` rounds
`p + u'` once more: the result is within about `2^-8·(|r - p| + |r|)` of `r` for bf16 (an
error relative to the step, like rounding the update itself), not necessarily `r`. Exact
`r` there would need updates wider than the param dtype, which optax's convention (updates
in the param dtype) rules out.

Overflow: a finite value never rounds to inf. A value beyond the largest finite value of
the target dtype (possible from float32 to bf16 or float16) becomes that largest value,
with its sign; inf and nan map to themselves.

Random draws: update number `t` (from 0) uses
`keys = jax.random.split(jax.random.fold_in(key, t), n)` for the `n` leaves of the updates
(in `jax.tree.leaves` order) and `jax.random.uniform(keys[i], shape, jnp.float32)` for
leaf `i`, so a run is reproducible from its key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src.utils import check_float_dtype


class RoundingState(NamedTuple):
    """State of the rounding transforms: the update count and the raw (uint32) key data."""
    count: jax.Array
    key: jax.Array


def round_stochastic(x: jax.Array, uniform: jax.Array, dtype: Any) -> jax.Array:
    """Unbiased stochastic rounding of `x` to `dtype` with given uniform draws.

    `x` lies between two neighbouring values `lo <= x <= hi` of `dtype`; the result is `hi`
    with probability `(x - lo)/(hi - lo)`, else `lo`, so its mean is `x`. (The draw picks
    the neighbour farther from `x` when `uniform` is below the probability of that one.)
    Values of `dtype` map to themselves; inf and nan map to themselves; a finite `x`
    beyond the largest finite value of `dtype` becomes that value (never inf).

    Args:
      x: values in a dtype at least as precise as `dtype` (e.g. float32).
      uniform: draws from U[0, 1), same shape as `x`.
      dtype: the target floating dtype.

    Returns:
      `x` rounded to `dtype`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.rounding import round_stochastic
      >>> x = jnp.float32(1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16
      >>> float(round_stochastic(x, jnp.float32(0.2), jnp.bfloat16))
      1.0078125
      >>> float(round_stochastic(x, jnp.float32(0.3), jnp.bfloat16))
      1.0

    References:
      S. Gupta, A. Agrawal, K. Gopalakrishnan, P. Narayanan, `Deep Learning with Limited
      Numerical Precision <https://arxiv.org/abs/1502.02551>`_, 2015.

      M. Croci et al., `Stochastic rounding: implementation, error analysis and applications
      <https://doi.org/10.1098/rsos.211631>`_, 2022.
    """
    nearest = x.astype(dtype)
    if x.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
        other, prob = _bf16_other_and_prob(x, nearest)
        finite = jnp.isfinite(nearest) & jnp.isfinite(other)
        r = jnp.where((uniform < prob) & finite, other, nearest)
        # Beyond bf16's largest finite value one neighbour is inf: keep the finite one.
        return jnp.where(jnp.isfinite(x) & ~jnp.isfinite(r), other, r)
    nearest_x = nearest.astype(x.dtype)
    toward = jnp.where(x > nearest_x, jnp.inf, -jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    prob = jnp.abs(x - nearest_x) / jnp.abs(other.astype(x.dtype) - nearest_x)
    r = jnp.where(uniform < prob, other, nearest)
    # Beyond the largest finite value `nearest` is inf and `other` that largest value.
    return jnp.where(jnp.isfinite(x) & ~jnp.isfinite(r), other, r)


def _bf16_other_and_prob(x: jax.Array, nearest: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 -> bfloat16: the other neighbour of `x` and `|x - nearest| / spacing`, from
    the bits. A bf16 value is a float32 with its low 16 bits zero, so those bits are the
    position of `x` between its two neighbours; arithmetic would lose it wherever
    `x - nearest` is a float32 subnormal (|x| < ~2^-118), which XLA:CPU flushes to zero."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # Position from the neighbour toward zero, in units of the spacing (exact).
    frac = (bits & jnp.uint32(0xFFFF)).astype(jnp.float32) * 2.0**-16
    toward_zero = bits & jnp.uint32(0xFFFF0000)
    near_bits = jax.lax.bitcast_convert_type(nearest.astype(jnp.float32), jnp.uint32)
    away = near_bits != toward_zero              # nearest is the neighbour away from zero
    other_bits = jnp.where(away, toward_zero, toward_zero + jnp.uint32(0x10000))
    other = jax.lax.bitcast_convert_type(
        (other_bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return other, jnp.where(away, 1.0 - frac, frac)


def round_dithered(x: jax.Array, uniform: jax.Array, dtype: Any) -> jax.Array:
    """SkewAdam's dithered rounding: `x + (U - 0.5)·|x|·eps`, then round to nearest.

    `eps = jnp.finfo(dtype).eps` is the spacing of `dtype` at 1 (2^-7 for bfloat16, the
    paper's constant). `|x|·eps` is one to two times the true spacing at `x`, so this only
    approximates unbiased stochastic rounding. A finite `x` never becomes inf: the
    dithered value saturates at the largest finite value of `dtype`; inf and nan map to
    themselves.

    Args:
      x: values (float32).
      uniform: draws from U[0, 1), same shape as `x`.
      dtype: the target floating dtype.

    Returns:
      The dithered `x` rounded to nearest in `dtype`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.rounding import round_dithered
      >>> float(round_dithered(jnp.float32(1.0), jnp.float32(0.5), jnp.bfloat16))
      1.0

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    info = jnp.finfo(dtype)
    dithered = x + (uniform - 0.5) * jnp.abs(x) * info.eps.astype(x.dtype)
    r = dithered.astype(dtype)
    big = jnp.asarray(info.max, dtype)
    # The dither can push a value near the largest finite one past it: saturate instead;
    # inf (whose dither would be inf - inf) and nan are kept as they are.
    r = jnp.where(jnp.isfinite(r), r, jnp.where(x > 0, big, -big))
    return jnp.where(jnp.isfinite(x), r, x.astype(dtype))


def _rounding_transform(round_fn: Callable[[jax.Array, jax.Array, Any], jax.Array],
                        key: int | jax.Array, dtype: Any, name: str
                        ) -> optax.GradientTransformation:
    check_float_dtype(f"{name}: dtype", dtype, allow_none=True)
    if dtype is not None:
        dtype = np.dtype(dtype)
    if isinstance(key, int | np.integer):
        key = jax.random.key(int(key))
    if not isinstance(key, jax.Array | np.ndarray):
        raise TypeError(f"{name}: key must be an int seed or a PRNG key, got {type(key)}")
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key_data = jnp.asarray(key, jnp.uint32)

    def init_fn(params):
        del params
        return RoundingState(count=jnp.zeros([], jnp.int32), key=jnp.array(key_data))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(f"{name} needs `params` in update()")
        leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.count)
        keys = jax.random.split(step_key, len(leaves))
        out = []
        for i, (u, p) in enumerate(zip(leaves, p_leaves, strict=True)):
            target = dtype if dtype is not None else p.dtype
            if not jnp.issubdtype(p.dtype, jnp.floating) or jnp.finfo(target).bits >= 32:
                out.append(u.astype(p.dtype))
                continue
            wide = jnp.promote_types(jnp.float32, jnp.promote_types(p.dtype, u.dtype))
            x = p.astype(wide) + u.astype(wide)
            uniform = jax.random.uniform(keys[i], x.shape, jnp.float32).astype(wide)
            r = round_fn(x, uniform, target)
            out.append((r.astype(wide) - p.astype(wide)).astype(p.dtype))
        return (jax.tree.unflatten(treedef, out),
                RoundingState(count=optax.safe_increment(state.count), key=state.key))

    return optax.GradientTransformation(init_fn, update_fn)


def stochastic_rounding(key: int | jax.Array = 0, dtype: Any = None
                        ) -> optax.GradientTransformation:
    """Unbiased stochastic rounding of the new parameter value (place LAST in a chain).

    The new value `x = p + u` (float32) is rounded to one of its two neighbouring values in
    the target dtype with probability proportional to proximity; the emitted update is
    `r - p` in the param dtype, so `optax.apply_updates` yields `r` (exactly whenever the
    step at most doubles or halves the parameter; see the module docstring). Use it after
    any optimizer on low-precision params, e.g.
    `optax.chain(optax.adamw(1e-3), stochastic_rounding())` on bf16 params.

    Args:
      key: an int seed or a PRNG key (typed, or raw uint32 key data).
      dtype: the target dtype; `None` means each parameter's own dtype. Leaves whose target
        has 32 or more bits (e.g. float32 params with `dtype=None`) are passed through, cast
        to the param dtype. With `dtype=jnp.bfloat16` float32 params are kept on the bf16
        grid (bf16 values stored in float32).

    Returns:
      An `optax.GradientTransformation` with state `RoundingState`; it needs `params`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo.rounding import stochastic_rounding
      >>> params = {"w": jnp.ones((4,), jnp.bfloat16)}
      >>> tx = optax.chain(optax.sgd(1e-3), stochastic_rounding(key=0))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones((4,), jnp.bfloat16)}
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)  # each 1.0 or 0.99609375

    References:
      S. Gupta, A. Agrawal, K. Gopalakrishnan, P. Narayanan, `Deep Learning with Limited
      Numerical Precision <https://arxiv.org/abs/1502.02551>`_, 2015.
    """
    return _rounding_transform(round_stochastic, key, dtype, "stochastic_rounding")


def dithered_rounding(key: int | jax.Array = 0, dtype: Any = None
                      ) -> optax.GradientTransformation:
    """SkewAdam's dithered rounding of the new parameter value (place LAST in a chain).

    `x = p + u` (float32) becomes `round_nearest(x + (U[0,1) - 0.5)·|x|·2^-7)` for bfloat16
    (`2^-7` is `jnp.finfo(dtype).eps`); the emitted update is `r - p` in the param dtype, so
    `optax.apply_updates` yields `r` (see the module docstring for when this is exact).

    Args:
      key: an int seed or a PRNG key (typed, or raw uint32 key data).
      dtype: the target dtype; `None` means each parameter's own dtype (float32 params are
        then passed through unchanged).

    Returns:
      An `optax.GradientTransformation` with state `RoundingState`; it needs `params`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo.rounding import dithered_rounding
      >>> tx = optax.chain(optax.adamw(1e-3), dithered_rounding(key=1))

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    return _rounding_transform(round_dithered, key, dtype, "dithered_rounding")


_BY_NAME: dict[str, Callable[..., optax.GradientTransformation]] = {
    "dithered": dithered_rounding,
    "stochastic": stochastic_rounding,
}


def by_name(name: str, key: int | jax.Array = 0, dtype: Any = None
            ) -> optax.GradientTransformation:
    """The rounding transform called `name`: `"stochastic"` or `"dithered"`.

    The one table from names to transforms, for configs and command lines (and
    `optax_snoo.skew_adam(rounding=name)`).

    Args:
      name: `"stochastic"` (`stochastic_rounding`) or `"dithered"` (`dithered_rounding`).
      key: an int seed or a PRNG key, as for those transforms.
      dtype: the target dtype, as for those transforms (`None`: each param's own).

    Returns:
      The rounding `optax.GradientTransformation`.

    Raises:
      ValueError: an unknown name (the message lists the known ones).

    Example:
      >>> import optax
      >>> from optax_snoo.rounding import by_name
      >>> tx = optax.chain(optax.adamw(1e-3), by_name("stochastic", key=3))
      >>> by_name("nearest")
      Traceback (most recent call last):
      ...
      ValueError: unknown rounding 'nearest'; expected one of ['dithered', 'stochastic']

    References:
      S. Gupta, A. Agrawal, K. Gopalakrishnan, P. Narayanan, `Deep Learning with Limited
      Numerical Precision <https://arxiv.org/abs/1502.02551>`_, 2015.

      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(f"unknown rounding {name!r}; expected one of {sorted(_BY_NAME)}")
    return _BY_NAME[name](key=key, dtype=dtype)
