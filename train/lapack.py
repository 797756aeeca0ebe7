"""One thread for the LAPACK calls of XLA:CPU (``eigh``, QR, Cholesky).

jax's CPU kernels for ``jnp.linalg.eigh``/``qr``/``cholesky`` call the LAPACK of scipy's
bundled OpenBLAS, which by default runs every call on as many threads as the machine has
cores, beside XLA's own thread pool. Its waiting threads spin, taking the cores from
the threads that work: on the 2-core Track 3 twin at load 9-10, SOAP-Muon's step
(record #44, a QR per Gram every step) took 9.9x #36's with OpenBLAS's default threads
and 1.2x on one thread (benchmarks/README.md, "SOAP-Muon's step on the twin"). The
trainer sets one thread once, when imported.
"""

from __future__ import annotations

import ctypes

# Each OpenBLAS build names its setter after its symbol prefix (scipy's wheels: scipy_).
_SETTERS = ("scipy_openblas_set_num_threads", "openblas_set_num_threads",
            "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")


def single_threaded_lapack() -> list[str]:
    """Set every OpenBLAS loaded in this process to one thread (scipy's, whose LAPACK jax's
    CPU kernels call, loaded here first); returns the libraries set (none where scipy or
    ``/proc/self/maps`` is missing: other platforms keep their default)."""
    try:
        import scipy.linalg  # noqa: F401  (loads the OpenBLAS jax's CPU kernels call)

        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "openblas" in line.rsplit("/", 1)[-1].lower()})
    except (ImportError, OSError):
        return []
    done = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        setter = next((getattr(lib, n) for n in _SETTERS if hasattr(lib, n)), None)
        if setter is not None:
            setter(1)
            done.append(path)
    return done
