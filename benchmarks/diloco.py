"""DiLoCo's cross-replica traffic, read from compiled programs: `python -m benchmarks.diloco`.

A small MLP's train step on 8 (simulated) CPU devices, the same global batch either way:

- DiLoCo (`optax_snoo.diloco(adamw)`): a mesh `("diloco", "fsdp") = (M, 8 / M)`; params,
  inner state and slow weights with a leading replica axis over `diloco`, matrices' rows
  over `fsdp`; each replica its own rows of the batch. Two programs: an inner step
  (`snoo_sync=False`) and a sync step (`snoo_sync=True`).
- Data-parallel AdamW: a mesh `("data", "fsdp") = (M, 8 / M)`, the params (rows over
  `fsdp`) and the batch over both axes; the gradients are reduced over every device on
  every step.

For each program: the bytes per device of the collectives whose device groups join
devices of different replicas (`data` blocks for data-parallel), `benchmarks.hlo`'s
count (`spans_blocks`), and of all collectives. DiLoCo's inner step moves nothing across
replicas; its sync step all-reduces the pseudo-gradient, each device's share of the params
(float32); data-parallel moves the gradients across replicas on every step.

    python -m benchmarks.diloco            # the table, M = 2, 4, 8, k = 28
    python -m benchmarks.diloco --trainer  # also the trainer's GPT step (CPU recipe's model)

With `--trainer`, the same counts for the trainer's compiled step on the
`shakespeare_char_cpu` model at batch 16 (`--mesh_diloco=2 --mesh_fsdp=4` with `snoo_adamw`, against
`--mesh_data=2 --mesh_fsdp=4` with `adamw`).

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  https://arxiv.org/abs/2311.08105, 2023.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_snoo
from benchmarks import hlo

WIDTHS = (64, 256, 64)  # input, hidden, output: an MLP of two (rows over fsdp) matrices
BATCH = 32


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    d_in, hidden, d_out = WIDTHS
    return {"w1": jax.random.normal(k1, (d_in, hidden)) / math.sqrt(d_in),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, d_out)) / math.sqrt(hidden)}


def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def param_bytes(params: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def _param_specs(lead: tuple) -> dict[str, P]:
    return {"w1": P(*lead, "fsdp"), "b1": P(*lead), "w2": P(*lead, "fsdp")}


def _state_shardings(state: Any, mesh: jax.sharding.Mesh, lead: tuple) -> Any:
    """Each state leaf sharded like the param of its rank (scalars replicated)."""
    by_rank = {len(lead) + 2: P(*lead, "fsdp"), len(lead) + 1: P(*lead)}
    return jax.tree.map(lambda x: NamedSharding(mesh, by_rank.get(x.ndim, P())), state)


def diloco_programs(replicas: int, k: int = 28, devices: int = 8) -> dict[str, str]:
    """Compiled HLO text of DiLoCo's inner and sync train steps, M = `replicas`."""
    mesh = jax.make_mesh((replicas, devices // replicas), ("diloco", "fsdp"),
                         axis_types=(AxisType.Auto,) * 2)
    tx = optax_snoo.diloco(optax.adamw(1e-3), k=k)
    params = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *p.shape)),
                          init_params(jax.random.key(0)))
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                 _param_specs(("diloco",))))
    state = tx.init(params)
    state = jax.device_put(state, _state_shardings(state, mesh, ("diloco",)))
    rows = NamedSharding(mesh, P("diloco", "fsdp"))
    x = jax.device_put(jnp.ones((replicas, BATCH // replicas, WIDTHS[0])), rows)
    y = jax.device_put(jnp.ones((replicas, BATCH // replicas, WIDTHS[2])), rows)

    def step(params, state, x, y, sync):
        grads = jax.vmap(jax.grad(loss))(params, x, y)  # each replica its own rows
        updates, state = tx.update(grads, state, params, snoo_sync=sync)
        return optax.apply_updates(params, updates), state

    return {name: jax.jit(step, static_argnums=4).lower(params, state, x, y, sync)
            .compile().as_text() for name, sync in (("inner", False), ("sync", True))}


def data_parallel_program(replicas: int, devices: int = 8) -> str:
    """Compiled HLO text of data-parallel AdamW's train step on `("data", "fsdp")`."""
    mesh = jax.make_mesh((replicas, devices // replicas), ("data", "fsdp"),
                         axis_types=(AxisType.Auto,) * 2)
    tx = optax.adamw(1e-3)
    params = jax.device_put(init_params(jax.random.key(0)), jax.tree.map(
        lambda s: NamedSharding(mesh, s), _param_specs(())))
    state = tx.init(params)
    state = jax.device_put(state, _state_shardings(state, mesh, ()))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.device_put(jnp.ones((BATCH, WIDTHS[0])), rows)
    y = jax.device_put(jnp.ones((BATCH, WIDTHS[2])), rows)

    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step).lower(params, state, x, y).compile().as_text()


def cross_replica_bytes(text: str, replicas: int, devices: int = 8) -> tuple[float, float]:
    """(bytes across replicas, all collective bytes) per device of one compiled step."""
    across = hlo.analyze(text, only=hlo.spans_blocks(devices // replicas))
    return across.collective_bytes, hlo.analyze(text).collective_bytes


def table(replica_counts: tuple[int, ...] = (2, 4, 8), k: int = 28) -> str:
    full = param_bytes(init_params(jax.random.key(0)))
    lines = [f"params: {full} bytes (float32); k = {k}; bytes per device per step",
             "", "| M | fsdp | params / fsdp | DiLoCo inner: across / all | DiLoCo sync: "
             "across / all | DiLoCo per step (mean over k) | data-parallel: across / all |",
             "|---|---|---|---|---|---|---|"]
    for m in replica_counts:
        fsdp = 8 // m
        share = full / fsdp  # a device's part of one replica's params
        programs = diloco_programs(m, k)
        inner = cross_replica_bytes(programs["inner"], m)
        sync = cross_replica_bytes(programs["sync"], m)
        dp = cross_replica_bytes(data_parallel_program(m), m)
        mean = (sync[0] + (k - 1) * inner[0]) / k
        lines.append(f"| {m} | {fsdp} | {share:.0f} | {inner[0]:.0f} / {inner[1]:.0f} | "
                     f"{sync[0]:.0f} / {sync[1]:.0f} | {mean:.0f} | "
                     f"{dp[0]:.0f} / {dp[1]:.0f} |")
    return "\n".join(lines)


def trainer_step_costs(config: Any, block: int) -> tuple[dict[Any, tuple[float, float]], int]:
    """The trainer's compiled step for `config`: per static hint (`snoo_sync` False and
    True, or None for an optimizer without Snoo), (bytes across blocks of `block`
    devices, all collective bytes) per device; and one replica's float32 params bytes.
    The batch is zeros of the config's shape."""
    import dataclasses

    from train.config import model_config
    from train.optimizers import build_optimizer
    from train.sharding import batch_sharding, make_mesh, replica_axis, tree_shardings
    from train.step import create_train_state, make_train_step

    config = dataclasses.replace(config, model=model_config(config, 64))
    optimizer, mesh = build_optimizer(config), make_mesh(config)
    model, state = create_train_state(config.model, optimizer.replica_tx, seed=0, mesh=mesh)
    step = make_train_step(model, optimizer, mesh=mesh,
                           state_shardings=tree_shardings(state, mesh))
    d = config.data
    x = jax.device_put(jnp.zeros((d.grad_accum, d.batch_size, config.model.block_size),
                                 jnp.int32), batch_sharding(mesh))
    hints = (None,) if optimizer.sync_period is None else (False, True)
    out = {}
    for hint in hints:
        kwargs = {} if hint is None else {"snoo_sync": hint}
        text = step.lower(state, x, x, **kwargs).compile().as_text()
        out[hint] = (hlo.analyze(text, only=hlo.spans_blocks(block)).collective_bytes,
                     hlo.analyze(text).collective_bytes)
    params = sum(x.size * 4 for x in jax.tree.leaves(state.params)) // replica_axis(mesh)
    return out, params


def trainer_table(k: int = 28) -> str:
    from train.config import get_preset, override

    base = override(get_preset("shakespeare_char_cpu"), snoo_k=k, mesh_data=1, mesh_fsdp=4,
                    batch_size=16)  # 12 rows do not split over 8 devices
    diloco, params = trainer_step_costs(override(base, optimizer="snoo_adamw",
                                                 mesh_diloco=2), 4)
    dp, _ = trainer_step_costs(override(base, optimizer="adamw", mesh_data=2), 4)
    mean = (diloco[True][0] + (k - 1) * diloco[False][0]) / k
    return "\n".join([
        f"trainer step, shakespeare_char_cpu model ({params} bytes of float32 params; share "
        f"over fsdp=4: {params / 4:.0f}), k = {k}; bytes per device",
        "", "| program | across replicas | all collectives |", "|---|---|---|",
        f"| DiLoCo (`snoo_adamw --mesh_diloco=2 --mesh_fsdp=4`) inner step | "
        f"{diloco[False][0]:.0f} | {diloco[False][1]:.0f} |",
        f"| DiLoCo sync step | {diloco[True][0]:.0f} | {diloco[True][1]:.0f} |",
        f"| DiLoCo mean per step over k | {mean:.0f} | |",
        f"| data-parallel AdamW (`--mesh_data=2 --mesh_fsdp=4`), every step | "
        f"{dp[None][0]:.0f} | {dp[None][1]:.0f} |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--k", type=int, default=28)
    parser.add_argument("--trainer", action="store_true")
    args = parser.parse_args()
    print(table(tuple(int(m) for m in args.replicas.split(",")), args.k))
    if args.trainer:
        print()
        print(trainer_table(args.k))


if __name__ == "__main__":
    main()
