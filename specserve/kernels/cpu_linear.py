"""CPU products: weights stored column-major, and oneDNN with weights packed once where it wins."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from specserve.kernels import common

log = logging.getLogger(__name__)

# MKL's sgemm (what F.linear runs on the CPU) packs the weight on every call, so a few rows cost
# several times what one row does and a verify of K+1 rows costs far more than a decode step.
# oneDNN with the weight packed once at load costs nearly the same for 2-9 rows, but has a fixed
# cost that loses at 1 row and on small weights. So per weight shape the runner measures both at
# a few row counts and `linear` switches to the packed product from the smallest count where it
# wins from there on. Before that, CPU weights are stored column by column (`column_major_copy`):
# the same [N, K] matrices, but F.linear's x @ W.T then reads W.T as a plain row-major [K, N],
# the layout MKL streams fastest when the weights come from memory rather than cache, as in a
# real forward (BENCHMARKS.md has the measurements).
CPU_ROWS = (1, 2, 4, 8, 16, 64)
CPU_PACK_MAX_BYTES = 2 << 30  # packed copies double those weights' memory: only for small models


def column_major_copy(w: torch.Tensor) -> torch.Tensor:
    """w's values, stored column by column (w.t() is contiguous)."""
    return w.t().contiguous().t()


def _cpu_us(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(5):  # best of 5 rounds: a loaded machine only ever adds time
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e6


@torch.inference_mode()
def tune_linear_cpu(weights: list[torch.Tensor]) -> dict:
    """Set `w.cpu_packed` on each of `weights` (CPU tensors): (oneDNN-packed copy, rows from which
    `linear` uses it), or None where MKL wins at every row count measured (or oneDNN is missing).
    Timed once per shape, at the current torch thread count. Returns {"NxK": {rows: (MKL us,
    oneDNN us)}, ...} for logging."""
    weights = [w for w in weights if w.dim() == 2 and not w.is_cuda and w.dtype in (torch.float32, torch.bfloat16)]
    for w in weights:
        w.cpu_packed = None
    if not common.FUSED or not torch.backends.mkldnn.is_available() or not weights:
        return {}
    if sum(w.numel() * w.element_size() for w in weights) > CPU_PACK_MAX_BYTES:
        log.info("CPU weights over %d GiB: oneDNN packing skipped (it would copy them)", CPU_PACK_MAX_BYTES >> 30)
        return {}
    pack = torch.ops.mkldnn._reorder_linear_weight
    product = torch.ops.mkldnn._linear_pointwise
    report, start_at = {}, {}
    for w in weights:
        key = (tuple(w.shape), w.dtype)
        packed = None
        if key not in start_at:
            try:
                packed = pack(w, 8)
                times = {}
                for rows in CPU_ROWS:
                    x = torch.randn(rows, w.shape[1], dtype=w.dtype)
                    times[rows] = (_cpu_us(lambda: F.linear(x, w)), _cpu_us(lambda: product(x, packed, None, "none", [], "")))
            except RuntimeError as e:  # a oneDNN build that cannot take this shape or dtype
                log.warning("oneDNN product for %s skipped: %s", tuple(w.shape), e)
                start_at[key] = None
                continue
            wins = [rows for rows, (mkl, dnnl) in times.items() if dnnl < 0.95 * mkl]
            # the smallest row count from which oneDNN wins at every larger one measured
            first = next((r for r in CPU_ROWS if all(q in wins for q in CPU_ROWS if q >= r)), None)
            start_at[key] = first
            report[f"{w.shape[0]}x{w.shape[1]}"] = {r: (round(a, 1), round(b, 1)) for r, (a, b) in times.items()}
        first = start_at[key]
        if first is not None:
            # rows between two measured counts use the packed product from just past the last MKL win
            prev = max((r for r in CPU_ROWS if r < first), default=0)
            w.cpu_packed = (packed if packed is not None else pack(w, 8), prev + 1)  # (the timed copy is w's)
    return report
