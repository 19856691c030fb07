"""int4 weights in compressed-tensors' `pack-quantized` layout: packing, unpacking, dequantizing.

A weight [..., N, K] is stored as int32 words [..., N, K/8]: input columns 8j..8j+7 of a row in
word j, column 8j+i in bits 4i..4i+3, each value v in [-8, 7] stored as v + 8. Scales are
[..., N, G] (G groups of K/G columns; G = 1 per channel); asymmetric zero points are int values
[..., N, G], which checkpoints pack the same way but along the output dimension (`dim=-2`).
The weight is (v - zero) * scale.

These are plain functions over any leading dimensions, so dense linears and stacked MoE experts
[E, N, K/8] share them. `int4_linear` is the reference product; `int4_matmul`, what Int4Linear
calls, runs the W4A16 Triton kernel instead for the 1-64 rows of decode and verify on CUDA, in
the launch shape (tiles, slices of K) `tune_int4` timed at start-up.
Its 2-64 rows and the fused int4 experts (`kernels.moe`) dequantize weight tiles in registers for
the tensor cores by one Triton helper, `int4_tile`; its one row sums on the CUDA cores (`_row_sum`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specserve.kernels import common
from specserve.kernels.common import pdl_args, triton, use_triton
from specserve.kernels.gemv import GEMV_ROWS, graph_us, rows_bucket, streamed_count

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

log = logging.getLogger(__name__)

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


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
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


TILE_ROWS = 16  # rows of a tile in the experts' device layout (`tile_experts`)
TILE_WORDS = 16  # words of a tile row a chunk holds: 128 input features


def _rows_in_tiles(t: torch.Tensor, interleave: int) -> torch.Tensor:
    """[..., R, C] -> [..., R / 16, 16, C]: each tile's rows (gate rows 8t..8t+7 then the same up rows
    where `interleave` = I, the gate rows' count, is given)."""
    *lead, R, C = t.shape
    if not interleave:
        return t.reshape(*lead, R // TILE_ROWS, TILE_ROWS, C)
    half = TILE_ROWS // 2
    gate = t[..., :interleave, :].reshape(*lead, interleave // half, half, C)
    up = t[..., interleave:, :].reshape(*lead, interleave // half, half, C)
    return torch.cat([gate, up], -2)


def _tiles_as_rows(t: torch.Tensor, interleave: int) -> torch.Tensor:
    """`_rows_in_tiles`' inverse: [..., R / 16, 16, C] -> [..., R, C]."""
    *lead, T, _, C = t.shape
    if not interleave:
        return t.reshape(*lead, T * TILE_ROWS, C)
    half = TILE_ROWS // 2
    return torch.cat([t[..., :half, :].reshape(*lead, T * half, C), t[..., half:, :].reshape(*lead, T * half, C)], -2)


def tile_experts(packed: torch.Tensor, scale: torch.Tensor, interleave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked int4 experts' words [..., R, K/8] and scales [..., R, G] in the device layout the CUDA
    expert kernels stream: each expert's rows in tiles of 16, a tile's words chunk by chunk (16 rows x
    16 words, 128 input features: one 1-KB run a warp reads whole) and its scales group by group (16
    rows each). With `interleave` = I (a gate/up stack [.., 2I, K/8]) a tile holds gate rows 8t..8t+7
    then up rows 8t..8t+7, so both halves of a SwiGLU meet in one tile. The tensors keep their shapes;
    only the order inside each expert changes (`untile_experts` reverses it)."""
    *lead, R, W = packed.shape
    if R % TILE_ROWS or W % TILE_WORDS or (interleave and interleave % (TILE_ROWS // 2)):
        raise ValueError(
            f"int4 experts of {R} rows and {W * PACK} input features do not tile into 16 rows x "
            f"{TILE_WORDS * PACK} features"
        )
    words = _rows_in_tiles(packed, interleave).unflatten(-1, (W // TILE_WORDS, TILE_WORDS)).transpose(-3, -2)
    scales = _rows_in_tiles(scale, interleave).transpose(-2, -1)
    return words.contiguous().view(packed.shape), scales.contiguous().view(scale.shape)


def untile_experts(packed: torch.Tensor, scale: torch.Tensor, interleave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`tile_experts`' inverse: the stored row-major words and scales."""
    *lead, R, W = packed.shape
    G = scale.shape[-1]
    T = R // TILE_ROWS
    words = packed.reshape(*lead, T, W // TILE_WORDS, TILE_ROWS, TILE_WORDS).transpose(-3, -2)
    scales = scale.reshape(*lead, T, G, TILE_ROWS).transpose(-2, -1)
    return (
        _tiles_as_rows(words.reshape(*lead, T, TILE_ROWS, W), interleave).contiguous(),
        _tiles_as_rows(scales, interleave).contiguous(),
    )


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T (+ bias) for an int4 weight W: the reference path, which dequantizes W for each
    call. Keeping only the packed form keeps int4's 4x smaller footprint, the point of loading it."""
    return F.linear(x, dequantize_int4(packed, scale, zero, x.dtype), bias)


INT4_GEMV_MAX_ROWS = 64  # more rows (prefill) dequantize once per call and run one float matmul


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int4_linear`, by the W4A16 kernel where it applies (CUDA, at most 64 rows): it streams the
    packed words, a quarter of a bf16 weight's bytes, which is what a decode step waits on. Its
    launch shape is the one `tune_int4` chose for these words and row count, if it ran."""
    rows = x.numel() // x.shape[-1]
    if rows > INT4_GEMV_MAX_ROWS or not use_triton(x, bias):
        return int4_linear(x, packed, scale, zero, bias)
    tuned = getattr(packed, "int4_configs", None)
    cfg = tuned.get(rows_bucket(rows)) if tuned is not None else None
    y = int4_gemv_triton(x.reshape(rows, -1).contiguous(), packed, scale, zero, bias, cfg)
    return y.view(*x.shape[:-1], packed.shape[0])


if triton is not None:

    @triton.jit
    def _group_at(rows, g, GROUPS: tl.constexpr, TILED: tl.constexpr):
        """Where (row, group) lies in per-(row, group) values [.., rows, GROUPS]: row-major, or under
        TILED `tile_experts`' order (16-row tiles, group by group)."""
        if TILED:
            return (rows // 16) * (16 * GROUPS) + g * 16 + rows % 16
        else:
            return rows * GROUPS + g

    @triton.jit
    def _group_tile(
        p_ptr,
        rows,
        nmask,
        k0,
        cols,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        ADD: tl.constexpr,
        DT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TILED: tl.constexpr,
    ):
        """Per-(row, group) values p [.., rows, GROUPS] (scales or zero points; `_group_at`'s order) of
        weight rows `rows` for a weight tile over columns `cols` (k0..k0+BLOCK_K), plus ADD, in DT,
        broadcastable to the [BLOCK_K, BLOCK_N] tile. Each (row, group) loads and converts once
        where the groups tile the tile evenly (the broadcast comes after, so no value of the tile
        pays a conversion): a tile inside one group (every tile, per channel) takes a
        [1, BLOCK_N] row, one spanning T whole groups a [T, BLOCK_N] tile repeated over each
        group's columns; otherwise every element loads its own."""
        GS: tl.constexpr = K // GROUPS  # columns per group
        if GROUPS == 1 or GS % BLOCK_K == 0:
            v = tl.load(p_ptr + _group_at(rows, k0 // GS, GROUPS, TILED), mask=nmask, other=0)
            return (v[None, :].to(tl.float32) + ADD).to(DT)
        elif BLOCK_K % GS == 0:
            T: tl.constexpr = BLOCK_K // GS
            g = k0 // GS + tl.arange(0, T)
            v = tl.load(
                p_ptr + _group_at(rows[None, :], g[:, None], GROUPS, TILED),
                mask=(g < GROUPS)[:, None] & nmask[None, :],
                other=0,
            )
            v = (v.to(tl.float32) + ADD).to(DT)
            return tl.reshape(tl.broadcast_to(v[:, None, :], (T, GS, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            v = tl.load(
                p_ptr + _group_at(rows[None, :], cols[:, None] // GS, GROUPS, TILED),
                mask=(cols < K)[:, None] & nmask[None, :],
                other=0,
            )
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
    def int4_tile(
        w_ptr,
        s_ptr,
        z_ptr,
        rows,
        nmask,
        k0,
        cols,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        dt: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TILED: tl.constexpr,
    ):
        """The int4 weight W [.., K] (packed words w_ptr [.., K/8], scales s_ptr and int8 zero
        points z_ptr [.., GROUPS]; row-major, or under TILED in `tile_experts`' order, `rows` then
        counting tile rows) at rows `rows` [BLOCK_N] (where `nmask`) and columns `cols`
        (k0..k0+BLOCK_K) as the transposed tile [BLOCK_K, BLOCK_N] in dt, zero outside W, equal
        to `dequantize_int4`'s weight bit for bit. No int-to-float conversion: a nibble ORed into
        the low mantissa bits of the dt constant 2^m (m: dt's mantissa width, so its last bit
        weighs 1) is 2^m + nibble exactly; subtracting 2^m + 8 + zero (exact) leaves v - zero,
        and the product with the scale (in dt) rounds once, as the reference dequantizes."""
        WORDS: tl.constexpr = K // 8
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        if TILED:  # (`tile_experts`' order: 16-row tiles, 16 words of each row a chunk)
            at = (
                (rows[None, :] // 16) * (16 * WORDS)
                + (offs_w[:, None] // 16) * 256
                + (rows[None, :] % 16) * 16
                + offs_w[:, None] % 16
            )
        else:
            at = rows[None, :] * WORDS + offs_w[:, None]
        words = tl.load(w_ptr + at, mask=(offs_w < WORDS)[:, None] & nmask[None, :], other=0)
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
            offset = _group_tile(z_ptr, rows, nmask, k0, cols, K, GROUPS, bias, dt, BLOCK_N, BLOCK_K, TILED)
        else:
            offset = tl.full([1, BLOCK_N], bias, dt)
        scale = _group_tile(s_ptr, rows, nmask, k0, cols, K, GROUPS, 0.0, dt, BLOCK_N, BLOCK_K, TILED)
        return (v - offset) * scale

    @triton.jit
    def _row_words(w_ptr, rows, nmask, k0, k_hi, K: tl.constexpr, T: tl.constexpr, WPG: tl.constexpr):
        """The packed words [BLOCK_N, T, WPG] of weight rows `rows` over columns k0..k0+8*T*WPG
        (T runs of WPG consecutive words), zero from column k_hi on."""
        word = k0 // 8 + tl.arange(0, T)[:, None] * WPG + tl.arange(0, WPG)[None, :]
        return tl.load(
            w_ptr + rows[:, None, None] * (K // 8) + word[None, :, :],
            mask=nmask[:, None, None] & (word < k_hi // 8)[None, :, :],
            other=0,
        )

    @triton.jit
    def _nibble_products(run, words, i: tl.constexpr, x_lo, x_hi, EXACT: tl.constexpr):
        """run + (128 + nibble i) * x_lo + (128 + nibble i + 4) * x_hi of each word in float32
        (two fused multiply-adds); under EXACT the nibbles themselves, 128 subtracted first.
        One shift and one mask put nibbles i and i + 4 into the two bfloat16 halves of 0x43004300
        (128 each): the high half is already float32, the low one shifts up."""
        pair = (words >> (4 * i)) & 0x000F000F | 0x43004300
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -65536).to(tl.float32, bitcast=True)  # (0xFFFF0000 as an int32)
        if EXACT:
            lo -= 128.0
            hi -= 128.0
        run = run + lo * x_lo[None, :, :]
        return run + hi * x_hi[None, :, :]

    @triton.jit
    def _row_dot(
        acc,
        words,
        x_ptr,
        s_ptr,
        z_ptr,
        rows,
        nmask,
        k0,
        k_hi,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        T: tl.constexpr,
        WPG: tl.constexpr,
    ):
        """acc [BLOCK_N, T] + one row x times the int4 weight's rows `rows` over columns
        k0..k0+8*T*WPG (`words` from `_row_words`; each run of WPG words inside one scale group),
        in float32 on the CUDA cores. Each value becomes the float32 128 + nibble exactly by
        integer ops alone (`_nibble_products`): no int-to-float conversion, no scale per value,
        and x's 8 columns of a word load as one vector. A run's sum of (128 + nibble) * x, less
        (136 + zero) times the run's sum of x, is its sum of (v - zero) * x, which its scale
        then multiplies once. The 128 cancels with a relative error of ~2^-19 of a run's sum,
        far below a 16-bit result's rounding; float32 rows subtract it from each value first
        (one more add a value), so their sums match the reference's to a float32 sum's order."""
        EXACT: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
        BIAS: tl.constexpr = 8.0 if EXACT else 136.0
        GS: tl.constexpr = K // GROUPS
        word = k0 // 8 + tl.arange(0, T)[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [T, WPG]
        col = word * 8
        inside = col < k_hi
        # x[8w .. 8w + 7] of each word w, split into the eight columns' tensors
        xw = tl.load(x_ptr + col[:, :, None] + tl.arange(0, 8)[None, None, :], mask=inside[:, :, None], other=0.0).to(
            tl.float32
        )
        x04, x15 = tl.split(tl.reshape(xw, (T, WPG, 4, 2)))  # columns 0 2 4 6 and 1 3 5 7 of a word
        x0, x2 = tl.split(tl.reshape(x04, (T, WPG, 2, 2)))  # 0 4, 2 6
        x1, x3 = tl.split(tl.reshape(x15, (T, WPG, 2, 2)))  # 1 5, 3 7
        x_0, x_4 = tl.split(x0)
        x_2, x_6 = tl.split(x2)
        x_1, x_5 = tl.split(x1)
        x_3, x_7 = tl.split(x3)
        run = _nibble_products(tl.zeros(words.shape, tl.float32), words, 0, x_0, x_4, EXACT)
        run = _nibble_products(run, words, 1, x_1, x_5, EXACT)
        run = _nibble_products(run, words, 2, x_2, x_6, EXACT)
        run = _nibble_products(run, words, 3, x_3, x_7, EXACT)
        xs = tl.sum(xw, axis=2)
        run = tl.sum(run, axis=2)  # [BLOCK_N, T]
        xs = tl.sum(xs, axis=1)[None, :]
        group = (k0 + tl.arange(0, T) * (8 * WPG)) // GS
        at, gmask = rows[:, None] * GROUPS + group[None, :], nmask[:, None] & (group < GROUPS)[None, :]
        scale = tl.load(s_ptr + at, mask=gmask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            offset = tl.load(z_ptr + at, mask=gmask, other=0).to(tl.float32) + BIAS
        else:
            offset = BIAS
        return acc + (run - offset * xs) * scale

    @triton.jit
    def _row_sum(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        rows,
        nmask,
        k_lo,
        k_hi,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One row x [K] times the int4 weight's rows `rows` [BLOCK_N] (where `nmask`) over
        columns k_lo..k_hi in steps of BLOCK_K, as float32 [BLOCK_N] (`_row_dot`). A step's words
        form runs inside one scale group (one run per step where a group holds it, one per
        group where it holds whole groups, else one per word); the runs' sums add up over K
        and are summed once, after the loop, so no step reduces across threads. Each step loads
        the next one's words before it computes: their latency hides behind the arithmetic (the
        first, not depending on the kernel before, loads while that one drains)."""
        GS: tl.constexpr = K // GROUPS
        T: tl.constexpr = (
            1 if GROUPS == 1 or GS % BLOCK_K == 0 else BLOCK_K // GS if BLOCK_K % GS == 0 else BLOCK_K // 8
        )
        WPG: tl.constexpr = BLOCK_K // 8 // T
        acc = tl.zeros([BLOCK_N, T], tl.float32)
        words = _row_words(w_ptr, rows, nmask, k_lo, k_hi, K, T, WPG)
        wait_for_previous(PDL)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ahead = _row_words(w_ptr, rows, nmask, k0 + BLOCK_K, k_hi, K, T, WPG)
            acc = _row_dot(acc, words, x_ptr, s_ptr, z_ptr, rows, nmask, k0, k_hi, K, GROUPS, HAS_ZERO, T, WPG)
            words = ahead
        return tl.sum(acc, axis=1)

    @triton.jit(do_not_specialize=["M", "SPAN_STEPS"])
    def _int4_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        SPAN_STEPS,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_ROW: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """y [M, N] = x [M, K] @ W^T for W packed [N, K/8] int32, scales / zero points [N, GROUPS].
        Program (n, s, m) owns BLOCK_N output features and BLOCK_M rows over SPAN_STEPS steps of
        BLOCK_K input columns from s*SPAN_STEPS*BLOCK_K (a runtime count: one compiled kernel
        serves every split, and the steps stay BLOCK_K-aligned for wide loads). One row sums on
        the CUDA cores (`_row_sum`); more rows dequantize a [BLOCK_K, BLOCK_N] tile of W^T
        in x's dtype in registers each step (`int4_tile`) for the tensor cores; both accumulate
        in float32. Under SPLIT y is the float32 partial sums [splits, M, N], which
        `_split_sum_kernel` adds up (and biases) in a fixed order: no atomics, so the result is
        the same at every call."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        split = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        k_lo = split * SPAN_STEPS * BLOCK_K
        k_hi = tl.minimum(k_lo + SPAN_STEPS * BLOCK_K, K)
        if ONE_ROW:
            acc = _row_sum(
                x_ptr, w_ptr, s_ptr, z_ptr, offs_n, nmask, k_lo, k_hi, K, GROUPS, HAS_ZERO, BLOCK_N, BLOCK_K, PDL
            )
        else:
            # Rows padded to BLOCK_M (at least 16) for the tensor cores, as W^T x^T (the MoE
            # kernels' SWAP): the dequantized tile is the left operand of Hopper's warp-group
            # MMA straight from registers; x's 16-64 rows are too few to be the left one.
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            wait_for_previous(PDL)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                w = int4_tile(
                    w_ptr,
                    s_ptr,
                    z_ptr,
                    offs_n,
                    nmask,
                    k0,
                    cols,
                    K,
                    GROUPS,
                    HAS_ZERO,
                    x_ptr.dtype.element_ty,
                    BLOCK_N,
                    BLOCK_K,
                    False,
                )
                x = tl.load(
                    x_ptr + offs_m[:, None] * K + cols[None, :],
                    mask=(offs_m[:, None] < M) & (cols < K)[None, :],
                    other=0.0,
                )
                acc = tl.dot(tl.trans(w), tl.trans(x), acc, input_precision=PRECISION)
            acc = tl.trans(acc)
        if SPLIT:
            y_ptr += split * M * N
        elif HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
            acc += bias
        if ONE_ROW:
            tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(
                y_ptr + offs_m[:, None] * N + offs_n[None, :],
                acc.to(y_ptr.dtype.element_ty),
                mask=(offs_m[:, None] < M) & nmask[None, :],
            )

    @triton.jit
    def _split_sum_kernel(
        p_ptr, b_ptr, y_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        """y [M, N] = the sum of float32 partials [SPLITS, M, N] in split order (+ bias [N])."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        wait_for_previous(PDL)
        acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


SUM_BLOCK = 1024  # elements per program of `_split_sum_kernel`


def gemv_tiles(rows: int) -> tuple[int, int, int]:
    """The W4A16 kernel's default (BLOCK_N, BLOCK_K, warps) for `rows` rows: one row sums on the
    CUDA cores over long K steps (64 rows to a program, so each x value loaded serves several),
    more take the tensor cores."""
    return (64, 256, 4) if rows == 1 else (64, 128, 4)


# Programs per SM the untuned launch shapes aim at: a decode step's few output blocks alone
# leave most SMs idle, so K is cut into slices until there are about this many.
PROGRAMS_PER_SM = 4


def default_config(N: int, K: int, rows: int, device: torch.device) -> tuple:
    """The launch shape (BLOCK_N, BLOCK_K, warps, splits) where no tuning chose one: K cut into
    enough slices that the GPU runs about PROGRAMS_PER_SM programs per SM, but no more than a
    whole step each, and few enough that the float32 partials stay under a quarter of the
    weight's bytes."""
    block_n, block_k, warps = gemv_tiles(rows)
    wanted = -(-PROGRAMS_PER_SM * common.sm_count(device) // -(-N // block_n))
    return block_n, block_k, warps, k_slices(K, block_k, max(1, min(wanted, K // (32 * rows))))[1]


def k_slices(K: int, block_k: int, splits: int) -> tuple[int, int]:
    """(columns per slice, slices) for K cut into `splits` slices of whole BLOCK_K steps (fewer
    where K has fewer steps, or where rounding the steps up leaves the last slices empty)."""
    span = -(-(-(-K // block_k)) // splits) * block_k
    return span, -(-K // span)


def int4_gemv_triton(
    x2: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cfg: tuple | None = None,
) -> torch.Tensor:
    """x2 [M <= 64, K] (contiguous) @ W^T (+ bias) for int4 W: packed [N, K/8], scales and
    unpacked int8 zero points [N, G]; float32 accumulation, the result in x2's dtype. `cfg`:
    (BLOCK_N, BLOCK_K, warps, splits[, BLOCK_M]) (default `default_config`); splits > 1 cut K
    into that many slices (fewer where K has fewer BLOCK_K steps), summed by a second kernel;
    with BLOCK_M the rows run in tiles of that many on the tensor cores (one row included), so
    a row's result does not depend on the rows beside it (--batch-invariant)."""
    M, K = x2.shape
    N, groups = packed.shape[0], scale.shape[-1]
    if packed.shape[1] * PACK != K or M > INT4_GEMV_MAX_ROWS:
        raise ValueError(
            f"int4 GEMV takes at most {INT4_GEMV_MAX_ROWS} rows of {packed.shape[1] * PACK} features, "
            f"got {tuple(x2.shape)}"
        )
    block_n, block_k, warps, splits, *fixed_m = cfg or default_config(N, K, M, x2.device)
    block_m = fixed_m[0] if fixed_m else max(16, triton.next_power_of_2(M))
    span, splits = k_slices(K, block_k, splits)
    one_row = M == 1 and not fixed_m and K // groups % PACK == 0  # (`_row_sum` sums groups of whole words)
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    out = torch.empty(splits, M, N, dtype=torch.float32, device=x2.device) if splits > 1 else y
    _int4_gemv_kernel[(triton.cdiv(N, block_n), splits, triton.cdiv(M, block_m))](
        x2,
        packed,
        scale.contiguous(),
        zero if zero is not None else packed,
        bias if bias is not None else scale,
        out,
        M,
        N,
        span // block_k,
        K,
        groups,
        HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_ROW=one_row,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",  # (tf32 would round float32 inputs)
        num_warps=warps,
        **pdl_args(x2),
    )
    if splits > 1:
        _split_sum_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            out,
            bias if bias is not None else scale,
            y,
            M * N,
            N,
            SPLITS=splits,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
            **pdl_args(x2),
        )
    return y


# Tuning candidates: tiles (BLOCK_N, BLOCK_K, warps) for one row (CUDA-core sums, or a 16-row
# tensor-core tile: fewer instructions per weight, though 15 of its rows are padding) and for
# more (tensor cores), each at these split counts, up to 32 programs per SM.
TUNED_TILES = {1: ((64, 256, 4), (32, 256, 4), (128, 128, 4), (64, 128, 4, 16)), 2: ((64, 128, 4), (32, 128, 4))}
TUNED_SPLITS = (1, 2, 4, 8, 16, 32)


def candidates(N: int, K: int, rows: int, device: torch.device) -> list[tuple]:
    """The launch shapes `tune_int4` times for `rows` rows of a [N, K] int4 weight, each once."""
    out = {}
    for block_n, block_k, warps, *fixed_m in TUNED_TILES[min(rows, 2)]:
        for s in TUNED_SPLITS:
            splits = k_slices(K, block_k, s)[1]
            if -(-N // block_n) * splits <= 32 * common.sm_count(device):
                out[(block_n, block_k, warps, splits, *fixed_m)] = None
    return list(out)


def invariant_config(N: int, K: int, device: torch.device) -> tuple:
    """--batch-invariant: one launch shape for every row count, chosen by no timing: 16-row
    tensor-core tiles (one row too) and a split count from the shape alone, so a token's
    output rounds alike in a decode step and a verify."""
    return default_config(N, K, 16, device) + (16,)


@torch.inference_mode()
def tune_int4(weights: list[tuple], max_rows: int = 8, invariant: bool = False) -> dict:
    """Choose the W4A16 launch shape per int4 weight shape and row bucket up to `max_rows`, by
    timing `candidates` in CUDA graphs over weights of the shape that together exceed the L2
    (as `gemv.tune_linear` does), each checked against the reference product first.
    `weights`: (packed, scales, zero points or None) of every int4 linear; each packed tensor
    gets its shape's choice as ``packed.int4_configs`` {rows bucket: config}, which
    `int4_matmul` follows (row counts past `max_rows`' bucket take `default_config`). With
    `invariant`, every bucket holds `invariant_config`. Returns {"int4 NxK/G": {rows: (default
    us, best us, chosen)}} for logging."""
    if not common.FUSED or triton is None or not weights or not weights[0][0].is_cuda:
        return {}
    by_shape: dict[tuple, list[tuple]] = {}
    for packed, scale, zero in weights:
        key = (*packed.shape, scale.shape[-1], zero is not None, scale.dtype)
        by_shape.setdefault(key, []).append((packed, scale, zero))
    report = {}
    for (N, words, groups, _, dtype), ws in by_shape.items():
        K, dev = words * PACK, ws[0][0].device
        configs = {}
        for packed, *_ in ws:
            packed.int4_configs = configs
        name = f"int4 {N}x{K}/{groups}"
        if invariant:
            configs.update({rows: invariant_config(N, K, dev) for rows in GEMV_ROWS})
            report[name] = {"any": (None, None, configs[1])}
            continue
        log.info("tuning the int4 GEMV for %dx%d, %d groups", N, K, groups)
        first = ws[0]
        need = streamed_count(sum(t.nbytes for t in first if t is not None), dev)
        ws = ws[:8] + [tuple(t.clone() if t is not None else None for t in first) for _ in range(need - len(ws[:8]))]
        for rows in (r for r in GEMV_ROWS if r <= rows_bucket(min(max_rows, GEMV_ROWS[-1]))):
            x = torch.randn(rows, K, device=dev, dtype=dtype)
            ref = int4_linear(x, *first).float()
            default, times = default_config(N, K, rows, dev), {}
            for cfg in dict.fromkeys([default] + candidates(N, K, rows, dev)):
                try:
                    got = int4_gemv_triton(x, *first, None, cfg).float()
                    err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                    if err > 1e-2:
                        raise RuntimeError(f"off by {err:.2g} of the reference")
                    times[cfg] = graph_us([lambda w=w, c=cfg: int4_gemv_triton(x, *w, None, c) for w in ws])
                except Exception as e:  # a config this GPU or Triton cannot run: the others remain
                    log.warning("int4 GEMV config %s for %s at %d rows skipped: %s", cfg, name, rows, e)
            if not times:
                raise RuntimeError(f"no int4 GEMV config runs for {name} at {rows} rows")
            best = min(times, key=times.get)
            configs[rows] = best
            report.setdefault(name, {})[rows] = (
                round(times.get(default, float("nan")), 1),
                round(times[best], 1),
                best,
            )
    torch.cuda.empty_cache()
    return report


def quantize_int4(
    w: torch.Tensor, group_size: int | None, symmetric: bool = True
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
