"""benchmarks.hlo: collectives and FLOPs of compiled programs, with loops counted.

Small programs whose counts are known by construction: a psum inside a 3-trip loop,
a tuple all-to-all, an all-gather, a dot inside a scan, a conditional, an
eigendecomposition in one branch of a conditional (K-FAC's refresh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import hlo


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_collective_in_a_loop_counts_trip_count_times(mesh):
    def f(x):
        def body(i, c):
            return c + jax.lax.psum(c * 1.5, "x")
        return jax.lax.fori_loop(0, 3, body, x)

    sm = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jax.device_put(jnp.ones((8, 128), jnp.float32), NamedSharding(mesh, P("x")))
    text = compiled_text(sm, x)
    cost = hlo.analyze(text)
    assert 3 in hlo.trip_counts(text)
    assert cost.counts["all-reduce"] == 3
    assert cost.by_kind["all-reduce"] == 3 * 128 * 4  # a (1, 128) f32 block per device
    assert cost.loop_collective_bytes == cost.collective_bytes


def test_all_to_all_tuple_and_all_gather_bytes(mesh):
    def f(x):
        y = jax.lax.all_to_all(x, "x", 0, 0, tiled=True)
        return y, jax.lax.all_gather(x, "x", axis=0, tiled=True)

    sm = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P()),
                       check_vma=False)
    x = jax.device_put(jnp.ones((64, 32), jnp.float32), NamedSharding(mesh, P("x")))
    cost = hlo.analyze(compiled_text(sm, x))
    local = 8 * 32 * 4
    assert cost.by_kind["all-to-all"] == local  # every element of the tuple counted once
    assert cost.by_kind["all-gather"] == 8 * local  # the gathered result
    assert cost.loop_collective_bytes == 0


def test_dot_flops_in_a_scan_and_against_cost_analysis():
    a = jnp.ones((64, 96), jnp.float32)
    b = jnp.ones((96, 96), jnp.float32)

    def f(a, b):
        return jax.lax.scan(lambda c, _: (c @ b, None), a, None, length=4)[0]

    compiled = jax.jit(f).lower(a, b).compile()
    cost = hlo.analyze(compiled.as_text())
    dot = 2 * 64 * 96 * 96
    assert 4 * dot <= cost.flops < 4 * dot * 1.01
    # cost_analysis counts the loop body once.
    assert compiled.cost_analysis()["flops"] < 1.5 * dot


def test_conditional_counts_its_most_expensive_or_cheapest_branch():
    x = jnp.ones((32, 32), jnp.float32)

    def f(p, x):
        return jax.lax.cond(p, lambda x: x @ x @ x, lambda x: x + 1.0, x)

    text = compiled_text(f, True, x)
    cost = hlo.analyze(text)
    assert 2 * 2 * 32**3 <= cost.flops < 2 * 2 * 32**3 * 1.05
    assert hlo.analyze(text, cheapest=True).flops < 2 * 32 * 32  # the x + 1 branch


def test_in_conditional_branch_finds_a_collective_by_structure(mesh):
    """A psum in a cond's branch (under a loop, so nested computations are followed) and
    one outside it: in that order in the program's structure, whatever names it carries."""
    def f(p, x):
        def body(i, c):
            return jax.lax.cond(p, lambda c: jax.lax.psum(c, "x") + c, lambda c: c * 2.0, c)
        return jax.lax.fori_loop(0, 2, body, x) + jax.lax.psum(x * 3.0, "x")

    sm = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))
    x = jax.device_put(jnp.ones((8, 128), jnp.float32), NamedSharding(mesh, P("x")))
    flags = hlo.in_conditional_branch(compiled_text(sm, True, x), "all-reduce")
    assert sorted(flags) == [False, True]
    assert hlo.in_conditional_branch(compiled_text(lambda x: x + 1.0, x), "all-reduce") == []


def test_eigh_counts_9n3_per_matrix_and_picks_the_refresh_or_plain_branch():
    """cost_analysis leaves the eigh custom call out; hlo counts 9 n^3 per n x n matrix
    of the batch, in the branch eigh_branch asks for."""
    x = jnp.ones((3, 16, 16), jnp.float32)

    def f(p, x):
        return jax.lax.cond(p, lambda x: jnp.linalg.eigh(x)[1], lambda x: x * 2.0, x)

    text = compiled_text(f, True, x)
    refresh, plain = hlo.analyze(text, eigh_branch=True), hlo.analyze(text, eigh_branch=False)
    assert refresh.eigh == {16: 3} and refresh.eigh_flops == 3 * 9 * 16**3
    assert refresh.flops >= refresh.eigh_flops
    assert plain.eigh == {} and plain.eigh_flops == 0 and plain.flops < 3 * 16 * 16 * 2
    assert hlo.analyze(text).eigh == {16: 3}  # the most expensive branch by default


def test_unknown_trip_count_is_an_error():
    def f(x):
        return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0, x)

    with pytest.raises(ValueError, match="trip count"):
        hlo.analyze(compiled_text(f, jnp.ones((4,))))


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=[2,4]<=[8], dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_2'}, use_global_device_ids=true", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_0'}, dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("to_apply=%add", None),
])
def test_replica_groups_in_every_written_form(attrs, groups):
    assert hlo.replica_groups(attrs) == groups
    spans = hlo.spans_blocks(4)(groups)
    assert spans == (groups is None or groups[0] == [0, 4])
