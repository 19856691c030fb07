"""The product every layer calls: F.linear, or what the start-up tuning found faster.

On the GPU that is, for 1-64 rows where the measurement found it faster for the weight's shape,
the Triton GEMV (`gemv.tune_linear`); on the CPU (weights stored column-major,
`cpu_linear.column_major_copy`), per row count, MKL, oneDNN with the weight packed once or the
native panel GEMV (`cpu_linear.tune_linear_cpu`). With ``SPECSERVE_FUSED_KERNELS=0`` nothing is
tuned, so F.linear runs everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.common import use_triton
from specserve.kernels.cpu_linear import CPU_ROWS, NATIVE, ONEDNN
from specserve.kernels.cpu_native import ops as native_ops
from specserve.kernels.gemv import gemv

_MAX_TUNED = CPU_ROWS[-1]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the kernel `tune_linear` (GPU: a GEMV) or `tune_linear_cpu` (CPU: oneDNN or
    the native panel GEMV) found faster for this weight and row count."""
    if not x.is_cuda:  # (this runs for every product on the CPU: a few attribute reads at most)
        plan = getattr(w, "cpu_plan", None)
        if plan is None:
            return F.linear(x, w, b)
        K = x.shape[-1]
        rows = x.numel() // K
        how = plan.by_rows[min(rows, _MAX_TUNED)]
        if how == NATIVE:
            x2 = x.reshape(rows, K)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return native_ops().panel_linear(x2, plan.panels, w.shape[0], b).view(*x.shape[:-1], w.shape[0])
        if how == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, plan.packed, b, "none", [], "")
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1]
    tuning = getattr(w, "linear_tuning", None)
    cfg = tuning.gemv_config(w, x.dtype, rows) if tuning is not None else None
    if cfg is None or not use_triton(x, w, b):
        return F.linear(x, w, b)
    y = gemv(x.reshape(rows, -1).contiguous(), w, cfg).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y
