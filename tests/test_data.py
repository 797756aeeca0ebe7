"""The batch sampler reaches every window of a split, and only whole windows."""

from __future__ import annotations

import numpy as np
import pytest

from train.data import CharDataset


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_window_start_of_a_split_is_reachable(split):
    """Ids are their positions, so a window's first input is its start."""
    n, T = 23, 5  # starts 0 .. n - T - 1: the last window's target is the split's last id
    ids = np.arange(n, dtype=np.int32)
    data = CharDataset("".join(map(chr, range(32, 32 + n))), ids, ids)
    starts = set()
    for step in range(200):
        x, y = data.batch(split, step, batch_size=4, block_size=T, seed=0)
        np.testing.assert_array_equal(x + 1, y)
        assert int(y.max()) <= n - 1
        starts |= set(x[..., 0].ravel().tolist())
    assert starts == set(range(n - T))
    x, _ = data.eval_batches(split, num_batches=100, batch_size=4, block_size=T, seed=0)
    assert set(x[..., 0].ravel().tolist()) == set(range(n - T))
