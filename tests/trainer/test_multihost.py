"""Multi-process training on one machine: 2 processes x 4 CPU devices (gloo collectives).

The two processes form one 8-device mesh through `jax.distributed` (`python -m train
--coordinator=... --num_processes=2 --process_id=I`), each feeding its own half of every
batch; their losses must follow the single-process 8-device run, and their collectively
written checkpoint must restore into a 1-device run that continues the same trajectory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import train
from references.error import bound, error
from repository import ROOT
from train import config as tc
from train import data as td
from train.checkpoint import Checkpointer
from train.sample import load_params
from trainer.support import SCALE_DEPENDENT, permute_rows, rounded_otherwise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(config: tc.TrainConfig, command) -> list[subprocess.Popen]:
    """`command(i) + config's flags` as processes 0 and 1 of one run, 4 CPU devices each."""
    argv = [f"--{k}={v}" for k, v in tc.flat_dict(config).items()
            if v is not None and k != "sample_start"]
    flags = os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=4")
    env = {**os.environ, "XLA_FLAGS": flags,
           "PYTHONPATH": str(ROOT)}
    port = _free_port()
    return [subprocess.Popen(
        [*command(i), *argv, f"--coordinator=localhost:{port}", "--num_processes=2",
         f"--process_id={i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for i in range(2)]


def _losses(history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@contextlib.contextmanager
def _rounded_otherwise(config):
    """`train.run` inside computes the same steps with their roundings moved (the peer of
    `trainer.support.peer_steps`): every training batch's rows permuted (within each
    DiLoCo replica's block) and, unless the recipe is scale-dependent, the loss scaled."""
    clean = td.TokenDataset.batch

    def permuted(self, split, step, **kw):
        x, y = clean(self, split, step, **kw)
        if split != "train":
            return x, y
        xy = permute_rows(np.stack([x, y]), step, config.mesh.diloco)
        return xy[0], xy[1]

    scaled = (contextlib.nullcontext() if config.optimizer.name in SCALE_DEPENDENT
              else rounded_otherwise())
    td.TokenDataset.batch = permuted
    try:
        with scaled:
            yield
    finally:
        td.TokenDataset.batch = clean


def _assert_as_close(got_dir, ref_dir, peer_dir, step):
    """Each leaf of the params `got_dir` saved at `step` (the weights it evaluates) is at
    most 4x as far from `ref_dir`'s as `peer_dir`'s are, plus a few float32 roundings
    (references.error.bound; the distances over many entries, not one lucky loss)."""
    (_, got, _), (_, ref, _), (_, peer, _) = (load_params(d, step)
                                              for d in (got_dir, ref_dir, peer_dir))
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref),
                               jax.tree.leaves(peer), strict=True):
        assert error(a, b) <= bound(c, b), (step, jax.tree_util.keystr(path), error(a, b),
                                            bound(c, b))


