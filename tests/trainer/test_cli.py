"""`python -m train` as a user meets it: the start-up line, the output, one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
from tqdm import tqdm

from repository import ROOT
from train import data as td
from train.errors import one_line, user_message
from train.metrics import COMPILING_BAR, restart_clock, show_compiling

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=8",
        "--dtype=float32", "--optimizer=adamw", "--max_iters=6", "--eval_interval=3",
        "--eval_iters=1", "--log_interval=2", "--checkpoint_every=3", "--mesh_data=1",
        "--num_samples=0", "--progress=false"]


def cli(*argv: str, module: str = "train") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *argv], env=env, capture_output=True,
                          text=True, timeout=600)


def in_process(*argv: str) -> subprocess.CompletedProcess:
    """`python -m train argv` as `train.__main__.main(argv)` in this process: the same
    parsing and the same `error:` handler (`run_cli`) without a new interpreter's
    imports; each test's first case still runs `cli`, the real entry point."""
    from train.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    proc = cli(*TINY, f"--data={corpus}", f"--out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_start_up_line_and_no_mfu_where_no_peak_is_known(finished):
    out, proc = finished
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("train: ") and sum(x.startswith("train: ") for x in lines) == 1
    for part in ("M parameters (n_layer=1, n_embd=32, block_size=16), attention handwritten,",
                 "optimizer adamw",
                 "1 cpu device(s)", "mesh data=1 fsdp=1 tensor=1", f"out_dir {out}"):
        assert part in lines[0], part
    assert lines[-1].startswith("done: step 6, val loss ") and "tokens/s" in lines[-1]
    assert "MFU" not in proc.stdout + proc.stderr  # CPUs have no peak FLOP/s
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in rows if "loss" in h] == [2, 4, 6]
    assert all("mfu" not in h for h in rows)


ERROR_CASES = ["rerun", "other_config", "mesh", "data", "memory", "cudnn", "qk_clip_attention"]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_line_and_a_non_zero_exit(finished, corpus, tmp_path, case):
    out, _ = finished
    argv, named = {
        "rerun": ([f"--out_dir={out}"], f"--out_dir='{out}' already holds a run"),
        "other_config": ([f"--out_dir={out}", "--resume", "--n_embd=64"],
                         "n_embd: checkpoint has 32, this run has 64"),
        "mesh": ([f"--out_dir={tmp_path}/m", "--mesh_data=4", "--mesh_fsdp=4"],
                 "--mesh_data=4 --mesh_fsdp=4 --mesh_tensor=1: the mesh needs 16 devices"),
        "data": ([f"--out_dir={tmp_path}/d", f"--data={tmp_path}/missing.txt"],
                 f"--data='{tmp_path}/missing.txt': no such file"),
        "memory": ([f"--out_dir={tmp_path}/b", "--block_size=1000000"],
                   "--block_size=1000000 with --batch_size=8: a train step needs at least"),
        "cudnn": ([f"--out_dir={tmp_path}/c", "--attention=cudnn"],
                  "attention='cudnn' is not available: cuDNN flash attention runs on NVIDIA "
                  "GPUs, and the devices here are cpu"),
        "qk_clip_attention": ([f"--out_dir={tmp_path}/q", "--attention=xla", "--qk_clip_tau=100"],
                              "attention='xla' cannot return the max logits QK-clip reads"),
    }[case]
    data = [] if case == "data" else [f"--data={corpus}"]
    proc = (cli if case == ERROR_CASES[0] else in_process)(*TINY, *data, *argv)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and named in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags, named", [
    (["--optimizer=adamw", "--learning_rate=-1e-3"],
     "recipe adamw: learning_rate=-0.001: expected a finite number > 0"),
    (["--muon_learning_rate=-0.02"],
     "recipe snoo_muon: muon_learning_rate=-0.02: expected a finite number > 0"),
    # the names of earlier versions: one line naming the new one
    (["--muon_lr=0.02"], "--muon_lr was renamed --muon_learning_rate"),
    (["--muon_beta=0.9"], "--muon_beta was renamed --muon_momentum"),
    (["--optimizer=skewadam"], "--optimizer=skewadam was renamed --optimizer=skew_adam"),
])
def test_a_value_out_of_range_is_one_line_before_any_work(tmp_path, flags, named):
    run = cli if flags[0].startswith("--optimizer=adamw") else in_process
    proc = run(*flags, f"--out_dir={tmp_path}/run")
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {named}\n", "")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--learning_rate=0.1", "--snoo_k=4"])
def test_a_flag_the_recipe_does_not_read_is_refused_listing_its_own(tmp_path, flag):
    """#44's SOAP-Muon has no single learning rate and no Snoo: each flag is refused in one
    line that names it and lists the recipe's hyperparameters (once both were accepted
    and ignored)."""
    from optax_snoo import recipes

    run = cli if flag == "--learning_rate=0.1" else in_process
    proc = run("--optimizer=track3_soap_muon", flag, f"--out_dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    key = flag.split("=")[0]
    assert line.startswith(f"error: {key} is not read by --optimizer=track3_soap_muon"), line
    listed = line.split("its hyperparameters are ")[1].split(" (python -m train")[0]
    assert listed.split(", ") == list(recipes.track3_soap_muon.hyperparameters.names())
    assert "muon_learning_rate" in listed and not (tmp_path / "run").exists()


def _soap_muon_run(corpus, out, *flags):
    """A 9-step #44 SOAP-Muon run from the command line; its losses and config.json."""
    from train.__main__ import main

    argv = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4",
            "--dtype=float32", "--tie_embeddings=false", "--optimizer=track3_soap_muon",
            "--max_iters=9", "--eval_interval=9", "--eval_iters=1", "--log_interval=1",
            "--checkpoint_every=9", "--mesh_data=1", "--num_samples=0", "--progress=false",
            f"--data={corpus}", f"--out_dir={out}", *flags]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [h["loss"] for h in rows if "loss" in h], json.loads((out / "config.json").read_text())


