"""Reading drafter training data.

`--data PATH` may be

- a ``.jsonl`` file (or ``.jsonl.gz``), one record per line, each with a ``"text"`` string or
  a chat ``"messages"`` list (``[{"role": ..., "content": ...}, ...]``);
- a ``.txt`` (or any other text) file: the whole file is one document;
- a ``.npy`` token stream (1-D integers, documents separated by the EOS id), as
  ``scripts/build_demo.py`` writes for the stdlib corpus;
- a folder: every file below it with one of the extensions above or a source-code
  extension, in sorted path order.

Records come back as `Record`s; `tokenize_records` turns them into token-id lists with
the target's tokenizer (chat records through its chat template).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

# Plain-text files read when --data is a folder (besides .jsonl and .npy).
TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".pyi",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".rs",
    ".go",
    ".js",
    ".ts",
    ".java",
    ".sh",
    ".json",
    ".toml",
    ".yaml",
    ".yml",
    ".html",
    ".css",
}


class DataError(ValueError):
    """Unusable training data; the message says which file/line and why."""


@dataclass
class Record:
    text: str | None = None
    messages: list[dict] | None = None
    ids: list[int] | None = None  # already tokenized (from a .npy stream)
    source: str = ""


def check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'{where}: messages[{i}] must be an object with string "role" and "content"')
    return msgs


def read_jsonl(path: Path) -> list[Record]:
    out = []
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f'{where}: each line must be a JSON object with "text" or "messages"')
            if "messages" in obj:
                out.append(Record(messages=check_messages(obj["messages"], where), source=where))
            elif "text" in obj:
                if not isinstance(obj["text"], str):
                    raise DataError(f'{where}: "text" must be a string')
                if obj["text"]:
                    out.append(Record(text=obj["text"], source=where))
            else:
                raise DataError(f'{where}: record has neither "text" nor "messages" (keys: {sorted(obj)})')
    return out


def read_token_stream(path: Path, eos_id: int | None) -> list[Record]:
    """A 1-D integer array; documents end at eos_id (which stays at each document's end)."""
    import numpy as np

    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(f"{path}: expected a 1-D integer token array, got {arr.dtype} with shape {arr.shape}")
    if eos_id is None:
        return [Record(ids=arr.astype(np.int64).tolist(), source=str(path))]
    ends = np.flatnonzero(arr == eos_id)
    out, start = [], 0
    for e in [*ends.tolist(), len(arr) - 1]:
        if e >= start:
            out.append(Record(ids=arr[start : e + 1].astype(np.int64).tolist(), source=f"{path}@{start}"))
        start = e + 1
    return out


def read_text_file(path: Path) -> list[Record]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    return [Record(text=text, source=str(path))] if text.strip() else []


def read_records(path: str | Path, eos_id: int | None = None) -> list[Record]:
    """All records under `path` (see the module docstring). Raises DataError when there are none."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and (p.suffix in TEXT_SUFFIXES or p.suffix in (".jsonl", ".npy") or p.name.endswith(".jsonl.gz"))
        )
        if not files:
            raise DataError(f"--data {path}: folder has no .jsonl, .jsonl.gz, .npy or text files")
        records = []
        for f in files:
            try:
                records += read_records(f, eos_id)
            except DataError:
                if f.suffix in (".jsonl", ".npy") or f.name.endswith(".jsonl.gz"):
                    raise
                continue  # a stray binary/non-UTF-8 source file in a folder: skip it
    elif path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        records = read_jsonl(path)
    elif path.suffix == ".npy":
        records = read_token_stream(path, eos_id)
    else:
        records = read_text_file(path)
    if not records:
        raise DataError(f"--data {path}: no usable records (empty text?)")
    return records


def tokenize_records(records: list[Record], tokenizer, eos_id: int | None) -> list[list[int]]:
    """Token ids per record. Plain text gets the EOS appended (the way pre-training streams
    separate documents); chat records are rendered by the tokenizer's chat template."""
    out = []
    for r in records:
        if r.ids is not None:
            ids = list(r.ids)
        elif r.messages is not None:
            try:
                ids = tokenizer.encode(tokenizer.apply_chat_template(r.messages, add_generation_prompt=False))
            except Exception as e:  # noqa: BLE001 - template errors come in many types
                raise DataError(f"{r.source}: chat template failed: {e}") from None
        else:
            ids = tokenizer.encode(r.text)
            if eos_id is not None:
                ids.append(eos_id)
        if len(ids) >= 2:
            out.append(ids)
    return out


def chat_prompt(record: Record, tokenizer) -> list[int] | None:
    """The prompt for regenerating a chat record's last assistant turn: every message
    before it, rendered with the generation prompt. None when there is no user turn."""
    msgs = record.messages or []
    cut = len(msgs)
    while cut > 0 and msgs[cut - 1]["role"] == "assistant":
        cut -= 1
    if cut == 0:
        return None
    return tokenizer.encode(tokenizer.apply_chat_template(msgs[:cut], add_generation_prompt=True))


def split_long(
    docs: list[list[int]], max_len: int, starts: list[int] | None = None, min_len: int = 8
) -> tuple[list[list[int]], list[int]]:
    """Cut documents into pieces of at most max_len tokens (each piece starts at position 0
    when trained, like a fresh request). starts[i]: the first of document i's tokens that the
    loss scores (a regenerated sample's response; the prompt before it is context only; default 0).
    Returns the pieces and each piece's own start."""
    out, out_starts = [], []
    for n, d in enumerate(docs):
        s = starts[n] if starts is not None else 0
        for i in range(0, len(d), max_len):
            piece = d[i : i + max_len]
            if len(piece) >= min_len and s - i < len(piece):
                out.append(piece)
                out_starts.append(max(0, s - i))
    return out, out_starts
