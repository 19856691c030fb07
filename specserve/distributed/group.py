"""The driver's side of the TP workers: spawn them with an explicit environment,
check that the environment arrived, exchange messages, and never wait forever.

- Workers are `subprocess.Popen` children (not multiprocessing forks), given a
  complete `env` dict: what runs is exactly what we built.
- Each worker reads /proc/self/environ first thing and reports it; every
  requested variable must arrive unchanged or start-up fails, naming the worker
  and the variable.
- Workers die with their parent: prctl(PR_SET_PDEATHSIG, SIGKILL) plus a
  parent-pid watchdog in the worker. PDEATHSIG fires when the *thread* that
  spawned the child exits, so all spawning happens on one long-lived thread.
- Every wait polls the workers: a dead worker, an error report or a stalled
  phase (no progress for `stall_timeout` s while capturing graphs) raises at
  once instead of hanging.
- Once serving (`watch`), a worker that exits by itself (killed, out of memory)
  ends the group at once, also while nothing waits on it: the others are
  killed and `on_lost` is told, as when a node goes away.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait

from specserve import envs
from specserve.distributed.nccl_profiles import WorkerEnv
from specserve.distributed.wire import Conn, WireError

log = logging.getLogger("specserve.tp")

# Variables shown in logs and /server_info besides NCCL_*: what the operator asked for.
SHOWN_PREFIXES = ("NCCL_", "TORCH_NCCL_")


class WorkerError(RuntimeError):
    """A worker failed, died or reported a problem; the message says which and why.
    `phase` is the failing worker's last reported phase (init, load, graphs, ...)."""

    phase = ""


class PhaseTimeout(WorkerError):
    """A guarded phase (CUDA graph capture) made no progress in time."""

    def __init__(self, msg: str, rank: int, last: str):
        super().__init__(msg)
        self.rank, self.last, self.phase = rank, last, "graphs"  # the caller sets the real phase


