"""`specserve launch`: run a server command under a watchdog.

    specserve launch [--stall-timeout S] [--ready-timeout S] [--health URL|none]
                     [--restarts N] [--fallback-args "..."] [--log FILE] [--grace S]
                     -- CMD ...

Works with any server command: `specserve serve ...`, `python -m sglang.launch_server
...`, `vllm serve ...`. What it does:

- starts CMD in its own session/process group and streams its stdout+stderr with
  timestamps (`2026-11-30 10:01:02.123 [server] ...`); its own lines are `[launch]`,
  stack dumps `[stacks]`; `--log FILE` writes the same lines to FILE too. It sets
  PYTHONUNBUFFERED=1 (unless already set) so Python servers' lines arrive as written.
- polls the health URL (`--health`, else http://HOST:PORT/health from `--port`/`--host` in
  CMD, else the vLLM/SGLang default port when CMD is one of those) and reports READY at
  the first HTTP 200.
- declares the server HUNG when for --stall-timeout seconds it received neither a new
  output line (including a progress-bar update) other than an HTTP access-log line, nor
  an HTTP 200 from the health URL. Access-log lines (`"GET /health HTTP/1.1" 503`) do not
  count: they only prove that the HTTP loop lives, and they are what launch's own polls
  make a server print, so a server whose engine is stuck while its HTTP loop answers 503
  is still flagged. Output is judged on whole lines, whatever the server's buffering: a
  line whose text and newline come in separate writes (Python's `print` under
  PYTHONUNBUFFERED=1) is judged when whole, and an unfinished line counts only once it
  stays unfinished for min(2 s, stall-timeout/4), like "loading ... done". Before READY
  that means no loading progress in the log; after READY it means /health stopped
  answering *and* the log went quiet. A server that is slow but keeps logging progress
  is never killed for a stall (only --ready-timeout, if given, bounds it).
- on a hang (and on --ready-timeout) it prints what every process of the tree is doing
  (state, kernel wait channel, CPU time) and dumps Python stacks with py-spy when py-spy
  is installed (`pip install py-spy`; ptrace rights needed).
- whenever the server stops - hang, crash, clean exit, Ctrl-C - it stops the whole tree:
  SIGTERM, --grace seconds, SIGKILL. The tree is the root's descendants (tracked
  continuously; the supervisor is a child subreaper, so setsid/double-forked workers stay
  its descendants), its process group and session, and any process carrying the
  launch's environment marker. Processes that merely hold /dev/nvidia* without belonging
  to the tree are never signalled, only named.
- checks with NVML that every GPU's used memory went back to its pre-launch level
  (within --gpu-tolerance-mib, waiting up to --gpu-release-timeout) and names the
  processes still holding memory. Without NVML it says so once and skips the check.
- `--restarts N` retries after a hang, a crash or a ready-timeout; every retry appends
  the shlex-split `--fallback-args` (for example `--disable-cuda-graph`) to CMD.
- Ctrl-C / SIGTERM / SIGHUP to `specserve launch`: SIGINT to the server's process group
  (what a terminal would do), --grace seconds for it to exit, then the tree is stopped as
  above. A second Ctrl-C skips the wait.

Exit codes (the last attempt's outcome once restarts are exhausted):

    0  the server exited with status 0, or was stopped by the user (Ctrl-C/SIGTERM)
    1  internal error of the supervisor itself (a Python traceback)
    2  usage error (bad options, no command)
    3  the command could not be started (not found, not executable)
    4  the server exited with a non-zero status or was killed by a signal
    5  hung: no output and no healthy /health for --stall-timeout seconds; tree stopped
    6  not ready (no HTTP 200 from the health URL) within --ready-timeout seconds
    7  cleanup failed: a process of the tree survived SIGKILL, or GPU memory did not
       return to its pre-launch level. Takes priority over 0 and 3-6 (the log says what
       happened before the cleanup), and no restart is attempted: the machine needs a
       person.

Linux (uses /proc and prctl; macOS mostly works without the subreaper). This module
does not import torch.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime

import psutil

from specserve.ops import nvml
from specserve.ops.process_tree import (
    MARKER_ENV,
    ProcessTree,
    describe,
    device_holders,
    process_table,
    set_child_subreaper,
    stop_tree,
)

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_START_FAILED = 3
EXIT_CRASHED = 4
EXIT_HUNG = 5
EXIT_READY_TIMEOUT = 6
EXIT_CLEANUP_FAILED = 7

EXIT_CODES = {
    EXIT_OK: "server exited with status 0, or stopped by the user",
    EXIT_INTERNAL: "internal error of the supervisor",
    EXIT_USAGE: "usage error",
    EXIT_START_FAILED: "command could not be started",
    EXIT_CRASHED: "server exited with a non-zero status or was killed by a signal",
    EXIT_HUNG: "hung (no output and no healthy /health for --stall-timeout s), tree stopped",
    EXIT_READY_TIMEOUT: "not ready within --ready-timeout",
    EXIT_CLEANUP_FAILED: "cleanup failed: a process survived SIGKILL or GPU memory not released",
}

# Default ports of servers that do not need --port on their command line.
_DEFAULT_PORTS = (("sglang", 30000), ("vllm", 8000))


# ---------------------------------------------------------------------------- output
def _timestamp(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.") + f"{int(t % 1 * 1000):03d}"


class Log:
    """Timestamped lines to stdout and, optionally, a file. Thread-safe."""

    def __init__(self, path: str | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stdout
        self.file = open(path, "a", encoding="utf-8", errors="replace") if path else None
        self.lock = threading.Lock()

    def write(self, tag: str, text: str, t: float | None = None) -> None:
        line = f"{_timestamp(t)} [{tag}] {text}\n"
        with self.lock:
            try:
                self.stream.write(line)
            except UnicodeEncodeError:
                self.stream.write(line.encode("ascii", "backslashreplace").decode("ascii"))
            except (OSError, ValueError):
                pass  # our stdout went away (closed pipe): keep supervising, keep the file
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass
            if self.file:
                self.file.write(line)
                self.file.flush()

    def launch(self, text: str) -> None:
        self.write("launch", text)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


# An HTTP access-log line: a quoted request line followed by a status code. This is the
# shape of uvicorn's (`INFO: 127.0.0.1:5000 - "GET /health HTTP/1.1" 503 Service
# Unavailable`), the Common Log Format's and Python's http.server's.
_ACCESS_LOG = re.compile(r'"(?:GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) \S+ HTTP/\d(?:\.\d)?" \d{3}\b')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def is_access_log(line: str) -> bool:
    return _ACCESS_LOG.search(_ANSI.sub("", line)) is not None


class OutputReader(threading.Thread):
    """Reads the server's combined stdout/stderr and logs it line by line.

    Progress is judged on whole lines: every line other than an HTTP access-log line counts.
    A line not finished yet counts only once it has stayed unfinished for `partial_grace`
    seconds (a "loading ... done" line written in pieces); before that it may be a line
    whose text and newline arrive in separate writes (Python's `print` unbuffered writes
    an access-log line that way), which must not pass for progress. Lines end at \\n or
    \\r; `\\r`-terminated segments are progress-bar refreshes and are logged at most once
    per `progress_every` seconds.
    """

    MAX_LINE = 64 * 1024

    def __init__(self, stream, log: Log, progress_every: float = 1.0, partial_grace: float = 2.0):
        super().__init__(name="server-output", daemon=True)
        self.fd = stream.fileno()
        self.stream = stream
        self.log = log
        self.progress_every = progress_every
        self.partial_grace = partial_grace
        self.last_activity = time.monotonic()  # the last whole line that counts as progress
        # The unfinished line: (when its first visible byte came, when its latest bytes came, its text).
        self._partial: tuple[float, float, str] | None = None
        self.last_line = ""
        self.last_line_wall = 0.0
        self.lines = 0
        self.access_lines = 0  # access-log lines since the last activity
        self.eof = threading.Event()
        self._pending_progress: str | None = None
        self._last_progress = 0.0

    def last_progress(self, now: float | None = None) -> float:
        """When the server last showed progress: `last_activity`, or the latest bytes of an unfinished
        line that is not an access-log line and has stayed unfinished for `partial_grace` s."""
        partial = self._partial
        if partial is None:
            return self.last_activity
        since, latest, text = partial
        now = time.monotonic() if now is None else now
        if now - since < self.partial_grace or is_access_log(text):
            return self.last_activity
        return max(self.last_activity, latest)

    def _emit(self, text: str) -> None:
        text = text.rstrip()
        if not text:
            return
        self.lines += 1
        t = time.time()
        if not is_access_log(text):  # the HUNG message names the last line of progress
            self.last_line, self.last_line_wall = text, t
        self.log.write("server", text, t)

    def _segment(self, text: str, progress: bool) -> None:
        if is_access_log(text):
            self.access_lines += 1
        elif text.strip():
            self.last_activity = time.monotonic()
            self.access_lines = 0
        if not progress:
            self._pending_progress = None
            self._emit(text)
            return
        now = time.monotonic()
        if now - self._last_progress >= self.progress_every:
            self._last_progress = now
            self._pending_progress = None
            self._emit(text)
        else:
            self._pending_progress = text

    def _track_partial(self, buf: bytes, new_line: bool) -> None:
        """Note the unfinished line `buf` (`new_line`: a line ended in this chunk, so `buf` began anew)."""
        if not buf.strip():
            self._partial = None
            return
        now = time.monotonic()
        since = self._partial[0] if self._partial is not None and not new_line else now
        self._partial = (since, now, buf.decode("utf-8", "replace"))

    def run(self) -> None:
        buf = b""
        skip_lf = False  # the previous chunk ended in \r: a leading \n completes a \r\n
        try:
            while True:
                try:
                    chunk = os.read(self.fd, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                if skip_lf and chunk.startswith(b"\n"):
                    chunk = chunk[1:]  # it was a \r\n line, not a progress update
                    if self._pending_progress is not None:
                        self._emit(self._pending_progress)
                        self._pending_progress = None
                skip_lf = False
                buf += chunk
                cut = False
                while True:
                    i_n, i_r = buf.find(b"\n"), buf.find(b"\r")
                    cuts = [i for i in (i_n, i_r) if i >= 0]
                    if not cuts:
                        break
                    i = min(cuts)
                    seg = buf[:i]
                    if buf[i : i + 2] == b"\r\n":
                        buf, progress = buf[i + 2 :], False
                    elif buf[i : i + 1] == b"\r":
                        buf, progress = buf[i + 1 :], True
                        skip_lf = not buf
                    else:
                        buf, progress = buf[i + 1 :], False
                    self._segment(seg.decode("utf-8", "replace"), progress)
                    cut = True
                if len(buf) > self.MAX_LINE:
                    self._segment(buf.decode("utf-8", "replace"), False)
                    buf, cut = b"", True
                self._track_partial(buf, cut)
        finally:
            if buf:
                self._segment(buf.rstrip(b"\r").decode("utf-8", "replace"), False)
            if self._pending_progress:
                self._emit(self._pending_progress)
            try:
                self.stream.close()
            except OSError:
                pass
            self.eof.set()


class HealthPoller(threading.Thread):
    """GETs the health URL every `interval` seconds; remembers the last HTTP 200."""

    def __init__(self, url: str, interval: float = 1.0, timeout: float = 2.0):
        super().__init__(name="health-poller", daemon=True)
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.last_ok: float | None = None  # monotonic time of the last 200
        self.first_ok: float | None = None
        self.ok = False  # state of the latest probe
        self.last_error = "not polled yet"
        self.stop = threading.Event()
        # Never go through a proxy for a local health check.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe(self) -> bool:
        try:
            with self.opener.open(self.url, timeout=self.timeout) as r:
                r.read(4096)
                if r.status == 200:
                    return True
                self.last_error = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            self.last_error = f"HTTP {e.code}"
        except Exception as e:  # refused, timeout, reset, bad URL ...
            reason = getattr(e, "reason", e)
            self.last_error = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
        return False

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            ok = self.probe()
            self.ok = ok
            if ok:
                self.last_ok = time.monotonic()
                if self.first_ok is None:
                    self.first_ok = self.last_ok
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - t)))


def infer_health_url(cmd: list[str]) -> tuple[str | None, str]:
    """Health URL from `--port`/`--host` in CMD, or a known server's default port; none for a
    headless node of a multi-node server (`--node-rank N`, N > 0: no HTTP, a status line a minute)."""
    port: str | None = None
    host: str | None = None
    for i, tok in enumerate(cmd):
        rank = None
        if tok == "--node-rank" and i + 1 < len(cmd):
            rank = cmd[i + 1]
        elif tok.startswith("--node-rank="):
            rank = tok.partition("=")[2]
        if rank not in (None, "", "0"):
            return None, f"a headless node (--node-rank {rank}) serves no HTTP"
        for flag in ("--port", "--host"):
            val = None
            if tok == flag and i + 1 < len(cmd):
                val = cmd[i + 1]
            elif tok.startswith(flag + "="):
                val = tok[len(flag) + 1 :]
            if val is not None:
                if flag == "--port":
                    port = val
                else:
                    host = val
    how = "from --port in the command"
    if port is None:
        joined = " ".join(cmd).lower()
        for name, default in _DEFAULT_PORTS:
            if name in joined:
                port, how = str(default), f"default port of {name}"
                break
    if port is None or not port.isdigit():
        return None, "no --port in the command"
    if host in (None, "", "0.0.0.0", "localhost"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/health", how


# ---------------------------------------------------------------------------- stacks
def _is_python(p: psutil.Process) -> bool:
    try:
        names = [p.name()]
        try:
            names.append(os.path.basename(p.exe()))
        except (psutil.Error, OSError):
            pass
        try:
            cmd = p.cmdline()
            if cmd:
                names.append(os.path.basename(cmd[0]))
        except (psutil.Error, OSError):
            pass
    except psutil.Error:
        return False
    return any(n.lower().startswith(("python", "pypy")) for n in names)


def dump_diagnostics(
    tree: ProcessTree,
    log: Log,
    native: bool = False,
    per_process_timeout: float = 20.0,
    max_processes: int = 16,
    budget: float = 60.0,
) -> None:
    """What each process of the tree is doing, and its Python stacks when py-spy exists.

    py-spy gets `per_process_timeout` s per process and `budget` s in all, so a wedged
    ptrace can delay the kill by a bounded time only.
    """
    t_end = time.monotonic() + budget
    procs = tree.members(full=True)
    if not procs:
        log.launch("no process of the tree is alive any more")
        return
    log.launch(f"processes of the tree ({len(procs)}):")
    for line in process_table(procs):
        log.write("stacks", line)
    py = [p for p in procs if _is_python(p)]
    if not py:
        return
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        log.launch(
            "py-spy is not installed: no Python stacks. Install it with `pip install py-spy`; "
            "it needs ptrace rights (root, or kernel.yama.ptrace_scope=0; in Docker "
            "--cap-add SYS_PTRACE)"
        )
        return
    for k, p in enumerate(py[:max_processes]):
        left = t_end - time.monotonic()
        if left <= 1.0:
            log.launch(f"stack dump budget of {budget:g} s spent: {len(py) - k} Python process(es) skipped")
            return
        cmd = [pyspy, "dump", "--pid", str(p.pid)] + (["--native"] if native else [])
        log.launch(f"py-spy dump of {describe(p, 100)}")
        try:
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            log.launch(f"  py-spy failed to start: {e}")
            return
        tree.exclude.add(child.pid)
        try:
            out, _ = child.communicate(timeout=min(per_process_timeout, left))
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
            log.launch(f"  py-spy timed out after {min(per_process_timeout, left):.0f} s")
        for line in out.decode("utf-8", "replace").splitlines():
            if line.strip():
                log.write("stacks", line)
        if child.returncode not in (0, None):
            log.launch(f"  py-spy exited with status {child.returncode}")
    if len(py) > max_processes:
        log.launch(f"stacks of {len(py) - max_processes} more Python processes not dumped")


# ---------------------------------------------------------------------------- GPU check
class GpuChecker:
    def __init__(self, log: Log, timeout: float, tolerance_mib: float):
        self.log = log
        self.timeout = timeout
        self.tolerance = tolerance_mib
        self.skip_said = False

    def snapshot(self) -> dict[int, float] | None:
        used = nvml.memory_used()
        if used is None and not self.skip_said:
            self.skip_said = True
            ok, reason = nvml.available()
            self.log.launch(f"{reason or nvml.NO_NVML_MESSAGE}: GPU memory check skipped")
        return used

    def check(self, before: dict[int, float] | None, tree: ProcessTree) -> bool:
        """Wait for memory to return to `before`; print the table; True when released."""
        if before is None:
            return True
        t0 = time.monotonic()
        after = nvml.memory_used() or {}
        while True:
            bad = [i for i, b in before.items() if after.get(i, 0.0) > b + self.tolerance]
            if not bad or time.monotonic() - t0 >= self.timeout:
                break
            time.sleep(1.0)
            after = nvml.memory_used() or {}
        waited = time.monotonic() - t0
        self.log.launch(
            f"GPU memory, before launch -> now (tolerance {self.tolerance:g} MiB"
            + (f", waited {waited:.1f} s" if waited >= 1.0 else "")
            + "):"
        )
        for i in sorted(before):
            b, a = before[i], after.get(i, float("nan"))
            status = "released" if i not in bad else f"NOT RELEASED (+{a - b:.0f} MiB)"
            self.log.launch(f"  GPU {i}: {b:9.0f} -> {a:9.0f} MiB  {status}")
        if not bad:
            return True
        q = nvml.query(processes=True)
        minors = {g.index: g.minor for g in q.gpus}
        holders_by_pid = device_holders()
        failed = False
        for i in bad:
            gpu = next((g for g in q.gpus if g.index == i), None)
            procs = {p.pid: p for p in (gpu.processes if gpu else [])}
            dev = f"/dev/nvidia{minors.get(i)}" if minors.get(i) is not None else None
            for pid, paths in holders_by_pid.items():
                if pid not in procs and dev in paths:
                    visible, name, cmd = nvml.describe_pid(pid)
                    procs[pid] = nvml.GpuProcess(pid=pid, name=name, cmdline=cmd, visible=visible, kind="device-file")
            if not procs:
                self.log.launch(
                    f"  GPU {i}: no process is listed as holding memory (other PID "
                    "namespace, or the driver is still tearing a context down)"
                )
                failed = True
            # Memory of visible processes outside the tree that NVML lists with a size:
            # the only evidence that the excess is somebody else's.
            explained = 0.0
            for p in procs.values():
                if tree.is_ours(p.pid):
                    verdict = "OF THIS LAUNCH, still alive"
                    failed = True
                elif not p.visible:
                    verdict = "unknown owner"
                    failed = True
                else:
                    try:
                        newer = psutil.Process(p.pid).create_time() >= tree.launched_at
                    except psutil.Error:
                        newer = False
                    verdict = (
                        "not of this launch, started during it: not killed"
                        if newer
                        else "not of this launch, older: not killed"
                    )
                    if p.kind != "device-file" and p.used_mib is not None:
                        explained += p.used_mib
                self.log.launch(f"  GPU {i} held by {p.describe()}  [{verdict}]")
            excess = after.get(i, 0.0) - before[i]
            if explained < excess - self.tolerance:
                failed = True
        if not failed:
            self.log.launch("  the extra memory belongs to processes outside this launch (see above)")
        return not failed


# ---------------------------------------------------------------------------- supervisor
@dataclass
class Attempt:
    outcome: str = "exited"  # exited | crashed | hung | ready_timeout | stopped | start_failed
    returncode: int | None = None
    ready: bool = False
    cleanup_ok: bool = True


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class Supervisor:
    def __init__(self, args: argparse.Namespace, cmd: list[str], log: Log):
        self.args = args
        self.cmd = cmd
        self.log = log
        self.stop_requests = 0
        self.gpu = GpuChecker(log, args.gpu_release_timeout, args.gpu_tolerance_mib)
        self.health_url: str | None = None
        self.subreaper = False

    # signals to the supervisor: ask the server to stop
    def _on_signal(self, signum, frame) -> None:
        self.stop_requests += 1

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop_requests:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def attempt(self, cmd: list[str]) -> Attempt:
        a = self.args
        res = Attempt()
        before = self.gpu.snapshot()
        env = dict(os.environ)
        env[MARKER_ENV] = uuid.uuid4().hex
        env.setdefault("PYTHONUNBUFFERED", "1")
        started_wall = time.time()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                bufsize=0,
            )
        except OSError as e:
            self.log.launch(f"could not start {cmd[0]!r}: {e}")
            res.outcome = "start_failed"
            return res
        t0 = time.monotonic()
        self.log.launch(f"started pid {proc.pid} (own session and process group)")
        tree = ProcessTree(
            proc.pid, marker=env[MARKER_ENV], started_at=started_wall, session_leader=True, adopt_orphans=self.subreaper
        )
        # A partial line must be able to count before a hang is declared.
        reader = OutputReader(proc.stdout, self.log, partial_grace=min(2.0, a.stall_timeout / 4))
        reader.start()
        health = None
        if self.health_url:
            health = HealthPoller(self.health_url, a.health_interval, timeout=min(5.0, max(0.5, a.stall_timeout / 4)))
            health.start()

        warned_quiet = False
        warned_404 = False
        health_was_ok = False
        last_refresh = 0.0
        stopped = False
        try:
            while True:
                now = time.monotonic()
                if now - last_refresh >= 1.0:
                    last_refresh = now
                    tree.refresh()
                    tree.reap(keep=[proc.pid])
                rc = proc.poll()
                if rc is not None:
                    res.returncode = rc
                    res.outcome = "exited" if rc == 0 else "crashed"
                    how = f"status {rc}" if rc >= 0 else f"signal {_signal_name(rc)}"
                    self.log.launch(
                        f"server (pid {proc.pid}) exited with {how} after {now - t0:.1f} s"
                        + (" (after READY)" if res.ready else " (before READY)" if self.health_url else "")
                    )
                    break
                if self.stop_requests:
                    res.outcome = "stopped"
                    break
                if health is not None:
                    if not warned_404 and health.last_error in ("HTTP 404", "HTTP 405"):
                        warned_404 = True
                        self.log.launch(
                            f"{self.health_url} answered {health.last_error}: the server is "
                            "listening but this is not its health path? (set --health)"
                        )
                    if not res.ready and health.first_ok is not None:
                        res.ready = True
                        self.log.launch(f"READY after {health.first_ok - t0:.1f} s: {self.health_url} answered 200")
                    if res.ready:
                        if health_was_ok and not health.ok:
                            self.log.launch(f"health check failing ({health.last_error})")
                        elif not health_was_ok and health.ok and health.last_ok != health.first_ok:
                            self.log.launch("health check OK again")
                        health_was_ok = health.ok
                last = max(reader.last_progress(now), t0, (health.last_ok or 0.0) if health is not None else 0.0)
                quiet = now - last
                if quiet >= a.stall_timeout:
                    res.outcome = "hung"
                    break
                if quiet >= a.stall_timeout / 2 and not warned_quiet and a.stall_timeout >= 10:
                    warned_quiet = True
                    self.log.launch(
                        f"no output{' and no healthy /health' if health else ''} for "
                        f"{quiet:.0f} s; declaring a hang at {a.stall_timeout:g} s"
                    )
                elif quiet < a.stall_timeout / 2:
                    warned_quiet = False
                if a.ready_timeout and not res.ready and now - t0 >= a.ready_timeout:
                    res.outcome = "ready_timeout"
                    break
                time.sleep(0.1)

            # ---- the server stopped or must be stopped
            if res.outcome == "hung":
                what = "no output and no HTTP 200 from the health URL" if health else "no output"
                if reader.access_lines:
                    what += f" (only {reader.access_lines} HTTP access-log lines, not counted as progress)"
                since = (
                    f"; last line at {_timestamp(reader.last_line_wall)}: {reader.last_line[:200]!r}"
                    if reader.lines
                    else "; it never printed anything"
                )
                self.log.launch(f"HUNG: {what} for {a.stall_timeout:g} s{since}")
                if health is not None:
                    self.log.launch(f"health: {self.health_url}: {health.last_error}")
                dump_diagnostics(tree, self.log, native=a.native_stacks)
            elif res.outcome == "ready_timeout":
                self.log.launch(
                    f"NOT READY within --ready-timeout {a.ready_timeout:g} s "
                    f"({self.health_url}: {health.last_error if health else '-'})"
                )
                dump_diagnostics(tree, self.log, native=a.native_stacks)
            elif res.outcome == "stopped":
                self.log.launch(
                    "stop requested: SIGINT to the server's process group "
                    f"(up to {a.grace:g} s to exit; Ctrl-C again to skip)"
                )
                n = self.stop_requests
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                except OSError:
                    pass
                end = time.monotonic() + a.grace
                while proc.poll() is None and time.monotonic() < end and self.stop_requests == n:
                    time.sleep(0.1)
                if proc.poll() is not None:
                    self.log.launch(f"server exited with status {proc.returncode}")
            res.cleanup_ok = self._stop(tree, proc, res) and res.cleanup_ok
            stopped = True
        finally:
            if health is not None:
                health.stop.set()
            if not stopped:  # an internal error: still never leave the tree behind
                try:
                    stop_tree(
                        tree, grace=min(a.grace, 2.0), log=self.log.launch, keep_unreaped=[proc.pid], on_tick=proc.poll
                    )
                except Exception:
                    pass
            reader.join(timeout=2.0)
        if res.returncode is None:
            res.returncode = proc.returncode
        if not self.gpu.check(before, tree):
            res.cleanup_ok = False
        return res

    def _stop(self, tree: ProcessTree, proc: subprocess.Popen, res: Attempt) -> bool:
        """Stop every process of the tree; True when none survived."""
        a = self.args
        members = tree.members(full=True)
        if res.outcome in ("exited", "crashed") and members:
            self.log.launch(f"{len(members)} process(es) of the tree still running after the server exited:")
            for p in members:
                self.log.launch(f"  {describe(p)}")
        # Warn about processes holding the GPU device files that are not ours.
        try:
            holders = device_holders()
        except Exception:
            holders = {}
        ours = {p.pid for p in members}
        for pid in holders:
            if pid in ours or tree.is_ours(pid):
                continue
            try:
                p = psutil.Process(pid)
                if p.create_time() >= tree.launched_at:
                    self.log.launch(
                        f"warning: {describe(p)} holds /dev/nvidia* and started during this "
                        "launch, but is not part of its tree: not killed"
                    )
            except psutil.Error:
                continue
        if not members:
            tree.drain_zombies([proc.pid], on_tick=proc.poll)
            return True
        n = self.stop_requests
        grace = 0.0 if n > 1 else a.grace
        result = stop_tree(
            tree,
            grace=grace,
            kill_wait=a.kill_wait,
            log=self.log.launch,
            keep_unreaped=[proc.pid],
            on_tick=proc.poll,
            hurry=lambda: self.stop_requests > max(n, 1),
        )
        proc.poll()
        if result.survivors:
            self.log.launch(
                f"{len(result.survivors)} process(es) survived SIGKILL (uninterruptible sleep in a driver?):"
            )
            for s in result.survivors:
                self.log.launch(f"  {s}")
            return False
        self.log.launch(
            f"process tree stopped ({len(result.signalled)} signalled, {len(result.sigkilled)} needed SIGKILL)"
        )
        return True

    def run(self) -> int:
        a = self.args
        fallback = shlex.split(a.fallback_args) if a.fallback_args else []
        tries = a.restarts + 1
        code = EXIT_INTERNAL
        for n in range(1, tries + 1):
            cmd = list(self.cmd) + (fallback if n > 1 else [])
            self.log.launch(f"attempt {n}/{tries}: {shlex.join(cmd)}")
            res = self.attempt(cmd)
            if not res.cleanup_ok:
                self.log.launch(
                    f"exit {EXIT_CLEANUP_FAILED}: {EXIT_CODES[EXIT_CLEANUP_FAILED]} "
                    f"(after: {res.outcome}); not restarting"
                )
                return EXIT_CLEANUP_FAILED
            if res.outcome == "stopped":
                self.log.launch(f"exit {EXIT_OK}: stopped by the user")
                return EXIT_OK
            if res.outcome == "exited":
                self.log.launch(f"exit {EXIT_OK}: server exited with status 0")
                return EXIT_OK
            if res.outcome == "start_failed":
                self.log.launch(f"exit {EXIT_START_FAILED}: {EXIT_CODES[EXIT_START_FAILED]}")
                return EXIT_START_FAILED
            code = {"crashed": EXIT_CRASHED, "hung": EXIT_HUNG, "ready_timeout": EXIT_READY_TIMEOUT}[res.outcome]
            if n < tries and not self.stop_requests:
                extra = f" with fallback args {shlex.join(fallback)}" if fallback else ""
                self.log.launch(
                    f"{res.outcome.replace('_', '-')}: restarting{extra} in "
                    f"{a.restart_delay:g} s ({tries - n} restart(s) left)"
                )
                self._sleep(a.restart_delay)
                if not self.stop_requests:
                    continue
                self.log.launch(f"exit {EXIT_OK}: stopped by the user")
                return EXIT_OK
            break
        self.log.launch(f"exit {code}: {EXIT_CODES[code]}")
        return code


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "exit codes:\n" + "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items())
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="declare a hang after S seconds with no output line and no healthy /health (default 600)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="give up when /health has not answered 200 after S seconds, even if "
        "the server keeps logging (default 0: no limit)",
    )
    parser.add_argument(
        "--health",
        metavar="URL",
        help="health URL (default: http://HOST:PORT/health from --port/--host in "
        "the command); 'none' disables health polling",
    )
    parser.add_argument(
        "--health-interval", type=float, default=1.0, metavar="S", help="seconds between health polls (default 1)"
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart up to N times after a hang, crash or ready-timeout (default 0)",
    )
    parser.add_argument(
        "--fallback-args",
        default="",
        metavar='"ARGS"',
        help="appended (shlex-split) to the command on every restart: for "
        "example --disable-cuda-graph for SGLang, --enforce-eager for vLLM",
    )
    parser.add_argument(
        "--restart-delay", type=float, default=2.0, metavar="S", help="pause before a restart (default 2)"
    )
    parser.add_argument("--log", metavar="FILE", help="also append the timestamped log to FILE")
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM (or the forwarded SIGINT) and SIGKILL (default 10)",
    )
    parser.add_argument(
        "--kill-wait",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for SIGKILLed processes to vanish (default 10)",
    )
    parser.add_argument(
        "--gpu-release-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for GPU memory to return to its pre-launch level (default 30)",
    )
    parser.add_argument(
        "--gpu-tolerance-mib",
        type=float,
        default=256.0,
        metavar="MIB",
        help="allowed excess over the pre-launch GPU memory (default 256)",
    )
    parser.add_argument(
        "--native-stacks", action="store_true", help="py-spy dump --native (C/C++ frames too: CUDA, NCCL)"
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the server command")
    _accept_dash_values(parser, ("--fallback-args",))


def _accept_dash_values(parser: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    """Let `--fallback-args --disable-cuda-graph` work as written.

    argparse takes a lone value that starts with '-' for an option and fails; this rewrites
    `FLAG VALUE` to `FLAG=VALUE` among our own options (never inside CMD) before parsing.
    """
    takes_value = {
        o
        for act in parser._actions
        if act.option_strings
        and act.nargs is None
        and not isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
        for o in act.option_strings
    }
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        if args is None:
            return original(args, namespace)
        args = list(args)
        out: list[str] = []
        i = 0
        while i < len(args):
            tok = args[i]
            if tok == "--" or not tok.startswith("-"):
                out.extend(args[i:])  # CMD starts here
                break
            if tok in flags and i + 1 < len(args):
                out.append(f"{tok}={args[i + 1]}")
                i += 2
                continue
            out.append(tok)
            if tok in takes_value and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            i += 1
        return original(out, namespace)

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _usage_error(msg: str) -> int:
    print(f"specserve launch: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return _usage_error("no command given: specserve launch [options] -- CMD ...")
    if args.stall_timeout <= 0:
        return _usage_error("--stall-timeout must be > 0")
    if args.restarts < 0 or args.ready_timeout < 0 or args.grace < 0:
        return _usage_error("--restarts, --ready-timeout and --grace must be >= 0")
    if args.health_interval <= 0:
        return _usage_error("--health-interval must be > 0")
    try:
        if args.fallback_args:
            shlex.split(args.fallback_args)
    except ValueError as e:
        return _usage_error(f"--fallback-args: {e}")

    try:
        log = Log(args.log)
    except OSError as e:
        return _usage_error(f"--log {args.log}: {e}")
    sup = Supervisor(args, cmd, log)
    if args.health and args.health.lower() == "none":
        sup.health_url = None
        log.launch("health polling disabled: readiness is not detected, hangs only from log silence")
    elif args.health:
        sup.health_url = args.health
        log.launch(f"health URL {args.health}")
    else:
        url, how = infer_health_url(cmd)
        sup.health_url = url
        if url:
            log.launch(f"health URL {url} ({how}; override with --health)")
        else:
            log.launch(
                f"{how}: no health URL, readiness is not detected and hangs are judged from "
                "log silence only (pass --health URL)"
            )
    if args.ready_timeout and not sup.health_url:
        log.close()
        return _usage_error("--ready-timeout needs a health URL (--health, or --port in the command)")
    log.launch(
        f"stall timeout {args.stall_timeout:g} s, ready timeout "
        f"{f'{args.ready_timeout:g} s' if args.ready_timeout else 'none'}, "
        f"restarts {args.restarts}, grace {args.grace:g} s"
    )
    sup.subreaper = set_child_subreaper()
    if not sup.subreaper:
        log.launch(
            "note: could not become a child subreaper; orphaned workers are found by "
            "session, process group and environment marker only"
        )

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            # Respect an inherited SIG_IGN (`nohup`, `cmd &` in a script): the user asked
            # for the server to survive that signal.
            if signal.getsignal(s) is not signal.SIG_IGN:
                old[s] = signal.signal(s, sup._on_signal)
    try:
        return sup.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        log.close()
