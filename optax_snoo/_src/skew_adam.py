"""SkewAdam: optimizer state allocated per parameter role.

After N. Malik, "Where Should Optimizer State Live? Tiered State Allocation for
Memory-Efficient Mixture-of-Experts Training", https://arxiv.org/abs/2607.19058, 2026.

Parameters of a Mixture-of-Experts model get a role from their path (by default: a path
containing `"experts"` -> experts, containing `"router"` -> router, everything else ->
backbone; `skew_adam_roles(params)` shows the roles), and each role gets its own policy:
whether it keeps a first moment, whether its second moment is factored Adafactor-style
over the last two axes, and whether it is weight-decayed. The defaults keep momentum only
for the small dense backbone, so the state of a 95%-experts model is a few percent of
AdamW's.

The pieces are public on their own:

- `scale_by_second_moment`: a β2-EMA of g² (factored over the last two axes as in
  Adafactor, leading axes batch, or full), bias-corrected in the numerator:
  `g·sqrt(1-β2^t)/den`.
- `scale_by_skew_adam`: the same denominator with an fp32 first moment:
  `m·sqrt(1-β2^t)/(1-β1^t)/den` (without momentum it is `scale_by_second_moment`).
- `skew_adam`: `optax.partition` over roles of `scale_by_skew_adam` (with its per-tensor
  RMS clipping, i.e. `optax.clip_by_block_rms` fused in) ->
  `optax_snoo.add_decoupled_weight_decay` (`wd·p` in float32) ->
  `optax.scale_by_learning_rate`, followed by a cast to the parameter dtype or by a
  rounding transform (`optax_snoo.rounding`).
"""
# No parameter-sized temporaries, for speed: docs/design.md, "Implementation notes".

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_snoo._src import rounding as rounding_lib
from optax_snoo._src.labels import describe, label_by_rules
from optax_snoo._src.utils import check_non_negative, check_positive, check_unit_interval
from optax_snoo._src.weight_decay import add_decoupled_weight_decay

BACKBONE = "backbone"
EXPERTS = "experts"
ROUTER = "router"

#: Ordered `(pattern, role)` rules: a plain string matches as a substring of the parameter
#: path, a compiled `re.Pattern` with `search`; the first match wins, else "backbone".
DEFAULT_ROLE_RULES: tuple[tuple[str | re.Pattern, str], ...] = (
    ("experts", EXPERTS),
    ("router", ROUTER),
)

RoleRules = Sequence[tuple[str | re.Pattern, str]]
RolesArg = RoleRules | Callable[[Any], Any] | None


@dataclasses.dataclass(frozen=True)
class RolePolicy:
    """What optimizer state one role keeps.

    Attributes:
      momentum: keep a first moment `m` (one value per parameter).
      factored: factor the second moment over the last two axes (only for ndim >= 2;
        1-D and scalar parameters always get a full second moment).
      weight_decay: apply the decoupled weight decay to this role.
      stats_dtype: dtype of the statistics and of the update arithmetic (float32).
    """

    momentum: bool = True
    factored: bool = True
    weight_decay: bool = True
    stats_dtype: Any = jnp.float32


#: The paper's table (Malik 2026): momentum only for the dense backbone; the router's
#: second moment full and not weight-decayed.
DEFAULT_POLICIES: dict[str, RolePolicy] = {
    BACKBONE: RolePolicy(momentum=True, factored=True, weight_decay=True),
    EXPERTS: RolePolicy(momentum=False, factored=True, weight_decay=True),
    ROUTER: RolePolicy(momentum=False, factored=False, weight_decay=False),
}

#: The paper's ablations, one name each. "uniform" turns momentum and the factored second
#: moment on for every role and leaves the weight-decay flags as in the default table.
POLICY_PRESETS: dict[str, dict[str, RolePolicy]] = {
    "skew_adam": DEFAULT_POLICIES,
    "expert_momentum": {**DEFAULT_POLICIES,
                        EXPERTS: RolePolicy(momentum=True, factored=True, weight_decay=True)},
    "factored_router": {**DEFAULT_POLICIES,
                        ROUTER: RolePolicy(momentum=False, factored=True, weight_decay=False)},
    "uniform": {role: dataclasses.replace(p, momentum=True, factored=True)
                for role, p in DEFAULT_POLICIES.items()},
}


# ----------------------------------------------------------------------------- roles

