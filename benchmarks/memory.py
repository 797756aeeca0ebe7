"""The SkewAdam paper's optimizer-state memory table, from our MoE GPT under `jax.eval_shape`.

The paper's 6,784.33M-parameter model (N. Malik, "Where Should Optimizer State Live?",
https://arxiv.org/abs/2607.19058, 2026) is built as a `models.GPT` config (2 blocks, d 4096,
32 heads with 8 KV heads, SwiGLU ff 4096, block 1 with 128 experts top-2, tied
embeddings, vocab 50304, 256 positions) and only traced: parameters and optimizer states
are `jax.ShapeDtypeStruct`s, nothing is allocated. Params are bf16 (SkewAdam's
statistics are float32 whatever the params); AdamW and Lion are traced on float32 params,
since optax keeps their moments in the param dtype and the paper counts float32 moments.
Each row is the state of the real optimizer (`jax.eval_shape(tx.init, params)`, measured
with `optax_snoo.memory`) next to the closed-form prediction and the paper's figure.

    python -m benchmarks.memory

Our GPT's LayerNorms have a scale only (`bias=False`; the paper's also have a bias,
5 x 4096 parameters), hence a parameter count 0.02M below the paper's; the GiB figures
agree to the paper's two decimals. Lion stands for the paper's "Muon/Lion" row (one
float32 momentum per parameter; our `muon` adds Adam moments for embeddings and norms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
import optax_snoo
from optax_snoo.memory import (
    adamw_state_bytes,
    muon_state_bytes,
    skew_adam_state_bytes,
    skew_adam_state_bytes_by_role,
    state_bytes,
    state_bytes_by_group,
)

PAPER_GIB = {"adamw": 50.55, "muon": 25.27, "skew_adam": 1.29, "expert_momentum": 25.29,
             "factored_router": 1.28}
PAPER_BY_ROLE = "backbone 5.0% of params -> 1.27 GiB momentum; experts 12.6 MB; router 2.1 MB"


def paper_config() -> models.GPTConfig:
    """The SkewAdam paper's model as our MoE GPT: block 0 dense SwiGLU, block 1 128
    SwiGLU experts."""
    return models.GPTConfig(
        vocab_size=50304, block_size=256, n_layer=2, n_head=32, n_kv_head=8, n_embd=4096,
        mlp="swiglu", mlp_hidden=4096, bias=False, tie_embeddings=True, moe_every=2,
        n_experts=128, top_k=2, expert_hidden=4096, param_dtype="bfloat16")


def param_shapes(config: models.GPTConfig):
    """The model's parameters as `ShapeDtypeStruct`s (nothing allocated)."""
    model = nnx.eval_shape(lambda: models.GPT(config, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])


def table(params) -> list[dict]:
    """One row per optimizer: measured state bytes (eval_shape), predicted, paper's GiB."""
    rows = []

    def add(name, label, tx, predicted, like=params):
        state = jax.eval_shape(tx.init, like)
        rows.append({"name": name, "label": label, "predicted": predicted, "state": state,
                     "measured": state_bytes(state, statistics_only=True),
                     "paper_gib": PAPER_GIB[name]})

    # optax keeps Adam/Lion moments in the param dtype; the paper's are float32.
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
    add("adamw", "AdamW", optax.adamw(3e-4), adamw_state_bytes(params), f32)
    add("muon", "Lion (one momentum, as Muon)", optax.lion(3e-4), muon_state_bytes(params),
        f32)
    for policies, label in (("skew_adam", "SkewAdam"),
                            ("expert_momentum", "SkewAdam + expert momentum"),
                            ("factored_router", "SkewAdam, factored router")):
        add(policies, label, optax_snoo.skew_adam(3e-4, policies=policies),
            skew_adam_state_bytes(params, policies=policies))
    return rows


def main() -> None:
    params = param_shapes(paper_config())
    n = sum(x.size for x in jax.tree.leaves(params))
    gib = lambda b: b / 2**30
    print(f"paper model as models.GPT (jax.eval_shape): {n / 1e6:,.2f}M params "
          f"(paper 6,784.33M)\n")
    rows = table(params)
    print(f"{'optimizer':34s} {'measured GiB':>12s} {'formula GiB':>12s} {'paper GiB':>10s} "
          f"{'/ AdamW':>8s}")
    adamw = rows[0]["measured"]
    for r in rows:
        print(f"{r['label']:34s} {gib(r['measured']):12.2f} {gib(r['predicted']):12.2f} "
              f"{r['paper_gib']:10.2f} {r['measured'] / adamw:8.4f}")
    by_role = state_bytes_by_group(rows[2]["state"], statistics_only=True)
    assert by_role == skew_adam_state_bytes_by_role(params)
    labels = jax.tree.leaves(optax_snoo.assign_roles(params))
    sizes = [x.size for x in jax.tree.leaves(params)]
    share = {role: sum(s for s, lab in zip(sizes, labels, strict=True) if lab == role) / n
             for role in by_role}
    print("\nSkewAdam by role (measured on the eval_shape state = formula):")
    for role, b in by_role.items():
        print(f"  {role:9s} {share[role]:7.2%} of params  {b / 1e6:10.1f} MB  "
              f"({gib(b):.2f} GiB)")
    print(f"  paper: {PAPER_BY_ROLE}")
    skew = rows[2]["measured"]
    print(f"\nSkewAdam / AdamW = {skew / adamw:.4f} (paper {1.29 / 50.55:.4f}); "
          f"{adamw / skew:.1f}x less state")


if __name__ == "__main__":
    main()
