"""Tensor parallelism over several machines: node 0's side (`Cluster`) and the
headless launcher every other node runs (`run_node`).

    node 0:  specserve serve --tp 4 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:29500 ...
    node 1:  specserve serve --tp 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:29500 ...

Every node starts its own tp / nnodes workers; all of them join one
torch.distributed group (global rank = node_rank * local + local_rank) through
the rendezvous store node 0 keeps at PORT. Node 0 drives every step.

The design keeps the worker protocol of one machine unchanged: a worker talks
to its driver over one connection, whether a socketpair (node 0's own workers)
or a TCP connection to node 0 at PORT+1 (the other nodes' workers). A remote
launcher opens that TCP connection, authenticates it, names the worker's group
and rank, and hands the socket to the worker it spawns; after that, driver and
worker exchange exactly the messages they exchange on one machine, and nothing
is relayed. This is simpler and more robust than a relay: there is no second
copy of the protocol to keep in step, and a worker that dies closes its own
socket, which node 0 sees at once.

Besides the workers' connections each launcher keeps one control connection to
node 0, for the life of node 0's process (a `bench` run starts one group per
configuration, a graph-capture fallback a second one): node 0 asks it to spawn
a group's workers (sending its NCCL profile and --env values, so that every
node applies node 0's choice) or to stop them; both sides send a heartbeat
every second. A control connection that closes, or stays silent for
`silence_s`, is a lost node: node 0 stops its own workers and every group
fails naming the node; a launcher that loses node 0 stops its workers and
exits 1. Collectives across nodes are bounded by --dist-timeout too (the
process group's timeout), and a node that never joins fails start-up after
--dist-timeout.

Every connection starts with a mutual HMAC challenge over the nodes' shared
secret (specserve.distributed.dist_key: --dist-key-file, SPECSERVE_DIST_KEY, or a
per-run secret when every node is on this machine's loopback); node 0 refuses a
routable address without one. Messages are JSON frames checked against the
protocol below (specserve.distributed.wire), never pickles, so a peer that
gets in can at worst send wrong values, not run code; a malformed message drops
its connection. Nothing is encrypted: prompts and outputs cross the network in
clear, as do the collectives' tensors and the rendezvous store's keys.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import wait

from specserve.config import ConfigError, ParallelConfig, parse_dist_addr
from specserve.distributed import dist_key, wire

log = logging.getLogger("specserve.tp")

BEAT_S = 1.0  # heartbeat period on every control connection
# A headless node logs its state this often: its liveness for a supervisor that judges hangs
# from log silence (`specserve launch`, whose default stall timeout is far longer).
STATUS_EVERY_S = 60.0
HANDSHAKE_S = 10  # a peer has this long to authenticate and send its first message

# The protocol: every message by its "type", with its fields and their types (wire.check).
FIRST = {  # a launcher's or a remote worker's first message to node 0
    "node": {"node": int, "nnodes": int, "tp": int, "pid": int, "host": str},
    "worker": {"group": int, "rank": int, "node": int},
}
TO_LAUNCHER = {
    "welcome": {},
    "reject": {"reason": str},
    "beat": {},
    "bye": {},
    "spawn": {"group": int, "profile": {"name": str, "env": wire.STR_MAP}, "explicit": wire.STR_MAP},
    "stop": {"group": int, "reason": (str, type(None))},
}
FROM_LAUNCHER = {"beat": {}, "error": {"error": str}}

# What node 0 may set in another node's worker environment: values for NCCL, gloo and specserve,
# never a variable that makes the worker load a library or read or write a file there.
REMOTE_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "SPECSERVE_")
REMOTE_ENV_CODE = ("PLUGIN", "_FILE", "_PATH", "_LIB", "_DIR")


def remote_env_refused(env: dict[str, str]) -> list[str]:
    """The variables of `env` that node 0 may not set on this node (see REMOTE_ENV_*)."""
    return [k for k in env if not k.startswith(REMOTE_ENV_PREFIXES) or any(c in k for c in REMOTE_ENV_CODE)]


def _receive_timeout(sock: socket.socket, seconds: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


def _open(sock: socket.socket, key: bytes, server: bool) -> tuple[wire.Conn, dict | None]:
    """`sock` as a wire.Conn after the handshake, and on node 0's side the peer's first message.
    Both run under a receive timeout, so a peer that stalls is dropped instead of blocking us;
    the connection blocks without one afterwards."""
    sock.setblocking(True)
    _receive_timeout(sock, HANDSHAKE_S)
    conn = wire.Conn(os.dup(sock.fileno()))  # the same socket; `sock` keeps the options handle
    try:
        wire.handshake(conn, key, server)
        first = wire.check(conn.recv(), FIRST, "first message") if server else None
        _receive_timeout(sock, 0)
    except BaseException:
        conn.close()
        raise
    finally:
        sock.close()
    return conn, first


def connect(host: str, port: int, deadline: float, first: dict, key_file: str | None) -> wire.Conn:
    """A TCP connection to node 0's channel, authenticated both ways, that has sent `first`.
    Node 0 may not be up yet: retried until `deadline` (time.monotonic)."""
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"cannot reach node 0 at {host}:{port} ({e}): is node 0 started with the same "
                    "--dist-init-addr, and is the port open?"
                ) from None
            time.sleep(0.5)
    try:  # the secret is read once node 0 listens: a loopback run's per-run secret exists by then
        key = dist_key.secret(key_file, host, port - 1, node_rank=first["node"])
        conn, _ = _open(sock, key, server=False)
    except ConfigError:
        sock.close()
        raise
    except Exception as e:  # noqa: BLE001 - a wrong secret, a reset: one clear message
        raise ConfigError(
            f"node 0 at {host}:{port} refused this node ({type(e).__name__}: {e or 'closed'}): is the "
            "secret (--dist-key-file / SPECSERVE_DIST_KEY) the same on every node?"
        ) from None
    conn.send(first)
    return conn


class _Peer:
    """A control connection to one remote launcher, as node 0 sees it."""

    def __init__(self, node: int, conn: wire.Conn, info: dict):
        self.node, self.conn, self.info = node, conn, info
        self.last_heard = time.monotonic()
        self.lock = threading.Lock()  # sends come from the monitor thread and from the caller

    def send(self, msg: dict) -> None:
        with self.lock:
            self.conn.send(msg)

    def where(self) -> str:
        return f"node {self.node} ({self.info.get('host', '?')}, launcher pid {self.info.get('pid', '?')})"


class Cluster:
    """Node 0's end: the rendezvous store, the channel every remote launcher and worker
    connects to, and the monitor that finds a lost node. One per process (`get`)."""

    _instance: "Cluster | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls, par: ParallelConfig) -> "Cluster":
        with cls._lock:
            c = cls._instance
            if c is None:
                c = cls._instance = cls(par)
            elif (c.nnodes, c.tp, c.addr) != (par.nnodes, par.tp, par.dist_init_addr):
                raise ConfigError(
                    f"this process already drives --nnodes {c.nnodes} --tp {c.tp} at {c.addr}; "
                    "one process drives one set of nodes"
                )
            if c.lost:
                raise RuntimeError(f"the multi-node group is broken: {c.lost}")
            return c

    def __init__(self, par: ParallelConfig):
        import torch.distributed as dist

        self.nnodes, self.tp, self.local, self.addr = par.nnodes, par.tp, par.local_tp, par.dist_init_addr
        self.host, self.port = parse_dist_addr(par.dist_init_addr)
        self.timeout = par.dist_timeout
        self.silence_s = min(30.0, par.dist_timeout)
        self.lost: str | None = None
        self.on_lost: list = []  # callbacks(reason) of the live groups
        self.peers: dict[int, _Peer] = {}
        self._groups = 0
        # The secret first: without one, a routable address is refused before anything listens.
        self.key = dist_key.secret(par.dist_key_file, self.host, self.port, node_rank=0)
        try:
            self.store = dist.TCPStore(self.host, self.port, None, True, wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - a busy port or an address not on this machine
            raise ConfigError(
                f"--dist-init-addr {self.addr}: node 0 cannot open the rendezvous store on port "
                f"{self.port} ({e}); run node 0 on {self.host} with a free port"
            ) from None
        # A loopback run listens on loopback only. Otherwise every interface, as the store listens: HOST
        # may name an address this machine only reaches through another (a hostname that /etc/hosts
        # maps to 127.0.1.1, a NAT).
        dual = socket.has_dualstack_ipv6() and not dist_key.is_loopback(self.host)
        bind = ("127.0.0.1" if self.host == "localhost" else self.host) if dist_key.is_loopback(self.host) else ""
        family = socket.AF_INET6 if dual or ":" in bind else socket.AF_INET
        try:
            self.listener = socket.create_server((bind, self.port + 1), family=family, backlog=256, dualstack_ipv6=dual)
        except OSError as e:
            raise ConfigError(
                f"--dist-init-addr {self.addr}: node 0 cannot listen on port {self.port + 1} ({e}); "
                "PORT and PORT+1 must both be free"
            ) from None
        self.listener.settimeout(0.25)
        try:
            self._join()
        except BaseException:
            self._close_all()
            raise
        threading.Thread(target=self._monitor, name="specserve-nodes", daemon=True).start()
        atexit.register(self.shutdown)

    # ------------------------------------------------------------ start-up
    def accept(self, deadline: float, want: str, check=lambda: None) -> tuple[wire.Conn, dict] | None:
        """One authenticated connection with its first message, or None after `deadline`. A peer
        without the secret, or whose first message breaks the protocol, is dropped and logged."""
        while time.monotonic() < deadline:
            check()
            try:
                sock, peer = self.listener.accept()
            except socket.timeout:
                continue
            try:
                conn, first = _open(sock, self.key, server=True)
            except Exception as e:  # noqa: BLE001 - a stray, unauthenticated or malformed peer: drop it
                log.warning(
                    "[tp] refused a connection from %s on port %d: %s: %s",
                    peer[0],
                    self.port + 1,
                    type(e).__name__,
                    e or "closed",
                )
                continue
            if first["type"] != want:
                conn.send({"type": "reject", "reason": f"node 0 expected a {want} connection, got {first['type']}"})
                conn.close()
                continue
            return conn, first
        return None

    def _join(self) -> None:
        deadline = time.monotonic() + self.timeout
        log.info(
            "[tp] node 0: waiting up to %.0f s for %d other node(s) at %s (port %d)",
            self.timeout,
            self.nnodes - 1,
            self.host,
            self.port + 1,
        )
        while len(self.peers) < self.nnodes - 1:
            got = self.accept(deadline, "node")
            if got is None:
                missing = [n for n in range(1, self.nnodes) if n not in self.peers]
                raise ConfigError(
                    f"node(s) {missing} did not join within --dist-timeout {self.timeout:g} s: start "
                    f"the same command with --node-rank N on each, pointing at {self.addr}"
                )
            conn, info = got
            node = info["node"]
            problem = None
            if (info["nnodes"], info["tp"]) != (self.nnodes, self.tp):
                problem = (
                    f"node {node} was started with --tp {info['tp']} --nnodes {info['nnodes']}, node 0 with "
                    f"--tp {self.tp} --nnodes {self.nnodes}"
                )
            elif node in self.peers:
                problem = f"two launchers claim --node-rank {node} ({self.peers[node].info['host']} and {info['host']})"
            if problem:
                conn.send({"type": "reject", "reason": problem})
                conn.close()
                raise ConfigError(problem)
            self.peers[node] = _Peer(node, conn, info)
            conn.send({"type": "welcome"})
            log.info("[tp] node %d joined from %s (launcher pid %s)", node, info["host"], info["pid"])

    def node_of(self, rank: int) -> int:
        return rank // self.local

    def spawn_remote(self, group_id: int, profile, explicit: dict, check) -> dict[int, wire.Conn]:
        """Ask every launcher for its workers of group `group_id`; their connections by global rank."""
        for p in self.peers.values():
            p.send(
                {
                    "type": "spawn",
                    "group": group_id,
                    "profile": {"name": profile.name, "env": dict(profile.env)},
                    "explicit": dict(explicit),
                }
            )
        want = {r for r in range(self.local, self.tp)}
        out: dict[int, wire.Conn] = {}
        deadline = time.monotonic() + self.timeout
        while want - set(out):
            got = self.accept(deadline, "worker", check)
            if got is None:
                missing = sorted(want - set(out))
                nodes = sorted({self.node_of(r) for r in missing})
                raise RuntimeError(
                    f"the workers {missing} of node(s) {nodes} did not connect within --dist-timeout {self.timeout:g} s"
                )
            conn, info = got
            if info.get("group") != group_id or info.get("rank") not in want:
                conn.close()  # a straggler of an earlier group
                continue
            out[info["rank"]] = conn
        return out

    def new_group_id(self) -> int:
        self._groups += 1
        return self._groups

    def stop_remote(self, group_id: int, reason: str | None) -> None:
        """The launchers stop whatever is left of a group's workers (best effort)."""
        for p in self.peers.values():
            try:
                p.send({"type": "stop", "group": group_id, "reason": reason})
            except OSError:
                pass

    # ------------------------------------------------------------ monitoring
    def _monitor(self) -> None:
        next_beat = 0.0
        while not self.lost:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT_S
                for p in list(self.peers.values()):
                    try:
                        p.send({"type": "beat"})
                    except OSError:
                        pass  # found below as a closed connection
            by_conn = {p.conn: p for p in self.peers.values()}
            for c in wait(list(by_conn), timeout=0.25):
                p = by_conn[c]
                try:
                    msg = wire.check(c.recv(), FROM_LAUNCHER, p.where())
                except (EOFError, OSError):
                    self._lose(f"{p.where()} went away (its launcher exited or the connection broke)")
                    return
                except wire.WireError as e:
                    self._lose(f"{p.where()} sent a malformed message ({e})")
                    return
                p.last_heard = time.monotonic()
                if msg["type"] == "error":
                    self._lose(f"{p.where()} failed: {msg['error']}")
                    return
            for p in self.peers.values():
                if time.monotonic() - p.last_heard > self.silence_s:
                    self._lose(
                        f"{p.where()} was silent for {self.silence_s:.0f} s (the machine or its network is down)"
                    )
                    return

    def _lose(self, reason: str) -> None:
        if self.lost:  # already ended (node 0 shutting down closes the connections too)
            return
        self.lost = reason
        log.error("[tp] %s: ending the group", reason)
        for cb in list(self.on_lost):
            try:
                cb(reason)
            except Exception:  # noqa: BLE001 - one failing callback must not keep the others from running
                log.exception("[tp] a lost-node callback failed")
        self._close_all()

    def shutdown(self) -> None:
        """Tell every launcher that node 0 is done (they exit 0), at the end of this process."""
        if self.lost:
            return
        self.lost = "node 0 shut down"
        for p in self.peers.values():
            try:
                p.send({"type": "bye"})
            except OSError:
                pass
        self._close_all()

    def _close_all(self) -> None:
        for p in self.peers.values():
            try:
                p.conn.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass


