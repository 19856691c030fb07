"""Write an editing workload for `specserve bench --prompts`: each held-out code prompt of the demo
set (specserve/assets/demo/heldout_prompts.jsonl) followed by an instruction to rewrite it and the
rewrite's first line, so the answer repeats most of the prompt, as code edits and agentic loops do
(where draft-free n-gram / suffix speculation pays).

    python benchmarks/editing_prompts.py benchmarks/results/editing_prompts.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[1] / "specserve" / "assets" / "demo" / "heldout_prompts.jsonl"
EDITS = ["with clearer names", "with type hints", "with a docstring", "keeping its behaviour"]


def main(out: str) -> None:
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    with open(out, "w") as f:
        for i, row in enumerate(r for r in rows if r["category"] == "code"):
            code = row["prompt"].rstrip("\n")
            prompt = f"{code}\n\n# The code above, rewritten {EDITS[i % len(EDITS)]}:\n{code.splitlines()[0]}\n"
            f.write(json.dumps({"prompt": prompt, "category": "edit", "source": row.get("source")}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
