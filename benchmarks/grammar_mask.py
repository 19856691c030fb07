"""Per-token mask time of the grammar engines (xgrammar, llguidance) on this CPU.

A JSON schema of moderate size (nested objects, arrays, enums, numbers, strings) is compiled
for vocabularies of 49k (SmolLM2's real byte-level vocabulary), 128k and 164k (that vocabulary
grown with BPE-like merges of its own tokens), and a valid document is walked token by token:
each step times the fill of the next-token bitmask after accepting the previous token (the work
a decode step waits for). Prints one JSON line per (engine, vocabulary): compile seconds and the
mean / p50 / p90 / max mask microseconds.

    python benchmarks/grammar_mask.py [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["id", "name", "role", "active", "tags", "address", "orders"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": 4217,
    "name": "Ada Lovelace",
    "email": "ada@example.com",
    "role": "editor",
    "score": 97.5,
    "active": True,
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "orders": [{"sku": "AE-1", "qty": 2, "price": 19.99}, {"sku": "DE-7", "qty": 1, "price": 5.0}],
}


def smollm2_vocab() -> tuple[list[bytes], int]:
    from specserve.engine.tokenizer import Tokenizer
    from specserve.model.gguf import find_gguf

    tok = Tokenizer(find_gguf("smollm2-135m-instruct").parent)
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    return vocab, min(tok.eos_token_ids)


def grown(vocab: list[bytes], size: int, seed: int = 0) -> list[bytes]:
    """The vocabulary grown to `size` distinct tokens by concatenating pairs of its tokens."""
    rng = random.Random(seed)
    seen, out = set(vocab), list(vocab)
    short = [t for t in vocab if 1 <= len(t) <= 6]
    while len(out) < size:
        t = rng.choice(short) + rng.choice(short)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def greedy_tokens(vocab: list[bytes], text: bytes) -> list[int]:
    """Longest-match tokenization of `text` (any valid token path will do for timing)."""
    index = {t: i for i, t in enumerate(vocab)}
    longest = max(len(t) for t in vocab)
    ids, i = [], 0
    while i < len(text):
        for n in range(min(longest, len(text) - i), 0, -1):
            if text[i : i + n] in index:
                ids.append(index[text[i : i + n]])
                i += n
                break
        else:
            raise ValueError(f"byte {text[i]!r} is not a token")
    return ids


def summarize(name: str, V: int, compile_s: float, times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {
        "engine": name,
        "vocab": V,
        "compile_s": round(compile_s, 3),
        "tokens": len(us),
        "mask_us_mean": round(statistics.fmean(us), 1),
        "mask_us_p50": round(us[len(us) // 2], 1),
        "mask_us_p90": round(us[int(len(us) * 0.9)], 1),
        "mask_us_max": round(us[-1], 1),
    }


def time_xgrammar(vocab: list[bytes], eos: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(tok), f"xgrammar refused token {tok} {vocab[tok]!r}"
    return summarize("xgrammar", len(vocab), compile_s, times)


def time_llguidance(vocab: list[bytes], eos: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    class Raw:
        eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, vocab, [eos]

        def __call__(self, s: bytes) -> list[int]:
            return greedy_tokens(vocab, s)

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Raw()))
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, len(vocab))
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(tok), f"llguidance refused token {tok} {vocab[tok]!r}: {matcher.get_error()}"
    return summarize("llguidance", len(vocab), compile_s, times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", default="49152,128256,163840")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base, eos = smollm2_vocab()
    text = json.dumps(DOCUMENT).encode()
    for V in (int(v) for v in args.vocabs.split(",")):
        vocab = grown(base, V) if V > len(base) else base
        ids = greedy_tokens(vocab, text)
        for run in (time_xgrammar, time_llguidance):
            print(json.dumps(run(vocab, eos, ids)), flush=True)


if __name__ == "__main__":
    main()
