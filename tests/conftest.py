"""Test set-up: eight simulated CPU devices, so sharding tests run on any machine.

XLA reads the flags once, when jax first initialises its backend, so they are set here,
before any test module imports jax. It also holds the corpus fixture the trainer test
modules share. The suite is dominated by compilation of small programs, so XLA's backend
optimisation is turned down and the legacy CPU emitters used (together about 4x less
test time), and every compiled program goes
to one persistent compilation cache: tests build the same programs from fresh ``jit``
objects, in other xdist workers and in the subprocesses they start, which jax's
in-memory caches cannot share. The cache is set through the environment, so the
workers (started by the process that imports this file first) and the subprocesses
inherit it; ``.ci/run`` points it at a fresh folder per run. Outside CI it defaults to
``.pytest_cache/jax_compilation_cache`` in the checkout (``rm -rf`` it to start cold;
``JAX_COMPILATION_CACHE_DIR`` elsewhere to move it).
"""

import os
from pathlib import Path

import numpy as np
import pytest

import compile_speed

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    # The legacy elemental emitters compile the suite's programs ~2x faster than the fusion
    # emitters (benchmarks/README.md, "Test-suite compile time"); same math, same results.
    + " --xla_cpu_use_fusion_emitters=false"
).strip()
compile_speed.apply(os.environ)  # one codegen module per program, no source locations
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One LAPACK thread (jax's CPU eigh/QR call scipy's OpenBLAS), as the trainer sets it: two
# xdist workers on 2 cores, each with OpenBLAS spinning on every core, starve each other
# (train/lapack.py; read when scipy's OpenBLAS loads, after this file).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax_compilation_cache"))
# Every program, however fast it compiled (the suite's are small: most take < 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

SENTENCES = ("the king and the queen walk to the castle . a fool sings of love and war . "
             "my lord , the night is long and the wind is cold .")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small word-level corpus file for trainer tests (shared by the trainer modules)."""
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(SENTENCES.split(), size=6000)) + "\n"
    path = tmp_path_factory.mktemp("corpus") / "input.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def compilation_cache():
    """The persistent compilation cache, which the trainer modules rely on (runs of the
    same config compile the same programs): fails loudly if it was switched off."""
    import jax

    assert jax.config.jax_compilation_cache_dir, "conftest's compilation cache is off"
    yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops jax's in-memory caches after each module: an xdist worker otherwise holds
    every program it compiled (5.4 GB per worker by the end of the suite); the persistent
    cache still serves programs a later module compiles again."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
