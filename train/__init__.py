"""The trainer: `python -m train`, or `train.run(config)` from Python.

Example:
  >>> import train
  >>> config = train.override(train.get_preset("shakespeare_char_cpu"), max_iters=50)
  >>> result = train.run(config)  # doctest: +SKIP
"""

from train import kfac_trainer  # noqa: F401  (registers "kfac" and "snoo_kfac")
from train.config import PRESETS, TrainConfig, get_preset, override, parse_args
from train.loop import RunResult, run
from train.optimizers import OPTIMIZERS, TrainOptimizer, build_optimizer, register

__all__ = [
    "OPTIMIZERS",
    "PRESETS",
    "RunResult",
    "TrainConfig",
    "TrainOptimizer",
    "build_optimizer",
    "get_preset",
    "override",
    "parse_args",
    "register",
    "run",
]
