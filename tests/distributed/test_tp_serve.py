"""`specserve serve --tp 2` on CPU (gloo) with the bundled demo pair, through the real `openai`
client: plain, fixed K, adaptive (serve's default) and a tree each answer chats and
completions, stream, give greedy text equal to one process without speculation, and report
acceptance in /metrics; a worker killed while the server is idle ends it too. Under `specserve
launch`, a TP worker SIGKILLed mid-stream ends every request in flight with an error (streams:
error event then [DONE]; non-streaming: 5xx), the server exits non-zero within --dist-timeout
with no process of its tree left, launch restarts it and it serves again; a worker frozen
mid-stream ends it after --dist-timeout. One server per mode: CPU is scarce."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from specserve.engine.llm import LLM
from specserve.engine.sampling import SamplingParams

from served import PY, Served, alive, free_port, sse_events, workers_of

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n"]
MAX_TOKENS = 24
DIST_TIMEOUT = 20  # seconds a TP worker may stay silent in one step
SERVE = [
    "-m",
    "specserve",
    "serve",
    "--tp",
    "2",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
    "--served-model-name",
    "demo",
    "--dist-timeout",
    str(DIST_TIMEOUT),
]
MODES = {
    "plain": ["--spec-steps", "0"],
    "fixed": ["--spec-steps", "3", "--no-adaptive"],
    "tree": [
        "--spec-steps",
        "3",
        "--spec-topk",
        "2",
        "--spec-tokens",
        "6",
        "--spec-tree-max-batch",
        "4",
        "--no-adaptive",
    ],
}


@pytest.fixture(scope="module")
def plain_reference(demo_pair) -> list[str]:
    """Greedy text of one process without speculation: what every TP2 mode must serve."""
    llm = LLM(model=demo_pair[0], device="cpu", max_model_len=1024)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.text for o in outs]


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^specserve:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


def exercise(url: str, reference: list[str], speculating: bool, k_max: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    greedy = {"model": "demo", "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for prompt, want in zip(PROMPTS, reference):
        done = client.completions.create(prompt=prompt, **greedy)
        assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
        streamed = client.completions.create(prompt=prompt, stream=True, **greedy)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Write a haiku."}], model="demo", max_tokens=16
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    pieces = client.chat.completions.create(
        messages=[{"role": "user", "content": "Count to five."}], model="demo", max_tokens=16, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    text = httpx.get(url + "/metrics", timeout=60).text
    drafted = metric(text, "spec_decode_num_draft_tokens_total")
    accepted = metric(text, "spec_decode_num_accepted_tokens_total")
    positions = re.findall(
        r'^specserve:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}', text, re.MULTILINE
    )
    assert len(positions) == k_max  # every draft position has its series from the start
    if speculating:
        assert drafted > 0 and 0 < accepted <= drafted
        assert metric(text, "spec_decode_num_drafts_total") > 0
    else:
        assert drafted == accepted == 0
    info = httpx.get(url + "/server_info", timeout=60).json()
    assert info["config"]["tp"] == 2 and info["state"] == "ready" and info["idle_integrity"] == "ok"
    assert info["speculation"]["drafter"] is speculating


@pytest.mark.parametrize("mode", list(MODES))
def test_tp2_serves_each_speculation_mode(mode, plain_reference, tmp_path):
    srv = Served([*SERVE, "--port", "0", *MODES[mode]], tmp_path / "serve.log")
    try:
        srv.wait_ready()
        tree = [p.pid for p in srv.tree()]
        assert len(workers_of(srv.proc.pid)) == 2
        exercise(srv.url, plain_reference, speculating=mode != "plain", k_max=0 if mode == "plain" else 3)
        if mode == "plain":  # a worker killed while the server is idle: noticed without any request
            victim = workers_of(srv.proc.pid)[0].pid
            os.kill(victim, signal.SIGKILL)
            assert srv.proc.wait(DIST_TIMEOUT) == 1, srv.log()
            assert f"TP worker 0 (pid {victim}) exited unexpectedly (killed by signal 9) while serving" in srv.log()
        else:
            srv.proc.send_signal(signal.SIGINT)
            assert srv.proc.wait(120) == 0, srv.log()
        assert alive(tree) == []
    finally:
        srv.stop()


LONG = {"model": "demo", "prompt": "def main():", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _requests_in_flight(url: str, results: dict) -> tuple[list[threading.Thread], threading.Barrier]:
    """Two streams (raw SSE and the openai client) and one non-streaming request; the barrier
    opens when both streams have their first chunk."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    started = threading.Barrier(3)

    def raw_stream():
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=300) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started.wait(120)
            results["raw"] = sse_events(lines)

    def openai_stream():
        pieces = iter(
            client.completions.create(
                model="demo",
                prompt="class Stack:",
                max_tokens=900,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        next(pieces)
        started.wait(120)
        try:
            results["openai"] = list(pieces)
        except openai.APIError as e:
            results["openai"] = e

    def unary():
        results["unary"] = httpx.post(url + "/v1/completions", json=LONG, timeout=300)

    threads = [threading.Thread(target=f, daemon=True) for f in (raw_stream, openai_stream, unary)]
    for t in threads:
        t.start()
    return threads, started


def _fault_mid_stream(launch: Served, url: str, sig: int, rank: int) -> dict:
    """Three requests in flight, then `sig` to TP worker `rank`; returns what the requests got, the
    /health codes polled until the server process ended, the server's exit status as launch saw it,
    seconds from the signal to that exit line, and the server's tree as it was."""
    server = next(p for p in launch.tree() if "serve" in p.cmdline() and "launch" not in p.cmdline())
    workers = workers_of(server.pid)
    assert len(workers) == 2
    results: dict = {"tree": [server.pid, *(w.pid for w in workers)], "victim": workers[rank].pid}
    threads, started = _requests_in_flight(url, results)
    started.wait(300)
    mark = len(launch.log_path.read_text())
    t_sig = time.monotonic()
    os.kill(workers[rank].pid, sig)
    health = []
    while server.is_running() and server.status() != "zombie" and len(health) < 20000:
        health.append(launch.health())
    exited = launch.wait_for(r"server \(pid \d+\) exited with status (-?\d+)", timeout=DIST_TIMEOUT + 60, start=mark)
    results.update(health=health, status=int(exited.group(1)), seconds=time.monotonic() - t_sig, mark=mark)
    for t in threads:
        t.join(120)
    return results


def _assert_failed(results: dict, why: str) -> None:
    """Every request in flight ended with an error naming `why`; /health never said 200 after it."""
    raw = results["raw"]
    assert raw[-1] == "[DONE]" and why in raw[-2]["error"]["message"], raw[-2:]
    assert isinstance(results["openai"], openai.APIError) and why in str(results["openai"]), results["openai"]
    assert results["unary"].status_code >= 500 and why in results["unary"].json()["error"]["message"]
    # 200 until the loss is noticed, then 503 or nothing listening; never 200 again. (The 503 window
    # before the exit is short; test_engine_death shows /health's 503 in process.)
    health = results["health"]
    after = health[next((i for i, h in enumerate(health) if h != 200), len(health)) :]
    assert set(after) <= {503, None}, health
    assert results["status"] != 0


def test_tp2_adaptive_serves_then_survives_a_killed_worker_under_launch(plain_reference, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = Served(
        [
            "-m",
            "specserve",
            "launch",
            "--stall-timeout",
            "600",
            "--restarts",
            "1",
            "--restart-delay",
            "0.5",
            "--grace",
            "5",
            "--",
            PY,
            *SERVE,
            "--port",
            str(port),
        ],
        tmp_path / "launch.log",
    )
    try:
        launch.wait_for(r"READY after")
        launch.url = url
        exercise(url, plain_reference, speculating=True, k_max=4)  # serve's default: adaptive K in 0..4

        # A worker killed mid-stream: the engine thread (waiting on the step) or the group's watch
        # thread, whichever sees it first, ends the group.
        killed = _fault_mid_stream(launch, url, signal.SIGKILL, rank=1)
        _assert_failed(killed, f"TP worker 1 (pid {killed['victim']}) exited unexpectedly (killed by signal 9)")
        assert killed["seconds"] < DIST_TIMEOUT
        log = launch.log_path.read_text()[killed["mark"] :]
        assert "still running after the server exited" not in log  # the server left no process behind
        assert alive(killed["tree"]) == []

        launch.wait_for(r"attempt 2/2", start=killed["mark"])
        launch.wait_for(r"READY after", start=killed["mark"])
        again = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        out = again.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == plain_reference[0]

        # A worker frozen mid-stream (alive, silent: as one stuck in a collective): after --dist-timeout.
        frozen = _fault_mid_stream(launch, url, signal.SIGSTOP, rank=0)
        _assert_failed(frozen, f"did not answer within {DIST_TIMEOUT} s during step")
        assert DIST_TIMEOUT <= frozen["seconds"] < DIST_TIMEOUT + 60
        log = launch.log_path.read_text()[frozen["mark"] :]
        assert "still running after the server exited" not in log
        assert launch.proc.wait(120) == 4, launch.log()  # restarts exhausted: launch reports the crash
        assert alive(killed["tree"] + frozen["tree"]) == []
    finally:
        launch.stop()
