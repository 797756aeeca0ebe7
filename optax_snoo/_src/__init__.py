"""Implementations; the public names are re-exported by `optax_snoo` and its namespaces."""
