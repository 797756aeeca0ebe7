"""The optax matrix: checks every transform of the library must pass.

Each `check_*` takes a transform (or a factory) and a params tree chosen by the caller,
runs a few steps with deterministic pseudo-random gradients, and asserts. They mirror
optax's own `contrib/_common_test.py` and `_sharding_test.py`: jit, low-precision params,
schedules, `inject_hyperparams`, `MultiSteps`, `partition`, `nnx.Optimizer`, sharded
state on an 8-device CPU mesh and an Orbax round trip mid-run.

The checks that compare two float32 programs (jitted and op by op, injected and plain,
MultiSteps and the mean gradient, a partition group and the transform alone, sharded and
unsharded) round differently in each, so with ``float64=`` (the transform's computation
for float64 params: often the transform itself, when its state follows the params'
dtype) both are measured against the float64 run and the first may be at most 4x less
accurate than the second (`references.error`). A transform that ends in a randomized
rounding to a grid (``grid=jnp.bfloat16``: stochastic or dithered rounding) is compared
on that grid instead: a float32 value within float32 rounding of its random threshold
may go to either neighbour, so the two runs may end at most one grid step apart per
rounding step, never further (`assert_on_grid_within`). Without either they fall back to
a fixed rtol/atol: a number, not a bound (kept for callers not yet given a float64
transform).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from references.error import assert_as_accurate, run_in_float64


def random_grads(params, step: int, scale: float = 1.0):
    """Deterministic gradient-like tree for `step`, same structure/dtype as `params`."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1000 + step), len(leaves))
    out = [
        (scale * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def run(tx: optax.GradientTransformation, params, steps: int, *, jit: bool = True,
        start: int = 0, state=None, **extra_args):
    """Apply `tx` for `steps` steps; returns (params, state, list of param trees)."""
    update = jax.jit(tx.update) if jit else tx.update
    if state is None:
        state = tx.init(params)
    history = []
    for t in range(start, start + steps):
        updates, state = update(random_grads(params, t), state, params, **extra_args)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return params, state, history


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol),
        a, b)


def assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def float64_run(tx64, params, steps: int, *, float32_state=False, **extra_args):
    """The params after `run(tx64, params, steps)` with params, gradients and `tx64` in
    float64 (jax's x64 inside only): what the float32 runs of that computation round. Its
    state must be float64 too, unless `float32_state` (a transform that keeps float32
    statistics whatever the params)."""
    return run_in_float64(lambda p: run(tx64, p, steps, **extra_args)[:2], params,
                          float32_leaves=float32_state)[0]


def grid_steps(a, b, dtype) -> np.ndarray:
    """How many values of the 16-bit float `dtype` (bf16, fp16) lie from each element of
    `a` to `b` (both on its grid): the distance of their bit patterns in the order of the
    values (a sign-magnitude pattern read as a signed count; +0 and -0 the same)."""
    def order(x):
        bits = np.asarray(jnp.asarray(x, dtype)).view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(order(a) - order(b))


