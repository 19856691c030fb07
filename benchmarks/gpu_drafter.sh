#!/usr/bin/env bash
# Train the demo drafter on one GPU, then measure it on the grown 8B pair (issue 9), in one call:
#   bash benchmarks/gpu_drafter.sh   (results under $OUT; ~MINUTES + 5 minutes: the 5-minute default
#   fits one 10-minute call; the bundled drafter came from MINUTES=7 SKIP_BENCH=1)
# 1. specserve train-draft on the bundled target: the target's own continuations of prompts cut
#    from the GPU machine's Python code (benchmarks/drafter_corpus.py: stdlib + site-packages minus
#    the held-out packages; or DATA=path: a .npy token stream / .jsonl made elsewhere, trained on
#    as it is), FROM=dir fine-tunes an existing drafter instead;
# 2. held-out acceptance at K=4 and 6 (bf16; EVAL_STEPS=4,6,8 for others), written into the log;
#    (INTER, VOCAB, TTT, AUX=i,j,k (the target layers feeding the drafter), LR, SEED set the recipe)
# 3. grow the target with the new drafter to the Llama-3-8B shape and bench it at batch 1-64
#    (skipped with SKIP_BENCH=1).
# The drafter comes back in $OUT/draft (config.json + model.safetensors, ~2 MB).
set -u
. benchmarks/gpu_env.sh
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-5}
date -u
if [ -n "${DATA:-}" ]; then
  SRC=(--data "$DATA")
else
  CORPUS=${CORPUS:-/tmp/drafter-corpus.jsonl}
  [ -s "$CORPUS" ] || python3 benchmarks/drafter_corpus.py "$CORPUS" --max-mb 60
  SRC=(--data "$CORPUS" --regenerate --regen-prompts "${PROMPTS:-100000}" --regen-batch 1024 --regen-max-tokens 320
       --regen-share "${REGEN_SHARE:-0.4}")
fi
if [ -n "${FROM:-}" ]; then
  SHAPE=(--from "$FROM" --lr "${LR:-1e-3}")
else
  SHAPE=(--draft-vocab "${VOCAB:-2048}" --draft-intermediate "${INTER:-1792}" --lr "${LR:-4e-3}")
  [ -n "${AUX:-}" ] && SHAPE+=(--aux-layer-ids "$AUX")
fi
timeout $(( ${MINUTES%.*} * 60 + 120 )) python3 -m specserve train-draft --model specserve/assets/demo \
  "${SRC[@]}" "${SHAPE[@]}" --out "$OUT/draft" --ttt-steps "${TTT:-5}" --batch-tokens 16384 --max-len 512 \
  --max-minutes "$MINUTES" --epochs 1000 --device "$DEVICE" --seed "${SEED:-0}" \
  --eval-prompts specserve/assets/demo/heldout_prompts.jsonl --eval-spec-steps "${EVAL_STEPS:-4,6}" > "$OUT/train.log" 2>&1
sed 's/\r/\n/g' "$OUT/train.log" | grep -v "step/s\]\|prompt/s\]" | grep -i "samples\|held-out\|wrote\|error" | cut -c1-200
rm -rf "$OUT/draft/checkpoint"
[ "${SKIP_BENCH:-0}" = 1 ] && { date -u; exit 0; }
W=/tmp/specserve-grown-new
timeout 90 python3 -m specserve grow --draft "$OUT/draft" --preset llama3-8b --pad-vocab 128256 --out $W --force \
  --device "$DEVICE" 2>&1 | tail -1
timeout 240 python3 -m specserve bench --model $W --draft $W/draft \
  --configs ${CONFIGS:-baseline eagle3:steps=4 eagle3:steps=6 eagle3:steps=6,topk=8,tokens=48 eagle3:adaptive,steps=6,topk=8,tokens=48} \
  --batch-sizes ${BATCHES:-1 4 16 64} --num-prompts 2 --max-tokens 64 --warmup 1 --repeats 2 \
  --out "$OUT/bench.json" --markdown "$OUT/bench.md" --no-progress > "$OUT/bench.log" 2>&1
grep "^| " "$OUT/bench.md" | head -24
date -u
