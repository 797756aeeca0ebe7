"""Label a params tree by ordered path-pattern rules, for `optax.partition`.

A rule is `(pattern, label)`: `pattern` is a regular expression (a string or a compiled
`re.Pattern`) searched in the leaf's path written as `"blocks/0/attn/c_q/kernel"` (see
`path_to_str`); `label` is a string or a callable of the leaf (its shape is what matters)
returning one. The first matching rule wins. A leaf that matches no rule, or a label with
no transform, is an error that names the path. `describe` shows what a labelling decided,
path by path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from optax_snoo._src.utils import path_to_str

Label = str | Callable[[Any], str]
Rule = tuple[str | re.Pattern, Label]

__all__ = [
    "MUON_ADAM_RULES",
    "PathRules",
    "by_path",
    "describe",
    "label_by_rules",
    "muon_adam_labels",
    "partition",
    "path_to_str",
]


def _matrix_or_vector(leaf: Any) -> str:
    return "muon" if len(getattr(leaf, "shape", ())) >= 2 else "adam"


#: Hidden matrices (and MoE expert stacks) go to Muon; embeddings, the head, norms, biases
#: and scalars go to Adam, as in K. Jordan et al., "Muon: An optimizer for hidden layers in
#: neural networks" (https://kellerjordan.github.io/posts/muon/, 2024); so does the small
#: MoE router, as in the SkewAdam paper's Muon baseline (N. Malik, arXiv 2607.19058, 2026).
#: Names cover nanoGPT/Flax/Llama-style models.
MUON_ADAM_RULES: tuple[Rule, ...] = (
    (r"(^|/)(wte|wpe|embed\w*|tok_embeddings|lm_head|head|unembed\w*|router)(/|$)", "adam"),
    (r"(^|/)(ln\w*|\w*norm\w*)(/|$)", "adam"),
    (r"(^|/)(bias|scale)$", "adam"),
    (r".*", _matrix_or_vector),
)


_REQUIRED = object()


def _compiled(rules: Sequence[tuple[Any, Any]], what: str, value: str = "value"
              ) -> list[tuple[re.Pattern, Any]]:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise ValueError(f"each {what} must be a (pattern, {value}) pair, got {rule!r}")
        pattern, value = rule
        if not isinstance(pattern, str | re.Pattern):
            raise ValueError(f"{what} {rule!r}: pattern must be a regex string or an "
                             f"re.Pattern, got {type(pattern).__name__}")
        try:
            compiled.append((re.compile(pattern), value))
        except re.error as err:
            raise ValueError(f"{what} pattern {pattern!r} is not a valid regex: {err}") from None
    return compiled


def by_path(rules: Sequence[tuple[str | re.Pattern, Any]], *, default: Any = _REQUIRED,
            what: str = "rule") -> Callable[[Any], Any]:
    """A function giving each leaf of a tree the value of the first rule its path matches.

    The library's one path rule: labels for `optax.partition` (`label_by_rules`), per-group
    learning rates and decays (`optax_snoo.AdamGroup`, `optax_snoo.MuonGroup`), masks (the
    tail EMA's, the trust gate's) all come from it. `optax.MaskedNode` leaves (the leaves
    of other groups inside a partition) stay `optax.MaskedNode`.

    Args:
      rules: ordered ``(pattern, value)`` pairs; ``pattern`` is a regular expression (a
        string or a compiled `re.Pattern`) searched (`re.search`) in the leaf's path
        (`path_to_str`: ``"blocks/0/attn/c_q/kernel"``); ``value`` is any object, given to
        the leaf as it is. The first match wins.
      default: the value of a leaf no rule matches, or a callable of such a leaf giving
        it; omitted: such a leaf is an error naming its path and the patterns.
      what: what a rule is called in error messages (``"Adam group"``...).

    Returns:
      A `PathRules`: ``rules(tree)`` is a tree of values with the structure of ``tree``;
      ``rules.value("blocks/0/mlp/c_fc/kernel")`` the value of one path.

    Raises:
      ValueError: at construction, a rule that is not a ``(pattern, value)`` pair or an
        invalid regex; when called, a leaf that matches no rule (without ``default``).

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.labels import by_path
      >>> decay = by_path([(r"(^|/)mlp(/|$)", 2.0)], default=1.0)
      >>> decay({"mlp": {"w": jnp.ones((2, 2))}, "attn": {"w": jnp.ones((2, 2))}})
      {'attn': {'w': 1.0}, 'mlp': {'w': 2.0}}
      >>> decay.value("blocks/0/mlp/c_fc/kernel")
      2.0
    """
    return PathRules(_compiled(rules, what), default, what)


class PathRules:
    """The function `by_path` returns: ``rules(tree)`` maps a tree, ``rules.value(path)``
    gives one path string's value (a callable ``default`` then gets ``leaf``)."""

    def __init__(self, compiled: list[tuple[re.Pattern, Any]], default: Any, what: str):
        self._compiled, self._default, self._what = compiled, default, what

    def match(self, name: str) -> tuple[Any, re.Match] | None:
        """The first rule's value and its match in path ``name``, or ``None``."""
        for regex, value in self._compiled:
            found = regex.search(name)
            if found:
                return value, found
        return None

    def value(self, name: str, leaf: Any = None) -> Any:
        """The value of the leaf at path ``name`` (``"blocks/0/attn/c_q/kernel"``)."""
        found = self.match(name)
        if found:
            return found[0]
        if self._default is _REQUIRED:
            raise ValueError(f"parameter {name!r} matches no {self._what} "
                             f"{[r.pattern for r, _ in self._compiled]}")
        return self._default(leaf) if callable(self._default) else self._default

    def by_prefix(self, tree: Any, make: Callable[[str, Any], Any]) -> Any:
        """``tree`` with each leaf whose path matches a rule as ``make(prefix, value)``:
        ``prefix`` is the path before the match without its trailing ``"/"`` (the leaf's
        layer, ``"blocks/0/attn"``), ``value`` the rule's; a leaf no rule matches is
        ``None``. How `qk_clip_heads` and `circuit_ov_heads` mark their heads."""

        def mark(path, _):
            name = path_to_str(path)
            found = self.match(name)
            if found is None:
                return None
            value, match = found
            return make(name[:match.start()].rstrip("/"), value)

        return jax.tree.map_with_path(mark, tree)

    def __call__(self, tree: Any) -> Any:
        masked = lambda x: isinstance(x, optax.MaskedNode)
        return jax.tree.map_with_path(
            lambda path, leaf: leaf if masked(leaf) else self.value(path_to_str(path), leaf),
            tree, is_leaf=masked)


