#!/usr/bin/env bash
# On one GPU, in about 5 minutes:
#  1. tokens/s and MFU of the trainer's step for the gpt2_small preset (12 x 768, block
#     1024, batch 32, bf16 compute): one compilation, then 5 rounds of 10 steps;
#  2. the study's headline comparison on the same preset: adamw, muon, snoo_muon, one seed,
#     STUDY_STEPS (default 150) steps each, written to benchmarks/results/gpu_headline.md;
#  3. SkewAdam's update time against AdamW's on the moe_tiny, moe_10m and dense GPT-2 trees
#     (benchmarks/skewadam_speed.py, under a minute; SKEW_ROUNDS=0 skips it). On XLA:CPU
#     it is 1.1-1.5x (no multi-output fusion); this is where the <= 1.0x target is checked;
#  4. tokens/s and MFU of modded-nanogpt Track 3's step (the track3 preset: the file's
#     12 x 768 network, 8 x 64 x 1024 tokens accumulated, the #36 optimizer, summed loss)
#     on random GPT-2 ids, one compilation then 3 rounds of 3 steps (TRACK3_ROUNDS=0
#     skips it; the machine needs no data or network).
# Attention is the trainer's default choice by backend (--attention=auto: cuDNN's fused
# flash attention where it runs the config, else XLA's); the throughput table's shape
# line and each study run's start-up line print which ran (--attention=xla compares).
# Fails with a message if JAX sees no GPU/TPU.
#
#   bash benchmarks/gpu.sh                                   # both parts
#   bash benchmarks/gpu.sh --optimizer=snoo_muon --batch_size=16
#   STUDY_STEPS=0 SKEW_ROUNDS=0 bash benchmarks/gpu.sh       # throughput only
#
# Extra arguments go to benchmarks/throughput.py (train config keys included). MFU is
# nanoGPT's estimate (6N + 12 L H Q T FLOPs per token) over the device's dense bf16
# peak from train.metrics.PEAK_FLOPS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
STUDY_STEPS="${STUDY_STEPS:-150}"
SKEW_ROUNDS="${SKEW_ROUNDS:-7}"
TRACK3_ROUNDS="${TRACK3_ROUNDS:-3}"
nvidia-smi --query-gpu=name,memory.total,utilization.gpu --format=csv 2>/dev/null || true
"$PYTHON" -m benchmarks.throughput --require_accelerator --preset=gpt2_small \
  --dtypes=bfloat16 --no_reference --rounds=5 --steps=10 --warmup=3 "$@"
if [ "$STUDY_STEPS" -gt 0 ]; then
  "$PYTHON" -m benchmarks.study --preset="gpt2_small@warmup_iters=$((STUDY_STEPS / 10))@eval_iters=10" \
    --optimizers=adamw,muon,snoo_muon --seeds=1 --steps="$STUDY_STEPS" \
    --eval_interval="$(( STUDY_STEPS >= 3 ? STUDY_STEPS / 3 : 1 ))" --name=gpu_headline
fi
if [ "$SKEW_ROUNDS" -gt 0 ]; then
  "$PYTHON" -m benchmarks.skewadam_speed --rounds="$SKEW_ROUNDS" --hlo
fi
if [ "$TRACK3_ROUNDS" -gt 0 ]; then
  "$PYTHON" -m benchmarks.throughput --require_accelerator --preset=track3 \
    --optimizers=track3_baseline --dtypes=bfloat16 --no_reference --vocab=50257 \
    --rounds="$TRACK3_ROUNDS" --steps=3 --warmup=1
fi
