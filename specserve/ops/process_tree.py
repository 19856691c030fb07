"""Track every process a launched server creates, and stop all of them.

A server tree is found by several independent means, because each one alone misses
something:

1. descendants of the root (psutil, polled continuously while the server runs), so a
   worker that is later re-parented is already known;
2. the supervisor makes itself a *child subreaper* (Linux prctl), so a grandchild whose
   parent died - including one that called setsid() and double-forked - is re-parented
   to the supervisor instead of init and stays a descendant;
3. members of the root's process group and session (the root is started with
   start_new_session=True, so both ids equal its PID);
4. an environment marker (SPECSERVE_LAUNCH_ID=<random>) that every descendant inherits
   unless it scrubs its environment;
5. holders of /dev/nvidia* device files, reported separately: one that is not ours by
   1-4 is never signalled, only named.

Every process is identified by (pid, create_time) - a psutil.Process does that - so a
reused PID is never mistaken for a tree member. Processes created before the launch are
never considered members.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psutil

from specserve import envs

MARKER_ENV = envs.LAUNCH_ID.name
PR_SET_CHILD_SUBREAPER = 36

LogFn = Callable[[str], None]


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux >= 3.4). True on success."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def _cmdline(p: psutil.Process, width: int = 160) -> str:
    try:
        cmd = " ".join(p.cmdline())
        if not cmd:
            cmd = f"[{p.name()}]"
    except (psutil.Error, OSError):
        cmd = "?"
    return cmd if len(cmd) <= width else cmd[: width - 3] + "..."


def describe(p: psutil.Process, width: int = 160) -> str:
    return f"pid {p.pid}: {_cmdline(p, width)}"


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no memory and cannot be signalled)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class SeenProcess:
    pid: int
    create_time: float
    cmdline: str


class ProcessTree:
    """The set of processes belonging to one launched command."""

    def __init__(
        self,
        root: int | psutil.Process,
        *,
        marker: str | None = None,
        started_at: float | None = None,
        session_leader: bool = False,
        adopt_orphans: bool = False,
        full_scan_every: float = 2.0,
    ):
        """`root`: the launched process (it may already have exited).

        `session_leader`: the root was started with start_new_session=True, so its PID
        is also the id of its session and process group (known even if it is gone).
        `adopt_orphans`: this process is a child subreaper that starts nothing else
        after `started_at` (except PIDs put in `exclude`), so every child of ours
        created since then - re-parented orphans included - belongs to the tree.
        """
        pid = root.pid if isinstance(root, psutil.Process) else int(root)
        try:
            self.root: psutil.Process | None = root if isinstance(root, psutil.Process) else psutil.Process(pid)
        except psutil.NoSuchProcess:
            self.root = None
        self.marker = marker
        if started_at is None:
            started_at = self.root.create_time() if self.root is not None else time.time()
        self.launched_at = started_at
        # Anything created before this instant is never ours (1 s slack for clock granularity).
        self.started_at = started_at - 1.0
        self.sid: int | None = None
        self.pgid: int | None = None
        if session_leader:
            self.sid = self.pgid = pid
        else:
            try:
                self.sid, self.pgid = os.getsid(pid), os.getpgid(pid)
            except OSError:
                pass
        self.me = psutil.Process()
        self.exclude: set[int] = set()  # helpers the supervisor itself runs (py-spy)
        self.known: dict[int, psutil.Process] = {}
        self.seen: dict[int, SeenProcess] = {}  # everything ever found, for reports
        self._last_full = 0.0
        self.full_scan_every = full_scan_every
        self.adopt_orphans = adopt_orphans
        self._not_ours: set[tuple[int, float]] = set()  # (pid, create_time) checked negative
        if self.root is not None:
            self._add(self.root)

    # ------------------------------------------------------------------ discovery
    def _add(self, p: psutil.Process) -> bool:
        """Record `p` as a member unless it is us, a helper, or older than the launch."""
        if p.pid == self.me.pid or p.pid in self.exclude:
            return False
        if p.pid in self.known:
            return True
        try:
            ct = p.create_time()
        except psutil.Error:
            return False
        if ct < self.started_at:
            return False
        self.known[p.pid] = p
        if p.pid not in self.seen or self.seen[p.pid].create_time != ct:
            self.seen[p.pid] = SeenProcess(p.pid, ct, _cmdline(p))
        return True

    def _session_alive(self) -> bool:
        """True while some process we know is still in the root's session/group.

        Guards the sid/pgid match against the (unlikely) reuse of those ids after the
        whole tree is gone.
        """
        if self.sid is None:
            return False
        for p in list(self.known.values()):
            try:
                if _alive(p) and (os.getsid(p.pid) == self.sid or os.getpgid(p.pid) == self.pgid):
                    return True
            except OSError:
                continue
        return False

    def _full_scan(self, procs: Iterable[psutil.Process]) -> None:
        """Members that are not (or no longer) descendants: same session/group, or marker."""
        session_alive = self._session_alive()
        for p in procs:
            if p.pid in self.known or p.pid == self.me.pid or p.pid in self.exclude:
                continue
            try:
                ct = p.create_time()
                if ct < self.started_at or (p.pid, ct) in self._not_ours:
                    continue
                ours = False
                if session_alive:
                    try:
                        ours = os.getsid(p.pid) == self.sid or os.getpgid(p.pid) == self.pgid
                    except OSError:
                        ours = False
                if not ours and self.marker:
                    try:
                        ours = p.environ().get(MARKER_ENV) == self.marker
                    except (psutil.Error, OSError):
                        ours = False
                if ours:
                    self._add(p)
                else:
                    # A process cannot join another session later, nor change the
                    # environment it was started with: a negative answer is final.
                    self._not_ours.add((p.pid, ct))
            except psutil.Error:
                continue

    def refresh(self, full: bool | None = None) -> None:
        """Add newly created members; forget dead ones (they stay in `seen`).

        One pass over the process table per call, whatever the size of the tree.
        """
        for pid, p in list(self.known.items()):
            if not _alive(p):
                del self.known[pid]
        procs: dict[int, psutil.Process] = {}
        children: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            ppid = p.info.get("ppid")
            procs[p.pid] = p
            if ppid is not None:
                children.setdefault(ppid, []).append(p.pid)
        now = time.monotonic()
        if full or (full is None and now - self._last_full >= self.full_scan_every):
            self._last_full = now
            self._full_scan(procs.values())
        # Descendants of every member; with adopt_orphans, also our own children
        # (orphans re-parented to us, the subreaper).
        start = [pid for pid, p in self.known.items() if procs.get(pid) == p]
        if self.adopt_orphans:
            start += [c for c in children.get(self.me.pid, []) if c not in self.exclude]
        visited: set[int] = set()
        while start:
            pid = start.pop()
            if pid in visited or pid == self.me.pid or pid in self.exclude:
                continue
            visited.add(pid)
            if pid not in self.known:
                p = procs.get(pid)
                if p is None or not self._add(p):
                    continue
            start.extend(children.get(pid, ()))

    def members(self, refresh: bool = True, full: bool | None = None) -> list[psutil.Process]:
        if refresh:
            self.refresh(full=full)
        return sorted((p for p in self.known.values() if _alive(p)), key=lambda p: p.pid)

    def is_ours(self, pid: int) -> bool:
        """Was `pid` (as the process that has it now) ever a member of this tree?"""
        s = self.seen.get(pid)
        if s is None:
            return False
        try:
            return abs(psutil.Process(pid).create_time() - s.create_time) < 0.01
        except psutil.Error:
            return False

    # ------------------------------------------------------------------ reaping
    def reap(self, keep: Iterable[int] = ()) -> None:
        """Collect exit statuses of zombie children of ours (re-parented orphans).

        `keep` lists children whose status someone else collects (the Popen root).
        Only with adopt_orphans: otherwise our children are not ours to reap.
        """
        if not self.adopt_orphans:
            return
        keep = set(keep) | self.exclude
        try:
            kids = self.me.children()
        except psutil.Error:
            return
        for c in kids:
            if c.pid in keep:
                continue
            try:
                if c.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(c.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError, OSError):
                pass

    def drain_zombies(
        self, keep: Iterable[int] = (), timeout: float = 1.0, on_tick: Callable[[], None] | None = None
    ) -> None:
        """Reap the dead of the tree for up to `timeout` s.

        A killed worker's child becomes a zombie and is re-parented to us (the subreaper)
        only once its own parent is gone; reaping it here means no <defunct> entry of
        the tree is left for an init that might never collect it.
        """
        end = time.monotonic() + timeout
        while True:
            if on_tick:
                on_tick()
            self.reap(keep)
            pending = False
            for s in self.seen.values():
                if s.pid in keep:
                    continue
                try:
                    p = psutil.Process(s.pid)
                    if (
                        abs(p.create_time() - s.create_time) < 0.01
                        and p.status() == psutil.STATUS_ZOMBIE
                        and (self.adopt_orphans or p.ppid() != self.me.pid)
                    ):
                        pending = True
                        break
                except psutil.Error:
                    continue
            if not pending or time.monotonic() >= end:
                return
            time.sleep(0.05)


@dataclass
class StopResult:
    signalled: list[str] = field(default_factory=list)  # got the first signal
    sigkilled: list[str] = field(default_factory=list)  # ignored it for the grace period
    survivors: list[str] = field(default_factory=list)  # still alive after SIGKILL

    @property
    def clean(self) -> bool:
        return not self.survivors


def _send(p: psutil.Process, sig: int) -> bool:
    try:
        p.send_signal(sig)  # psutil checks the create_time first: no PID-reuse accidents
        return True
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, PermissionError, OSError):
        return False


def stop_tree(
    tree: ProcessTree,
    *,
    grace: float = 10.0,
    kill_wait: float = 10.0,
    first_signal: int = signal.SIGTERM,
    log: LogFn = print,
    keep_unreaped: Iterable[int] = (),
    poll: float = 0.1,
    on_tick: Callable[[], None] | None = None,
    hurry: Callable[[], bool] | None = None,
) -> StopResult:
    """first_signal (SIGTERM) to every member, wait `grace`, SIGKILL what is left.

    Members appearing meanwhile (a process forking while shutting down) get the same
    treatment. Returns who was signalled, who needed SIGKILL, and who survived even that
    (typically a process in uninterruptible sleep inside a driver).
    `on_tick` runs every poll (the supervisor reaps its Popen child there); when
    `hurry()` turns true (a second Ctrl-C) the rest of the grace period is skipped.
    """
    res = StopResult()
    sig_name = signal.Signals(first_signal).name
    termed: set[int] = set()
    t_end = time.monotonic() + max(0.0, grace)
    first = True
    alive: list[psutil.Process] = []
    while True:
        alive = tree.members(full=first or None)
        first = False
        new = [p for p in alive if p.pid not in termed]
        for p in new:
            termed.add(p.pid)
            if _send(p, first_signal):
                res.signalled.append(describe(p))
                _send(p, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        if new:
            log(f"{sig_name} -> {len(new)} process(es): " + ", ".join(str(p.pid) for p in new))
        if on_tick:
            on_tick()
        tree.reap(keep_unreaped)
        if not alive:
            tree.drain_zombies(keep_unreaped, on_tick=on_tick)
            return res
        if time.monotonic() >= t_end or (hurry is not None and hurry()):
            break
        time.sleep(poll)

    alive = tree.members(full=True)
    if not alive:
        tree.drain_zombies(keep_unreaped, on_tick=on_tick)
        return res
    log(f"{len(alive)} process(es) still alive after the {grace:g} s grace: SIGKILL")
    for p in alive:
        log(f"  SIGKILL {describe(p)}")
        res.sigkilled.append(describe(p))
    t_end = time.monotonic() + max(0.0, kill_wait)
    killed: set[int] = set()
    last_resend = 0.0
    while True:
        now = time.monotonic()
        resend = now - last_resend >= 1.0
        if resend:
            last_resend = now
        for p in alive:
            if p.pid not in killed or resend:
                if p.pid not in killed and describe(p) not in res.sigkilled:
                    log(f"  SIGKILL {describe(p)} (new)")
                    res.sigkilled.append(describe(p))
                killed.add(p.pid)
                _send(p, signal.SIGKILL)
        if on_tick:
            on_tick()
        tree.reap(keep_unreaped)
        time.sleep(poll)
        alive = tree.members()
        if not alive or time.monotonic() >= t_end:
            break
    tree.drain_zombies(keep_unreaped, on_tick=on_tick)
    for p in alive:
        try:
            state = p.status()
        except psutil.Error:
            state = "?"
        res.survivors.append(f"{describe(p)} (state {state})")
    return res


def process_table(procs: Iterable[psutil.Process]) -> list[str]:
    """One line per process: what it is doing right now (state, kernel wait channel, CPU)."""
    lines = [f"{'PID':>7} {'PPID':>7} {'STATE':<10} {'WCHAN':<24} {'CPU s':>8} {'RSS MiB':>8}  COMMAND"]
    for p in procs:
        try:
            with p.oneshot():
                ppid = p.ppid()
                state = p.status()
                ct = p.cpu_times()
                cpu = ct.user + ct.system
                rss = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        try:
            with open(f"/proc/{p.pid}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            wchan = "-"
        lines.append(f"{p.pid:>7} {ppid:>7} {state:<10} {wchan[:24]:<24} {cpu:>8.1f} {rss:>8.0f}  {_cmdline(p, 100)}")
    return lines


def device_holders(prefix: str = "/dev/nvidia", pids: Iterable[int] | None = None) -> dict[int, list[str]]:
    """PID -> device files under `prefix` it has open (Linux /proc; {} elsewhere).

    Processes of other users are skipped silently unless we are root. The calling
    process is left out (NVML itself opens /dev/nvidia*).
    """
    out: dict[int, list[str]] = {}
    me = os.getpid()
    if not os.path.isdir("/proc/self/fd"):
        return out
    for pid in pids if pids is not None else psutil.pids():
        if pid == me:
            continue
        base = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        found: set[str] = set()
        for fd in fds:
            try:
                target = os.readlink(f"{base}/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(target)
        if found:
            out[pid] = sorted(found)
    return out