def assign_roles(params: Any, rules: RoleRules = DEFAULT_ROLE_RULES,
                 default_role: str = BACKBONE) -> Any:
    """Labels every leaf of `params` with a role from its path.

    This is `optax_snoo.labels.label_by_rules` with each plain-string pattern escaped
    (`re.escape`), so that it matches as a substring.

    Args:
      params: a pytree of arrays (or `jax.ShapeDtypeStruct`s; only paths are used).
      rules: ordered `(pattern, role)` pairs; a `str` pattern matches as a substring of the
        path written by `optax_snoo.labels.path_to_str` (`"moe/experts/w_fc"`), an
        `re.Pattern` with `search`. The first matching rule wins.
      default_role: the role of leaves that match no rule.

    Returns:
      A tree with the structure of `params` whose leaves are role names.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import assign_roles
      >>> assign_roles({"moe": {"experts": jnp.zeros((2, 3, 4)), "router": jnp.zeros((4, 2))},
      ...               "wte": jnp.zeros((8, 4))})
      {'moe': {'experts': 'experts', 'router': 'router'}, 'wte': 'backbone'}

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    regex_rules = [(re.escape(pattern) if isinstance(pattern, str) else pattern, role)
                   for pattern, role in _checked_rules(rules)]
    return label_by_rules(regex_rules, default=default_role)(params)


def skew_adam_roles(params: Any, roles: RolesArg = None) -> dict[str, str]:
    """The SkewAdam role of every parameter path, as `skew_adam(roles=roles)` decides it.

    Roles come from path names, so a model that names its layers differently (say
    `"moe_ffn"` for its experts) silently gets backbone policies; print this once.
    This is `optax_snoo.labels.describe` of the role labelling.

    Args:
      params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
      roles: the `roles` argument of `skew_adam` (`None`, rules, or a callable).

    Returns:
      A dict from each leaf's path string (`optax_snoo.labels.path_to_str`) to its role,
      in `jax.tree.leaves` order.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import skew_adam_roles
      >>> params = {"moe": {"experts": {"w_fc": jnp.zeros((2, 3, 4))},
      ...                   "router": {"kernel": jnp.zeros((4, 2))}},
      ...           "wte": jnp.zeros((8, 4))}
      >>> skew_adam_roles(params)
      {'moe/experts/w_fc': 'experts', 'moe/router/kernel': 'router', 'wte': 'backbone'}
      >>> skew_adam_roles(params, roles=[("moe", "experts")])
      {'moe/experts/w_fc': 'experts', 'moe/router/kernel': 'experts', 'wte': 'backbone'}

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    return describe(role_labeller(roles), params)


def resolve_policies(policies: str | Mapping[str, RolePolicy] | None = None,
                     roles: RolesArg = None) -> dict[str, RolePolicy]:
    """The full role -> `RolePolicy` table used by `skew_adam`.

    Args:
      policies: `None` (`DEFAULT_POLICIES`), a preset name from `POLICY_PRESETS`
        ("skew_adam", "expert_momentum", "factored_router", "uniform"), or a mapping of role
        names to policies that overrides the default table entry by entry.
      roles: the `roles` argument of `skew_adam`; with a rule list, the roles it names may
        (and must) be given policies too. A callable may return any role with a policy.

    Returns:
      A dict from every role name to its policy.

    Raises:
      ValueError: unknown preset, a policy for a role no rule can produce, a rule whose role
        has no policy, or a value that is not a `RolePolicy`.
    """
    if policies is None:
        policies = {}
    elif isinstance(policies, str):
        if policies not in POLICY_PRESETS:
            raise ValueError(f"unknown policies preset {policies!r}; expected one of "
                             f"{sorted(POLICY_PRESETS)} or a mapping of role -> RolePolicy")
        policies = POLICY_PRESETS[policies]
    elif not isinstance(policies, Mapping):
        raise TypeError(f"policies must be None, a preset name or a mapping of role -> "
                        f"RolePolicy, got {type(policies).__name__}")
    for name, p in policies.items():
        if not isinstance(p, RolePolicy):
            raise TypeError(f"policy for role {name!r} must be a RolePolicy, got {p!r}")
    table = {**DEFAULT_POLICIES, **policies}
    if callable(roles):
        return table
    rule_roles = {name for _, name in _checked_rules(roles)}
    unknown = set(table) - set(DEFAULT_POLICIES) - rule_roles
    if unknown:
        raise ValueError(f"policies name unknown role(s) {sorted(unknown)}; roles are "
                         f"{sorted(set(DEFAULT_POLICIES) | rule_roles)} (add a rule to "
                         f"`roles` to define a new role)")
    missing = rule_roles - set(table)
    if missing:
        raise ValueError(f"roles rules name role(s) {sorted(missing)} without a policy; "
                         f"pass policies={{name: RolePolicy(...)}} for them")
    return table


_INJECT_HINT = (
    "With optax.inject_hyperparams, a callable `roles` is taken for a schedule and called "
    "with the step count: declare it static, e.g. optax.inject_hyperparams(skew_adam, "
    "static_args=('roles', 'policies', 'rounding'))")


def _checked_rules(roles: RoleRules | None) -> tuple[tuple[str | re.Pattern, str], ...]:
    if roles is None:
        return DEFAULT_ROLE_RULES
    if isinstance(roles, str | bytes | Mapping | numbers.Number | jax.Array | np.ndarray):
        raise TypeError(f"roles must be None, a sequence of (pattern, role) rules or a "
                        f"callable params -> tree of role names, got "
                        f"{type(roles).__name__} {roles!r:.60}. {_INJECT_HINT}.")
    rules = tuple(roles)
    for rule in rules:
        if (not isinstance(rule, tuple | list) or len(rule) != 2
                or not isinstance(rule[0], str | re.Pattern) or not isinstance(rule[1], str)):
            raise ValueError(f"each roles rule must be (str or re.Pattern, role name), "
                             f"got {rule!r}")
    return rules


def role_labeller(roles: RolesArg = None, table: Mapping[str, RolePolicy] | None = None
                  ) -> Callable[[Any], Any]:
    """The function `params -> tree of role names` that `skew_adam(roles=roles)` uses.

    Args:
      roles: the `roles` argument of `skew_adam`: `None` (`DEFAULT_ROLE_RULES`), rules for
        `assign_roles`, or a callable `params -> tree of role names`.
      table: the role -> policy table (`resolve_policies`); when given, a role without a
        policy is a `ValueError` when the labeller is called.

    Returns:
      The labelling function, for `optax.partition`.
    """
    if callable(roles):
        fn = roles
    else:
        rules = _checked_rules(roles)
        fn = lambda params: assign_roles(params, rules)
    if table is None:
        return fn

    def labels(params):
        tree = fn(params)
        unknown = set(jax.tree.leaves(tree)) - set(table)
        if unknown:
            raise ValueError(f"roles returned unknown role(s) {sorted(map(str, unknown))}; "
                             f"roles with a policy are {sorted(table)}")
        return tree
    return labels


# ----------------------------------------------------------------------------- numerics

def is_factored(shape: Sequence[int], factored: bool = True) -> bool:
    """Whether a parameter of `shape` keeps a factored second moment (row and column
    statistics over its last two axes) when its policy asks for `factored`: ndim >= 2 and
    no zero-size matrix axis (an empty matrix keeps a full, empty moment)."""
    return factored and len(shape) >= 2 and shape[-1] > 0 and shape[-2] > 0


def _init_moment(p: jax.Array, factored: bool, dtype: Any) -> tuple[Any, Any, Any]:
    """`(v_row, v_col, v)` for one parameter; the unused entries are `optax.MaskedNode()`."""
    if is_factored(p.shape, factored):
        # Slices of the param keep its sharding on the axes that survive.
        return (jnp.zeros_like(p[..., 0], dtype=dtype), jnp.zeros_like(p[..., 0, :], dtype=dtype),
                optax.MaskedNode())
    return optax.MaskedNode(), optax.MaskedNode(), jnp.zeros_like(p, dtype=dtype)


