"""What the bench tests share: a character-level tokenizer, the prompt file, the CLI runner and the
report schema's validator. The tiny pair itself is the `bench_pair` fixture (tests/bench/conftest.py)."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest

from specserve.bench import report

try:
    import jsonschema
except ImportError:  # a GPU machine without the test extras still runs the GPU test
    jsonschema = None
SCHEMA = json.loads(report.SCHEMA_PATH.read_text())
needs_jsonschema = pytest.mark.skipif(jsonschema is None, reason="needs jsonschema")


def validate(doc: dict) -> None:
    if jsonschema is None:
        pytest.skip("needs jsonschema")
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)


def write_char_tokenizer(d: Path, vocab: int) -> None:
    """A character-level tokenizer for a tiny target (ids 0 = unk, vocab-1 = eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ([" ", "\n"] + list(string.ascii_letters) + list(string.digits) + list(string.punctuation))[: vocab - 2]
    tok = Tokenizer(
        models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}, "<eos>": vocab - 1}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(d / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))


PROMPTS = [
    {"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):", "category": "code"},
    {"prompt": "for i in range(10):\n    print(i)", "category": "code"},
    {"prompt": "The river rose higher than anyone could remember.", "category": "prose"},
    {"messages": [{"role": "user", "content": "How do I reverse a list?"}], "category": "chat"},
]


def char_tokenizer_96(d: Path) -> None:
    write_char_tokenizer(d, 96)


def run_cli(monkeypatch, argv: list[str]) -> int:
    from specserve.cli import main

    monkeypatch.setattr(sys, "argv", ["specserve"])  # main() rewrites sys.argv; restore it afterwards
    return main(argv)
