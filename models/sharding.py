"""Logical axis names of the GPT's parameters and default rules mapping them to a mesh.

Every parameter of :class:`models.GPT` carries ``out_sharding`` metadata: one logical
name (or ``None``, replicated) per array axis. A trainer turns them into mesh
shardings with ``nnx.logical_axis_rules(logical_rules())`` and
``nnx.get_named_sharding(state, mesh)`` (or builds the model under ``jax.set_mesh(mesh)``
and the rules, which shards the parameters as they are created).

| logical name | used by                                         | default mesh axis |
|--------------|-------------------------------------------------|-------------------|
| embed        | the model width in every matrix and embedding   | fsdp              |
| mlp          | the hidden width of dense MLPs                  | tensor            |
| heads        | query heads x head width (``c_q``, ``c_proj``)  | tensor            |
| kv           | key/value heads x head width (``c_k``, ``c_v``) | tensor            |
| vocab        | the vocabulary (``wte``, ``lm_head``)           | tensor            |
| expert       | the expert axis of expert stacks                | None (replicated) |
| expert_mlp   | the hidden width of expert stacks               | tensor            |
| layers       | the layer axis of scanned blocks (scan_layers)  | None (replicated) |

LayerNorm scales/biases, the position table's row axis and the router's expert axis
are ``None`` (replicated): they are small.
"""

from __future__ import annotations

LOGICAL_AXES: tuple[str, ...] = (
    "embed",
    "mlp",
    "heads",
    "kv",
    "vocab",
    "expert",
    "expert_mlp",
    "layers",
)

LogicalRules = tuple[tuple[str, str | None], ...]


def logical_rules(
    fsdp_axis: str | None = "fsdp",
    tensor_axis: str | None = "tensor",
    expert_axis: str | None = None,
) -> LogicalRules:
    """Default rules mapping :data:`LOGICAL_AXES` to mesh axes.

    ``embed`` is sharded over ``fsdp_axis`` (ZeRO-3 style: each device keeps a slice of
    every matrix and XLA gathers it for the matmul); ``mlp``, ``heads``, ``kv`` and
    ``vocab`` over ``tensor_axis`` (Megatron-style tensor parallelism); ``expert`` over
    ``expert_axis``. One mesh axis may appear only once per parameter, so when
    ``expert_axis == tensor_axis`` the hidden width of expert stacks (``expert_mlp``)
    is left unsharded. Sharded dimensions must be divisible by the mesh axis size
    (e.g. pad ``vocab_size`` to a multiple of the tensor axis, as nanoGPT's 50304).

    Args:
      fsdp_axis: mesh axis for the model width, or ``None`` to replicate it.
      tensor_axis: mesh axis for the hidden/head/vocabulary dimensions, or ``None``.
      expert_axis: mesh axis for the expert dimension of expert stacks, or ``None``
        (default: experts replicated across devices, each sharded like a dense MLP).

    Returns:
      A tuple of ``(logical_name, mesh_axis_or_None)`` pairs covering every name in
      :data:`LOGICAL_AXES`, for ``nnx.logical_axis_rules``.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import models
      >>> mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 3)
      >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(models.logical_rules()):
      ...   model = models.GPT(models.GPTConfig(), rngs=nnx.Rngs(0))
      >>> model.blocks[0].mlp.c_fc.kernel[...].sharding.spec
      P('fsdp', 'tensor')

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
      Models", https://arxiv.org/abs/1910.02054, 2020.
      Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
      Using Model Parallelism", https://arxiv.org/abs/1909.08053, 2019.
    """
    expert_mlp = None if expert_axis is not None and expert_axis == tensor_axis else tensor_axis
    return (
        ("embed", fsdp_axis),
        ("mlp", tensor_axis),
        ("heads", tensor_axis),
        ("kv", tensor_axis),
        ("vocab", tensor_axis),
        ("expert", expert_axis),
        ("expert_mlp", expert_mlp),
        ("layers", None),  # each device holds every layer's slice; the scan walks them
    )