def assert_on_grid_within(got, peer, grid, steps: int, what=""):
    """Every leaf of `got` and `peer` lies on `grid`'s values and the two are at most
    `steps` grid steps apart (one per randomized rounding of a value its two float32
    programs computed within rounding of each other)."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(peer),
                            strict=True):
        name = f"{what}{jax.tree_util.keystr(path)}"
        for z in (x, y):
            z = np.asarray(z, np.float32)
            np.testing.assert_array_equal(np.asarray(jnp.asarray(z, grid), np.float32), z,
                                          err_msg=f"{name}: off the {jnp.dtype(grid)} grid")
        apart = int(grid_steps(x, y, grid).max())
        assert apart <= steps, f"{name}: {apart} grid steps apart after {steps} roundings"


def assert_runs_agree(got, peer, float64_params=None, rtol=1e-5, atol=1e-6, what="", *,
                      grid=None, steps=1):
    """`got` as accurate as `peer` against `float64_params` (their computation in float64);
    with `grid`, within `steps` grid steps of `peer` (`assert_on_grid_within`); without
    either, the fixed `rtol`/`atol` of callers not yet ported."""
    if grid is not None:
        assert_on_grid_within(got, peer, grid, steps, what)
    elif float64_params is None:
        assert_trees_close(got, peer, rtol, atol)
    else:
        assert_as_accurate(got, peer, float64_params, what=what)


def check_jit_matches_eager(tx, params, steps: int = 4, rtol=1e-5, atol=1e-6, *,
                            float64=None, float32_state=False, grid=None):
    """Jitted and op-by-op runs agree (XLA fuses, and may simplify small dots, in one and
    not the other): against `float64`'s run when given, on `grid` when given (see the
    module docstring)."""
    p_jit, s_jit, _ = run(tx, params, steps, jit=True)
    p_eager, s_eager, _ = run(tx, params, steps, jit=False)
    ref = None if float64 is None else float64_run(float64, params, steps,
                                                    float32_state=float32_state)
    assert_runs_agree(p_jit, p_eager, ref, rtol, atol, what="jit vs eager", grid=grid,
                      steps=steps)
    assert jax.tree.structure(s_jit) == jax.tree.structure(s_eager)


def check_state_stable(tx, params, steps: int = 3):
    """State keeps structure, shapes and dtypes across updates (required by lax.cond/scan)."""
    state0 = tx.init(params)
    _, state, _ = run(tx, params, steps, state=state0)
    spec = lambda s: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), s)
    assert spec(state0) == spec(state), "state structure/dtype changed across updates"


def check_dtype_preserved(tx, params, dtype=jnp.bfloat16, steps: int = 3):
    """Low-precision params: updates come back in the param dtype and stay finite."""
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(steps):
        updates, state = update(random_grads(params, t), state, params)
        for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
            assert u.dtype == p.dtype, f"update dtype {u.dtype} != param dtype {p.dtype}"
            assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
        params = optax.apply_updates(params, updates)
    for p in jax.tree.leaves(params):
        assert p.dtype == dtype


def check_inject_hyperparams(factory: Callable[..., optax.GradientTransformation], params,
                             kwargs: dict, static_args=(), steps: int = 3, *, float64=None,
                             float32_state=False, grid=None):
    """`optax.inject_hyperparams(factory)` gives the same trajectory as `factory`.
    `float64`: a factory like `factory` building the float64 computation (`True`:
    `factory` itself); `grid`: see the module docstring."""
    plain = factory(**kwargs)
    injected = optax.inject_hyperparams(factory, static_args=static_args)(**kwargs)
    p1, _, _ = run(plain, params, steps)
    p2, state, _ = run(injected, params, steps)
    # Injected hyperparameters are traced f32 arrays instead of folded constants: XLA may
    # fuse differently, so agreement is to f32 rounding, not bitwise.
    ref = None if float64 is None else float64_run(
        (factory if float64 is True else float64)(**kwargs), params, steps,
        float32_state=float32_state)
    assert_runs_agree(p2, p1, ref, what="injected vs plain", grid=grid, steps=steps)
    return state


def _mean_gradient_run(tx, params, every_k, steps):
    """`tx` applied to the mean of each `every_k` gradients (MultiSteps' definition)."""
    state, p_ref = tx.init(params), params
    ref_update = jax.jit(tx.update)
    acc = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
    for outer in range(steps):
        grads = [random_grads(params, outer * every_k + i) for i in range(every_k)]
        mean = jax.tree.map(lambda *gs: sum(acc(g) for g in gs) / every_k, *grads)
        mean = jax.tree.map(lambda m, p: m.astype(p.dtype), mean, params)
        u, state = ref_update(mean, state, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    return p_ref, state


def check_multisteps(tx, params, every_k: int = 2, steps: int = 2, *, float64=None,
                     float32_state=False, grid=None):
    """`optax.MultiSteps(tx, k)` equals `tx` applied to the mean of k gradients (`grid`:
    see the module docstring; `tx` rounds once per `every_k` gradients)."""
    ms = optax.MultiSteps(tx, every_k_schedule=every_k)
    ms_state = ms.init(params)
    p_ms = params
    ms_update = jax.jit(ms.update)
    for outer in range(steps):
        for i in range(every_k):
            g = random_grads(params, outer * every_k + i)
            u, ms_state = ms_update(g, ms_state, p_ms)
            p_ms = optax.apply_updates(p_ms, u)
    p_ref, _ = _mean_gradient_run(tx, params, every_k, steps)
    ref = None if float64 is None else run_in_float64(
        lambda p: _mean_gradient_run(float64, p, every_k, steps), params,
        float32_leaves=float32_state)[0]
    assert_runs_agree(p_ms, p_ref, ref, what="MultiSteps vs the mean gradient", grid=grid,
                      steps=steps)


def check_partition(tx, params, steps: int = 3, *, float64=None, float32_state=False,
                    grid=None):
    """`tx` as one group of `optax.partition`, SGD on the rest, equals `tx` on its leaves
    (`grid`: see the module docstring)."""
    flat = {f"g{i}": x for i, x in enumerate(jax.tree.leaves(params))}
    ours = {k: v for k, v in flat.items()}
    mixed = {"ours": ours, "other": {"w": jnp.ones((3,), jnp.float32)}}
    labels = {"ours": jax.tree.map(lambda _: "ours", ours), "other": {"w": "sgd"}}
    part = optax.partition({"ours": tx, "sgd": optax.sgd(0.1)}, labels)
    p_part, _, _ = run(part, mixed, steps)

    def alone(tx, mixed):  # the same gradients for the "ours" subtree, as `run` makes them
        state, p_ref = tx.init(mixed["ours"]), mixed["ours"]
        for t in range(steps):
            g = random_grads(mixed, t)["ours"]
            u, state = jax.jit(tx.update)(g, state, p_ref)
            p_ref = optax.apply_updates(p_ref, u)
        return p_ref, state

    ref = None if float64 is None else run_in_float64(
        lambda m: alone(float64, m), mixed, float32_leaves=float32_state)[0]
    assert_runs_agree(p_part["ours"], alone(tx, mixed)[0], ref, 1e-6, 1e-7,
                      what="partition vs alone", grid=grid, steps=steps)


def check_nnx_optimizer(tx, steps: int = 3):
    """`nnx.Optimizer(model, tx, wrt=nnx.Param)` trains a small MLP: the loss falls."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jax.random.normal(jax.random.key(1), (32, 4))

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        o.update(m, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(steps)]
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


def mesh8(axis_names=("data", "model"), shape=(4, 2)):
    assert jax.device_count() >= 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape))


def shard_params(params, mesh, spec_fn: Callable[[jax.Array], P] | None = None):
    """Place `params` on `mesh`: by default the first axis over 'data', the second over 'model'
    where they divide, replicated otherwise."""
    def default_spec(x):
        axes = []
        for dim, name in zip(x.shape, ("data", "model"), strict=False):
            axes.append(name if dim % mesh.shape[name] == 0 else None)
        return P(*axes)
    spec_fn = spec_fn or default_spec
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_fn(x))), params)


def check_sharded_state(tx, params, steps: int = 2, mesh=None, *, float64=None,
                        float32_state=False, grid=None):
    """On an 8-device mesh, state leaves shaped like a param carry that param's sharding,
    after an eager `init` and after jitted updates, and the result equals the unsharded run.

    (Under `jax.jit(tx.init)` on an Auto mesh XLA places fresh zeros on one device, for
    optax's own transforms too; trainers pass `out_shardings` there.)"""
    mesh = mesh or mesh8()
    sharded = shard_params(params, mesh)
    state = tx.init(sharded)
    by_shape = {}
    for x in jax.tree.leaves(sharded):
        by_shape.setdefault(x.shape, set()).add(x.sharding.spec)

    def check(state):
        for leaf in jax.tree.leaves(state):
            if not isinstance(leaf, jax.Array) or leaf.ndim == 0:
                continue
            specs = by_shape.get(leaf.shape)
            if specs is not None and len(specs) == 1:
                (spec,) = specs
                assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
                    f"state leaf {leaf.shape} has {leaf.sharding}, params have {spec}")
    check(state)
    p, state, _ = run(tx, sharded, steps, state=state)
    check(state)
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(sharded), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    p_ref, _, _ = run(tx, params, steps)
    ref = None if float64 is None else float64_run(float64, params, steps,
                                                    float32_state=float32_state)
    assert_runs_agree(p, p_ref, ref, what="sharded vs unsharded", grid=grid, steps=steps)


def check_orbax_roundtrip(tx, params, tmp_path, steps_before: int = 3, steps_after: int = 4,
                          **extra_args):
    """Save the state mid-run with Orbax, restore it into the abstract target, and continue:
    bit-identical to the uninterrupted run."""
    import orbax.checkpoint as ocp

    p_full, _, _ = run(tx, params, steps_before + steps_after, **extra_args)
    p_mid, s_mid, _ = run(tx, params, steps_before, **extra_args)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": p_mid, "state": s_mid})
        ckptr.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p_mid, "state": s_mid})
        restored = ckptr.restore(path, target)
    assert jax.tree.structure(restored["state"]) == jax.tree.structure(s_mid)
    p_resumed, _, _ = run(tx, restored["params"], steps_after, start=steps_before,
                          state=restored["state"], **extra_args)
    # Bitwise: the same compiled update on the same values (the round trip is exact).
    assert_trees_equal(p_resumed, p_full)


def nest(flat):
    """A nested dict of float32 arrays from `{"a/b/c": value}` (a params tree by path)."""
    out = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value, jnp.float32)
    return out
