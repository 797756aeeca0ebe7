"""Command line: `python -m train [--preset=NAME] [--optimizer=NAME] [--key=value ...]`.

`--help` lists every key with its type and default (of the chosen preset). The resolved
config is written to `out_dir/config.json`; see `train.loop` for the other outputs.
A mistake (a bad key or value, a missing `--data` file, an existing run without
`--resume`, a checkpoint of another config, a mesh the devices cannot form, a step that
cannot fit in memory) ends with one `error: ...` line on stderr and exit status 2, as in
`train.sample` and `train.evaluate` (`train.errors.MISTAKE_EXIT_STATUS`); 1 is a crash.

Several processes (one per host) form one run through `jax.distributed.initialize`: pass
`--coordinator=HOST:PORT --num_processes=N --process_id=I` (or set
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); under Slurm or Open
MPI, JAX finds them itself. On CPUs the collectives go through gloo.

Example:
  $ python -m train --optimizer=adamw --out_dir=out/adamw
  $ python -m train --preset=moe_tiny --max_iters=500 --optimizer snoo_muon
  $ python -m train --coordinator=10.0.0.1:1234 --num_processes=2 --process_id=0  # host 0
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

import jax

from train.config import TrainConfig, config_help, parse_args
from train.errors import MISTAKE_EXIT_STATUS, run_cli
from train.loop import run
from train.optimizers import OPTIMIZERS


class DistributedFlag(NamedTuple):
    """A multi-process flag: the environment variable that also sets it, the shape of its
    value (for `--help`) and its help."""

    env: str
    metavar: str
    help: str


#: The multi-process flags: how to start, not what to train (so not in `TrainConfig`).
DISTRIBUTED: dict[str, DistributedFlag] = {
    "coordinator": DistributedFlag("JAX_COORDINATOR_ADDRESS", "HOST:PORT",
                                   "process 0's address, which every process connects to"),
    "num_processes": DistributedFlag("JAX_NUM_PROCESSES", "N",
                                     "processes in the run, one per host"),
    "process_id": DistributedFlag("JAX_PROCESS_ID", "I", "this process's index, 0 <= I < N"),
}
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def split_distributed(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take `--coordinator/--num_processes/--process_id` out of `argv` (env vars fill in).

    Returns:
      `(settings, rest)`: the given settings by flag name, and the other arguments.
    """
    settings = {name: os.environ[flag.env] for name, flag in DISTRIBUTED.items()
                if flag.env in os.environ}
    rest, args = [], list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if arg.startswith("--") and key in DISTRIBUTED:
            if not eq:
                if not args or args[0].startswith("--"):
                    raise ValueError(f"--{key} needs a value (--{key}=VALUE)")
                value = args.pop(0)
            settings[key] = value
        else:
            rest.append(arg)
    return settings, rest


def distributed_help() -> str:
    """The `--help` section of the multi-process flags (`DISTRIBUTED`)."""
    lines = ["multi-process: all three flags or none (under Slurm or Open MPI, JAX finds "
             "them); on CPUs the collectives go through gloo"]
    for name, flag in DISTRIBUTED.items():
        usage = f"--{name}={flag.metavar}"
        lines.append(f"  {usage:<24} or ${flag.env:<24} {flag.help}")
    return "\n".join(lines)


def init_distributed(settings: dict[str, str]) -> None:
    """`jax.distributed.initialize` from `settings` (or a Slurm/MPI launch); else nothing.

    Raises:
      ValueError: for a partial or ill-typed set of settings.
    """
    cluster = any(int(os.environ.get(name, "1")) > 1 for name in _CLUSTER_ENV)
    if not settings and not cluster:
        return
    if settings:
        missing = [f"--{name}" for name in DISTRIBUTED if name not in settings]
        if missing:
            raise ValueError(f"multi-process run: {', '.join(missing)} missing (given: "
                             f"{settings}); pass all three or none")
        try:
            num, pid = int(settings["num_processes"]), int(settings["process_id"])
        except ValueError:
            raise ValueError(f"--num_processes={settings['num_processes']!r} and --process_id="
                             f"{settings['process_id']!r}: expected integers") from None
        if not 0 <= pid < num:
            raise ValueError(f"--process_id={pid}: expected 0 <= id < --num_processes={num}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backends only
    if settings:
        jax.distributed.initialize(settings["coordinator"], num, pid)
    else:
        jax.distributed.initialize()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, train, print the final metrics; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        try:
            shown = parse_args(split_distributed([a for a in argv if a not in ("-h", "--help")])[1])
        except ValueError:
            shown = TrainConfig()
        print(config_help(shown, optimizers=list(OPTIMIZERS)), distributed_help(), sep="\n\n")
        return 0
    try:
        settings, argv = split_distributed(argv)
        config = parse_args(argv)
        init_distributed(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return MISTAKE_EXIT_STATUS
    hint = lambda: (f"lower --block_size={config.model.block_size} or --batch_size="
                    f"{config.data.batch_size} (--grad_accum keeps the tokens per step)")
    return run_cli(lambda: _train(config), hint)


def _train(config: TrainConfig) -> int:
    result = run(config)
    if jax.process_index() == 0:
        print(done_line(result.final, result.out_dir))
    return 0


def done_line(final: dict, out_dir: object) -> str:
    """The closing line: losses, throughput (and MFU where the devices' peak is known)."""
    parts = [f"done: step {final['step']}"]
    if isinstance(final.get("val_loss"), float):
        parts.append(f"val loss {final['val_loss']:.4f} (best {final['best_val_loss']:.4f})")
    if isinstance(final.get("tokens_per_sec"), float):
        parts.append(f"{final['tokens_per_sec']:,.0f} tokens/s")
    if isinstance(final.get("mfu"), float):
        parts.append(f"MFU {final['mfu']:.1%}")
    return ", ".join(parts) + f", {final['wall_s']:.0f} s; outputs in {out_dir}"


if __name__ == "__main__":
    sys.exit(main())
