"""The sequential data order against a numpy port of modded-nanogpt's
`distributed_data_generator` (records/track_3_optimization/train_gpt_simple.py): the same
tokens every step, for every rank, across shard boundaries, with accumulation and on resume;
and the validation windows against the same generator's first batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from train import data as td


def file_generator(shards, batch_size, seq_len, rank=0, world_size=1):
    """The file's generator, ported line by line (torch tensors -> numpy arrays)."""
    assert batch_size % world_size == 0
    local_batch_size = batch_size // world_size
    file_iter = iter(shards)
    tokens, pos = next(file_iter), 0
    while True:
        if pos + batch_size + 1 >= len(tokens):
            tokens, pos = next(file_iter), 0
        buf = tokens[pos + rank * local_batch_size:][:local_batch_size + 1]
        inputs = buf[:-1].astype(np.int32)
        targets = buf[1:].astype(np.int64)
        pos += batch_size
        yield inputs.reshape(-1, seq_len), targets.reshape(-1, seq_len)


def _dataset(tmp_path, lengths, vocab=50257, seed=0):
    rng = np.random.default_rng(seed)
    shards = [rng.integers(0, vocab, n).astype(np.uint16) for n in lengths]
    for i, ids in enumerate(shards):
        td.write_shard(tmp_path / f"fw_train_{i:06d}.bin", ids)
    td.write_shard(tmp_path / "fw_val_000000.bin", rng.integers(0, vocab, 5000))
    return td.open_dataset(tmp_path), shards


# B*T = 4*8 = 32 tokens a step (x accumulation): a shard of 66 holds (66-2)//32 = 2 steps
# exactly at the file's boundary test (pos + 33 >= 66 at pos 64), 65 holds 1 (pos 32: 65 >=
# 65), 100 holds 3; 1000 many. With 64 tokens a step, the 65-token second shard holds the
# one step the file reads without testing.
LENGTHS = [66, 65, 100, 1000, 67]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_step_equals_the_files_generator(tmp_path, grad_accum):
    data, shards = _dataset(tmp_path, LENGTHS)
    B, T = 4, 8
    step_tokens = grad_accum * B * T
    total = sum(td.sequential_steps_per_shard(n, step_tokens, first=i == 0)
                for i, n in enumerate(LENGTHS))
    reference = list(itertools.islice(file_generator(shards, step_tokens, T), total))
    for step in range(total):  # each step computed on its own: a resume anywhere
        x, y = data.sequential_batch("train", step, batch_size=B, block_size=T,
                                     grad_accum=grad_accum)
        assert x.shape == y.shape == (grad_accum, B, T) and x.dtype == np.int32
        # micro-batch a = rows a*B..a*B+B-1 of the step's chunk, as the file's loop takes
        # `inputs[i*mbs:(i+1)*mbs]` with mbs = B on one rank
        np.testing.assert_array_equal(x.reshape(-1, T), reference[step][0])
        np.testing.assert_array_equal(y.reshape(-1, T), reference[step][1])
    # the generator has nothing more in the shards: it would open a missing sixth shard
    with pytest.raises(RuntimeError, match="StopIteration"):
        next(itertools.islice(file_generator(shards, step_tokens, T), total, None))
    with pytest.raises(ValueError, match=f"holds {total} steps"):
        data.sequential_batch("train", total, batch_size=B, block_size=T,
                              grad_accum=grad_accum)


def test_steps_per_shard_matches_the_files_boundary_test():
    # the file: the first shard is tested before its first step; a later one is read at
    # pos 0 as soon as it is opened, then tested before each further step
    for step_tokens in (1, 3, 32, 64):
        for length in range(step_tokens + 1, 200):
            for first in (True, False):
                pos, steps = 0, 0
                if not first:
                    steps, pos = 1, step_tokens
                while not pos + step_tokens + 1 >= length:  # the file's test, negated
                    steps, pos = steps + 1, pos + step_tokens
                assert td.sequential_steps_per_shard(length, step_tokens, first=first) == (
                    steps), (length, step_tokens, first)
    assert td.sequential_steps_per_shard(3, 32) == 0  # too short even for the file's read


def test_position_of_a_step_at_shard_boundaries():
    # steps per shard with 32 tokens: 2, 1, 3 -> steps 0,1 | 2 | 3,4,5
    lengths = [66, 65, 100]
    assert [td.sequential_position(lengths, s, 32) for s in range(6)] == [
        (0, 0), (0, 32), (1, 0), (2, 0), (2, 32), (2, 64)]
    # a first shard of 33 is tested and skipped; a later one of 33 is read once
    assert [td.sequential_position([33, 33, 66], s, 32) for s in range(3)] == [
        (1, 0), (2, 0), (2, 32)]
    with pytest.raises(ValueError, match="step=-1"):
        td.sequential_position(lengths, -1, 32)


def test_a_short_shard_is_skipped_whole(tmp_path):
    # 20 tokens hold no 32-token step (the file would read a short buffer from it)
    data, shards = _dataset(tmp_path, [66, 20, 100])
    x, _ = data.sequential_batch("train", 2, batch_size=4, block_size=8)
    np.testing.assert_array_equal(x.reshape(-1), shards[2][:32])


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_process_reads_the_rows_of_its_rank(tmp_path, world_size):
    data, shards = _dataset(tmp_path, LENGTHS)
    B, T = 4, 8
    for rank in range(world_size):
        gen = file_generator(shards, B * T, T, rank=rank, world_size=world_size)
        per = B // world_size
        rows = slice(rank * per, (rank + 1) * per)
        for step, (inputs, targets) in enumerate(itertools.islice(gen, 7)):
            x, y = data.sequential_batch("train", step, batch_size=B, block_size=T, rows=rows)
            np.testing.assert_array_equal(x[0], inputs)
            np.testing.assert_array_equal(y[0], targets)
            whole_x, _ = data.sequential_batch("train", step, batch_size=B, block_size=T)
            np.testing.assert_array_equal(x, whole_x[:, rows])


def test_validation_windows_are_the_files_first_val_batch(tmp_path):
    data, _ = _dataset(tmp_path, LENGTHS)
    val = data.splits["val"].shards[0].open()
    B, T, val_tokens = 4, 8, 4 * 4 * 8
    inputs, targets = next(file_generator([np.asarray(val)], val_tokens, T))
    x, y = data.first_windows("val", num_tokens=val_tokens, batch_size=B, block_size=T)
    assert x.shape == (4, B, T)
    np.testing.assert_array_equal(x.reshape(-1, T), inputs)
    np.testing.assert_array_equal(y.reshape(-1, T), targets)
    x1, _ = data.first_windows("val", num_tokens=val_tokens, batch_size=B, block_size=T,
                               rows=slice(2, 4))
    np.testing.assert_array_equal(x1, x[:, 2:4])
    for bad in (80, 100, 0):
        with pytest.raises(ValueError, match=f"val_tokens={bad}: expected a multiple of .* = 32 "):
            data.first_windows("val", num_tokens=bad, batch_size=B, block_size=T)
    with pytest.raises(ValueError, match="expected at least 10,240"):
        data.first_windows("val", num_tokens=10240, batch_size=B, block_size=T)


def test_text_corpus_reads_sequentially():
    data = td.TokenDataset.from_text("abcdefghij" * 30)
    ids = data.splits["train"].shards[0].array
    x, y = data.sequential_batch("train", 3, batch_size=2, block_size=5)
    np.testing.assert_array_equal(x.reshape(-1), ids[30:40])
    np.testing.assert_array_equal(y.reshape(-1), ids[31:41])
