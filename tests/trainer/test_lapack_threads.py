"""The trainer runs XLA:CPU's LAPACK (jax's CPU ``eigh``/QR kernels call scipy's OpenBLAS)
on one thread: its spinning threads made SOAP-Muon's twin step several times slower on a
loaded machine (train/lapack.py, benchmarks/README.md)."""

from __future__ import annotations

import ctypes

import jax.numpy as jnp

import train  # noqa: F401  (sets the threads when imported)

GETTERS = ("scipy_openblas_get_num_threads", "openblas_get_num_threads")


def test_importing_the_trainer_sets_scipy_openblas_to_one_thread():
    jnp.linalg.qr(jnp.eye(4)).Q.block_until_ready()  # the LAPACK jax calls is loaded
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "scipy_openblas-" in line}
    assert paths, "scipy's OpenBLAS is not the LAPACK jax calls here"
    for path in paths:
        lib = ctypes.CDLL(path)
        getter = next(getattr(lib, n) for n in GETTERS if hasattr(lib, n))
        assert getter() == 1, path
