"""Label a params tree by ordered path-pattern rules, for `optax.partition`.

A rule is `(pattern, label)`: `pattern` is a regular expression searched in the leaf's
path written as `"blocks/0/attn/c_q/kernel"`; `label` is a string or a callable of the
leaf (its shape is what matters) returning one. The first matching rule wins. A leaf that
matches no rule, or a label with no transform, is an error that names the path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

Label = str | Callable[[Any], str]
Rule = tuple[str, Label]

__all__ = [
    "MUON_ADAM_RULES",
    "label_by_rules",
    "muon_adam_labels",
    "partition",
    "path_to_str",
]


def path_to_str(path: Sequence[Any]) -> str:
    """Write a pytree key path as `"a/0/b"`.

    The `.value` attribute of Flax NNX variables is dropped, so the path of an
    `nnx.State` leaf reads like the module attribute it came from.
    """
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            if key.name == "value":
                continue
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _matrix_or_vector(leaf: Any) -> str:
    return "muon" if len(getattr(leaf, "shape", ())) >= 2 else "adam"


# Hidden matrices (and MoE expert stacks) go to Muon; embeddings, the head, norms,
# biases and scalars go to Adam (SPEC §2.3), and so does the small MoE router, as in the
# SkewAdam paper's Muon baseline. Names cover nanoGPT/Flax/Llama-style models.
MUON_ADAM_RULES: tuple[Rule, ...] = (
    (r"(^|/)(wte|wpe|embed\w*|tok_embeddings|lm_head|head|unembed\w*|router)(/|$)", "adam"),
    (r"(^|/)(ln\w*|\w*norm\w*)(/|$)", "adam"),
    (r"(^|/)(bias|scale)$", "adam"),
    (r".*", _matrix_or_vector),
)


def label_by_rules(rules: Sequence[Rule], *, default: str | None = None
                   ) -> Callable[[Any], Any]:
    """Build a labelling function for `optax.partition` from ordered path rules.

    Args:
      rules: `(pattern, label)` pairs, tried in order; `pattern` is searched (`re.search`)
        in the path string (see `path_to_str`); `label` is a string or a callable of the
        leaf returning a string.
      default: label for leaves that match no rule; `None` makes that an error.

    Returns:
      A function `params -> labels` (a tree of strings with the structure of `params`).

    Example:
      >>> labels = label_by_rules([(r"embed", "adam"), (r".*", "muon")])
      >>> labels({"embed": jnp.zeros((4, 2)), "w": jnp.zeros((2, 2))})
      {'embed': 'adam', 'w': 'muon'}
    """
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise ValueError(f"each rule must be a (pattern, label) pair, got {rule!r}")
        pattern, label = rule
        if not (isinstance(label, str) or callable(label)):
            raise ValueError(f"rule {pattern!r}: label must be a string or callable, got {label!r}")
        try:
            compiled.append((re.compile(pattern), label))
        except re.error as err:
            raise ValueError(f"rule pattern {pattern!r} is not a valid regex: {err}") from None

    def labels_fn(params: Any) -> Any:
        def label_leaf(path, leaf):
            name = path_to_str(path)
            for regex, label in compiled:
                if regex.search(name):
                    result = label(leaf) if callable(label) else label
                    if not isinstance(result, str):
                        raise ValueError(f"label for {name!r} must be a string, got {result!r}")
                    return result
            if default is None:
                patterns = [r.pattern for r, _ in compiled]
                raise ValueError(f"parameter {name!r} matches no labelling rule {patterns}")
            return default

        return jax.tree.map_with_path(label_leaf, params)

    return labels_fn


def muon_adam_labels(params: Any) -> Any:
    """Label hidden matrices `"muon"` and everything else `"adam"` (`MUON_ADAM_RULES`)."""
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
      >>> tx = partition({"muon": muon(0.02), "adam": optax.adamw(3e-4)}, muon_adam_labels)
    """
    inner = optax.partition(transforms, labels)

    def init(params):
        _check_labels(labels(params) if callable(labels) else labels, transforms)
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init, inner.update)
