"""An engine loop that dies ends the server: every request in flight fails (streams with an
error event and [DONE], non-streaming with a 5xx), /health never says 200 again, and the
process exits non-zero by itself. The fault is injected into a real `specserve serve`
(tests/engine_loop_fault.py) with the bundled demo pair; the client is the real `openai` one."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest

from served import Served, alive

FAULT_SERVER = Path(__file__).with_name("engine_loop_fault.py")
LONG = {"model": "demo", "prompt": "def main():", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


@pytest.mark.slow
def test_engine_loop_death_fails_requests_and_ends_the_server(demo_pair, tmp_path):
    trigger = tmp_path / "fail-now"
    srv = Served(
        [
            str(FAULT_SERVER),
            "serve",
            "--model",
            demo_pair[0],
            "--draft",
            demo_pair[1],
            "--port",
            "0",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--served-model-name",
            "demo",
        ],
        tmp_path / "serve.log",
        env={"SPECSERVE_TEST_LOOP_FAULT": str(trigger)},
    )
    try:
        srv.wait_ready()
        tree = [p.pid for p in srv.tree()]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        results: dict[str, object] = {}
        started = threading.Barrier(3)

        def raw_stream():
            with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait(60)
                results["raw"] = [first, *(line for line in lines if line.startswith("data: "))]

        def openai_stream():
            stream = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=900,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            pieces = iter(stream)
            next(pieces)
            started.wait(60)
            try:
                results["openai"] = [c for c in pieces]
            except openai.APIError as e:
                results["openai"] = e

        def unary():
            results["unary"] = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=120)

        threads = [threading.Thread(target=f) for f in (raw_stream, openai_stream, unary)]
        for t in threads:
            t.start()
        started.wait(300)  # both streams are past their first event, the unary request is queued or running
        trigger.touch()
        health = []
        while srv.proc.poll() is None and len(health) < 600:
            health.append(srv.health())
        for t in threads:
            t.join(120)
        code = srv.proc.wait(120)
        assert code != 0, srv.log()
        raw = results["raw"]
        assert raw[-1] == "data: [DONE]" and '"error"' in raw[-2] and "injected engine-loop fault" in raw[-2], raw[-3:]
        assert isinstance(results["openai"], openai.APIError), results["openai"]
        assert "injected engine-loop fault" in str(results["openai"])
        unary_r = results["unary"]
        assert unary_r.status_code >= 500 and "injected engine-loop fault" in unary_r.json()["error"]["message"]
        after = health[next((i for i, h in enumerate(health) if h != 200), len(health)) :]
        assert set(after) <= {503, None}, health  # once the fault is hit, never a live front over the dead engine
        assert "the engine loop stopped: RuntimeError: injected engine-loop fault" in srv.log_path.read_text()
        assert alive(tree) == []
    finally:
        srv.stop()


def test_dead_loop_health_is_503_and_new_requests_fail_at_once(demo_pair):
    """In process, with nothing to end it, a front over a dead loop: /health says 503 with the
    reason, a request sent afterwards fails at once, `on_error` is told once."""
    import uvicorn

    from specserve.engine.llm import LLM
    from specserve.engine.sampling import SamplingParams
    from specserve.server import serve_cmd
    from specserve.server.app import ServerConfig, create_app
    from specserve.server.engine_loop import EngineLoop, Job
    from specserve.server.metrics import Metrics

    errors: list[str] = []
    loop = EngineLoop(
        lambda: LLM(model=demo_pair[0], device="cpu", max_model_len=256), Metrics(), capacity=4, on_error=errors.append
    )
    app = create_app(loop, loop.metrics, ServerConfig(served_model_name="demo", api_key=None), {})
    sock = serve_cmd.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    loop.start()
    thread.start()
    try:
        assert loop.ready.wait(300), loop.error
        assert httpx.get(url + "/health", timeout=30).status_code == 200

        def broken_publish():
            raise RuntimeError("injected engine-loop fault")

        loop._publish = broken_publish
        events = []
        loop.submit([Job("wake", 0, [1, 2, 3], SamplingParams(max_tokens=4), events.append)])  # wakes the loop
        loop.thread.join(60)
        assert not loop.thread.is_alive()
        assert events[-1].kind == "error" and "injected engine-loop fault" in events[-1].message  # after a first step
        h = httpx.get(url + "/health", timeout=30)
        assert h.status_code == 503 and "injected engine-loop fault" in h.json()["message"]
        r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "engine unavailable" in r.json()["error"]["message"]
        late = []
        loop.submit([Job("late", 0, [1, 2], SamplingParams(max_tokens=2), late.append)])  # raced past the check
        assert [(e.kind, e.status) for e in late] == [("error", 503)]
        assert len(errors) == 1 and "injected engine-loop fault" in errors[0]
    finally:
        server.should_exit = True
        thread.join(15)
        loop.stop()
