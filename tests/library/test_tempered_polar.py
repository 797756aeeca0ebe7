"""scale_by_muon(tempered_polar=...) against a float64 numpy transcription of modded-nanogpt
Track 3 result #38's Tempered Polar (`train_gpt_tail_refinterp_2900.py`:
`tempered_polar_rho_for_step`, `apply_tempered_polar`, on `zeropower_via_newtonschulz5`'s
Aurora polar and on `zeropower_plain_newtonschulz5`, as `muon_update` calls them) in the
record's (out, in) layout, at update counts across its ramp (rho 0 -> 0.05 over
2600-2800). Constants from `references.track3_constants.R38`; controls (rho, the clip,
the ramp's start moved) must fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
from optax_snoo import scale_by_muon
from references.error import in_float64
from references.track3_constants import NS_COEFFICIENTS, NS_EPS, R38

AURORA_K, AURORA_BETA, AURORA_EPS = 3, 0.25, 1e-7  # script:365-366, 160 (AURORA_BETA)
COUNTS = (2599, 2600, 2601, 2650, 2700, 2799, 2800, 2801, 2900)


@dataclasses.dataclass(frozen=True)
class Temper:
    rho: float = R38.tempered_rho
    max_delta: float = R38.tempered_max_delta
    ramp: tuple[int, int] = R38.tempered_ramp


def gram_norm(G, eps=R38.tempered_eps):
    """`gram_frobenius_norm_estimate` (script:349-352)."""
    gram = G.T @ G if G.shape[0] > G.shape[1] else G @ G.T
    return max(np.sqrt(np.linalg.norm(gram)), eps)


def ns_inner(X):
    """`_ns_inner` (script:354-360)."""
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def zeropower_aurora(G):
    """`zeropower_via_newtonschulz5` (script:455-487) in float64: Aurora on wide matrices."""
    X = G.T if G.shape[0] > G.shape[1] else G
    if G.shape[0] < G.shape[1]:
        Xt = X.T
        target = Xt.shape[1] / Xt.shape[0]
        D = 1.0 / np.maximum(np.linalg.norm(Xt, axis=1, keepdims=True), AURORA_EPS)
        for k in range(AURORA_K):
            wide = (D * Xt).T
            U = ns_inner(wide / gram_norm(wide, NS_EPS)).T
            if k < AURORA_K - 1:
                row_sq = np.maximum(np.sum(U * U, axis=1, keepdims=True), AURORA_EPS ** 2)
                D = D * (target / row_sq) ** AURORA_BETA
        X = U.T
    else:
        X = ns_inner(X / gram_norm(X, NS_EPS))
    return X.T if G.shape[0] > G.shape[1] else X


def zeropower_plain(G):
    """`zeropower_plain_newtonschulz5` (script:404-412) in float64."""
    X = G.T if G.shape[0] > G.shape[1] else G
    X = ns_inner(X / gram_norm(X, NS_EPS))
    return X.T if G.shape[0] > G.shape[1] else X


def record_rho(t: Temper, step):
    """`tempered_polar_rho_for_step` (script:893-911; no decay)."""
    start, end = t.ramp
    if step < start:
        return 0.0
    if step < end:
        return t.rho * (step - start) / (end - start)
    return t.rho


def record_polar(G, step, zeropower, stats):
    """`muon_update`'s first lines (script:925-938): the polar, then Tempered Polar."""
    normalized = G / gram_norm(G)                        # scale_to_unit_operator_norm
    polar = zeropower(G)
    polar_norm = gram_norm(polar)
    rho = record_rho(Temper(), step)                     # apply_tempered_polar (:913-923)
    if rho == 0.0:
        return polar
    residual = normalized - polar
    clip = min(polar_norm * Temper().max_delta / max(gram_norm(residual), 1e-10), 1.0)
    stats["bind" if clip < 1.0 else "free"] += 1
    mixed = polar + rho * residual * clip
    return mixed * polar_norm / max(gram_norm(mixed), 1e-10)


# Record layouts (out, in): square, wide (Aurora in the record), a 2 x 8 one with nearly
# orthonormal rows and equal column norms (its own polar, even Aurora's: the clip free),
# tall (plain Newton-Schulz in the record: only without Aurora).
def gradients(count, tall):
    rng = np.random.default_rng(count)
    g = {"square": rng.standard_normal((6, 6)), "wide": rng.standard_normal((4, 10)),
         "thin": np.array([[1.0] * 8, [1.0, -1.0] * 4]) / np.sqrt(8)
         + 0.005 * rng.standard_normal((2, 8))}
    if tall:
        g["tall"] = rng.standard_normal((10, 4))
    return g


