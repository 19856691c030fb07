"""The OpenAI-compatible server, end to end on CPU: the real uvicorn server,
the real `openai` client, 200 concurrent streams checked token for token
against offline `LLM.generate`, bad inputs while a stream is in flight,
disconnects, admission control, loading and failure states, and the CLI.

Uses the bundled demo pair (the demo target with a random drafter until the
demo drafter exists; a tiny random target with the demo tokenizer before
that). The GPU test drives the engine thread alone (the GPU machines have no
fastapi/uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from specserve.engine.llm import LLM, SamplingParams
from specserve.server import serve_cmd
from specserve.server.engine_loop import EngineLoop, Event, Job
from specserve.server.metrics import Metrics

from serving import (
    HAVE_HTTP,
    KEY,
    MAX_LEN,
    NAME,
    PROMPTS,
    Live,
    chat_messages,
    metric,
    serve_kwargs,
    slowed,
)

if HAVE_HTTP:
    import httpx
    import openai


@pytest.fixture(scope="module")
def engine_kw(pair) -> dict:
    return serve_kwargs(pair, "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def live(http, engine_kw):
    srv = Live(lambda: LLM(**engine_kw), max_num_seqs=16, max_queue=400)
    srv.wait_ready()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def offline(engine_kw) -> LLM:
    return LLM(**engine_kw)


# ---------------------------------------------------------------- client API
def test_openai_client_completions_chat_streaming(live, offline):
    cfg = live.loop.llm.engine.cfg
    assert cfg.adaptive and cfg.max_spec_steps == 3  # serve's default: adaptive K up to --spec-steps
    client = live.client()
    assert [m.id for m in client.models.list().data] == [NAME]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = offline.generate([PROMPTS[0]], greedy)[0]

    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want.token_ids)

    stream = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    msgs = chat_messages(1)
    chat_want = offline.generate([offline.tokenizer.apply_chat_template(msgs)], greedy)[0]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_want.text
    assert chat.usage.completion_tokens == len(chat_want.token_ids)
    parts = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True)
    chunks = list(parts)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_want.text
    assert chunks[-1].choices[0].finish_reason == chat_want.finish_reason

    # n > 1: one sequence per choice; greedy choices are identical, usage counts them all.
    a = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, n=3)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [want.text] * 3
    assert a.usage.completion_tokens == 3 * len(want.token_ids)
    assert a.usage.prompt_tokens == len(want.prompt_token_ids)
    multi = list(
        client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, n=2, stream=True)
    )
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in multi if c.choices and c.choices[0].index == i) == want.text
    sampled = client.completions.create(
        model=NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=6, temperature=1.0, n=2, seed=7
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in sampled.choices)

    # Stop strings: the text is cut exactly as LLM.generate cuts it, in streams too.
    stop = [want.text[3:5]] if len(want.text) >= 5 else ["\n"]
    cut = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop=stop))[0]
    s = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s) == cut.text

    # Errors come back as the client's typed exceptions.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ------------------------------------------------------------------ the load
@pytest.mark.slow
def test_200_concurrent_streams_match_offline_and_free_all_kv(live, offline):
    n, max_tokens = 200, 16
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    # Every 4th request is a chat; outputs per distinct prompt must equal offline generate.
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(len(PROMPTS))]
    chats = [offline.tokenizer.apply_chat_template(chat_messages(i)) for i in range(len(PROMPTS))]
    want_text = {t: o.text for t, o in zip(texts, offline.generate(texts, greedy))}
    want_chat = {i: o.text for i, o in enumerate(offline.generate(chats, greedy))}
    before = live.get("/metrics").text

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, str | None]:
        p = i % len(PROMPTS)
        if i % 4 == 3:
            s = await client.chat.completions.create(
                model=NAME, messages=chat_messages(p), max_tokens=max_tokens, temperature=0, stream=True
            )
            got, reason = "", None
            async for c in s:
                got += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
            return got, want_chat[p], reason
        s = await client.completions.create(
            model=NAME, prompt=texts[p], max_tokens=max_tokens, temperature=0, stream=True
        )
        got, reason = "", None
        async for c in s:
            got += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return got, want_text[texts[p]], reason

    async def main():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=600) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    seconds = time.perf_counter() - t0
    mismatches = [i for i, (got, want, _) in enumerate(results) if got != want]
    assert not mismatches, f"{len(mismatches)} outputs differ from offline generate, e.g. {results[mismatches[0]][:2]}"
    assert all(r in ("stop", "length") for _, _, r in results)
    info = live.wait_idle()
    assert info["kv"]["rows_used"] == 0 and info["kv"]["tokens_cached"] == 0
    assert info["requests"]["running"] == 0 and info["requests"]["waiting"] == 0
    after = live.get("/metrics").text
    done = metric(after, "specserve:request_success_total") - metric(before, "specserve:request_success_total")
    assert done == n
    assert (
        metric(after, "specserve:time_to_first_token_seconds_count")
        - metric(before, "specserve:time_to_first_token_seconds_count")
        == n
    )
    # Adaptive speculation ran and its choices are visible in /metrics (which K it picks depends on
    # timings measured on this machine, so no particular K is asserted).
    assert metric(after, "specserve:spec_decode_num_drafts_total") > 0
    assert metric(after, "specserve:spec_decode_steps_chosen_total") > 0
    print(f"\n200 concurrent streams: {seconds:.1f} s")


# ------------------------------------------------------------- bad requests
def _bad_requests(live) -> list[tuple[str, dict, int, str | None]]:
    """(description, httpx kwargs, expected status, expected error param)."""
    comp = lambda **kw: {"json": {"model": NAME, "prompt": "def f(x):", "max_tokens": 4, **kw}}  # noqa: E731
    return [
        (
            "invalid JSON",
            {"content": b'{"model": "x", "prompt": ', "headers": {**live.headers, "Content-Type": "application/json"}},
            400,
            None,
        ),
        ("not an object", {"json": [1, 2]}, 400, None),
        ("unknown model", comp(model="gpt-4"), 404, "model"),
        ("prompt longer than max-model-len", comp(prompt="x = 1\n" * MAX_LEN), 400, "prompt"),
        ("prompt ids longer than max-model-len", comp(prompt=[5] * MAX_LEN), 400, "prompt"),
        ("prompt + max_tokens too long", comp(max_tokens=MAX_LEN), 400, "max_tokens"),
        ("token id outside the vocabulary", comp(prompt=[10**7]), 400, "prompt"),
        ("max_tokens 0", comp(max_tokens=0), 400, "max_tokens"),
        ("max_tokens negative", comp(max_tokens=-3), 400, "max_tokens"),
        ("max_tokens not an int", comp(max_tokens="ten"), 400, "max_tokens"),
        ("temperature < 0", comp(temperature=-0.5), 400, "temperature"),
        ("top_p 0", comp(top_p=0), 400, "top_p"),
        ("top_p > 1", comp(top_p=1.5), 400, "top_p"),
        ("n above the limit", comp(n=live.cfg.max_n + 1), 400, "n"),
        ("n 0", comp(n=0), 400, "n"),
        ("logprobs above 5", comp(logprobs=6), 400, "logprobs"),
        ("echo", comp(echo=True), 400, "echo"),
        ("empty prompt", comp(prompt=""), 400, "prompt"),
        ("oversized body", comp(prompt="x" * (live.cfg.max_body_bytes + 10)), 413, None),
        ("no API key", {**comp(), "headers": {}}, 401, None),
        ("wrong API key", {**comp(), "headers": {"Authorization": "Bearer nope"}}, 401, None),
    ]


def test_bad_inputs_answered_while_a_stream_continues(live, offline):
    n_tokens = 160
    body = {
        "model": NAME,
        "prompt": PROMPTS[3],
        "max_tokens": n_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    want = offline.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))[0]
    events: list[tuple[float, dict]] = []
    started = threading.Event()

    def reader():
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", live.url + "/v1/completions", json=body, headers=live.headers) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append((time.perf_counter(), json.loads(line[6:])))
                    if len(events) == 2:
                        started.set()

    t = threading.Thread(target=reader)
    with slowed(live):  # keep the stream alive through the battery
        t.start()
        assert started.wait(60)
        t0 = time.perf_counter()
        for what, kw, status, param in _bad_requests(live):
            resp = live.post("/v1/completions", **kw)
            assert resp.status_code == status, (what, resp.status_code, resp.text[:300])
            err = resp.json()["error"]
            assert err["message"] and err["type"], what
            assert set(err) == {"message", "type", "param", "code"}, what
            if param:
                assert err["param"] == param, (what, err)
        chat = live.post("/v1/chat/completions", json={"model": NAME, "messages": []})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        route = live.get("/v1/nothing")
        assert route.status_code == 404 and "error" in route.json()
        assert live.get("/health").status_code == 200
        t1 = time.perf_counter()
        t.join(120)
    assert any(t0 < ts < t1 for ts, _ in events), "the stream made no progress while bad requests were answered"
    chunks = [e for _, e in events]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text
    assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    info = live.wait_idle()
    assert sum(info["requests"]["ended"]["rejected"].values()) >= len(_bad_requests(live))
    assert info["state"] == "ready"


def test_server_info_shows_the_policy_costs_per_context(live):
    """/server_info: the adaptive policy's step costs per batch bucket, context bucket and K (as of the
    last idle moment), with the steps it timed live."""
    live.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    live.wait_idle()
    costs = live.info()["speculation"]["costs"]
    rows = [row for by_context in costs.values() for ks in by_context.values() for row in ks.values()]
    assert rows and all(set(row) == {"seeded_ms", "live_ms", "predicted_ms", "timed"} for row in rows)
    assert any(row["timed"] for row in rows)


# -------------------------------------------------------------- disconnects
def test_tree_speculation_served_equals_plain(http, pair):
    """`serve --spec-topk 3`: greedy and seeded sampled completions through the openai client
    equal plain decoding's (trees verify sampled requests against the target's own draws);
    /server_info shows the tree acceptance estimate."""
    kw = serve_kwargs(pair, "--max-num-seqs", "4", "--spec-topk", "3", "--spec-tokens", "8", "--no-adaptive")
    plain = LLM(**serve_kwargs(pair, "--max-num-seqs", "4", "--spec-steps", "0"))
    srv = Live(lambda: LLM(**kw), max_num_seqs=4, max_queue=8)
    try:
        srv.wait_ready()
        client = srv.client()
        for params in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 11}):
            want = plain.generate([PROMPTS[2]], SamplingParams(max_tokens=16, **params))[0]
            out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, **params)
            assert out.choices[0].text == want.text, params
        info = srv.info()
        cfg = srv.loop.llm.engine.cfg
        assert cfg.spec_topk == 3 and cfg.spec_tokens == 8
        assert info["speculation"]["since_start"]["cycles"] > 0
        assert len(info["speculation"]["acceptance_estimate_tree"]) == 3
    finally:
        srv.close()


def test_client_disconnect_frees_its_row(live):
    live.wait_idle()
    before = live.info()["requests"]
    body = {"model": NAME, "prompt": "def main():", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with slowed(live), httpx.Client(timeout=60) as c:
        with c.stream("POST", live.url + "/v1/completions", json=body, headers=live.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open: dropping a half-read iterator closes the connection
            got = [line for line, _ in zip((x for x in lines if x.startswith("data: {")), range(3))]
            assert len(got) == 3
            assert live.info()["requests"]["running"] == 1
        # leaving the block closes the connection mid-stream
    info = live.wait_idle()
    assert info["requests"]["aborted"] == before["aborted"] + 1
    assert info["requests"]["success"] == before["success"]  # aborted, not run to completion
    assert info["kv"]["rows_used"] == 0

    # A non-streaming client that times out is noticed too.
    with slowed(live):  # 300 tokens take > 6 s here; the client gives up after 1 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", headers=live.headers, timeout=1.0, json={**body, "stream": False})
        info = live.wait_idle()
    assert info["requests"]["aborted"] == before["aborted"] + 2


def test_admit_wait_serves_the_same_tokens_and_leaves_nothing_behind(http, pair, offline):
    """`serve --admit-wait 3` with 4 rows under 24 concurrent streams: arrivals are let in together, every
    stream gets the tokens offline generation gives, and the server ends idle with its KV whole."""
    kw = serve_kwargs(pair, "--max-num-seqs", "4", "--admit-wait", "3")
    assert kw["admit_wait"] == 3
    srv = Live(lambda: LLM(**kw), max_num_seqs=4, max_queue=64)
    try:
        srv.wait_ready()
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
        lengths = [4 + 3 * (i % 5) for i in range(24)]  # rows end at different steps
        want = [
            offline.generate([t], SamplingParams(temperature=0, max_tokens=n))[0].text for t, n in zip(texts, lengths)
        ]

        async def one(client, i):
            r = await client.completions.create(model=NAME, prompt=texts[i], max_tokens=lengths[i], temperature=0)
            return r.choices[0].text

        async def all_of_them():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
            return await asyncio.gather(*(one(client, i) for i in range(24)))

        assert asyncio.run(all_of_them()) == want
        info = srv.wait_idle()
        assert info["kv"]["rows_used"] == 0 and info["requests"]["success"]
    finally:
        srv.close()


# --------------------------------------------------------------- admission
@pytest.fixture(scope="module")
def small(http, pair):
    kw = serve_kwargs(pair, "--max-num-seqs", "1", "--no-adaptive")
    srv = Live(lambda: LLM(**kw), max_num_seqs=1, max_queue=1)
    srv.wait_ready()
    yield srv
    srv.close()


def test_queue_full_gets_429_with_retry_after(small):
    body = {"model": NAME, "prompt": "import os", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with slowed(small), httpx.Client(timeout=60) as c:
        with (
            c.stream("POST", small.url + "/v1/completions", json=body, headers=small.headers) as r1,
            c.stream("POST", small.url + "/v1/completions", json=body, headers=small.headers) as r2,
        ):
            assert r1.status_code == r2.status_code == 200
            full = small.post("/v1/completions", json={**body, "stream": False})
            assert full.status_code == 429
            assert int(full.headers["Retry-After"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                small.client().completions.create(model=NAME, prompt="x", max_tokens=1)
            info = small.info()
            assert info["requests"]["running"] == 1 and info["requests"]["waiting"] == 1
    small.wait_idle()
    # More sequences than the server can ever hold is a 400, not a retryable 429.
    too_many = small.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1, "n": 3})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    ok = small.client().completions.create(model=NAME, prompt="x = ", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_engine_error_fails_requests_but_server_recovers(small):
    engine = small.loop.llm.engine
    real = engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real()

    engine.step = flaky
    try:
        r = small.post("/v1/completions", json={"model": NAME, "prompt": "def g():", "max_tokens": 8})
    finally:
        del engine.step
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    info = small.wait_idle()
    assert info["state"] == "ready" and info["kv"]["rows_used"] == 0
    assert small.get("/health").status_code == 200
    ok = small.post("/v1/completions", json={"model": NAME, "prompt": "def g():", "max_tokens": 4})
    assert ok.status_code == 200


# ------------------------------------------------------- loading and health
def test_health_is_503_while_loading_and_on_failure(http, pair):
    gate = threading.Event()
    kw = serve_kwargs(pair, "--max-num-seqs", "2")

    def slow_build():
        gate.wait(60)
        return LLM(**kw)

    srv = Live(slow_build, max_num_seqs=2, max_queue=2, api_key=None)
    try:
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert srv.get("/metrics").status_code == 200
        assert srv.info()["state"] == "loading"
        gate.set()
        srv.wait_ready()
        assert httpx.get(srv.url + "/health").status_code == 200
        # No --api-key: /v1 is open (and the model field is optional).
        assert srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        gate.set()
        srv.close()

    errors = []

    def broken():
        raise FileNotFoundError("weights missing")

    srv = Live(broken, max_num_seqs=1, max_queue=1)
    srv.loop.on_error = errors.append
    try:
        deadline = time.time() + 300
        while srv.loop.error is None:
            assert time.time() < deadline
            time.sleep(0.02)
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and "weights missing" in h.json()["message"]
    finally:
        srv.close()


# ------------------------------------------------------------------ metrics
def test_metrics_exposition_names_and_format(live):
    text = live.get("/metrics").text
    sample = re.compile(r'^specserve:[a-z0-9_:]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+(inf)?$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "request_success_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_count",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        'spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
        "spec_decode_steps",
        "spec_decode_steps_chosen_total",
        "kv_cache_usage_perc",
    ):
        assert f"specserve:{name}" in text, name
    assert 'specserve:time_to_first_token_seconds_bucket{le="+Inf"}' in text
    info = live.info()
    assert info["versions"]["specserve"] and info["config"]["server"]["api_key_set"] is True
    assert KEY not in json.dumps(info)


def test_prefix_cache_through_the_server(live):
    """serve caches prompt blocks by default: a repeated long prompt is found in the cache (the
    counters say so), answers the same, and the pool is whole again when the server is idle."""
    client = live.client()
    prompt = "def fibonacci(n):\n    " + "a, b = b, a + b  # step\n    " * 12
    before = live.get("/metrics").text
    outs = [
        client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        for _ in range(2)
    ]
    after = live.get("/metrics").text
    assert outs[0] == outs[1]
    hits = metric(after, "specserve:prefix_cache_hits_total") - metric(before, "specserve:prefix_cache_hits_total")
    queried = metric(after, "specserve:prefix_cache_queries_total") - metric(
        before, "specserve:prefix_cache_queries_total"
    )
    assert hits >= 64 and queried > hits
    for name in ("kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "num_preemptions_total"):
        assert f"specserve:{name} " in after, name
    deadline = time.time() + 60
    while (info := live.info())["idle_integrity"] != "ok":
        assert time.time() < deadline, info["idle_integrity"]
        time.sleep(0.1)
    assert info["kv"]["prefix_cache"] is True and info["kv"]["blocks_used"] == 0 and info["kv"]["blocks_cached"] > 0


# ---------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_serve_subprocess_ready_then_clean_exit(http, pair, tmp_path):
    env = {**os.environ, "SPECSERVE_API_KEY": "cli-key"}
    cmd = [
        sys.executable,
        "-m",
        "specserve",
        "serve",
        "--model",
        pair[0],
        "--draft",
        pair[1],
        "--port",
        "0",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        str(MAX_LEN),
        "--served-model-name",
        "m",
    ]
    # The server's output goes to a file: a pipe nobody reads while waiting could fill and stall the
    # server, and every failure below shows the log. Deadlines only bound a hang (a loaded machine is slow).
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)

    def log() -> str:
        return f"server exit code {proc.poll()}; its log:\n{log_path.read_text()}"

    try:
        deadline = time.time() + 600
        url = None
        while url is None:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = m and m.group(1)
            assert url or (proc.poll() is None and time.time() < deadline), log()
            time.sleep(0.2)
        while httpx.get(url + "/health", timeout=60).status_code != 200:
            assert proc.poll() is None and time.time() < deadline, log()
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401, log()
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer cli-key"}, timeout=60).json()
        assert models["data"][0]["id"] == "m"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 0, log()
        assert "Traceback" not in log_path.read_text(), log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_bad_setups_before_loading(http, pair, capsys):
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    assert serve_cmd.run(p.parse_args(["--model", "/nonexistent/model", "--port", "0"])) == 1
    assert "neither a Hugging Face model directory" in capsys.readouterr().err


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_engine_thread_with_cuda_graphs(pair):
    """The server's engine thread on CUDA: graphs captured in that thread, 96
    concurrent greedy sequences (adaptive K) equal to offline generate, an
    abort mid-stream frees its row, every row free afterwards."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = serve_kwargs(pair, "--max-num-seqs", "32", "--device", "cuda", "--dtype", "float32")
    loop = EngineLoop(lambda: LLM(**kw), Metrics(), capacity=256)
    loop.start()
    try:
        assert loop.ready.wait(600), loop.error
        assert loop.llm.engine.graph_seconds > 0  # CUDA graphs were captured in the engine thread
        n, greedy = 96, SamplingParams(temperature=0, max_tokens=32)
        events: dict[int, list[Event]] = {i: [] for i in range(n + 1)}
        lock, all_done = threading.Lock(), threading.Event()

        def sink(ev: Event) -> None:
            with lock:
                events[ev.index].append(ev)
                if sum(1 for i in range(n) if events[i] and events[i][-1].kind != "delta") == n:
                    all_done.set()

        tok = loop.llm.tokenizer
        ids = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
        long_job = Job(
            "long", n, tok.encode("def main():"), SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), sink
        )
        loop.submit([long_job])
        loop.submit([Job(f"r{i}", i, ids[i], greedy, sink) for i in range(n)])
        deadline = time.time() + 300
        while len(events[n]) < 3:
            assert time.time() < deadline
            time.sleep(0.001)
        loop.abort(["long"])
        assert all_done.wait(300)
        # A second engine beside the server's, with a pool of its own size (the server's holds
        # --gpu-memory-utilization of the GPU).
        offline = LLM(
            **serve_kwargs(
                pair, "--max-num-seqs", "32", "--device", "cuda", "--dtype", "float32", "--kv-cache-tokens", "65536"
            )
        ).generate(PROMPTS, greedy)
        for i in range(n):
            assert [e.kind for e in events[i]][-1] == "finish"
            assert "".join(e.text for e in events[i]) == offline[i % len(PROMPTS)].text, i
        deadline = time.time() + 300
        while not (loop.snapshot()["idle_integrity"] == "ok" and loop.in_flight == 0):
            assert time.time() < deadline, loop.snapshot()
            time.sleep(0.01)
        assert loop.metrics.aborted == 1 and events[n][-1].kind == "delta"
        assert loop.snapshot()["kv"]["rows_used"] == 0
        assert loop.snapshot()["spec"]["cycles"] > 0
    finally:
        loop.stop()
