"""A recipe on a user's own tree (issue 34, 4.5): an embedding named ``tok_emb`` and a head
named ``out`` must not go silently to Muon. The recipes' embedding and head groups are
required and claim their matches: without ``adam_patterns`` their ``init`` (and
`recipes.describe`) refuses in one line naming the group, its pattern and ``labels=``;
with them, the leaves go to those groups; `recipes.describe` prints every leaf's group."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from optax_snoo import recipes
from optax_snoo.labels import path_to_str

# A user's GPT: our block names, but its own embedding and head names.
USER = {
    "tok_emb": {"embedding": jnp.ones((32, 16))},
    "blocks": [{"ln_1": {"scale": jnp.ones(16)},
                "attn": {"c_q": {"kernel": jnp.ones((16, 16))},
                         "c_k": {"kernel": jnp.ones((16, 16))},
                         "c_v": {"kernel": jnp.ones((16, 16))},
                         "c_proj": {"kernel": jnp.ones((16, 16)), "bias": jnp.zeros(16)}},
                "mlp": {"c_fc": {"kernel": jnp.ones((16, 32))},
                        "c_proj": {"kernel": jnp.ones((32, 16))}}}],
    "ln_f": {"scale": jnp.ones(16)},
    "out": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros(32)},
}
PATTERNS = {"embed": "tok_emb", "head": "^out/"}
# The recipes whose groups place the embedding and the head by name.
RECIPES = ["track3_baseline", "snoo_track3_baseline", "track3_soap_muon", "track3_record",
           "muonh", "muloco_normuonh", "track3_newton_muon", "modded_nanogpt",
           "modded_nanogpt_muon"]


def paths(tree):
    return [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def build(name, **options):
    recipe = recipes.get(name)
    return recipe(recipe.record_steps or 100, **options)


@pytest.mark.parametrize("name", RECIPES)
def test_a_tree_naming_its_embedding_otherwise_is_refused_in_one_line(name):
    """Without adam_patterns the embedding matches no group: refused, not trained by Muon."""
    with pytest.raises(ValueError) as err:
        build(name).init(USER)
    message = str(err.value)
    assert "\n" not in message
    group = re.match(r"Adam group '(embed|head)' matches no parameter \(pattern '(.+?)'\)",
                     message)
    assert group, message
    assert "adam_patterns" in message and "labels=" in message, message
    with pytest.raises(ValueError, match=re.escape(message)):
        recipes.describe(name, USER)  # the same refusal


@pytest.mark.parametrize("name", RECIPES)
def test_adam_patterns_put_embedding_and_head_in_their_groups(name):
    groups = recipes.describe(name, USER, adam_patterns=PATTERNS)
    assert list(groups) == paths(USER)
    assert groups["tok_emb/embedding"] == "embed" and groups["out/kernel"] == "head"
    hidden = [p for p in groups if p.startswith("blocks/") and p.endswith("/kernel")]
    partition = {p: g.split("/")[0] for p, g in groups.items()}  # "muon/<Muon group>"
    assert {partition[p] for p in hidden} == {"muon"}
    # 1-D leaves stay with the first Adam group they match, never Muon (the head's bias too).
    assert all(groups[p] not in ("muon", "embed") for p in groups if USER_NDIM[p] == 1)
    state = build(name, adam_patterns=PATTERNS).init(USER)
    owners = state_owners(state)
    assert owners["tok_emb/embedding"] == "embed" and owners["out/kernel"] == "head"
    assert owners == partition  # describe says what init does


USER_NDIM = {path_to_str(p): leaf.ndim
             for p, leaf in jax.tree_util.tree_flatten_with_path(USER)[0]}


def state_owners(state):
    """Each leaf's group, read from the partition's masked first-moment trees."""
    partitions = [x for x in jax.tree.leaves(
        state, is_leaf=lambda x: hasattr(x, "inner_states")) if hasattr(x, "inner_states")]
    assert len(partitions) == 1  # inside Snoo, EMA-Nesterov, a chain...
    state, owners = partitions[0], {}
    for name, group in state.inner_states.items():
        mu = group.inner_state[0].mu
        for path, leaf in jax.tree_util.tree_flatten_with_path(
                mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]:
            if not isinstance(leaf, optax.MaskedNode):
                owners[path_to_str(path)] = name
    return owners


def test_describe_prints_every_leaf_with_its_group(capsys):
    params = jax.eval_shape(lambda: USER)  # shapes are enough
    print(recipes.describe("track3_record", params, adam_patterns=PATTERNS))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["leaf", "group", "(track3_record)"]
    table = dict(line.split() for line in lines[1:-1])
    assert list(table) == paths(USER)
    want = {"tok_emb/embedding": "embed", "out/kernel": "head", "out/bias": "vectors",
            "ln_f/scale": "gains", "blocks/0/ln_1/scale": "gains",
            "blocks/0/attn/c_proj/bias": "attn_proj_bias"}
    assert {p: table[p] for p in want} == want
    assert {table[p] for p in table if p.endswith("/kernel") and p.startswith("blocks/")} == {
        "muon"}
    counts = {g: sum(v == g for v in table.values()) for g in set(table.values())}
    assert sorted(lines[-1].split(", ")) == sorted(f"{n} in {g}" for g, n in counts.items())
    assert all(len(line.split()) == 2 for line in lines[1:-1])
