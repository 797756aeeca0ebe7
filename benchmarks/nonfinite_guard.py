"""Cost of the trainer's non-finite guard (`train.nonfinite`): XLA's own cost analysis.

Compiles the train step of the default CPU preset with and without the guard
(`max_bad_steps=10` vs `None`) for each optimizer path and prints the ratio of the
compiled programs' bytes accessed and FLOPs. Cost analysis does not depend on machine
load, unlike timings on a shared machine.

    python -m benchmarks.nonfinite_guard
"""

from __future__ import annotations

import numpy as np

from train import config as tc
from train.optimizers import build_optimizer
from train.sharding import batch_sharding, make_mesh, put_batch, tree_shardings
from train.step import create_train_state, make_train_step


def main() -> None:
    for optimizer, sync in (("adamw", None), ("snoo_muon", False), ("snoo_muon", True),
                            ("snoo_adamw", None)):
        config = tc.override(tc.get_preset("shakespeare_char_cpu"), optimizer=optimizer,
                             mesh_data=1)
        spec = build_optimizer(config)
        hints = {} if sync is None else {"snoo_sync": sync}  # None: Snoo decides in jit
        mesh = make_mesh(config)
        cost = {}
        for name, max_bad_steps in (("off", None), ("guard", 10)):
            model, state = create_train_state(tc.model_config(config, 65), spec.tx, seed=0,
                                              mesh=mesh)
            step = make_train_step(model, spec, mesh=mesh,
                                   state_shardings=tree_shardings(state, mesh),
                                   max_bad_steps=max_bad_steps)
            shape = (1, config.data.batch_size, config.model.block_size)
            x = put_batch(np.zeros(shape, np.int32), batch_sharding(mesh))
            analysis = step.lower(state, x, x, **hints).compile().cost_analysis()
            analysis = analysis[0] if isinstance(analysis, list) else analysis
            cost[name] = (analysis["bytes accessed"], analysis["flops"])
        print(f"{optimizer:<11} snoo_sync={sync!s:<5} bytes accessed "
              f"{cost['guard'][0] / cost['off'][0]:.3f}x, flops "
              f"{cost['guard'][1] / cost['off'][1]:.4f}x")


if __name__ == "__main__":
    main()
