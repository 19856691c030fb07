#!/usr/bin/env bash
# The MoE speculation benchmark on one H200: the bundled demo pair grown, function-preserving, into a
# Mixtral model shaped like Qwen3-30B-A3B (hidden 2048, 48 layers, 32 query / 4 KV heads of 128,
# 128 experts of 768, top-8; vocabulary padded to Qwen3's 151936; 30.5B parameters, ~57 GiB in bf16)
# with the grown demo drafter, then `specserve bench`: plain decoding, EAGLE-3 chains of 3 and 5
# steps, adaptive K up to 5, at batch 1, 4, 16 and 64.
#
# Too long for one 10-minute call: run the phases as separate calls on one warm machine (the grown
# pair stays in $W between them):
#   PHASE=grow  bash benchmarks/grow_moe_gpu.sh             grow into $W (~3-5 min: 57 GiB written)
#   PHASE=check bash benchmarks/grow_moe_gpu.sh             greedy tokens of the grown target against the
#                                                            demo target's, plain and speculative, bf16
#                                                            (two loads of the grown pair: ~4-6 min)
#   PHASE=bench BATCHES="1 4" bash benchmarks/grow_moe_gpu.sh    ~4-6 min
#   PHASE=bench BATCHES="16 64" bash benchmarks/grow_moe_gpu.sh  ~6-9 min (the reference MoE path runs
#                                                            each chosen expert as its own kernels: at
#                                                            batch 64 nearly all 128 experts, per layer)
#   PHASE=serve bash benchmarks/grow_moe_gpu.sh               the served figure: plain vs adaptive behind
#                                                            `specserve serve`, CONCURRENCY (64) in flight
#                                                            (ADMIT_WAIT=N: both with --admit-wait N)
#   PHASE=probe bash benchmarks/grow_moe_gpu.sh               why adaptive loses where it does: step traces at batch 64
#                                                            and served (64 in flight, ADMIT_WAIT steps), each choice
#                                                            of K > 0 logged, and a profile of prefill chunks (~4 min)
# Results under $OUT (grow_check.json, bench-<batches>.json/.md, online-c<C>-{plain,adaptive}.json).
# Env: PRESET (default qwen3-moe-30b-a3b; mixtral-8x7b needs ~88 GiB of disk: nvidia-h200-x2),
#      LAYERS (fewer layers when the disk is short), W (where the pair is written), CONFIGS, BATCHES.
set -u
. benchmarks/gpu_env.sh
PRESET=${PRESET:-qwen3-moe-30b-a3b}
W=${W:-/tmp/specserve-grown-moe}
PHASE=${PHASE:-grow}
LAYER_FLAG=${LAYERS:+--layers $LAYERS}
date -u
if [ "$PHASE" = grow ]; then
  # bytes of the grown bf16 checkpoint, checked against the free disk before writing it
  need=$(python3 - "$PRESET" "${LAYERS:-}" <<'EOF'
import sys
from specserve.train.shapes import PRESETS
s = PRESETS[sys.argv[1]]
layers = int(sys.argv[2]) if sys.argv[2] else s.layers
attn = 2 * s.hidden * s.heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim
mlp = max(s.experts, 1) * 3 * s.hidden * s.target_intermediate + s.experts * s.hidden
print(2 * (layers * (attn + mlp) + 2 * 151936 * s.hidden) + 2 * 10 * s.hidden * s.intermediate)
EOF
)
  mkdir -p "$(dirname "$W")"
  free=$(df --output=avail -B1 "$(dirname "$W")" | tail -1)
  if [ "$free" -lt "$need" ]; then
    echo "error: the grown $PRESET needs ~$((need >> 30)) GiB but $(dirname "$W") has $((free >> 30)) GiB free;" \
         "set LAYERS (e.g. LAYERS=32) or W to a larger disk" >&2
    exit 1
  fi
  timeout 560 python3 -m specserve grow --preset "$PRESET" $LAYER_FLAG --pad-vocab 151936 --out "$W" --force \
    --device cuda 2>&1 | tail -4
  du -sh "$W"
elif [ "$PHASE" = check ]; then
  [ -f "$W/draft/config.json" ] || { echo "error: no grown pair in $W; run PHASE=grow first on this machine" >&2; exit 1; }
  timeout 560 python3 benchmarks/grow_check.py --preset "$PRESET" --reuse --work "$W" --no-float32 \
    --num-prompts 8 --max-tokens 48 --spec-steps 3 --out "$OUT/grow_check.json" 2>&1 | grep -v -i warn | tail -12