class _Spawner:
    """One thread that lives as long as the process and starts every worker,
    so PR_SET_PDEATHSIG is tied to the process lifetime, not a caller's thread."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="specserve-tp-spawner", daemon=True).start()

    def _loop(self) -> None:
        while True:
            args, kw, box = self.jobs.get()
            try:
                box.put((subprocess.Popen(args, **kw), None))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.put((None, e))

    def popen(self, args, **kw) -> subprocess.Popen:
        box: queue.Queue = queue.Queue()
        self.jobs.put((args, kw, box))
        proc, err = box.get()
        if err is not None:
            raise err
        return proc


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _popen(args, **kw) -> subprocess.Popen:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.popen(args, **kw)


WORKER_ARGS = ("-m", "specserve.distributed.worker")  # the interpreter arguments that start one worker


def spawn_worker(
    base_env: dict[str, str], rank: int, local_rank: int, size: int, fd: int, master: tuple[str, int]
) -> subprocess.Popen:
    """Start one worker: `base_env` plus its place in the group; `fd` is its end of the
    connection to the driver, `master` the rendezvous store."""
    env = dict(base_env)
    env.pop(envs.DIST_KEY.name, None)  # the nodes' secret stays with the processes that authenticate
    env.update(
        {
            envs.TP_RANK.name: str(rank),
            envs.TP_SIZE.name: str(size),
            envs.TP_FD.name: str(fd),
            envs.TP_PARENT_PID.name: str(os.getpid()),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(size),
            "PYTHONUNBUFFERED": "1",
        }
    )
    # Worker stdout goes to our stderr: `generate --json` keeps a clean stdout.
    return _popen(
        [sys.executable, *WORKER_ARGS],
        env=worker_env_hook(env, rank),
        pass_fds=(fd,),
        stdout=2,
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


class WorkerGroup:
    """N worker processes (`python -m specserve.distributed.worker`): all on this machine, or
    with a `cluster` (specserve.distributed.multinode) the first `cluster.local` here and the
    others started by the other nodes' launchers (`procs` holds None for those)."""

    def __init__(
        self,
        size: int,
        wenv: WorkerEnv,
        hello_timeout: float = 60.0,
        cluster=None,
        profile=None,
        explicit: dict[str, str] | None = None,
    ):
        import torch.distributed as dist

        self.size, self.wenv, self.cluster = size, wenv, cluster
        self.procs: list[subprocess.Popen | None] = []
        self.conns: list[Conn] = []
        self.env_reports: list[dict] = []
        self.last_progress: list[str] = [""] * size
        self.closed = False
        self.stopping = False  # kill() began: workers exiting from now on are expected to
        self.lost: str | None = None  # why the group ended from outside (a lost node or worker)
        self.on_lost = None  # callback(reason), called on the monitor or watch thread
        if cluster is None:
            self.local, self.group_id = size, 0
            # The rendezvous store lives in the driver on an OS-chosen port: no fixed ports, no races.
            self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            master = ("127.0.0.1", self.store.port)
        else:
            self.local, self.group_id, self.store = cluster.local, cluster.new_group_id(), cluster.store
            master = (cluster.host, cluster.port)
        # Every group has its own keys in the store: one store serves a driver's successive groups.
        self.store_prefix = f"group{self.group_id}/"
        try:
            for rank in range(self.local):
                ours, theirs = socket.socketpair()
                self.procs.append(spawn_worker(self.wenv.env, rank, rank, size, theirs.fileno(), master))
                theirs.close()
                self.conns.append(Conn(ours.detach()))
            if cluster is not None:
                cluster.on_lost.append(self._node_lost)
                remote = cluster.spawn_remote(self.group_id, profile, explicit or {}, self._check_lost)
                for rank in range(self.local, size):
                    self.procs.append(None)
                    self.conns.append(remote[rank])
            self._hello(hello_timeout)
        except BaseException as e:
            self.kill(f"start-up failed on node 0: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            raise

    def who(self, rank: int) -> str:
        """A worker's name in messages (with its node when there are several)."""
        return f"TP worker {rank}" + (f" (node {rank // self.local})" if self.cluster is not None else "")

    def _node_lost(self, reason: str) -> None:
        if self.lost or self.closed:
            return
        self.lost = reason
        self.kill(reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def watch(self, interval: float = 0.5) -> None:
        """From now on, a local worker that exits while the group is neither closing nor being
        killed ends the group (see the module notes)."""
        threading.Thread(target=self._watch_local, args=(interval,), name="specserve-tp-watch", daemon=True).start()

    def _watch_local(self, interval: float) -> None:
        while not (self.closed or self.stopping or self.lost):
            for rank, p in enumerate(self.procs):
                if p is not None and p.poll() is not None and not (self.closed or self.stopping):
                    self._node_lost(
                        f"{self.who(rank)} (pid {p.pid}) exited unexpectedly ({_exit_status(p.returncode)})"
                        f" while serving; last step: {self.last_progress[rank] or 'none'}"
                    )
                    return
            time.sleep(interval)

    def _check_lost(self) -> None:
        if self.lost:
            raise WorkerError(f"the TP group ended: {self.lost}")

    # ----------------------------------------------------------- start-up
    def _hello(self, timeout: float) -> None:
        reports = self.recv_all(timeout=timeout, what="start-up (hello)")
        problems = []
        multi = self.cluster is not None
        for rank, msg in enumerate(reports):
            seen = msg["environ"]
            name = f"node {rank // self.local} worker {rank}" if multi else f"worker {rank}"
            for k, want in self.wenv.requested.items():
                got = seen.get(k)
                if got != want:
                    problems.append(
                        f"{name} (pid {msg['pid']}): {k} should be {want!r}{' (as on node 0)' if multi else ''} "
                        f"but the worker sees {'<unset>' if got is None else repr(got)}"
                    )
            for k in sorted(seen):
                if k.startswith(SHOWN_PREFIXES) and k not in self.wenv.requested:
                    problems.append(
                        f"{name} (pid {msg['pid']}): {k}={seen[k]!r} is set there but not on node 0's workers"
                    )
            shown = {k: v for k, v in sorted(seen.items()) if k.startswith(SHOWN_PREFIXES) or k in self.wenv.requested}
            self.env_reports.append({"rank": rank, "node": rank // self.local, "pid": msg["pid"], "env": shown})
        if problems:
            why = (
                "the nodes' environments differ (every worker must see node 0's NCCL settings; unset or "
                "align them on the other nodes):"
                if multi
                else "a requested environment variable did not reach a TP worker (is a wrapper, sudo or a "
                "container entrypoint resetting the environment?):"
            )
            raise WorkerError(why + "\n  " + "\n  ".join(problems))
        for r in self.env_reports:
            log.info(
                "[tp] %s (pid %d) env: %s",
                self.who(r["rank"]).removeprefix("TP "),
                r["pid"],
                " ".join(f"{k}={v}" for k, v in r["env"].items()) or "(no NCCL_* variables)",
            )

    # ----------------------------------------------------------- messages
    def send_all(self, msg: dict) -> None:
        for rank, c in enumerate(self.conns):
            try:
                c.send(msg)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._raise_dead(rank)

    def recv_all(
        self,
        timeout: float | None = None,
        stall_timeout: float | None = None,
        stall_phases: tuple[str, ...] = ("graphs",),
        what: str = "reply",
        on_progress=None,
        init_timeout: float = 600.0,
    ) -> list[dict]:
        """One non-progress message from every worker. Raises WorkerError if a worker
        dies or reports an error, PhaseTimeout if a worker whose last progress is in
        `stall_phases` is silent for `stall_timeout` s (or in phase "init" for
        `init_timeout` s: joining the process group, setting up collectives), and
        WorkerError after `timeout` s."""
        t_start = time.monotonic()
        last_heard = [t_start] * self.size
        phase = [""] * self.size
        out: list[dict | None] = [None] * self.size
        pending = {c: r for r, c in enumerate(self.conns)}
        while pending:
            self._check_lost()
            for c in wait(list(pending), timeout=0.25):
                rank = pending[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    self._raise_dead(rank)
                except WireError as e:  # not a bad request: the group's protocol is broken, so is the group
                    raise WorkerError(f"{self.who(rank)} sent a malformed message ({e})") from None
                last_heard[rank] = time.monotonic()
                kind = msg.get("type")
                if kind == "progress":
                    phase[rank] = msg["phase"]
                    self.last_progress[rank] = msg["text"]
                    log.info("[tp] worker %d: %s", rank, msg["text"])
                    if on_progress is not None:
                        on_progress(rank, msg)
                    continue
                if kind == "error":
                    if msg.get("kind") == "ConfigError":  # a checkpoint/setting problem: the same clear message
                        from specserve.config import ConfigError

                        raise ConfigError(f"{self.who(rank)}: {msg['error'].split(': ', 1)[-1]}")
                    err = WorkerError(
                        f"{self.who(rank)} failed during {what}: {msg['error']}\n{msg.get('traceback', '')}"
                    )
                    err.phase = phase[rank]
                    raise err
                out[rank] = msg
                del pending[c]
            now = time.monotonic()
            for c, rank in list(pending.items()):
                proc = self.procs[rank]
                if proc is not None and proc.poll() is not None:
                    self._raise_dead(rank, phase[rank])
                limit = (
                    stall_timeout if phase[rank] in stall_phases else init_timeout if phase[rank] == "init" else None
                )
                if limit is not None and now - last_heard[rank] > limit:
                    err = PhaseTimeout(
                        f"{self.who(rank)} made no progress for {limit:.0f} s during {phase[rank]} "
                        f"(last step: {self.last_progress[rank] or 'none'})",
                        rank,
                        self.last_progress[rank],
                    )
                    err.phase = phase[rank]
                    raise err
            if timeout is not None and now - t_start > timeout:
                ranks = sorted(pending.values())
                nodes = f" on node(s) {sorted({r // self.local for r in ranks})}" if self.cluster is not None else ""
                raise WorkerError(
                    f"TP worker(s) {ranks}{nodes} did not answer within {timeout:.0f} s during {what} "
                    f"(last steps: {[self.last_progress[r] for r in ranks]})"
                )
        return out  # type: ignore[return-value]

    def request(self, msg: dict, **kw) -> list[dict]:
        self.send_all(msg)
        return self.recv_all(**kw)

    def _raise_dead(self, rank: int, phase: str = ""):
        self._check_lost()
        proc = self.procs[rank]
        if proc is None:
            err = WorkerError(
                f"{self.who(rank)} closed its connection (the worker exited or its node went away); "
                f"last step: {self.last_progress[rank] or 'none'}"
            )
        else:
            try:
                code = proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            err = WorkerError(
                f"{self.who(rank)} (pid {proc.pid}) exited unexpectedly ({_exit_status(code)}); "
                f"last step: {self.last_progress[rank] or 'none'}"
            )
        err.phase = phase
        raise err

    # ----------------------------------------------------------- shutdown
    def pids(self) -> list[int]:
        """This machine's workers (the other nodes' launchers own theirs)."""
        return [p.pid for p in self.procs if p is not None]

    def kill(self, reason: str | None = "node 0 stopped the group after an error") -> None:
        """SIGKILL every worker now and reap them (a hung NCCL call cannot be interrupted politely);
        the other nodes' launchers stop theirs and log `reason` (None: an orderly end)."""
        self.stopping = True
        local = [p for p in self.procs if p is not None]
        for p in local:
            if p.poll() is None:
                p.kill()
        for p in local:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("[tp] worker pid %d did not exit after SIGKILL", p.pid)
        if self.cluster is not None:
            self.cluster.stop_remote(self.group_id, reason)
            if self._node_lost in self.cluster.on_lost:
                self.cluster.on_lost.remove(self._node_lost)
        self._close_conns()

    def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self.lost and all(p is None or p.poll() is None for p in self.procs):
                self.request({"op": "shutdown"}, timeout=timeout, what="shutdown")
                for p in self.procs:
                    if p is not None:
                        p.wait(timeout=timeout)
        except (WorkerError, subprocess.TimeoutExpired, OSError):
            pass
        self.kill(reason=None)

    def _close_conns(self) -> None:
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def _exit_status(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def worker_env_hook(env: dict[str, str], rank: int) -> dict[str, str]:
    """The exact environment handed to a worker (tests replace this to simulate a lost variable)."""
    return env
