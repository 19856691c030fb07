"""Residual add + RMSNorm, rotary embedding with the KV-cache write, and SwiGLU's silu(gate) * up.

- ``rms_norm``       residual add + RMSNorm (one row per program);
- ``rope_store_kv``  rotary embedding of q and k, k and v written into the KV cache at their
                     cache index (one (token, head) per program);
- ``silu_mul``       SwiGLU's silu(gate) * up.

On the CPU (float32, inference) the norm and SwiGLU run as one native call each where the
native kernels are built (`cpu_native`): a decode step there pays per op, not per byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.common import pdl_args, triton, use_triton
from specserve.kernels.cpu_native import fused_ops

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        N,
        x_stride,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # x's rows lie x_stride apart (a slice of a wider product's rows); the others are packed.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        dt = x_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        wait_for_previous(PDL)
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * N + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # rounded as torch's add rounds
            tl.store(sum_ptr + row * N + offs, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * inv).to(dt).to(tl.float32)
        tl.store(out_ptr + row * N + offs, (w * y).to(dt), mask=mask)

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, pos, offs, HALF: tl.constexpr, dt: tl.constexpr):
        """The halves of the cos and sin rows at `pos`, the float32 tables rounded to the model dtype
        first, as the reference does."""
        c1 = tl.load(cos_ptr + pos * 2 * HALF + offs).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + offs).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * 2 * HALF + offs).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + offs).to(dt).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def _cache_slot(bt_ptr, row, w, bt_stride, c_row, c_pos, BS: tl.constexpr, PAGED: tl.constexpr):
        """Element offset of cache index `w` of KV row `row` (head 0): in the row's slot, or with PAGED in
        block table[row, w // BS] at offset w % BS."""
        if PAGED:
            block = tl.load(bt_ptr + row * bt_stride + w // BS)
            return (block * c_row + (w % BS) * c_pos).to(tl.int64)
        else:
            return (row * c_row + w * c_pos).to(tl.int64)

    @triton.jit
    def _rotate(base, c1, c2, s1, s2, offs, HALF: tl.constexpr, dt: tl.constexpr):
        x1 = tl.load(base + offs).to(tl.float32)
        x2 = tl.load(base + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model dtype
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    # Integers that change from request to request (row, token count, strides of the position
    # buffers) are not specialized on: each new value class would compile again while serving.
    @triton.jit(do_not_specialize=["T", "idx_stride", "row_start", "bt_stride"])
    def _rope_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        q_out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        widx_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        T,
        H,
        q_stride,
        k_stride,
        v_stride,
        idx_stride,
        row_start,
        bt_stride,
        c_row,
        c_head,
        c_pos,
        HALF: tl.constexpr,
        BS: tl.constexpr,
        PAGED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        dt = q_ptr.dtype.element_ty
        wait_for_previous(PDL)
        offs = tl.arange(0, HALF)
        idx = (tok // T) * idx_stride + tok % T  # positions/write_idx may be column slices of a wider buffer
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, tl.load(pos_ptr + idx), offs, HALF, dt)
        if head < H:
            o1, o2 = _rotate(q_ptr + tok * q_stride + head * 2 * HALF, c1, c2, s1, s2, offs, HALF, dt)
            out = q_out_ptr + (tok * H + head) * 2 * HALF
            tl.store(out + offs, o1)
            tl.store(out + HALF + offs, o2)
        else:
            kh = head - H
            o1, o2 = _rotate(k_ptr + tok * k_stride + kh * 2 * HALF, c1, c2, s1, s2, offs, HALF, dt)
            slot = (
                _cache_slot(bt_ptr, row_start + tok // T, tl.load(widx_ptr + idx), bt_stride, c_row, c_pos, BS, PAGED)
                + kh * c_head
            )
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + slot + offs, o1.to(cdt))
            tl.store(kc_ptr + slot + HALF + offs, o2.to(cdt))
            v = v_ptr + tok * v_stride + kh * 2 * HALF
            tl.store(vc_ptr + slot + offs, tl.load(v + offs).to(cdt))
            tl.store(vc_ptr + slot + HALF + offs, tl.load(v + HALF + offs).to(cdt))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        dt = x_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * I + offs, (s * u).to(dt), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """q [B, T, H, D], k [B, T, Hkv, D]; cos/sin float32 tables [max_pos, D]; positions [B, T]."""
    c = cos[positions].unsqueeze(2).to(q.dtype)
    s = sin[positions].unsqueeze(2).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def rope_store_kv_ref(
    q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx, block_table=None, block_size: int = 0
):
    q, k = apply_rope(q, k, cos, sin, positions)
    B = q.shape[0]
    block = torch.arange(B, device=q.device).unsqueeze(1) + row_start
    offset = write_idx
    if block_table is not None:
        block, offset = block_table[block, write_idx // block_size], write_idx % block_size
    k_cache[block, :, offset] = k.to(k_cache.dtype)
    v_cache[block, :, offset] = v.to(v_cache.dtype)
    return q


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :I]) * gate_up[..., I:]  # (two slices: cheaper than chunk's split on the CPU)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x; with ``residual``: (norm(x + residual), x + residual), the sum being the
    new residual stream (one kernel on GPU instead of an add plus ~7)."""
    if (
        use_triton(x, weight, residual)
        and x.shape[-1] <= 16384
        and (_row_stride(x) is not None if residual is None else x.is_contiguous() and residual.is_contiguous())
    ):
        return rms_norm_triton(x, weight, eps, residual)
    if x.dtype == torch.float32 and not x.is_cuda:
        native = fused_ops()
        if native is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            y, total = native.add_rms_norm(x, residual, weight, eps)  # one call for the add and the norm
            return y if residual is None else (y, total)
    total = x if residual is None else x + residual
    if total.dtype == torch.float32 and not total.is_cuda:
        # The reference's float32 ops in its order (bit-identical), without its no-op casts and
        # temporaries. On the CPU every op a decode step runs comes after a weight stream that
        # leaves the caches cold, so each op costs several microseconds: aten's rms_norm runs
        # about twenty internally.
        inv = total.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        y = total * inv * weight
    else:
        y = rms_norm_ref(total, weight, eps)
    return y if residual is None else (y, total)


def _row_stride(x: torch.Tensor) -> int | None:
    """The distance between consecutive rows of x [..., N] (its leading dims flattened) where each row is
    packed and the rows lie evenly apart, as in a slice of a wider product's output; else None."""
    if x.stride(-1) != 1:
        return None
    dims = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n > 1]
    if any(st != st_in * n_in for (_, st), (n_in, st_in) in zip(dims, dims[1:])):
        return None
    return dims[-1][1] if dims else x.shape[-1]


def rms_norm_triton(x, weight, eps: float, residual=None):
    """The RMSNorm kernel; x's rows may lie evenly apart (`_row_stride`) where there is no residual."""
    N = x.shape[-1]
    stride = _row_stride(x) if residual is None else N
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(x.numel() // N,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        total,
        N,
        stride,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_args(x),
    )
    return out if residual is None else (out, total)


def _tokens_even(t: torch.Tensor) -> bool:
    """[B, T, ...] whose tokens b*T+t lie one `_token_stride` apart (dims past the second aside)."""
    B, T = t.shape[:2]
    return B == 1 or T == 1 or t.stride(0) == T * t.stride(1)


def _tokens_strided(t: torch.Tensor) -> bool:
    """[B, T, heads, D] with heads and D packed and tokens evenly strided (e.g. views of a qkv row)."""
    D = t.shape[3]
    return t.stride(3) == 1 and t.stride(2) == D and _tokens_even(t)


def _token_stride(t: torch.Tensor) -> int:
    """Elements from token b*T+t to the next (see _tokens_strided). With one token per row, the
    row stride: a view's stride over a size-1 dimension says nothing (a decode step's q/k/v views
    of [B, 1, qkv] have stride(1) = heads * D, not the qkv width)."""
    return t.stride(1) if t.shape[1] > 1 else t.stride(0)


def rope_store_kv(
    q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx, block_table=None, block_size: int = 0
) -> torch.Tensor:
    """Rotary embedding of q [B, T, H, D] and k [B, T, Hkv, D]; k and v are written for rows
    row_start.. at cache index ``write_idx`` [B, T]: caches [rows, Hkv, len, D], or with a
    `block_table` [rows, blocks] pools [blocks, Hkv, block_size, D]. Returns rotated q."""
    D = q.shape[-1]
    if (
        use_triton(q, k, v)
        and D % 2 == 0
        and triton.next_power_of_2(D // 2) == D // 2
        and all(_tokens_strided(t) for t in (q, k, v))
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and positions.stride() == write_idx.stride()
        and write_idx.stride(1) == 1
    ):
        return rope_store_kv_triton(
            q, k, v, cos, sin, positions, k_cache, v_cache, row_start, write_idx, block_table, block_size
        )
    return rope_store_kv_ref(
        q, k, v, cos, sin, positions, k_cache, v_cache, row_start, write_idx, block_table, block_size
    )


def rope_store_kv_triton(
    q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx, block_table=None, block_size: int = 0
):
    B, T, H, D = q.shape
    q_out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    paged = block_table is not None
    _rope_kv_kernel[(B * T, H + k.shape[2])](
        q,
        k,
        v,
        q_out,
        cos,
        sin,
        positions,
        write_idx,
        k_cache,
        v_cache,
        block_table if paged else write_idx,
        T,
        H,
        _token_stride(q),
        _token_stride(k),
        _token_stride(v),
        write_idx.stride(0),
        row_start,
        block_table.stride(0) if paged else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HALF=D // 2,
        BS=block_size if paged else 1,
        PAGED=paged,
        num_warps=1,
        enable_fp_fusion=False,
        **pdl_args(q),
    )  # a fused multiply-add would skip the reference's rounding of each product
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2I] (gate first)."""
    if use_triton(gate_up) and gate_up.is_contiguous():
        return silu_mul_triton(gate_up)
    if gate_up.dtype == torch.float32 and not gate_up.is_cuda and gate_up.is_contiguous():
        native = fused_ops()
        if native is not None:
            return native.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(gate_up.numel() // (2 * I), triton.cdiv(I, block))](
        gate_up, out, I, BLOCK=block, num_warps=4, **pdl_args(gate_up)
    )
    return out
