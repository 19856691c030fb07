"""CPU products: weights stored column-major, and per weight shape and row count the fastest of
MKL, oneDNN with the weight packed once, and the native panel GEMV."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import common, cpu_native

log = logging.getLogger(__name__)

# MKL's sgemm (what F.linear runs on the CPU) packs the weight on every call, so a few rows cost
# several times what one row does and a verify of K+1 rows costs far more than a decode step.
# oneDNN with the weight packed once at load costs nearly the same for 2-9 rows, but has a fixed
# cost that loses at 1 row and on small weights. The native panel GEMV (`cpu_native`) reads its
# repacked weight once for up to 8 rows, as one stream per panel group. So per weight shape the
# runner measures each at a few row counts and `linear` takes the fastest for a call's row count
# (a count between two measured ones takes the larger one's choice). Before that, CPU weights
# are stored column by column (`column_major_copy`): the same [N, K] matrices, but F.linear's
# x @ W.T then reads W.T as a plain row-major [K, N], the layout MKL streams fastest when the
# weights come from memory rather than cache, as in a real forward (BENCHMARKS.md has the
# measurements).
CPU_ROWS = (1, 2, 4, 8, 16, 64)
CPU_PACK_MAX_BYTES = 2 << 30  # packed copies add to those weights' memory: only for small models
MKL, ONEDNN, NATIVE = "mkl", "onednn", "native"


@dataclass
class CpuPlan:
    """How `linear` multiplies by one weight: `by_rows[min(rows, CPU_ROWS[-1])]` names the kernel."""

    by_rows: tuple[str, ...]
    packed: torch.Tensor | None = None  # oneDNN's copy of the weight
    panels: torch.Tensor | None = None  # cpu_native.pack_panels of the weight


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


def _choices(times: dict[int, dict[str, float]]) -> tuple[str, ...]:
    """The kernel for every row count 0..CPU_ROWS[-1] from the times measured at (some of) CPU_ROWS:
    the fastest at the count of CPU_ROWS at or above it; MKL unless another is 5% faster, and MKL
    where that count was not measured (wider than any decode or verify step: prefill chunks)."""
    best = {}
    for rows, t in times.items():
        fastest = min(t, key=t.get)
        best[rows] = fastest if t[fastest] < 0.95 * t[MKL] else MKL
    return tuple(best.get(next(r for r in CPU_ROWS if r >= max(rows, 1)), MKL) for rows in range(CPU_ROWS[-1] + 1))


@torch.inference_mode()
def tune_linear_cpu(weights: list[torch.Tensor], max_rows: int = CPU_ROWS[-1]) -> dict:
    """Set `w.cpu_plan` on each of `weights` (CPU tensors): a CpuPlan, or None where MKL wins at
    every row count measured. Row counts are measured up to the first of CPU_ROWS that covers
    `max_rows`, the widest decode or verify step (wider ones cost the most to time, and only
    prefill runs them). Timed once per shape, at the current torch thread count, each
    kernel over all of the shape's weights in turn: a forward reads them from memory, not from
    cache, and that changes the winner at a few rows (a kernel that computes faster loses to one
    that streams faster). Returns {"NxK": {rows: {kernel: us}}, ...} for logging."""
    weights = [w for w in weights if w.dim() == 2 and not w.is_cuda and w.dtype in (torch.float32, torch.bfloat16)]
    for w in weights:
        w.cpu_plan = None
    if not common.FUSED or not weights:
        return {}
    if sum(w.numel() * w.element_size() for w in weights) > CPU_PACK_MAX_BYTES:
        log.info("CPU weights over %d GiB: packed copies skipped (they would copy them)", CPU_PACK_MAX_BYTES >> 30)
        return {}
    dnnl = torch.backends.mkldnn.is_available()
    ops = cpu_native.ops()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault((tuple(w.shape), w.dtype), []).append(w)
    counts = CPU_ROWS[: next(i for i, r in enumerate(CPU_ROWS) if r >= min(max_rows, CPU_ROWS[-1])) + 1]
    report = {}
    for (shape, dtype), group in groups.items():
        copies = {MKL: group}
        if dnnl:
            try:
                copies[ONEDNN] = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in group]
                torch.ops.mkldnn._linear_pointwise(
                    torch.zeros(1, shape[1], dtype=dtype), copies[ONEDNN][0], None, "none", [], ""
                )
            except RuntimeError as e:  # a oneDNN build that cannot take this shape or dtype
                log.warning("oneDNN product for %s skipped: %s", shape, e)
                copies.pop(ONEDNN, None)
        if ops is not None and dtype == torch.float32:
            copies[NATIVE] = [cpu_native.pack_panels(w) for w in group]
        times = {}
        for rows in counts:
            x = torch.randn(rows, shape[1], dtype=dtype)
            times[rows] = {
                k: _cpu_us(lambda: products(k, x, c, shape[0]), reps=max(1, 20 // len(group))) / len(group)
                for k, c in copies.items()
                if k != NATIVE or rows <= cpu_native.MAX_ROWS
            }
        report[f"{shape[0]}x{shape[1]}"] = {r: {k: round(v, 1) for k, v in t.items()} for r, t in times.items()}
        by_rows = _choices(times)
        if set(by_rows) != {MKL}:
            for i, w in enumerate(group):
                w.cpu_plan = CpuPlan(
                    by_rows,
                    copies[ONEDNN][i] if ONEDNN in by_rows else None,
                    copies[NATIVE][i] if NATIVE in by_rows else None,
                )
    return report


def products(kernel: str, x: torch.Tensor, weights: list[torch.Tensor], n: int) -> None:
    """x times each of `weights` (one shape, in `kernel`'s layout) in turn."""
    if kernel == NATIVE:
        panel_linear = cpu_native.ops().panel_linear
        for p in weights:
            panel_linear(x, p, n, None)
    elif kernel == ONEDNN:
        for p in weights:
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    else:
        for w in weights:
            F.linear(x, w)
