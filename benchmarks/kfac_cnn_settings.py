"""K-FAC settings on a small Flax NNX CNN, as docs/kfac.md "K-FAC on your model" gives them.

Two `nnx.Conv` layers (1 -> 8 -> 16 channels, the second with stride 2), global average
pooling and an `nnx.Linear` head, trained 150 steps of 128 images (8x8, four line
patterns placed at random in noise, as `notebooks/05_kfac_cnn`), each run in one compiled
`lax.scan`; K-FAC refreshes every 5 steps from step 0. Prints, per setting and seed, the
mean loss of the first and of the last 10 steps, and the largest loss of the run.

    python -m benchmarks.kfac_cnn_settings
"""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
from flax import nnx

from optax_snoo import kfac

STEPS, BATCH, SEEDS = 150, 128, (0, 1)


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` 8x8 images, each one of four 3x3 line patterns at a random place in noise."""
    patterns = np.zeros((4, 3, 3), np.float32)
    patterns[0, 1, :] = 1
    patterns[1, :, 1] = 1
    patterns[2] = np.eye(3)
    patterns[3, 1, :] = patterns[3, :, 1] = 1
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    images = rng.normal(0.0, 0.35, (n, 8, 8, 1)).astype(np.float32)
    rows, cols = rng.integers(0, 6, n), rng.integers(0, 6, n)
    for i in range(n):
        images[i, rows[i]:rows[i] + 3, cols[i]:cols[i] + 3, 0] += patterns[labels[i]]
    return images, labels


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        return self.head(h.mean(axis=(1, 2)))


def train(make_tx, seed: int, images, labels) -> np.ndarray:
    """The per-step losses of one run: `make_tx(layers)` is K-FAC told its layers, or a
    first-order optimizer (`make_tx.second_order` False) that ignores them."""
    graphdef, params = nnx.split(CNN(nnx.Rngs(seed)), nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss_fn(p, x, y):
        logits = nnx.merge(graphdef, nnx.State(p))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    second_order = getattr(make_tx, "second_order", False)
    layers = None
    if second_order:
        stats = jax.eval_shape(
            lambda p: kfac.value_grad_and_stats(loss_fn, p, images[0], labels[0])[2], params)
        layers = jax.eval_shape(kfac.curvature_from_stats, stats)
    tx = make_tx(layers)

    def step(carry, batch):
        p, state = carry
        if second_order:
            loss, grads, stats = kfac.value_grad_and_stats(loss_fn, p, *batch)
            updates, state = tx.update(grads, state, p,
                                       curvature=kfac.curvature_from_stats(stats))
        else:
            loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
            updates, state = tx.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), loss

    run = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), (images, labels))[1])
    return np.asarray(run(params))


def _kfac(lr: float, damping: float, graft: str | None):
    def make(layers):
        return kfac.kfac(lr, damping=damping, refresh=kfac.every(5, first=0), graft=graft,
                         layers=layers)

    make.second_order = True
    return make


SETTINGS = {
    "kfac lr 0.1, damping 1e-2, no graft": _kfac(0.1, 1e-2, None),
    "kfac lr 0.01, damping 1e-2, no graft": _kfac(0.01, 1e-2, None),
    "kfac lr 0.01, damping 1e-3, graft adam": _kfac(0.01, 1e-3, "adam"),
    "kfac lr 0.01, damping 1e-2, graft adam": _kfac(0.01, 1e-2, "adam"),
    "kfac lr 0.03, damping 1e-3, graft adam": _kfac(0.03, 1e-3, "adam"),
    "adamw lr 0.01": lambda layers: optax.adamw(1e-2, weight_decay=0.0),
}


def main() -> None:
    x, y = make_data(STEPS * BATCH, 100)
    images, labels = x.reshape(STEPS, BATCH, 8, 8, 1), y.reshape(STEPS, BATCH)
    for name, make_tx in SETTINGS.items():
        start = time.perf_counter()
        runs = [train(make_tx, seed, images, labels) for seed in SEEDS]
        cells = [f"seed {s}: first 10 {r[:10].mean():.3g}, last 10 {r[-10:].mean():.3g}, "
                 f"max {np.nanmax(r):.3g}" for s, r in zip(SEEDS, runs, strict=True)]
        print(f"{name:40s} {' | '.join(cells)}  ({time.perf_counter() - start:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
