"""Drafter training prompts from the installed ShareGPT package: every human turn of every
conversation past the first --skip (those stay held out: `specserve bench --dataset sharegpt`
reads the first ones), with the conversation before it as chat history, so prompts of all
lengths appear; the target answers each itself (`train-draft --regenerate`). Written as
.jsonl.gz (chat "messages"), small enough to carry to a GPU machine.

    python benchmarks/sharegpt_prompts.py OUT.jsonl.gz [--skip 1000] [--max-chars 4000] [--limit N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.bench.datasets import DATASETS, dataset_file, iter_sharegpt  # noqa: E402

ROLES = {"human": "user", "gpt": "assistant"}


def turn_prompts(conv: dict, max_chars: int):
    """Each human turn with the turns before it, while the whole prompt fits max_chars."""
    history: list[dict] = []
    for t in conv.get("conversations") or []:
        role, text = ROLES.get(t.get("from")), t.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            return  # an unknown speaker or an empty turn: the rest of this conversation is unreliable
        history.append({"role": role, "content": text})
        if role == "user":
            if sum(len(m["content"]) for m in history) > max_chars:
                return
            yield list(history)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--skip", type=int, default=1000, help="conversations held out at the start (the bench's)")
    ap.add_argument("--max-chars", type=int, default=4000, help="longest prompt, history included, in characters")
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    args = ap.parse_args()
    n = convs = 0
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for i, conv in enumerate(iter_sharegpt(dataset_file(DATASETS["sharegpt"]))):
            if i < args.skip:
                continue
            convs += 1
            for msgs in turn_prompts(conv, args.max_chars):
                f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
                n += 1
                if args.limit and n >= args.limit:
                    break
            if args.limit and n >= args.limit:
                break
    print(f"wrote {n} prompts from {convs} conversations to {args.out}")


if __name__ == "__main__":
    main()
