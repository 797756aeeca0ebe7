"""Every registered optimizer on the 8-device CPU mesh: `--mesh_fsdp=8` and
`--mesh_data=2 --mesh_fsdp=4` train as one device does (params sharded by the trainer's
logical rules, so Muon's whole-matrix Newton-Schulz and K-FAC's split refresh run)."""

from __future__ import annotations

import numpy as np
import pytest

from train import config as tc
from train.optimizers import OPTIMIZERS
from train.sharding import batch_sharding, put_batch
from trainer.support import random_batches, step_setup, tiny

SOAP_OPTIMIZERS = ("track3_record", "track3_soap_muon")
#: The fsdp-only mesh splits matrices 8 ways (the owners' per-matrix state at its widest);
#: every optimizer runs on data2_fsdp4, which splits both the batch and the matrices, and
#: these also on fsdp8 (CI time). snoo_muon and kfac at fsdp 8 are test_multihost's runs
#: (8 devices over 2 processes); AdamW and the hyperball keep no per-matrix state.
FSDP8_FAMILIES = ("normuon", "skew_adam", "track3_record", "newton_muon")
MESHES = {"fsdp8": dict(mesh_data=1, mesh_fsdp=8), "data2_fsdp4": dict(mesh_data=2, mesh_fsdp=4)}


def _losses(config, steps=3):
    mesh, state, step, spec, vocab_size = step_setup(config)
    losses = []
    for t, xy in enumerate(random_batches(config, steps, vocab_size)):
        state, metrics = step(state, put_batch(xy[0], batch_sharding(mesh)),
                              put_batch(xy[1], batch_sharding(mesh)), **spec.update_kwargs(t))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_on_the_eight_device_mesh(corpus, tmp_path, name):
    # float32 Newton-Schulz would be exact to 1e-6; the default bf16 one and the sharded
    # programs' reduction orders keep the losses within a few 1e-5 over 3 steps.
    names = OPTIMIZERS[name].hyperparameters.names()
    settings = {k: v for k, v in dict(snoo_k=2, kfac_interval=1, kfac_first=1).items()
                if k in names}
    # The records' recipes give the head its own Adam group: untied, as in the records;
    # 12 steps, more than any recipe's fewest.
    untied = "adam_patterns" in OPTIMIZERS[name].options
    one = tiny(corpus, tmp_path, optimizer=name, mesh_data=1, max_iters=12,
               tie_embeddings=not untied, **settings)
    reference = _losses(one)  # once for both meshes: the 1-device run is half the cost
    # SOAP's first eigenbasis comes from a rank-deficient Gram on the non-square MLP
    # matrices: its null-space directions are picked by rounding, so after the second
    # update sharded and 1-device runs may differ beyond it (docs/soap_muon.md); the
    # losses before that must agree, the later ones stay finite.
    agree = 2 if name in SOAP_OPTIMIZERS else len(reference)
    for mesh, axes in MESHES.items():
        if mesh == "fsdp8" and name not in FSDP8_FAMILIES:
            continue
        losses = _losses(tc.override(one, **axes))
        np.testing.assert_allclose(losses[:agree], reference[:agree], rtol=1e-4, err_msg=mesh)
        assert np.all(np.isfinite(losses)), (mesh, losses)
