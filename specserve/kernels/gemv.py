"""The skinny-matmul (GEMV) kernel and the start-up measurement that chooses it over cuBLAS."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.kernels import common
from specserve.kernels.common import pdl_args, triton

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

log = logging.getLogger(__name__)

# Decode multiplies 1-8 token rows by each weight, a verify up to 64, so a step is bound by how
# fast the weights stream from HBM. cuBLAS falls well short of the copy bandwidth there on some shapes; a
# plain GEMV (each program owns a few output features over all of K) beats it on some shapes and
# loses on others (benchmarks/gemv_sweep.py). So the choice is measured per weight shape and row
# count when the runner starts (`tune_linear`), inside CUDA graphs over distinct weights of the
# shape (as a decode step reads them, cold in L2), and `linear` follows it.

GEMV_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts tuned (r rows use the tuning of the next one up)
# Candidates (BLOCK_N, BLOCK_K, warps, stages) for one row, 2-8 rows and 9-64 rows (verify forwards:
# a tree of 31 nodes is 32 rows): the best of the sweep (benchmarks/gemv_sweep.py, H200) per weight
# shape, plus wider K blocks for long rows (down_proj).
# (A vector-FMA variant for 2-8 rows, each weight tile times every row, does not beat cuBLAS there
# by the margin the tuner asks for, so it is not a candidate.)
# --batch-invariant: one fixed launch shape (16-row tiles) for every row count, chosen by no
# timing, so two engines (plain and speculative) round every row alike.
ROW_INVARIANT_GEMV = (32, 256, 4, 4, 16)
GEMV_CONFIGS = {
    1: ((8, 512, 4, 4), (8, 512, 8, 4), (8, 256, 4, 4), (8, 1024, 8, 4)),
    2: ((32, 256, 4, 4), (64, 256, 4, 4), (32, 128, 4, 3)),
    16: ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4)),
}
# One row also tries the CUDA GEMV (kernels/csrc/gemv.cu: Hopper or later, bf16, K a multiple of 256):
# ("cuda", warps a block, weight rows a warp, warps sharing a row's features, 16-byte loads a lane per
# row and batch of steps).
# The best of the sweep at Kimi-K2.5's shapes (benchmarks/gemv_sweep.py --shapes kimi; figures in
# BENCHMARKS.md); the tuner takes one only where it measures faster than Triton and cuBLAS.
GEMV_CUDA_CONFIGS = (
    ("cuda", 8, 1, 2, 2),
    ("cuda", 4, 2, 1, 2),
    ("cuda", 8, 2, 2, 2),
    ("cuda", 4, 1, 4, 2),
    ("cuda", 8, 1, 1, 2),
)


@dataclass
class LinearTuning:
    """What `tune_linear` chose per weight shape and row bucket. Every weight it measured holds
    it (``w.linear_tuning``), so `linear` finds the choice from the weight alone and two models
    in one process keep their own."""

    gemv: dict[tuple, tuple | None] = field(default_factory=dict)  # (N, K, dtype, rows bucket) -> config; None: cuBLAS

    def gemv_config(self, w: torch.Tensor, dtype: torch.dtype, rows: int) -> tuple | None:
        """The GEMV config for `rows` rows of `dtype` times `w`, or None for cuBLAS."""
        bucket = rows_bucket(rows)
        return self.gemv.get((w.shape[0], w.shape[1], dtype, bucket)) if bucket else None


if triton is not None:

    @triton.jit
    def _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K: tl.constexpr, ONE_ROW: tl.constexpr):
        if ONE_ROW:  # vector FMAs and a row reduction
            x = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            return acc + tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        else:  # rows padded to BLOCK_M (at least 16) for the tensor cores
            x = tl.load(
                x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0
            )
            return acc + tl.dot(x, tl.trans(w))

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        M,
        N,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_ROW: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        # The weights do not depend on the kernel before: the first tile is read while it drains.
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        wait_for_previous(PDL)
        if ONE_ROW:
            acc = tl.zeros([BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc = _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K, ONE_ROW)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K, ONE_ROW)
        if ONE_ROW:
            tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(
                y_ptr + offs_m[:, None] * N + offs_n[None, :],
                acc.to(y_ptr.dtype.element_ty),
                mask=(offs_m[:, None] < M) & nmask[None, :],
            )


def gemv_triton(x2: torch.Tensor, w: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """x2 [M <= 64, K] (contiguous) @ w [N, K]^T with float32 accumulation. `cfg`: (BLOCK_N,
    BLOCK_K, warps, stages[, BLOCK_M]); with BLOCK_M the rows run in tiles of that many on the
    tensor cores (one row included), so a row's result does not depend on the rows beside it."""
    M, K = x2.shape
    N = w.shape[0]
    block_n, block_k, warps, stages, *fixed_m = cfg
    block_m = fixed_m[0] if fixed_m else max(16, triton.next_power_of_2(M))
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    _gemv_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x2,
        w,
        y,
        M,
        N,
        K,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_ROW=M == 1 and not fixed_m,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x2),
    )
    return y


