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


def _build():
    import os

    from torch.utils.cpp_extension import load

    try:  # the ninja wheel's binary, also when its environment's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    log.info("loading the native CPU kernels (built once per machine: about a minute the first time)")
    return load(name="specserve_cpu_kernels", sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off"], verbose=False)


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
                why = f"the build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e})"
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
