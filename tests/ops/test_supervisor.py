"""`specserve launch` against fake servers (CPU only, no GPU, no network beyond 127.0.0.1).

The slow end-to-end scenarios each take a few seconds of mostly sleeping; they are
started together, in the background, the first time a test needs one (only those
whose tests were selected), so the whole file takes about as long as the longest one.
Every scenario runs with a fake `pynvml` first on PYTHONPATH, so the results do not
depend on the GPUs (or their absence) of the machine running the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from specserve.ops import supervisor as sup
from specserve.ops.process_tree import ProcessTree, device_holders, stop_tree

FAKE = Path(__file__).parent / "fake_servers"
FAKE_NVML = FAKE / "fake_nvml"
PY = sys.executable
STALL = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _is_fake(pid: int) -> bool:
    try:
        return any("fake_servers" in a for a in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def survivors(pids: list[int], wait: float = 2.0, zombies_count: bool = True) -> list[str]:
    """Processes of the list still present after up to `wait` s.

    Zombies count unless `zombies_count` is False: the supervisor reaps every zombie of
    its tree (it is their subreaper), so none may be left behind for an init that might
    never collect them.
    """
    end = time.monotonic() + wait
    while True:
        left = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                zombie = p.status() == psutil.STATUS_ZOMBIE
                if (zombie and zombies_count) or (not zombie and _is_fake(pid)):
                    left.append(f"{pid} {p.status()} {' '.join(p.cmdline())}")
            except psutil.Error:
                pass
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if _is_fake(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[(\w+)\] (.*)$")


def parse(out: str) -> list[tuple[float, str, str]]:
    rows = []
    for line in out.splitlines():
        m = TS.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            rows.append((t, m.group(2), m.group(3)))
    return rows


def fake_env(tmp: Path, state: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("FAKE_NVML_STATE", None)
    if state is not None:
        path = tmp / "nvml_state.json"
        path.write_text(json.dumps(state))
        env["FAKE_NVML_STATE"] = str(path)
    return env


@dataclass
class Scenario:
    name: str
    proc: subprocess.Popen
    out_path: Path
    pidfile: Path
    t0: float
    timeout: float
    rc: int | None = None
    out: str = ""
    elapsed: float = 0.0

    def result(self) -> "Scenario":
        if self.rc is None:
            try:
                self.rc = self.proc.wait(timeout=max(1.0, self.t0 + self.timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(
                    f"scenario {self.name}: supervisor still running after {self.timeout} s:\n"
                    + self.out_path.read_text()
                )
            self.elapsed = time.monotonic() - self.t0
            self.out = self.out_path.read_text()
        return self


def start(
    name: str, tmp: Path, launch_args: list[str], cmd: list[str], state: dict | None = None, timeout: float = 300.0
) -> Scenario:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    out_path = d / "out.txt"
    f = open(out_path, "w")
    cmd = [c.replace("{pidfile}", str(d / "pids")).replace("{dir}", str(d)) for c in cmd]
    if state is not None:
        state = json.loads(json.dumps(state).replace("{pidfile}", str(d / "pids")).replace("{dir}", str(d)))
    proc = subprocess.Popen(
        [PY, "-m", "specserve", "launch", *launch_args, "--", *cmd],
        stdout=f,
        stderr=subprocess.STDOUT,
        env=fake_env(d, state),
        stdin=subprocess.DEVNULL,
    )
    f.close()
    return Scenario(name, proc, out_path, d / "pids", time.monotonic(), timeout)


def _scenarios(tmp: Path, bystander: int) -> dict:
    """name -> (launch args, command, fake NVML state)."""
    quick = ["--grace", "1", "--kill-wait", "5", "--gpu-release-timeout", "3"]
    slow_port, freeze_port, never_port, stuck_port = free_port(), free_port(), free_port(), free_port()
    return {
        "silent": (
            ["--stall-timeout", str(STALL), "--log", str(tmp / "silent" / "launch.log"), *quick],
            [PY, str(FAKE / "silent_hang.py"), "--pidfile", "{pidfile}"],
            None,
        ),
        "stubborn": (
            ["--stall-timeout", str(STALL), *quick],
            [PY, str(FAKE / "stubborn_tree.py"), "--pidfile", "{pidfile}"],
            {
                "gpus": [
                    {
                        "name": "Fake H200",
                        "total_mib": 143771,
                        "base_mib": 500,
                        "pidfile": "{pidfile}",
                        "pidfile_mib": 9000,
                    }
                ]
            },
        ),
        "crash": (
            ["--stall-timeout", "30", *quick],
            [PY, str(FAKE / "stubborn_tree.py"), "--pidfile", "{pidfile}", "--exit-code", "3"],
            None,
        ),
        "slow": (
            ["--stall-timeout", "3", *quick],
            [
                PY,
                str(FAKE / "slow_server.py"),
                "--port",
                str(slow_port),
                "--load-seconds",
                "7",
                "--line-every",
                "0.3",
                "--cr",
                "--serve-seconds",
                "4.5",
                "--pidfile",
                "{pidfile}",
            ],
            None,
        ),
        "stuck_loading": (
            ["--stall-timeout", str(STALL), "--health-interval", "0.3", *quick],
            [PY, str(FAKE / "stuck_loading.py"), "--port", str(stuck_port), "--pidfile", "{pidfile}"],
            None,
        ),
        "ready_timeout": (
            ["--stall-timeout", "30", "--ready-timeout", "3", *quick],
            [
                PY,
                str(FAKE / "slow_server.py"),
                "--port",
                str(never_port),
                "--load-seconds",
                "60",
                "--pidfile",
                "{pidfile}",
            ],
            None,
        ),
        "freeze": (
            ["--stall-timeout", str(STALL), "--health-interval", "0.3", *quick],
            [
                PY,
                str(FAKE / "slow_server.py"),
                "--port",
                str(freeze_port),
                "--load-seconds",
                "0.5",
                "--freeze-after",
                "2",
                "--pidfile",
                "{pidfile}",
            ],
            None,
        ),
        "fallback": (
            [
                "--stall-timeout",
                str(STALL),
                "--restarts",
                "2",
                "--restart-delay",
                "0.2",
                "--fallback-args",
                "--disable-cuda-graph",
                *quick,
            ],
            [PY, str(FAKE / "silent_hang.py"), "--pidfile", "{pidfile}", "--works-with", "disable-cuda-graph"],
            None,
        ),
        "exhausted": (
            ["--stall-timeout", "30", "--restarts", "2", "--restart-delay", "0.1", *quick],
            [PY, "-c", "import sys; print('boom', flush=True); sys.exit(3)"],
            None,
        ),
        "gpu_leak": (
            ["--stall-timeout", str(STALL), "--restarts", "1", *quick],
            [PY, str(FAKE / "silent_hang.py"), "--pidfile", "{pidfile}", "--touch", "{dir}/flag"],
            {
                "gpus": [
                    {
                        "name": "Fake H200",
                        "total_mib": 143771,
                        "base_mib": 500,
                        "pidfile": "{pidfile}",
                        "pidfile_mib": 30000,
                    },
                    {
                        "name": "Fake H200",
                        "total_mib": 143771,
                        "base_mib": 500,
                        "holders": [{"pid": 4194000, "mib": 70000, "when_file": "{dir}/flag"}],
                    },
                ]
            },
        ),
        # The extra memory belongs to a visible process outside the tree: named, not killed,
        # and not a cleanup failure.
        "gpu_other": (
            ["--stall-timeout", str(STALL), *quick],
            [PY, str(FAKE / "silent_hang.py"), "--pidfile", "{pidfile}", "--touch", "{dir}/flag"],
            {
                "gpus": [
                    {
                        "name": "Fake H200",
                        "total_mib": 143771,
                        "base_mib": 500,
                        "holders": [{"pid": bystander, "mib": 20000, "when_file": "{dir}/flag"}],
                    }
                ]
            },
        ),
    }


SCENARIO_OF_TEST = {
    "test_silent_hang_detected_and_tree_stopped": "silent",
    "test_stubborn_tree_with_escaped_daemon_is_killed": "stubborn",
    "test_crash_leaving_workers_behind": "crash",
    "test_slow_but_logging_server_is_never_killed": "slow",
    "test_stuck_loading_behind_a_live_http_loop": "stuck_loading",
    "test_ready_timeout": "ready_timeout",
    "test_hang_after_ready": "freeze",
    "test_restart_with_fallback_args": "fallback",
    "test_restarts_exhausted": "exhausted",
    "test_gpu_memory_not_released": "gpu_leak",
    "test_gpu_memory_of_another_process": "gpu_other",
}


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    wanted = {SCENARIO_OF_TEST[i.name] for i in request.session.items if i.name in SCENARIO_OF_TEST}
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    started = {name: start(name, tmp, *spec) for name, spec in _scenarios(tmp, bystander.pid).items() if name in wanted}
    started["bystander"] = bystander
    yield started
    bystander.kill()
    bystander.wait()
    for s in started.values():
        if not isinstance(s, Scenario):
            continue
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        kill_leftovers(read_pids(s.pidfile))


def launched(scenarios, name: str) -> Scenario:
    s = scenarios[name].result()
    print(s.out)  # shown by pytest when the test fails
    return s


def hang_latency(rows) -> float:
    """Seconds between the server's last output line and the HUNG verdict."""
    t_hung = next(t for t, tag, text in rows if tag == "launch" and text.startswith("HUNG"))
    t_last = max(t for t, tag, _ in rows if tag == "server" and t <= t_hung)
    return t_hung - t_last


