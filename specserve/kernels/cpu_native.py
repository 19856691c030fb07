"""Native (C++, AVX2/FMA) CPU kernels: a GEMV over weights packed into panels, and fused small ops.

Built from ``csrc/cpu_kernels.cpp`` with torch's extension builder the first time a process asks
for them (once per machine: the result lives in torch's extension cache, later processes only
load it). Without a compiler, on a CPU without AVX2/FMA, or off x86, `ops()` returns None after
one log line and every caller keeps the torch path.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import torch

from specserve.kernels import common

log = logging.getLogger(__name__)

PANEL = 16  # output features per panel (two ymm registers)
MAX_ROWS = 8  # rows the tuner offers the panel product for (it reads the weight once for all of them)
_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_state: dict = {}


_NAME = "specserve_cpu_kernels"


def _build():
    import os

    from torch.utils.cpp_extension import _get_build_directory, load

    try:  # the ninja wheel's binary, also when its environment's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    log.info("loading the native CPU kernels (built once per machine: about a minute the first time)")
    with builder_lock(Path(_get_build_directory(_NAME, verbose=False))):
        return load(
            name=_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off"],
            verbose=False,
        )


class builder_lock:
    """Context: this process is the one building or loading the kernels in `build_dir`. torch's builder
    guards its directory with a `lock` file that only the process that made it removes, so a build killed
    part-way (Ctrl-C, a timeout) leaves it behind, and every later process would wait for it forever
    without a word. Here builders first take an OS lock (released by the kernel when its holder dies),
    so a `lock` file found while holding it is a dead build's: it is removed, and said so."""

    def __init__(self, build_dir: Path):
        self.build_dir = build_dir
        self.fd = None

    def __enter__(self):
        import os

        try:
            import fcntl
        except ImportError:  # (not a POSIX system: torch's own lock alone)
            return self
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.build_dir / "specserve.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building the native CPU kernels in %s", self.build_dir)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        baton = self.build_dir / "lock"
        if baton.exists():
            log.warning("removed %s, left by a build of the native CPU kernels that did not finish", baton)
            baton.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        import os

        if self.fd is not None:
            os.close(self.fd)  # (closing releases the lock)


def _supported() -> str | None:
    """Why the kernels cannot run here, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} CPU (they are x86 AVX2 code)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "a CPU without AVX2/FMA"
    return None


def ops():
    """The compiled module (panel_linear, add_rms_norm, silu_mul, rope_), or None where it cannot
    be built or run here (logged once)."""
    if "ops" not in _state:
        why = _supported()
        module = None
        if why is None:
            try:
                module = _build()
            except Exception as e:  # no compiler, no ninja, a failed build: the torch path serves
                why = (
                    f"the build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e})"
                )
        if why is not None:
            log.warning("native CPU kernels unavailable: %s; using torch's CPU ops", why)
        _state["ops"] = module
    return _state["ops"]


def fused_ops():
    """`ops()` where the fused kernels are on (``SPECSERVE_FUSED_KERNELS``) and nothing records
    gradients (the kernels have no backward: a CPU training step keeps torch's ops), else None."""
    if not common.FUSED or torch.is_grad_enabled():
        return None
    return ops()


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (any strides) as contiguous float32 panels [ceil(N/16), K, 16]: panel p holds
    output features 16p..16p+15 for every k in turn, zero past N."""
    N, K = w.shape
    P = -(-N // PANEL)
    padded = torch.zeros(P * PANEL, K, dtype=torch.float32)
    padded[:N] = w
    return padded.view(P, PANEL, K).transpose(1, 2).contiguous()
