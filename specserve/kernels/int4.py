"""int4 weights in compressed-tensors' `pack-quantized` layout: packing, unpacking, dequantizing.

A weight [..., N, K] is stored as int32 words [..., N, K/8]: input columns 8j..8j+7 of a row in
word j, column 8j+i in bits 4i..4i+3, each value v in [-8, 7] stored as v + 8. Scales are
[..., N, G] (G groups of K/G columns; G = 1 per channel); asymmetric zero points are int values
[..., N, G], which checkpoints pack the same way but along the output dimension (`dim=-2`).
The weight is (v - zero) * scale.

These are plain functions over any leading dimensions, so dense linears and stacked MoE experts
[E, N, K/8] share them. `int4_linear` is the reference product; `int4_matmul`, what Int4Linear
calls, runs the W4A16 Triton kernel instead for the 1-64 rows of decode and verify on CUDA.
That kernel and the fused int4 experts (`kernels.moe`) dequantize their weight tiles in
registers by one Triton helper, `int4_tile`.
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

    @triton.jit
    def _group_tile(p_ptr, rows, nmask, k0, cols, K: tl.constexpr, GROUPS: tl.constexpr, ADD: tl.constexpr,
                    DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Per-(row, group) values p [.., rows, GROUPS] (scales or zero points) of weight rows
        `rows` for a weight tile over columns `cols` (k0..k0+BLOCK_K), plus ADD, in DT,
        broadcastable to the [BLOCK_K, BLOCK_N] tile. Each (row, group) loads and converts once
        where the groups tile the tile evenly (the broadcast comes after, so no value of the tile
        pays a conversion): a tile inside one group takes a [1, BLOCK_N] row, one spanning T
        whole groups a [T, BLOCK_N] tile repeated over each group's columns; otherwise every
        element loads its own."""
        GS: tl.constexpr = K // GROUPS  # columns per group
        if GS % BLOCK_K == 0:
            v = tl.load(p_ptr + rows * GROUPS + k0 // GS, mask=nmask, other=0)
            return (v[None, :].to(tl.float32) + ADD).to(DT)
        elif BLOCK_K % GS == 0:
            T: tl.constexpr = BLOCK_K // GS
            g = k0 // GS + tl.arange(0, T)
            v = tl.load(p_ptr + rows[None, :] * GROUPS + g[:, None], mask=(g < GROUPS)[:, None] & nmask[None, :],
                        other=0)
            v = (v.to(tl.float32) + ADD).to(DT)
            return tl.reshape(tl.broadcast_to(v[:, None, :], (T, GS, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            v = tl.load(p_ptr + rows[None, :] * GROUPS + cols[:, None] // GS,
                        mask=(cols < K)[:, None] & nmask[None, :], other=0)
            return (v.to(tl.float32) + ADD).to(DT)

    @triton.jit
    def _nibbles(words, OR: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The stored nibbles (value + 8) of words [BLOCK_K / 8, BLOCK_N] as a [BLOCK_K, BLOCK_N]
        tile in column order (nibble i of word j: bits 4i..4i+3, row 8j + i), each ORed with OR:
        int32, or under HALF int16, two nibbles a shift (bits 4i.. and 4i+16.., nibbles i and
        i + 4, land in a word's two halves, then split into their rows). (Arithmetic shifts: the
        masks drop the sign.)"""
        if HALF:
            four = tl.arange(0, 4) * 4
            pairs = (words[:, None, :] >> four[None, :, None]) & 0x000F000F | (OR * 0x10001)  # [word, i, n]
            halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))  # [word, i, n, half]
            out = tl.permute(halves, (0, 3, 1, 2))  # [word, half, i, n]: row 8 * word + 4 * half + i
        else:
            eight = tl.arange(0, 8) * 4
            out = (words[:, None, :] >> eight[None, :, None]) & 0xF | OR  # [word, i, n]
        return tl.reshape(out, (BLOCK_K, BLOCK_N))

    @triton.jit
    def int4_tile(w_ptr, s_ptr, z_ptr, rows, nmask, k0, cols, K: tl.constexpr, GROUPS: tl.constexpr,
                  HAS_ZERO: tl.constexpr, dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The int4 weight W [.., K] (packed words w_ptr [.., K/8], scales s_ptr and int8 zero
        points z_ptr [.., GROUPS]) at rows `rows` [BLOCK_N] (where `nmask`) and columns `cols`
        (k0..k0+BLOCK_K) as the transposed tile [BLOCK_K, BLOCK_N] in dt, zero outside W, equal
        to `dequantize_int4`'s weight bit for bit. No int-to-float conversion: a nibble ORed into
        the low mantissa bits of the dt constant 2^m (m: dt's mantissa width, so its last bit
        weighs 1) is 2^m + nibble exactly; subtracting 2^m + 8 + zero (exact) leaves v - zero,
        and the product with the scale (in dt) rounds once, as the reference dequantizes."""
        WORDS: tl.constexpr = K // 8
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rows[None, :] * WORDS + offs_w[:, None],
                        mask=(offs_w < WORDS)[:, None] & nmask[None, :], other=0)
        if dt == tl.float16:
            v = _nibbles(words, 0x6400, True, BLOCK_N, BLOCK_K).to(dt, bitcast=True)  # 2^10 + nibble
            bias = 1024.0 + 8.0
        elif dt == tl.bfloat16:
            v = _nibbles(words, 0x4300, True, BLOCK_N, BLOCK_K).to(dt, bitcast=True)  # 2^7 + nibble
            bias = 128.0 + 8.0
        else:
            v = _nibbles(words, 0x4B000000, False, BLOCK_N, BLOCK_K).to(dt, bitcast=True)  # 2^23 + nibble
            bias = 8388608.0 + 8.0
        if HAS_ZERO:
            offset = _group_tile(z_ptr, rows, nmask, k0, cols, K, GROUPS, bias, dt, BLOCK_N, BLOCK_K)
        else:
            offset = tl.full([1, BLOCK_N], bias, dt)
        scale = _group_tile(s_ptr, rows, nmask, k0, cols, K, GROUPS, 0.0, dt, BLOCK_N, BLOCK_K)
        return (v - offset) * scale

    @triton.jit(do_not_specialize=["M"])
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, GROUPS: tl.constexpr,
                          HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_ROW: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr):
        """y [M, N] = x [M, K] @ W^T for W packed [N, K/8] int32, scales / zero points [N, GROUPS].
        A program owns BLOCK_N output features over all of K; each step dequantizes a
        [BLOCK_K, BLOCK_N] tile of W^T in x's dtype in registers (`int4_tile`) and accumulates
        its products in float32."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        if ONE_ROW:
            acc = tl.zeros([BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        wait_for_previous(PDL)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            w = int4_tile(w_ptr, s_ptr, z_ptr, offs_n, nmask, k0, cols, K, GROUPS, HAS_ZERO, x_ptr.dtype.element_ty,
                          BLOCK_N, BLOCK_K)
            if ONE_ROW:
                x = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
            else:  # rows padded to BLOCK_M (at least 16) for the tensor cores
                x = tl.load(x_ptr + offs_m[:, None] * K + cols[None, :], mask=(offs_m[:, None] < M) & kmask[None, :],
                            other=0.0)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
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
