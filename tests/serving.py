"""What the HTTP server tests share: constants, the in-process `Live` server and small helpers.
The `pair` and `http` fixtures live in tests/server/conftest.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time

from specserve.config import DEMO_DIR
from specserve.server import serve_cmd
from specserve.server.engine_loop import EngineLoop
from specserve.server.metrics import Metrics

try:
    import httpx
    import openai
    import uvicorn

    from specserve.server.app import ServerConfig, create_app

    HAVE_HTTP = True
except ImportError:  # e.g. the GPU machines: only the engine-thread test runs there
    HAVE_HTTP = False


KEY = "test-key"
NAME = "demo-pair"
MAX_LEN = 384
PROMPTS = [
    json.loads(line)["prompt"] for line in (DEMO_DIR / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()
]


def serve_kwargs(pair, *flags: str) -> dict:
    """Engine kwargs exactly as `specserve serve` builds them from its flags."""
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    args = p.parse_args(
        ["--model", pair[0], "--draft", pair[1], "--spec-steps", "3", "--max-model-len", str(MAX_LEN), *flags]
    )
    return serve_cmd.serve_engine_kwargs(args)


class Live:
    """An in-process server on a free port: uvicorn in one thread, the engine in another."""

    def __init__(self, build, max_num_seqs: int, max_queue: int, api_key: str | None = KEY, **cfg):
        self.metrics = Metrics()
        self.loop = EngineLoop(build, self.metrics, capacity=max_num_seqs + max_queue)
        self.cfg = ServerConfig(served_model_name=NAME, api_key=api_key, **cfg)
        app = create_app(self.loop, self.metrics, self.cfg, {"engine": {"max_num_seqs": max_num_seqs}})
        sock = serve_cmd.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.loop.start()
        self.thread.start()
        deadline = time.time() + 300
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def wait_ready(self, timeout: float = 600) -> None:
        assert self.loop.ready.wait(timeout), self.loop.error

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30)

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        return httpx.post(self.url + path, timeout=60, **kw)

    def info(self) -> dict:
        return self.get("/server_info").json()

    def wait_idle(self, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while True:
            info = self.info()
            if info["requests"]["in_flight"] == 0 and info["idle_integrity"] == "ok":
                return info
            assert time.time() < deadline, f"server not idle: {info['requests']} {info['kv']}"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.loop.stop()


@contextlib.contextmanager
def slowed(srv: Live, seconds: float = 0.02):
    """Make every engine step take a little longer, so a stream surely outlives what the test does meanwhile."""
    engine = srv.loop.llm.engine
    real_step = engine.step
    engine.step = lambda: (time.sleep(seconds), real_step())[1]
    try:
        yield
    finally:
        del engine.step


def chat_messages(i: int) -> list[dict]:
    return [{"role": "system", "content": "Complete the code."}, {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
