"""nanoGPT's CPU recipe in PyTorch, as a same-machine cross-check of `python -m train`.

A GPT written here from nanoGPT's description (pre-LayerNorm blocks without biases, causal
`scaled_dot_product_attention`, exact GELU, tied head; init N(0, 0.02²) with the residual
projections at 0.02/sqrt(2·n_layer)), trained as nanoGPT's `train.py` does: AdamW (0.9,
0.99) with decay 0.1 on >= 2-D tensors only, nanoGPT's `get_lr` (warmup 100, cosine from
1e-3 to 1e-4 at step 2000), global-norm clipping 1.0, batches of 12 random 64-token
windows from `torch.randint`, evaluation every 250 steps on 20 random batches per split,
float32. At step 2000 it also reports the loss over every non-overlapping window of the val
split (the same windows as `python -m train.evaluate`) and the median time of a training
step. Needs PyTorch, which is not a dependency of this project (`pip install torch`).

    python benchmarks/torch_recipe.py --seed=1337 [--data=PATH] [--max_iters=2000]
    python benchmarks/torch_recipe.py --serve     # timed steps on request, for
                                                  # `python -m benchmarks.throughput --torch=`

`--serve` times the training step alone (as `benchmarks.throughput` times ours): it
reads a step count per line on stdin, runs that many steps on 4 batches drawn once, and
answers each line with one JSON line of the wall and CPU seconds they took.

References:
  Karpathy, "nanoGPT" (model.py, train.py, config/train_shakespeare_char.py; the README's
  CPU command line), https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data/tinyshakespeare/input.txt"


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q, k, v = (a.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for a in (q, k, v))
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, D))
        return x + self.mlp_proj(functional.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for b in self.blocks:
            for w in (b.attn_proj.weight, b.mlp_proj.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head
        return functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def get_lr(it: int, lr=1e-3, min_lr=1e-4, warmup=100, decay_iters=2000) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


class Recipe:
    """nanoGPT's model, AdamW groups, batches and training step on tiny Shakespeare."""

    B, T = 12, 64

    def __init__(self, seed: int, data: str, max_iters: int):
        torch.manual_seed(seed)
        text = Path(data).read_text(encoding="utf-8")
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        chars, ids = np.unique(codes, return_inverse=True)  # sorted characters, as train.data
        ids = ids.astype(np.int64)
        n = int(len(ids) * 0.9)
        self.splits = {"train": torch.from_numpy(ids[:n]), "val": torch.from_numpy(ids[n:])}
        self.model = GPT(len(chars), self.T, n_layer=4, n_head=4, d=128)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=1e-3, betas=(0.9, 0.99))
        self.max_iters = max_iters

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data, T = self.splits[split], self.T
        ix = torch.randint(len(data) - T, (self.B,))
        return (torch.stack([data[i:i + T] for i in ix]),
                torch.stack([data[i + 1:i + 1 + T] for i in ix]))

    def step(self, it: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Training step `it` on `(x, y)`: lr, forward, backward, clip, AdamW."""
        for group in self.opt.param_groups:
            group["lr"] = get_lr(it, decay_iters=self.max_iters)
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def serve(recipe: Recipe, lines, write) -> None:
    """For each step count read from `lines`, that many timed steps; `write` one JSON line
    `{"wall": s, "cpu": s}` after each (the steps cycle over 4 batches drawn once)."""
    batches = [recipe.get_batch("train") for _ in range(4)]
    it = 0
    write(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}))
    for line in lines:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(int(line)):
            loss = recipe.step(it, *batches[it % len(batches)])
            it += 1
        loss.item()
        write(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--max_iters", type=int, default=2000)
    parser.add_argument("--serve", action="store_true",
                        help="answer step counts on stdin with their timings (above)")
    args = parser.parse_args(argv)
    recipe = Recipe(args.seed, args.data, args.max_iters)
    if args.serve:
        return serve(recipe, sys.stdin, lambda line: print(line, flush=True))
    model, get_batch, splits, T = recipe.model, recipe.get_batch, recipe.splits, recipe.T

    @torch.no_grad()
    def estimate(split, iters=20):
        model.eval()
        out = torch.stack([model(*get_batch(split)) for _ in range(iters)]).mean().item()
        model.train()
        return out

    @torch.no_grad()
    def whole_val():
        data = splits["val"]
        w = (len(data) - 1) // T
        x, y = data[:w * T].view(w, T), data[1:w * T + 1].view(w, T)
        model.eval()
        total = sum(model(x[i:i + 64], y[i:i + 64]).item() * len(x[i:i + 64])
                    for i in range(0, w, 64))
        model.train()
        return total / w

    evals, step_times = [], []
    x, y = get_batch("train")
    for it in range(args.max_iters + 1):
        if it % 250 == 0 or it == args.max_iters:
            evals.append({"step": it, "train": estimate("train"), "val": estimate("val")})
            print(json.dumps(evals[-1]), flush=True)
        if it == args.max_iters:
            break
        t0 = time.perf_counter()
        recipe.step(it, x, y)  # draws no random numbers, so the batches are nanoGPT's
        step_times.append(time.perf_counter() - t0)
        x, y = get_batch("train")
    B = recipe.B
    result = {"seed": args.seed, "val_20_batches": evals[-1]["val"], "whole_val": whole_val(),
              "ms_per_step": 1e3 * statistics.median(step_times[10:]),
              "tokens_per_s": B * T / statistics.median(step_times[10:]),
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