elif [ "$PHASE" = bench ]; then
  [ -f "$W/draft/config.json" ] || { echo "error: no grown pair in $W; run PHASE=grow first on this machine" >&2; exit 1; }
  BATCHES=${BATCHES:-1 4 16 64}
  tag=$(echo "$BATCHES" | tr ' ' '-')
  timeout 570 python3 -m specserve bench --model "$W" --draft "$W/draft" \
    --configs ${CONFIGS:-baseline eagle3:steps=3 eagle3:steps=5 eagle3:adaptive,steps=5} \
    --batch-sizes $BATCHES --num-prompts 2 --max-tokens 64 --warmup 1 --repeats 2 --peers \
    --out "$OUT/bench-$tag.json" --markdown "$OUT/bench-$tag.md" --no-progress 2>&1 | grep -v -i warn | tail -30
elif [ "$PHASE" = serve ]; then
  # The served figure: `specserve serve` loaded by `specserve bench --url` with CONCURRENCY requests in
  # flight (finished ones replaced at once), plain decoding then adaptive K; ~4-6 min (two loads).
  [ -f "$W/draft/config.json" ] || { echo "error: no grown pair in $W; run PHASE=grow first on this machine" >&2; exit 1; }
  C=${CONCURRENCY:-64}
  for mode in plain adaptive; do
    if [ $mode = plain ]; then flags="--spec-steps 0 --no-adaptive"; else flags="--spec-steps ${SPEC_STEPS:-5}"; fi
    python3 -m specserve serve --model "$W" --draft "$W/draft" $flags --max-num-seqs "$C" --port 8101 \
      ${ADMIT_WAIT:+--admit-wait $ADMIT_WAIT} \
      > "$OUT/serve-$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 150); do  # (until /health answers 200: loaded and graphs captured)
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8101/health', timeout=2)" \
        2>/dev/null && break
      sleep 2
    done
    timeout 240 python3 -m specserve bench --url http://127.0.0.1:8101 --concurrency "$C" \
      --num-requests "${REQUESTS:-1024}" --max-tokens 64 --label "$mode" --out "$OUT/online-c$C-$mode.json" 2>&1 \
      | grep -v -i warn | tail -6
    kill -INT $pid; wait $pid
  done
  python3 - "$OUT" "$C" <<'EOF'
import json, sys
out, c = sys.argv[1], sys.argv[2]
tok = {}
for mode in ("plain", "adaptive"):
    r = json.load(open(f"{out}/online-c{c}-{mode}.json"))["results"][0]
    tok[mode] = r["tok_s"]["median"]
    print(f"{mode}: {tok[mode]:.1f} tok/s, acceptance length {r['accept_length'] or '-'}")
print(f"adaptive / plain at {c} in flight: {tok['adaptive'] / tok['plain']:.2f}x")
EOF
elif [ "$PHASE" = probe ]; then
  [ -f "$W/draft/config.json" ] || { echo "error: no grown pair in $W; run PHASE=grow first on this machine" >&2; exit 1; }
  P=specserve/bench/prompts.jsonl
  timeout 150 python3 benchmarks/step_trace.py --model "$W" --draft "$W/draft" --prompts $P --num-prompts 24 \
    --max-tokens 64 --batch 64 --steps 5 --rounds 2 --out "$OUT/trace-b64.json" 2>&1 | grep -v -i warn | tail -12
  timeout 150 python3 benchmarks/step_trace.py --model "$W" --draft "$W/draft" --prompts $P --num-prompts 24 \
    --max-tokens 64 --in-flight 64 --requests 384 --admit-wait "${ADMIT_WAIT:-0}" --steps 5 --rounds 2 \
    --out "$OUT/trace-served-w${ADMIT_WAIT:-0}.json" 2>&1 | grep -v -i warn | tail -12
  timeout 120 python3 benchmarks/prefill_profile.py --model "$W" --shapes 1x512 6x50 10x48 --out "$OUT/prefill.json" \
    2>&1 | grep -v -i warn | tail -50
else
  echo "error: PHASE must be grow, check, bench, serve or probe, got '$PHASE'" >&2
  exit 1
fi
nvidia-smi --query-gpu=index,memory.used --format=csv
date -u