# ---------------------------------------------------------------------------- end to end
def test_silent_hang_detected_and_tree_stopped(scenarios):
    s = launched(scenarios, "silent")
    assert s.rc == sup.EXIT_HUNG
    rows = parse(s.out)
    assert STALL - 0.2 <= hang_latency(rows) <= STALL + 5
    assert "capturing CUDA graphs" in s.out and "HUNG: no output for 2 s" in s.out
    assert "GPU memory check skipped" in s.out  # the fake pynvml without state = no driver
    if shutil.which("py-spy") is None:
        assert "py-spy is not installed" in s.out and "pip install py-spy" in s.out
    else:  # the hung process's Python stack, in the log
        assert "py-spy dump of" in s.out and re.search(r"\[stacks\] .*silent_hang\.py:\d+", s.out)
    assert "process tree stopped" in s.out
    assert read_pids(s.pidfile) and survivors(read_pids(s.pidfile)) == []
    log = (s.out_path.parent / "launch.log").read_text()
    assert "[server] capturing CUDA graphs" in log and "[launch] HUNG" in log


def test_stubborn_tree_with_escaped_daemon_is_killed(scenarios):
    s = launched(scenarios, "stubborn")
    assert s.rc == sup.EXIT_HUNG
    pids = read_pids(s.pidfile)
    assert len(pids) == 7  # main, 2 children, 2 grandchildren, daemonizer, setsid'd daemon
    assert STALL - 0.2 <= hang_latency(parse(s.out)) <= STALL + 5
    assert "needed SIGKILL" in s.out and "--role daemon" in s.out
    assert survivors(pids) == []
    # The fake GPU listed the tree's processes (9000 MiB each); all of it came back.
    assert re.search(r"GPU 0:\s+500 ->\s+500 MiB\s+released", s.out)


