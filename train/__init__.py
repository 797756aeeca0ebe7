"""The trainer: `python -m train`, or `train.run(config)` from Python.

Example:
  >>> import train
  >>> config = train.override(train.get_preset("shakespeare_char_cpu"), max_iters=50)
  >>> result = train.run(config)  # doctest: +SKIP
"""

import importlib.util as _importlib_util

# The trainer's dependencies beyond the library's (the `train` extra); checked before any
# import, so that a missing one is named with the command that installs it.
_TRAIN_EXTRA = ("flax", "orbax.checkpoint", "tqdm", "matplotlib")


def _missing_train_extra() -> list[str]:
    missing = []
    for name in _TRAIN_EXTRA:
        try:
            found = _importlib_util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package, or a blocked module
            found = False
        if not found:
            missing.append(name)
    return missing


if _missing := _missing_train_extra():
    raise ModuleNotFoundError(
        f"the trainer needs the 'train' extra; missing: {', '.join(_missing)}. "
        "Install it from the repository's checkout: pip install -e '.[train]'",
        name=_missing[0],
    )

from train.lapack import single_threaded_lapack  # noqa: E402

single_threaded_lapack()  # XLA:CPU's eigh/QR on one thread (train/lapack.py: why)

from train import kfac_trainer  # noqa: E402, F401  (registers the K-FAC and Newton-Muon hooks)
from train.config import PRESETS, TrainConfig, get_preset, override, parse_args  # noqa: E402
from train.loop import RunResult, run  # noqa: E402
from train.optimizers import OPTIMIZERS, TrainOptimizer, build_optimizer  # noqa: E402

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
    "run",
]
