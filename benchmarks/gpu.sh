#!/usr/bin/env bash
# Tokens/s and MFU of the trainer's step for the gpt2_small preset (12 x 768, block 1024,
# batch 32, bf16 compute) on one GPU, in well under 5 minutes (one compilation, then
# 5 rounds of 10 steps). Fails with a message if JAX sees no GPU/TPU.
#
#   bash benchmarks/gpu.sh                      # adamw
#   bash benchmarks/gpu.sh --optimizer=snoo_muon --batch_size=16
#
# Extra arguments go to benchmarks/throughput.py (train config keys included). MFU is
# nanoGPT's estimate (6N + 12 L H Q T FLOPs per token) over the device's dense bf16
# peak from train.metrics.PEAK_FLOPS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
nvidia-smi --query-gpu=name,memory.total,utilization.gpu --format=csv 2>/dev/null || true
exec "$PYTHON" -m benchmarks.throughput --require_accelerator --preset=gpt2_small \
  --dtypes=bfloat16 --no_reference --rounds=5 --steps=10 --warmup=3 "$@"
