"""XLA's and jax's compile-speed settings of the test suite, in one place: what they
change is how fast programs compile, not what the programs compute. tests/conftest.py
applies them to the tests (and the processes they start); `.ci/run` gives them to the
doctests and notebooks (`eval "$(python tests/compile_speed.py)"`), which otherwise run
as users run them. Figures: benchmarks/README.md, "Test-suite compile time".
"""

from __future__ import annotations

import os
import shlex
from collections.abc import MutableMapping

#: One LLVM module per program, not 32 parts compiled in parallel: the two test workers
#: already fill both cores (compile time -20%).
XLA_FLAGS = ("--xla_cpu_parallel_codegen_split_count=1",)
#: No Python source locations in the lowered programs (debug metadata only; about -6% of
#: a trainer test's time in lowering and compiling them).
ENVIRONMENT = {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0",
               "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "0"}


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds the flags to `environ`'s XLA_FLAGS and sets the variables it does not set."""
    environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), *XLA_FLAGS]).strip()
    for name, value in ENVIRONMENT.items():
        environ.setdefault(name, value)


if __name__ == "__main__":  # the shell's exports, for .ci/run
    settings = dict(os.environ)
    apply(settings)
    for name in ("XLA_FLAGS", *ENVIRONMENT):
        print(f"export {name}={shlex.quote(settings[name])}")