def test_crash_leaving_workers_behind(scenarios):
    s = launched(scenarios, "crash")
    assert s.rc == sup.EXIT_CRASHED
    assert "exited with status 3" in s.out
    assert "still running after the server exited" in s.out
    pids = read_pids(s.pidfile)
    assert len(pids) == 7 and survivors(pids) == []


@pytest.mark.slow
def test_slow_but_logging_server_is_never_killed(scenarios):
    s = launched(scenarios, "slow")
    assert s.rc == sup.EXIT_OK, "the slow server must not be killed"
    assert "HUNG" not in s.out and "SIGTERM" not in s.out
    rows = parse(s.out)
    t_ready = next(t for t, tag, text in rows if text.startswith("READY"))
    loading = [t for t, tag, text in rows if tag == "server" and "loading weights" in text]
    assert len(loading) >= 5 and loading[-1] - loading[0] > 3  # longer than the stall timeout
    assert t_ready > loading[-1]
    assert "shutting down cleanly" in s.out  # quiet for > stall timeout after READY, /health kept it alive
    assert survivors(read_pids(s.pidfile)) == []


def test_stuck_loading_behind_a_live_http_loop(scenarios):
    # /health answers 503 and every poll adds an access-log line: the log is busy, yet
    # nothing progresses. Measured from the last line that is not an access-log line.
    s = launched(scenarios, "stuck_loading")
    assert s.rc == sup.EXIT_HUNG
    rows = parse(s.out)
    t_hung = next(t for t, tag, text in rows if tag == "launch" and text.startswith("HUNG"))
    server = [(t, text) for t, tag, text in rows if tag == "server" and t <= t_hung]
    access = [t for t, text in server if sup.is_access_log(text)]
    t_last = max(t for t, text in server if not sup.is_access_log(text))
    assert STALL - 0.2 <= t_hung - t_last <= STALL + 5
    assert len([t for t in access if t > t_last]) >= 3  # the polls kept printing all along
    assert "HTTP access-log lines, not counted as progress" in s.out
    assert "last line at" in s.out and "loading weights: file 1/2" in s.out
    assert "health: " in s.out and "HTTP 503" in s.out
    assert "processes of the tree (1):" in s.out  # the stack/process dump ran
    if shutil.which("py-spy") is not None:
        assert re.search(r"\[stacks\] .*stuck_loading\.py:\d+", s.out)
    assert "process tree stopped" in s.out
    assert read_pids(s.pidfile) and survivors(read_pids(s.pidfile)) == []


