"""How close two float32 programs of one computation must be: as close as float32 lets
the computation itself be (shared by the tests that compare sharded with unsharded,
distributed with replicated, fused with unfused, scanned with unrolled programs).

Two programs that sum in different orders (another blocking of a matmul, a reduction
split over devices, a stack of 2 instead of 16 matrices) round differently, so on some
CPU they differ by whatever the computation's float32 error is there. A fixed `rtol`
below that error fails on that CPU; one far above it hides a real bug. So each result is
measured against the same computation in float64 (`ref`), and the program under test
may be no less accurate than the one it is compared with (`peer`), up to a small factor
and a few float32 roundings of the result.
"""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)

# Two roundings of one computation in different orders have errors of the same size
# (sums of as many roundings): 4x allows one to be unlucky where the other was lucky.
FACTOR = 4.0
# A result rounded to float32 once or twice more (a transpose, a cast, a stored state)
# has that much error even where the peer's is zero.
ULPS = 4.0
# A reference of another computation would make any two results "as accurate" as each
# other: the peer must be within this of it (relative, Frobenius), far above float32's
# rounding of the computations compared here and far below a wrong formula's distance.
SAME_COMPUTATION = 1e-3


def float64(tree):
    """Every floating leaf as a float64 numpy array (the same values); others as numpy."""
    def cast(x):
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
    return jax.tree.map(cast, tree)


@contextlib.contextmanager
def in_float64():
    """jax with float64 enabled inside the block only (never left set for other tests)."""
    with jax.enable_x64(True):
        yield


def error(x, ref) -> float:
    """Frobenius distance ``||x - ref||`` in float64."""
    return float(np.linalg.norm(np.asarray(x, np.float64).ravel()
                                - np.asarray(ref, np.float64).ravel()))


def relative_error(x, ref) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius, float64)."""
    return error(x, ref) / float(np.linalg.norm(np.asarray(ref, np.float64).ravel()))


def bound(peer, ref, factor=FACTOR, ulps=ULPS) -> float:
    """What a result of `peer`'s computation may miss `ref` by: `factor` x `peer`'s own
    error plus `ulps` float32 roundings of `ref`'s scale (Frobenius)."""
    scale = float(np.linalg.norm(np.asarray(ref, np.float64).ravel()))
    return factor * error(peer, ref) + ulps * EPS32 * scale


def assert_as_accurate(got, peer, ref, *, factor=FACTOR, ulps=ULPS, what="",
                       same=SAME_COMPUTATION):
    """Each floating leaf of `got` misses `ref`'s by at most `bound(peer, ref)`; the
    other leaves (counts, integer indices) equal `peer`'s and `ref`'s exactly; and
    `ref` is `peer`'s computation (within `same`).

    Args:
      got: the float32 results of the program under test (a pytree).
      peer: the float32 results of the program it is compared with (same structure).
      ref: the same computation in float64 (same structure).
      factor: how much less accurate than `peer` `got` may be.
      ulps: float32 roundings of the result's scale allowed on top.
      what: a prefix for the failure message.
      same: how far (relative) `peer` may be from `ref` (`SAME_COMPUTATION`; more for
        bf16 programs, whose own rounding is larger).
    """
    got_l = jax.tree_util.tree_flatten_with_path(got)[0]
    peer_l, ref_l = jax.tree.leaves(peer), jax.tree.leaves(ref)
    assert len(got_l) == len(peer_l) == len(ref_l), (what, len(got_l), len(peer_l), len(ref_l))
    for (path, g), p, r in zip(got_l, peer_l, ref_l, strict=True):
        name = f"{what}{jax.tree_util.keystr(path)}"
        g, p, r = np.asarray(g), np.asarray(p), np.asarray(r)
        assert g.shape == p.shape == r.shape, (name, g.shape, p.shape, r.shape)
        if not np.issubdtype(g.dtype, np.floating):
            np.testing.assert_array_equal(g, p, err_msg=name)
            np.testing.assert_array_equal(g, r, err_msg=name)
            continue
        scale = float(np.linalg.norm(r.astype(np.float64).ravel()))
        assert error(p, r) <= same * scale, (
            f"{name}: the float64 reference is not the peer's computation (relative "
            f"distance {error(p, r) / scale:.3g})")
        e, b = error(g, r), bound(p, r, factor, ulps)
        assert e <= b, (f"{name}: error {e:.3g} against float64 exceeds {factor} x the "
                        f"peer's {error(p, r):.3g} + {ulps} ulps of {np.linalg.norm(r):.3g}")


def run_in_float64(fn, *trees, float32_leaves=False):
    """`fn(*trees)` with every floating leaf of `trees` cast to float64 (the same values)
    and jax's x64 on inside only; its results as float64 numpy. With `fn` building its
    transform in float64 too, this is the computation a float32 program rounds: a
    floating result that is not float64 fails (unless `float32_leaves`, for a state the
    library keeps in float32 whatever the params)."""
    with in_float64():
        cast = lambda x: (jax.numpy.asarray(np.asarray(x), np.float64)
                          if np.issubdtype(np.asarray(x).dtype, np.floating) else x)
        out = fn(*(jax.tree.map(cast, t) for t in trees))
        kinds = {np.asarray(x).dtype for x in jax.tree.leaves(out)
                 if np.issubdtype(np.asarray(x).dtype, np.floating)}
        assert float32_leaves or kinds <= {np.dtype(np.float64)}, (
            f"the float64 reference computed in {sorted(map(str, kinds))}")
        return float64(out)


def program_text(lowered) -> str:
    """The program `lowered` gives the compiler, as StableHLO text: every constant in full,
    no source locations, no argument names, the module's name left out. Two programs
    with equal texts compile to one executable, so on the same inputs they give bitwise
    the same results and may be compared exactly.

    (The compiled text is no substitute: it prints constants of more than a few elements
    as ``{...}``, and its frame tables, whose order differs on a cold compilation cache,
    come before its computations; the HLO text names parameters by their argument paths.)

    Args:
      lowered: ``jax.jit(f).lower(*args)``.
    """
    return re.sub(r"^module @[\w.\-]+", "module", lowered.as_text(debug_info=False), count=1)