def label_by_rules(rules: Sequence[Rule], *, default: str | None = None
                   ) -> Callable[[Any], Any]:
    """Build a labelling function for `optax.partition` from ordered path rules.

    `by_path` with string labels: a rule's label may also be a callable of the leaf (its
    shape is what matters) returning the string.

    Args:
      rules: `(pattern, label)` pairs, tried in order; `pattern` is a regular expression,
        a string or a compiled `re.Pattern`, searched (`re.search`) in the path string (see
        `path_to_str`); to match a plain substring, pass `re.escape(text)`. `label` is a
        string or a callable of the leaf returning a string.
      default: label for leaves that match no rule; `None` makes that an error.

    Returns:
      A function `params -> labels` (a tree of strings with the structure of `params`).

    Raises:
      ValueError: at construction, a rule that is not a `(pattern, label)` pair, an invalid
        regex or a label that is neither a string nor a callable; when called, a leaf that
        matches no rule (without `default`) or a callable label returning a non-string,
        naming the leaf's path.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.labels import label_by_rules
      >>> labels = label_by_rules([(r"embed", "adam"), (r".*", "muon")])
      >>> labels({"embed": jnp.zeros((4, 2)), "w": jnp.zeros((2, 2))})
      {'embed': 'adam', 'w': 'muon'}

    References:
      optax authors, `optax.partition
      <https://optax.readthedocs.io/en/latest/api/combining_optimizers.html>`_, 2024.
    """
    for pattern, label in _compiled(rules, "rule", "label"):
        if not (isinstance(label, str) or callable(label)):
            raise ValueError(f"rule {pattern.pattern!r}: label must be a string or callable, "
                             f"got {label!r}")
    # Each rule's value is (label, matched): the leaf's label is resolved after matching.
    tagged = by_path([(pattern, (label,)) for pattern, label in rules],
                     default=_REQUIRED if default is None else (default,), what="labelling rule")

    def labels_fn(params: Any) -> Any:
        def resolve(path, leaf, tag):
            if isinstance(leaf, optax.MaskedNode):
                return leaf
            label = tag[0](leaf) if callable(tag[0]) else tag[0]
            if not isinstance(label, str):
                raise ValueError(f"label for {path_to_str(path)!r} must be a string, got "
                                 f"{label!r}")
            return label

        tags = tagged(params)
        return jax.tree.map_with_path(resolve, params, tags,
                                      is_leaf=lambda x: isinstance(x, optax.MaskedNode))

    return labels_fn


