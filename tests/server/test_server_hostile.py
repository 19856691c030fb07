"""The server under hostile input and signals: every request field fuzzed while
streams run, bodies no parser should choke on, prompts that must not stall the
event loop, protected operations routes, chat stop tokens, one count per ended
request, and a clean drain on SIGTERM/SIGINT with a real subprocess server.

Shares the demo pair and the in-process `Live` server of test_server.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specserve.config import DEMO_DIR
from specserve.engine.llm import LLM
from specserve.engine.tokenizer import Tokenizer

from serving import (
    HAVE_HTTP,
    KEY,
    MAX_LEN,
    NAME,
    PROMPTS,
    Live,
    metric,
    serve_kwargs,
    slowed,
)

if HAVE_HTTP:
    import httpx

    from specserve.server.app import TextLimits


@pytest.fixture(scope="module")
def live(http, pair):
    kw = serve_kwargs(pair, "--max-num-seqs", "16", "--no-adaptive")  # adaptive start-up tuning is slow on CPU
    srv = Live(lambda: LLM(**kw), max_num_seqs=16, max_queue=400)
    srv.wait_ready(300)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def small(http, pair):
    kw = serve_kwargs(pair, "--max-num-seqs", "1", "--no-adaptive")
    srv = Live(lambda: LLM(**kw), max_num_seqs=1, max_queue=1)
    srv.wait_ready(300)
    yield srv
    srv.close()


def raw_post(srv: Live, path: str, body, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    """POST `body` serialized by Python's json (NaN and Infinity included, as a hostile client may send them)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        srv.url + path,
        content=data,
        timeout=timeout,
        headers={**srv.headers, "Content-Type": "application/json", **(headers or {})},
    )


def ended(srv: Live, outcome: str, reason: str) -> float:
    return metric(srv.get("/metrics").text, f'specserve:request_ended_total{{outcome="{outcome}",reason="{reason}"}}')


