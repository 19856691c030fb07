#!/usr/bin/env bash
# The 8B-class run (issue 9) plus the supervisor demonstration (issue 8), one call on one H200:
#   bash benchmarks/gpu_scale.sh            (results under $OUT)
# 1. grow the bundled demo pair to the Llama-3.1-8B shape (vocab padded to 128256) and check that
#    the grown target's greedy tokens agree with the small target's;
# 2. specserve bench on the grown pair: baseline, eagle3 chains of 1..6 steps, the tree (8 steps, top-4,
#    31 nodes) fixed and adaptive, batch 1/4/16/64,
#    transformers peers, profile + cost model;
# 3. with LAUNCH=1 (then over 10 minutes in all: run it as its own call after the others, with
#    SKIP_GROW_CHECK=1): specserve launch supervising a real `specserve serve` of the grown pair with
#    a ready-timeout shorter than its start-up: killed during CUDA graph capture, GPU memory checked.
# Timeouts fit one 10-minute call on a fresh machine (cold Triton cache: the bench's engine start-up
# then compiles its GEMV candidates, ~1 min).
set -u
. benchmarks/gpu_env.sh
W=/tmp/specserve-grown
date -u
if [ "${SKIP_GROW_CHECK:-0}" = 1 ]; then
  timeout 120 python3 -m specserve grow --preset llama3-8b --pad-vocab 128256 --out $W --device cuda 2>&1 | tail -3
else
  timeout 190 python3 benchmarks/grow_check.py --preset llama3-8b --pad-vocab 128256 --work $W \
    --num-prompts 24 --max-tokens 64 --out "$OUT/grow_check.json" 2>&1 | grep -v -i warn | tail -12
fi
timeout 380 python3 -m specserve bench --model $W --draft $W/draft \
  --configs ${CONFIGS:-baseline eagle3:steps=1 eagle3:steps=2 eagle3:steps=3 eagle3:steps=4 eagle3:steps=5 eagle3:steps=6 eagle3:steps=8,topk=4,tokens=31 eagle3:adaptive,steps=8,topk=4,tokens=31} \
  --batch-sizes ${BATCHES:-1 4 16 64} --num-prompts 2 --max-tokens 64 --warmup 1 --repeats 2 --peers ${PEERS-hf hf-assisted} \
  --out "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png" --no-progress 2>&1 | grep -v -i warn | tail -45
nvidia-smi --query-gpu=index,memory.used --format=csv
[ "${LAUNCH:-0}" = 1 ] || { date -u; exit 0; }
timeout 90 python3 -m specserve launch --ready-timeout 12 --stall-timeout 60 --log "$OUT/launch.log" -- \
  python3 -m specserve serve --model $W --draft $W/draft --port 18123 2>&1 | tail -25
echo "launch exit code: ${PIPESTATUS[0]}"
nvidia-smi --query-gpu=index,memory.used --format=csv
date -u