def test_access_log_lines_are_recognised():
    for line in [
        'INFO:     127.0.0.1:53422 - "GET /health HTTP/1.1" 503 Service Unavailable',
        '\x1b[32mINFO\x1b[0m:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" \x1b[32m200 OK\x1b[0m',
        '127.0.0.1 - - [01/Dec/2026 10:00:00] "GET /health HTTP/1.0" 200 -',
    ]:
        assert sup.is_access_log(line), line
    for line in [
        "2026-12-01 10:00:00 INFO specserve.server: captured graph 3/40 decode batch 8",
        "loading weights: file 1/2",
        'error: bad "GET" in the config',
    ]:
        assert not sup.is_access_log(line), line


def test_output_reader_ignores_access_log_lines_for_activity():
    r, w = os.pipe()
    reader = sup.OutputReader(os.fdopen(r, "rb", buffering=0), _ListLog())
    reader.start()
    os.write(w, b"loading\n")
    time.sleep(0.2)
    t_progress = reader.last_activity
    for _ in range(3):
        time.sleep(0.1)
        os.write(w, b'INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 503 Service Unavailable\n')
    time.sleep(0.2)
    assert reader.last_activity == t_progress and reader.access_lines == 3
    assert reader.last_line == "loading"
    os.write(w, b"captured graph 1/4\r")
    time.sleep(0.2)
    assert reader.last_activity > t_progress and reader.access_lines == 0
    os.close(w)
    assert reader.eof.wait(5)


def test_ready_timeout(scenarios):
    s = launched(scenarios, "ready_timeout")
    assert s.rc == sup.EXIT_READY_TIMEOUT
    assert "NOT READY within --ready-timeout 3 s" in s.out and "HUNG" not in s.out
    assert survivors(read_pids(s.pidfile)) == []


def test_hang_after_ready(scenarios):
    s = launched(scenarios, "freeze")
    assert s.rc == sup.EXIT_HUNG
    assert "READY after" in s.out and "no output and no HTTP 200" in s.out
    rows = parse(s.out)
    t_ready = next(t for t, _, text in rows if text.startswith("READY"))
    t_hung = next(t for t, _, text in rows if text.startswith("HUNG"))
    # frozen 2 s after serving; declared hung about STALL s later
    assert STALL <= t_hung - t_ready <= 2 + STALL + 5
    assert survivors(read_pids(s.pidfile)) == []


def test_restart_with_fallback_args(scenarios):
    s = launched(scenarios, "fallback")
    assert s.rc == sup.EXIT_OK
    assert "attempt 1/3" in s.out and "attempt 2/3" in s.out and "attempt 3/3" not in s.out
    assert "restarting with fallback args --disable-cuda-graph" in s.out
    assert "fallback flag --disable-cuda-graph given" in s.out
    attempt2 = next(line for line in s.out.splitlines() if "attempt 2/3" in line)
    assert attempt2.endswith("--works-with disable-cuda-graph --disable-cuda-graph")
    assert survivors(read_pids(s.pidfile)) == []


