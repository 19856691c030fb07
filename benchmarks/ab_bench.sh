#!/usr/bin/env bash
# Speed A/B of two specserve trees on one GPU, in one call: the checkout (B) against an older tree (A)
# carried in .ab/ (ignored by git). Prepare here, then run on the GPU machine with carry [".ab", ".whl"]:
#   rm -rf .ab && mkdir .ab && git archive REV specserve | tar -x -C .ab
#   bash benchmarks/ab_bench.sh            (results under $OUT: bench-N-SIDE.json, ab.json, log, host.log)
# Both trees bench the same grown 8B pair (grown once, by the checkout) with the same configs, one process
# per run, in the order ORDER. At batch 16 and 64 the figures spread from pass to pass and shift with a
# run's place in the call (the grow step also leaves its output as dirty pages, hence the sync), so the
# default order A B B A gives both sides the same mean place: a drift linear in time cancels in the
# ratio of the geometric means of each side's runs. Plan the call from what one run costs: its loading
# (two engines for the default configs) plus one pass per warm-up and repeat.
# Knobs (environment): ORDER, PROMPTS (per category), TOKENS, WARMUP, REPEATS, CONFIGS, BATCHES,
# BENCH_TIMEOUT (seconds per run). ab.json lists, per config and batch size, each run's median tok/s and
# the ratio B/A of the geometric means of the run medians.
set -u
. benchmarks/gpu_env.sh >/dev/null 2>&1
W=/tmp/specserve-grown
[ -d .ab/specserve ] || { echo "no .ab/specserve: see the header of this script"; exit 2; }
# Host state every 5 s (load, dirty pages, free memory) and GPU clocks/power, to tell drift from code.
(while sleep 5; do echo "$(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" \
   "$(grep -E '^(MemFree|Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')" \
   "gpu $(nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
          --format=csv,noheader 2>/dev/null)"; done) >"$OUT/host.log" 2>&1 &
MON=$!
trap 'kill $MON 2>/dev/null' EXIT
date -u; nproc; grep -E '^MemTotal' /proc/meminfo; df -h /tmp | tail -1
if [ ! -f $W/config.json ]; then
  t0=$(date +%s)
  timeout 150 python3 -m specserve grow --preset llama3-8b --pad-vocab 128256 --out $W --device cuda 2>&1 | tail -2
  t1=$(date +%s); timeout 120 sync; echo "grow $((t1 - t0)) s, sync $(($(date +%s) - t1)) s"
fi
CONFIGS=${CONFIGS:-baseline eagle3:steps=5 eagle3:steps=8,topk=4,tokens=31 eagle3:adaptive,steps=8,topk=4,tokens=31}
n=0
for side in ${ORDER:-A B B A}; do
  n=$((n + 1))
  # The older tree writes its JSON with --json FILE, the checkout with --out FILE.
  if [ $side = A ]; then tree=$PWD/.ab; flag=--json; else tree=$PWD; flag=--out; fi
  echo "== run $n side $side $(date -u +%T)"
  # run from inside the tree: `python -m` puts the working directory first on sys.path
  (cd $tree && PYTHONPATH=$tree:${PYTHONPATH} timeout ${BENCH_TIMEOUT:-200} python3 -m specserve bench --model $W \
    --draft $W/draft --configs $CONFIGS --batch-sizes ${BATCHES:-1 16 64} --num-prompts ${PROMPTS:-2} \
    --max-tokens ${TOKENS:-64} --warmup ${WARMUP:-1} --repeats ${REPEATS:-3} --peers --no-progress \
    $flag "$OUT/bench-$n-$side.json") 2>&1 | grep -v -i warn | tail -3
done
python3 - "$OUT" <<'PY'
import glob, json, math, re, statistics, sys
out = sys.argv[1]
runs = {}  # (config, batch) -> [(run number, side, median tok/s)]
for f in sorted(glob.glob(f"{out}/bench-*-*.json"), key=lambda f: int(re.search(r"bench-(\d+)-", f)[1])):
    n, side = re.search(r"bench-(\d+)-([AB])\.json$", f).groups()
    d = json.load(open(f))
    for row in d["results"]:
        if row.get("tok_s"):
            runs.setdefault((row["config"], row["batch_size"]), []).append(
                {"run": int(n), "side": side, "median": statistics.median(row["tok_s"]["values"]),
                 "values": row["tok_s"]["values"], "wall_s": d.get("wall_s"), "load_s": d.get("load_s")})

def gmean(xs):
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")

rows = []
for (cfg, b), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    a = gmean([r["median"] for r in rs if r["side"] == "A"])
    bb = gmean([r["median"] for r in rs if r["side"] == "B"])
    rows.append({"config": cfg, "batch_size": b, "A_tok_s": a, "B_tok_s": bb, "ratio": bb / a, "runs": rs})
json.dump({"rows": rows}, open(f"{out}/ab.json", "w"), indent=1)
print(f"{'config':44s} {'B':>4s} {'A tok/s':>9s} {'B tok/s':>9s} {'B/A':>6s}  run medians (side)")
for r in rows:
    each = " ".join(f"{x['median']:.0f}{x['side']}" for x in r["runs"])
    print(f"{r['config']:44s} {r['batch_size']:4d} {r['A_tok_s']:9.1f} {r['B_tok_s']:9.1f} {r['ratio']:6.3f}  {each}")
PY
date -u
