"""Datasets: every layout recognised, windows drawn as a pure function of the step, bad
files refused in one line, memory flat in the data's size, batches prefetched."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from repository import ROOT
from train import data as td
from train.tokenizer import ByteTokenizer, CharTokenizer
from trainer.support import nanogpt_char_folder


def one_shard(ids) -> td.TokenDataset:
    split = td.TokenSplit((td.Shard(None, 0, len(ids), np.asarray(ids)),))
    return td.TokenDataset({"train": split, "val": split}, int(np.max(ids)) + 1,
                           {"kind": "bytes"}, "test")


def fineweb_folder(tmp_path: Path, train_lengths, val_lengths=(50,), seed=0, vocab=50257):
    """modded-nanogpt shards of random ids; returns the folder and the token arrays."""
    rng = np.random.default_rng(seed)
    folder = tmp_path / "fineweb"
    folder.mkdir(exist_ok=True)
    arrays = {}
    for split, lengths in (("train", train_lengths), ("val", val_lengths)):
        arrays[split] = [rng.integers(0, vocab, n).astype(np.uint16) for n in lengths]
        for i, a in enumerate(arrays[split]):
            td.write_shard(folder / f"fineweb_{split}_{i:06d}.bin", a)
    return folder, arrays


# ---------------------------------------------------------------------------- windows


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_window_start_of_a_split_is_reachable(split):
    """Ids are their positions, so a window's first input is its start."""
    n, T = 23, 5  # starts 0 .. n - T - 1: the last window's target is the split's last id
    data = one_shard(np.arange(n, dtype=np.uint16))
    starts = set()
    for step in range(200):
        x, y = data.batch(split, step, batch_size=4, block_size=T, seed=0)
        np.testing.assert_array_equal(x + 1, y)
        assert int(y.max()) <= n - 1
        starts |= set(x[..., 0].ravel().tolist())
    assert starts == set(range(n - T))
    x, _ = data.eval_batches(split, num_batches=100, batch_size=4, block_size=T, seed=0)
    assert set(x[..., 0].ravel().tolist()) == set(range(n - T))


