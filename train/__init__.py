"""The trainer: `python -m train`, or `train.run(config)` from Python.

Example:
  >>> import dataclasses, train
  >>> config = dataclasses.replace(train.get_preset("shakespeare_char_cpu"), max_iters=50)
  >>> result = train.run(config)  # doctest: +SKIP
"""

from train.config import PRESETS, TrainConfig, get_preset, parse_args
from train.loop import RunResult, run
from train.optimizers import OPTIMIZERS, build_optimizer, register

__all__ = [
    "OPTIMIZERS",
    "PRESETS",
    "RunResult",
    "TrainConfig",
    "build_optimizer",
    "get_preset",
    "parse_args",
    "register",
    "run",
]
