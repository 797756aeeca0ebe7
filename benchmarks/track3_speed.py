"""Our `track3_cpu` step against modded-nanogpt Track 3's own step in PyTorch, same shape.

`python -m benchmarks.track3_speed [--rounds=7 --steps=5]`. The PyTorch side is the
file's (records/track_3_optimization/train_gpt_simple.py) GPT and optimizer step written
here from it, at the twin's shape (4 x 128, heads of 32, context 128, vocabulary 65, 8 x 2
accumulated sequences): bf16 embedding and residual stream, RMSNorm, half-truncated RoPE
after QK-norm, attention scale 0.12, ReLU², biases, soft-cap, summed loss; Muon (EMA
Nesterov 0.95, 12 Newton-Schulz steps of (2, -1.5, 0.5) in bf16, decoupled decay) and
fused-free `torch.optim.AdamW` groups. Eager mode (the file compiles the model with
`torch.compile` for CUDA; on this CPU that needs a C++ toolchain and minutes, so it is left
out and said so). Ours is the trainer's jitted step (`benchmarks.throughput.ours`). The
two alternate round by round in one process, so machine load hits both alike; the line
reports the median ratio of the rounds, the `lscpu` model, its bf16 flags and the load.

Needs PyTorch (not a dependency): `pip install torch`.

References:
  Jordan et al., modded-nanogpt Track 3 (optimization), train_gpt_simple.py,
  https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization,
  2026.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Sequence

import numpy as np


def torch_step(n_layer: int, d: int, head_dim: int, vocab: int, block: int, batch: int,
               accum: int, seed: int = 0):
    """`run(n)`: n optimizer steps of the file's network and optimizers (PyTorch, CPU)."""
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    torch.manual_seed(seed)

    def rms(x, gains=None):
        return F.rms_norm(x, (x.size(-1),), weight=None if gains is None else gains.type_as(x))

    class Lin(nn.Linear):  # weights cast to the activations' dtype at use, biases on
        def forward(self, x):
            return F.linear(x, self.weight.type_as(x), self.bias.type_as(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.proj = (Lin(d, d) for _ in range(4))
            self.fc, self.mproj = Lin(d, 4 * d), Lin(4 * d, d)
            self.g1, self.g2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            freq = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4)
            self.register_buffer("freq", torch.cat([freq, torch.zeros(head_dim // 4)]))

        def rotate(self, x):  # (B, T, H, D): rotate-half pairs by -theta, in float32
            theta = torch.outer(torch.arange(x.size(1), dtype=torch.float32), self.freq)
            cos, sin = theta.cos()[None, :, None], theta.sin()[None, :, None]
            a, b = x.float().chunk(2, dim=-1)
            return torch.cat((a * cos + b * sin, b * cos - a * sin), -1).type_as(x)

        def forward(self, x):
            B, T = x.shape[:2]
            h = rms(x, self.g1)
            q, k, v = (f(h).view(B, T, -1, head_dim) for f in (self.q, self.k, self.v))
            q, k = self.rotate(rms(q)), self.rotate(rms(k))
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), scale=0.12, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
            return x + self.mproj(self.fc(rms(x, self.g2)).relu().square())

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d).bfloat16()
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.head = Lin(d, vocab)
            self.g_in, self.g_out = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))

        def forward(self, x, y):
            h = rms(self.embed(x), self.g_in)
            for block in self.blocks:
                h = block(h)
            z = self.head(rms(h, self.g_out)).float()
            z = 15 * z * (z.square() + 225).rsqrt()
            return F.cross_entropy(z.view(-1, z.size(-1)), y.reshape(-1), reduction="sum")

    model = GPT()
    for name, p in model.named_parameters():  # the file's init
        if name.startswith("g"):
            continue
        with torch.no_grad():
            if "proj" in name or name.startswith("head") or name.endswith("bias"):
                p.zero_()
            elif name == "embed.weight":
                p.normal_()
            else:
                p.normal_(std=0.33 ** 0.5 / p.size(-1) ** 0.5)
    hidden = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2]
    adamw = torch.optim.AdamW(
        [dict(params=[model.embed.weight], lr=0.7), dict(params=[model.head.weight], lr=0.004),
         dict(params=[p for p in model.parameters() if p.ndim < 2], lr=0.015)],
        betas=(0.8, 0.95), eps=1e-10, weight_decay=0.001)
    momenta = [torch.zeros_like(p) for p in hidden]

    @torch.no_grad()
    def muon(lr=0.025, wd=0.05, mu=0.95):
        for p, m in zip(hidden, momenta, strict=True):
            g = p.grad
            m.lerp_(g, 1 - mu)
            x = g.lerp(m, mu).bfloat16()
            tall = x.size(0) > x.size(1)
            x = x.mT if tall else x
            x = x / (x.norm() + 1e-7)
            for _ in range(12):
                a = x @ x.mT
                x = 2 * x + (-1.5 * a + 0.5 * a @ a) @ x
            x = (x.mT if tall else x).float() * max(1, g.size(0) / g.size(1)) ** 0.5
            p.mul_(1 - lr * wd).add_(x, alpha=-lr)

    rng = np.random.default_rng(seed)
    data = [torch.from_numpy(rng.integers(0, vocab, (accum * batch, block + 1)))
            for _ in range(4)]

    def run(n: int) -> None:
        for i in range(n):
            w = data[i % len(data)]
            for a in range(accum):
                rows = w[a * batch:(a + 1) * batch]
                model(rows[:, :-1], rows[:, 1:]).backward()
            adamw.step()
            muon()
            model.zero_grad(set_to_none=True)

    return run


def _cpu() -> tuple[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?", "?"
    model = next((x.split(":", 1)[1].strip() for x in text.splitlines()
                  if x.startswith("Model name")), "?")
    flags = next((x for x in text.splitlines() if x.startswith("Flags")), "")
    bf16 = sorted({f for f in flags.split() if "bf16" in f or f.startswith("amx")})
    return model, " ".join(bf16) or "none"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per side per round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    import jax
    import torch

    from benchmarks.throughput import ours
    from train.config import get_preset

    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset("track3_cpu")
    m, d = config.model, config.data
    sides = {"ours": ours(config).run,
             "torch": torch_step(m.n_layer, m.n_embd, m.n_embd // m.n_head, 65, m.block_size,
                                 d.batch_size, d.grad_accum)}
    load = [os.getloadavg()[0]]
    for run in sides.values():
        run(2)  # compile / warm up
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, run in sides.items():
            t0 = time.perf_counter()
            run(args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    load.append(os.getloadavg()[0])
    ratios = [t / o for t, o in zip(times["torch"], times["ours"], strict=True)]
    cpu, flags = _cpu()
    result = {"ours_ms": 1e3 * statistics.median(times["ours"]),
              "torch_ms": 1e3 * statistics.median(times["torch"]),
              "torch_over_ours": statistics.median(ratios),
              "ratio_range": [min(ratios), max(ratios)], "cpu": cpu, "bf16_flags": flags,
              "load": load, "torch": torch.__version__, "jax": jax.__version__,
              "torch_threads": torch.get_num_threads()}
    print(f"track3_cpu step: ours {result['ours_ms']:.0f} ms, PyTorch (eager) "
          f"{result['torch_ms']:.0f} ms; PyTorch/ours {result['torch_over_ours']:.2f} "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); {cpu}; bf16 flags: {flags}; "
          f"load {load[0]:.1f} -> {load[1]:.1f}; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), jax {jax.__version__}")
    return result


if __name__ == "__main__":
    main()
