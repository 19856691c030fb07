import json

import pytest

from benching import PROMPTS, char_tokenizer_96


@pytest.fixture(scope="module")
def bench_pair(make_pair, tmp_path_factory):
    target, draft = make_pair(vocab=96, hidden=64, layers=4, tokenizer=char_tokenizer_96)
    prompts = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return target, draft, prompts
