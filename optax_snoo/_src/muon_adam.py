"""`muon`, the library's one Muon + Adam builder: Muon's chain and the AdamW groups in
one partition (`with_adam_groups`).

References:
  Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
  <https://github.com/KellerJordan/modded-nanogpt>`_ (records), 2024-2025
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.adam import AdamGroup, adam_group
from optax_snoo._src.labels import muon_adam_labels, partition
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.newton_schulz import Coefficients
from optax_snoo._src.utils import check_non_negative, path_to_str
from optax_snoo._src.weight_decay import add_decoupled_weight_decay


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float | optax.Schedule = 0.95,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_multiplier: optax.Params | Callable[[optax.Params], Any] | None = None,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    beta2: float | optax.Schedule | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    adam_nesterov: bool = False,
    adam_groups: Sequence[AdamGroup] | None = None,
    cautious_weight_decay: bool = False,
    labels: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon on matrices and matrix stacks, AdamW groups on every other leaf.

    The one Muon + Adam builder of the library (the recipes and the trainer build their
    stacks with it): an ``optax.partition`` of

    - ``"muon"``: ``chain(scale_by_muon(...), decoupled weight decay,
      scale_by_learning_rate(learning_rate))``, i.e.
      ``p ← p (1 - lr·wd·wd_mul) - lr·s(fan_in, fan_out)·O`` with the shape scale ``s``
      of `scale_by_muon` (``sqrt(max(1, fan_out/fan_in))`` by default);
    - one AdamW group per `AdamGroup` of ``adam_groups`` (`adam_group`: its own
      learning rate or schedule, betas, eps, decoupled weight decay and bias correction),
      each non-Muon leaf in the first group whose pattern its path matches; without
      ``adam_groups``, one group ``"adam"`` of every non-Muon leaf from the ``adam_*``
      arguments: the numbers and the state tree of ``optax.adamw(adam_learning_rate,
      adam_b1, adam_b2, adam_eps, weight_decay=adam_weight_decay,
      nesterov=adam_nesterov)`` for float32 params (for bf16 params ``wd·p`` is formed
      in float32, see `add_decoupled_weight_decay`).

    Every decay is `add_decoupled_weight_decay`; with ``cautious_weight_decay=True``
    all groups decay only where the update and the weight agree in sign (Chen et al., as
    in modded-nanogpt's GPT-2 Medium record).

    Labels default to ``optax_snoo.labels.muon_adam_labels`` (hidden matrices and stacks to
    Muon; embeddings, head, norms, biases, scalars to Adam).

    Args:
      learning_rate: Muon learning rate (float >= 0 or schedule); record: 0.027-0.03 with
        a linear cooldown over the last ~70% of training (`stable_cooldown_schedule`).
      beta: Muon momentum or schedule (records: `muon_momentum_warmup`,
        `muon_momentum_schedule`).
      weight_decay: decoupled weight decay of the Muon group, multiplied by the learning
        rate (record: 0.01).
      weight_decay_multiplier: per-leaf factor on ``weight_decay``: a tree of floats with
        the params' structure, or a callable ``params -> tree`` (inside the partition it
        receives the params with Adam leaves replaced by ``optax.MaskedNode``); ``None``
        means 1.0 everywhere (record: 2.0 on MLP weights).
      coefficients: Newton-Schulz preset or triples; see `orthogonalize`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      nesterov: Nesterov (EMA form) momentum for Muon.
      bias_correction: bias-correct the Muon momentum like optax.contrib.muon.
      smoothing: update smoothing σ (float, schedule) or ``None``; see `scale_by_muon`.
      smoothing_form: ``"ema"`` or ``"nesterov"``.
      matrix_axes: the (fan_in, fan_out) axes of every Muon leaf.
      shape_scale: ``"modded"`` (or ``True``), ``"consistent_rms"`` (Moonlight's
        ``0.2 sqrt(max(fan_in, fan_out))``: with it AdamW's learning rate and weight decay
        suit the Muon group too), or ``None``/``False``; see `scale_by_muon`.
      beta2: NorMuon's per-neuron second-moment decay, or ``None`` for plain Muon;
        see `scale_by_muon` and `normuon`.
      shard_newton_schulz: on sharded params each device orthogonalises whole matrices;
        see `scale_by_muon`.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``
        (`NewtonSchulzPlan.from_params(params)`); see `scale_by_muon`.
      mesh: the mesh for leaves of unknown sharding (default: the ``jax.set_mesh``
        context); see `scale_by_muon`.
      adam_learning_rate: learning rate of the single AdamW group (default:
        ``learning_rate``); not with ``adam_groups``.
      adam_b1: first-moment decay of the single AdamW group.
      adam_b2: second-moment decay of the single AdamW group.
      adam_eps: epsilon of the single AdamW group.
      adam_weight_decay: decoupled weight decay of the single AdamW group.
      adam_nesterov: Nesterov momentum in the single AdamW group
        (``optax.adamw(nesterov=)``); ``optax.contrib.muon(nesterov=True)`` does this,
        the record does not.
      adam_groups: ordered `AdamGroup` entries for the non-Muon leaves (first match wins; a
        leaf no group matches is an error at init); replaces the ``adam_*`` arguments,
        which must then keep their defaults.
      cautious_weight_decay: in every group, decay only the entries where the update
        (before the learning rate) and the weight agree in sign,
        ``u + wd·mul·p·[u·p >= 0]``; see `add_decoupled_weight_decay`.
      labels: a tree of ``"muon"``/``"adam"`` strings with the params' structure, or a
        callable ``params -> tree``; overrides the default labelling (``"adam"`` leaves
        then go to the Adam groups by path).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (a checked ``optax.partition``, see
      `optax_snoo.labels.partition`), its state's ``inner_states`` keyed by the group
      labels.

    Raises:
      ValueError: for a negative learning rate or weight decay, bad groups (duplicate
        names, ``adam_*`` arguments beside ``adam_groups``), and everything
        `scale_by_muon` rejects; at init time for a 0-D/1-D leaf labelled ``"muon"`` and
        for a non-Muon leaf no Adam group matches.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_snoo import AdamGroup, muon, muon_momentum_warmup
      >>> params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,)), "wte": jnp.ones((4, 8))}
      >>> labels = {"w": "muon", "b": "adam", "wte": "adam"}
      >>> tx = muon(0.03, beta=muon_momentum_warmup(), weight_decay=0.01,
      ...           adam_learning_rate=3e-3, labels=labels)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> tx = muon(0.03, labels=labels, adam_groups=[
      ...     AdamGroup("wte", 0.3, b1=0.8, b2=0.95, name="embed"),
      ...     AdamGroup(".*", 0.01, b1=0.8, b2=0.99, bias_correction=False, name="vectors")])
      >>> sorted(tx.init(params).inner_states)
      ['embed', 'muon', 'vectors']

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline
      <https://github.com/KellerJordan/modded-nanogpt>`_, 2024

      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    check_non_negative("learning_rate", learning_rate)
    check_non_negative("weight_decay", weight_decay)
    if adam_groups is None:
        check_non_negative("adam_learning_rate", adam_learning_rate)
        adam_groups = (AdamGroup(
            ".*", learning_rate if adam_learning_rate is None else adam_learning_rate,
            adam_b1, adam_b2, adam_eps, adam_weight_decay, nesterov=adam_nesterov,
            name="adam"),)
    else:
        single = dict(adam_learning_rate=adam_learning_rate, adam_b1=adam_b1, adam_b2=adam_b2,
                      adam_eps=adam_eps, adam_weight_decay=adam_weight_decay,
                      adam_nesterov=adam_nesterov)
        changed = {k: v for k, v in single.items() if v != _SINGLE_ADAM_DEFAULTS[k]}
        if changed:
            raise ValueError(f"muon: {changed} given beside adam_groups; set the Adam "
                             "hyperparameters on each AdamGroup instead.")
    muon_tx = optax.chain(
        scale_by_muon(
            beta, coefficients=coefficients, ns_dtype=ns_dtype, nesterov=nesterov,
            bias_correction=bias_correction, matrix_axes=matrix_axes, smoothing=smoothing,
            smoothing_form=smoothing_form, shape_scale=shape_scale, beta2=beta2,
            shard_newton_schulz=shard_newton_schulz, newton_schulz_plan=newton_schulz_plan,
            mesh=mesh),
        add_decoupled_weight_decay(weight_decay, weight_decay_multiplier,
                                   cautious=cautious_weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    return with_adam_groups(muon_tx, adam_groups, labels=labels,
                            cautious_weight_decay=cautious_weight_decay)


def with_adam_groups(
    muon_tx: optax.GradientTransformation,
    adam_groups: Sequence[AdamGroup],
    *,
    labels: Any | Callable[[optax.Params], Any] | None = None,
    cautious_weight_decay: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """`muon`'s partition with a given Muon-group chain: ``muon_tx`` on the ``"muon"``
    leaves, each non-Muon leaf in the first `AdamGroup` whose pattern its path matches.

    `muon` builds its Muon group as ``chain(scale_by_muon, decay, scale_by_learning_rate)``;
    stacks whose hidden-matrix step is something else (SOAP whitening, `radius_steps` in
    place of the learning rate: modded-nanogpt Track 3's records) pass their own chain.

    Args:
      muon_tx: the Muon group's transformation (its updates are final).
      adam_groups: ordered `AdamGroup` entries (first match wins).
      labels: ``"muon"``/``"adam"`` labels (tree or callable); ``None``:
        `optax_snoo.labels.muon_adam_labels`.
      cautious_weight_decay: the Adam groups' decay only where update and weight agree
        in sign.

    Returns:
      A checked ``optax.partition`` (its state's ``inner_states`` keyed by ``"muon"`` and
      the groups' names).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from optax_snoo import AdamGroup
      >>> from optax_snoo._src.muon import scale_by_muon
      >>> from optax_snoo._src.muon_adam import with_adam_groups
      >>> tx = with_adam_groups(optax.chain(scale_by_muon(), optax.scale(-0.02)),
      ...                       [AdamGroup(".*", 3e-3, name="rest")])
      >>> sorted(tx.init({"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}).inner_states)
      ['muon', 'rest']
    """
    names = _adam_group_names(adam_groups)
    transforms = {"muon": muon_tx} | {
        name: adam_group(group, cautious_weight_decay=cautious_weight_decay)
        for name, group in zip(names, adam_groups, strict=True)}
    base = muon_adam_labels if labels is None else labels
    return partition(transforms, _labels_with_adam_groups(base, adam_groups, names))


_SINGLE_ADAM_DEFAULTS = dict(adam_learning_rate=None, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8,
                             adam_weight_decay=0.0, adam_nesterov=False)


def _adam_group_names(groups: Sequence[AdamGroup]) -> list[str]:
    """Each group's label: its ``name``, else ``"adam"`` alone or ``"adam_<i>"``."""
    groups = tuple(groups)
    if not groups:
        raise ValueError("adam_groups: expected at least one AdamGroup, got none.")
    for group in groups:
        if not isinstance(group, AdamGroup):
            raise ValueError(f"adam_groups: expected AdamGroup(pattern, learning_rate, ...) "
                             f"entries, got {group!r}.")
    default = (lambda i: "adam") if len(groups) == 1 else (lambda i: f"adam_{i}")
    names = [default(i) if g.name is None else g.name for i, g in enumerate(groups)]
    if len(set(names)) != len(names) or "muon" in names:
        raise ValueError(f"adam_groups: group names must be distinct and not 'muon', got "
                         f"{names}.")
    return names


def _labels_with_adam_groups(labels: Any, groups: Sequence[AdamGroup], names: Sequence[str]
                             ) -> Callable[[optax.Params], Any]:
    """``labels`` (a tree or a function of the params) with each ``"adam"`` leaf relabelled
    by the first group whose pattern its path matches."""
    compiled = [re.compile(g.pattern) for g in groups]

    def group_labels(params: optax.Params) -> Any:
        def refine(path: Any, label: Any) -> Any:
            if label != "adam":
                return label
            name = path_to_str(path)
            for regex, group_name in zip(compiled, names, strict=True):
                if regex.search(name):
                    return group_name
            raise ValueError(f"parameter {name!r} matches no Adam group "
                             f"{[regex.pattern for regex in compiled]}")

        return jax.tree.map_with_path(refine, labels(params) if callable(labels) else labels)

    return group_labels
