"""Adam with bias correction on or off, and the Adam groups that sit beside Muon.

`scale_by_adam` is ``optax.scale_by_adam`` (the same transform when bias-corrected) with
``bias_correction=False`` for the uncorrected moments modded-nanogpt's Track 3 records
use on 1-D parameters. `AdamGroup` describes one group of the non-Muon leaves of `muon`
(its path pattern, learning rate or schedule, betas, eps, decoupled weight decay and bias
correction); `adam_group` is the group's chain.

References:
  Kingma & Ba, `Adam: A Method for Stochastic Optimization
  <https://arxiv.org/abs/1412.6980>`_, 2015

  Loshchilov & Hutter, `Decoupled Weight Decay Regularization
  <https://arxiv.org/abs/1711.05101>`_, 2019

  Jordan et al., `modded-nanogpt Track 3 (optimization) records
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.utils import check_non_negative, check_unit_interval
from optax_snoo._src.weight_decay import add_decoupled_weight_decay

__all__ = ["AdamGroup", "adam_group", "scale_by_adam"]


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = False,
    bias_correction: bool = True,
) -> optax.GradientTransformation:
    r"""Adam's direction, with the bias correction on (optax's) or off.

    With ``t`` the number of updates so far (1 at the first)::

        m = b1 m + (1-b1) g;   v = b2 v + (1-b2) g²
        m̂ = m / (1 - b1^t),   v̂ = v / (1 - b2^t)        # bias_correction=True
        m̂ = m,                v̂ = v                     # bias_correction=False
        update = m̂ / (sqrt(v̂ + eps_root) + eps)

    With ``bias_correction=True`` this *is* ``optax.scale_by_adam`` (same numbers, same
    state). Without it, the moments start at zero and are used as they are, as the
    ``Adam`` class of modded-nanogpt's Track 3 record #46 does on 1-D parameters
    (``m.lerp_(g, 1-b1); v.lerp_(g², 1-b2); p -= lr·m/(sqrt(v) + eps)``): the first
    steps are smaller than Adam's by ``(1-b1)/sqrt(1-b2)``. ``nesterov=True`` uses
    ``b1 m + (1-b1) g`` (bias-corrected like optax's when the correction is on). The
    state is ``optax.ScaleByAdamState`` either way.

    Args:
      b1: first-moment decay in [0, 1).
      b2: second-moment decay in [0, 1).
      eps: added to the denominator's square root (>= 0).
      eps_root: added inside the square root (>= 0).
      mu_dtype: dtype of the first moment (``None``: the gradient's).
      nesterov: Nesterov momentum (Dozat's NAdam form).
      bias_correction: divide the moments by ``1 - b^t``.

    Returns:
      An ``optax.GradientTransformation`` with state ``optax.ScaleByAdamState``.

    Raises:
      ValueError: ``b1`` or ``b2`` outside [0, 1), or a negative ``eps``/``eps_root``.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import scale_by_adam
      >>> tx = scale_by_adam(0.8, 0.99, eps=0.0, bias_correction=False)
      >>> g = {"b": jnp.full((3,), 2.0)}
      >>> updates, _ = tx.update(g, tx.init(g))
      >>> round(float(updates["b"][0]), 4)  # (1-b1)/sqrt(1-b2) = 0.2/0.1
      2.0

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2015

      Jordan et al., `modded-nanogpt Track 3 record #46 (Adam class)
      <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
      2026
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)
    corrected = optax.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)
    if bias_correction:
        return corrected
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def update_fn(updates: optax.Updates, state: optax.ScaleByAdamState,
                  params: optax.Params | None = None
                  ) -> tuple[optax.Updates, optax.ScaleByAdamState]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        first = (jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, updates) if nesterov
                 else mu)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), first, nu)
        return updates, optax.ScaleByAdamState(
            count=optax.safe_increment(state.count), mu=optax.tree.cast(mu, mu_dtype),
            nu=optax.tree.cast_like(nu, state.nu))

    return optax.GradientTransformation(corrected.init, update_fn)


class AdamGroup(NamedTuple):
    """One Adam group beside Muon: the non-Muon leaves whose path matches ``pattern``.

    `muon` gives each leaf it does not send to Muon to the first group whose
    ``pattern`` is found (``re.search``) in the leaf's path (``"blocks/0/ln_1/scale"``,
    see `optax_snoo.labels.path_to_str`); a leaf no group matches is an error naming it.
    The group's chain is `adam_group`: AdamW with its own learning rate (or schedule),
    betas, eps, decoupled weight decay (``p ← p (1 - lr·wd)``, PyTorch's ``AdamW``) and
    bias correction.

    Attributes:
      pattern: regular expression (string or compiled) searched in the leaf path.
      learning_rate: the group's learning rate (>= 0) or a schedule of the update count.
      b1: first-moment decay.
      b2: second-moment decay.
      eps: added to the denominator's square root.
      weight_decay: decoupled weight decay (or schedule), multiplied by the learning rate.
      bias_correction: bias-correct the moments (`scale_by_adam`); modded-nanogpt's
        Track 3 record #46 turns it off on 1-D parameters.
      nesterov: Nesterov momentum in this group.
      name: the group's label in the partition (its key in the optimizer state);
        ``None``: ``"adam"`` for the only group, else ``"adam_<index>"``.
      claim: the group also takes the leaves its pattern matches that the labels give to
        Muon (an embedding or head the default labels do not recognise by name); the
        leaves the labels give to Adam still go to the first group they match.
      required: a group that matches no leaf is an error at init (the recipes' embedding:
        a model that names it otherwise would train it with Muon).
      like: the name of another group: this one is required when a Muon leaf has the
        shape of one of that group's leaves or its transpose (the recipes' head, like the
        embedding: a head named otherwise is refused, a tied head, which is the
        embedding, is not).

    Example:
      >>> from optax_snoo import AdamGroup
      >>> head = AdamGroup(r"(^|/)lm_head(/|$)", 0.004, b1=0.8, b2=0.95, eps=1e-10,
      ...                  weight_decay=0.001, name="head")
      >>> head.bias_correction
      True
    """

    pattern: str | re.Pattern
    learning_rate: optax.ScalarOrSchedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: optax.ScalarOrSchedule = 0.0
    bias_correction: bool = True
    nesterov: bool = False
    name: str | None = None
    claim: bool = False
    required: bool = False
    like: str | None = None


def adam_group(group: AdamGroup, *, cautious_weight_decay: bool = False
               ) -> optax.GradientTransformation:
    """The chain of one `AdamGroup`: ``optax.adamw``'s, with bias correction as asked.

    ``chain(scale_by_adam(b1, b2, eps, nesterov, bias_correction),
    add_decoupled_weight_decay(weight_decay), scale_by_learning_rate(learning_rate))``:
    with bias correction on and a float32 leaf, the numbers and the state tree of
    ``optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)``.

    Args:
      group: the group.
      cautious_weight_decay: decay only where the update and the weight agree in sign
        (`optax_snoo.add_decoupled_weight_decay`).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params`` when the group
      decays.

    Raises:
      ValueError: a bad pattern, a negative learning rate, eps or weight decay, or betas
        outside [0, 1), naming the group.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import AdamGroup, adam_group
      >>> tx = adam_group(AdamGroup(".*", 0.015, b1=0.8, b2=0.95, bias_correction=False))
      >>> p = {"b": jnp.ones(2)}
      >>> updates, _ = tx.update(p, tx.init(p), p)
    """
    if not isinstance(group, AdamGroup):
        raise ValueError(f"expected an AdamGroup(pattern, learning_rate, ...), got {group!r}")
    if not isinstance(group.pattern, str | re.Pattern):
        raise ValueError(f"AdamGroup.pattern must be a regex string or an re.Pattern, got "
                         f"{group.pattern!r}")
    try:
        re.compile(group.pattern)
    except re.error as err:
        raise ValueError(f"AdamGroup.pattern {group.pattern!r} is not a valid regex: {err}"
                         ) from None
    where = f"AdamGroup {group.name or group.pattern!r}: "
    try:
        check_non_negative("learning_rate", group.learning_rate)
        check_non_negative("weight_decay", group.weight_decay)
        direction = scale_by_adam(group.b1, group.b2, group.eps, nesterov=group.nesterov,
                                  bias_correction=group.bias_correction)
    except ValueError as err:
        raise ValueError(where + str(err)) from None
    return optax.chain(
        direction,
        add_decoupled_weight_decay(group.weight_decay, cautious=cautious_weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )
