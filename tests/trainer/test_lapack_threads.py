"""The trainer runs XLA:CPU's LAPACK (jax's CPU ``eigh``/QR kernels call scipy's OpenBLAS)
on one thread: its spinning threads made SOAP-Muon's twin step several times slower on a
loaded machine (train/lapack.py, benchmarks/README.md). Checked in fresh processes without
``OPENBLAS_NUM_THREADS`` (tests/conftest.py sets it for the suite's own processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, sys
import jax.numpy as jnp
if sys.argv[1] == "trainer":
    import train  # noqa: F401  (sets the threads when imported)
jnp.linalg.qr(jnp.eye(4)).Q.block_until_ready()  # the LAPACK jax calls is loaded
with open("/proc/self/maps") as maps:
    paths = sorted({line.split()[-1] for line in maps if "scipy_openblas-" in line})
assert paths, "scipy's OpenBLAS is not the LAPACK jax calls here"
for path in paths:
    lib = ctypes.CDLL(path)
    getter = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads",
                                            "openblas_get_num_threads") if hasattr(lib, n))
    print(getter())
"""


def _threads(mode: str) -> list[int]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [int(n) for n in out.split()]


def test_importing_the_trainer_sets_scipy_openblas_to_one_thread():
    threads = _threads("trainer")
    assert threads and all(n == 1 for n in threads), threads


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenBLAS's default is 1")
def test_without_the_trainer_openblas_takes_every_core():
    """The control: the library alone keeps OpenBLAS's default (one thread a core)."""
    assert all(n > 1 for n in _threads("library"))
