"""Faults: non-finite steps, killed runs, damaged checkpoints, unwritable outputs, full disks.

Each test checks what the trainer did and that no checkpoint it had written was lost.
Tiny models on a small synthetic corpus, as in test_train.py.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import train
from optax_snoo import SnooState
from references.error import assert_as_accurate, float64, in_float64
from references.gpt64 import FLOAT64_DTYPES
from repository import ROOT
from train import config as tc
from train import data as td
from train.checkpoint import Checkpointer, CheckpointSaveError, CheckpointWarning
from train.nonfinite import NonFiniteError
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step
from trainer.support import tiny_in


def train_losses(history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


# ----------------------------------------------------------------------------- NaN / Inf

def _is_snoo(x):
    return isinstance(x, SnooState)


def snoo_counts(tree) -> list:
    return [x.count for x in jax.tree.leaves(tree, is_leaf=_is_snoo) if _is_snoo(x)]


def without_snoo_count(tree):
    return jax.tree.map(lambda x: x._replace(count=0) if _is_snoo(x) else x, tree,
                        is_leaf=_is_snoo)


@pytest.mark.parametrize("poison", ["inputs", "targets"])
def test_nonfinite_step_leaves_state_unchanged(corpus, tmp_path, poison):
    """An out-of-vocabulary id gathers NaN (jnp.take fills): the step changes no state."""
    config = tiny_in(corpus, tmp_path)
    vocab = td.open_dataset(corpus).vocab_size
    spec = build_optimizer(config)
    mesh = make_mesh(config)
    model, state = create_train_state(tc.model_config(config, vocab), spec.tx, seed=0,
                                      mesh=mesh)
    step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh),
                           max_bad_steps=2)
    put = lambda x: put_batch(x, batch_sharding(mesh))
    rng = np.random.default_rng(0)
    xy = rng.integers(0, vocab, (2, 1, 8, 16)).astype(np.int32)
    state, metrics = step(state, put(xy[0]), put(xy[1]), snoo_sync=False)  # one good step
    assert float(metrics["skipped"]) == 0.0
    before = jax.tree.map(lambda x: np.array(x, copy=True), state)
    bad = xy.copy()
    bad[0 if poison == "inputs" else 1, 0, 3, 5] = 10 * vocab
    for t in range(3):  # a sync step (Snoo's outer update would move its slow copy), twice
        state, metrics = step(state, put(bad[0]), put(bad[1]), snoo_sync=True)
        assert not np.isfinite(float(metrics["loss"]) + float(metrics["grad_norm"]))
        assert float(metrics["skipped"]) == 1.0
        assert int(state.bad_steps) == t + 1 and int(state.skipped_steps) == t + 1
        # Only Snoo's count moves: the skipped step keeps its slot in the period.
        assert [int(c) for c in snoo_counts(state)] == [c + t + 1 for c in snoo_counts(before)]
        unchanged = lambda s: without_snoo_count(s._replace(bad_steps=0, skipped_steps=0))
        jax.tree.map(np.testing.assert_array_equal, unchanged(state), unchanged(before))
    # Latched: past max_bad_steps even a good batch is skipped (the host stops the run).
    state, metrics = step(state, put(xy[0]), put(xy[1]), snoo_sync=False)
    assert float(metrics["skipped"]) == 1.0 and int(state.bad_steps) == 4


def test_snoo_hint_from_the_step_agrees_with_the_in_jit_sync_after_a_skipped_step(
        corpus, tmp_path):
    """The host's hint `step % k == 0` stays right after a skip: the same states as
    Snoo's own in-jit choice (`snoo_sync=None`), step by step."""
    vocab = td.open_dataset(corpus).vocab_size
    batches = np.random.default_rng(1).integers(0, vocab, (8, 2, 1, 8, 16)).astype(np.int32)
    batches[1, 0, 0, 2, 3] = 10 * vocab  # step 1 is skipped

    def final_state(hinted, **dtypes):
        config = tiny_in(corpus, tmp_path, snoo_k=3, **dtypes)
        spec = build_optimizer(config)
        mesh = make_mesh(config)
        put = lambda x: put_batch(x, batch_sharding(mesh))
        model, state = create_train_state(tc.model_config(config, vocab), spec.tx, seed=0,
                                          mesh=mesh)
        step = make_train_step(model, spec, mesh=mesh, state_shardings=tree_shardings(state, mesh))
        for s, (x, y) in enumerate(batches):
            state, metrics = step(state, put(x), put(y),
                                  **(spec.update_kwargs(s) if hinted else {}))
            assert float(metrics["skipped"]) == (s == 1)
        assert [int(c) for c in snoo_counts(state)] == [len(batches)]
        return jax.device_get(state)

    in_jit, hinted = final_state(False), final_state(True)
    # Two differently compiled f32 programs (a static branch and a `lax.cond`): every float
    # of the state as accurate as the in-jit run's against that program in float64 (a sync
    # at a wrong step moves params by ~lr, 1e-3); counts and keys equal.
    with in_float64():
        ref = float64(final_state(False, **FLOAT64_DTYPES))
    assert_as_accurate(hinted, in_jit, ref)


