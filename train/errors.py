"""How the command lines (`python -m train`, `train.sample`, `train.evaluate`) end on a
user's mistake: one line on stderr naming the value, no traceback, exit status 2.

Exit status 2 (`MISTAKE_EXIT_STATUS`) is argparse's for a bad command line, and every
entry point uses it for every mistake, on the command line or found later (a missing
file, a checkpoint of another config): 0 is success, 2 a mistake reported in one line,
and 1 (Python's own) a crash with a traceback, that is a bug.

A mistake is an error the trainer raises on purpose with a message for the user: a
`ValueError` or `OSError` raised in this project's own code (a bad mesh, a missing
`--data` file, an existing run without `--resume`, a checkpoint of another config, a
step that cannot fit in memory), a `ModuleNotFoundError` raised there (a tracker that is
not installed), a `NonFiniteError` or `CheckpointSaveError`, or the device running out of
memory (XLA's `RESOURCE_EXHAUSTED`). Anything else (a bug) keeps its traceback.

Example:
  >>> line = user_message(ValueError("bad\\n  a\\n  b"))  # not raised by the project
  >>> line is None
  True
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

__all__ = ["MISTAKE_EXIT_STATUS", "one_line", "run_cli", "user_message"]

#: The exit status of a user's mistake (argparse's for a bad command line).
MISTAKE_EXIT_STATUS = 2

_OWN = tuple(str(Path(__file__).resolve().parents[1] / pkg) for pkg in
             ("train", "models", "optax_snoo"))


def one_line(message: str) -> str:
    """`message` on one line: its lines stripped and joined (`: ` ends need no `;`)."""
    out = ""
    for line in (x.strip() for x in message.splitlines()):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def _raised_here(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(_OWN)


def user_message(err: BaseException, hint: str = "") -> str | None:
    """The one-line message for a user's mistake `err`, or `None` when it is not one.

    Args:
      err: the exception.
      hint: what to lower when the device ran out of memory (e.g. the flags' values).
    """
    from train.checkpoint import CheckpointSaveError
    from train.nonfinite import NonFiniteError

    if isinstance(err, NonFiniteError | CheckpointSaveError) or (
            isinstance(err, ValueError | OSError | ModuleNotFoundError) and _raised_here(err)):
        return one_line(str(err))
    if type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and (
            "RESOURCE_EXHAUSTED" in str(err)):
        first = one_line(str(err))[:300]
        return f"out of device memory ({first}){'; ' + hint if hint else ''}"
    return None


def run_cli(body: Callable[[], int], hint: Callable[[], str] = lambda: "") -> int:
    """`body()`, with a user's mistake printed as `error: <one line>` and exit status
    `MISTAKE_EXIT_STATUS`."""
    try:
        return body()
    except Exception as err:
        line = user_message(err, hint())
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return MISTAKE_EXIT_STATUS