@functools.cache
def _gemv_cuda_kernel(warps: int, rows_a_warp: int, split: int, unroll: int):
    if warps % split:
        raise ValueError(f"CUDA GEMV: {split} warps a row do not divide {warps} warps a block")
    src = (Path(__file__).parent / "csrc" / "gemv.cu").read_text()
    return torch.cuda._compile_kernel(
        src,
        "gemv_bf16",
        nvcc_options=[f"-DWARPS={warps}", f"-DRPW={rows_a_warp}", f"-DSPLIT={split}", f"-DUNROLL={unroll}"],
    )


def gemv_cuda_fits(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the CUDA GEMV serves x2 [rows, K] @ w [N, K]^T (it may still fail to compile: the tuner
    then keeps to the other kernels)."""
    return (
        x2.shape[0] == 1
        and x2.dtype == w.dtype == torch.bfloat16
        and x2.shape[1] % 256 == 0
        and x2.is_cuda
        and hasattr(torch.cuda, "_compile_kernel")
        and torch.cuda.get_device_capability(x2.device) >= (9, 0)
    )


def gemv_cuda(x2: torch.Tensor, w: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """x2 [1, K] (contiguous) @ w [N, K]^T (contiguous) by kernels/csrc/gemv.cu, within `gemv_cuda_fits`."""
    _, warps, rows_a_warp, split, unroll = cfg
    N, K = w.shape
    y = torch.empty(1, N, dtype=x2.dtype, device=x2.device)
    rows_a_block = warps // split * rows_a_warp
    _gemv_cuda_kernel(warps, rows_a_warp, split, unroll)(
        grid=(-(-N // rows_a_block), 1, 1), block=(32 * warps, 1, 1), args=[x2, w, y, N, K]
    )
    return y


def gemv(x2: torch.Tensor, w: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """x2 @ w^T by a GEMV config of the tuner's: a CUDA one (cfg[0] == "cuda") or a Triton one."""
    return gemv_cuda(x2, w, cfg) if cfg[0] == "cuda" else gemv_triton(x2, w, cfg)


def gemv_config_group(rows: int) -> int:
    """The GEMV_CONFIGS key for a product of `rows` rows."""
    return 1 if rows == 1 else 2 if rows <= 8 else 16


def rows_bucket(rows: int) -> int | None:
    """The tuned row count whose choice `rows` rows take (the next one up; None past the last)."""
    return next((b for b in GEMV_ROWS if rows <= b), None)


def graph_us(fns, reps: int = 10) -> float:
    """Microseconds per call of a CUDA graph that runs each of `fns` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps / len(fns)


def _streamed(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Up to 8 weights of one shape, plus copies of the first until together they span four L2
    caches: a step streams every weight from HBM, while a timing that finds its weights in the L2
    favours other kernels, and would choose differently for models that differ only in how many
    layers share the shape."""
    ws = ws[:8]
    need = streamed_count(ws[0].numel() * ws[0].element_size(), ws[0].device)
    return ws + [ws[0].clone() for _ in range(need - len(ws))]


def streamed_count(nbytes: int, device: torch.device) -> int:
    """How many weights of `nbytes` each together span four L2 caches of `device` (at most 64)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return min(-(-4 * l2 // nbytes), 64)


@torch.inference_mode()
def tune_linear(weights: list[torch.Tensor], max_rows: int = 8, invariant: bool = False) -> dict:
    """Choose cuBLAS or a GEMV config for each weight shape and row bucket up to `max_rows`.
    `weights`: every weight the model multiplies by (grouped by shape here; up to 8 of a shape,
    with copies where they fit in the L2 (`_streamed`), are timed in turn so the measurement
    streams from HBM as a real step does). Each of them
    gets the resulting `LinearTuning` as ``w.linear_tuning``. With `invariant`, every row count
    takes ROW_INVARIANT_GEMV instead, so a token's logits round the same whether a decode step
    (one row) or a verify computes them: speculative greedy output then equals plain output in
    half precision too. Returns {"NxK": {rows: (cuBLAS us, best Triton us, chosen)}} for logging."""
    if not common.FUSED or triton is None or not weights or not weights[0].is_cuda:
        return {}
    tuning = LinearTuning()
    cuda_ok = True
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        w.linear_tuning = tuning
        if w.dim() == 2 and w.is_contiguous() and w.dtype in (torch.bfloat16, torch.float16):
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    report = {}
    for i, ((N, K, dtype), ws) in enumerate(by_shape.items()):
        # (one line per shape: on a cold Triton cache this phase compiles for a minute or so)
        log.info("tuning linear kernels: shape %d of %d (%dx%d)", i + 1, len(by_shape), N, K)
        if invariant:
            x = torch.randn(GEMV_ROWS[-1], K, device=ws[0].device, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            err = (
                (gemv_triton(x, ws[0], ROW_INVARIANT_GEMV).float() - ref).norm() / ref.norm().clamp_min(1e-12)
            ).item()
            if err > 1e-2:  # (no GEMV: cuBLAS, whose kernels differ by row count)
                raise RuntimeError(
                    f"--batch-invariant: the row-invariant GEMV is off by {err:.2g} for a "
                    f"{N}x{K} weight; run without --batch-invariant"
                )
            tuning.gemv.update({(N, K, dtype, rows): ROW_INVARIANT_GEMV for rows in GEMV_ROWS})
            report[f"{N}x{K}"] = {"any": (None, None, ROW_INVARIANT_GEMV)}
            continue
        ws = _streamed(ws)
        for rows in (r for r in GEMV_ROWS if r <= max_rows):
            x = torch.randn(rows, K, device=ws[0].device, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            t_cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            best, t_best = None, t_cublas
            cuda = GEMV_CUDA_CONFIGS if cuda_ok and gemv_cuda_fits(x, ws[0]) else ()
            for cfg in GEMV_CONFIGS[gemv_config_group(rows)] + cuda:
                try:
                    err = ((gemv(x, ws[0], cfg).float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                    t = graph_us([lambda w=w, c=cfg: gemv(x, w, c) for w in ws]) if err <= 1e-2 else None
                except Exception as e:  # a config this GPU or Triton cannot run: skip it, keep cuBLAS
                    if cfg[0] == "cuda":  # (not built here, e.g. no NVRTC library: said once, not tried again)
                        log.warning("the CUDA GEMV could not run (%s); products take Triton's GEMV or cuBLAS", e)
                        cuda_ok = False
                        break
                    # (64-row tiles of the widest candidates need more shared memory than a GPU has:
                    # expected, so not worth a warning at every start-up)
                    level = logging.DEBUG if "out of resource" in str(e) else logging.WARNING
                    log.log(level, "GEMV config %s for %dx%d at %d rows skipped: %s", cfg, N, K, rows, e)
                    continue
                if t is not None and t < t_best and t < 0.97 * t_cublas:  # the fastest clear win over cuBLAS
                    best, t_best = cfg, t
            tuning.gemv[(N, K, dtype, rows)] = best
            report.setdefault(f"{N}x{K}", {})[rows] = (round(t_cublas, 1), round(t_best, 1), best)
    # Each timing graph took a cuBLAS workspace in its own pool: hand that memory back now, or
    # it stays reserved and the KV-cache plan (and `specserve check`'s estimate) is off by it.
    torch.cuda.empty_cache()
    return report
