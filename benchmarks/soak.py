"""Bounded soak and fuzz run of `specserve serve` on this machine's loopback.

    python benchmarks/soak.py [--rounds 20] [--requests 200] [--concurrency 24]
                              [--disconnects 50] [--max-tokens 16] [--time-limit 540]
                              [--serve-args "..."] [--json FILE]

Starts `specserve serve` (the bundled demo pair unless --serve-args names a model) on a
free 127.0.0.1 port and, while a thread probes /health every 0.2 s and samples the
server's RSS:

1. fuzz: every bad body of both request schemas (wrong types, huge, negative, NaN,
   empty, nested, lone surrogates, deep nesting, unknown roles, not JSON) while a few
   streams run; each must get a 4xx and every stream must still end with [DONE];
2. `--rounds` rounds of `--requests` streams (completions and chat, greedy and seeded
   sampling, every 4th with logprobs, every 5th with a prompt of `--long-prompt-words`
   words, chat requests with a JSON-schema `response_format` or with `tools` (auto and
   required)) at `--concurrency`; each must end with [DONE] and no error event;
3. `--disconnects` streams closed after their first chunk; the server must go back to
   no running sequences.

Prints requests, failures by reason, RSS start/end/max per round, whether RSS reached a
plateau and the largest /health latency; `--json FILE` writes the same. It stops by
itself: the counts are bounded and no round starts after --time-limit seconds (the
rounds left out are reported). Exit status 0 when nothing failed and RSS plateaued.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

MODEL = "demo"
# RSS may rise while the allocator and caches warm up; after that, a round may end at most
# this much above the end of the first round of the second half of the run.
PLATEAU_MIB = 8.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Monitor(threading.Thread):
    """Probes /health and samples the server's RSS until stopped."""

    def __init__(self, port: int, pid: int, every: float = 0.2):
        super().__init__(name="monitor", daemon=True)
        self.port, self.every = port, every
        self.proc = psutil.Process(pid)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.health_max_ms = 0.0
        self.health_failures = 0
        self.rss_max = 0.0  # MiB since the last reset

    def rss(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def reset_rss_max(self) -> float:
        with self.lock:
            self.rss_max = self.rss()
            return self.rss_max

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                c.request("GET", "/health")
                ok = c.getresponse().status == 200
                c.close()
            except OSError:
                ok = False
            ms = (time.perf_counter() - t) * 1000
            with self.lock:
                self.health_max_ms = max(self.health_max_ms, ms)
                self.health_failures += not ok
                try:
                    self.rss_max = max(self.rss_max, self.rss())
                except psutil.Error:
                    pass
            self.stop.wait(self.every)


# ----------------------------------------------------------------------------- bodies
LONG_PROMPT_WORDS = 0  # set from --long-prompt-words


ROW_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def good_body(i: int, max_tokens: int, stream: bool = True) -> tuple[str, dict]:
    sampling = {"temperature": 0.8, "seed": i} if i % 3 == 0 else {"temperature": 0}
    text = f"Write function number {i}."
    if i % 5 == 4 and LONG_PROMPT_WORDS:
        text = " ".join(f"value_{i}_{k} = {k} * x" for k in range(LONG_PROMPT_WORDS // 5)) + "\n" + text
    if i % 2:
        extra = {"logprobs": True, "top_logprobs": 2} if i % 4 == 3 else {}
        if i % 6 == 1:  # a JSON-schema reply (enforced by the grammar; with speculation, verified under it)
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "row", "schema": ROW_SCHEMA}}
        elif i % 6 == 5:  # tools, the model choosing (auto) or made to call one (required)
            extra |= {"tools": [LOOKUP_TOOL], "tool_choice": "required" if i % 12 == 11 else "auto"}
        return "/v1/chat/completions", {
            "model": MODEL,
            "stream": stream,
            "max_tokens": max_tokens,
            **sampling,
            **extra,
            "messages": [{"role": "user", "content": text}],
        }
    extra = {"logprobs": 2} if i % 4 == 0 else {}
    return "/v1/completions", {
        "model": MODEL,
        "stream": stream,
        "max_tokens": max_tokens,
        **sampling,
        **extra,
        "prompt": f"# {text}\ndef function_{i}(x):",
    }


NAN, INF = object(), object()  # written as the bare JSON extensions NaN and Infinity
# Per field, values that no correct server accepts (types, ranges, int64 overflow, NaN).
BAD_VALUES = {
    "max_tokens": ["x", [1], {"a": 1}, -1, 2**63, 10**40, NAN, INF],
    "temperature": ["x", [1], {"a": 1}, -1, NAN, INF],
    "top_p": ["x", [1], -1, 2, NAN],
    "top_k": ["x", [1], -2, -(2**63), 2**63, 10**40, NAN],
    "min_p": ["x", -1, 2, NAN],
    "n": ["x", 0, -1, 2**63, 10**40, NAN],
    "seed": ["x", [1], {"a": 1}, 10**40, NAN],
    "stop": [5, [1], {"a": 1}, [[["x"]]]],
    "stream": ["x", [1], {"a": 1}],
    "presence_penalty": ["x", -3, 3, NAN],
    "frequency_penalty": ["x", -3, 3, NAN],
    "logprobs": ["x", -1, [1], {"a": 1}],
    "top_logprobs": ["x", -1, [1], NAN],
    "stream_options": ["x", [1], {"include_usage": "x"}],
    "model": [5, [1], {"a": 1}, "no-such-model"],
}


def _raw(body: dict) -> bytes:
    text = json.dumps(body)
    return text.replace('"__NaN__"', "NaN").replace('"__Inf__"', "Infinity").encode()


def fuzz_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of requests every one of which must be refused with a 4xx."""
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out: list[tuple[str, str, bytes]] = []
    for schema, path, base in (("completions", "/v1/completions", comp), ("chat", "/v1/chat/completions", chat)):
        for field, values in BAD_VALUES.items():
            for v in values:
                label = "NaN" if v is NAN else "Infinity" if v is INF else json.dumps(v)[:24]
                v = "__NaN__" if v is NAN else "__Inf__" if v is INF else v
                out.append((f"{schema}.{field}={label}", path, _raw({**base, field: v})))
        out.append((f"{schema}.deep_nesting", path, b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
        out.append((f"{schema}.not_json", path, b"{not json"))
        out.append((f"{schema}.not_an_object", path, b"[1, 2, 3]"))
        out.append((f"{schema}.empty_body", path, b""))
        out.append((f"{schema}.no_model", path, _raw({k: v for k, v in base.items() if k != "model"})))
    for name, v in (
        ("list_of_objects", [{"a": 1}]),
        ("nested", [[["x"]]]),
        ("number", 5),
        ("empty_list", []),
        ("huge_token_id", [2**63]),
        ("negative_token_id", [-1]),
        ("null", None),
    ):
        out.append((f"completions.prompt={name}", "/v1/completions", _raw({**comp, "prompt": v})))
    out.append(
        (
            "completions.prompt=lone_surrogate",
            "/v1/completions",
            b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 4}',
        )
    )
    for name, messages in (
        ("empty", []),
        ("string", "hi"),
        ("no_role", [{"content": "x"}]),
        ("unknown_role", [{"role": "wizard", "content": "x"}]),
        ("content_number", [{"role": "user", "content": 5}]),
        ("nested", [[{"role": "user", "content": "x"}]]),
    ):
        out.append((f"chat.messages={name}", "/v1/chat/completions", _raw({**chat, "messages": messages})))
    out.append(
        (
            "chat.messages=lone_surrogate",
            "/v1/chat/completions",
            b'{"model": "demo", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}',
        )
    )
    return out


# ----------------------------------------------------------------------------- client
async def one_stream(
    client: httpx.AsyncClient, url: str, path: str, body: dict, failures: Counter, disconnect: bool = False
) -> bool:
    """True when the stream ended with [DONE] and no error event (or, with `disconnect`,
    when its first chunk arrived before the client hung up)."""
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                failures[f"HTTP {r.status_code}"] += 1
                return False
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if disconnect:
                    return True  # leaving the block closes the connection mid-stream
                data = line[6:]
                if data == "[DONE]":
                    done = True
                elif '"error"' in data and "error" in json.loads(data):
                    failures["error event in the stream"] += 1
                    return False
            if not done:
                failures["stream ended without [DONE]"] += 1
            return done
    except httpx.HTTPError as e:
        failures[f"client {type(e).__name__}"] += 1
        return False


async def run_streams(
    url: str, n: int, concurrency: int, max_tokens: int, failures: Counter, offset: int = 0, disconnect: bool = False
) -> int:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker(i: int) -> bool:
            async with sem:
                path, body = good_body(offset + i, max_tokens)
                return await one_stream(client, url, path, body, failures, disconnect)

        return sum(await asyncio.gather(*(worker(i) for i in range(n))))


async def run_fuzz(url: str, max_tokens: int, failures: Counter) -> dict:
    """The fuzz set while 8 streams run; every 5xx or broken stream is a failure."""
    bodies = fuzz_bodies()
    statuses: Counter = Counter()
    accepted: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        streams = asyncio.gather(*(one_stream(client, url, *good_body(i, max_tokens * 4), failures) for i in range(8)))

        async def bad(name: str, path: str, raw: bytes) -> None:
            try:
                r = await client.post(url + path, content=raw, headers={"Content-Type": "application/json"})
            except httpx.HTTPError as e:
                failures[f"fuzz {name}: client {type(e).__name__}"] += 1
                return
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                failures[f"fuzz {name}: HTTP {r.status_code}"] += 1
            elif r.status_code < 400:
                accepted.append(name)  # not a crash, but a bad body that went through: reported

        for k in range(0, len(bodies), 8):
            await asyncio.gather(*(bad(*b) for b in bodies[k : k + 8]))
        ok = sum(await streams)
    print(
        f"fuzz: {len(bodies)} bad bodies, statuses {dict(sorted(statuses.items()))}, "
        f"{ok}/8 concurrent streams completed",
        flush=True,
    )
    if accepted:
        print(f"fuzz: accepted with 2xx (expected a 4xx): {', '.join(accepted)}", flush=True)
    return {
        "requests": len(bodies),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "accepted": accepted,
        "concurrent_streams_completed": ok,
        "of": 8,
    }


def running_sequences(url: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    vals = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(("specserve:num_requests_running", "specserve:num_requests_waiting"))
    ]
    return sum(vals) if vals else None


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=200, help="streams per round (default 200)")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--disconnects", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--long-prompt-words",
        type=int,
        default=300,
        help="words of every 5th prompt (0: none); must fit the server's --max-model-len",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=540.0,
        metavar="S",
        help="start no round after S seconds of soak (default 540)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="give up when the server is not ready after S seconds (default 900)",
    )
    p.add_argument("--serve-args", default="", help="extra `specserve serve` arguments (shlex-split)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    a = p.parse_args(argv)
    global LONG_PROMPT_WORDS
    LONG_PROMPT_WORDS = a.long_prompt_words
    for name in ("rounds", "requests", "concurrency", "max_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logdir = Path(tempfile.mkdtemp(prefix="specserve-soak-"))
    cmd = [
        sys.executable,
        "-m",
        "specserve",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *shlex.split(a.serve_args),
    ]
    print(f"starting: {shlex.join(cmd)} (log: {logdir / 'serve.log'})", flush=True)
    with open(logdir / "serve.log", "wb") as logf:
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    monitor = None
    try:
        t0 = time.monotonic()
        while True:
            if server.poll() is not None:
                print(
                    f"error: the server exited with status {server.returncode} before it was ready; "
                    f"see {logdir / 'serve.log'}",
                    file=sys.stderr,
                )
                return 1
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > a.startup_timeout:
                print(f"error: not ready within --startup-timeout {a.startup_timeout:g} s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"ready after {time.monotonic() - t0:.1f} s", flush=True)
        monitor = Monitor(port, server.pid)
        monitor.start()
        failures: Counter = Counter()
        results: dict = {
            "command": shlex.join(cmd),
            "rounds": [],
            "rounds_requested": a.rounds,
            "requests_per_round": a.requests,
            "concurrency": a.concurrency,
            "max_tokens": a.max_tokens,
            "long_prompt_words": a.long_prompt_words,
        }
        t_soak = time.monotonic()

        rss0 = monitor.reset_rss_max()
        fuzz = asyncio.run(run_fuzz(url, a.max_tokens, failures))
        n_fuzz = fuzz["requests"]
        results["fuzz"] = fuzz
        requests = n_fuzz + 8

        for r in range(a.rounds):
            if time.monotonic() - t_soak > a.time_limit:
                print(f"--time-limit {a.time_limit:g} s reached: rounds {r + 1}-{a.rounds} not run", flush=True)
                break
            start = monitor.reset_rss_max()
            t = time.monotonic()
            ok = asyncio.run(run_streams(url, a.requests, a.concurrency, a.max_tokens, failures, offset=r * a.requests))
            row = {
                "round": r + 1,
                "requests": a.requests,
                "completed": ok,
                "seconds": round(time.monotonic() - t, 1),
                "rss_start_mib": round(start, 1),
                "rss_end_mib": round(monitor.rss(), 1),
                "rss_max_mib": round(monitor.rss_max, 1),
            }
            results["rounds"].append(row)
            requests += a.requests
            print(
                f"round {r + 1:2d}/{a.rounds}: {ok}/{a.requests} completed in {row['seconds']:6.1f} s; RSS MiB "
                f"start {row['rss_start_mib']:7.1f} end {row['rss_end_mib']:7.1f} max {row['rss_max_mib']:7.1f}",
                flush=True,
            )

        got_first = asyncio.run(
            run_streams(url, a.disconnects, a.concurrency, a.max_tokens * 8, failures, offset=10**6, disconnect=True)
        )
        requests += a.disconnects
        deadline, left = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            left = running_sequences(url)
            if left == 0:
                break
            time.sleep(0.5)
        if left != 0:
            failures[f"sequences still running 60 s after the disconnects: {left}"] += 1
        print(
            f"disconnects: {a.disconnects} streams closed after their first chunk ({got_first} got one); "
            f"sequences left running: {left:g}"
            if left is not None
            else "sequences left running: unknown",
            flush=True,
        )
        results["disconnects"] = {"requests": a.disconnects, "first_chunk_received": got_first, "sequences_left": left}

        ends = [row["rss_end_mib"] for row in results["rounds"]]
        half = ends[len(ends) // 2 :] if len(ends) >= 4 else []
        growth = (max(half) - half[0]) if half else None
        plateau = growth is not None and growth <= PLATEAU_MIB
        if server.poll() is not None:
            failures[f"server exited with status {server.returncode}"] += 1
        results.update(
            {
                "requests": requests,
                "failures": dict(failures),
                "failed": sum(failures.values()),
                "rss_start_mib": round(rss0, 1),
                "rss_end_mib": round(monitor.rss(), 1),
                "rss_max_mib": round(max([row["rss_max_mib"] for row in results["rounds"]] + [rss0]), 1),
                "rss_growth_second_half_mib": None if growth is None else round(growth, 1),
                "rss_plateau": plateau,
                "plateau_tolerance_mib": PLATEAU_MIB,
                "health_max_ms": round(monitor.health_max_ms, 1),
                "health_failures": monitor.health_failures,
                "soak_seconds": round(time.monotonic() - t_soak, 1),
            }
        )
    finally:
        if monitor is not None:
            monitor.stop.set()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    print(
        f"requests: {results['requests']} (fuzz {n_fuzz} + 8 streams, {len(results['rounds'])} x {a.requests} "
        f"streams, {a.disconnects} disconnects); soak {results['soak_seconds']} s"
    )
    print(f"failures: {results['failed']}" + "".join(f"\n  {n:5d}  {why}" for why, n in failures.most_common()))
    print(
        f"RSS MiB: start {results['rss_start_mib']}, end {results['rss_end_mib']}, max {results['rss_max_mib']}; "
        + (
            "second half of the rounds: too few rounds to judge a plateau"
            if growth is None
            else f"second half of the rounds grew {growth:.1f} MiB: "
            + ("plateau" if plateau else f"NO PLATEAU (tolerance {PLATEAU_MIB:g} MiB)")
        )
    )
    print(f"/health: max latency {results['health_max_ms']} ms, {results['health_failures']} probe(s) not 200")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if not failures and plateau else 1


if __name__ == "__main__":
    sys.exit(main())