def ours(t: Temper, aurora: bool):
    """Ours in float64 at each count of COUNTS: {name: (out, in) update}."""
    start, end = t.ramp
    out = []
    with in_float64():
        rho = lambda c: t.rho * jnp.clip((jnp.asarray(c, jnp.float64) - start) / (end - start),
                                         0.0, 1.0)
        tx = scale_by_muon(0.0, coefficients="track3", ns_dtype=jnp.float64,
                           ns_normalization="gram_frobenius", shape_scale=None,
                           aurora_iterations=AURORA_K if aurora else None,
                           aurora_beta=AURORA_BETA, tempered_polar=rho,
                           tempered_polar_max=t.max_delta)
        update = jax.jit(tx.update)
        for count in COUNTS:
            g = {n: jnp.asarray(x.T) for n, x in gradients(count, not aurora).items()}
            state = tx.init(g)._replace(count=jnp.asarray(count, jnp.int32))
            u, _ = update(g, state)
            out.append({n: np.asarray(x).T for n, x in u.items()})
    return out


def record(aurora: bool):
    stats = {"bind": 0, "free": 0}
    zeropower = zeropower_aurora if aurora else zeropower_plain
    out = [{n: record_polar(G, count, zeropower, stats)
            for n, G in gradients(count, not aurora).items()} for count in COUNTS]
    return out, stats


def worst(a, b):
    return max(float(np.max(np.abs(x[n] - y[n]))) for x, y in zip(a, b, strict=True)
               for n in x)


TOL = 1e-12  # float64: 12 Newton-Schulz products (x3 with Aurora) on O(1) matrices


@pytest.mark.parametrize("aurora", [True, False], ids=["aurora", "plain"])
def test_matches_record_across_its_ramp(aurora):
    ref, stats = record(aurora)
    assert stats["bind"] > 0 and stats["free"] > 0, stats  # both branches of the clip
    got = ours(Temper(), aurora)
    assert worst(got, ref) < TOL
    # The polar itself where rho = 0 (count < 2600): no tempering.
    untempered = [{n: (zeropower_aurora if aurora else zeropower_plain)(G)
                   for n, G in gradients(COUNTS[0], not aurora).items()}]
    assert worst(got[:1], untempered) < TOL
    for control in (dict(rho=0.0525), dict(max_delta=0.2625), dict(ramp=(2650, 2800))):
        assert worst(ours(Temper(**control), aurora), ref) > 1e6 * TOL, control


def test_zero_rho_is_the_plain_polar_bitwise():
    g = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
    plain = scale_by_muon()
    tempered = scale_by_muon(tempered_polar=0.0)
    a, _ = plain.update(g, plain.init(g))
    b, _ = tempered.update(g, tempered.init(g))
    m.assert_trees_equal(a, b)


def test_bad_input():
    with pytest.raises(ValueError, match="tempered_polar"):
        scale_by_muon(tempered_polar=-0.1)
    with pytest.raises(ValueError, match="tempered_polar_max"):
        scale_by_muon(tempered_polar=0.1, tempered_polar_max=0.0)
    with pytest.raises(ValueError, match="tempered_polar"):
        scale_by_muon(spectral_map="power", tempered_polar=0.1)


MATRIX_PARAMS = {"a": jnp.ones((8, 4)) + jnp.eye(8, 4), "b": jnp.linspace(-1.0, 1.0, 48)
                 .reshape(6, 8)}


def test_optax_matrix(tmp_path):
    tx = scale_by_muon(tempered_polar=optax.linear_schedule(0.0, 0.3, 2, 1),
                       aurora_iterations=2)
    m.check_jit_matches_eager(tx, MATRIX_PARAMS, steps=3)
    m.check_state_stable(tx, MATRIX_PARAMS, steps=3)
    m.check_dtype_preserved(tx, MATRIX_PARAMS, steps=2)
    m.check_partition(tx, MATRIX_PARAMS, steps=2)
    m.check_sharded_state(tx, MATRIX_PARAMS, steps=3)
    m.check_inject_hyperparams(
        lambda tempered_polar: scale_by_muon(tempered_polar=tempered_polar),
        MATRIX_PARAMS, dict(tempered_polar=0.2), steps=3)
