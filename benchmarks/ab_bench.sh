#!/usr/bin/env bash
# Speed A/B of two specserve trees on one GPU, in one call: the checkout (B) against an older tree (A)
# carried in .ab/ (ignored by git). Prepare here, then run on the GPU machine with carry [".ab", ".whl"]:
#   rm -rf .ab && mkdir .ab && git archive REV specserve | tar -x -C .ab
#   bash benchmarks/ab_bench.sh            (results under $OUT: bench-A-*.json, bench-B-*.json, ab.json)
# Both trees bench the same grown 8B pair (grown once, by the checkout) with the same configs; the runs
# alternate A, B, A, B ... (ROUNDS pairs) so drift of the machine falls on both. ab.json lists, per config
# and batch size, the median tok/s of each side over all its repeats and the ratio B/A.
set -u
. benchmarks/gpu_env.sh >/dev/null 2>&1
W=/tmp/specserve-grown
[ -d .ab/specserve ] || { echo "no .ab/specserve: see the header of this script"; exit 2; }
date -u
[ -f $W/config.json ] || timeout 150 python3 -m specserve grow --preset llama3-8b --pad-vocab 128256 --out $W --device cuda 2>&1 | tail -2
CONFIGS=${CONFIGS:-baseline eagle3:steps=5 eagle3:steps=8,topk=4,tokens=31 eagle3:adaptive,steps=8,topk=4,tokens=31}
B_JSON_FLAG=${B_JSON_FLAG:---out}  # the old tree writes its JSON with --json FILE
for r in $(seq 1 ${ROUNDS:-1}); do
  for side in ${SIDES:-A B}; do
    if [ $side = A ]; then tree=$PWD/.ab; flag=--json; else tree=$PWD; flag=$B_JSON_FLAG; fi
    echo "== round $r side $side"
    # run from inside the tree: `python -m` puts the working directory first on sys.path
    (cd $tree && PYTHONPATH=$tree:${PYTHONPATH} timeout ${BENCH_TIMEOUT:-200} python3 -m specserve bench --model $W --draft $W/draft \
      --configs $CONFIGS --batch-sizes ${BATCHES:-1 16 64} --num-prompts 2 --max-tokens 64 --warmup 2 \
      --repeats ${REPEATS:-4} --peers --no-progress $flag "$OUT/bench-$side-$r.json") 2>&1 | grep -v -i warn | tail -4
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
vals = {}
for side in "AB":
    for f in sorted(glob.glob(f"{out}/bench-{side}-*.json")):
        for row in json.load(open(f))["results"]:
            if row.get("tok_s"):
                vals.setdefault((row["config"], row["batch_size"]), {}).setdefault(side, []).extend(row["tok_s"]["values"])
rows = []
for (cfg, b), v in sorted(vals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    a, bb = statistics.median(v.get("A", [float("nan")])), statistics.median(v.get("B", [float("nan")]))
    rows.append({"config": cfg, "batch_size": b, "A_tok_s": a, "B_tok_s": bb, "ratio": bb / a, "A_values": v.get("A"), "B_values": v.get("B")})
json.dump({"rows": rows}, open(f"{out}/ab.json", "w"), indent=1)
print(f"{'config':44s} {'B':>4s} {'A tok/s':>9s} {'B tok/s':>9s} {'B/A':>6s}")
for r in rows:
    print(f"{r['config']:44s} {r['batch_size']:4d} {r['A_tok_s']:9.1f} {r['B_tok_s']:9.1f} {r['ratio']:6.3f}")
PY
date -u
