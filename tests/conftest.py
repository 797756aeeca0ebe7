"""Test set-up: eight simulated CPU devices, so sharding tests run on any machine.

XLA reads the flags once, when jax first initialises its backend, so they are set here,
before any test module imports jax. The suite is dominated by compilation of small
programs, so XLA's backend optimisation is turned down (about 2x less test time).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
