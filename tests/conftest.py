"""Test set-up: eight simulated CPU devices, so sharding tests run on any machine.

XLA reads the flags once, when jax first initialises its backend, so they are set here,
before any test module imports jax. It also holds the corpus and compilation-cache
fixtures the trainer test modules share. The suite is dominated by compilation of small
programs, so XLA's backend optimisation is turned down (about 2x less test time).
"""

import os

import numpy as np
import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
def compilation_cache(tmp_path_factory):
    """A persistent XLA compilation cache for one module (runs of the same config compile
    the same programs); the previous settings come back afterwards."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update(names[1], 0.0)
    jax.config.update(names[2], 0)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