def _update_moment(g: jax.Array, v_row: Any, v_col: Any, v: Any, b2: Any, eps: Any
                   ) -> tuple[tuple[jax.Array, ...], Any, Any, Any]:
    """Step 1 of the paper's update for one parameter: `1/den` and the new
    `(v_row, v_col, v)`.

    `1/den` is `(1/row, 1/col)` (vectors; `1/den` is their outer product) when factored,
    else `(1/sqrt(max(v, eps)),)`.
    """
    # Barrier copies of g keep g*g unshared: docs/design.md, "Implementation notes".
    if isinstance(v, optax.MaskedNode):
        g_col = jax.lax.optimization_barrier(g)
        col_sum = jnp.einsum("...rc,...rc->...c", g_col, g_col,
                             precision=jax.lax.Precision.HIGHEST)
        v_row = b2 * v_row + (1 - b2) * jnp.mean(g * g, axis=-1)
        v_col = b2 * v_col + (1 - b2) * (col_sum / g.shape[-2])
        row_mean = jnp.mean(v_row, axis=-1, keepdims=True)
        inv_row = jax.lax.rsqrt(jnp.maximum(v_row / jnp.maximum(row_mean, 1e-15), eps))
        inv_col = jax.lax.rsqrt(jnp.maximum(v_col, eps))
        return (inv_row, inv_col), v_row, v_col, v
    v = b2 * v + (1 - b2) * g * g
    return (jax.lax.rsqrt(jnp.maximum(v, eps)),), v_row, v_col, v


def _clip_scale(x: jax.Array, inv_den: tuple[jax.Array, ...], scale: jax.Array,
                clip_threshold: Any) -> jax.Array:
    """`scale / max(1, RMS(x·scale/den)/clip_threshold)` (update clipping), for `_scaled`.

    The sum reads `optimization_barrier` copies of its inputs, so it shares (and
    materialises) nothing with the update. Factored, it sums over rows first,
    `Σ_j col_j⁻² Σ_i (x_ij / row_i)²`: one broadcast per element instead of two.
    """
    if clip_threshold is None:
        return scale
    x, inv = jax.lax.optimization_barrier((x, inv_den[0]))
    if len(inv_den) == 2:
        col_sq = jnp.sum(jnp.square(x * inv[..., :, None]), axis=-2)
        mean_sq = jnp.sum(col_sq * jnp.square(inv_den[1])) / x.size
    else:
        mean_sq = jnp.mean(jnp.square(x * inv))
    return scale / jnp.maximum(1.0, jnp.sqrt(mean_sq) * scale / clip_threshold)


def _scaled(x: jax.Array, inv_den: tuple[jax.Array, ...], scale: jax.Array) -> jax.Array:
    """`x · scale / den` with `inv_den` from `_update_moment`. Only multiplications touch
    parameter-sized arrays (the scalar goes into the row vector), so XLA fuses this into
    its consumer instead of storing it."""
    if len(inv_den) == 2:
        inv_row, inv_col = inv_den
        return x * (scale * inv_row)[..., :, None] * inv_col[..., None, :]
    return x * (scale * inv_den[0])


def _unzip(updates: Any, out: Any, n: int) -> list[Any]:
    """Splits a tree of n-tuples (one per leaf of `updates`) into n trees."""
    return [jax.tree.map(lambda _, o, i=i: o[i], updates, out) for i in range(n)]


def _one_minus_pow(b: Any, t: jax.Array) -> jax.Array:
    """`1 - b**t` for integer t >= 1, without the cancellation of the direct f32 formula
    (a Python float `b` keeps its float64 logarithm)."""
    t = t.astype(jnp.float32)
    if not isinstance(b, int | float):
        return -jnp.expm1(t * jnp.log(b))
    return -jnp.expm1(t * (math.log(b) if b > 0 else -math.inf))


def _check_not_schedule(name: str, value: Any) -> None:
    if callable(value):
        raise TypeError(f"{name} must be a number, got the callable {value!r} (schedules are "
                        f"supported for learning_rate and weight_decay only)")


def _check_decay(name: str, value: Any) -> None:
    _check_not_schedule(name, value)
    check_unit_interval(name, value)


def _check_eps(eps: Any) -> None:
    _check_not_schedule("eps", eps)
    check_positive("eps (a clamp on the squared quantity)", eps)


def _check_clip(clip_threshold: Any) -> None:
    _check_not_schedule("clip_threshold", clip_threshold)
    check_positive("clip_threshold", clip_threshold, allow_none=True)


def _check_params(params: Any, name: str) -> None:
    if params is None:
        raise ValueError(f"{name} needs `params` in update()")


# ----------------------------------------------------------------------------- transforms

class ScaleBySecondMomentState(NamedTuple):
    """State of `scale_by_second_moment`. `v_row`, `v_col` and `v` mirror params: a
    factored `(..., R, C)` parameter has `v_row` `(..., R)` and `v_col` `(..., C)` (EMAs of
    the mean of g² over the other axis), a full one has `v` shaped like itself; unused
    entries are `optax.MaskedNode()` (no memory)."""
    count: jax.Array
    v_row: Any
    v_col: Any
    v: Any


