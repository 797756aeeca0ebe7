"""Collective bytes per device of Muon and SOAP-Muon on FSDP-sharded matrices.

One transformer block's hidden matrices (q, k, v, attention output, MLP in and out; Flax
``(in, out)`` kernels of width ``--width``), rows split over ``--devices`` simulated CPU
devices, ``scale_by_muon`` compiled without a precondition (``muon``) and with
``precondition=soap_whitening()`` (``soap_muon_on_owners``, what `soap_muon` runs: the
raw gradient travels with the momentum to each matrix's owner, which whitens it there and
keeps its statistics), read with `benchmarks.hlo` (loops counted; a conditional at its
most expensive branch, the basis refresh).

    python -m benchmarks.soap_muon_collectives             # width 768 on 8 devices
    python -m benchmarks.soap_muon_collectives --width=128

``--recipes=track3_baseline,track3_soap_muon,...`` instead compiles each recipe's whole
optimizer update (``tx.update`` as the trainer builds it, its matrices' plan included)
on the ``--preset`` network (the Track 3 twin by default) with ``--mesh_fsdp`` over
``--devices``, and reads every collective of the step after the first (`hlo.analyze`
``without_eigh``: SOAP's power-QR refresh), listing each all-gather and all-reduce
larger than the largest 1-D leaf with its bytes, beside the largest matrix's bytes:
none gathers a whole matrix to every device when the list stays empty.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--recipes", default="", help="comma-separated: each recipe's "
                        "update on the --preset network instead of one block")
    parser.add_argument("--preset", default="track3_cpu")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    if args.recipes:
        print(json.dumps(recipes(args.recipes.split(","), args.preset, args.devices),
                         indent=1))
        return
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import hlo
    from optax_snoo import NewtonSchulzPlan, scale_by_muon, soap_whitening

    d = args.width
    mesh = jax.make_mesh((args.devices,), ("fsdp",), axis_types=(AxisType.Auto,))
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "attn_proj": (d, d),
              "fc": (d, 4 * d), "mlp_proj": (4 * d, d)}
    params = {k: jax.device_put(jnp.zeros(s, jnp.float32), NamedSharding(mesh, P("fsdp")))
              for k, s in shapes.items()}
    plan = NewtonSchulzPlan.from_params(params)
    param_bytes = 4 * sum(a * b for a, b in shapes.values())
    rows = {}
    for name, precondition, norm in [
            ("muon", None, "frobenius"),
            ("soap_muon_on_owners", soap_whitening(), "gram_frobenius")]:
        tx = scale_by_muon(precondition=precondition, ns_normalization=norm,
                           newton_schulz_plan=plan)
        state = tx.init(params)
        text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
        cost = hlo.analyze(text)
        rows[name] = {"counts": dict(cost.counts),
                      "bytes": {k: int(v) for k, v in cost.by_kind.items()},
                      "total_bytes": int(cost.collective_bytes),
                      "loop_bytes": int(cost.loop_collective_bytes),
                      "per_param_byte": round(cost.collective_bytes / param_bytes, 3)}
    print(json.dumps({"width": d, "devices": args.devices, "param_bytes": param_bytes,
                      **rows}, indent=1))


def recipes(names: list[str], preset: str, devices: int) -> dict:
    """Per recipe: the collectives of its update per device and step (after the first),
    and the all-gathers/all-reduces bigger than a vector."""
    import functools
    import re

    import jax
    import numpy as np

    from benchmarks import hlo
    from train.config import model_config, parse_args
    from train.optimizers import build_optimizer
    from train.sharding import make_mesh
    from train.step import create_train_state, param_shardings

    out = {"preset": preset, "devices": devices, "fsdp": devices}
    for name in names:
        config = parse_args([f"--preset={preset}", f"--optimizer={name}",
                             f"--mesh_fsdp={devices}"])
        mesh = make_mesh(config)
        spec = build_optimizer(config, params=param_shardings(config.model, mesh))
        _, state = create_train_state(model_config(config, 65), spec.tx, seed=0, mesh=mesh)
        params, opt_state = state.params, state.opt_state
        update = jax.jit(functools.partial(spec.tx.update, **spec.update_kwargs(5)))
        text = update.lower(params, opt_state, params).compile().as_text()
        cost = hlo.analyze(text, without_eigh=True)
        shapes = [x.shape for x in jax.tree.leaves(params)]
        vector = max(4 * int(np.prod(s)) for s in shapes if len(s) < 2)
        matrix = max(4 * int(np.prod(s)) for s in shapes if len(s) >= 2)
        big = []
        for line in text.splitlines():
            m = re.search(r"=\s*(\S+\[[0-9,]*\][^ ]*)\s+(all-gather|all-reduce)(-start)?\(", line)
            if m and hlo._bytes(m.group(1)) > vector:
                big.append(f"{m.group(2)} {m.group(1)} ({int(hlo._bytes(m.group(1)))} B)")
        out[name] = {"counts": {k: int(v) for k, v in cost.counts.items()},
                     "bytes": {k: int(v) for k, v in cost.by_kind.items()},
                     "total_mb": round(cost.collective_bytes / 1e6, 2),
                     "largest_matrix_bytes": matrix, "larger_than_a_vector": big}
    return out


if __name__ == "__main__":
    main()
