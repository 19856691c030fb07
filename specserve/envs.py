"""Every environment variable specserve reads, with its type, default and meaning.

Code reads a switch only through its entry here (``envs.PDL.get()``), so this module is the
complete list: ``specserve --help`` and docs/cli.md describe the same set, and a
test checks that no ``SPECSERVE_*`` name appears in the package without an entry.

Two kinds: *user* switches, which an operator may set, and *internal* ones, which the TP driver
sets for the worker processes it starts (rank, size, socket, parent pid) or the supervisor
stamps on every process it launches; setting those by hand is never needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type  # bool, int or str
    default: bool | int | str | None
    doc: str
    internal: bool = False  # set by specserve for its own child processes, not by users
    choices: tuple[str, ...] = ()  # the accepted values of a str switch (empty: any)

    def raw(self) -> str | None:
        return os.environ.get(self.name)

    def get(self):
        """The value, or the default where the variable is unset or empty. A value that is not of
        the variable's type raises a ValueError naming the variable."""
        raw = self.raw()
        if raw is None or raw == "":
            return self.default
        if self.type is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off)")
        if self.type is int:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{self.name}={raw!r}: expected an integer") from None
        if self.choices and raw not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: choose one of {', '.join(self.choices)}")
        return raw

    def require(self):
        """The value of a variable that must be set (internal plumbing a worker cannot start without)."""
        if self.raw() in (None, ""):
            raise RuntimeError(f"{self.name} is not set: this process is started by specserve, not by hand")
        return self.get()


REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, type_: type, default, doc: str, internal: bool = False, choices: tuple[str, ...] = ()) -> EnvVar:
    var = EnvVar(name, type_, default, doc, internal, choices)
    REGISTRY[name] = var
    return var


# ----------------------------------------------------------------------------- user switches

FUSED_KERNELS = _var(
    "SPECSERVE_FUSED_KERNELS",
    bool,
    True,
    "0: PyTorch reference ops instead of the fused Triton kernels, no linear tuning (A/B runs)",
)
INT4_MOE_CUDA = _var(
    "SPECSERVE_INT4_MOE_CUDA",
    bool,
    True,
    "0: int4 routed experts of decode-sized batches on the Triton kernels, not the CUDA ones (A/B runs)",
)
PDL = _var(
    "SPECSERVE_PDL", bool, True, "0: launch the Triton kernels without programmatic dependent launch (Hopper and later)"
)
ALLREDUCE = _var(
    "SPECSERVE_ALLREDUCE",
    str,
    "auto",
    "tensor-parallel all-reduce: auto, torch, nccl or symm_mem (an NCCL profile may set it)",
)
NCCL_LIB = _var(
    "SPECSERVE_NCCL_LIB",
    str,
    None,
    "the libnccl shared library specserve's own NCCL communicator loads (default: libnccl.so.2)",
)
TP_DRAFT_EMBED = _var(
    "SPECSERVE_TP_DRAFT_EMBED",
    str,
    "replicated",
    "under TP, a drafter that reads the target's embedding gets a full copy per rank "
    "(replicated) or uses the vocab-parallel one (shared: less memory, one more all-reduce)",
    choices=("replicated", "shared"),
)
CAPTURE_MODE = _var(
    "SPECSERVE_CAPTURE_MODE",
    str,
    "thread_local",
    "CUDA graph capture error mode in TP workers: thread_local, global or relaxed",
    choices=("thread_local", "global", "relaxed"),
)
DIST_KEY = _var(
    "SPECSERVE_DIST_KEY",
    str,
    None,
    "shared secret authenticating the connections between nodes (--nnodes > 1); the same on every node",
)
API_KEY = _var(
    "SPECSERVE_API_KEY", str, None, "default of `serve --api-key`: the bearer token every /v1 route requires"
)

# ----------------------------------------------------------------------------- internal plumbing

TP_RANK = _var("SPECSERVE_TP_RANK", int, None, "a TP worker's rank", internal=True)
TP_SIZE = _var("SPECSERVE_TP_SIZE", int, None, "the number of TP workers", internal=True)
TP_FD = _var("SPECSERVE_TP_FD", int, None, "file descriptor of a TP worker's socket to its driver", internal=True)
TP_PARENT_PID = _var(
    "SPECSERVE_TP_PARENT_PID", int, None, "pid of the TP driver: a worker exits when it goes away", internal=True
)
LAUNCH_ID = _var(
    "SPECSERVE_LAUNCH_ID",
    str,
    None,
    "marker the supervisor gives a launch: finds every descendant process to kill",
    internal=True,
)


def reference_table() -> str:
    """The registry as a Markdown table (docs/cli.md's environment reference is this output)."""
    rows = ["| variable | type | default | kind | meaning |", "|---|---|---|---|---|"]
    for v in REGISTRY.values():
        default = "" if v.default is None else str(int(v.default) if v.type is bool else v.default)
        rows.append(
            f"| `{v.name}` | {v.type.__name__} | {default} | {'internal' if v.internal else 'user'} | {v.doc} |"
        )
    return "\n".join(rows)
