"""Row-wise argmax with each row split into chunks side by side."""

from __future__ import annotations

import torch

from specserve.kernels.common import pdl_args, triton, use_triton

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit(do_not_specialize=["V", "S"])
    def _argmax_kernel(
        x_ptr, part_v, part_i, cnt_ptr, out_ptr, V, S, BLOCK: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr
    ):
        # Program (row, chunk): the first index of the chunk's maximum; the row's last chunk to
        # finish picks among the chunks' (in chunk order: the first maximum wins, as in torch).
        row = tl.program_id(0)
        c = tl.program_id(1)
        wait_for_previous(PDL)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = c * BLOCK + tl.argmax(x, axis=0)
        if S == 1:
            tl.store(out_ptr + row, i.to(tl.int64))
        else:
            tl.store(part_v + row * S + c, m)
            tl.store(part_i + row * S + c, i)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
            if done == S - 1:
                j = tl.arange(0, SP)
                vs = tl.load(part_v + row * S + j, mask=j < S, other=float("-inf"), cache_modifier=".cg")
                ix = tl.load(part_i + row * S + j, mask=j < S, other=2147483647, cache_modifier=".cg")
                best = tl.min(tl.where(vs == tl.max(vs, axis=0), ix, 2147483647), axis=0)
                tl.store(out_ptr + row, best.to(tl.int64))
                tl.atomic_xchg(cnt_ptr + row, 0)


ARGMAX_BLOCK = 4096  # entries of a row per program
_argmax_counters: dict[torch.device, torch.Tensor] = {}


def _chunk_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per row, how many of its chunks `_argmax_kernel` has finished: zero between calls (each
    row's last chunk resets its own). Made outside CUDA graphs: the runner's warm-up forward
    comes before any capture."""
    got = _argmax_counters.get(device)
    if got is None or got.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("argmax row counters must exist before CUDA graph capture (run a warm-up forward)")
        got = _argmax_counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return got


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1). On GPU one kernel over the rows split into chunks side by side: torch's
    reduction runs a 128k-entry row in one block, which takes longer than a whole layer's
    attention."""
    if not (use_triton(x) and x.is_contiguous() and x.numel() > 0 and x.shape[-1] < 2**31):
        return x.argmax(-1)
    return argmax_triton(x)


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    V = x.shape[-1]
    R, S = x.numel() // V, triton.cdiv(V, ARGMAX_BLOCK)
    out = torch.empty(R, dtype=torch.long, device=x.device)
    part_v = torch.empty(R * S, dtype=torch.float32, device=x.device)
    part_i = torch.empty(R * S, dtype=torch.int32, device=x.device)
    _argmax_kernel[(R, S)](
        x,
        part_v,
        part_i,
        _chunk_counters(x.device, R),
        out,
        V,
        S,
        BLOCK=ARGMAX_BLOCK,
        SP=triton.next_power_of_2(S),
        num_warps=8,
        **pdl_args(x),
    )
    return out.view(x.shape[:-1])
