"""What every kernel module shares: whether to use Triton at all, and programmatic dependent launch.

On Hopper and later every kernel is launched with programmatic dependent launch
(``_wait_for_previous``): it is scheduled while the kernel before it drains and waits for it
before reading activations or writing anything, so results are unchanged and the launch gaps
between the kernels of a decode step disappear. ``SPECSERVE_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch

from specserve import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.4: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

# Process-wide switches, read once at import (benchmarks flip them for A/B runs of one process).
FUSED = envs.FUSED_KERNELS.get()
# Programmatic dependent launch (Hopper+): each kernel may start while the one before it
# drains, prefetching what does not depend on it (a GEMV's first weight tile), then waits for
# it (`griddepcontrol.wait`) before touching activations.
PDL = envs.PDL.get()


def use_triton(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The Triton kernels serve CUDA inference only: they have no backward, so where autograd
    records (training a drafter on a GPU) the PyTorch reference runs instead of silently
    cutting the gradient."""
    if not (FUSED and triton is not None and x.is_cuda):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *others)))


def interpreted() -> bool:
    """Do the Triton kernels run in Triton's CPU interpreter (its own TRITON_INTERPRET switch)?"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_pdl(x: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch? (Triton's interpreter has no griddepcontrol.)"""
    return PDL and gdc_wait is not None and x.is_cuda and _capability(x.device) >= 9 and not interpreted()


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (1 elsewhere: Triton's interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def pdl_args(x: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking a ``PDL`` constexpr, with PDL where `use_pdl` allows it."""
    pdl = use_pdl(x)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Under programmatic dependent launch: wait until the kernel before this one has
        finished (its writes visible), then let the next kernel start launching. Nothing may be
        stored, and no activation read, before this."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
