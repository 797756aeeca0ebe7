"""Sampling: padded vocabulary ids are never drawn; the `python -m train.sample` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import train
from repository import ROOT
from train import config as tc
from train.sample import main as sample_main

pytestmark = pytest.mark.usefixtures("compilation_cache")


def test_sample_token_never_draws_an_id_past_valid_vocab():
    logits = jnp.array([[0.0, 1.0, 2.0, 50.0, 60.0]] * 64)  # ids 3, 4 are padding
    for temperature in (0.0, 1.0, 100.0):
        toks = models.sample_token(logits, jax.random.key(0), temperature, None, 3)
        assert int(toks.max()) < 3, temperature
    toks = models.sample_token(logits, jax.random.key(0), 1.0, 1, 3)  # top-1 of the real ids
    np.testing.assert_array_equal(toks, 2)


def test_generate_masks_the_padded_vocabulary():
    model = models.GPT(models.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2,
                                        n_embd=16), rngs=nnx.Rngs(0))
    prompt = jnp.zeros((4, 2), jnp.int32)
    # Near-uniform: 11 of 16 ids are padding, so unmasked 4 x 12 draws would hit them.
    out = models.generate(model, prompt, 12, temperature=100.0, rng=jax.random.key(1),
                          valid_vocab=5)
    assert int(out[:, 2:].max()) < 5
    hits = models.generate(model, prompt, 12, temperature=100.0, rng=jax.random.key(1))
    assert int(hits.max()) >= 5  # the same draw without the mask does reach padding
    with pytest.raises(ValueError, match="valid_vocab must be None or an int in"):
        models.generate(model, prompt, 2, rng=jax.random.key(0), valid_vocab=17)
    with pytest.raises(ValueError, match=r"top_k .*\[1, 5\]"):
        models.generate(model, prompt, 2, rng=jax.random.key(0), valid_vocab=5, top_k=6)


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A finished 8-step run whose vocabulary is padded (to a multiple of 8)."""
    out = tmp_path_factory.mktemp("sample") / "run"
    config = tc.override(
        tc.TrainConfig(), n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8,
        dtype="float32", optimizer="adamw", max_iters=8, eval_interval=4, eval_iters=1,
        checkpoint_every=4, mesh_data=1, num_samples=2, sample_max_new_tokens=40, progress=False,
        vocab_multiple=8, data=str(corpus), out_dir=str(out))
    vocab = len(set(Path(corpus).read_text()))
    assert tc.model_config(config, vocab).vocab_size > vocab  # padding exists
    train.run(config)
    return config, out


def test_samples_decode_every_token(finished):
    _, out = finished
    samples = (out / "samples.txt").read_text()[:-1].split("\n---------------\n")
    assert [len(s) for s in samples] == [1 + 40] * 2  # the prompt "\n", 40 characters


def test_sample_cli_takes_out_dir(finished, capsys):
    _, out = finished
    assert sample_main(["--out_dir", str(out), "--num_samples=1", "--max_new_tokens=25",
                        "--start=the"]) == 0
    text = capsys.readouterr().out.split("\n---------------\n")[0]
    assert text.startswith("the") and len(text) == 3 + 25


def test_sample_cli_unknown_step_lists_the_saved_ones(finished, capsys):
    _, out = finished
    assert sample_main(["--out_dir", str(out), "--step=5"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --step=5: no such checkpoint in {out}/checkpoints; saved steps: " \
                  "4, 8\n"


def test_sample_cli_bad_prompt_file_is_one_error_line(finished, tmp_path, capsys):
    _, out = finished
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    for start, message in [(f"FILE:{tmp_path}/missing.txt", "cannot read the prompt file"),
                           (f"FILE:{latin1}", "is not UTF-8 text (byte 3"),
                           ("the ✓", "--start='the ✓': characters ['✓'] are not in the "
                                     "vocabulary")]:
        assert sample_main(["--out_dir", str(out), f"--start={start}"]) == 2, start
        err = capsys.readouterr().err
        assert err.startswith(f"error: --start={start!r}") and message in err, err
        assert err.count("\n") == 1, err
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the", encoding="utf-8")
    assert sample_main(["--out_dir", str(out), "--num_samples=1", "--max_new_tokens=5",
                        f"--start=FILE:{prompt}"]) == 0
    assert capsys.readouterr().out.startswith("the")


def test_sample_cli_creates_nothing_in_a_missing_out_dir(tmp_path, capsys):
    missing = tmp_path / "nope" / "run"
    assert sample_main(["--out_dir", str(missing)]) == 2
    assert "--out_dir=" in capsys.readouterr().err and not (tmp_path / "nope").exists()
    (tmp_path / "empty").mkdir()
    assert sample_main(["--out_dir", str(tmp_path / "empty")]) == 2
    assert "no checkpoints/ folder" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []


def test_sample_module_runs_without_a_runpy_warning():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "train.sample", "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--out_dir" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("tool", ["train.sample", "train.evaluate"])
def test_out_is_not_a_run_folder_flag(tool, capsys):
    """`--out` names a dataset folder (`train.prepare`); a run's folder is `--out_dir`, and
    argparse's abbreviations must not make `--out` mean it."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(tool).main(["--out=somewhere"])
    assert exit_.value.code == 2
    assert "--out_dir" in capsys.readouterr().err