# snoo_muon and kfac with the params sharded over fsdp (8 devices), so Muon's whole-matrix
# Newton-Schulz and K-FAC's distributed refresh run across hosts; snoo_adamw as DiLoCo, one
# replica per process (fsdp over its 4 devices; the sync's all-reduce crosses hosts as a
# data-parallel gradient's would: plain data parallelism across processes is the token
# shards test below); its restore takes one device per replica.
@pytest.mark.parametrize("optimizer,mesh,hyperparameters", [
    ("snoo_muon", dict(mesh_data=1, mesh_fsdp=-1), dict(adam_learning_rate=1e-2, snoo_k=2)),
    ("kfac", dict(mesh_data=1, mesh_fsdp=-1),
     dict(adam_learning_rate=1e-2, kfac_learning_rate=1e-2, kfac_interval=2)),
    ("snoo_adamw", dict(mesh_diloco=2, mesh_data=1, mesh_fsdp=-1),
     dict(learning_rate=1e-2, snoo_k=2)),
])
def test_two_processes_match_one_and_restore_on_one_device(corpus, tmp_path, optimizer, mesh,
                                                           hyperparameters):
    config = tc.override(
        tc.TrainConfig(), n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8,
        dtype="float32", optimizer=optimizer, final_lr_scale=0.1, warmup_iters=2,
        max_iters=4, lr_decay_iters=8, eval_interval=4, eval_iters=1, log_interval=1,
        checkpoint_every=4, num_samples=0, progress=False, data=str(corpus),
        out_dir=str(tmp_path / "multi"), **mesh, **hyperparameters)
    procs = _two_processes(config, lambda i: [sys.executable, "-m", "train"])
    # Meanwhile, the reference: one process, all 8 devices, 8 steps; and its peer, the
    # same run with its roundings moved. The processes' collectives sum in another order
    # than the one process's, and no float64 run spans processes: the bound is the peer's
    # distance from the reference.
    one, peer = tmp_path / "one", tmp_path / "peer"
    reference = train.run(tc.override(config, out_dir=str(one), max_iters=8)).history
    with _rounded_otherwise(config):
        train.run(tc.override(config, out_dir=str(peer), max_iters=8))
    for i, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"process {i}:\n{output}"
    multi = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(_losses(multi)) == [1, 2, 3, 4]
    assert np.all(np.isfinite(list(_losses(multi).values())))
    assert Checkpointer(tmp_path / "multi" / "checkpoints").steps() == [4]
    _assert_as_close(tmp_path / "multi", one, peer, 4)

    # The 8-device, 2-process checkpoint restores on one device and continues the run.
    resumed = train.run(tc.override(config, mesh_data=1, mesh_fsdp=1, resume=True,
                                    max_iters=8))
    assert sorted(s for s in _losses(resumed.history) if s > 4) == [5, 6, 7, 8]
    assert sorted(_losses(reference)) == list(range(1, 9))
    _assert_as_close(tmp_path / "multi", one, peer, 8)


_RECORD = """
import json, sys
from train import data as td

log = open(sys.argv[1], "a")
batch, read = td.TokenDataset.batch, td.TokenSplit.read

def recorded_batch(self, split, step, **kw):
    x, y = batch(self, split, step, **kw)
    rows = kw.get("rows")
    log.write(json.dumps({"split": split, "step": step, "rows": [rows.start, rows.stop],
                          "x": x.tolist()}) + "\\n")
    return x, y

def recorded_read(self, shard, offset, length, vocab_size):
    log.write(json.dumps({"windows_read": int(offset.size)}) + "\\n")
    return read(self, shard, offset, length, vocab_size)

td.TokenDataset.batch, td.TokenSplit.read = recorded_batch, recorded_read
from train.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def test_each_process_reads_only_its_rows_of_token_shards(tmp_path):
    """2 processes x 4 devices on modded-nanogpt shards: each reads only its half of every
    batch (4 of 8 rows per micro-batch), and those rows are the global batch's."""
    from train import data as td

    folder = tmp_path / "shards"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 1)):
        for i in range(n):
            td.write_shard(folder / f"fw_{split}_{i:06d}.bin", rng.integers(0, 500, 2000))
    (tmp_path / "record.py").write_text(_RECORD)
    config = tc.override(
        tc.TrainConfig(), n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8,
        grad_accum=2, dtype="float32", optimizer="adamw", max_iters=2, eval_interval=2,
        eval_iters=1, log_interval=1, checkpoint_every=2, num_samples=0, progress=False,
        mesh_data=-1, data=str(folder), out_dir=str(tmp_path / "multi"))
    logs = [tmp_path / f"reads{i}.jsonl" for i in range(2)]
    procs = _two_processes(
        config, lambda i: [sys.executable, str(tmp_path / "record.py"), str(logs[i])])
    for i, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"process {i}:\n{output}"
    data = td.open_dataset(folder)
    for i, log in enumerate(logs):
        entries = [json.loads(x) for x in log.read_text().splitlines()]
        batches = [e for e in entries if e.get("split") == "train"]
        assert {e["step"] for e in batches} >= {0, 1}
        for e in batches:
            assert e["rows"] == [4 * i, 4 * i + 4]
            whole, _ = data.batch("train", e["step"], batch_size=8, block_size=16,
                                  grad_accum=2, seed=config.run.seed)
            np.testing.assert_array_equal(e["x"], whole[:, 4 * i:4 * i + 4])
        # every read of the process: 4 rows x 2 micro-batches (train), 4 rows (eval)
        assert {e["windows_read"] for e in entries if "windows_read" in e} == {8, 4}
