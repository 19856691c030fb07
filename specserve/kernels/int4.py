"""int4 weights in compressed-tensors' `pack-quantized` layout: packing, unpacking, dequantizing.

A weight [..., N, K] is stored as int32 words [..., N, K/8]: input columns 8j..8j+7 of a row in
word j, column 8j+i in bits 4i..4i+3, each value v in [-8, 7] stored as v + 8. Scales are
[..., N, G] (G groups of K/G columns; G = 1 per channel); asymmetric zero points are int values
[..., N, G], which checkpoints pack the same way but along the output dimension (`dim=-2`).
The weight is (v - zero) * scale.

These are plain functions over any leading dimensions, so dense linears and stacked MoE experts
[E, N, K/8] share them. `int4_linear` is the reference product; `int4_matmul`, what Int4Linear
calls, runs the W4A16 Triton kernel instead for the 1-64 rows of decode and verify on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.common import pdl_args, triton, use_triton

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

PACK = 8  # int4 values per int32 word
# Bit offsets of a word's values, as Python ints: no device tensor to create, so a CUDA graph
# may capture the reference product as well.
SHIFTS = range(0, 32, 4)


def pack_int4(q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Integers in [-8, 7] -> int32 words of eight consecutive values along `dim` (-1: the
    weights' layout, -2: the zero points'); the bits past the last value are zero."""
    if q.is_floating_point() or int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("pack_int4 takes integers in [-8, 7]")
    q = q.movedim(dim, -1).to(torch.int64) + 8
    pad = -q.shape[-1] % PACK
    if pad:
        q = F.pad(q, (0, pad))
    values = q.view(*q.shape[:-1], -1, PACK)
    words = sum(values[..., i] << shift for i, shift in enumerate(SHIFTS))
    words = torch.where(words >= 2**31, words - 2**32, words)  # the top nibble sets the sign bit
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int4(words: torch.Tensor, size: int, dim: int = -1) -> torch.Tensor:
    """`pack_int4`'s inverse: int32 words -> int8 values, `size` of them along `dim`."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed int4 words must be int32, got {words.dtype}")
    w = words.movedim(dim, -1)
    nibbles = torch.stack([(w >> shift) & 0xF for shift in SHIFTS], -1)  # (arithmetic shifts: the mask drops the sign)
    return (nibbles.flatten(-2)[..., :size] - 8).to(torch.int8).movedim(-1, dim)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weights [..., N, K] in `dtype` (default the scales') from packed words [..., N, K/8],
    scales [..., N, G] and optional zero points [..., N, G] (unpacked). Computed in `dtype`, as
    compressed-tensors does in the scales' dtype: (v - zero) is exact there, the product rounds once."""
    dtype = dtype or scale.dtype
    K = packed.shape[-1] * PACK
    groups = scale.shape[-1]
    v = unpack_int4(packed, K).unflatten(-1, (groups, K // groups)).to(dtype)
    if zero is not None:
        v = v - zero.to(dtype).unsqueeze(-1)
    return (v * scale.to(dtype).unsqueeze(-1)).flatten(-2)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for an int4 weight W: the reference path, which dequantizes W for each
    call. Keeping only the packed form keeps int4's 4x smaller footprint, the point of loading it."""
    return F.linear(x, dequantize_int4(packed, scale, zero, x.dtype), bias)


INT4_GEMV_MAX_ROWS = 64  # more rows (prefill) dequantize once per call and run one float matmul


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int4_linear`, by the W4A16 kernel where it applies (CUDA, at most 64 rows): it streams the
    packed words, a quarter of a bf16 weight's bytes, which is what a decode step waits on."""
    rows = x.numel() // x.shape[-1]
    if rows > INT4_GEMV_MAX_ROWS or not use_triton(x, bias):
        return int4_linear(x, packed, scale, zero, bias)
    y = int4_gemv_triton(x.reshape(rows, -1).contiguous(), packed, scale, zero, bias)
    return y.view(*x.shape[:-1], packed.shape[0])


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, GROUPS: tl.constexpr,
                          HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_ROW: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr):
        """y [M, N] = x [M, K] @ W^T for W packed [N, K/8] int32, scales / zero points [N, GROUPS].
        A program owns BLOCK_N output features over all of K; each step unpacks BLOCK_K/8 words a
        row into BLOCK_K weights in registers, scales them by their groups' scales and
        accumulates in float32."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        offs_word = tl.arange(0, BLOCK_K // 8)
        shifts = tl.arange(0, 8) * 4
        WORDS: tl.constexpr = K // 8
        GROUP: tl.constexpr = K // GROUPS
        if ONE_ROW:
            acc = tl.zeros([BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        wait_for_previous(PDL)
        for i in range(0, tl.cdiv(K, BLOCK_K)):
            words_k = i * (BLOCK_K // 8) + offs_word
            wmask = nmask[:, None] & (words_k[None, :] < WORDS)
            words = tl.load(w_ptr + offs_n[:, None] * WORDS + words_k[None, :], mask=wmask, other=0)
            # Column 8j+b of a row is bits 4b..4b+3 of its word j, stored as value + 8
            # (arithmetic shifts: the mask drops the sign).
            nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF
            v = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
            offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            gmask = nmask[:, None] & kmask[None, :]
            group = offs_n[:, None] * GROUPS + offs_k[None, :] // GROUP
            if HAS_ZERO:
                v = v - tl.load(z_ptr + group, mask=gmask, other=0).to(tl.float32)
            # One rounding into the activations' dtype, as the reference's dequantization.
            w = (v * tl.load(s_ptr + group, mask=gmask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if ONE_ROW:
                x = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            else:  # rows padded to BLOCK_M (at least 16) for the tensor cores
                x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                            mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        if ONE_ROW:
            if HAS_BIAS:
                acc += bias
            tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            if HAS_BIAS:
                acc += bias[None, :]
            tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & nmask[None, :])


def gemv_tiles(rows: int) -> tuple[int, int, int]:
    """The W4A16 kernel's (BLOCK_N, BLOCK_K, warps) for `rows` rows: one row sums on the CUDA
    cores over long K steps, more take the tensor cores."""
    return (16, 256, 4) if rows == 1 else (64, 128, 4)


def int4_gemv_triton(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M <= 64, K] (contiguous) @ W^T (+ bias) for int4 W: packed [N, K/8], scales and
    unpacked int8 zero points [N, G]; float32 accumulation, the result in x2's dtype."""
    M, K = x2.shape
    N, groups = packed.shape[0], scale.shape[-1]
    if packed.shape[1] * PACK != K or M > INT4_GEMV_MAX_ROWS:
        raise ValueError(f"int4 GEMV takes at most {INT4_GEMV_MAX_ROWS} rows of {packed.shape[1] * PACK} features, "
                         f"got {tuple(x2.shape)}")
    one_row = M == 1
    block_n, block_k, warps = gemv_tiles(M)
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    _int4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, packed, scale.contiguous(), zero if zero is not None else packed, bias if bias is not None else scale,
        y, M, N, K, groups, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, ONE_ROW=one_row,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",  # (tf32 would round float32 inputs)
        num_warps=warps, **pdl_args(x2))
    return y


def quantize_int4(w: torch.Tensor, group_size: int | None, symmetric: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest int4 of float weights [..., N, K]: (values int8 [..., N, K], scales
    [..., N, G] in w's dtype, zero points int8 [..., N, G] or None when symmetric), groups of
    `group_size` input columns (None: one per row). For test and benchmark checkpoints."""
    K = w.shape[-1]
    g = w.float().unflatten(-1, (1 if group_size is None else K // group_size, -1))
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp_min(1e-8).to(w.dtype)
        q = (g / scale.float().unsqueeze(-1)).round().clamp(-8, 7)
        return q.flatten(-2).to(torch.int8), scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(w.dtype)
    zero = (-8 - lo / scale.float()).round().clamp(-8, 7)
    q = ((g / scale.float().unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(-8, 7)
    return q.flatten(-2).to(torch.int8), scale, zero.to(torch.int8)
