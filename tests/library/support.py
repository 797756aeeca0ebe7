"""Problems that several library test modules run: `test_properties`' random trees
(hypothesis strategies) and its check that a transform runs on them, and
`test_kfac_transform`'s K-FAC layers with their deterministic curvature and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

from optax_snoo.kfac import LayerCurvature

# ---- random trees (test_properties)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SHAPES = st.one_of(st.just(()), st.tuples(st.integers(0, 5)),
                   st.tuples(st.integers(0, 6), st.integers(1, 6)),
                   st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)))
NAMES = st.sampled_from(["kernel", "bias", "w", "embedding", "scale", "experts", "router"])


@st.composite
def trees(draw, shapes=SHAPES, min_leaves=1):
    """A nested dict of 1-4 leaves (`[d0, d1, ...]` shapes, one dtype per leaf)."""
    n = draw(st.integers(min_leaves, 4))
    tree = {}
    for i in range(n):
        shape = draw(shapes)
        dtype = draw(st.sampled_from(DTYPES))
        path = [f"{draw(NAMES)}_{i}"] if draw(st.booleans()) else [f"l{i}", draw(NAMES)]
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = (shape, dtype)
    return tree


def materialise(spec, seed=0):
    """Params and 3 steps of gradients for a tree of `(shape, dtype)` leaves."""
    leaves, treedef = jax.tree.flatten(spec, is_leaf=lambda x: isinstance(x, tuple) and len(
        x) == 2 and isinstance(x[0], tuple))
    rng = np.random.default_rng(seed)
    make = lambda s, d, scale: jnp.asarray(scale * rng.standard_normal(s), d)
    params = treedef.unflatten([make(s, d, 0.5) for s, d in leaves])
    grads = [treedef.unflatten([make(s, d, 1.0) for s, d in leaves]) for _ in range(3)]
    return params, grads


def signature(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype, getattr(x, "sharding", None))
                                      for x in jax.tree.leaves(tree)]


def check_runs(tx, params, grads, **extra):
    """Three jitted updates: finite, param-shaped updates; a state of stable signature."""
    state = tx.init(params)
    before = signature(state)
    update = jax.jit(lambda g, s, p, **kw: tx.update(g, s, p, **kw))
    for g in grads:
        updates, state = update(g, state, params, **extra)
        assert jax.tree.structure(updates) == jax.tree.structure(params)
        for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
            assert u.shape == p.shape
            assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32)))), (u, p.dtype)
        assert signature(state) == before
        params = optax.apply_updates(params, updates)
    return params


KERNELS = st.tuples(st.integers(1, 5), st.integers(1, 5))


@st.composite
def kfac_problems(draw):
    """Params with 1-2 Dense layers (kernel, maybe bias) plus other leaves; curvature."""
    spec = draw(trees())
    spec = {k: v for k, v in spec.items() if not k.startswith("l")}  # no stray "kernel"s
    layers = {}
    for i in range(draw(st.integers(1, 2))):
        d_in, d_out = draw(KERNELS)
        dtype = draw(st.sampled_from(DTYPES))
        layer = {"kernel": ((d_in, d_out), dtype)}
        if draw(st.booleans()):
            layer["bias"] = ((d_out,), dtype)
        layers[f"dense{i}"] = layer
    return {**spec, **layers}, draw(st.integers(0, 1000))


# ---- K-FAC layers, curvature and gradients (test_kfac_transform)

# Layers: (kernel shape, stack axes, has_bias). "scale" is not preconditioned.
LAYERS = {"l1": ((4, 6), 0, True), "l2": ((6, 3), 0, False), "experts": ((2, 3, 4), 1, True)}


def make_params(dtype=jnp.float32):
    rng = np.random.default_rng(1)
    params = {"scale": jnp.asarray(rng.normal(size=3), dtype)}
    for name, (shape, nstack, has_bias) in LAYERS.items():
        params[name] = {"kernel": jnp.asarray(rng.normal(size=shape), dtype)}
        if has_bias:
            params[name]["bias"] = jnp.asarray(rng.normal(size=shape[:nstack] + shape[-1:]), dtype)
    return params


def spd(rng, stack, n):
    b = rng.normal(size=(*stack, n, 2 * n))
    scale = rng.uniform(0.5, 2.0)
    return (scale * (b @ np.swapaxes(b, -1, -2) / (2 * n) + 0.05 * np.eye(n))).astype(np.float32)


def curvature_at(t):
    """Deterministic batch factors for step t (float32 numpy), keyed like the params."""
    rng = np.random.default_rng(10_000 + t)
    out = {}
    for name, (shape, nstack, has_bias) in LAYERS.items():
        stack = shape[:nstack]
        d_in = shape[nstack] + int(has_bias)
        out[name] = {"kernel": LayerCurvature(spd(rng, stack, d_in), spd(rng, stack, shape[-1]))}
    return out


def grads_at(t, params):
    rng = np.random.default_rng(20_000 + t)
    return jax.tree.map(lambda p: np.asarray(rng.normal(size=p.shape), np.float32), params)


TEMPLATE = curvature_at(0)


def fsdp_matrices():
    """Eight float32 matrices (a block's q, k, v, o, two MLP-in and two MLP-out shapes,
    32-64 wide) with their rows split over an 8-device "fsdp" mesh: the tree the
    compiled-collectives tests of the per-matrix transforms read."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    shapes = {"q": (32, 32), "k": (32, 32), "v": (32, 32), "o": (32, 32),
              "fc": (32, 64), "fc2": (32, 64), "proj": (64, 32), "proj2": (64, 32)}
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    return {k: jax.device_put(jnp.ones(s, jnp.float32), rows) for k, s in shapes.items()}


def compiled_update(tx, params):
    """`(tx.init(params), the cost of tx's update compiled on params)` (`benchmarks.hlo`)."""
    from benchmarks import hlo

    state = tx.init(params)
    return state, hlo.analyze(jax.jit(tx.update).lower(params, state).compile().as_text())


def assert_lies_like(trees, params):
    """Every leaf of each tree of `trees` carries the sharding of its param in `params`."""
    for tree in trees:
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(params), strict=True):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
