"""`specserve bench --context N`: every prompt led by filler up to N tokens, so speculation is measured at the
user's context length in one command."""

from __future__ import annotations

import json

import pytest

from specserve.bench.offline import at_context

from benching import PROMPTS, char_tokenizer_96, run_cli, validate


def test_prompts_are_led_by_the_other_prompts_up_to_the_context():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    out = at_context(prompts, 10)
    assert [len(p) for p in out] == [10, 10, 10]
    assert out[0] == [4, 5, 6, 7, 8, 9, 10] + [1, 2, 3]  # the prompt itself last, after the next prompts' text
    assert out[1] == [6, 7, 8, 9, 10, 11, 1, 2] + [4, 5]
    assert out[2][-6:] == prompts[2]
    assert at_context(prompts, 4)[2] == prompts[2]  # already longer: as it is
    assert at_context(prompts, None) is prompts
    assert [len(p) for p in at_context([[7]], 5)] == [5]  # a single prompt repeats itself


def test_context_refused_where_it_cannot_apply(monkeypatch, capsys):
    assert run_cli(monkeypatch, ["bench", "--context", "0"]) == 1
    assert "--context must be at least 1" in capsys.readouterr().err
    assert run_cli(monkeypatch, ["bench", "--context", "512", "--url", "http://localhost:1"]) == 1
    assert "offline mode" in capsys.readouterr().err


@pytest.mark.slow
def test_offline_bench_at_a_context(monkeypatch, make_pair, tmp_path, capsys):
    """The bench at --context 300: prompts of 300 tokens, speculation still equal to plain decoding; a
    --max-model-len too short for the context and the new tokens is refused by name."""
    target, draft = make_pair(vocab=96, hidden=64, layers=4, tokenizer=char_tokenizer_96)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    base = ["bench", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts), "--configs",
            "eagle3:steps=2", "--batch-sizes", "1", "--max-tokens", "6", "--repeats", "1", "--warmup", "0",
            "--peers", "--no-progress", "--context", "300"]
    assert run_cli(monkeypatch, [*base, "--max-model-len", "256"]) == 1
    assert "--context 300 plus --max-tokens 6 exceeds --max-model-len 256" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert run_cli(monkeypatch, [*base, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["settings"]["context"] == 300 and doc["settings"]["prompts"]["mean_prompt_tokens"] == 300
    assert doc["settings"]["max_model_len"] >= 306
    rows = {r["config"]: r for r in doc["results"]}
    assert rows["eagle3:steps=2"]["matches_baseline"] is True
