"""The secret the nodes of a multi-node run share, and `specserve dist-key`, which makes one.

    specserve dist-key --out /etc/specserve/dist.key     # once; copy the file to every node (mode 0600)
    specserve serve ... --nnodes 2 --dist-key-file /etc/specserve/dist.key

Where a node finds it, first hit wins: --dist-key-file FILE (refused when group or
others may read it), SPECSERVE_DIST_KEY, and only when --dist-init-addr is a
loopback address (every node on this machine, run by this user) a per-run random
secret node 0 writes to a 0600 file in this user's runtime directory. Node 0
refuses to listen on any other address without a secret.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import os
import secrets
import stat
import sys
from pathlib import Path

from specserve import envs
from specserve.config import ConfigError

MIN_CHARS = 16  # shorter secrets fall to an offline guess from one recorded handshake
HOW = (
    "make one with `specserve dist-key --out FILE`, copy FILE to every node (mode 0600) and pass "
    f"--dist-key-file FILE on each, or set {envs.DIST_KEY.name} to the same secret on every node"
)


def is_loopback(host: str) -> bool:
    """A literal loopback address or `localhost`: a name is not trusted to stay on this machine
    (a hostname that /etc/hosts maps to 127.0.1.1 is still how the other nodes reach it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_key_file(path: str) -> bytes:
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ConfigError(f"--dist-key-file {path}: {e.strerror}; {HOW}") from None
    if st.st_mode & 0o077:
        raise ConfigError(
            f"--dist-key-file {path} may be read by group or others (mode "
            f"{stat.filemode(st.st_mode)}): run `chmod 600 {path}`"
        )
    return _checked(p.read_text().strip(), f"--dist-key-file {path}")


def _checked(text: str, where: str) -> bytes:
    if len(text) < MIN_CHARS:
        raise ConfigError(f"{where}: the secret has {len(text)} characters, at least {MIN_CHARS} are needed; {HOW}")
    return text.encode()


def _run_dir() -> Path:
    """This user's private directory for per-run secrets (created 0700; refused if others can enter)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "specserve" if base and os.path.isdir(base) else Path.home() / ".cache" / "specserve" / "run"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{d} (where loopback runs keep their per-run secret) must belong to you with mode 0700")
    return d


def run_key_path(port: int) -> Path:
    return _run_dir() / f"dist-{port}.key"


def secret(key_file: str | None, host: str, port: int, node_rank: int) -> bytes:
    """The shared secret of this run (see the module doc); ConfigError when there is none."""
    if key_file:
        return read_key_file(key_file)
    if envs.DIST_KEY.get():
        return _checked(envs.DIST_KEY.get(), envs.DIST_KEY.name)
    if not is_loopback(host):
        where = "node 0 will not listen on" if node_rank == 0 else "this node cannot authenticate to"
        raise ConfigError(
            f"--dist-init-addr {host}:{port} is not a loopback address and no secret is set, so "
            f"{where} it (anyone who reaches node 0 could otherwise drive every node): {HOW}"
        )
    path = run_key_path(port)
    if node_rank == 0:
        key = secrets.token_hex(32)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        os.replace(tmp, path)
        atexit.register(_remove, path, key)
        return key.encode()
    try:  # read once node 0 listens: it writes the file before it opens its port
        return _checked(path.read_text().strip(), str(path))
    except FileNotFoundError:
        raise ConfigError(
            f"no per-run secret at {path}: is node 0 running on this machine as this user? "
            f"Across users or machines: {HOW}"
        ) from None


def _remove(path: Path, key: str) -> None:
    try:
        if path.read_text() == key:  # a later run on the same port may have replaced it
            path.unlink()
    except OSError:
        pass


# ------------------------------------------------------------------ specserve dist-key
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the secret to FILE (created with mode 0600, never "
        "overwritten); without it the secret is printed once",
    )


def run(args: argparse.Namespace) -> int:
    key = secrets.token_hex(32)
    if not args.out:
        print(key)
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{args.out} exists: remove it first or pick another --out (a secret is never "
            "overwritten: the other nodes may hold it)"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    print(
        f"wrote a new secret to {args.out} (mode 0600); copy it to every node, keeping its mode, and start "
        f"each with --dist-key-file {args.out}",
        file=sys.stderr,
    )
    return 0