def test_restarts_exhausted(scenarios):
    s = launched(scenarios, "exhausted")
    assert s.rc == sup.EXIT_CRASHED
    assert s.out.count("[server] boom") == 3 and "attempt 3/3" in s.out


def test_gpu_memory_not_released(scenarios):
    s = launched(scenarios, "gpu_leak")
    assert s.rc == sup.EXIT_CLEANUP_FAILED
    assert re.search(r"GPU 0:\s+500 ->\s+500 MiB\s+released", s.out)
    assert re.search(r"GPU 1:\s+500 ->\s+70500 MiB\s+NOT RELEASED \(\+70000 MiB\)", s.out)
    assert "GPU 1 held by pid 4194000 (70000 MiB)" in s.out
    assert "not restarting" in s.out and "attempt 2/2" not in s.out
    assert survivors(read_pids(s.pidfile)) == []


def test_gpu_memory_of_another_process(scenarios):
    s = launched(scenarios, "gpu_other")
    bystander = scenarios["bystander"]
    assert s.rc == sup.EXIT_HUNG
    assert re.search(r"GPU 0:\s+500 ->\s+20500 MiB\s+NOT RELEASED", s.out)
    assert f"GPU 0 held by pid {bystander.pid} (20000 MiB)" in s.out
    assert "not of this launch, older: not killed" in s.out
    assert "belongs to processes outside this launch" in s.out
    assert bystander.poll() is None  # never signalled
    assert survivors(read_pids(s.pidfile)) == []


# ---------------------------------------------------------------------------- quick ones
def run_launch(args, tmp_path, timeout=300):
    return subprocess.run(
        [PY, "-m", "specserve", "launch", *args],
        capture_output=True,
        text=True,
        env=fake_env(tmp_path),
        timeout=timeout,
    )


