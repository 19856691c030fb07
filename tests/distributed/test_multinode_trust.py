"""A node cannot be taken over: the shared secret, the JSON wire format, and what node 0 and a
headless node do with a peer that lacks the secret or sends a malformed message (loopback only;
the refusal of a routable address without a secret happens before anything binds)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest

from specserve.cli import main
from specserve.config import ConfigError, ParallelConfig
from specserve.distributed import dist_key, wire
from specserve.distributed.multinode import TO_LAUNCHER, Cluster, remote_env_refused
from specserve.engine.llm import LLM
from specserve.engine.sampling import SamplingParams

from nodes import WAIT, finish, free_port_pair, generate_args, start_node
from tiny import CODE_PROMPTS

SECRET = "0123456789abcdef0123456789abcdef"


class _MakesAFile:
    """Unpickling this creates `path`: the proof that a receiver did not unpickle."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _frame(obj) -> bytes:
    return json.dumps(obj).encode()


# ------------------------------------------------------------------ the wire format
def test_decode_never_unpickles_and_refuses_every_malformed_frame(tmp_path):
    marker = tmp_path / "pwned"
    bad = {
        "a pickle": pickle.dumps({"type": "node", "x": _MakesAFile(marker)}),
        "garbage": b"\x80\x04garbage{",
        "not an object": _frame([1, 2]),
        "no version": _frame({"m": {"type": "beat"}}),
        "another version": _frame({"v": 99, "m": {"type": "beat"}}),
        "a list message": _frame({"v": 1, "m": [1]}),
        "an unknown tag": _frame({"v": 1, "m": {"x": {"$": "os.system", "fields": {}}}}),
        "a wrong field type": _frame({"v": 1, "m": {"p": {"$": "SamplingParams", "fields": {"max_tokens": "9"}}}}),
        "an unknown field": _frame({"v": 1, "m": {"p": {"$": "SamplingParams", "fields": {"evil": 1}}}}),
        "an invalid value": _frame({"v": 1, "m": {"p": {"$": "SamplingParams", "fields": {"top_p": 7.0}}}}),
        "deep nesting": b'{"v":1,"m":{"a":' + b"[" * 100000 + b"]" * 100000 + b"}}",
        "a huge integer": b'{"v":1,"m":{"a":' + b"9" * 10000 + b"}}",
    }
    for what, data in bad.items():
        with pytest.raises(wire.WireError):
            wire.decode(data)
        assert not marker.exists(), what
    # What the protocol carries round-trips exactly, tuples and int keys included.
    from specserve.engine.llm import RequestOutput
    from specserve.engine.logprobs import TokenLogprob

    msg = {
        "op": "generate",
        "params": [SamplingParams(temperature=0, stop=["x"], seed=3)],
        "choices": {2: 5},
        "out": RequestOutput("r", [1], [2], "t", "length", logprobs=[TokenLogprob(2, -0.5, ((2, -0.5),))]),
    }
    assert wire.decode(wire.encode(msg)) == msg
    with pytest.raises(wire.WireError, match="cannot be sent"):
        wire.encode({"x": object()})
    # The annotation shapes a dataclass field may use.
    import typing

    assert wire._conforms("a", typing.Literal["a", "b"]) and not wire._conforms("c", typing.Literal["a", "b"])
    assert wire._conforms(None, int | None) and not wire._conforms(True, int) and wire._conforms(1, float)
    assert wire._conforms(((1, 0.5),), tuple[tuple[int, float], ...]) and not wire._conforms([1], tuple[int, ...])


def test_schemas_refuse_wrong_types_missing_and_extra_fields():
    ok = {"type": "stop", "group": 1, "reason": None}
    assert wire.check(dict(ok), TO_LAUNCHER, "t") == ok
    for bad in (
        {**ok, "group": "1"},
        {**ok, "group": True},
        {"type": "stop", "group": 1},
        {**ok, "extra": 1},
        {"type": "exec", "code": "x"},
        {"group": 1},
        {"type": "spawn", "group": 1, "profile": {"name": "p", "env": {"A": 1}}, "explicit": {}},
    ):
        with pytest.raises(wire.WireError):
            wire.check(bad, TO_LAUNCHER, "t")


def test_an_oversize_length_is_refused_before_reading_it():
    a, b = socket.socketpair()
    conn = wire.Conn(b.detach())
    a.sendall(struct.pack("!i", 0x7FFFFFFF))  # claims 2 GiB, sends nothing more
    with pytest.raises(OSError, match="bad message length"):
        conn.recv()
    a.close()


