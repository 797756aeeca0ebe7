"""Smoke tests of the Python parts of benchmarks/gpu.sh (throughput, skewadam_speed), tiny.

Only that the scripts run and report what they say; no timing is asserted.
"""

import pytest

from benchmarks import skewadam_speed, throughput

TINY = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=8",
        "--rounds=1", "--steps=2", "--warmup=1"]


def test_gpu_script_arguments_run_on_cpu_with_a_tiny_override():
    # benchmarks/gpu.sh's arguments, less --require_accelerator, plus a tiny shape.
    table = throughput.main(["--preset=gpt2_small", "--dtypes=bfloat16", "--no_reference",
                             "--optimizer=snoo_muon", *TINY])
    rows = [line for line in table.splitlines() if line.startswith("| ours")]
    assert len(rows) == 1 and "| n/a |" in rows[0]  # no MFU without a known peak
    assert rows[0].startswith("| ours snoo_muon bfloat16 |") and "128 tokens/step" in table
    assert "attention (ours snoo_muon bfloat16: handwritten)" in table  # auto, on CPU


def test_ours_against_the_reference_step():
    table = throughput.main(["--dtypes=bfloat16,float32", *TINY])
    names = [line.split("|")[1].strip() for line in table.splitlines()[5:]]
    assert names == ["ours adamw bfloat16", "ours adamw float32",
                     "reference float32 (plain jax)"]
    assert table.splitlines()[-1].split("|")[5].strip() == "1.00x"


def test_optimizers_interleaved_with_a_paired_ratio_to_the_first():
    table = throughput.main(["--optimizers=adamw,snoo_adamw", "--dtypes=float32",
                             "--no_reference", *TINY])
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ours")]
    assert [r[1].strip() for r in rows] == ["ours adamw float32", "ours snoo_adamw float32"]
    assert rows[0][6].strip() == "1.000"  # the first variant against itself
    assert float(rows[1][6]) > 0


def test_ours_warm_up_compiles_every_program_the_timed_steps_run():
    """A Snoo step syncing every 3 updates is two programs; the warm-up runs both, so the
    timed steps after it compile nothing (a sync's compile once sat in a timed round)."""
    import jax

    from train.config import parse_args

    config = parse_args(["--optimizer=snoo_adamw", "--snoo_k=3", *TINY[:5], "--mesh_data=1"])
    variant = throughput.ours(config)
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event) if event.endswith(
        "backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        variant.run(1)
        first = len(compiles)
        variant.run(variant.warmup_steps - 1)
        warm = len(compiles)
        variant.run(7)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert warm > first  # the warm-up's later steps compiled the other program
    assert len(compiles) == warm


def test_require_accelerator_fails_on_cpu():
    with pytest.raises(SystemExit, match="no GPU/TPU"):
        throughput.main(["--require_accelerator", *TINY])


def test_skewadam_speed_script_runs_on_the_moe_tiny_tree(capsys):
    # benchmarks/gpu.sh's third part, one short round.
    skewadam_speed.main(["--tree=moe_tiny", "--rounds=1", "--steps=1", "--hlo"])
    out = capsys.readouterr().out
    assert "moe_tiny" in out and "ratio" in out
    assert "adamw" in out and "skew_adam {'fusions':" in out


def test_a_variant_timed_in_another_process_reports_its_own_times():
    # The PyTorch variant (--torch) times its steps in a subprocess and returns them.
    calls = []
    v = throughput.Variant("elsewhere", lambda n: calls.append(n) or (0.5 * n, 0.25 * n), None)
    throughput.measure([v], rounds=2, steps=4, warmup=1)
    assert calls == [1, 4, 4] and v.wall == [0.5, 0.5] and v.cpu == [0.25, 0.25]


def test_torch_runs_only_at_the_recipe_shape():
    with pytest.raises(SystemExit, match="CPU recipe only"):
        throughput.main(["--torch=python-with-torch", "--no_reference", *TINY])


def test_torch_recipe_serves_timed_steps():
    pytest.importorskip("torch")
    from benchmarks import torch_recipe

    out = []
    recipe = torch_recipe.Recipe(0, str(torch_recipe.DEFAULT_DATA), max_iters=10)
    torch_recipe.serve(recipe, ["1", "2"], out.append)
    assert len(out) == 3 and "torch" in out[0] and '"wall"' in out[2]


def test_data_loader_rate_reads_gpt2_owt_steps_of_written_shards(tmp_path):
    from benchmarks import data_loader

    folder = data_loader.write_random_shards(tmp_path / "rand", 2**-10, shard_tokens=2**18)
    assert len(list(folder.glob("rand_train_*.bin"))) == 2  # 2**19 tokens in 2 shards
    r = data_loader.loader_rate(folder, steps=2)
    assert r["tokens"] == 2**19 and r["tokens_per_s"] > 0
    assert r["ratio"] == r["tokens_per_s"] / r["step_needs_tokens_per_s"]
    assert data_loader.batch_seconds(None, steps=2) > 0