def test_ctrl_c_stops_the_whole_tree(tmp_path):
    pidfile = tmp_path / "pids"
    # Ctrl-C's default action in launch, also when pytest itself runs with SIGINT ignored (`cmd &` in a
    # script, `nohup`): launch keeps an inherited SIG_IGN by design, and would then ignore this SIGINT.
    p = subprocess.Popen(
        [
            PY,
            "-m",
            "specserve",
            "launch",
            "--stall-timeout",
            "30",
            "--grace",
            "1",
            "--",
            PY,
            str(FAKE / "stubborn_tree.py"),
            "--pidfile",
            str(pidfile),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=fake_env(tmp_path),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = []
    try:
        deadline = time.monotonic() + 300
        for line in p.stdout:
            out.append(line)
            if "tree up" in line or time.monotonic() > deadline:
                break
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=300)
        out.append(rest)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        pids = read_pids(pidfile)
        left = survivors(pids)
        kill_leftovers(pids)
    text = "".join(out)
    print(text)
    assert p.returncode == sup.EXIT_OK
    assert "stop requested: SIGINT" in text and "exit 0: stopped by the user" in text
    assert len(pids) == 7 and left == []


def test_command_not_found(tmp_path):
    r = run_launch(["--stall-timeout", "5", "--", "/nonexistent/server-binary", "--port", "1"], tmp_path)
    assert r.returncode == sup.EXIT_START_FAILED, r.stdout + r.stderr
    assert "could not start" in r.stdout


def test_usage_errors(tmp_path):
    assert run_launch([], tmp_path).returncode == sup.EXIT_USAGE
    assert run_launch(["--stall-timeout", "0", "--", "true"], tmp_path).returncode == sup.EXIT_USAGE
    r = run_launch(["--ready-timeout", "5", "--health", "none", "--", "true"], tmp_path)
    assert r.returncode == sup.EXIT_USAGE and "needs a health URL" in r.stderr


def test_clean_exit_and_no_torch(tmp_path):
    r = run_launch(
        ["--stall-timeout", "5", "--", PY, "-c", "import sys; print('modules', 'torch' in sys.modules)"], tmp_path
    )
    assert r.returncode == sup.EXIT_OK, r.stdout
    r = subprocess.run(
        [PY, "-c", "import sys, specserve.ops.supervisor, specserve.ops.gpus; sys.exit(int('torch' in sys.modules))"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, "the supervisor must not import torch"


# ---------------------------------------------------------------------------- units
@pytest.mark.parametrize(
    "cmd, url",
    [
        (["specserve", "serve", "--port", "8123"], "http://127.0.0.1:8123/health"),
        (["x", "--host", "0.0.0.0", "--port=9000"], "http://127.0.0.1:9000/health"),
        (["x", "--host", "10.1.2.3", "--port", "9000"], "http://10.1.2.3:9000/health"),
        (["x", "--host", "::", "--port", "9000"], "http://[::1]:9000/health"),
        (["vllm", "serve", "meta-llama/Llama-3.1-8B"], "http://127.0.0.1:8000/health"),
        (["python", "-m", "sglang.launch_server", "--model-path", "m"], "http://127.0.0.1:30000/health"),
        (["python", "-m", "sglang.launch_server", "--port", "31000"], "http://127.0.0.1:31000/health"),
        (["python", "my_server.py"], None),
        (["specserve", "serve", "--nnodes", "2", "--node-rank", "1", "--port", "8000"], None),  # headless: no HTTP
        (["specserve", "serve", "--node-rank=0", "--port", "9000"], "http://127.0.0.1:9000/health"),
    ],
)
def test_infer_health_url(cmd, url):
    assert sup.infer_health_url(cmd)[0] == url


def test_fallback_args_may_start_with_dashes():
    import argparse

    p = argparse.ArgumentParser()
    sup.add_arguments(p)
    a = p.parse_args(
        [
            "--fallback-args",
            "--disable-cuda-graph",
            "--restarts",
            "1",
            "--log",
            "f",
            "--",
            "python",
            "--fallback-args",
            "x",
        ]
    )
    assert a.fallback_args == "--disable-cuda-graph" and a.restarts == 1 and a.log == "f"
    assert a.cmd == ["--", "python", "--fallback-args", "x"]  # CMD is left alone (run() drops "--")
    a = p.parse_args(["--fallback-args", "--disable-cuda-graph --cuda-graph-max-bs 8", "vllm", "serve"])
    assert a.fallback_args.split() == ["--disable-cuda-graph", "--cuda-graph-max-bs", "8"]
    assert a.cmd == ["vllm", "serve"]


class _ListLog:
    def __init__(self):
        self.rows = []

    def write(self, tag, text, t=None):
        self.rows.append((tag, text))


def test_output_reader_lines_and_progress():
    r, w = os.pipe()
    log = _ListLog()
    reader = sup.OutputReader(os.fdopen(r, "rb", buffering=0), log, progress_every=1000.0)
    reader.start()
    for chunk in [b"one\n", b"two\r", b"\n", b"50%\r60%\r70%\r", b"\nthree\r\nfour", b" five"]:
        os.write(w, chunk)
        time.sleep(0.05)
    os.close(w)
    assert reader.eof.wait(5)
    texts = [t for _, t in log.rows]
    # \r\n split over two reads is still one line ("two", "70%"); the throttled progress
    # updates in between (50%, 60%) are dropped.
    assert texts == ["one", "two", "70%", "three", "four five"]


def test_process_tree_stops_stubborn_tree_in_process(tmp_path):
    pidfile = tmp_path / "pids"
    root = subprocess.Popen(
        [PY, str(FAKE / "stubborn_tree.py"), "--pidfile", str(pidfile)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # An unrelated process started after the root: never part of the tree.
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        assert "tree up" in root.stdout.readline()
        tree = ProcessTree(root.pid, session_leader=True)
        members = {p.pid for p in tree.members(full=True)}
        pids = read_pids(pidfile)
        assert bystander.pid not in members
        assert root.pid in members and len(members) >= 5  # the setsid'd daemon escaped here:
        logs = []  # no subreaper, no env marker
        res = stop_tree(tree, grace=0.5, kill_wait=5, log=logs.append, on_tick=root.poll)
        assert res.clean and res.sigkilled
        assert root.wait(5) == -signal.SIGKILL
        assert bystander.poll() is None, "a process outside the tree was signalled"
        daemon = [pid for pid in pids if pid not in members]
        # Zombies may linger here: without a subreaper they are init's to collect.
        assert survivors([pid for pid in pids if pid in members], zombies_count=False) == []
    finally:
        bystander.kill()
        bystander.wait()
        kill_leftovers(read_pids(pidfile))
    assert daemon  # the double-forked daemon; the supervisor finds it as subreaper (see above)


def test_device_holders(tmp_path):
    dev = tmp_path / "nvidia-like-device"
    dev.write_text("")
    holder = subprocess.Popen(
        [PY, "-c", f"f = open({str(dev)!r}); print('open', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        found = device_holders(prefix=str(dev))
        assert found.get(holder.pid) == [str(dev)]
        assert os.getpid() not in found
    finally:
        holder.kill()
        holder.wait()


def test_exit_codes_are_documented():
    doc = sup.__doc__
    for code in sup.EXIT_CODES:
        assert re.search(rf"^\s+{code}\s+\S", doc, re.M), f"exit code {code} missing from the docstring"


def test_marker_and_session_find_non_descendants(tmp_path):
    """Members that are not descendants: an orphan in the root's session, a marked process."""
    sleep = [PY, "-c", "import time; time.sleep(60)"]
    env = dict(os.environ, SPECSERVE_LAUNCH_ID="test-marker-123")
    # The root double-forks an orphan that stays in its session but leaves its process
    # group and drops the marker: only the session id ties it to the tree.
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.setpgid(0, 0)\n"
        "        env = {k: v for k, v in os.environ.items() if k != 'SPECSERVE_LAUNCH_ID'}\n"
        "        os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'], env)\n"
        "    print(pid, flush=True)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(60)\n"
    )
    root = subprocess.Popen([PY, "-c", code], start_new_session=True, env=env, stdout=subprocess.PIPE, text=True)
    marked = subprocess.Popen(sleep, start_new_session=True, env=env)  # own session, marker
    bystander = subprocess.Popen(sleep, start_new_session=True)  # own session, no marker
    orphan = int(root.stdout.readline())
    try:
        tree = ProcessTree(root.pid, marker="test-marker-123", session_leader=True)
        members = {p.pid for p in tree.members(full=True)}
        assert {root.pid, marked.pid, orphan} <= members
        assert bystander.pid not in members and os.getpid() not in members
        res = stop_tree(tree, grace=2, kill_wait=5, log=lambda m: None, on_tick=root.poll)
        assert res.clean
        assert root.wait(5) == -signal.SIGTERM and marked.wait(5) == -signal.SIGTERM
        end = time.monotonic() + 60
        while _is_sleeper(orphan) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _is_sleeper(orphan), "the orphan in the root's session survived"
        assert bystander.poll() is None
    finally:
        for p in (root, marked, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()
        if _is_sleeper(orphan):
            os.kill(orphan, signal.SIGKILL)


def _is_sleeper(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "time.sleep(60)" in " ".join(p.cmdline())
    except psutil.Error:
        return False


@pytest.mark.gpu
def test_gpu_hang_is_killed_and_memory_released(tmp_path):
    """Real GPU, real NVML: a main process and a SIGTERM-ignoring worker hold 4 GiB each."""
    pidfile = tmp_path / "pids"
    r = subprocess.run(
        [
            PY,
            "-m",
            "specserve",
            "launch",
            "--stall-timeout",
            "5",
            "--grace",
            "2",
            "--gpu-release-timeout",
            "60",
            "--",
            PY,
            str(FAKE / "gpu_hang.py"),
            "--gib",
            "4",
            "--pidfile",
            str(pidfile),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(r.stdout, r.stderr)
    pids = read_pids(pidfile)
    try:
        assert r.returncode == sup.EXIT_HUNG
        assert "GPU memory check skipped" not in r.stdout
        assert re.search(r"GPU 0: .* MiB\s+released", r.stdout)
        assert len(pids) == 2 and survivors(pids) == []
        assert "needed SIGKILL" in r.stdout  # the worker ignored SIGTERM
    finally:
        kill_leftovers(pids)