def test_a_recipes_hyperparameter_from_the_command_line_is_the_one_trained(corpus, tmp_path):
    """--muon_learning_rate=0.3 on #44's SOAP-Muon (default 0.0375) trains another run
    and is what config.json records (it once trained at 0.0375 and recorded 0.3)."""
    default, default_config = _soap_muon_run(corpus, tmp_path / "default")
    faster, config = _soap_muon_run(corpus, tmp_path / "fast", "--muon_learning_rate=0.3")
    assert len(default) == len(faster) == 9
    assert default[0] == faster[0] and default[1:] != faster[1:]  # the same first batch
    assert config["recipe"]["muon_learning_rate"] == 0.3
    assert config["optimizer"]["hyperparameters"] == {"muon_learning_rate": 0.3}
    assert default_config["recipe"]["muon_learning_rate"] == 0.0375
    assert config["recipe"] == {**default_config["recipe"], "muon_learning_rate": 0.3}


def test_a_run_shorter_than_its_recipe_is_refused_before_anything(tmp_path, capsys,
                                                                   monkeypatch):
    """track3_record's step constants need 9 steps; 0 steps are refused for every recipe.
    Nothing is built (no mesh, no data, no state: nothing compiled) and nothing written."""
    from optax_snoo import recipes
    from train import loop
    from train.__main__ import main

    def built(*args, **kwargs):
        raise AssertionError("the run was set up")

    for name in ("make_mesh", "open_dataset", "create_train_state", "Checkpointer"):
        monkeypatch.setattr(loop, name, built)
    out = tmp_path / "run"
    assert main(["--optimizer=track3_record", "--max_iters=3", f"--out_dir={out}"]) == 2
    assert capsys.readouterr().err == (
        "error: --max_iters=3: --optimizer=track3_record needs at least 9 steps (its step "
        "constants are fractions of the record's 2900)\n")
    for name in recipes.REGISTRY:
        assert main([f"--optimizer={name}", "--max_iters=0", f"--out_dir={out}"]) == 2, name
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: --max_iters=0: --optimizer={name} needs at least "), line
    assert not out.exists()
    # a finished run's folder resumed with --max_iters=0: left as it was
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["--max_iters=0", "--resume", f"--out_dir={out}"]) == 2
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "{}"


