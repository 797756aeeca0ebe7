"""The loop's pure decisions: what each step does (`step_actions`), the warning of a
resume that moves the schedule's end (`schedule_change`); the batch-size and mesh checks
that run with the other config errors."""

from __future__ import annotations

import math

import pytest

from train import config as tc
from train.loop import StepActions, eval_due, schedule_change, step_actions
from train.sharding import check_batch_size, make_mesh, mesh_shape


def _run(**overrides) -> tc.RunConfig:
    return tc.override(tc.TrainConfig(), **overrides).run


def _plan(run: tc.RunConfig, start: int, **kw) -> dict[str, list[int]]:
    acts = {s: step_actions(s, start=start, run=run, **kw) for s in range(start, run.max_iters + 1)}
    return {name: [s for s, a in acts.items() if getattr(a, name)]
            for name in ("evaluate", "save", "log", "last")}


def test_step_actions_of_a_fresh_run():
    run = _run(max_iters=10, eval_interval=4, checkpoint_every=6, log_interval=3)
    # written out by hand: evaluations every 4 steps, at each save and at the end; saves
    # every 6 steps and at the end; logs after the updates of steps 3, 6, 9 and 10
    assert _plan(run, 0) == {"evaluate": [0, 4, 6, 8, 10], "save": [6, 10],
                             "log": [2, 5, 8, 9], "last": [10]}


def test_step_actions_of_a_resumed_run_skip_the_step_it_starts_from():
    run = _run(max_iters=12, eval_interval=4, checkpoint_every=6, log_interval=5, resume=True)
    assert _plan(run, 8) == {"evaluate": [12], "save": [12], "log": [9, 11], "last": [12]}
    assert _plan(run, 12) == {"evaluate": [], "save": [], "log": [], "last": [12]}


def test_step_actions_at_max_iters_zero():
    assert step_actions(0, start=0, run=_run(max_iters=0)) == StepActions(
        evaluate=True, save=True, log=False, last=True)
    assert step_actions(0, start=0, run=_run(max_iters=0, resume=True)) == StepActions(
        evaluate=False, save=False, log=False, last=True)


def test_a_cadence_plugs_into_step_actions():
    run = _run(max_iters=10, eval_interval=4, checkpoint_every=100, log_interval=100)
    every_third = lambda step, run: step % 3 == 0
    assert _plan(run, 0, cadence=every_third)["evaluate"] == [0, 3, 6, 9, 10]
    # the default cadence (modded-nanogpt's): every eval_interval steps and at the end
    assert [s for s in range(11) if eval_due(s, run)] == [0, 4, 8, 10]


def _nanogpt_lr(it: int, *, peak: float, min_lr: float, warmup: int, decay: int) -> float:
    """nanoGPT's train.py `get_lr`, written out (float64)."""
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - min_lr)


def test_schedule_change_warns_with_the_lr_jump_when_the_end_moves():
    base = dict(optimizer="adamw", learning_rate=1e-2, final_lr_scale=0.01, warmup_iters=100)
    saved = tc.override(tc.TrainConfig(), max_iters=2000, **base)
    longer = tc.override(saved, max_iters=4000)
    line = schedule_change(saved, longer, 2000)
    old = _nanogpt_lr(2000, peak=1e-2, min_lr=1e-4, warmup=100, decay=2000)
    new = _nanogpt_lr(2000, peak=1e-2, min_lr=1e-4, warmup=100, decay=4000)
    assert line == (
        "warning: resuming at step 2000 with --max_iters=4000 (the checkpoint's run had "
        "2000): --optimizer=adamw's schedules now end at step 4000, not 2000, so the logged "
        f"lr at step 2000 goes from {old:.4g} to {new:.4g}; to keep the first run's end pass "
        "--lr_decay_iters=2000")
    assert "\n" not in line
    # the end kept (a fixed lr_decay_iters, or the same max_iters): no warning
    assert schedule_change(tc.override(saved, lr_decay_iters=2000),
                           tc.override(longer, lr_decay_iters=2000), 2000) is None
    assert schedule_change(saved, saved, 1000) is None
    cooldown = dict(schedule="stable_cooldown")
    line = schedule_change(tc.override(saved, **cooldown), tc.override(longer, **cooldown), 1500)
    assert "--optimizer=adamw's schedules now end at step 4000, not 2000" in line
    assert "--lr_decay_iters" not in line
    # a record's recipe: its step constants move with the run (#36: flat for 30%, to 0)
    track3 = tc.override(tc.TrainConfig(), optimizer="track3_baseline", max_iters=1000)
    line = schedule_change(track3, tc.override(track3, max_iters=2000), 900)
    lr_old, lr_new = 0.025 * (1 - 0.9) / 0.7, 0.025 * (1 - 0.45) / 0.7
    assert line.endswith(f"now end at step 2000, not 1000, so the logged lr at step 900 goes "
                         f"from {lr_old:.4g} to {lr_new:.4g}"), line


@pytest.mark.parametrize("data, fsdp, batch, fits", [
    (8, 1, 12, "--batch_size=8 or --batch_size=16"),
    (4, 2, 4, "--batch_size=8"),  # nothing below: only the multiple above
    (2, 2, 6, "--batch_size=4 or --batch_size=8"),
])
def test_a_batch_that_does_not_divide_over_the_devices_names_sizes_that_do(data, fsdp, batch,
                                                                           fits):
    mesh = make_mesh(tc.override(tc.TrainConfig(), mesh_data=data, mesh_fsdp=fsdp))
    with pytest.raises(ValueError) as err:
        check_batch_size(batch, mesh)
    ways = data * fsdp
    assert str(err.value).startswith(f"--batch_size={batch} does not divide over the {ways} "
                                     f"data-parallel devices (mesh data*fsdp={ways}")
    assert f"expected a multiple of {ways}, e.g. {fits}," in str(err.value)
    check_batch_size(2 * ways, mesh)  # a multiple passes


def test_mesh_errors_count_their_devices_in_words():
    one = tc.override(tc.TrainConfig(), mesh_data=-1, mesh_fsdp=3)
    with pytest.raises(ValueError, match=r"^--mesh_data=-1 --mesh_fsdp=3 --mesh_tensor=1: the "
                                         r"fixed axes' product 3 does not divide the 1 device, "):
        mesh_shape(one, 1)
    with pytest.raises(ValueError, match=r"does not divide the 8 devices, "):
        mesh_shape(one, 8)
    with pytest.raises(ValueError, match=r"the mesh needs 1 device; 0 available"):
        mesh_shape(tc.override(tc.TrainConfig(), mesh_data=1), 0)
