"""Training prompts for the demo drafter on a machine with more Python than the stdlib:
    PYTHONPATH=. python benchmarks/drafter_corpus.py OUT.jsonl [--max-mb 60]
writes {"text"} records from the running interpreter's stdlib (test suites left out, as
build_demo does) plus every top-level package in site-packages except the ones the held-out and
bench code prompts come from (build_demo.HELDOUT_PACKAGES), chosen by a hash of the path up to
--max-mb. The drafter learns the target's continuations of prompts cut from it
(train-draft --regenerate): more varied code than the stdlib alone. (Adding package documentation
as prose and chat questions made from its sentences, for the bench's prose and chat prompts, did
not raise acceptance there: BENCHMARKS.md 12.)"""

from __future__ import annotations

import argparse
import json
import sysconfig
import zlib
from pathlib import Path

from scripts.build_demo import HELDOUT_PACKAGES, TEST_DIR_NAMES, collect_stdlib


def site_package_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["purelib"])
    held = set(HELDOUT_PACKAGES) | {"markupsafe"}  # jinja2's own dependency, close to jinja2's code
    out = []
    for top in sorted(root.iterdir()):
        if (
            not top.is_dir()
            or top.name in held
            or top.name.endswith((".dist-info", ".egg-info"))
            or top.name.startswith(("_", "."))
        ):
            continue
        for p in top.rglob("*.py"):
            rel = p.relative_to(root)
            if not any(part in TEST_DIR_NAMES or part == "__pycache__" for part in rel.parts):
                out.append((rel.as_posix(), p))
    return out


def cap(docs: list[tuple[str, str]], budget: float) -> list[tuple[str, str]]:
    docs = sorted(docs, key=lambda d: zlib.crc32(d[0].encode()))
    out, size = [], 0
    for d in docs:
        if size + len(d[1]) <= budget:
            out.append(d)
            size += len(d[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-mb", type=float, default=60.0)
    args = ap.parse_args()
    docs = [(d.name, d.text) for d in collect_stdlib()]
    for name, p in site_package_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 200 <= len(text) <= 300_000:
            docs.append((name, text))
    code = cap(docs, args.max_mb * 1e6)
    with open(args.out, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for _, t in code)
    size = sum(len(t) for _, t in code) / 1e6
    print(f"drafter corpus: {len(code)} code files ({size:.1f} MB) -> {args.out}")


if __name__ == "__main__":
    main()
