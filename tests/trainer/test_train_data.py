"""The trainer on every dataset layout: a nanoGPT-prepared folder, modded-nanogpt shards
and a prepared folder each train, resume exactly, evaluate and sample; bad data stops the
CLI with one line before anything compiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from repository import ROOT
from train import config as tc
from train import data as td
from train import tokenizer as ttok
from train.evaluate import evaluate_split
from train.sample import main as sample_main
from trainer.support import nanogpt_char_folder

pytestmark = pytest.mark.usefixtures("compilation_cache")


class DigitsEncoding:
    """A stand-in for tiktoken's GPT-2 encoding (which cannot be downloaded in tests):
    decodes id i as `<i>`."""

    name, n_vocab, eot_token = "gpt2", td.GPT2_VOCAB_SIZE, 50256

    def encode_ordinary(self, text):
        return [int(t) for t in text.replace(">", "").split("<") if t]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _fineweb(tmp_path: Path) -> Path:
    """GPT-2-id shards whose text is a few repeated 'sentences' of ids, so loss falls."""
    rng = np.random.default_rng(0)
    sentences = [rng.integers(0, td.GPT2_VOCAB_SIZE, 12) for _ in range(6)]
    folder = tmp_path / "fineweb"
    folder.mkdir()
    for split, count in (("train", 3), ("val", 1)):
        for i in range(count):
            ids = np.concatenate([sentences[j] for j in rng.integers(0, 6, 300)])
            td.write_shard(folder / f"fineweb_{split}_{i:06d}.bin", ids)
    return folder


def _prepared_bytes(tmp_path: Path) -> Path:
    text = td.SHIPPED_CORPUS.read_text(encoding="utf-8")[:30000].encode()
    folder = tmp_path / "prepared"
    folder.mkdir()
    ids = np.frombuffer(text, np.uint8).astype(np.uint16)
    td.write_shard(folder / "tokens_train_000000.bin", np.concatenate([[256], ids[:27000]]))
    td.write_shard(folder / "tokens_val_000000.bin", ids[27000:])
    (folder / td.DATASET_META).write_text(json.dumps(
        {"layout": "shards", "vocab_size": 257, "tokenizer": {"kind": "bytes"}}))
    return folder


LAYOUTS = {
    "nanogpt_char": lambda tmp: nanogpt_char_folder(
        tmp, td.SHIPPED_CORPUS.read_text(encoding="utf-8")[:30000]),
    "fineweb": _fineweb,
    "prepared_bytes": _prepared_bytes,
}


def _tiny(data: Path, out: Path, **overrides) -> tc.TrainConfig:
    base = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, dtype="float32",
                optimizer="adamw", learning_rate=1e-2, final_lr_scale=0.1, warmup_iters=1,
                max_iters=6, lr_decay_iters=6, eval_interval=3, eval_iters=2, log_interval=1,
                checkpoint_every=3, mesh_data=1, num_samples=1, sample_max_new_tokens=8,
                sample_start="", progress=False, data=str(data), out_dir=str(out))
    return tc.override(tc.TrainConfig(), **{**base, **overrides})


def _losses(history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_trains_resumes_evaluates_and_samples(layout, tmp_path, monkeypatch,
                                                          capsys):
    monkeypatch.setattr(ttok.TiktokenTokenizer, "gpt2",
                        classmethod(lambda cls: cls(DigitsEncoding(), "gpt2")))
    data = LAYOUTS[layout](tmp_path)
    whole = train.run(_tiny(data, tmp_path / "whole"))
    losses = _losses(whole.history)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
    vocab = td.open_dataset(data).vocab_size
    config = json.loads((whole.out_dir / "config.json").read_text())
    assert config["model"]["vocab_size"] == (50304 if vocab > 1024 else vocab)

    half = _tiny(data, tmp_path / "half", max_iters=3)
    train.run(half)
    resumed = train.run(tc.override(half, max_iters=6, resume=True))
    assert _losses(resumed.history) == {s: v for s, v in losses.items() if s > 3}  # bitwise

    r = evaluate_split(whole.out_dir, eval_tokens=5 * 16)
    assert r["windows"] == 5 and r["step"] == 6 and np.isfinite(r["loss"])
    capsys.readouterr()  # the runs' own lines
    assert sample_main(["--out_dir", str(whole.out_dir), "--num_samples=1",
                        "--max_new_tokens=5", "--start="]) == 0
    text = capsys.readouterr().out.split("\n---------------")[0]
    if layout == "fineweb":  # an end-of-text start, then five ids, each a real GPT-2 id
        ids = [int(t) for t in text.replace(">", "").split("<") if t]
        assert len(ids) == 6 and ids[0] == 50256 and max(ids) < td.GPT2_VOCAB_SIZE
    else:
        assert len(text) >= 1
    assert (whole.out_dir / "samples.txt").read_text().strip()


def test_resume_with_other_data_is_refused(tmp_path):
    data = _prepared_bytes(tmp_path)
    config = _tiny(data, tmp_path / "run", max_iters=3, num_samples=0)
    train.run(config)
    other = nanogpt_char_folder(tmp_path, "abcdefgh " * 200)
    with pytest.raises(ValueError, match=r"its data's tokenizer \(kind=bytes\) is not this "
                                         r"--data's \(a vocabulary of 9 characters\)"):
        train.run(tc.override(config, data=str(other), max_iters=6, resume=True))


@pytest.mark.parametrize("make, message", [
    (lambda tmp: (tmp / "owt").mkdir() or tmp / "owt",
     "a folder without train.bin/val.bin"),
    (lambda tmp: td.write_shard(tmp / "x_train_000000.bin", [1, 2, 3]),
     "is one modded-nanogpt shard; pass its folder"),
])
def test_cli_bad_data_is_one_line_before_compiling(tmp_path, make, message):
    path = make(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "train", f"--data={path}",
                           f"--out_dir={out}", "--max_iters=2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "Traceback" not in proc.stderr and not proc.stdout.startswith("train:")
