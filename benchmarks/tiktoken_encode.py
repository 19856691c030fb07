"""Encode time of a ~100k-token multilingual prompt: specserve's tiktoken.model tokenizer against the `tiktoken`
package's own Encoding with the same ranks and pattern, and a `tokenizers` tokenizer.json (the bundled demo's) on
the same text for the speed class. A measurement, not a test: best of --repeats runs each.

    python benchmarks/tiktoken_encode.py [--tiktoken-dir DIR] [--tokens 100000] [--out results.json]

DIR holds tiktoken.model + tokenizer_config.json (a Kimi-K2/K2.5 repository, say); by default the tiny
Kimi-shaped tokenizer of tests/kimi_repo.py is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    import tiktoken
    from tokenizers import Tokenizer as HFTokenizer

    from specserve.config import DEMO_DIR
    from specserve.engine.tokenizer import Tokenizer

    from kimi_repo import CORPUS, write_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiktoken-dir", type=Path)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    d = args.tiktoken_dir or Path(tempfile.mkdtemp()) / "kimi"
    if args.tiktoken_dir is None:
        write_tokenizer(d)
    ours = Tokenizer(d)
    vocab = ours.tok
    ref = tiktoken.Encoding(
        "reference", pat_str=vocab.enc._pat_str, mergeable_ranks=vocab.ranks, special_tokens=vocab.special_ids
    )
    text = CORPUS
    while len(ours.encode(text)) < args.tokens:
        text += CORPUS
    n = len(ours.encode(text))
    assert ours.encode(text) == ref.encode(text, allowed_special="all")
    t_ours = best_of(lambda: ours.encode(text), args.repeats)
    t_ref = best_of(lambda: ref.encode(text, allowed_special="all"), args.repeats)
    hf = HFTokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    t_hf = best_of(lambda: hf.encode(text, add_special_tokens=False), args.repeats)
    label = str(d) if args.tiktoken_dir else f"tests/kimi_repo.py's tokenizer ({len(vocab.ranks)} ranks)"
    result = {
        "tokenizer": label,
        "chars": len(text),
        "tokens": n,
        "specserve_s": round(t_ours, 4),
        "tiktoken_s": round(t_ref, 4),
        "ratio_vs_tiktoken": round(t_ours / t_ref, 3),
        "tokenizers_demo_s": round(t_hf, 4),
        "tokenizers_demo_tokens": len(hf.encode(text).ids),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
