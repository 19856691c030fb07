#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct drafter on one GPU and bench it:
#   bash benchmarks/gpu_smol_drafter.sh   (results under $OUT; ~MINUTES + 3 minutes; SKIP_BENCH=1 stops after training)
# The GGUF (98 MB) and the prompts (~11 MB) are more than one call carries (64 MiB with the tree), so they
# travel in pieces on consecutive calls while the machine stays warm (each earlier call only copies its piece
# to /tmp), and are put together here (GGUF=a whole file already there; PARTS=the pieces in order; SHA=its
# sha256; `bash benchmarks/smol_pieces.sh` cuts them); FROM=an earlier drafter to fine-tune. The call sends the session's own checkout.
# Prompts: DATA, chat "messages" records (`python benchmarks/sharegpt_prompts.py OUT.jsonl.gz`: every ShareGPT
# human turn with its history, the bench's first conversations held out), answered by the target itself through
# its chat template (--regenerate); the loss scores the responses only. Regeneration may answer for REGEN_SHARE (0.5) of MINUTES from when it starts; a run
# cut short keeps prompts of every length, and the log says so ("regeneration time is up").
# Bench: MT-Bench and HumanEval (BENCH_DATA), batch 1 and 16, PEERS=hf adds transformers' generate(). The drafter comes back in $OUT/draft
# (config.json + model.safetensors + training_summary.json).
# A run longer than one call: WORK=a folder under /tmp (it persists while the machine stays warm).
# The run lives there (regenerated samples, checkpoint); each call resumes it where the last one
# stopped (the first regenerates), trains for MINUTES, keeps its checkpoint and sends the drafter
# back (a fine-tune's calls may all pass FROM, or only the first: the checkpoint holds the drafter); LR_MINUTES=the training minutes of all calls together, which one lr cosine spans. Calls
# before the last take SKIP_BENCH=1. VAL_SAMPLES=N holds the last N regenerated samples out of training
# and reports the drafter's agreement and acceptance length on them after each call (the log's
# "validation" line; training_summary.json's val_*): the drafter on unseen prompts of its own kind.
set -u
. benchmarks/gpu_env.sh
MINUTES=${MINUTES:-6}
GGUF=${GGUF:-/tmp/smol.gguf}
if [ ! -s "$GGUF" ]; then
  cat ${PARTS:-/tmp/smolpart.*} > "$GGUF" || exit 1
fi
if [ -n "${SHA:-}" ] && ! echo "$SHA  $GGUF" | sha256sum -c --quiet; then
  echo "error: $GGUF does not match sha256 $SHA (a piece missing?)"; rm -f "$GGUF"; exit 1
fi
DRAFT="$OUT/draft"
RUN_FLAGS=()
if [ -n "${WORK:-}" ]; then
  DRAFT="$WORK/draft"
  RUN_FLAGS=(--keep-checkpoint ${LR_MINUTES:+--lr-minutes "$LR_MINUTES"})
  [ -d "$DRAFT/checkpoint" ] && RUN_FLAGS+=(--resume) && echo "resuming $DRAFT"
fi
date -u
timeout $(( ${MINUTES%.*} * 60 + 150 )) python3 -m specserve train-draft --model "$GGUF" \
  --data "${DATA:-.device/sharegpt-turns.jsonl.gz}" --regenerate --regen-prompts "${PROMPTS:-24000}" \
  --regen-batch 1024 --regen-max-tokens "${REGEN_TOKENS:-256}" --regen-share "${REGEN_SHARE:-0.5}" \
  --draft-vocab "${VOCAB:-6144}" --draft-intermediate "${INTER:-768}" --ttt-steps "${TTT:-5}" \
  --batch-tokens "${BATCH_TOKENS:-16384}" --max-len "${MAX_LEN:-1024}" --epochs 1000 --lr "${LR:-2e-3}" \
  ${FROM:+--from "$FROM"} ${VAL_SAMPLES:+--val-samples "$VAL_SAMPLES"} --max-minutes "$MINUTES" --device cuda \
  --seed "${SEED:-0}" --out "$DRAFT" ${RUN_FLAGS[@]+"${RUN_FLAGS[@]}"} \
  > "$OUT/train.log" 2>&1
sed 's/\r/\n/g' "$OUT/train.log" | grep -v "step/s\]\|prompt/s\]" | grep -i "samples\|validation\|vocabulary\|training:\|budget\|resuming\|regeneration\|wrote\|error" | cut -c1-220
sed 's/\r/\n/g' "$OUT/train.log" | grep "step/s\]" | tail -1 | cut -c1-220
if [ -n "${WORK:-}" ]; then
  mkdir -p "$OUT/draft" && cp "$DRAFT"/*.json "$DRAFT/model.safetensors" "$OUT/draft/" || exit 1
else
  rm -rf "$OUT/draft/checkpoint"
fi
[ -s "$OUT/draft/model.safetensors" ] || exit 1
[ -n "${SKIP_BENCH:-}" ] && exit 0
date -u
timeout "${BENCH_SECONDS:-240}" python3 -m specserve bench --model "$GGUF" --draft "$OUT/draft" \
  --dataset ${BENCH_DATA:-.device/mt-bench.jsonl .device/humaneval.jsonl} \
  --configs ${CONFIGS:-baseline eagle3:steps=1 eagle3:steps=2 eagle3:steps=4 eagle3:adaptive,steps=6} \
  --batch-sizes ${BATCHES:-1 16} --num-prompts "${NUM_PROMPTS:-16}" --max-tokens 128 --warmup 1 --repeats 2 \
  --peers ${PEERS:-} --out "$OUT/bench.json" --markdown "$OUT/bench.md" --no-progress > "$OUT/bench.log" 2>&1
grep "^| " "$OUT/bench.md" | head -40
tail -3 "$OUT/bench.log"
date -u