def test_handshake_needs_the_same_secret_on_both_sides():
    for client_key, ok in ((b"k" * 32, True), (b"x" * 32, False)):
        a, b = socket.socketpair()
        server, client = Connection(a.detach()), Connection(b.detach())
        errors = []

        def serve():
            try:
                wire.handshake(server, b"k" * 32, server=True)
            except (wire.WireError, OSError, EOFError) as e:
                errors.append(e)
            server.close()

        t = threading.Thread(target=serve)
        t.start()
        if ok:
            wire.handshake(client, client_key, server=False)
        else:
            with pytest.raises((wire.WireError, EOFError, OSError)):
                wire.handshake(client, client_key, server=False)
        t.join()
        client.close()
        assert bool(errors) != ok


# ------------------------------------------------------------------ the secret
def test_a_routable_address_without_a_secret_is_refused_before_binding(monkeypatch):
    monkeypatch.delenv("SPECSERVE_DIST_KEY", raising=False)
    port = free_port_pair()
    host = socket.gethostname()  # a name is never taken for loopback, whatever /etc/hosts maps it to
    with pytest.raises(ConfigError, match="specserve dist-key --out FILE") as e:
        Cluster(ParallelConfig(tp=2, nnodes=2, dist_init_addr=f"{host}:{port}"))
    assert "is not a loopback address and no secret is set" in str(e.value)
    for p in (port, port + 1):  # nothing was bound
        with socket.socket() as s:
            s.bind(("", p))