class Streams:
    """Greedy streams read in threads; each records its text, finish reason and whether it saw [DONE]."""

    def __init__(self, srv: Live, n: int, max_tokens: int):
        self.srv, self.max_tokens = srv, max_tokens
        self.results: list[dict] = [
            {"chunks": 0, "text": "", "finish": None, "done": False, "error": None} for _ in range(n)
        ]
        self.started = threading.Barrier(n + 1, timeout=120)
        self.threads = [threading.Thread(target=self._read, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()
        self.started.wait()  # every stream has produced at least one chunk

    def _read(self, i: int) -> None:
        r = self.results[i]
        body = {
            "model": NAME,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        signalled = False
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", self.srv.url + "/v1/completions", json=body, headers=self.srv.headers) as resp,
        ):
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    r["done"] = True
                elif line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        r["error"] = ev["error"]
                    else:
                        r["chunks"] += 1
                        r["text"] += ev["choices"][0]["text"]
                        r["finish"] = ev["choices"][0]["finish_reason"] or r["finish"]
                if not signalled and (r["chunks"] or r["error"]):
                    signalled = True
                    self.started.wait()

    def join(self) -> list[dict]:
        for t in self.threads:
            t.join(180)
        return self.results


# ------------------------------------------------------------------- fuzzing
HOSTILE = [
    "x",
    "",
    2**63,
    2**64,
    -1,
    -(2**63) - 1,
    0,
    1e308,
    float("nan"),
    float("-inf"),
    [],
    {},
    [[[1]]],
    {"a": {"b": [1]}},
    True,
    0.5,
]
COMPLETION_FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "logprobs",
    "echo",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "model",
    "response_format",
]
CHAT_FIELDS = [
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "model",
]


@pytest.mark.slow
def test_fuzz_every_field_while_streams_run(live):
    """Every field of both schemas gets every hostile value while four streams
    run: each answer is a 200 or a 4xx naming the field, never a 5xx; the
    streams end normally and the server stays ready."""
    # The values that once broke the engine step for everyone go first, while the streams surely run.
    killers = [
        ("top_k", 2**63),
        ("top_k", 2**64),
        ("seed", 2**63),
        ("temperature", 1e-300),
        ("top_p", 1e-300),
        ("stop_token_ids", [2**63]),
        ("temperature", 1e308),
    ]
    cases = [
        (path, fields, base)
        for path, fields, base in (
            ("/v1/completions", COMPLETION_FIELDS, {"model": NAME, "prompt": "def f(x):", "max_tokens": 1}),
            (
                "/v1/chat/completions",
                CHAT_FIELDS,
                {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            ),
        )
    ]
    with slowed(live, 0.01):
        streams = Streams(live, 4, max_tokens=200)
        for path, _, base in cases:
            for name, value in killers:
                r = raw_post(live, path, {**base, name: value})
                assert r.status_code in (200, 400), (path, name, value, r.status_code, r.text[:300])
        for path, fields, base in cases:
            for name in fields:
                for value in HOSTILE:
                    r = raw_post(live, path, {**base, name: value})
                    assert r.status_code < 500, (path, name, value, r.status_code, r.text[:300])
                    if r.status_code == 200:
                        continue
                    err = r.json()["error"]
                    assert r.status_code in (400, 404), (path, name, value, r.status_code, err)
                    assert err["param"] == name or name in err["message"], (path, name, value, err)
                    assert len(err["message"]) < 400, (path, name, err["message"])
        assert live.get("/health").status_code == 200
        results = streams.join()
    for r in results:
        assert r["error"] is None and r["done"] and r["finish"] == "length", r
    info = live.wait_idle()
    assert info["state"] == "ready" and info["kv"]["rows_used"] == 0


def test_top_k_above_the_vocabulary_means_no_top_k(live):
    plain = live.post(
        "/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "seed": 5}
    )
    for top_k in (4096, 2**63 - 1):
        r = live.post(
            "/v1/completions",
            json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "seed": 5, "top_k": top_k},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"], top_k
    for top_k in (2**63, 10**30):  # beyond int64: no integer option can carry it
        r = live.post("/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "top_k": top_k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


@pytest.mark.parametrize(
    "name,value",
    [("min_p", 0.1), ("min_p", float("nan")), ("min_p", "x"), ("repetition_penalty", 1.2), ("typical_p", 0.5)],
)
def test_sampling_options_of_other_servers_are_refused_not_ignored(live, name, value):
    r = raw_post(live, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1, name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert (
        live.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1, "min_p": 0}).status_code
        == 200
    )


def test_a_failing_engine_step_fails_only_the_requests_in_it(small):
    """One row: A runs, B waits. A step raises: A gets the error, B is not in
    that step and completes."""
    engine = small.loop.llm.engine
    real = engine.step
    armed = threading.Event()

    def step():
        if armed.is_set() and engine.waiting:
            armed.clear()
            raise RuntimeError("injected failure")
        time.sleep(0.01)
        return real()

    body = {"model": NAME, "prompt": "def g():", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    engine.step = step
    try:
        out: dict[str, httpx.Response] = {}
        a = threading.Thread(target=lambda: out.update(a=small.post("/v1/completions", json=body)))
        a.start()
        deadline = time.time() + 30
        while small.info()["requests"]["running"] < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        b = threading.Thread(target=lambda: out.update(b=small.post("/v1/completions", json=body)))
        b.start()
        while small.info()["requests"]["waiting"] < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        armed.set()
        a.join(60)
        b.join(60)
    finally:
        del engine.step
    assert out["a"].status_code == 500 and "injected failure" in out["a"].json()["error"]["message"]
    assert out["b"].status_code == 200, out["b"].text
    assert out["b"].json()["choices"][0]["finish_reason"] == "length"
    assert small.wait_idle()["state"] == "ready"


def test_unpackable_parameters_fail_alone_at_admission(small):
    """A SamplingParams that slipped past the HTTP checks is refused in the engine thread, before any step."""
    from specserve.engine.sampling import SamplingParams
    from specserve.server.engine_loop import Job

    got = []
    params = SamplingParams(max_tokens=4)
    params.top_k = 2**63  # mutated after construction: only the admission check can see it
    small.loop.submit([Job("bad-params", 0, [1, 2, 3], params, got.append)])
    deadline = time.time() + 30
    while not got:
        assert time.time() < deadline
        time.sleep(0.01)
    assert got[0].kind == "error" and got[0].status == 400 and "top_k" in got[0].message
    ok = small.post("/v1/completions", json={"model": NAME, "prompt": "x = ", "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------ hostile bodies
def test_deep_json_surrogates_and_unknown_roles_are_400(live):
    deep = b'{"model": "%s", "prompt": ' % NAME.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = raw_post(live, "/v1/completions", deep)
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"], r.text[:300]
    nested = 1
    for _ in range(40):  # parseable, but deeper than any request field goes
        nested = [nested]
    r = raw_post(live, "/v1/completions", {"model": NAME, "prompt": nested})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    # json.dumps writes a lone surrogate as the escape \ud800, which json.loads turns back into one
    r = raw_post(live, "/v1/completions", {"model": NAME, "prompt": "def f\ud800():", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert "surrogate" in r.json()["error"]["message"]
    r = raw_post(
        live,
        "/v1/chat/completions",
        {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi \udfff"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    r = live.post(
        "/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [{"role": "wizard", "content": "hi"}]}
    )
    assert r.status_code == 400 and "'wizard'" in r.json()["error"]["message"], r.text[:300]
    r = live.post(
        "/v1/chat/completions",
        json={
            "model": NAME,
            "max_tokens": 2,
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 200, r.text[:300]
    assert live.get("/health").status_code == 200


# -------------------------------------------------------- the event loop
def test_tokenization_runs_off_the_event_loop(live):
    """While one request's tokenization is blocked, /health and other routes still answer."""
    tok = live.loop.llm.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tok.encode

    def blocked(text):
        entered.set()
        release.wait(60)
        return real(text)

    tok.encode = blocked
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=live.post("/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 2})
        )
    )
    try:
        t.start()
        assert entered.wait(30), "the request never reached the tokenizer"
        assert httpx.get(live.url + "/health", timeout=20).status_code == 200
        assert live.get("/v1/models").status_code == 200
    finally:
        release.set()
        del tok.encode
        t.join(60)
    assert out["r"].status_code == 200


def test_prompts_too_long_for_any_tokenization_are_refused_untokenized(live):
    tok = live.loop.llm.tokenizer
    calls = []
    real = tok.encode
    tok.encode = lambda text: calls.append(len(text)) or real(text)
    try:
        per_token = TextLimits.of(tok).max_token_chars
        huge = "x" * (MAX_LEN * per_token + 1)
        r = live.post("/v1/completions", json={"model": NAME, "prompt": huge, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        r = live.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": huge}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    finally:
        del tok.encode
    assert calls == []


# ----------------------------------------------------------------- exposure
def test_metrics_and_server_info_need_the_key(live, http):
    for path in ("/metrics", "/server_info", "/v1/models"):
        r = httpx.get(live.url + path, timeout=30)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", path
        assert httpx.get(live.url + path, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
        assert live.get(path).status_code == 200, path
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200

    def broken():
        raise RuntimeError("no model in this test")

    srv = Live(broken, max_num_seqs=1, max_queue=1, metrics_no_auth=True)
    try:
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        assert httpx.get(srv.url + "/server_info", timeout=30).status_code == 401
    finally:
        srv.close()


# ------------------------------------------------------------- chat shape
def test_end_of_turn_found_from_the_chat_template(tmp_path):
    """The demo template closes turns with <|im_end|>: found even where generation_config.json does not list it."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / f, tmp_path / f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    tok = Tokenizer(tmp_path)
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert im_end is not None and im_end not in tok.eos_token_ids
    assert TextLimits.of(tok).end_of_turn_id == im_end


def test_chat_stops_at_end_of_turn_and_every_eos(live):
    engine, tok = live.loop.llm.engine, live.loop.llm.tokenizer
    gen_eos = json.loads((Path(live.loop.llm.config.model) / "generation_config.json").read_text())["eos_token_id"]
    assert set(gen_eos) | tok.eos_token_ids <= engine.eos_token_ids
    seen = []
    real = engine.add_request
    engine.add_request = lambda ids, params, seq_id=None: seen.append(params) or real(ids, params, seq_id=seq_id)
    try:
        for extra in ({}, {"ignore_eos": True, "max_tokens": 2}):
            r = live.post(
                "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
            )
            assert r.status_code == 200, r.text
    finally:
        del engine.add_request
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert im_end in seen[0].stop_token_ids
    assert im_end not in seen[1].stop_token_ids  # ignore_eos runs to max_tokens


def test_stream_chunks_carry_usage_null_until_the_last(live):
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, headers=live.headers, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ metrics
def test_every_ended_request_counted_once_by_outcome(small):
    engine = small.loop.llm.engine
    before = {
        k: ended(small, *k)
        for k in (
            ("failed", "engine_error"),
            ("finished", "length"),
            ("rejected", "http_400"),
            ("rejected", "invalid_api_key"),
        )
    }

    def failing():
        raise RuntimeError("injected failure")

    body = {"model": NAME, "prompt": "def g():", "max_tokens": 4, "ignore_eos": True}
    engine.step = failing
    try:
        for stream in (False, True, False, True):
            r = small.post("/v1/completions", json={**body, "stream": stream})
            if stream:
                assert r.status_code == 200 and '"code":"engine_error"' in r.text.replace(" ", ""), r.text
                assert r.text.rstrip().endswith("data: [DONE]")
            else:
                assert r.status_code == 500, r.text
    finally:
        del engine.step
    small.wait_idle()
    assert small.post("/v1/completions", json=body).status_code == 200
    assert small.post("/v1/completions", json={**body, "max_tokens": 0}).status_code == 400
    assert httpx.post(small.url + "/v1/completions", json=body, timeout=30).status_code == 401
    after = {k: ended(small, *k) for k in before}
    assert after[("failed", "engine_error")] == before[("failed", "engine_error")] + 4
    assert after[("finished", "length")] == before[("finished", "length")] + 1
    assert after[("rejected", "http_400")] == before[("rejected", "http_400")] + 1
    assert after[("rejected", "invalid_api_key")] == before[("rejected", "invalid_api_key")] + 1


# ----------------------------------------------------------------- shutdown
def start_server(pair, *flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "specserve",
        "serve",
        "--model",
        pair[0],
        "--spec-steps",
        "0",
        "--port",
        "0",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--api-key",
        KEY,
        "--served-model-name",
        NAME,
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    log = []
    for line in proc.stdout:
        log.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            break
    assert m, "".join(log)
    url = m.group(1)
    deadline = time.time() + 300
    while httpx.get(url + "/health", timeout=30).status_code != 200:
        assert proc.poll() is None and time.time() < deadline, "".join(log)
        time.sleep(0.2)
    return proc, url


def long_stream(url: str, first: threading.Event, lines: list[str]) -> None:
    body = {
        "model": NAME,
        "prompt": "def main():",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, timeout=600, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()


@pytest.mark.slow
@pytest.mark.parametrize("sig,grace", [(signal.SIGTERM, "600"), (signal.SIGINT, "0")])
def test_shutdown_drains_then_ends_the_rest_cleanly(http, pair, sig, grace):
    """First signal: admissions stop (503, /health not ready) and the running
    stream goes on; with a 600 s grace it finishes normally, with 0 s it is
    ended by an error event; [DONE] either way, exit status 0, no traceback."""
    proc, url = start_server(pair, "--shutdown-timeout", grace)
    try:
        first, lines = threading.Event(), []
        t = threading.Thread(target=long_stream, args=(url, first, lines))
        t.start()
        assert first.wait(120)
        proc.send_signal(sig)
        if grace != "0":
            h = httpx.get(url + "/health", timeout=30)
            assert h.status_code == 503 and h.json()["status"] == "shutting_down"
            r = httpx.post(
                url + "/v1/completions",
                json={"model": NAME, "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=30,
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        t.join(600)
        assert proc.wait(120) == 0
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][6:])
    if grace == "0":
        assert last["error"]["code"] == "shutdown" and "shutting down" in last["error"]["message"], last
    else:
        assert last.get("choices", [{}])[0].get("finish_reason") == "length", last
    assert "Traceback" not in out and "CancelledError" not in out, out
