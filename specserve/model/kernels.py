"""A Triton kernel for skinny matrix products (decode and verify).

Decoding reads every weight once per step for 1-16 token rows. cuBLAS often
picks tiles that leave most of an H100/H200's multiprocessors idle for such
shapes (an N=4096 projection gives ~32 tiles for 132 SMs), reaching about half
the memory bandwidth. This kernel gives each program a thin slice of output
features and one slice of K through tensor cores, so every SM
reads weights (split-K partial sums are added atomically in float32). Whether
it is right and beats cuBLAS is checked once per weight shape (outside
CUDA-graph capture) and remembered: it is used only where it wins.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16
# Opt-in until validated on GPU: the split-K version has not yet completed a GPU check (an
# illegal memory access appeared in the first run that could have used it; see BENCHMARKS.md).
ENABLED = os.environ.get("SPECSERVE_SKINNY_MATMUL", "0") == "1"
_choice: dict[tuple, bool] = {}

if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=4, num_stages=4)
            for bn, bk, sk in ((32, 256, 1), (32, 256, 4), (64, 128, 4), (32, 128, 8), (16, 256, 8), (64, 256, 2))
        ],
        key=["N", "K"],
        reset_to_zero=["y_ptr"],
    )
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        # Program (n, s) computes BLOCK_N outputs over the s-th of SPLIT_K slices of K and
        # adds its partial sums into the float32 output: more programs than SMs even for N=4096.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + k_per, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.atomic_add(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)


_tuned: set[tuple] = set()


def skinny_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M <= 16, K] @ w[N, K]^T with the Triton kernel (float32 accumulation)."""
    M, K = x2.shape
    N = w.shape[0]
    y = torch.zeros(M, N, dtype=torch.float32, device=x2.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    _skinny_kernel[grid](x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), BLOCK_M=16)
    key = (N, K)
    if key not in _tuned:  # the autotuning call ran several configs into y: compute it once more
        _tuned.add(key)
        y.zero_()
        _skinny_kernel[grid](x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), BLOCK_M=16)
    return y.to(x2.dtype)


def _time_ms(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the skinny kernel for few-row bf16/fp16 inputs on CUDA where it is faster."""
    rows = x.numel() // x.shape[-1]
    if (not ENABLED or triton is None or not x.is_cuda or rows > MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
            or not w.is_contiguous()):
        return F.linear(x, w, b)
    key = (tuple(w.shape), x.dtype, rows > 4)
    use = _choice.get(key)
    if use is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, w, b)  # never benchmark inside a capture
        x2 = x.reshape(rows, -1).contiguous()
        ref = F.linear(x2, w)
        err = ((skinny_matmul(x2, w).float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
        # Adopt it only where it is right (bf16-level error) and clearly faster.
        use = err < 2e-2 and _time_ms(lambda: skinny_matmul(x2, w)) < 0.97 * _time_ms(lambda: F.linear(x2, w))
        _choice[key] = use
    if not use:
        return F.linear(x, w, b)
    y = skinny_matmul(x.reshape(rows, -1).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y
