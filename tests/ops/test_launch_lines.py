"""`specserve launch` judges progress on whole lines: an access-log line whose text and newline
arrive in separate writes (Python's `print` under PYTHONUNBUFFERED=1) is not progress, and an
unfinished line counts only once it stays unfinished (a real "loading ... done" line)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil

from specserve.ops import supervisor as sup

from served import free_port

FAKE = Path(__file__).parent / "fake_servers"
ACCESS = b'INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 503 Service Unavailable'


class _ListLog:
    def __init__(self):
        self.rows = []

    def write(self, tag, text, t=None):
        self.rows.append((tag, text))


def _reader(grace: float) -> tuple[sup.OutputReader, int]:
    r, w = os.pipe()
    reader = sup.OutputReader(os.fdopen(r, "rb", buffering=0), _ListLog(), partial_grace=grace)
    reader.start()
    return reader, w


def test_access_log_line_written_in_two_pieces_is_not_progress():
    reader, w = _reader(grace=0.5)
    start = reader.last_progress()
    for _ in range(3):
        os.write(w, ACCESS)
        time.sleep(0.1)  # the reader sees the unfinished line before its newline
        assert reader.last_progress() == start
        os.write(w, b"\n")
        time.sleep(0.05)
    assert reader.last_progress() == start and reader.access_lines == 3
    os.close(w)
    assert reader.eof.wait(5)


def test_unfinished_line_counts_once_it_stays_unfinished():
    reader, w = _reader(grace=0.3)
    start = reader.last_progress()
    os.write(w, b"loading weights ...")
    time.sleep(0.1)
    assert reader.last_progress() == start  # too young to tell from a line whose newline is on its way
    time.sleep(0.4)
    counted = reader.last_progress()
    assert counted > start
    os.write(w, b" .")  # more of the same line: its latest bytes count
    time.sleep(0.1)
    assert reader.last_progress() > counted
    os.write(w, b" done\n")
    time.sleep(0.1)
    assert reader._partial is None and reader.last_line == "loading weights ... . done"
    os.write(w, ACCESS)  # an unfinished access-log line never counts, however long it waits
    mark = reader.last_progress()
    time.sleep(0.5)
    assert reader.last_progress() == mark
    os.close(w)
    assert reader.eof.wait(5)


def test_print_access_log_server_answering_503_is_declared_hung(tmp_path):
    stall = 4.0
    port = free_port()
    pidfile = tmp_path / "pids"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve",
            "launch",
            "--stall-timeout",
            str(stall),
            "--health-interval",
            "0.3",
            "--ready-timeout",
            "40",
            "--grace",
            "1",
            "--",
            sys.executable,
            str(FAKE / "stuck_loading.py"),
            "--print-log",
            "--port",
            str(port),
            "--pidfile",
            str(pidfile),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == sup.EXIT_HUNG, out
    rows = [(sup_time(line), line) for line in out.splitlines() if line[:4].isdigit()]
    t_hung = next(t for t, line in rows if "[launch] HUNG" in line)
    server = [(t, line.split("[server] ", 1)[1]) for t, line in rows if "[server] " in line and t <= t_hung]
    t_last = max(t for t, text in server if not sup.is_access_log(text))
    assert t_hung - t_last <= stall + 5, out
    assert sum(sup.is_access_log(text) for _, text in server) >= 5, out  # the polls kept printing all along
    assert "HTTP access-log lines, not counted as progress" in out
    pids = [int(x) for x in pidfile.read_text().split()]
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def sup_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