def test_shard_windows_stay_inside_one_file_and_cover_every_file(tmp_path):
    """Ids encode (shard, position): a window never straddles two shards, each shard's
    every window is drawn, and shards too short for a window are never drawn."""
    T, lengths = 4, (9, 3, 30, 5)  # the 3-token shard holds no window of 4 + 1
    folder = tmp_path / "s"
    folder.mkdir()
    for i, n in enumerate(lengths):
        td.write_shard(folder / f"x_train_{i:06d}.bin", 1000 * i + np.arange(n))
    td.write_shard(folder / "x_val_000000.bin", np.arange(10))
    data = td.open_dataset(folder, check=False)
    seen = set()
    for step in range(400):
        x, y = data.batch("train", step, batch_size=8, block_size=T, seed=1)
        np.testing.assert_array_equal(x + 1, y)  # consecutive ids: one shard, in order
        seen |= {(int(s) // 1000, int(s) % 1000) for s in x[..., 0].ravel()}
    expected = {(i, p) for i, n in enumerate(lengths) for p in range(max(n - T, 0))}
    assert seen == expected


def test_batches_are_a_function_of_seed_and_step_whatever_was_read_before(tmp_path):
    folder, _ = fineweb_folder(tmp_path, (700, 300, 1000))
    kw = dict(batch_size=6, block_size=16, seed=3, grad_accum=2)
    first = td.open_dataset(folder)
    run = [first.batch("train", s, **kw) for s in range(10)]
    resumed = td.open_dataset(folder)  # a restarted process, reading from step 7 on
    for s in (7, 8, 9, 3):
        np.testing.assert_array_equal(resumed.batch("train", s, **kw)[0], run[s][0])
    # a process's rows are those rows of the global batch, and only they are read
    rows = first.batch("train", 4, rows=slice(2, 5), **kw)
    np.testing.assert_array_equal(rows[0], run[4][0][:, 2:5])


def test_rows_read_only_the_process_windows(tmp_path, monkeypatch):
    folder, _ = fineweb_folder(tmp_path, (500,))
    data = td.open_dataset(folder)
    read = []
    original = td.TokenSplit.read

    def counting(self, shard, offset, length, vocab_size):
        read.append(offset.size)
        return original(self, shard, offset, length, vocab_size)

    monkeypatch.setattr(td.TokenSplit, "read", counting)
    data.batch("train", 0, batch_size=8, block_size=8, grad_accum=3, rows=slice(4, 6))
    assert read == [3 * 2]


def test_sequential_windows_read_every_window_once_and_stop_at_eval_tokens(tmp_path):
    folder, arrays = fineweb_folder(tmp_path, (10,), val_lengths=(23, 2, 11))
    data = td.open_dataset(folder)
    T = 5
    got = list(data.sequential_windows("val", T, batch_size=3))
    x = np.concatenate([g[0] for g in got])
    y = np.concatenate([g[1] for g in got])
    expected = [a[i * T:i * T + T + 1] for a in arrays["val"] for i in range((len(a) - 1) // T)]
    np.testing.assert_array_equal(np.concatenate([x, y[:, -1:]], axis=1), expected)
    assert [len(g[0]) for g in got] == [3, 3]  # 4 + 0 + 2 windows
    capped = list(data.sequential_windows("val", T, batch_size=3, max_tokens=2 * T + 4))
    assert sum(len(g[0]) for g in capped) == 2


# ------------------------------------------------------------------------ recognising


def test_text_file_is_the_character_dataset(tmp_path):
    path = tmp_path / "input.txt"
    text = "to be or not to be, that is the question\n" * 30
    path.write_text(text)
    data = td.open_dataset(path)
    assert data.tokenizer == CharTokenizer.from_text(text) and data.vocab_size == len(set(text))
    assert data.num_tokens("train") == int(len(text) * 0.9)
    assert data.tokenizer_meta == {"kind": "chars", "chars": "".join(sorted(set(text)))}


def test_nanogpt_char_folder_with_meta_pkl(tmp_path):
    text = (td.SHIPPED_CORPUS.read_text(encoding="utf-8"))[:20000]
    folder = nanogpt_char_folder(tmp_path, text)
    data = td.open_dataset(folder)
    assert data.vocab_size == len(set(text)) and "meta.pkl" in data.source
    x, _ = data.batch("train", 0, batch_size=2, block_size=32, seed=0)
    assert data.tokenizer.decode(x[0, 0]) in text
    # the same characters and split as the text file itself: the same batches
    assert data.tokenizer == CharTokenizer.from_text(text)
    (tmp_path / "input.txt").write_text(text)
    text_data = td.open_dataset(tmp_path / "input.txt")
    for split in ("train", "val"):
        np.testing.assert_array_equal(
            data.batch(split, 5, batch_size=4, block_size=16, seed=2)[0],
            text_data.batch(split, 5, batch_size=4, block_size=16, seed=2)[0])


def test_nanogpt_folder_without_meta_is_gpt2(tmp_path):
    folder = tmp_path / "owt"
    folder.mkdir()
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(folder / f"{split}.bin")
    data = td.open_dataset(folder)
    assert data.vocab_size == td.GPT2_VOCAB_SIZE
    assert data.tokenizer_meta == {"kind": "tiktoken", "name": "gpt2"}


def test_fineweb_shards_by_folder_and_by_glob(tmp_path):
    folder, arrays = fineweb_folder(tmp_path, (100, 200), val_lengths=(40,))
    for where in (folder, str(folder / "fineweb_*.bin")):
        data = td.open_dataset(where)
        assert data.num_tokens("train") == 300 and data.num_tokens("val") == 40
        assert data.vocab_size == td.GPT2_VOCAB_SIZE
    assert td.read_shard_header(folder / "fineweb_train_000001.bin") == 200
    raw = np.fromfile(folder / "fineweb_train_000001.bin", np.uint16)[512:]
    np.testing.assert_array_equal(raw, arrays["train"][1])


def test_prepared_folder_names_its_tokenizer(tmp_path):
    folder = tmp_path / "prepared"
    folder.mkdir()
    td.write_shard(folder / "tokens_train_000000.bin", np.arange(300) % 257)
    td.write_shard(folder / "tokens_val_000000.bin", np.arange(50) % 257)
    (folder / td.DATASET_META).write_text(json.dumps(
        {"layout": "shards", "vocab_size": 257, "tokenizer": {"kind": "bytes"}}))
    data = td.open_dataset(folder)
    assert data.vocab_size == 257 and isinstance(data.tokenizer, ByteTokenizer)


# ------------------------------------------------------------------------- refusals


def _shard_bytes(magic=td.SHARD_MAGIC, version=td.SHARD_VERSION, count=10, tokens=10):
    header = np.zeros(256, np.int32)
    header[:3] = magic, version, count
    return header.tobytes() + np.zeros(tokens, np.uint16).tobytes()


@pytest.mark.parametrize("payload, message", [
    (_shard_bytes(magic=1234), "magic number 1234, expected 20240520"),
    (_shard_bytes(version=2), "version 2, expected 1"),
    (_shard_bytes(count=12), r"1044 bytes, expected 1048 \(header \+ 2 bytes x 12 tokens"),
    # longer than its header says (trailing ids no reader would count)
    (_shard_bytes(count=8), r"1044 bytes, expected 1040 \(header \+ 2 bytes x 8 tokens"),
    (b"\0" * 100, "shorter than a shard's 1024-byte header"),
])
def test_a_bad_shard_is_one_line_naming_the_file(tmp_path, payload, message):
    folder, _ = fineweb_folder(tmp_path, (100,))
    bad = folder / "fineweb_train_000001.bin"
    bad.write_bytes(payload)
    with pytest.raises(ValueError, match=f"^{bad}: .*{message}") as err:
        td.open_dataset(folder)
    assert "\n" not in str(err.value)


def test_empty_split_missing_split_and_out_of_vocabulary_ids(tmp_path):
    folder, _ = fineweb_folder(tmp_path, (100,))
    td.write_shard(folder / "fineweb_val_000000.bin", [])
    with pytest.raises(ValueError, match="the val split is empty"):
        td.open_dataset(folder)
    (folder / "fineweb_val_000000.bin").unlink()
    with pytest.raises(ValueError, match=r"no val shard \(expected files named \*_val_\*.bin"):
        td.open_dataset(folder)
    td.write_shard(folder / "fineweb_val_000000.bin", [1, 2, 3, 50257, 4])
    with pytest.raises(ValueError, match="fineweb_val_000000.bin: token id 50257 at token 3, "
                                         "expected ids below the vocabulary size 50257"):
        td.open_dataset(folder)
    # Large datasets are sampled when they open; every batch is checked as it is read.
    data = td.open_dataset(folder, check=False)
    with pytest.raises(ValueError, match="token id 50257"):
        for step in range(50):
            data.batch("val", step, batch_size=4, block_size=2)


def test_token_files_and_unknown_folders_are_refused_with_what_to_pass(tmp_path):
    folder = tmp_path / "owt"
    folder.mkdir()
    np.arange(100, dtype=np.uint16).tofile(folder / "train.bin")
    with pytest.raises(ValueError, match="is a token file; pass the folder"):
        td.open_dataset(folder / "train.bin")
    with pytest.raises(ValueError, match="a folder without train.bin/val.bin"):
        td.open_dataset(folder)  # val.bin missing
    shard, _ = fineweb_folder(tmp_path, (100,))
    with pytest.raises(ValueError, match="is one modded-nanogpt shard; pass its folder"):
        td.open_dataset(shard / "fineweb_train_000000.bin")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3"):
        td.open_dataset(latin1)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        td.open_dataset(tmp_path / "missing")
    np.arange(5, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "train.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="7 bytes, expected an even size"):
        td.open_dataset(folder)


def test_meta_pkl_that_would_run_code_is_refused(tmp_path):
    folder = nanogpt_char_folder(tmp_path, "hello world " * 100)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": Exploit()}))
    with pytest.raises(ValueError, match=r"meta.pkl: not a nanoGPT meta.pkl of plain data "
                                         r"\(refused to load (posix|os).system"):
        td.open_dataset(folder)
    assert not marker.exists()
    # a builtin is as much code as os.system: eval of a string that would write the marker
    class BuiltinExploit:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w').close()",))

    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": BuiltinExploit()}))
    with pytest.raises(ValueError, match=r"refused to load builtins.eval"):
        td.open_dataset(folder)
    assert not marker.exists()
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 2, "itos": {0: "a"}}))
    with pytest.raises(ValueError, match="expected nanoGPT's character vocabulary"):
        td.open_dataset(folder)


# ------------------------------------------------------------------------- memory

_RSS_SCRIPT = textwrap.dedent("""
    import resource, sys
    from train import data as td

    def rss_mib():
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    data = td.open_dataset(sys.argv[1])
    before = rss_mib()
    for step in range(20):
        data.batch("train", step, batch_size=32, block_size=1024, grad_accum=2, seed=0)
    for x, _ in data.sequential_windows("val", 1024, batch_size=64, max_tokens=2**22):
        pass
    with open("/proc/self/maps") as f:
        mapped = sum(sys.argv[1] in line for line in f)
    print(data.num_tokens("train"), mapped, before, rss_mib(),
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
""")


def _rss(folder: Path) -> tuple[int, int, float, float, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(folder)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), int(out[1]), *map(float, out[2:])


def test_memory_does_not_grow_with_the_dataset(tmp_path):
    """Four shards of 1.5 GiB each (sparse files: id 0 everywhere) against a tiny set: the
    same resident memory after 20 batches of 64 x 1025 tokens and 4M tokens of val
    windows, and no file left mapped (pages a live map touched would stay resident)."""
    big = tmp_path / "big"
    big.mkdir()
    n = 3 * 2**29  # 1.5 GiB of uint16 per shard: 6 GiB in all
    for i in range(4):
        header = np.zeros(256, np.int32)
        header[:3] = td.SHARD_MAGIC, td.SHARD_VERSION, n
        with open(big / f"big_train_{i:06d}.bin", "wb") as f:
            f.write(header.tobytes())
            f.truncate(1024 + 2 * n)
    td.write_shard(big / "big_val_000000.bin", np.zeros(2**22 + 1, np.uint16))
    small, _ = fineweb_folder(tmp_path, (5000,), val_lengths=(3000,))
    tokens_big, mapped_big, before_big, after_big, peak_big = _rss(big)
    tokens_small, mapped_small, before_small, after_small, peak_small = _rss(small)
    assert tokens_big == 4 * n and tokens_small == 5000
    assert mapped_big == mapped_small == 0
    # Each process's growth from its dataset opened (two interpreters' imports differ by a
    # few MiB of pages, which is not the dataset's). The val windows alone are 8 MiB of
    # pages; the peak adds one 8 MiB scan chunk.
    grown_big, grown_small = after_big - before_big, after_small - before_small
    assert grown_big - grown_small < 4, (grown_big, grown_small)
    assert (peak_big - before_big) - (peak_small - before_small) < 24, (peak_big, peak_small)


# ---------------------------------------------------------------------- prefetching


def test_prefetcher_returns_each_step_and_raises_the_make_error():
    made, next_made = [], threading.Event()

    def make(step):
        made.append(step)
        if step == 1:
            next_made.set()
        if step == 3:
            raise ValueError("bad batch 3")
        return step * 10

    with td.BatchPrefetcher(make) as batches:
        assert batches.get(0) == 0
        assert next_made.wait(10)  # step 1 made in the background, before anyone asked
        assert [batches.get(s) for s in (1, 2)] == [10, 20]
        assert made[:3] == [0, 1, 2]
        assert batches.get(7) == 70  # a jump (a resumed loop): made now, not prefetched
        with pytest.raises(ValueError, match="bad batch 3"):
            batches.get(3)
    off = td.BatchPrefetcher(lambda s: s, enabled=False)
    assert off.get(5) == 5
    off.close()