def describe(labels: Any | Callable[[Any], Any], params: Any) -> dict[str, Any]:
    """The label of every parameter path: what a labelling decided, in leaf order.

    Labels decided by path names (`muon_adam_labels`, `label_by_rules`, SkewAdam's roles,
    see `optax_snoo.skew_adam_roles`) are easy to get silently wrong when a model names its
    layers differently; print this once to check.

    Args:
      labels: a tree of labels with the structure of `params`, or a function
        `params -> labels` (as `optax.partition` takes).
      params: the params tree (arrays or `jax.ShapeDtypeStruct`s: only paths and shapes
        are read).

    Returns:
      A dict from each leaf's path string (`path_to_str`) to its label, in
      `jax.tree.leaves` order.

    Raises:
      ValueError: if a tree of labels does not have the structure of `params`, or two
        leaves have the same path string.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.labels import describe, muon_adam_labels
      >>> params = {"wte": {"embedding": jnp.zeros((8, 4))},
      ...           "blocks": [{"attn": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros(4)}}]}
      >>> describe(muon_adam_labels, params)
      {'blocks/0/attn/bias': 'adam', 'blocks/0/attn/kernel': 'muon', 'wte/embedding': 'adam'}

    References:
      optax authors, `optax.partition
      <https://optax.readthedocs.io/en/latest/api/combining_optimizers.html>`_, 2024.
    """
    if callable(labels):
        tree = labels(params)
    else:
        tree = labels
        if jax.tree.structure(tree) != jax.tree.structure(params):
            raise ValueError(
                f"labels must have the structure of params (or be a function of params); "
                f"got labels {jax.tree.structure(tree)} for params "
                f"{jax.tree.structure(params)}")
    out: dict[str, Any] = {}
    for path, label in jax.tree_util.tree_leaves_with_path(tree):
        name = path_to_str(path)
        if name in out:
            raise ValueError(f"two parameters have the path {name!r}; describe needs "
                             f"distinct path strings")
        out[name] = label
    return out


def muon_adam_labels(params: Any) -> Any:
    """Label hidden matrices `"muon"` and everything else `"adam"` (`MUON_ADAM_RULES`).

    In order: a path component named like an embedding, the head, an unembedding or a
    router -> "adam"; a norm (`ln*`, `*norm*`) -> "adam"; a leaf named `bias` or `scale`
    -> "adam"; else "muon" for ndim >= 2 (MoE expert stacks too) and "adam" for vectors
    and scalars. `describe(muon_adam_labels, params)` shows the result.

    Args:
      params: a params tree (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
      A tree of `"muon"`/`"adam"` with the structure of `params`.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo.labels import muon_adam_labels
      >>> muon_adam_labels({"lm_head": jnp.zeros((4, 8)), "mlp": jnp.zeros((4, 4)),
      ...                   "ln_f": {"scale": jnp.ones(4)}})
      {'lm_head': 'adam', 'ln_f': {'scale': 'adam'}, 'mlp': 'muon'}

    References:
      K. Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """
    return label_by_rules(MUON_ADAM_RULES)(params)


def _check_labels(labels: Any, known: Mapping[str, Any]) -> None:
    def check(path, label):
        if label not in known:
            raise ValueError(
                f"parameter {path_to_str(path)!r} has label {label!r}, which has no transform; "
                f"transforms are given for {sorted(known)}")
        return label

    jax.tree.map_with_path(check, labels)


def partition(transforms: Mapping[str, optax.GradientTransformation],
              labels: Any | Callable[[Any], Any]
              ) -> optax.GradientTransformationExtraArgs:
    """`optax.partition` that first checks every label has a transform.

    Args:
      transforms: label -> transformation.
      labels: a tree of labels or a function `params -> labels` (e.g. from
        `label_by_rules`).

    Returns:
      The partitioned transformation. `init` raises a `ValueError` naming the first
      parameter path whose label has no transform.

    Example:
      >>> import jax.numpy as jnp, optax, optax_snoo
      >>> from optax_snoo.labels import muon_adam_labels, partition
      >>> tx = partition({"muon": optax_snoo.muon(0.02), "adam": optax.adamw(3e-4)},
      ...                muon_adam_labels)
      >>> state = tx.init({"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)})
      >>> only_muon = partition({"muon": optax.sgd(0.1)}, muon_adam_labels)
      >>> only_muon.init({"b": jnp.zeros(4)})  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: parameter 'b' has label 'adam', which has no transform; ...

    References:
      optax authors, `optax.partition
      <https://optax.readthedocs.io/en/latest/api/combining_optimizers.html>`_, 2024.
    """
    inner = optax.partition(transforms, labels)

    def init(params):
        _check_labels(labels(params) if callable(labels) else labels, transforms)
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init, inner.update)
