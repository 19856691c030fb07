#!/usr/bin/env bash
# Paged KV on one GPU, in one call: GPU tests of the paged kernels, the shared-prefix workload
# (benchmarks/prefix_bench.py) on the grown 8B pair, and decode speed against the tree before
# paging carried in .ab/ (prepare: rm -rf .ab && mkdir .ab && git archive REV specserve
# ':(exclude)specserve/assets' | tar -x -C .ab; run with carry [".ab", ".whl"]).
set -u
. benchmarks/gpu_env.sh >/dev/null 2>&1
W=/tmp/specserve-grown
date -u
[ -f $W/config.json ] || timeout 150 python3 -m specserve grow --preset llama3-8b --pad-vocab 128256 --out $W --device cuda 2>&1 | tail -1
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -m gpu ${GPU_TESTS:-tests/engine/test_paged.py tests/spec/test_speculative.py tests/kernels/test_kernels.py} 2>&1 | tail -3
timeout ${PREFIX_TIMEOUT:-170} python3 benchmarks/prefix_bench.py --model $W --draft $W/draft --gpu-memory-utilization 0.9 --max-model-len 2048 --prefix-tokens 1900 \
  --fit-lengths 32768 131072 --out $OUT/prefix.json 2>&1 | grep -v -i warn | tail -6
for side in ${ORDER:-B A}; do
  if [ $side = A ]; then tree=$PWD/.ab; else tree=$PWD; fi
  (cd $tree && PYTHONPATH=$tree:${PYTHONPATH} timeout 120 python3 -m specserve bench --model $W --draft $W/draft \
    --configs baseline eagle3:steps=5 --batch-sizes 1 16 64 --num-prompts 2 --max-tokens 64 --warmup 2 --repeats 3 \
    --no-progress --out "$OUT/bench-$side.json") 2>&1 | grep -v -i warn | tail -1
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = {}
for side in "AB":
    try:
        for r in json.load(open(f"{sys.argv[1]}/bench-{side}.json"))["results"]:
            if r.get("tok_s"):
                rows.setdefault((r["config"], r["batch_size"]), {})[side] = r["tok_s"]["median"]
    except OSError:
        pass
for (c, b), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{c:24s} {b:4d}  slot {v.get('A', float('nan')):9.1f}  paged {v.get('B', float('nan')):9.1f}  "
          f"paged/slot {v.get('B', float('nan')) / v.get('A', float('nan')):.3f}")
PY
date -u