def test_help_lists_the_recipes_hyperparameters_with_their_defaults(capsys):
    """--optimizer=track3_record --help: each of #46's hyperparameters with its default
    (a few typed from the record), and a given value in place of its default."""
    from optax_snoo import recipes
    from train.__main__ import main

    def shown(argv):
        assert main(argv) == 0
        text = capsys.readouterr().out
        section = text.split("track3_record's hyperparameters")[1].split("\n\n")[0]
        rows = [re.match(r"  --(\w+) +(.+?) +default (\S+) ", line)
                for line in section.splitlines()[1:]]
        return {f"--{m[1]}": [m[2], "default", m[3]] for m in rows}

    flags = shown(["--optimizer=track3_record", "--help"])
    recipe = recipes.track3_record
    assert list(flags) == [f"--{n}" for n in recipe.hyperparameters.names()]
    for name, tp, default, _ in recipe.hyperparameters.describe():
        assert flags[f"--{name}"] == [tp, "default", json.dumps(default)], name
    # #46's own values (its log): Muon lr 0.0375, tail EMA from 2400 blended 0.6
    assert flags["--muon_learning_rate"][2] == "0.0375"
    assert flags["--tail_start"][2] == "2400" and flags["--tail_blend"][2] == "0.6"
    given = shown(["--optimizer=track3_record", "--muon_learning_rate=0.05", "--help"])
    assert given["--muon_learning_rate"][2] == "0.05"


@pytest.mark.parametrize("module, usage, later", [
    ("train", ["--n_layer=three"], ["--data=/no/such/corpus.txt"]),
    ("train.sample", ["--step=latest"], []),
    ("train.evaluate", ["--split=test"], []),
])
def test_every_entry_point_exits_2_on_a_mistake(module, usage, later, tmp_path, capsys):
    """On the command line (argparse's status) and found after it (`train.errors.run_cli`)."""
    import importlib

    main = importlib.import_module("train.__main__" if module == "train" else module).main
    out = [f"--out_dir={tmp_path / 'run'}"]
    try:
        status = main([*out, *usage])
    except SystemExit as exit_:  # argparse exits by itself
        status = exit_.code
    assert status == 2 and "error: " in capsys.readouterr().err
    assert main([*out, *later]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "run").exists()