def test_cli_refuses_a_routable_address_without_a_secret(monkeypatch, capsys):
    monkeypatch.delenv("SPECSERVE_DIST_KEY", raising=False)
    port = free_port_pair()
    args = [
        "generate",
        "--prompt",
        "x",
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"10.0.0.1:{port}",
        "--device",
        "cpu",
        "--disable-cuda-graph",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error: --dist-init-addr 10.0.0.1" in err and "specserve dist-key --out FILE" in err


def test_a_headless_node_without_a_secret_stops_before_connecting(monkeypatch, capsys):
    from specserve.distributed.multinode import run_node

    monkeypatch.delenv("SPECSERVE_DIST_KEY", raising=False)
    assert run_node(ParallelConfig(tp=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")) == 1
    err = capsys.readouterr().err
    assert "error: node 1: --dist-init-addr 10.0.0.1:29500 is not a loopback address" in err
    assert "this node cannot authenticate to it" in err and "specserve dist-key --out FILE" in err


def test_dist_key_command_and_key_file_rules(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECSERVE_DIST_KEY", raising=False)
    key = tmp_path / "dist.key"
    assert main(["dist-key", "--out", str(key)]) == 0
    assert key.stat().st_mode & 0o777 == 0o600
    text = key.read_text().strip()
    assert len(text) == 64 and dist_key.read_key_file(str(key)) == text.encode()
    assert main(["dist-key", "--out", str(key)]) == 1  # never overwritten
    assert "exists" in capsys.readouterr().err and key.read_text().strip() == text
    assert main(["dist-key"]) == 0 and len(capsys.readouterr().out.strip()) == 64
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=f"run `chmod 600 {key}`"):
        dist_key.secret(str(key), "10.0.0.1", 1, 0)
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16 are needed"):
        dist_key.secret(str(short), "10.0.0.1", 1, 0)
    monkeypatch.setenv("SPECSERVE_DIST_KEY", SECRET)
    assert dist_key.secret(None, "10.0.0.1", 1, 0) == SECRET.encode()


def test_loopback_runs_share_a_per_run_secret_private_to_this_user(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECSERVE_DIST_KEY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    port = free_port_pair()
    with pytest.raises(ConfigError, match="is node 0 running on this machine"):
        dist_key.secret(None, "127.0.0.1", port, node_rank=1)
    k0 = dist_key.secret(None, "127.0.0.1", port, node_rank=0)
    assert dist_key.secret(None, "127.0.0.1", port, node_rank=1) == k0 and len(k0) == 64
    path = dist_key.run_key_path(port)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert dist_key.secret(None, "127.0.0.1", port, node_rank=0) != k0  # a fresh one per run
    path.unlink()


def test_node_0_may_not_set_code_loading_variables_on_other_nodes():
    env = {
        "NCCL_PROTO": "LL",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "SPECSERVE_ALLREDUCE": "torch",
        "LD_PRELOAD": "x.so",
        "PYTHONPATH": "/tmp",
        "NCCL_NET_PLUGIN": "evil",
        "NCCL_DEBUG_FILE": "/etc/x",
        "SPECSERVE_NCCL_LIB": "x.so",
        "BASH_ENV": "x",
        "TRITON_CACHE_DIR": "/tmp",
    }
    assert sorted(remote_env_refused(env)) == [
        "BASH_ENV",
        "LD_PRELOAD",
        "NCCL_DEBUG_FILE",
        "NCCL_NET_PLUGIN",
        "PYTHONPATH",
        "SPECSERVE_NCCL_LIB",
        "TRITON_CACHE_DIR",
    ]


# ------------------------------------------------------------------ hostile peers, real nodes
def _dial(port: int, deadline: float) -> socket.socket:
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.setblocking(True)  # for the Connection that shares its descriptor; reads stay bounded:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", WAIT, 0))
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _dropped(sock: socket.socket) -> bool:
    """Whether node 0 closed this connection (it never answers a refused peer)."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def _authenticated(port: int, key: bytes, deadline: float) -> tuple[socket.socket, Connection]:
    sock = _dial(port, deadline)
    conn = Connection(os.dup(sock.fileno()))
    wire.handshake(conn, key, server=False)
    return sock, conn


@pytest.mark.slow
def test_hostile_peers_are_dropped_without_running_anything_and_the_nodes_still_work(pair, tmp_path):
    target, draft = pair
    key = tmp_path / "dist.key"
    key.write_text(SECRET)
    key.chmod(0o600)
    marker = tmp_path / "pwned"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(
        model=str(target), draft=str(draft), spec_steps=3, device="cpu", max_model_len=96, max_num_seqs=4
    ).generate(CODE_PROMPTS, greedy)
    port = free_port_pair()
    args = generate_args(target, draft, ["--dist-key-file", str(key)])
    node0 = start_node("generate", 0, port, args, timeout=WAIT)
    node1 = None
    try:
        deadline = time.monotonic() + WAIT
        # No secret: the handshake fails and node 0 closes the connection.
        sock = _dial(port + 1, deadline)
        wrong = Connection(os.dup(sock.fileno()))
        with pytest.raises((wire.WireError, EOFError, OSError)):
            wire.handshake(wrong, b"not-the-secret-at-all", server=False)
        wrong.close()
        assert _dropped(sock)
        # The secret, then a first message that breaks the protocol: each is dropped unread.
        first = {"type": "node", "node": 1, "nnodes": 2, "tp": 2, "pid": 1, "host": "x"}
        hostile = [
            pickle.dumps(_MakesAFile(marker)),
            b"{not json",
            _frame({"v": 1, "m": {**first, "node": "1"}}),  # a wrong type
            _frame({"v": 1, "m": {**first, "extra": 1}}),
            _frame({"v": 1, "m": {"type": "spawn", "group": 1, "profile": {"name": "x", "env": {}}, "explicit": {}}}),
            _frame({"v": 2, "m": first}),
        ]
        for data in hostile:
            sock, conn = _authenticated(port + 1, SECRET.encode(), deadline)
            conn.send_bytes(data)
            conn.close()
            assert _dropped(sock)
        sock, conn = _authenticated(port + 1, SECRET.encode(), deadline)
        sock.sendall(struct.pack("!i", 0x7FFFFFF0))  # an oversize length, and no body
        conn.close()
        assert _dropped(sock)
        # The real node 1 joins after all that, and the run is the one a single process gives.
        node1 = start_node("generate", 1, port, args, timeout=WAIT)
        (c0, out0, err0), (c1, _, err1) = finish(node0, node1)
    finally:
        for p in (node0, node1):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert c0 == 0, err0
    assert c1 == 0, err1
    assert not marker.exists()
    refused = [line for line in err0.splitlines() if "refused a connection from 127.0.0.1" in line]
    assert len(refused) == 1 + len(hostile) + 1, refused
    assert "WireError" in refused[0] and "not a JSON frame" in refused[1] and "bad message length" in refused[-1]
    outs = [json.loads(line) for line in out0.splitlines()]
    assert [o["token_ids"] for o in outs] == [o.token_ids for o in ref]


@pytest.mark.slow
def test_a_headless_node_drops_a_node_0_that_sends_a_malformed_message(pair, tmp_path):
    """Here the test is node 0: it authenticates, welcomes node 1, then sends a pickle."""
    target, _ = pair
    port = free_port_pair()
    marker = tmp_path / "pwned"
    key = SECRET.encode()
    with socket.create_server(("127.0.0.1", port + 1)) as listener:
        listener.settimeout(WAIT)
        node1 = start_node(
            "serve", 1, port, ["--model", str(target), "--skip-check"], env={"SPECSERVE_DIST_KEY": SECRET}, timeout=WAIT
        )
        try:
            sock, _ = listener.accept()
            conn = wire.Conn(sock.detach())
            wire.handshake(conn, key, server=True)
            assert conn.recv()["type"] == "node"
            conn.send({"type": "welcome"})
            conn.send_bytes(pickle.dumps(_MakesAFile(marker)))
            ((code, _, err),) = finish(node1)
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait()
    assert code == 1 and "sent a malformed message (not a JSON frame" in err, err
    assert not marker.exists()
