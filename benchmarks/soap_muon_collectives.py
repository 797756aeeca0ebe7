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
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
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


if __name__ == "__main__":
    main()
