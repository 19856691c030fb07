"""A Triton kernel for skinny matrix products (decode and verify).

Decoding reads every weight once per step for 1-16 token rows. cuBLAS often
picks tiles that leave most of an H100/H200's multiprocessors idle for such
shapes (an N=4096 projection gives ~32 tiles for 132 SMs), reaching about half
the memory bandwidth. This kernel gives each program a thin slice of output
features and streams the whole K dimension through tensor cores, so every SM
reads weights. Whether it beats cuBLAS is measured once per weight shape
(outside CUDA-graph capture) and remembered: it is used only where it wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16
_choice: dict[tuple, bool] = {}

if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=5),
            triton.Config({"BLOCK_N": 32, "BLOCK_K": 512}, num_warps=8, num_stages=3),
        ],
        key=["N", "K"],
    )
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def skinny_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M <= 16, K] @ w[N, K]^T with the Triton kernel."""
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _skinny_kernel[grid](x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), BLOCK_M=16)
    return y


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
    if (triton is None or not x.is_cuda or rows > MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
            or not w.is_contiguous()):
        return F.linear(x, w, b)
    key = (tuple(w.shape), x.dtype, rows > 4)
    use = _choice.get(key)
    if use is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, w, b)  # never benchmark inside a capture
        x2 = x.reshape(rows, -1).contiguous()
        use = _time_ms(lambda: skinny_matmul(x2, w)) < 0.97 * _time_ms(lambda: F.linear(x2, w))
        _choice[key] = use
    if not use:
        return F.linear(x, w, b)
    y = skinny_matmul(x.reshape(rows, -1).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y