def test_help_lists_the_multi_process_flags(capsys):
    from train.__main__ import main

    assert main(["--help"]) == 0
    flags = {line.split()[0]: line.split()[1:3]
             for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert flags["--coordinator=HOST:PORT"] == ["or", "$JAX_COORDINATOR_ADDRESS"]
    assert flags["--num_processes=N"] == ["or", "$JAX_NUM_PROCESSES"]
    assert flags["--process_id=I"] == ["or", "$JAX_PROCESS_ID"]


def test_corpus_ships_with_the_code_and_is_found_from_any_directory(tmp_path, monkeypatch):
    import hashlib

    shipped = ROOT / "data" / "tinyshakespeare" / "input.txt"
    assert shipped == td.SHIPPED_CORPUS and (shipped.parent / "SOURCE").is_file()
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == td.TINYSHAKESPEARE_SHA256

    def offline(url, timeout):
        raise OSError("no network")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPTAX_SNOO_CACHE", str(tmp_path / "cache"))
    assert td.find_corpus(opener=offline) == shipped
    assert td.corpus_search_paths() == [shipped, tmp_path / "cache" / "tinyshakespeare" /
                                        "input.txt"]


def test_corpus_not_found_lists_each_path_once(tmp_path):
    def offline(url, timeout):
        raise OSError("no network")

    search = [tmp_path / "a" / "input.txt", tmp_path / "cache" / "input.txt"]
    with pytest.raises(FileNotFoundError) as err:
        td.find_corpus(search=search, cache_dir=tmp_path / "cache", opener=offline)
    message = str(err.value)
    assert [message.count(str(p)) for p in search] == [1, 1], message


def test_restart_clock_counts_the_rate_from_after_compilation():
    now = [0.0]
    bar = tqdm(total=100, initial=10, desc="compiling", file=io.StringIO(), mininterval=0)
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    now[0] = 30.0  # a 30 s compilation, then one step
    bar.update()
    restart_clock(bar)
    assert bar.n == 11 and bar.desc == ""
    now[0] = 31.0
    bar.update(10)  # 10 steps in 1 s: 10 it/s, so 79 steps to go is about 8 s
    d = bar.format_dict
    assert d["elapsed"] == pytest.approx(1.0)
    assert (d["n"] - d["initial"]) / d["elapsed"] == pytest.approx(10.0)
    bar.close()


ETA_OR_RATE = re.compile(r"<\d|\d(it/s|s/it)")


def test_progress_bar_shows_no_rate_or_eta_while_compiling_and_never_a_negative_one():
    """The loop's calls for Snoo (two step variants, compiled at steps 0 and 1): 25 s
    compilations, then 0.5 s steps, on a clock that moves a little at every reading."""
    now = [0.0]

    def clock():
        now[0] += 1e-4
        return now[0]

    out = io.StringIO()
    bar = tqdm(total=60, desc="compiling", bar_format=COMPILING_BAR, file=out, mininterval=0)
    bar._time = clock
    bar.start_t = bar.last_print_t = clock()
    compiled, drawn = set(), {}
    for step in range(6):
        variant = step % 3 == 0
        if variant not in compiled:
            show_compiling(bar)
        now[0] += 25.0 if variant not in compiled else 0.5
        bar.update()
        if variant not in compiled:
            compiled.add(variant)
            restart_clock(bar)
        drawn[step] = len(out.getvalue())
    bar.close()
    frames = lambda text: [f.strip() for f in text.split("\r") if f.strip()]
    assert not [f for f in frames(out.getvalue()) if re.search(r"-\d", f)], out.getvalue()
    untimed = frames(out.getvalue()[:drawn[1]])  # to the end of the second compilation
    assert [f for f in untimed if ETA_OR_RATE.search(f)] == [], untimed
    assert "compiling" in untimed[0] and "2/60" in untimed[-1], untimed
    # from step 2 on the steps are timed: 0.5 s each, so 54 steps to go is 27 s
    last = frames(out.getvalue())[-1]
    assert last.endswith("6/60 [00:02<00:27,  2.00it/s]"), last


def test_user_message_is_for_the_projects_own_errors():
    assert one_line("cannot resume:\n  a: 1\n  b: 2\nRun again.") == (
        "cannot resume: a: 1; b: 2; Run again.")
    assert user_message(ValueError("raised outside the project")) is None
    with pytest.raises(ValueError) as err:
        td.check_split("test")
    assert user_message(err.value) == "split='test': expected 'train' or 'val'"

    class JaxRuntimeError(RuntimeError):  # the name XLA's errors carry
        pass

    oom = JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.0T bytes.")
    assert user_message(oom, "lower --block_size=4096") == (
        "out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating 1.0T bytes.); "
        "lower --block_size=4096")
    assert user_message(RuntimeError("RESOURCE_EXHAUSTED")) is None  # not XLA's


class FakeDevice:
    """An accelerator as `check_memory` sees it: platform, kind, process, memory limit."""

    platform, device_kind, process_index = "gpu", "Fake GPU", 0

    def __init__(self, gib: float):
        self.limit = int(gib * 2**30)

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_check_memory_refuses_what_cannot_fit_and_passes_the_presets():
    from train import config as tc
    from train.metrics import check_memory
    from train.optimizers import build_optimizer

    for name, gib in (("shakespeare_char", 16), ("gpt2_small", 80)):
        config = tc.get_preset(name)
        tx = build_optimizer(config).tx
        check_memory(config, tc.model_config(config, 65), tx, [FakeDevice(gib)])
    config = tc.override(tc.get_preset("gpt2_small"), block_size=16384)
    tx = build_optimizer(config).tx
    gpt = tc.model_config(config, 65)
    with pytest.raises(ValueError, match=r"--block_size=16384 with --batch_size=32: a train step "
                                         r"needs at least .* more than the 80.0 GiB on 1 Fake"):
        check_memory(config, gpt, tx, [FakeDevice(80)])
    check_memory(config, gpt, tx, [FakeDevice(80)] * 8)  # eight of them: enough


def test_float64_without_x64_is_refused_in_one_line(tmp_path, capsys):
    """jax would silently compute a float64 model in float32: the flag is refused, naming
    the switch, before anything is written."""
    from train.__main__ import main

    out = tmp_path / "run"
    assert main(["--param_dtype=float64", f"--out_dir={out}"]) == 2
    assert capsys.readouterr().err == (
        "error: GPTConfig.param_dtype='float64' needs jax's 64-bit mode: call "
        'jax.config.update("jax_enable_x64", True) first (or set JAX_ENABLE_X64=1).\n')
    assert not out.exists()
