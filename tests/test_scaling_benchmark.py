"""benchmarks.scaling on the issue's case (16 row-sharded 512x512 matrices): the rows it
reports and the targets it checks; plus the registry the K-FAC rows plug into."""

from __future__ import annotations

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
