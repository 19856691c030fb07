"""The bytes that cross a process or node boundary between specserve processes:
an HMAC handshake with the shared secret, then length-prefixed JSON frames.

Nothing received here can run code: a frame is parsed as JSON (never
unpickled) and rebuilt only into plain data (None, bool, int, float, str,
list, dict) plus a fixed set of tagged forms: tuples, dicts with non-string
keys, and the dataclasses in `CLASSES`, each field checked against the class's
annotations before its constructor runs. Anything else (bad JSON, an unknown
tag or class, a field of the wrong type, a frame over `MAX_FRAME`) raises
WireError; the receiver drops that connection.

A frame is {"v": VERSION, "m": MESSAGE}; every message is a dict. Callers
check each message's fields against their protocol (`check`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib
import json
import os
import types
import typing
from multiprocessing.connection import Connection

VERSION = 1
MAX_FRAME = 256 << 20  # a generate reply of a large batch with logprobs stays far below
_NONCE = 32
_HANDSHAKE_FRAME = 256
_TAG = "$"

# The dataclasses a message may carry, by the name on the wire.
CLASSES = {
    "SamplingParams": "specserve.engine.sampling:SamplingParams",
    "RequestOutput": "specserve.engine.llm:RequestOutput",
    "TokenLogprob": "specserve.engine.logprobs:TokenLogprob",
    "GrammarSpec": "specserve.constrain.grammar:GrammarSpec",
}


class WireError(ValueError):
    """A frame or message that breaks the format or its protocol: never acted on."""


# ------------------------------------------------------------------ authentication
def _mac(key: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(key, role + b"".join(nonces), hashlib.sha256).digest()


def handshake(conn: Connection, key: bytes, server: bool) -> None:
    """Mutual HMAC-SHA256 challenge-response: each side proves it holds `key` over the other's
    fresh nonce, without sending the key. Raises WireError on a wrong answer."""
    if server:
        ours = os.urandom(_NONCE)
        conn.send_bytes(ours)
        answer = conn.recv_bytes(_HANDSHAKE_FRAME)
        theirs, mac = answer[:_NONCE], answer[_NONCE:]
        if len(theirs) != _NONCE or not hmac.compare_digest(mac, _mac(key, b"client", ours, theirs)):
            raise WireError("the peer does not hold the shared secret")
        conn.send_bytes(_mac(key, b"server", theirs, ours))
    else:
        theirs = conn.recv_bytes(_HANDSHAKE_FRAME)
        if len(theirs) != _NONCE:
            raise WireError("node 0 sent a malformed challenge")
        ours = os.urandom(_NONCE)
        conn.send_bytes(ours + _mac(key, b"client", theirs, ours))
        if not hmac.compare_digest(conn.recv_bytes(_HANDSHAKE_FRAME), _mac(key, b"server", ours, theirs)):
            raise WireError("node 0 does not hold the shared secret")


# ------------------------------------------------------------------ encoding
def encode(msg: dict) -> bytes:
    if not isinstance(msg, dict):
        raise WireError(f"a message is a dict, not {type(msg).__name__}")
    return json.dumps({"v": VERSION, "m": _to_json(msg)}, separators=(",", ":")).encode()


def _to_json(x):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if isinstance(x, tuple):
        return {_TAG: "tuple", "items": [_to_json(v) for v in x]}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and _TAG not in x:
            return {k: _to_json(v) for k, v in x.items()}
        return {_TAG: "map", "items": [[_to_json(k), _to_json(v)] for k, v in x.items()]}
    name = type(x).__name__
    if dataclasses.is_dataclass(x) and CLASSES.get(name) == f"{type(x).__module__}:{type(x).__qualname__}":
        return {_TAG: name, "fields": {f.name: _to_json(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}}
    raise WireError(
        f"a {type(x).__module__}.{name} cannot be sent between processes: send plain data "
        "(or add a plain dataclass to specserve.distributed.wire.CLASSES)"
    )


def decode(data: bytes) -> dict:
    """The message in a frame, or WireError. Never executes anything from the frame."""
    try:
        frame = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"not a JSON frame ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(frame, dict) or set(frame) != {"v", "m"}:
        raise WireError('a frame is {"v": version, "m": message}')
    if frame["v"] != VERSION:
        raise WireError(f"wire version {frame['v']!r}, this side speaks {VERSION}: run the same specserve everywhere")
    try:
        msg = _from_json(frame["m"])
    except RecursionError:
        raise WireError("a message nested too deeply") from None
    if not isinstance(msg, dict):
        raise WireError(f"a message is an object, got {type(msg).__name__}")
    return msg


def _from_json(x):
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    if not isinstance(x, dict):
        return x
    tag = x.get(_TAG)
    if tag is None:
        return {k: _from_json(v) for k, v in x.items()}
    if tag == "tuple" and set(x) == {_TAG, "items"} and isinstance(x["items"], list):
        return tuple(_from_json(v) for v in x["items"])
    if tag == "map" and set(x) == {_TAG, "items"} and isinstance(x["items"], list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in x["items"]):
            raise WireError("a map's items are [key, value] pairs")
        try:
            return {_from_json(k): _from_json(v) for k, v in x["items"]}
        except TypeError:
            raise WireError("a map key that cannot be a key") from None
    if tag in CLASSES and set(x) == {_TAG, "fields"} and isinstance(x["fields"], dict):
        return _build(tag, {k: _from_json(v) for k, v in x["fields"].items()})
    raise WireError(f"an unknown tagged value {str(tag)[:40]!r}")


def _build(name: str, fields: dict):
    module, _, attr = CLASSES[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) - known:
        raise WireError(f"{name} has no field(s) {sorted(set(fields) - known)[:5]}")
    for k, v in fields.items():
        if not _conforms(v, hints[k]):
            raise WireError(f"{name}.{k}: {type(v).__name__} does not match {hints[k]}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise WireError(f"{name}: {e}") from None


def _conforms(v, hint) -> bool:
    """Whether decoded value `v` fits the annotation `hint` (the shapes dataclass fields use)."""
    if hint is typing.Any:
        return True
    if hint is type(None) or hint is None:
        return v is None
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint in (bool, str):
        return isinstance(v, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return v in args
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(v, a) for a in args)
    if origin is list or hint is list:
        return isinstance(v, list) and all(_conforms(i, args[0]) for i in v) if args else isinstance(v, list)
    if origin is dict or hint is dict:
        return isinstance(v, dict) and (
            not args or all(_conforms(k, args[0]) and _conforms(i, args[1]) for k, i in v.items())
        )
    if origin is tuple:
        if not isinstance(v, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(i, args[0]) for i in v)
        return len(v) == len(args) and all(_conforms(i, a) for i, a in zip(v, args))
    if dataclasses.is_dataclass(hint):
        return isinstance(v, hint)
    return False


# ------------------------------------------------------------------ schemas
def check(msg: dict, schemas: dict[str, dict], where: str) -> dict:
    """`msg` if its "type" is one of `schemas` and it has exactly that schema's fields, each of
    its type: a type, a tuple of types, a nested schema (dict), or STR_MAP; else WireError."""
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in schemas:
        raise WireError(f"{where}: unexpected message type {str(kind)[:40]!r} (expected one of {sorted(schemas)})")
    _check_fields(msg, {"type": str, **schemas[kind]}, f"{where} {kind!r}")
    return msg


STR_MAP = "str->str"  # a schema type: a dict of strings to strings (environment variables)


def _check_fields(obj: dict, schema: dict, where: str) -> None:
    if set(obj) != set(schema):
        raise WireError(f"{where}: fields {sorted(obj)[:10]}, expected {sorted(schema)}")
    for k, want in schema.items():
        v = obj[k]
        if isinstance(want, dict):
            if not isinstance(v, dict):
                raise WireError(f"{where}.{k}: expected an object")
            _check_fields(v, want, f"{where}.{k}")
        elif want == STR_MAP:
            if not (isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())):
                raise WireError(f"{where}.{k}: expected an object of strings")
        else:
            wants = want if isinstance(want, tuple) else (want,)
            if isinstance(v, bool) and bool not in wants or not isinstance(v, wants):
                raise WireError(f"{where}.{k}: {type(v).__name__}, expected {'/'.join(w.__name__ for w in wants)}")


# ------------------------------------------------------------------ the connection
class Conn(Connection):
    """A multiprocessing Connection (same framing, `poll`, works with `wait`) whose objects
    travel as JSON frames (`encode` / `decode`) instead of pickles."""

    def send(self, obj: dict) -> None:
        self.send_bytes(encode(obj))

    def recv(self) -> dict:
        return decode(self.recv_bytes(MAX_FRAME))
