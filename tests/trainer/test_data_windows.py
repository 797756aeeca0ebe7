"""Which tokens the sequential order and the first-N validation windows hold, computed from
the raw token files with modded-nanogpt Track 3's generator semantics (`train.data`'s module
docstring; records/track_3_optimization/train_gpt_simple.py, `distributed_data_generator`):
each step the next `A*B*T + 1` ids of the current shard, read as `A*B` rows of `T` (targets
one further), a shard left when `pos + A*B*T + 1 >= len(tokens)`; the validation set the val
split's first `val_tokens` ids as contiguous windows of `T`.

A process's slice `rows=lo:hi` of micro-batch `a` holds rows `a*B + lo ... a*B + hi - 1` of
the step: micro-batch `a` is one global batch of `B` rows sharded over the processes, so any
number of processes reads what one process reads. (The file's rank `r` reads the contiguous
rows `r*A*B/W ...` and splits them into its micro-batches; over all ranks and micro-batches
that is the same rows, once each, so the summed loss and gradient are the same.)
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest

from train import config as tc
from train import data as td
from train import loop
from trainer.support import nanogpt_char_folder

B, T = 4, 8


def file_steps(lengths, step_tokens):
    """(shard, pos) of each step, replaying the file's generator loop: the first shard at 0,
    then `pos += step_tokens`, the next shard whenever `pos + step_tokens + 1 >= len`."""
    shard, pos = 0, 0
    while True:
        if pos + step_tokens + 1 >= lengths[shard]:
            shard, pos = shard + 1, 0
            if shard == len(lengths):
                return
        yield shard, pos
        pos += step_tokens


def step_rows(ids, pos, n_rows):
    """The step's rows: inputs `ids[pos + k*T : pos + k*T + T]`, targets one further."""
    x = np.stack([ids[pos + k * T: pos + k * T + T] for k in range(n_rows)])
    y = np.stack([ids[pos + k * T + 1: pos + k * T + T + 1] for k in range(n_rows)])
    return x.astype(np.int32), y.astype(np.int32)


def shards_dataset(tmp_path, lengths):
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 50257, n).astype(np.uint16) for n in lengths]
    for i, ids in enumerate(shards):
        td.write_shard(tmp_path / f"fw_train_{i:06d}.bin", ids)
    td.write_shard(tmp_path / "fw_val_000000.bin", rng.integers(0, 50257, 3000))
    return td.open_dataset(tmp_path), shards


# 2*4*8 = 64 tokens a step (96 with A = 3): several steps in each shard, three shard changes.
LENGTHS = [300, 150, 450, 1000]


@pytest.mark.parametrize("grad_accum", [2, 3])
@pytest.mark.parametrize("processes", [2, 4])
def test_each_micro_batch_of_each_row_slice(tmp_path, grad_accum, processes):
    data, shards = shards_dataset(tmp_path, LENGTHS)
    A, per = grad_accum, B // processes
    steps = list(file_steps(LENGTHS, A * B * T))
    assert len({s for s, _ in steps}) == len(LENGTHS) and len(steps) > 10
    for step, (shard, pos) in enumerate(steps):
        chunk_x, chunk_y = step_rows(shards[shard], pos, A * B)
        for p in range(processes):
            lo = p * per
            x, y = data.sequential_batch("train", step, batch_size=B, block_size=T,
                                         grad_accum=A, rows=slice(lo, lo + per))
            assert x.shape == y.shape == (A, per, T)
            for a in range(A):  # micro-batch a, this process's rows: rows a*B + lo + i
                want = [a * B + lo + i for i in range(per)]
                np.testing.assert_array_equal(x[a], chunk_x[want], f"step {step} p {p} mb {a}")
                np.testing.assert_array_equal(y[a], chunk_y[want], f"step {step} p {p} mb {a}")


def test_first_val_windows_of_each_row_slice(tmp_path):
    data, _ = shards_dataset(tmp_path, LENGTHS)
    val = np.asarray(data.splits["val"].shards[0].open())
    batches = 5
    x_all, y_all = step_rows(val, 0, batches * B)  # windows 0, T, 2T, ... of the split
    for processes in (1, 2, 4):
        per = B // processes
        for p in range(processes):
            rows = slice(p * per, (p + 1) * per)
            x, y = data.first_windows("val", num_tokens=batches * B * T, batch_size=B,
                                      block_size=T, rows=rows)
            assert x.shape == (batches, per, T)
            for b in range(batches):
                want = [b * B + p * per + i for i in range(per)]
                np.testing.assert_array_equal(x[b], x_all[want])
                np.testing.assert_array_equal(y[b], y_all[want])


def test_the_trainer_reads_its_steps_and_the_first_val_tokens(tmp_path):
    """What the trainer builds for a sequential run with val_tokens: the train batches of
    its steps from train.bin, and the val loss's windows from the start of val.bin."""
    rng = np.random.default_rng(3)
    text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ,.\n"), size=6000))
    folder = nanogpt_char_folder(tmp_path, text)
    train_ids, val_ids = (np.fromfile(folder / f"{s}.bin", np.uint16) for s in ("train", "val"))
    A, val_batches = 2, 3
    config = tc.override(tc.TrainConfig(), **{
        "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": T, "batch_size": B,
        "grad_accum": A, "dtype": "float32", "mesh_data": 1, "optimizer": "adamw",
        "data": str(folder), "data_order": "sequential", "val_tokens": val_batches * B * T,
        "eval_iters": 1, "max_iters": 4, "progress": False, "out_dir": str(tmp_path / "run")})
    with contextlib.ExitStack() as stack:
        r = loop._setup(config, stack)
        val_x, val_y = (np.asarray(a) for a in r.evals["val"])
        train = [tuple(np.asarray(a) for a in r.batches.get(s)) for s in range(3)]
    x_all, y_all = step_rows(val_ids, 0, val_batches * B)
    np.testing.assert_array_equal(val_x, x_all.reshape(val_batches, B, T))
    np.testing.assert_array_equal(val_y, y_all.reshape(val_batches, B, T))
    for step, (shard, pos) in enumerate(itertools.islice(file_steps([len(train_ids)],
                                                                    A * B * T), 3)):
        assert shard == 0
        x, y = step_rows(train_ids, pos, A * B)
        np.testing.assert_array_equal(train[step][0], x.reshape(A, B, T), f"step {step}")
        np.testing.assert_array_equal(train[step][1], y.reshape(A, B, T), f"step {step}")
