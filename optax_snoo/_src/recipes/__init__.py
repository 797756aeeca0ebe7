"""Every recipe of the library, registered by name, and `describe`.

Importing this package registers the recipes of its modules in `REGISTRY`:
`stacks` (AdamW, Muon, NorMuon, SkewAdam, Adafactor, K-FAC, Newton-Muon and their Snoo
twins), `gpt2_medium` (modded-nanogpt's GPT-2 Medium record), and Track 3's by record:
`track3_baseline` (#36), `track3_soap` (#44, #46), `track3_hyperball` (#5, #8, #13),
`track3_newton_muon` (#15), `track3_adam` (#2), `track3_muon_variants` (#7, #18, #22, #26,
#28), `track3_contra` (#9, #11, #17), `track3_psgd` (#33), `track3_shampoo` (#21, #35),
`track3_soaph` (#27, #19, #25), `track3_soft_muon` (#20, #32), `track3_muown` (#23, #31),
`track3_aurora_proj` (#30, #34, #38), `track3_aurora_ema` (#40, #42, #41, #43).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_snoo._src.labels import describe as _describe
from optax_snoo._src.recipes import (  # noqa: F401  (each module registers its recipes)
    gpt2_medium,
    stacks,
    track3_adam,
    track3_aurora_ema,
    track3_aurora_proj,
    track3_baseline,
    track3_contra,
    track3_hyperball,
    track3_muon_variants,
    track3_muown,
    track3_newton_muon,
    track3_psgd,
    track3_shampoo,
    track3_soap,
    track3_soaph,
    track3_soft_muon,
)
from optax_snoo._src.recipes.base import REGISTRY, Recipe, get

__all__ = ["Groups", "describe"]


class Groups(dict[str, str]):
    """Each params leaf's path -> its group in a recipe (`describe`); prints as a table."""

    def __init__(self, recipe: str, groups: dict[str, str]):
        super().__init__(groups)
        self.recipe = recipe

    def __str__(self) -> str:
        width = max([len("leaf"), *map(len, self)])
        lines = [f"{'leaf':<{width}}  group ({self.recipe})"]
        lines += [f"{path:<{width}}  {group}" for path, group in self.items()]
        counts: dict[str, int] = {}
        for group in self.values():
            counts[group] = counts.get(group, 0) + 1
        lines.append(", ".join(f"{n} in {g}" for g, n in counts.items()))
        return "\n".join(lines)


def describe(recipe: Recipe | str, params: Any, **options: Any) -> Groups:
    """Each leaf's group when ``recipe`` trains ``params``: print it once on a new model.

    A recipe sends leaves to its groups by path names; a model that names its embedding
    ``tok_emb`` or its head ``out`` needs ``adam_patterns=`` (or ``labels=``). This shows
    what the recipe decides, and raises the error its ``init`` would (a required group
    matching nothing, a leaf in no group).

    Args:
      recipe: a `Recipe` or its registered name.
      params: the params tree (arrays or ``jax.ShapeDtypeStruct``: only paths and shapes
        are read).
      **options: the recipe's options (``labels``, ``adam_patterns``...).

    Returns:
      A dict from each leaf's path (in leaf order) to its group; ``print`` gives a table.

    Example:
      >>> import jax.numpy as jnp
      >>> from optax_snoo import recipes
      >>> params = {"tok_emb": jnp.ones((16, 4)), "h": {"kernel": jnp.ones((4, 4))},
      ...           "out": {"kernel": jnp.ones((4, 16))}}
      >>> print(recipes.describe("track3_baseline", params,
      ...                        adam_patterns={"embed": "tok_emb", "head": "^out/"}))
      leaf        group (track3_baseline)
      h/kernel    muon
      out/kernel  head
      tok_emb     embed
      1 in muon, 1 in head, 1 in embed
    """
    recipe = get(recipe) if isinstance(recipe, str) else recipe
    stack = recipe.stack(recipe.record_steps or max(recipe.min_steps, 1000), **options)
    one_group = lambda tree: jax.tree.map(lambda _: recipe.name, tree)
    groups = _describe(one_group if stack.groups is None else stack.groups, params)
    return Groups(recipe.name, groups)


# Registered names, for `dir()`.
_ = REGISTRY
