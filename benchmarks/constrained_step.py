"""Step time and acceptance with a JSON-schema constraint on half the batch (GPU; runs on CPU too).

For each batch size, three runs of the same prompts through one engine: none constrained, half
constrained (every other request carries the schema), and again none (drift check). Prints one
JSON line per (batch, run): mean wall seconds per engine step over the decode phase, tokens per
second, and the mean acceptance length of the constrained and the unconstrained requests apart.

    python benchmarks/constrained_step.py --model TARGET --draft DRAFTER [--batches 1 16 64] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specserve.constrain.grammar import GrammarSpec
from specserve.engine.llm import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "rating": {"enum": ["good", "fair", "poor"]},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "tags", "rating", "summary"],
    "additionalProperties": False,
}


def run(llm: LLM, batch: int, constrained: bool, max_tokens: int) -> dict:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompts = [f"Describe book number {i} as JSON with title, year, tags, rating and summary." for i in range(batch)]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=False,
            grammar=grammar if constrained and i % 2 == 0 else None,
        )
        for i in range(batch)
    ]
    engine = llm.engine
    seqs = [engine.add_request(llm.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
    times, tokens = [], 0
    while engine.has_work():
        decoding = engine.n_running and not engine.n_prefill and not engine.waiting
        t0 = time.perf_counter()
        out = engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
            tokens += sum(len(s.new_tokens) for s in out)
    accept = {True: [], False: []}
    for s in seqs:
        if s.spec.cycles:
            accept[s.matcher is not None].append(s.spec.accept_length)
    return {
        "batch": batch,
        "constrained_half": constrained,
        "steps": len(times),
        "step_ms": round(1e3 * statistics.fmean(times), 3) if times else None,
        "tok_per_s": round(tokens / sum(times), 1) if times else None,
        "accept_len_constrained": round(statistics.fmean(accept[True]), 3) if accept[True] else None,
        "accept_len_unconstrained": round(statistics.fmean(accept[False]), 3) if accept[False] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        args.draft,
        device=args.device,
        spec_steps=args.k if args.draft else 0,
        max_num_seqs=max(args.batches),
    )
    for batch in args.batches:
        for constrained in (False, True, False):
            print(json.dumps(run(llm, batch, constrained, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
