"""`optax_snoo.eval_params` on what a Flax user has: an ``nnx.State`` of params and an
``nnx.Optimizer``'s state, in each of its forms, give the readout a plain optax run of the
same steps gives; the wrong params are refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_snoo

STEPS = 6


class Net(nnx.Module):
    """An embedding, a matrix, a norm (with a batch statistic, not a parameter) and a head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.hidden = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.norm(jnp.tanh(self.hidden(self.embed(tokens)))))


def not_embedding(params):
    """The tail EMA's mask, in the params' own container (a State inside nnx.Optimizer)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "embed" not in jax.tree_util.keystr(path), params)


def recipe_like():
    """``chain(ema_nesterov(muon + adam), tail_ema, tail_velocity,
    reference_interpolation)`` as the Track 3 records are built, with the lookahead on
    at the end, the tail EMA and velocity started early and the interpolation on for the
    last two updates (all readouts differ from the weights after STEPS updates)."""
    return optax.chain(
        optax_snoo.ema_nesterov(optax_snoo.muon(0.05, adam_learning_rate=0.02), beta0=0.5,
                                gamma=0.7, prefill=1, stop=100),
        optax_snoo.tail_ema(start=2, horizon=3.0, blend=0.6, mask=not_embedding),
        optax_snoo.tail_velocity(start=2, beta=0.5, gamma=-1.0, max_ratio=0.5,
                                 mask=not_embedding),
        optax_snoo.reference_interpolation(capture=3, start=STEPS - 1, gamma=-0.3))


def batch(t):
    rng = np.random.default_rng(t)
    return jnp.asarray(rng.integers(0, 11, (4, 5))), jnp.asarray(rng.integers(0, 11, (4, 5)))


def loss_fn(model, tokens, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


@pytest.fixture(scope="module")
def trained():
    """An nnx.Optimizer trained STEPS steps, and a plain optax run fed the same gradients
    (the reference: eval_params on plain pytrees, as the library's other tests use it)."""
    model = Net(nnx.Rngs(0))
    tx = recipe_like()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = tx.init(params)
    for t in range(STEPS):
        grads = nnx.grad(loss_fn)(model, *batch(t))
        opt.update(model, grads)
        updates, state = tx.update(nnx.to_pure_dict(grads), state, params)
        params = optax.apply_updates(params, updates)
    ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)  # the two runs are the same run
    return model, opt, params, state


def assert_same_tree(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_the_reference_readout_differs_from_the_weights(trained):
    _, _, params, state = trained
    ev = optax_snoo.eval_params(params, state)
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        other = ev
        for entry in path:
            other = other[entry.key]
        # every leaf: the lookahead is removed everywhere, the tail EMA on all but embed
        assert np.abs(np.asarray(other) - np.asarray(value)).max() > 1e-4, path


@pytest.mark.parametrize("params_form", ["nnx.State", "pure dict"])
@pytest.mark.parametrize("state_form", ["opt.opt_state", "nnx.state(opt, nnx.OptState)",
                                        "its pure dict"])
def test_every_flax_form_gives_the_plain_readout(trained, params_form, state_form):
    model, opt, params, state = trained
    want = optax_snoo.eval_params(params, state)
    flax_params = nnx.state(model, nnx.Param)
    if params_form == "pure dict":
        flax_params = nnx.to_pure_dict(flax_params)
    flax_state = {"opt.opt_state": opt.opt_state,
                  "nnx.state(opt, nnx.OptState)": nnx.state(opt, nnx.OptState),
                  "its pure dict": nnx.to_pure_dict(nnx.state(opt, nnx.OptState))}[state_form]
    got = optax_snoo.eval_params(flax_params, flax_state)
    if params_form == "nnx.State":  # the caller's own types come back, for nnx.update
        assert isinstance(got, nnx.State)
        assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(got))
        got = nnx.to_pure_dict(got)
    assert_same_tree(got, want)


def test_under_jit_and_into_the_model(trained):
    model, opt, params, state = trained
    # (both jitted: XLA fuses the velocity's norms, rounding differently from eager)
    want = jax.jit(optax_snoo.eval_params)(params, state)
    got = jax.jit(optax_snoo.eval_params)(nnx.state(model, nnx.Param), opt.opt_state)
    evaluated = nnx.clone(model)
    nnx.update(evaluated, got)
    assert_same_tree(nnx.to_pure_dict(nnx.state(evaluated, nnx.Param)), want)
    # the model itself is untouched: its weights are still the trained ones
    assert_same_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)


def test_params_that_are_not_the_optimizers_are_refused(trained):
    _, opt, params, _ = trained
    with pytest.raises(ValueError, match=r"^eval_params: the optimizer state's "
                                         r"EmaNesterovState averages leaves the params do "
                                         r"not have: \['embed/embedding', 'head/bias', "
                                         r"'head/kernel', 'hidden/bias'\] \.\.\.; pass the "
                                         r"params the optimizer updates"):
        optax_snoo.eval_params({"w": jnp.zeros(3)}, opt.opt_state)
    wrong = {**params, "head": {**params["head"], "bias": jnp.zeros(3)}}
    with pytest.raises(ValueError, match=r"^eval_params: head/bias has shape \(3,\) in the "
                                         r"params but \(11,\) in the optimizer state's "
                                         r"EmaNesterovState$"):
        optax_snoo.eval_params(wrong, nnx.state(opt, nnx.OptState))
