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

from served import Served

FAULT_SERVER = Path(__file__).with_name("engine_loop_fault.py")
LONG = {"model": "demo", "prompt": "def main():", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


@pytest.mark.slow
def test_engine_loop_death_fails_requests_and_ends_the_server(demo_pair, tmp_path):
    trigger = tmp_path / "fail-now"
    srv = Served([str(FAULT_SERVER), "serve", "--model", demo_pair[0], "--draft", demo_pair[1], "--port", "0",
                  "--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", "demo"],
                 tmp_path / "serve.log", env={"SPECSERVE_TEST_LOOP_FAULT": str(trigger)})
    try:
        srv.wait_ready()
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
            stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=900, stream=True, extra_body={"ignore_eos": True})
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
        assert 200 not in health  # never a live front over the dead engine
        assert "the engine loop stopped: RuntimeError: injected engine-loop fault" in srv.log_path.read_text()
        assert srv.tree() == []
    finally:
        srv.stop()