class ScaleBySkewAdamState(NamedTuple):
    """State of `scale_by_skew_adam` with momentum: `mu` is the first moment (shaped like
    params), `v_row`, `v_col`, `v` the second moment as in `ScaleBySecondMomentState`."""
    count: jax.Array
    mu: Any
    v_row: Any
    v_col: Any
    v: Any


def scale_by_second_moment(b2: float = 0.999, eps: float = 1e-8, *, factored: bool = True,
                           stats_dtype: Any = jnp.float32, clip_threshold: float | None = None
                           ) -> optax.GradientTransformation:
    r"""Scales updates by SkewAdam's second moment, without momentum.

    With `t` the update count from 1 and `g` the update cast to `stats_dtype`:

    - factored (`factored=True` and ndim >= 2; the last two axes are the matrix, leading
      axes are batch, e.g. one factorisation per expert of an `(E, R, C)` stack):
      `r = β2 r + (1-β2) mean(g², -1)`, `c = β2 c + (1-β2) mean(g², -2)`,
      `den = sqrt(max(r / max(mean(r), 1e-15), eps)) · sqrt(max(c, eps))` (outer product);
    - full: `v = β2 v + (1-β2) g²`, `den = sqrt(max(v, eps))`.

    The output is `u = g · sqrt(1-β2^t) / den`, in `stats_dtype`, and with `clip_threshold`
    `u / max(1, RMS(u)/clip_threshold)` per tensor. `eps` clamps the squared quantity; it
    is not added to the denominator.

    Args:
      b2: decay of the second-moment EMA, in [0, 1).
      eps: lower clamp of the (normalised) squared statistics, > 0.
      factored: factor the statistics of parameters with ndim >= 2.
      stats_dtype: dtype of the statistics and of the output.
      clip_threshold: per-tensor RMS clipping, equal to following this transform with
        `optax.clip_by_block_rms(clip_threshold)` (up to rounding) but cheaper: the RMS
        comes from the statistics and `u` is never stored. `None`: no clipping.

    Returns:
      An `optax.GradientTransformation` with state `ScaleBySecondMomentState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_second_moment
      >>> tx = scale_by_second_moment()
      >>> params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
      >>> state = tx.init(params)
      >>> state.v_row["w"].shape, state.v_col["w"].shape, state.v["b"].shape
      ((4,), (3,), (3,))

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.

      N. Shazeer, M. Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
      <https://arxiv.org/abs/1804.04235>`_, 2018.
    """
    _check_decay("b2", b2)
    _check_eps(eps)
    _check_clip(clip_threshold)

    def init_fn(params):
        moments = jax.tree.map(lambda p: _init_moment(p, factored, stats_dtype), params)
        v_row, v_col, v = _unzip(params, moments, 3)
        return ScaleBySecondMomentState(jnp.zeros([], jnp.int32), v_row, v_col, v)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        scale = jnp.sqrt(_one_minus_pow(b2, count))

        def leaf(g, v_row, v_col, v):
            g = g.astype(stats_dtype)
            inv_den, v_row, v_col, v = _update_moment(g, v_row, v_col, v, b2, eps)
            u = _scaled(g, inv_den, _clip_scale(g, inv_den, scale, clip_threshold))
            return u.astype(stats_dtype), v_row, v_col, v

        out = jax.tree.map(leaf, updates, state.v_row, state.v_col, state.v)
        updates, v_row, v_col, v = _unzip(updates, out, 4)
        return updates, ScaleBySecondMomentState(count, v_row, v_col, v)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_skew_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       momentum: bool = True, factored: bool = True,
                       stats_dtype: Any = jnp.float32, clip_threshold: float | None = None
                       ) -> optax.GradientTransformation:
    r"""SkewAdam's direction for one role: no weight decay or lr.

    Steps, with `t` counting updates from 1 and `g` the update cast to `stats_dtype`:

    1. second moment and `den` exactly as `scale_by_second_moment`;
    2. with momentum: `m = β1 m + (1-β1) g`, `u = m · sqrt(1-β2^t) / (1-β1^t)`;
       without: `u = g · sqrt(1-β2^t)`;
    3. `u / den`; with `clip_threshold`, divided by `max(1, RMS/clip_threshold)` per tensor.

    Args:
      b1: decay of the first moment, in [0, 1) (unused without momentum).
      b2: decay of the second moment, in [0, 1).
      eps: lower clamp of the squared statistics, > 0.
      momentum: keep a first moment. Without it this is `scale_by_second_moment`.
      factored: factor the second moment of parameters with ndim >= 2.
      stats_dtype: dtype of `m`, of the second moment and of the output.
      clip_threshold: per-tensor RMS clipping (as `scale_by_second_moment`'s); `None`: none.

    Returns:
      An `optax.GradientTransformation`; its state is `ScaleBySkewAdamState` with momentum,
      `ScaleBySecondMomentState` without.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from optax_snoo import scale_by_skew_adam
      >>> tx = scale_by_skew_adam()
      >>> params = {"w": jnp.ones((4, 3))}
      >>> u, state = tx.update({"w": jnp.full((4, 3), 0.1)}, tx.init(params))
      >>> float(u["w"][0, 0])  # the first step of a constant gradient is its sign
      1.0

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    _check_decay("b1", b1)
    _check_decay("b2", b2)
    _check_eps(eps)
    _check_clip(clip_threshold)
    if not momentum:
        return scale_by_second_moment(b2, eps, factored=factored, stats_dtype=stats_dtype,
                                      clip_threshold=clip_threshold)

    def init_fn(params):
        mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=stats_dtype), params)
        moments = jax.tree.map(lambda p: _init_moment(p, factored, stats_dtype), params)
        v_row, v_col, v = _unzip(params, moments, 3)
        return ScaleBySkewAdamState(jnp.zeros([], jnp.int32), mu, v_row, v_col, v)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        scale = jnp.sqrt(_one_minus_pow(b2, count)) / _one_minus_pow(b1, count)

        def leaf(g, mu, v_row, v_col, v):
            g = g.astype(stats_dtype)
            inv_den, v_row, v_col, v = _update_moment(g, v_row, v_col, v, b2, eps)
            mu = b1 * mu + (1 - b1) * g
            u = _scaled(mu, inv_den, _clip_scale(mu, inv_den, scale, clip_threshold))
            return u.astype(stats_dtype), mu.astype(stats_dtype), v_row, v_col, v

        out = jax.tree.map(leaf, updates, state.mu, state.v_row, state.v_col, state.v)
        updates, mu, v_row, v_col, v = _unzip(updates, out, 5)
        return updates, ScaleBySkewAdamState(count, mu, v_row, v_col, v)

    return optax.GradientTransformation(init_fn, update_fn)


def cast_to_param_dtype() -> optax.GradientTransformation:
    """Casts each update to its parameter's dtype (the last step of `skew_adam`, which
    computes in float32 whatever the parameter dtype, when no rounding is asked for).

    Returns:
      A stateless `optax.GradientTransformation` that needs `params`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import cast_to_param_dtype
      >>> p = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> u, _ = cast_to_param_dtype().update({"w": jnp.ones((2,))}, None, p)
      >>> u["w"].dtype
      dtype(bfloat16)

    References:
      optax authors, `optax.apply_updates <https://optax.readthedocs.io>`_, 2024.
    """
    def update_fn(updates, state, params=None):
        _check_params(params, "cast_to_param_dtype")
        return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def skew_adam(learning_rate: optax.ScalarOrSchedule = 3e-4, b1: float = 0.9,
              b2: float = 0.999, eps: float = 1e-8,
              weight_decay: optax.ScalarOrSchedule = 0.05, *,
              roles: RolesArg = None,
              policies: str | Mapping[str, RolePolicy] | None = None,
              clip_threshold: float | None = 1.0,
              rounding: str | optax.GradientTransformation | None = None,
              ) -> optax.GradientTransformationExtraArgs:
    r"""SkewAdam: per-role optimizer state for Mixture-of-Experts models.

    Every parameter gets a role (default rules: path contains "experts" -> experts, contains
    "router" -> router, else backbone; `skew_adam_roles(params, roles)` shows the roles a
    model gets) and each role a `RolePolicy`. Default table (the paper's):

    ========  ========  =====================================  ============
    role      momentum  second moment                          weight decay
    ========  ========  =====================================  ============
    backbone  yes       factored for ndim >= 2, full for 1-D   yes
    experts   no        factored (per expert for (E, R, C))    yes
    router    no        full                                   no
    ========  ========  =====================================  ============

    Per role this is `optax.partition` of `scale_by_skew_adam(clip_threshold=...) ->
    add_decoupled_weight_decay -> scale_by_learning_rate`
    (the clipping equals a following `optax.clip_by_block_rms(clip_threshold)`), i.e.
    `u = u / max(1, RMS(u)/clip_threshold)` per tensor,
    then `p <- p - lr·(u + wd·p) = p(1 - lr·wd) - lr·u`. All arithmetic is in the role's
    `stats_dtype` (float32); the updates are finally cast to the parameter dtype, or handed
    to `rounding`, which turns the float32 new value into the parameter dtype (e.g. bf16
    master weights with the paper's dithered rounding, `optax_snoo.rounding`).

    Args:
      learning_rate: a non-negative float or a schedule of the step.
      b1: decay of the first moment (roles with momentum), in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: lower clamp of the squared statistics, > 0.
      weight_decay: decoupled weight decay for roles whose policy has `weight_decay=True`
        (multiplied by the learning rate), >= 0, or a schedule.
      roles: `None` (default rules), an ordered sequence of `(pattern, role)` rules (a `str`
        matches as a substring of the `"/"`-joined path, an `re.Pattern` with `search`; first
        match wins; no match -> "backbone"), or a callable `params -> tree of role names`
        (it must depend only on paths/shapes: `optax.partition` re-evaluates it on updates).
      policies: `None`, a preset name ("skew_adam", "expert_momentum", "factored_router",
        "uniform") or a mapping `role -> RolePolicy` overriding the default table.
      clip_threshold: the per-tensor RMS threshold (the paper's: 1.0); `None` disables
        clipping.
      rounding: `None` (cast to the param dtype), "stochastic" or "dithered"
        (`optax_snoo.rounding.by_name(rounding)`, key 0), or any rounding
        `GradientTransformation`.

    Returns:
      An `optax.GradientTransformationExtraArgs`. With `optax.inject_hyperparams`, declare
      `static_args=("roles", "policies", "rounding")` (a callable `roles` would otherwise be
      taken for a schedule; skew_adam then fails with a `TypeError` that says so).

    Raises:
      ValueError: negative learning rate or weight decay, b1/b2 outside [0, 1), eps <= 0,
        clip_threshold <= 0, unknown role or preset names, or (at init) roles returning a
        role without a policy.
      TypeError: `roles` that is not None, rules or a callable (e.g. the output of a
        callable `roles` that `optax.inject_hyperparams` took for a schedule).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import skew_adam
      >>> params = {"attn": jnp.ones((8, 8)), "moe": {"experts": jnp.ones((4, 8, 16)),
      ...                                             "router": jnp.ones((8, 4))}}
      >>> tx = skew_adam(3e-4)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> ablation = skew_adam(3e-4, policies="expert_momentum")

    References:
      N. Malik, `Where Should Optimizer State Live? Tiered State Allocation for
      Memory-Efficient Mixture-of-Experts Training <https://arxiv.org/abs/2607.19058>`_, 2026.
    """
    check_non_negative("learning_rate", learning_rate)
    check_non_negative("weight_decay", weight_decay)
    _check_clip(clip_threshold)
    table = resolve_policies(policies, roles)
    labels = role_labeller(roles, table)

    groups = {}
    for role, policy in table.items():
        parts = [scale_by_skew_adam(b1, b2, eps, momentum=policy.momentum,
                                    factored=policy.factored, stats_dtype=policy.stats_dtype,
                                    clip_threshold=clip_threshold)]
        if policy.weight_decay:
            parts.append(add_decoupled_weight_decay(weight_decay))
        parts.append(optax.scale_by_learning_rate(learning_rate))
        groups[role] = optax.chain(*parts)
    return optax.chain(optax.partition(groups, labels), _resolve_rounding(rounding))


def _resolve_rounding(rounding: str | optax.GradientTransformation | None
                      ) -> optax.GradientTransformation:
    if rounding is None:
        return cast_to_param_dtype()
    if isinstance(rounding, str):
        return rounding_lib.by_name(rounding)
    if not isinstance(rounding, optax.GradientTransformation):
        raise TypeError(f"rounding must be None, a name or a GradientTransformation, "
                        f"got {type(rounding).__name__}")
    return rounding