# ------------------------------------------------------------------ headless nodes
def run_node(par: ParallelConfig) -> int:
    """A headless node: join node 0, start this node's workers whenever node 0 asks, stop them
    when it says so, and exit when node 0 ends (0) or is lost (1)."""
    from specserve.distributed import group as group_mod
    from specserve.distributed.nccl_profiles import Profile, build_worker_env

    logging.basicConfig(level=logging.INFO, format=f"[node {par.node_rank}] %(message)s", stream=sys.stderr)
    host, port = parse_dist_addr(par.dist_init_addr)
    node, local = par.node_rank, par.local_tp
    deadline = time.monotonic() + par.dist_timeout
    try:
        if not dist_key.is_loopback(host):  # no usable secret: say so now, not after reaching node 0
            dist_key.secret(par.dist_key_file, host, port, node)
        ctl = connect(
            host,
            port + 1,
            deadline,
            {
                "type": "node",
                "node": node,
                "nnodes": par.nnodes,
                "tp": par.tp,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            },
            par.dist_key_file,
        )
        if not ctl.poll(max(deadline - time.monotonic(), 1.0)):
            raise ConfigError(f"node 0 at {par.dist_init_addr} accepted this node but never answered")
        answer = wire.check(ctl.recv(), TO_LAUNCHER, "node 0")
    except (ConfigError, wire.WireError, EOFError, OSError) as e:
        print(f"error: node {node}: {e}", file=sys.stderr)
        return 1
    if answer["type"] != "welcome":
        print(f"error: node {node}: node 0 refused this node: {answer.get('reason')}", file=sys.stderr)
        return 1
    log.info(
        "joined node 0 at %s as node %d of %d (%d workers here, ranks %d..%d)",
        par.dist_init_addr,
        node,
        par.nnodes,
        local,
        node * local,
        node * local + local - 1,
    )
    procs: dict[int, list] = {}  # group id -> Popen of this node's workers
    silence_s = min(30.0, par.dist_timeout)
    last_heard, next_beat = time.monotonic(), 0.0
    next_status = time.monotonic() + STATUS_EVERY_S
    code, why = 1, ""
    failed: str | None = None  # why node 0 ended this node's latest group, if not in order

    def stop(gid: int) -> None:
        for p in procs.pop(gid, []):
            if p.poll() is None:
                p.kill()
            p.wait()

    try:
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT_S
                ctl.send({"type": "beat"})
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                alive = {gid: sum(p.poll() is None for p in ps) for gid, ps in procs.items()}
                log.info(
                    "status: node 0 heard %.1f s ago; workers alive per group: %s",
                    now - last_heard,
                    alive or "none (waiting for node 0)",
                )
            if ctl.poll(0.25):
                msg = wire.check(ctl.recv(), TO_LAUNCHER, "node 0")
                last_heard = time.monotonic()
                op = msg["type"]
                if op == "spawn":
                    gid, failed = msg["group"], None
                    prof_env, explicit = msg["profile"]["env"], msg["explicit"]
                    refused = remote_env_refused({**prof_env, **explicit})
                    if refused:  # node 0's hello check then names them, failing the start-up
                        log.warning(
                            "refused node 0's %s for this node's workers: a variable that could load code "
                            "or write files here must be set in this node's own environment",
                            refused,
                        )
                    prof = Profile(
                        msg["profile"]["name"], {k: v for k, v in prof_env.items() if k not in refused}, "node 0"
                    )
                    wenv = build_worker_env(
                        dict(os.environ), prof, {k: v for k, v in explicit.items() if k not in refused}
                    )
                    for note in wenv.notes:
                        log.warning("%s", note)
                    procs[gid] = []
                    for i in range(local):
                        rank = node * local + i
                        conn = connect(
                            host,
                            port + 1,
                            time.monotonic() + par.dist_timeout,
                            {"type": "worker", "group": gid, "rank": rank, "node": node},
                            par.dist_key_file,
                        )
                        procs[gid].append(
                            group_mod.spawn_worker(wenv.env, rank, i, par.tp, conn.fileno(), (host, port))
                        )
                        conn.close()  # the worker holds the socket now
                    log.info(
                        "started workers %s for group %d (pids %s)",
                        [node * local + i for i in range(local)],
                        gid,
                        [p.pid for p in procs[gid]],
                    )
                elif op == "stop":
                    stop(msg["group"])
                    if msg["reason"]:
                        failed = msg["reason"]
                        log.warning("node 0 stopped group %d: %s", msg["group"], failed)
                elif op == "bye":
                    code, why = (1, f"node 0 ended after an error ({failed})") if failed else (0, "node 0 finished")
                    break
                elif op == "reject":
                    why = f"node 0 refused this node: {msg['reason']}"
                    break
            elif time.monotonic() - last_heard > silence_s:
                why = f"node 0 at {par.dist_init_addr} was silent for {silence_s:.0f} s"
                break
            for gid, ps in list(procs.items()):
                dead = [p for p in ps if p.poll() not in (None, 0)]
                if dead:  # node 0 sees the closed socket too; the rest of the group cannot go on
                    log.warning("worker pid %d of group %d exited with code %s", dead[0].pid, gid, dead[0].returncode)
                    stop(gid)
    except (EOFError, OSError) as e:
        why = f"lost node 0 at {par.dist_init_addr} ({type(e).__name__}: {e or 'connection closed'})"
    except wire.WireError as e:
        why = f"node 0 at {par.dist_init_addr} sent a malformed message ({e})"
    except ConfigError as e:
        why = str(e)
    finally:
        for gid in list(procs):
            stop(gid)
        if code:
            try:  # node 0 names the reason instead of only seeing the connection close
                ctl.send({"type": "error", "error": why})
            except OSError:
                pass
        ctl.close()
    if code:
        print(f"error: node {node}: {why}; stopped this node's workers", file=sys.stderr)
    else:
        log.info("%s; exiting", why)
    return code
