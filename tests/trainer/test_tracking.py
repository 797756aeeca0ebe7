"""What a run reports besides `metrics.jsonl`: TensorBoard event files (read back here,
TFRecord framing and all), Weights & Biases (a stand-in `wandb` module records the calls),
the progress bar's text, the plot's title; and the one-line errors when a tracker is not
installed.

One tiny Snoo run (two step variants, so two compilations) serves most tests; nothing is
downloaded and wandb need not be installed.
"""

from __future__ import annotations

import functools
import io
import json
import re
import struct
import sys
import types

import numpy as np
import pytest
from tqdm import tqdm

import train
from train import config as tc
from train import loop
from train.__main__ import main
from train.metrics import (
    MetricsLog,
    WandbTracker,
    open_trackers,
    plot_losses,
    run_title,
    tracker_scalars,
)
from trainer.support import tiny_in

pytestmark = pytest.mark.usefixtures("compilation_cache")
event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")


def tiny(corpus, out, **overrides) -> tc.TrainConfig:
    """`support.tiny_in`'s run (test_faults'), 6 steps long."""
    return tiny_in(corpus, out, **{**dict(max_iters=6, lr_decay_iters=6, eval_interval=3,
                                              eval_iters=1, checkpoint_every=3), **overrides})


# ------------------------------------------------------------------ reading event files


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus 0xa282ead8 (mod 2**32)."""
    crc = _crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path) -> list:
    """The `Event` records of a TFRecord file: uint64 length, masked CRC of the length,
    the payload, masked CRC of the payload (little-endian), checked record by record."""
    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[i + 8:i + 12])
        payload = data[i + 12:i + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
        assert header_crc == _masked_crc(header) and payload_crc == _masked_crc(payload)
        events.append(event_pb2.Event.FromString(payload))
        i += 16 + length
    return events


def scalars_of(logdir) -> dict[tuple[str, int], float]:
    """`{(tag, step): value}` over every event file in `logdir`."""
    found = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in read_events(path):
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.simple_value
    return found


# --------------------------------------------------------------------- a stand-in wandb


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


def fake_wandb(calls: list) -> types.ModuleType:
    module = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    module.init = init
    return module


# ------------------------------------------------------------------------ the tiny run


@pytest.fixture(scope="module")
def tracked(corpus, tmp_path_factory):
    """A 6-step Snoo run with `--tensorboard` and `--wandb_project`, its progress bar
    drawn at every update into a buffer, the loss plot's figure kept."""
    out = tmp_path_factory.mktemp("tracked") / "tiny_run"
    config = tiny(corpus, out, tensorboard=True, wandb_project="optax-snoo-tests",
                  progress=True)
    calls, bar_text, figures = [], io.StringIO(), []

    def plot(*args, **kwargs):
        figures.append(plot_losses(*args, **kwargs))
        return figures[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", fake_wandb(calls))
        mp.setattr(loop, "tqdm", functools.partial(tqdm, file=bar_text, mininterval=0))
        mp.setattr(loop, "plot_losses", plot)
        result = train.run(config)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return dict(config=config, result=result, out=out, lines=lines, calls=calls,
                bar=bar_text.getvalue(), figures=figures)


def test_tensorboard_event_file_holds_every_logged_scalar(tracked):
    logged = {(tag, line["step"]): value for line in tracked["lines"]
              for tag, value in tracker_scalars(line).items()}
    assert {"train/loss", "train/lr", "eval/train_loss", "eval/val_loss"} <= {
        tag for tag, _ in logged}
    found = scalars_of(tracked["out"] / "tensorboard")
    assert set(found) == set(logged)
    # TensorBoard stores float32: the logged values rounded to float32, exactly
    assert {k: float(np.float32(v)) for k, v in logged.items()} == found
    losses = {step: v for (tag, step), v in found.items() if tag == "train/loss"}
    assert sorted(losses) == list(range(1, 7))


def test_wandb_gets_the_same_scalars_config_and_name(tracked):
    calls, config = tracked["calls"], tracked["config"]
    (kind, init), *rest = calls
    assert kind == "init"
    assert init["project"] == "optax-snoo-tests" and init["name"] == "tiny_run"
    assert init["dir"] == str(tracked["out"]) and init["resume"] is None
    # The command line's keys, with the attention implementation the run resolved to.
    assert init["config"] == {**tc.flat_dict(config), "attention": "handwritten"}
    assert init["config"]["n_layer"] == 1 and init["config"]["optimizer"] == "snoo_adamw"
    assert (tracked["out"] / "wandb_run_id").read_text().strip() == init["id"]
    assert rest[-1] == ("finish",) and ("finish",) not in rest[:-1]
    expected = [("log", tracker_scalars(line), line["step"]) for line in tracked["lines"]]
    assert rest[:-1] == expected


def test_progress_bar_of_a_run_shows_no_rate_or_eta_until_a_timed_step(tracked):
    frames = [f.strip() for f in tracked["bar"].split("\r") if f.strip()]
    assert frames, "the bar drew nothing"
    assert not [f for f in frames if re.search(r"-\d", f)], frames
    eta_or_rate = re.compile(r"<\d|\d(it/s|s/it)")
    # steps 0 (sync) and 1 (no sync) compile: a count of 3 is the first timed step
    counted = [(f, int(m.group(1))) for f in frames if (m := re.search(r"(\d+)/6\b", f))]
    early = [f for f, n in counted if n <= 2]
    assert early and not [f for f in early if eta_or_rate.search(f)], early
    assert any("compiling" in f for f in early)
    assert any(eta_or_rate.search(f) for f in frames if "6/6" in f), frames


def test_plot_title_names_the_run_the_optimizer_and_the_shape(tracked):
    (fig,) = tracked["figures"]
    assert fig.axes[0].get_title() == (
        "tiny_run\nsnoo_adamw, n_layer=1, n_embd=32, n_head=2, block_size=16")
    assert (tracked["out"] / "loss.png").stat().st_size > 0


# ---------------------------------------------------------------- without a training run


def test_run_title_names_a_mixture_of_experts_and_fits_the_figure(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    config = tc.override(tc.get_preset("moe_tiny"), optimizer="snoo_skew_adam")
    title = run_title(config)
    assert title == ("moe_tiny\nsnoo_skew_adam, n_layer=4, n_embd=128, n_head=4, "
                     "block_size=64\nmoe_every=2, n_experts=8, top_k=2")
    fig = plot_losses([{"step": 0, "val_loss": 1.0}], tmp_path / "loss.png", title=title)
    box = fig.axes[0].title.get_window_extent(FigureCanvasAgg(fig).get_renderer())
    assert 0 <= box.x0 < box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, box


def test_plot_has_the_title_it_is_given_or_none(tmp_path):
    history = [{"step": 0, "val_loss": 1.0}, {"step": 1, "loss": 0.9}]
    fig = plot_losses(history, tmp_path / "titled.png", title="run\nadamw, n_layer=1")
    assert fig.axes[0].get_title() == "run\nadamw, n_layer=1"
    assert plot_losses(history, tmp_path / "bare.png").axes[0].get_title() == ""
    assert (tmp_path / "titled.png").stat().st_size > 0


def test_resumed_tensorboard_purges_what_the_killed_run_logged_after_the_checkpoint(
        tmp_path):
    config = tc.override(tc.TrainConfig(), out_dir=str(tmp_path), tensorboard=True,
                         resume=True)
    (tracker,) = open_trackers(config, tmp_path, start=4)
    log = MetricsLog(tmp_path / "metrics.jsonl", trackers=[tracker])
    log.write(step=5, loss=2.0)
    log.close()
    events = [e for p in (tmp_path / "tensorboard").glob("events.*") for e in read_events(p)]
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [5]  # TensorBoard hides the earlier events from step 5 on
    assert scalars_of(tmp_path / "tensorboard") == {("train/loss", 5): 2.0}


def test_resumed_wandb_run_continues_the_same_run_id(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    first = WandbTracker("p", name="r", config={}, out_dir=tmp_path)
    again = WandbTracker("p", name="r", config={}, out_dir=tmp_path, resume=True)
    first.close()
    again.close()
    (_, a), (_, b) = [c for c in calls if c[0] == "init"]
    assert re.fullmatch(r"[0-9a-f]{8}", a["id"]) and b["id"] == a["id"]
    assert a["resume"] is None and b["resume"] == "allow"
    fresh = WandbTracker("p", name="r", config={}, out_dir=tmp_path)
    assert calls[-1][1]["id"] != a["id"]  # a new run (no --resume) gets a new id
    fresh.close()


def test_trackers_get_numbers_only_and_close_once(tmp_path):
    received = []

    class Recorder:
        def write(self, step, scalars):
            received.append((step, scalars))

        def close(self):
            received.append("closed")

    log = MetricsLog(tmp_path / "m.jsonl", trackers=[Recorder()])
    log.write(step=3, loss=2.5, note="text", flag=True, mfu=0.25)
    log.write(step=4, val_loss=2.25, train_loss=2.0)
    log.close()
    log.close()
    assert received == [(3, {"train/loss": 2.5, "train/mfu": 0.25}),
                        (4, {"eval/val_loss": 2.25, "eval/train_loss": 2.0}), "closed"]


@pytest.mark.parametrize(("flag", "module"), [("--tensorboard", "tensorboardX"),
                                              ("--wandb_project=p", "wandb")])
def test_missing_tracker_is_one_line_before_any_work(flag, module, monkeypatch, capsys,
                                                     corpus, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails
    out = tmp_path / "run"
    name = flag.split("=")[0]
    with pytest.raises(ModuleNotFoundError, match=(
            rf"^{name} needs the {module} package, which is not installed: pip install "
            rf"{module} \(or, in the repository's checkout, pip install -e '\.\[tracking\]'\)$")):
        key, _, value = flag[2:].partition("=")
        train.run(tiny(corpus, out, **{key: value or True}))
    assert not out.exists()  # before the out_dir is made, so before any compilation
    argv = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--max_iters=1",
            f"--data={corpus}", f"--out_dir={out}", flag]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {name} needs the {module}"), err
    assert not out.exists()


def test_empty_wandb_project_is_refused():
    with pytest.raises(ValueError, match=r"^wandb_project='': expected a project name"):
        tc.parse_args(["--wandb_project="])


def test_tracking_flags_are_in_the_help(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"--tensorboard +bool +default false +write TensorBoard", text), text
    assert re.search(r"--wandb_project +str \| None +default None +log to this Weights", text)
