"""Two "nodes" on 127.0.0.1 for the multi-node tests: each a `specserve ... --nnodes 2` process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tiny import CODE_PROMPTS

ENGINE = ["--device", "cpu", "--max-model-len", "96", "--disable-cuda-graph"]
WAIT = 180  # generous: five agents share two cores


def free_port_pair() -> int:
    """A port P with P and P+1 free (the store and node 0's channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def start_node(command: str, rank: int, port: int, extra: list[str], env: dict | None = None, timeout: float = 60):
    args = [
        sys.executable,
        "-m",
        "specserve",
        command,
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--dist-timeout",
        str(timeout),
        *ENGINE,
        *extra,
    ]
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )


def finish(*procs: subprocess.Popen) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out.append((p.returncode, o, e))
    return out


def generate_args(target, draft, extra=()) -> list[str]:
    args = ["--model", str(target), "--max-tokens", "24", "--ignore-eos", "--json", *extra]
    if draft is not None:
        args += ["--draft", str(draft), "--spec-steps", "3"]
    for p in CODE_PROMPTS:
        args += ["--prompt", p]
    return args
