"""Served with a KV pool that holds about one long request: concurrent long requests wait or are
preempted, and every one finishes with the text one roomy process gives (speculation on)."""

from __future__ import annotations

import threading

import pytest

from specserve.engine.llm import LLM
from specserve.engine.sampling import SamplingParams

from serving import MAX_LEN, NAME, PROMPTS, Live, serve_kwargs


@pytest.fixture(scope="module")
def pair(demo_pair) -> tuple[str, str]:
    return demo_pair


@pytest.mark.slow
def test_long_requests_over_a_small_pool_all_finish_as_with_room(pair):
    pytest.importorskip("openai")
    long_prompts = [" ".join([p] * 12)[:600] for p in PROMPTS[:3]]
    roomy = LLM(**serve_kwargs(pair, "--max-num-seqs", "4"))
    outs = roomy.generate(long_prompts, SamplingParams(temperature=0, max_tokens=60))
    want = [o.text for o in outs]
    need = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    kw = serve_kwargs(pair, "--max-num-seqs", "4", "--kv-cache-tokens", str(MAX_LEN + 64))
    srv = Live(lambda: LLM(**kw), max_num_seqs=4, max_queue=8)
    try:
        srv.wait_ready()
        client = srv.client()
        got: list[str | None] = [None] * len(long_prompts)

        def ask(i: int) -> None:
            r = client.completions.create(model=NAME, prompt=long_prompts[i], max_tokens=60, temperature=0)
            got[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(long_prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert got == want
        kv = srv.wait_idle()["kv"]
        assert kv["blocks_total"] * kv["block_size"] < need  # the pool could not hold them all at once
    finally:
        srv.close()
