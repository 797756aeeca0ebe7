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
