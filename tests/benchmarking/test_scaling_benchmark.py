"""benchmarks.scaling on the issue's case (16 row-sharded 512x512 matrices): the rows it
reports and the targets it checks, the registry, and the K-FAC refresh and plain rows."""

from __future__ import annotations

import math

from benchmarks import scaling


def test_rows_and_targets_on_the_issue_case():
    rows = []
    for shape in [(1, 1, 1), (1, 8, 1), (2, 4, 1)]:
        rows += scaling.measure("16x512", shape, ["muon before", "muon", "snoo(muon)"])
    by = {(r["mesh"], r["step"]): r for r in rows}
    share = by[("1x8x1", "muon")]["share_bytes"]
    assert share == 16 * 512 * 512 * 4 / 8
    before, after = by[("1x8x1", "muon before")], by[("1x8x1", "muon")]
    assert before["loop_collective_bytes"] >= 100 * share
    assert after["loop_collective_bytes"] == 0
    assert after["collective_bytes"] == share  # bf16 transfers: 2 x share / 2
    # FLOPs split 8 ways: 16 matrices, 2 per device.
    total = by[("1x1x1", "muon")]["flops"]
    assert after["flops"] <= 1.02 * total / 8
    targets = scaling.check_targets(rows)
    assert len(targets) == 3 and all("FAIL" not in t for t in targets), targets
    assert "| 16x512 | 1x8x1 | 8 | muon |" in scaling.markdown(rows)


def test_registry_takes_new_steps():
    @scaling.register_stack("test sgd")
    def _sgd(tree, mesh):
        import optax
        return scaling.optimizer_step(optax.sgd(0.1), tree)

    try:
        rows = scaling.measure("16x512", (1, 8, 1), ["test sgd"])
        assert rows[0]["collective_bytes"] == 0 and rows[0]["step"] == "test sgd"
    finally:
        del scaling.STACKS["test sgd"]


TINY_MOE = ("shakespeare_char_cpu@n_layer=2@n_embd=64@n_head=2@block_size=16@batch_size=4"
            "@moe_every=2@n_experts=4")


def test_kfac_rows_refresh_split_and_targets():
    """The trainer's kfac stack on a tiny MoE GPT (experts preconditioned): the refresh
    row holds every factor's eigh at N=1 and its share at N=8, the plain row none; on a
    data-only mesh the plain step's collectives are the factor statistics' reduce-scatters
    (dense kernels) and all-reduces (expert stacks, scalars); the refresh's per-device
    FLOPs meet the target at every N."""
    rows = []
    for shape in [(1, 1, 1), (2, 1, 1), (1, 4, 1), (2, 4, 1)]:
        rows += scaling.measure(TINY_MOE, shape, ["kfac"])
    by = {(r["mesh"], r["step"]): r for r in rows}
    assert len(by) == 8
    # Factor sizes: 64 (A of every kernel but c_proj/w_proj, G of c_q..c_proj and w_proj),
    # 256 (the dense block's c_fc G, c_proj A, and the 4 experts' w_fc G, w_proj A).
    single = by[("1x1x1", "kfac refresh")]["eigh"]
    assert sum(single.values()) > 8 and set(single) == {64, 256}
    eight = by[("2x4x1", "kfac refresh")]["eigh"]
    assert eight == {d: math.ceil(k / 8) for d, k in single.items()}
    assert all(not r["eigh"] for r in rows if r["step"] == "kfac")
    counts = by[("2x1x1", "kfac")]["counts"]
    # A and G of each dense kernel (2 x 4 attention, 1 dense MLP x 2): one each.
    assert set(counts) == {"all-reduce", "reduce-scatter"} and counts["reduce-scatter"] == 20
    targets = scaling.check_kfac_targets(rows)
    assert len(targets) == 4 and all("FAIL" not in t for t in targets), targets
    assert f"| {TINY_MOE} | 2x4x1 | 8 |" in scaling.kfac_markdown(rows)
    assert scaling.measure("16x512", (1, 1, 1), ["kfac"]) == []  # no model, no K-FAC
