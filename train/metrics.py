"""Run metrics: the JSON-lines log, throughput and MFU, and the loss plot.

MFU follows nanoGPT: FLOPs per token `6N + 12·L·H·Q·T` (N = parameters without the
position table, MoE experts counted at `top_k / n_experts`), divided by the peak bf16
FLOP/s of the devices (a small table by device kind; none for CPUs).

Example:
  >>> peak_flops_per_device("NVIDIA H100 80GB HBM3")
  989000000000000.0
  >>> peak_flops_per_device("cpu") is None
  True

References:
  Karpathy, "nanoGPT" (model.py estimate_mfu), https://github.com/karpathy/nanoGPT, 2023.
  Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (appendix B, MFU),
  https://arxiv.org/abs/2204.02311, 2022.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "PEAK_FLOPS",
    "MetricsLog",
    "flops_per_token",
    "peak_flops_per_device",
    "plot_losses",
]

# Dense bf16 tensor-core peaks per device (vendor data sheets); matched as substrings of
# `jax.Device.device_kind`, first match wins.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10", 125e12), ("V100", 125e12), ("T4", 65e12), ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of `device_kind`, or `None` when unknown (CPUs)."""
    for name, flops in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def flops_per_token(params: Any, config: Any) -> float:
    """nanoGPT's training FLOPs per token, `6N + 12·L·H·Q·T`.

    Args:
      params: the GPT's parameter tree (pure dict from `nnx.split`).
      config: its `models.GPTConfig`.
    """
    n = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if names and names[0] == "wpe":
            continue
        scale = config.top_k / config.n_experts if "experts" in names else 1.0
        n += scale * math.prod(leaf.shape)
    head_dim = config.n_embd // config.n_head
    return 6 * n + 12 * config.n_layer * config.n_head * head_dim * config.block_size


class MetricsLog:
    """Append-only `metrics.jsonl` (one JSON object per line) plus the in-memory history."""

    def __init__(self, path: str | os.PathLike, *, append: bool = False):
        self.path = Path(path)
        self.history: list[dict[str, Any]] = []
        if not append:
            self.path.write_text("")

    def write(self, **entry: Any) -> dict[str, Any]:
        """Record `entry` (JSON-serialisable values) and return it."""
        self.history.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry


def plot_losses(history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Save train/val loss against step (the logged train loss and both eval losses).

    Draws on a bare `matplotlib.figure.Figure`, so pyplot's global backend (a notebook's
    inline backend, say) is left alone.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    series = (("loss", "train (batch)", 0.4), ("train_loss", "train (eval)", 1.0),
              ("val_loss", "val (eval)", 1.0))
    for key, label, alpha in series:
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, alpha=alpha,
                    marker="o" if key != "loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
