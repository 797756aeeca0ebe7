"""`muon`, the library's one Muon + Adam builder: Muon's chain and the AdamW groups in
one partition (`with_adam_groups`), and the parameter groups of each side: `MuonGroup`
(a learning rate and decay per set of matrices) beside `optax_snoo.AdamGroup`.

References:
  Jordan et al., `modded-nanogpt: Speedrunning the NanoGPT baseline
  <https://github.com/KellerJordan/modded-nanogpt>`_ (records), 2024-2025
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_snoo._src.adam import AdamGroup, adam_group
from optax_snoo._src.labels import by_path, muon_adam_labels, partition
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_plan import NewtonSchulzPlan
from optax_snoo._src.muon_sharding import MatrixPrecondition
from optax_snoo._src.newton_schulz import Coefficients
from optax_snoo._src.utils import check_non_negative, path_to_str, value_at
from optax_snoo._src.weight_decay import add_decoupled_weight_decay


class MuonGroup(NamedTuple):
    """One group of Muon's matrices: the Muon leaves whose path matches ``pattern``, with
    their own learning rate and decoupled weight decay.

    Muon's direction (momentum, Newton-Schulz, shape scale) is shared by every matrix,
    whose whole matrices `scale_by_muon` splits over the devices together; a group sets
    only the step ``p ← p (1 - lr_g·wd_g) - lr_g·O`` of its leaves (modded-nanogpt Track 3
    record #15: q/k/v, attention output, MLP in and MLP out each their own).

    Attributes:
      pattern: regular expression (string or compiled) searched in the leaf's path.
      learning_rate: the group's learning rate or schedule; ``None``: `muon`'s.
      weight_decay: the group's decoupled weight decay (times its learning rate);
        ``None``: `muon`'s.
      name: what errors and `optax_snoo.recipes.describe` call the group.

    Example:
      >>> from optax_snoo import MuonGroup
      >>> MuonGroup(r"(^|/)mlp/", weight_decay=0.02, name="mlp").learning_rate is None
      True
    """

    pattern: str | re.Pattern
    learning_rate: optax.ScalarOrSchedule | None = None
    weight_decay: jax.typing.ArrayLike | None = None
    name: str | None = None


def _muon_step(learning_rate: optax.ScalarOrSchedule, weight_decay: Any,
               groups: Sequence[MuonGroup] | None, cautious: bool
               ) -> optax.GradientTransformation:
    """Muon's step after its direction: decoupled decay, then minus the learning rate; per
    `MuonGroup` when groups are given (each Muon leaf must match one)."""
    if groups is None:
        return optax.chain(add_decoupled_weight_decay(weight_decay, cautious=cautious),
                           optax.scale_by_learning_rate(learning_rate))
    groups = tuple(groups)
    for i, g in enumerate(groups):
        if not isinstance(g, MuonGroup):
            raise ValueError(f"muon_groups[{i}]: expected a MuonGroup, got {g!r}")
        check_non_negative(f"muon_groups[{i}] ({g.name or g.pattern}) learning_rate",
                           g.learning_rate, allow_none=True)
        check_non_negative(f"muon_groups[{i}] ({g.name or g.pattern}) weight_decay",
                           g.weight_decay, allow_none=True)
    rates = by_path([(g.pattern, learning_rate if g.learning_rate is None else g.learning_rate)
                     for g in groups], what="Muon group")
    decays = by_path([(g.pattern, weight_decay if g.weight_decay is None else g.weight_decay)
                      for g in groups], what="Muon group")

    def init_fn(params):
        rates(params)  # a Muon leaf no group matches: an error at init
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        lr = rates(updates)
        masked = lambda x: isinstance(x, optax.MaskedNode)
        updates = jax.tree.map(
            lambda u, r: u if masked(u) else -jnp.asarray(value_at(r, state.count), u.dtype) * u,
            updates, lr, is_leaf=masked)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.chain(
        add_decoupled_weight_decay(1.0, decays, cautious=cautious),
        optax.GradientTransformation(init_fn, update_fn))


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float | optax.Schedule = 0.95,
    weight_decay: jax.typing.ArrayLike = 0.0,
    muon_groups: Sequence[MuonGroup] | None = None,
    coefficients: Coefficients = "modded",
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    nesterov: bool = True,
    bias_correction: bool = False,
    smoothing: float | optax.Schedule | None = None,
    smoothing_form: str = "ema",
    matrix_axes: tuple[int, int] = (-2, -1),
    shape_scale: bool | str | None = "modded",
    beta2: float | optax.Schedule | None = None,
    precondition: MatrixPrecondition | None = None,
    shard_newton_schulz: bool = True,
    newton_schulz_plan: NewtonSchulzPlan | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float | None = None,
    adam_b2: float | None = None,
    adam_eps: float | None = None,
    adam_weight_decay: float | None = None,
    adam_nesterov: bool | None = None,
    adam_groups: Sequence[AdamGroup] | None = None,
    cautious_weight_decay: bool = False,
    labels: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon on matrices and matrix stacks, AdamW groups on every other leaf.

    The one Muon + Adam builder of the library (the recipes and the trainer build their
    stacks with it): an ``optax.partition`` of

    - ``"muon"``: ``chain(scale_by_muon(...), decoupled weight decay,
      scale_by_learning_rate(learning_rate))``, i.e.
      ``p ← p (1 - lr·wd) - lr·s(fan_in, fan_out)·O`` with the shape scale ``s``
      of `scale_by_muon` (``sqrt(max(1, fan_out/fan_in))`` by default); with
      ``muon_groups``, each matrix with the ``lr``, ``wd`` of the first `MuonGroup` its
      path matches (one Newton-Schulz over all of them);
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
      muon_groups: ordered `MuonGroup` entries (first match wins; a Muon leaf no group
        matches is an error at init; add ``MuonGroup(".*")`` for the rest): per-group
        learning rates and decays (the GPT-2 Medium record: twice the decay on the MLP
        matrices; Track 3 #15: four groups); ``None``: one group.
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
      precondition: a `MatrixPrecondition` of the Newton-Schulz input (SOAP's whitening,
        Muon²'s second moment); see `scale_by_muon`.
      newton_schulz_plan: where the Muon leaves live under ``jax.jit``
        (`NewtonSchulzPlan.from_params(params)`); see `scale_by_muon`.
      mesh: the mesh for leaves of unknown sharding (default: the ``jax.set_mesh``
        context); see `scale_by_muon`.
      adam_learning_rate: learning rate of the single AdamW group (``None``:
        ``learning_rate``). The ``adam_*`` arguments are ``optax.contrib.muon``'s and
        describe the one group ``"adam"``; they cannot be given with ``adam_groups``.
      adam_b1: first-moment decay of the single AdamW group (``None``: 0.9).
      adam_b2: second-moment decay of the single AdamW group (``None``: 0.999).
      adam_eps: epsilon of the single AdamW group (``None``: 1e-8).
      adam_weight_decay: decoupled weight decay of the single AdamW group (``None``: 0).
      adam_nesterov: Nesterov momentum in the single AdamW group
        (``optax.adamw(nesterov=)``; ``None``: off); ``optax.contrib.muon(nesterov=True)``
        does this, the record does not.
      adam_groups: ordered `AdamGroup` entries for the non-Muon leaves (first match wins; a
        leaf no group matches is an error at init; a ``claim`` group also takes matching
        leaves the labels give to Muon; a ``required`` group matching nothing is an
        error); instead of the ``adam_*`` arguments.
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
    single = dict(adam_learning_rate=adam_learning_rate, adam_b1=adam_b1, adam_b2=adam_b2,
                  adam_eps=adam_eps, adam_weight_decay=adam_weight_decay,
                  adam_nesterov=adam_nesterov)
    given = sorted(k for k, v in single.items() if v is not None)
    if adam_groups is None:
        check_non_negative("adam_learning_rate", adam_learning_rate, allow_none=True)
        pick = lambda value, default: default if value is None else value
        adam_groups = (AdamGroup(
            ".*", pick(adam_learning_rate, learning_rate), pick(adam_b1, 0.9),
            pick(adam_b2, 0.999), pick(adam_eps, 1e-8), pick(adam_weight_decay, 0.0),
            nesterov=pick(adam_nesterov, False), name="adam"),)
    elif given:
        raise ValueError(f"muon: {', '.join(given)} given beside adam_groups; set the Adam "
                         "hyperparameters on each AdamGroup instead.")
    muon_tx = optax.chain(
        scale_by_muon(
            beta, coefficients=coefficients, ns_dtype=ns_dtype, nesterov=nesterov,
            bias_correction=bias_correction, matrix_axes=matrix_axes, smoothing=smoothing,
            smoothing_form=smoothing_form, shape_scale=shape_scale, beta2=beta2,
            precondition=precondition, shard_newton_schulz=shard_newton_schulz,
            newton_schulz_plan=newton_schulz_plan, mesh=mesh),
        _muon_step(learning_rate, weight_decay, muon_groups, cautious_weight_decay),
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
    return partition(transforms, group_labels(adam_groups, labels))


def group_labels(adam_groups: Sequence[AdamGroup],
                 labels: Any | Callable[[optax.Params], Any] | None = None,
                 muon_groups: Sequence[MuonGroup] | None = None
                 ) -> Callable[[optax.Params], Any]:
    """``params -> tree of group names`` of `with_adam_groups`' partition: ``"muon"`` or
    the name of each leaf's `AdamGroup` (see `with_adam_groups` for the rules); with
    ``muon_groups``, a Muon leaf is ``"muon/<its MuonGroup's name>"`` (what
    `optax_snoo.recipes.describe` shows; the partition's label stays ``"muon"``).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import AdamGroup
      >>> from optax_snoo._src.muon_adam import group_labels
      >>> group_labels([AdamGroup("tok_emb", 0.3, name="embed", claim=True),
      ...               AdamGroup(".*", 0.01, name="rest")])(
      ...     {"tok_emb": jnp.ones((8, 4)), "w": jnp.ones((4, 4)), "b": jnp.ones(4)})
      {'b': 'rest', 'tok_emb': 'embed', 'w': 'muon'}
    """
    base = muon_adam_labels if labels is None else labels
    partition_labels = _labels_with_adam_groups(base, adam_groups, _adam_group_names(adam_groups))
    if not muon_groups:
        return partition_labels
    names = by_path([(g.pattern, g.name or getattr(g.pattern, "pattern", g.pattern))
                     for g in muon_groups], what="Muon group")

    def with_muon_groups(params: optax.Params) -> Any:
        return jax.tree.map_with_path(
            lambda path, label: f"muon/{names.value(path_to_str(path))}" if label == "muon"
            else label, partition_labels(params))

    return with_muon_groups


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
    by the first group whose pattern its path matches, and any other leaf (Muon's) a
    ``claim`` group's pattern matches given to the first such group; a ``required`` group
    that gets no leaf is an error naming it."""
    pairs = list(zip(groups, names, strict=True))
    claims = by_path([(g.pattern, name) for g, name in pairs if g.claim], default=None)
    adam = by_path([(g.pattern, name) for g, name in pairs], what="Adam group")

    def group_labels(params: optax.Params) -> Any:
        def refine(path: Any, label: Any) -> Any:
            name = path_to_str(path)
            if label == "adam":
                return adam.value(name)
            # A claim takes a leaf from Muon only: Adam's own leaves keep first-match order.
            claimed = claims.value(name)
            return label if claimed is None else claimed

        out = jax.tree.map_with_path(refine, labels(params) if callable(labels) else labels)
        _check_required(pairs, params, out)
        return out

    return group_labels


def _check_required(groups: Sequence[tuple[AdamGroup, str]], params: Any, labels: Any
                    ) -> None:
    """Refuse a ``required`` group with no leaf, and a ``like`` group with none while a
    Muon leaf is shaped like a leaf of the group it names (or transposed)."""
    leaves = jax.tree_util.tree_leaves_with_path(labels)
    shapes = [tuple(getattr(p, "shape", ())) for p in jax.tree.leaves(params)]
    by_group: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for (path, label), shape in zip(leaves, shapes, strict=True):
        by_group.setdefault(label, []).append((path_to_str(path), shape))
    hint = ("name its leaves in the group's pattern (a recipe's adam_patterns) or pass "
            "labels=; optax_snoo.recipes.describe(recipe, params) shows each leaf's group")
    for g, name in groups:
        pattern = getattr(g.pattern, "pattern", g.pattern)
        if name in by_group:
            continue
        if g.required:
            raise ValueError(f"Adam group {name!r} matches no parameter (pattern "
                             f"{pattern!r}): {hint}")
        twins = {s for _, s in by_group.get(g.like, [])} if g.like else set()
        twins |= {s[::-1] for s in twins}
        suspect = [(p, s) for p, s in by_group.get("muon", []) if s in twins]
        if suspect:
            path, shape = suspect[0]
            raise ValueError(f"Adam group {name!r} matches no parameter (pattern "
                             f"{pattern!r}) and the Muon leaf {path!r} {shape} is "
                             f"shaped like group {g.like!r}'s: a {name} named otherwise? "
                             f"{hint}")