def test_run_skips_bad_steps_then_stops_keeping_the_last_good_checkpoint(
        corpus, tmp_path, monkeypatch):
    """Step 2 is poisoned (skipped, run goes on); steps >= 5 all are: stop after 2 in a row."""
    clean = td.TokenDataset.batch

    def poisoned(self, split, step, **kw):
        x, y = clean(self, split, step, **kw)
        if split == "train" and (step == 2 or step >= 5):
            x = x.copy()
            x[0, 0, 0] = 10 * self.vocab_size
        return x, y

    monkeypatch.setattr(td.TokenDataset, "batch", poisoned)
    config = tiny_in(corpus, tmp_path / "run", max_bad_steps=2)
    with pytest.raises(NonFiniteError, match=r"(?s)stopping at step 7: 2 consecutive.*"
                                             r"--max_bad_steps=2.*steps \[4\]"):
        train.run(config)
    lines = [json.loads(x)
             for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {h["step"]: h for h in lines if "loss" in h}
    assert [by_step[s]["skipped"] for s in range(1, 8)] == [0, 0, 1, 0, 0, 1, 1]
    assert [by_step[s]["skipped_steps"] for s in (3, 4, 6, 7)] == [1, 1, 2, 3]
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    assert ckpt.steps() == [4]  # nothing saved after the bad run; step 4 is whole
    meta = ckpt.restore_meta(4)
    assert meta["step"] == 4 and np.isfinite(meta["val_loss"])
    ckpt.close()


# ----------------------------------------------------------------------------- SIGKILL


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compilation cache for this module and its subprocesses (same programs)."""
    path = tmp_path_factory.mktemp("jax_cache")
    names = {"jax_compilation_cache_dir": str(path),
             "jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": 0}
    saved = {name: getattr(jax.config, name) for name in names}
    for name, value in names.items():
        jax.config.update(name, value)
    yield path
    for name, value in saved.items():
        jax.config.update(name, value)


def _launch(config: tc.TrainConfig, cache: Path, resume: bool = False) -> subprocess.Popen:
    """`python -m train` with `config` in a fresh process (the 8-device env of conftest)."""
    values = {**tc.flat_dict(config), "resume": resume}
    argv = [f"--{k}={v}" for k, v in values.items() if v is not None and k != "sample_start"]
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return subprocess.Popen([sys.executable, "-m", "train", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300.0) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled every 2 ms)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before the kill:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "timed out waiting to kill the run"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def _logged_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]


def test_sigkill_during_async_save_and_at_a_random_step_then_resume_exactly(
        corpus, tmp_path, cache_dir):
    """Killed while a checkpoint is being written, resumed, killed again at a random step,
    resumed again: the metrics log equals the uninterrupted run's, step for step."""
    config = tiny_in(corpus, tmp_path / "ref", max_iters=12, lr_decay_iters=12, eval_interval=2,
                  checkpoint_every=2)
    reference = train.run(config).history
    run = tc.override(config, out_dir=str(tmp_path / "run"))
    ckpts, log = tmp_path / "run" / "checkpoints", tmp_path / "run" / "metrics.jsonl"
    tmp_dirs = lambda: [p.name for p in ckpts.glob("*.orbax-checkpoint-tmp*")]

    # 1. SIGKILL while the step-4 (or later) checkpoint is still a temporary folder.
    proc = _launch(run, cache_dir)
    _kill_when(proc, lambda: any(int(name.split(".")[0]) >= 4 for name in tmp_dirs()))
    assert tmp_dirs(), "the kill did not land during a checkpoint write"
    # 2. Resume, then SIGKILL right after a random step is logged.
    at = int(np.random.default_rng().integers(6, 12))
    proc = _launch(run, cache_dir, resume=True)
    _kill_when(proc, lambda: at in _logged_steps(log))
    # 3. Resume to the end.
    proc = _launch(run, cache_dir, resume=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert not tmp_dirs()  # the killed write's temporary folder was cleaned up
    resumed = [json.loads(x) for x in log.read_text().splitlines()]
    keys = ("step", "loss", "grad_norm", "train_loss", "val_loss")
    strip = lambda history: [{k: h[k] for k in keys if k in h} for h in history]
    assert strip(resumed) == strip(reference), f"killed at step {at}"


# ----------------------------------------------------------------------------- damaged checkpoints


def _damage(step_dir: Path, how: str) -> None:
    if how == "truncated arrays":  # a partial copy or a bad disk: the array chunks are cut
        for chunk in step_dir.glob("state/ocdbt.process_0/d/*"):
            with chunk.open("r+b") as f:
                f.truncate(10)
    elif how == "missing meta":  # half-deleted by hand
        (step_dir / "meta" / "metadata").unlink()
    elif how == "empty folder":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.fixture(scope="module")
def eight_steps(corpus, tmp_path_factory, cache_dir):
    """A finished 8-step run with checkpoints at steps 4 and 8 (both kept)."""
    config = tiny_in(corpus, tmp_path_factory.mktemp("eight") / "run")
    result = train.run(config)
    assert Checkpointer(Path(config.run.out_dir) / "checkpoints").steps() == [4, 8]
    return config, result.history


@pytest.mark.parametrize("how", ["truncated arrays", "missing meta", "empty folder"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(eight_steps, tmp_path, how,
                                                                   monkeypatch):
    config, _ = eight_steps
    out = tmp_path / "run"
    shutil.copytree(config.run.out_dir, out)
    _damage(out / "checkpoints" / "8", how)
    ckpt = Checkpointer(out / "checkpoints")
    like = _state_like(config)
    leftovers = []  # "Exception ignored" reports of Orbax's abandoned reads: none get out
    monkeypatch.setattr(sys, "unraisablehook", leftovers.append)
    with pytest.warns(CheckpointWarning, match=rf"(?s)checkpoint step 8 \({out}/checkpoints/8\)"
                                               r".*moved to .*checkpoints_damaged/8-"):
        _, meta, step = ckpt.restore_latest(like)
    gc.collect()
    monkeypatch.undo()
    assert leftovers == []
    assert (step, meta["step"]) == (4, 4) and ckpt.steps() == [4]
    assert len(list((out / "checkpoints_damaged").iterdir())) == 1  # kept, not deleted
    ckpt.close()


def _state_like(config):
    vocab = td.open_dataset(config.data.path).vocab_size
    mesh = make_mesh(config)
    return create_train_state(tc.model_config(config, vocab), build_optimizer(config).tx,
                              seed=0, mesh=mesh)[1]


def test_resume_past_a_damaged_checkpoint_redoes_its_steps_exactly(eight_steps, tmp_path):
    config, history = eight_steps
    out = tmp_path / "run"
    shutil.copytree(config.run.out_dir, out)
    _damage(out / "checkpoints" / "8", "truncated arrays")
    with pytest.warns(CheckpointWarning, match="checkpoint step 8"):
        resumed = train.run(tc.override(config, out_dir=str(out), resume=True))
    assert train_losses(resumed.history) == {s: v for s, v in train_losses(history).items()
                                             if s > 4}
    assert Checkpointer(out / "checkpoints").steps() == [4, 8]  # step 8 rewritten


def test_every_checkpoint_damaged_is_a_clear_error(eight_steps, tmp_path):
    config, _ = eight_steps
    out = tmp_path / "run"
    shutil.copytree(config.run.out_dir, out)
    for step in (4, 8):
        _damage(out / "checkpoints" / str(step), "missing meta")
    with pytest.warns(CheckpointWarning), pytest.raises(
            FileNotFoundError, match=r"(?s)no checkpoint in .* could be restored:.*step 8.*"
                                     r"step 4"):
        train.run(tc.override(config, out_dir=str(out), resume=True))


def test_checkpoint_of_another_config_is_refused_and_kept(eight_steps, tmp_path):
    config, _ = eight_steps
    out = tmp_path / "run"
    shutil.copytree(config.run.out_dir, out)
    with pytest.raises(ValueError, match=r"n_layer: checkpoint has 1, this run has 2"):
        train.run(tc.override(config, out_dir=str(out), resume=True, n_layer=2))
    assert Checkpointer(out / "checkpoints").steps() == [4, 8]
    assert not (out / "checkpoints_damaged").exists()  # a mismatch is not damage


# ----------------------------------------------------------------------------- disk, permissions


def test_unwritable_out_dir_fails_before_any_work(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"--out_dir=.*a_file/run' is not writable.*nothing "
                                      r"was trained"):
        train.run(tiny_in(corpus, blocker / "run"))
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="is not writable"):
            train.run(tiny_in(corpus, locked / "run"))


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (`None` for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("before", ["absent", "a_file", "a_file_and_empty_checkpoints"])
@pytest.mark.parametrize("failure, overrides, error", [
    ("missing data", dict(data="/no/such/corpus.txt"), FileNotFoundError),
    ("mesh", dict(mesh_data=4, mesh_fsdp=4), ValueError),
    ("nothing to resume", dict(resume=True), FileNotFoundError),
    # 8 devices: the default batch of 12 rows does not split over them
    ("batch", dict(mesh_data=8, batch_size=12), ValueError),
    # the prompt of the samples at the end: refused before the first step
    ("prompt", dict(num_samples=1, sample_start="✓"), ValueError),
    ("prompt file", dict(num_samples=1, sample_start="FILE:/no/such/prompt.txt"),
     FileNotFoundError),
])
def test_a_failed_start_leaves_out_dir_as_it_was(corpus, tmp_path, before, failure, overrides,
                                                 error):
    out = tmp_path / "parent" / "run"
    if before != "absent":  # anything a user keeps there, even an empty checkpoints/
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("keep me")
    if before == "a_file_and_empty_checkpoints":
        (out / "checkpoints").mkdir()
    snapshot = _tree(tmp_path)
    with pytest.raises(error):
        train.run(tiny_in(corpus, out, **overrides))
    assert _tree(tmp_path) == snapshot, failure


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax
@pytest.mark.parametrize("disk", ["tmpfs", "hook"])
def test_full_disk_at_save_is_a_clear_error_and_loses_no_checkpoint(
        eight_steps, tmp_path, monkeypatch, disk):
    """A real 700 KiB tmpfs (one checkpoint fits; needs root) or an ENOSPC fault hook."""
    config, history = eight_steps
    out = tmp_path / "disk"
    if disk == "tmpfs":
        if not _tmpfs(out, "700k"):
            pytest.skip("cannot mount a tmpfs here (needs root)")
    else:
        save = ocp.CheckpointManager.save

        def full(self, step, *args, **kwargs):
            if step == 8:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return save(self, step, *args, **kwargs)

        monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    try:
        run = tc.override(config, out_dir=str(out / "run"))
        with pytest.raises(CheckpointSaveError, match=r"(?s)writing checkpoint step\(s\) \[8\]"
                                                      r".*No space left on device.*intact "
                                                      r"\(steps \[4\]\).*--resume"):
            train.run(run)
        monkeypatch.undo()
        if disk == "tmpfs":  # free space: the same mount, grown
            subprocess.run(["mount", "-o", "remount,size=4m", str(out)], check=True)
        resumed = train.run(tc.override(run, resume=True))
        assert train_losses(resumed.history) == {s: v for s, v in train_losses(history).items()
                                                 if s > 4}
        assert Checkpointer(out / "run" / "checkpoints").steps() == [4, 8]
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", str(out)], check=True)


# ----------------------------------------------------------------------------- interrupted


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_at_a_step_closes_everything_and_keeps_the_last_checkpoint(
        eight_steps, tmp_path, monkeypatch, error):
    """A `KeyboardInterrupt` (a notebook's stop button) or a prefetch error reading step
    6's batch: the run's threads end, its checkpointer is closed, step 4 stays whole and
    a resume trains steps 5-8 as the uninterrupted run did."""
    import threading

    config, history = eight_steps
    clean, opened = td.TokenDataset.batch, []
    init = Checkpointer.__init__

    def failing(self, split, step, **kw):
        if split == "train" and step == 6:
            raise error("stopped at step 6")
        return clean(self, split, step, **kw)

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(td.TokenDataset, "batch", failing)
    monkeypatch.setattr(Checkpointer, "__init__", recorded)
    threads = set(threading.enumerate())
    run = tc.override(config, out_dir=str(tmp_path / "run"), tensorboard=True)
    with pytest.raises(error, match="stopped at step 6"):
        train.run(run)
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert left == [], left  # no prefetch thread, no Orbax writer, no tracker's
    assert len(opened) == 1 and opened[0]._closed
    monkeypatch.undo()
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    assert ckpt.steps() == [4] and ckpt.restore_meta(4)["step"] == 4
    ckpt.close()
    resumed = train.run(tc.override(run, resume=True))
    assert train_losses(resumed.history) == {s: v for s, v in train_losses(history).items()
                                             if s > 4}
