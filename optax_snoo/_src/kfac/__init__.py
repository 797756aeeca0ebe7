"""K-FAC implementation modules; the public names are in `optax_snoo.kfac`."""
