"""The product every layer calls: F.linear, or what the start-up tuning found faster.

On the GPU that is, for 1-64 rows where the measurement found it faster for the weight's shape,
the Triton GEMV (`gemv.tune_linear`); on the CPU (weights stored column-major,
`cpu_linear.column_major_copy`), from the row count where it wins, oneDNN with the weight packed
once (`cpu_linear.tune_linear_cpu`). With ``SPECSERVE_FUSED_KERNELS=0`` nothing is tuned, so
F.linear runs everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.common import use_triton
from specserve.kernels.gemv import gemv_triton


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the kernel `tune_linear` (GPU: a GEMV) or `tune_linear_cpu` (oneDNN, packed
    weight) found faster for this weight and row count."""
    if not x.is_cuda:  # (this runs for every product on the CPU: a few attribute reads at most)
        packed = getattr(w, "cpu_packed", None)
        if packed is not None and x.numel() >= packed[1] * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, packed[0], b, "none", [], "")
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1]
    tuning = getattr(w, "linear_tuning", None)
    cfg = tuning.gemv_config(w, x.dtype, rows) if tuning is not None else None
    if cfg is None or not use_triton(x, w, b):
        return F.linear(x, w, b)
    y = gemv_triton(x.reshape(rows, -1).contiguous(), w, cfg).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y
