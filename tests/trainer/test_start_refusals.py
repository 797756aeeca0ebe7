"""What the trainer refuses at start, before it writes anything: a GPU-sized preset on a
machine whose devices are CPUs (with the flag that overrides named), and FineWeb shards
that are not there (with how to get them)."""

from __future__ import annotations

import jax
import pytest

from train import config as tc
from train.__main__ import main

GPU_SIZED = ("shakespeare_char", "gpt2_small", "gpt2_owt", "gpt2_medium_fineweb", "track3")


def test_the_gpu_sized_presets_ask_for_an_accelerator_and_the_cpu_ones_do_not():
    for name in tc.PRESETS:
        assert tc.get_preset(name).run.require_accelerator == (name in GPU_SIZED), name


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is for CPU-only machines")
@pytest.mark.parametrize("preset", ["track3", "shakespeare_char"])
def test_a_gpu_sized_preset_is_refused_on_a_cpu_before_anything_is_written(
        preset, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([f"--preset={preset}", f"--out_dir={out}", "--max_iters=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: this run is sized for GPUs"), err
    assert "--require_accelerator=false" in err and "track3_cpu" in err
    assert not out.exists()


def test_missing_fineweb_shards_say_how_to_get_them(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["--preset=track3", "--require_accelerator=false", f"--out_dir={out}",
                   f"--data={tmp_path / 'fineweb10B'}", "--max_iters=2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0, err
    assert "no such file or folder" in err and "cached_fineweb10B.py" in err
    assert not out.exists()


def test_another_missing_path_gets_no_fineweb_hint(tmp_path, capsys):
    assert main([f"--data={tmp_path / 'corpus.txt'}", f"--out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "fineweb" not in err.lower()
