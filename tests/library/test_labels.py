"""Path-rule labelling for optax.partition."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from optax_snoo import labels as lb

GPT_LIKE = {
    "wte": {"embedding": jnp.zeros((65, 8))},
    "wpe": {"embedding": jnp.zeros((16, 8))},
    "blocks": [{
        "ln_1": {"scale": jnp.ones(8), "bias": jnp.zeros(8)},
        "attn": {"c_q": {"kernel": jnp.zeros((8, 8))}, "c_proj": {"kernel": jnp.zeros((8, 8)),
                                                                  "bias": jnp.zeros(8)}},
        "moe": {"router": {"kernel": jnp.zeros((8, 4))},
                "experts": {"w_fc": jnp.zeros((4, 8, 16))}},
    }],
    "ln_f": {"scale": jnp.ones(8)},
    "lm_head": {"kernel": jnp.zeros((8, 65))},
    "gain": jnp.ones(()),
}


def test_path_to_str_reads_like_attribute_paths():
    paths = [lb.path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(GPT_LIKE)[0]]
    assert "blocks/0/attn/c_q/kernel" in paths
    assert "wte/embedding" in paths


def test_muon_adam_rules_on_a_transformer():
    labels = lb.muon_adam_labels(GPT_LIKE)
    assert labels["wte"]["embedding"] == "adam"
    assert labels["wpe"]["embedding"] == "adam"
    assert labels["lm_head"]["kernel"] == "adam"
    assert labels["ln_f"]["scale"] == "adam"
    block = labels["blocks"][0]
    assert block["ln_1"] == {"scale": "adam", "bias": "adam"}
    assert block["attn"]["c_q"]["kernel"] == "muon"
    assert block["attn"]["c_proj"] == {"kernel": "muon", "bias": "adam"}
    assert block["moe"]["experts"]["w_fc"] == "muon"   # 3-D expert stacks are matrices too
    assert block["moe"]["router"]["kernel"] == "adam"
    assert labels["gain"] == "adam"


def test_nnx_state_paths_drop_the_value_attribute():
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    labels = lb.muon_adam_labels(nnx.state(model, nnx.Param))
    assert jax.tree.leaves(labels) == ["adam", "muon"]   # bias, kernel


def test_first_matching_rule_wins_and_callables_see_the_leaf():
    fn = lb.label_by_rules([(r"head", "frozen"), (r".*", lambda x: f"nd{x.ndim}")])
    out = fn({"head": jnp.zeros(2), "w": jnp.zeros((2, 2)), "v": jnp.zeros(3)})
    assert out == {"head": "frozen", "w": "nd2", "v": "nd1"}


def test_unmatched_leaf_names_its_path():
    fn = lb.label_by_rules([(r"^w$", "a")])
    with pytest.raises(ValueError, match=r"'blocks/0/v' matches no labelling rule"):
        fn({"w": jnp.zeros(1), "blocks": [{"v": jnp.zeros(1)}]})
    assert lb.label_by_rules([(r"^w$", "a")], default="b")({"w": 1.0, "v": 2.0}) == {
        "w": "a", "v": "b"}


@pytest.mark.parametrize("rules, match", [
    ([("(", "a")], "not a valid regex"),
    ([("a",)], r"\(pattern, label\) pair"),
    ([("a", 3)], "label must be a string or callable"),
])
def test_bad_rules(rules, match):
    with pytest.raises(ValueError, match=match):
        lb.label_by_rules(rules)


def test_partition_checks_every_label_has_a_transform():
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    tx = lb.partition({"muon": optax.sgd(0.1)}, lb.muon_adam_labels)
    with pytest.raises(ValueError, match=r"parameter 'b' has label 'adam', which has no transform"):
        tx.init(params)
    tx = lb.partition({"muon": optax.sgd(0.1), "adam": optax.sgd(1.0)}, lb.muon_adam_labels)
    state = tx.init(params)
    u, _ = tx.update({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, state, params)
    assert float(u["w"][0, 0]) == pytest.approx(-0.1)
    assert float(u["b"][0]) == pytest.approx(-1.0)


# ----------------------------------------------------------------------------- one path rule

def test_path_to_str_is_the_shared_rule():
    from optax_snoo._src import utils
    assert lb.path_to_str is utils.path_to_str
    # Keys holding "/" name the same leaf as the nested dicts they abbreviate.
    flat = jax.tree_util.tree_flatten_with_path({"l1/kernel": 0})[0][0][0]
    nested = jax.tree_util.tree_flatten_with_path({"l1": {"kernel": 0}})[0][0][0]
    assert lb.path_to_str(flat) == lb.path_to_str(nested) == "l1/kernel"


def test_rules_take_compiled_patterns_and_reject_other_types():
    import re
    fn = lb.label_by_rules([(re.compile(r"^W$", re.IGNORECASE), "a")], default="b")
    assert fn({"w": 0, "v": 0}) == {"w": "a", "v": "b"}
    with pytest.raises(ValueError, match="pattern must be a regex string or an re.Pattern"):
        lb.label_by_rules([(3, "a")])


def test_by_path_gives_any_value_first_match_wins():
    """Non-string values (numbers, schedules, tuples) as they are; a callable default
    sees the leaf; `value` reads one path string; masked leaves stay masked."""
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    rules = lb.by_path([(r"(^|/)mlp(/|$)", 2.0), (r"attn", schedule), (r"^w$", (1, "a"))],
                       default=lambda leaf: float(leaf.ndim))
    tree = {"blocks": [{"mlp": {"k": jnp.ones((2, 2))}, "attn": {"k": jnp.ones((2, 2))}}],
            "w": jnp.ones(3), "scale": jnp.ones(3), "masked": optax.MaskedNode()}
    out = rules(tree)
    assert out["blocks"][0]["mlp"]["k"] == 2.0 and out["blocks"][0]["attn"]["k"] is schedule
    assert out["w"] == (1, "a") and out["scale"] == 1.0
    assert isinstance(out["masked"], optax.MaskedNode)
    # "blocks/0/mlp_attn/k" is not an mlp module: the first rule's anchors; the second's not.
    assert rules.value("blocks/0/mlp_attn/k") is schedule
    assert rules.value("blocks/0/mlp/attn/k") == 2.0  # first match wins


def test_by_path_without_default_names_the_unmatched_path():
    rules = lb.by_path([(r"^w$", 1.0)], what="Muon group")
    with pytest.raises(ValueError, match=r"parameter 'blocks/0/v' matches no Muon group "
                                         r"\['\^w\$'\]"):
        rules({"w": jnp.zeros(1), "blocks": [{"v": jnp.zeros(1)}]})
    with pytest.raises(ValueError, match="not a valid regex"):
        lb.by_path([("(", 1.0)])


# ----------------------------------------------------------------------------- describe

def test_describe_lists_every_path_and_its_label():
    got = lb.describe(lb.muon_adam_labels, GPT_LIKE)
    assert got == {
        "blocks/0/attn/c_proj/bias": "adam", "blocks/0/attn/c_proj/kernel": "muon",
        "blocks/0/attn/c_q/kernel": "muon", "blocks/0/ln_1/bias": "adam",
        "blocks/0/ln_1/scale": "adam", "blocks/0/moe/experts/w_fc": "muon",
        "blocks/0/moe/router/kernel": "adam", "gain": "adam", "lm_head/kernel": "adam",
        "ln_f/scale": "adam", "wpe/embedding": "adam", "wte/embedding": "adam"}
    assert list(got) == [lb.path_to_str(p) for p, _ in
                         jax.tree_util.tree_flatten_with_path(GPT_LIKE)[0]]
    # A tree of labels reads the same as the function that made it.
    assert lb.describe(lb.muon_adam_labels(GPT_LIKE), GPT_LIKE) == got


def test_describe_on_nnx_state_and_shapes():
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    shapes = jax.eval_shape(lambda: nnx.state(model, nnx.Param))
    assert lb.describe(lb.muon_adam_labels, shapes) == {"bias": "adam", "kernel": "muon"}


def test_describe_rejects_mismatched_trees_and_clashing_paths():
    with pytest.raises(ValueError, match="structure of params"):
        lb.describe({"w": "muon"}, {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match="two parameters have the path 'a/b'"):
        lb.describe(lb.muon_adam_labels, {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}})
