"""Instruction prompts written by the target itself, for drafter training in its own domain.

A chat model continues its chat template up to the start of a user turn with a user's request,
in the style of the requests it was tuned on (the Magpie recipe): sampled, that gives as many
instruction prompts as wanted with no dataset, and `specserve train-draft --regenerate` then has
the target answer them. ShareGPT alone trains a drafter that agrees far less on MT-Bench-style
requests than on ShareGPT ones (BENCHMARKS.md 4); these prompts cover that domain. Written as
.jsonl(.gz) of chat "messages" records, the format train-draft reads.

    python benchmarks/synth_prompts.py --model smollm2-135m-instruct OUT.jsonl.gz [--count N]
        [--max-tokens 128] [--temperature 1.0] [--seed 0] [--device auto] [--batch 1024]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARK = "@@specserve-user-text@@"


def user_prefix(tok) -> list[int]:
    """The chat template's text before a first user turn's content (system prompt included)."""
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=False)
    if MARK not in text:
        raise SystemExit("error: the chat template does not show a user turn's content; cannot synthesize prompts")
    return tok.encode(text[: text.index(MARK)])


def synthesize(
    model: str, count: int, max_tokens: int, temperature: float, seed: int, device: str, batch: int
) -> list[str]:
    """Up to `count` distinct user requests the target writes itself; unfinished ones (no end of
    turn within `max_tokens`) and very short ones are dropped."""
    from specserve.engine.tokenizer import Tokenizer
    from specserve.model.catalog import known_model_path
    from specserve.train.train_draft import regenerate_samples

    path = str(known_model_path(model) or model)
    tok = Tokenizer(path)
    prefix = user_prefix(tok)
    ends = set(tok.eos_token_ids) | ({tok.end_of_turn_id} if tok.end_of_turn_id is not None else set())
    samples, _ = regenerate_samples(path, [prefix] * count, max_tokens, temperature, seed, device, batch, None, ends)
    seen, out = set(), []
    for ids in samples:
        request = ids[len(prefix) :]
        if not request or request[-1] not in ends:
            continue
        text = tok.decode(request, skip_special_tokens=True).strip()
        if len(text) >= 8 and text.casefold() not in seen:
            seen.add(text.casefold())
            out.append(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output .jsonl or .jsonl.gz")
    ap.add_argument("--model", required=True, help="a chat model: folder, .gguf or a known name")
    ap.add_argument("--count", type=int, default=20000, help="requests to sample (distinct finished ones are kept)")
    ap.add_argument("--max-tokens", type=int, default=128, help="longest request in tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (as the engine takes it)")
    ap.add_argument("--batch", type=int, default=1024, help="requests sampled at once")
    args = ap.parse_args()
    if args.count < 1 or args.max_tokens < 1 or args.temperature <= 0:
        ap.error("--count and --max-tokens must be >= 1 and --temperature > 0 (a greedy request is one request)")
    texts = synthesize(args.model, args.count, args.max_tokens, args.temperature, args.seed, args.device, args.batch)
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n")
    print(f"wrote {len(texts)} distinct requests of {args.count} sampled to {args.out}")


if __name__ == "__main__":
    main()
