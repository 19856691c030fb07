"""`specserve serve` (or `launch` around it) as a subprocess for the fault tests: its output goes
to a file (a pipe nobody reads could fill and stall it) that every failed assertion shows;
deadlines only bound a hang (a loaded machine is slow)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

PY = sys.executable
WORKER_MARK = "specserve.distributed.worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        with open(log_path, "w") as f:
            self.proc = subprocess.Popen(
                [PY, *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.url: str | None = None

    def log(self) -> str:
        return f"exit code {self.proc.poll()}; log:\n{self.log_path.read_text()[-20000:]}"

    def wait_for(self, pattern: str, timeout: float = 600, start: int = 0) -> re.Match:
        """The first match of `pattern` in the log past character `start`."""
        deadline = time.time() + timeout
        while True:
            m = re.compile(pattern).search(self.log_path.read_text(), start)
            if m:
                return m
            assert self.proc.poll() is None and time.time() < deadline, f"no {pattern!r}; {self.log()}"
            time.sleep(0.2)

    def health(self) -> int | None:
        """/health's status code, None when nothing answers."""
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, url: str | None = None, timeout: float = 600) -> None:
        self.url = url or self.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", timeout).group(1)
        deadline = time.time() + timeout
        while self.health() != 200:
            assert self.proc.poll() is None and time.time() < deadline, f"never ready; {self.log()}"
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        """The process and its descendants, alive now."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """Kill whatever is left of the tree (after the test, pass or fail)."""
        for p in reversed(self.tree()):
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


def workers_of(pid: int) -> list[psutil.Process]:
    """The TP worker processes under `pid`, by rank order of their start."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return sorted((p for p in kids if WORKER_MARK in " ".join(p.cmdline())), key=lambda p: p.create_time())


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def sse_events(lines) -> list:
    """The `data:` payloads among server-sent event `lines`, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
