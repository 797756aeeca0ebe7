"""K-FAC's plain-step collective bytes per device, with and without the factor statistics.

The trainer's `kfac` stack on a preset's GPT (`benchmarks.scaling.kfac_stack`: batch
factors from one batch's captured statistics, tokens split over the batch axes), compiled
twice per mesh: a statistics step (the factors reduced over the batch axes, then their
EMA) and a step without statistics (``curvature=None``, what the trainer's steps between
statistics steps run with ``--kfac_stats_every`` > 1: its statistics branch is not
taken). Both read at their plain (non-refresh) branch (`benchmarks.hlo`). With
statistics every ``k`` steps a step moves ``(stats + (k - 1) · no_stats) / k`` on average.
Collective bytes by kind (a reduce-scatter counted at its full input, `benchmarks.hlo`)
and the factor EMAs' bytes per device, from the compiled step's output shardings (rows
split over the batch axes: ``kfac(stats_axes=...)``).
The target of the K-FAC statistics issue is ``2 x (the device's share of the K-FAC
group's parameters + its share of the factors)``, both ``total / N``.

    python -m benchmarks.kfac_stats_bytes                  # gpt2_small, 1x8x1 and 2x4x1
    python -m benchmarks.kfac_stats_bytes --tree=gpt2_small --meshes=1x8x1
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax

from benchmarks import hlo, scaling  # sets 8 simulated CPU devices, as its own runs

MIB = 2**20


def measure(tree_name: str, mesh_shape: tuple[int, int, int], every: list[int]) -> dict:
    """Bytes of the statistics and no-statistics plain steps on one mesh, amortised."""
    mesh = scaling.make_mesh(mesh_shape)
    tree = scaling.build_tree(tree_name, mesh)
    cost, held = {}, {}
    for statistics in (True, False):
        step = scaling.kfac_stack(tree, mesh, statistics=statistics)
        with jax.set_mesh(mesh):
            compiled = jax.jit(step.fn).lower(*step.args).compile()
        cost[statistics] = hlo.analyze(compiled.as_text(), eigh_branch=False)
        # Per-device bytes of the factor EMAs the step returns (from its output shardings).
        out_factors = _factors(compiled.output_shardings[1])
        held[statistics] = sum(
            math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
            for x, sh in zip(_factors(step.args[1]), out_factors, strict=True))
    n = math.prod(mesh_shape)
    factors = _factors(step.args[1])
    factor_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in factors)
    kfac_params = [x for x, lab in zip(jax.tree.leaves(tree.params),
                                       jax.tree.leaves(_kfac_labels(tree)), strict=True)
                   if lab == "kfac"]
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in kfac_params)
    target = 2 * (param_bytes + factor_bytes) / n
    stats, plain = cost[True].collective_bytes, cost[False].collective_bytes
    return {
        "tree": tree_name, "mesh": "x".join(map(str, mesh_shape)), "n": n,
        "statistics_step_MiB": stats / MIB,
        "statistics_by_kind_MiB": {k: v / MIB for k, v in cost[True].by_kind.items()},
        "no_statistics_step_MiB": plain / MIB,
        "no_statistics_by_kind_MiB": {k: v / MIB for k, v in cost[False].by_kind.items()},
        "factors_per_device_MiB": held[True] / MIB,
        "factors_per_device_no_statistics_MiB": held[False] / MIB,
        "kfac_param_share_MiB": param_bytes / n / MIB,
        "factor_share_MiB": factor_bytes / n / MIB,
        "target_MiB": target / MIB,
        "amortised_MiB": {k: (stats + (k - 1) * plain) / k / MIB for k in every},
        "load": os.getloadavg()[0],
    }


def _factors(state) -> list:
    """The factor EMA leaves of every K-FAC state in ``state`` (or of its shardings)."""
    has = lambda x: hasattr(x, "factors")
    return [x for s in jax.tree.leaves(state, is_leaf=has) if has(s)
            for x in jax.tree.leaves(s.factors)]


def _kfac_labels(tree: scaling.Tree):
    import optax_snoo.labels
    from optax_snoo.recipes import kfac_label_rules as kfac_rules

    return optax_snoo.labels.label_by_rules(kfac_rules(tree.config.moe_every > 0))(tree.params)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default="gpt2_small")
    parser.add_argument("--meshes", default="1x8x1,2x4x1")
    parser.add_argument("--every", default="1,2,4,8", help="stats_every values to amortise")
    args = parser.parse_args(argv)
    every = [int(k) for k in args.every.split(",")]
    rows = [measure(args.tree, tuple(int(x) for x in m.split("x")), every)
            for m in args.meshes.split(",")]
    print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
