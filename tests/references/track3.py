"""Float64 numpy references of modded-nanogpt Track 3's records for the recipe tests.

The per-matrix pieces are the transforms' references beside it (`references.soap`'s
`RefSoapMuon`, `references.radius`'s `ref_muon_step` and `ref_scale_invariant_update`,
`references.muon`'s `ref_ns` and `RefMuon.normuon`); this module adds the records' Adam
classes and the layout helpers the whole-stack references share. Weights are kept in
our (in, out) layout; the record's (out, in) matrices are their transposes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from optax_snoo.labels import path_to_str


def adam_step(p, g, m, v, t, lr, b1, b2, eps, *, bias_correction, wd=0.0):
    """`torch.optim.AdamW` (``bias_correction=True``; ``t`` counts from 1) or #46's `Adam`
    class (``m.lerp_(g, 1-b1); v.lerp_(g², 1-b2); p -= lr·m/(sqrt(v)+eps)``).

    Returns:
      ``(p, m, v)``.
    """
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    if bias_correction:
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
        return p - lr / (1 - b1**t) * m / denom, m, v
    return p - lr * m / (np.sqrt(v) + eps), m, v


def nest(flat, dtype=jnp.float32):
    """``{"a/b": x}`` -> ``{"a": {"b": jnp.asarray(x)}}``."""
    out = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value, dtype)
    return out


def flatten(tree):
    """The inverse of `nest`, as float64 numpy arrays."""
    return {path_to_str(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def power_cool(lr0, c, t_end, t, power=1.2):
    """#20's ``_lr``: ``min(lr0, c·max(0, t_end - t)^power)``."""
    return min(lr0, c * max(0.0, t_end - t) ** power)


def stable_cooldown(t, total, cooldown_frac):
    """The records' ``set_hparams`` multiplier: 1, then linear to 0 over the last frac."""
    progress = t / total
    return 1.0 if progress < 1 - cooldown_frac else (1 - progress) / cooldown_frac
