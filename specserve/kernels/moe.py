"""Fused routed experts: every (token, chosen expert) pair through its expert's SwiGLU in two
grouped GEMMs, with fixed shapes and no host synchronisation, so an MoE forward can be captured
in a CUDA graph.

- ``align_pairs``  sorts the N x top_k pairs by expert into blocks of BLOCK_M rows, each expert's
                   run padded to whole blocks, and names each block's expert. The buffers are
                   sized for the worst case (every held expert chosen), so their shapes depend
                   only on N, top_k, the expert count and BLOCK_M: blocks no pair fills are
                   marked with the expert count and their programs exit at once. Torch ops;
                   decode and verify sizes take `kernels.moe_routing.fused_align`, one program.
- ``fused_experts`` gate_up with silu(gate) * up fused (one kernel), then down times the routing
                   weight (a second), then the top_k rows of each token summed (a third).

Roundings follow the reference (`model.moe.MoE`): each product is accumulated in float32 and
rounded to the model's dtype where `linear` rounds, silu and the routing weight are applied as
the reference applies them, and only the final sum of a token's top_k contributions is taken in
float32 and rounded once (the reference adds them one expert at a time in the model's dtype).
float32 products use IEEE float32 on the tensor cores, not TF32, so float32 runs match the
reference to the order of a float32 sum.

int4 experts (W4A16) run the same kernels with their weight tiles read as packed words and
dequantized in registers (`_weight_tile`): a quarter of a 16-bit weight's bytes cross memory,
which is what a decode step's expert GEMMs wait on, and the tile the tensor cores multiply is
the reference's dequantized weight exactly. Their launch shape follows the pair count
(`default_tiles`); `Tiles` overrides it. Where experts see a few pairs each (decode, short
verifies) and NVRTC is at hand, bf16 int4 experts take two CUDA kernels instead (`csrc/int4_moe.cu`,
`int4_cuda_experts`): Triton's dequantization costs more instructions a weight than streaming
a quarter of the bytes leaves time for. Those kernels read the words in a tiled order made once
at load (`kernels.int4.tile_experts`: each warp's share one contiguous run), which the Triton
kernels read too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Union

import torch

from specserve import envs
from specserve.kernels import common
from specserve.kernels.common import pdl_args, triton
from specserve.kernels.int4 import PACK
from specserve.kernels.moe_routing import FLOATS, aligned_blocks, fused_align, fused_routing_fits

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous
    from specserve.kernels.int4 import int4_tile

    @triton.jit
    def _weight_tile(
        w_ptr,
        s_ptr,
        z_ptr,
        e,
        rows,
        nmask,
        k0,
        cols,
        ROWS: tl.constexpr,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        INT4: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        TILED: tl.constexpr,
        HALF: tl.constexpr,
        dt: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Expert e's weight [ROWS, K] at rows `rows` [BLOCK_N] and columns `cols` (k0..k0+BLOCK_K)
        as a [BLOCK_K, BLOCK_N] tile in dt, zero outside the weight. Float weights load and
        convert; int4 ones load packed words and dequantize them in dt (`int4_tile`), under TILED
        from `kernels.int4.tile_experts`' order (HALF: a gate/up stack's gate rows, interleaved by
        eights in its tiles; 0 for down)."""
        if INT4:
            if TILED and HALF > 0:  # gate row i: tile i // 8, row i % 8; up row HALF + i: row 8 + i % 8
                r = rows % HALF
                rows = (r // 8) * 16 + r % 8 + (rows >= HALF).to(r.dtype) * 8
            return int4_tile(
                w_ptr, s_ptr, z_ptr, e * ROWS + rows, nmask, k0, cols, K, GROUPS, HAS_ZERO, dt, BLOCK_N, BLOCK_K, TILED
            )  # (int64 rows: the expert's offset)
        else:
            mask = (cols < K)[:, None] & nmask[None, :]
            return tl.load(w_ptr + (e * ROWS + rows[None, :]) * K + cols[:, None], mask=mask, other=0.0).to(dt)

    @triton.jit
    def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
        """A float32 accumulator for BLOCK_M pairs x BLOCK_N features, transposed under SWAP."""
        if SWAP:
            return tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            return tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    @triton.jit
    def _mma(a, w, acc, SWAP: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N]; under SWAP acc is transposed and
        the weight tile is the left operand (acc + w^T a^T): a decode's few pairs are too few rows
        for Hopper's warp-group MMA, a weight tile's BLOCK_N are not, and a left operand may come
        straight from the registers it was dequantized in."""
        if SWAP:
            return tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=PRECISION)
        else:
            return tl.dot(a, w, acc, input_precision=PRECISION)

    @triton.jit
    def _unswap(acc, SWAP: tl.constexpr):
        """An accumulator `_zeros` made, as [BLOCK_M, BLOCK_N]."""
        if SWAP:
            return tl.trans(acc)
        else:
            return acc

    @triton.jit
    def _swiglu(acc_g, acc_u, dt: tl.constexpr):
        """silu(gate) * up in dt from float32 sums, rounded where the reference rounds."""
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (s * u).to(dt)

    # (P and E are arguments Triton would specialize by divisibility by 16: a prefill chunk of an odd token
    # count would compile a second variant mid-run, stalling that step.)
    @triton.jit(do_not_specialize=["P", "E"])
    def _gate_up_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        h_ptr,
        g_ptr,
        pairs_ptr,
        block_expert_ptr,
        P,
        E,
        H: tl.constexpr,
        I: tl.constexpr,
        TOP_K: tl.constexpr,
        GROUPS: tl.constexpr,
        INT4: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        TILED: tl.constexpr,
        SWAP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_SPAN: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (block, n, s): BLOCK_M pairs of one expert times BLOCK_N gate and up features
        # each, over input columns s*K_SPAN..(s+1)*K_SPAN. With the whole input (K_SPAN >= H) it
        # stores silu(gate) * up; with a slice it adds its float32 sums into g_ptr [P, 2I]
        # (gate columns, then up), and `_swiglu_kernel` finishes once every slice is in.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        k_lo = tl.program_id(2) * K_SPAN
        wait_for_previous(PDL)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= E:  # a block past the last pair
            return
        e = e.to(tl.int64)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < P  # padding rows hold P
        tok = (pair // TOP_K).to(tl.int64)
        pair = pair.to(tl.int64)  # (pair * hidden outgrows int32 on long prefill chunks)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < I
        dt = h_ptr.dtype.element_ty
        acc_g = _zeros(BLOCK_M, BLOCK_N, SWAP)
        acc_u = _zeros(BLOCK_M, BLOCK_N, SWAP)
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPAN, H), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=valid[:, None] & (cols < H)[None, :], other=0.0)
            wg = _weight_tile(
                w_ptr,
                s_ptr,
                z_ptr,
                e,
                offs_n,
                nmask,
                k0,
                cols,
                2 * I,
                H,
                GROUPS,
                INT4,
                HAS_ZERO,
                TILED,
                I,
                dt,
                BLOCK_N,
                BLOCK_K,
            )
            wu = _weight_tile(
                w_ptr,
                s_ptr,
                z_ptr,
                e,
                I + offs_n,
                nmask,
                k0,
                cols,
                2 * I,
                H,
                GROUPS,
                INT4,
                HAS_ZERO,
                TILED,
                I,
                dt,
                BLOCK_N,
                BLOCK_K,
            )
            acc_g = _mma(a, wg, acc_g, SWAP, PRECISION)
            acc_u = _mma(a, wu, acc_u, SWAP, PRECISION)
        acc_g = _unswap(acc_g, SWAP)
        acc_u = _unswap(acc_u, SWAP)
        out_mask = valid[:, None] & nmask[None, :]
        if K_SPAN >= H:
            tl.store(h_ptr + pair[:, None] * I + offs_n[None, :], _swiglu(acc_g, acc_u, dt), mask=out_mask)
        else:
            g_at = g_ptr + pair[:, None] * (2 * I) + offs_n[None, :]
            tl.atomic_add(g_at, acc_g, mask=out_mask, sem="relaxed")
            tl.atomic_add(g_at + I, acc_u, mask=out_mask, sem="relaxed")

    @triton.jit
    def _swiglu_kernel(g_ptr, h_ptr, I: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # Program (pair, n): the split-K gate_up's finish for BLOCK features of one pair.
        pair = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        wait_for_previous(PDL)
        g = tl.load(g_ptr + pair * (2 * I) + offs, mask=mask, other=0.0)
        u = tl.load(g_ptr + pair * (2 * I) + I + offs, mask=mask, other=0.0)
        tl.store(h_ptr + pair * I + offs, _swiglu(g, u, h_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["P", "E"])
    def _down_kernel(
        h_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        rw_ptr,
        out_ptr,
        pairs_ptr,
        block_expert_ptr,
        P,
        E,
        H: tl.constexpr,
        I: tl.constexpr,
        GROUPS: tl.constexpr,
        INT4: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        TILED: tl.constexpr,
        SWAP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_SPAN: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (block, n, s): BLOCK_M pairs of one expert times BLOCK_N output features over
        # input columns s*K_SPAN..(s+1)*K_SPAN. With the whole input (K_SPAN >= I) each row is
        # scaled by its routing weight and stored; with a slice the float32 sums are added into
        # out_ptr (float32 [P, H]) and `fused_experts` applies the routing weight after.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        k_lo = tl.program_id(2) * K_SPAN
        wait_for_previous(PDL)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= E:
            return
        e = e.to(tl.int64)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < P
        pair = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < H
        dt = h_ptr.dtype.element_ty
        acc = _zeros(BLOCK_M, BLOCK_N, SWAP)
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPAN, I), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + pair[:, None] * I + cols[None, :], mask=valid[:, None] & (cols < I)[None, :], other=0.0)
            b = _weight_tile(
                w_ptr,
                s_ptr,
                z_ptr,
                e,
                offs_n,
                nmask,
                k0,
                cols,
                H,
                I,
                GROUPS,
                INT4,
                HAS_ZERO,
                TILED,
                0,
                dt,
                BLOCK_N,
                BLOCK_K,
            )
            acc = _mma(a, b, acc, SWAP, PRECISION)
        acc = _unswap(acc, SWAP)
        out_at = out_ptr + pair[:, None] * H + offs_n[None, :]
        out_mask = valid[:, None] & nmask[None, :]
        if K_SPAN >= I:
            y = acc.to(dt).to(tl.float32)
            rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            tl.store(out_at, (y * rw[:, None]).to(dt), mask=out_mask)
        else:
            tl.atomic_add(out_at, acc, mask=out_mask, sem="relaxed")

    @triton.jit
    def _combine_kernel(
        y_ptr,
        rw_ptr,
        ids_ptr,
        add_ptr,
        out_ptr,
        first,
        E,
        H: tl.constexpr,
        TOP_K: tl.constexpr,
        SPLIT: tl.constexpr,
        ADD: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (token, n): BLOCK output features of one token, its TOP_K rows of y [P, H]
        # summed in float32 and rounded once. Rows of pairs held elsewhere are never written
        # (nor zeroed): they are skipped. Under SPLIT y holds the split down kernel's float32
        # sums, each rounded to the dtype and times its routing weight as the unsplit kernel
        # stores it (launched without FMA contraction, so float32's product rounds too). Under
        # ADD the token's row of add_ptr [N, H] is added to the rounded sum, rounded again.
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        wait_for_previous(PDL)
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(TOP_K):
            pair = n * TOP_K + r
            e = tl.load(ids_ptr + pair) - first
            held = (e >= 0) & (e < E)
            # (where, not `mask & held`: Triton's interpreter refuses a mask of a tensor and a scalar)
            y = tl.load(y_ptr + pair * H + offs, mask=tl.where(held, mask, False), other=0.0).to(tl.float32)
            if SPLIT:
                y = (y.to(dt).to(tl.float32) * tl.load(rw_ptr + pair).to(tl.float32)).to(dt).to(tl.float32)
            acc += y
        res = acc.to(dt)
        if ADD:
            res = (res.to(tl.float32) + tl.load(add_ptr + n * H + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(out_ptr + n * H + offs, res, mask=mask)


COMBINE_BLOCK = 1024  # output features a `_combine_kernel` program sums
MIN_DIM = 16  # tl.dot's smallest tile: experts narrower than this take the reference path


class Int4Stack(Protocol):
    """Stacked int4 experts as `model.moe.Int4Experts` holds them (`kernels.int4`'s layout):
    packed words [E, rows, K/8] int32, scales [E, rows, G] and, when asymmetric, zero points
    unpacked to int8 [E, rows, G]; group g covers input columns g*K/G..(g+1)*K/G-1. Words and
    scales are row-major, or where `tiled` is true in `kernels.int4.tile_experts`' order (gate/up
    stacks interleaved by eights), the only one the CUDA expert kernels read."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    tiled: bool


Experts = Union[torch.Tensor, Int4Stack]  # float [E, rows, K] or int4


def expert_shape(w: Experts) -> tuple[int, int, int]:
    """(experts, rows, input features) of stacked float or int4 experts."""
    if isinstance(w, torch.Tensor):
        return tuple(w.shape)
    E, rows, words = w.packed.shape
    return E, rows, words * PACK


def _weight_args(w: Experts) -> dict:
    """The kernels' weight arguments: float experts pass their tensor (the scale and zero
    pointers are never read), int4 ones their words, scales and zero points."""
    if isinstance(w, torch.Tensor):
        w = w.contiguous()
        return dict(w_ptr=w, s_ptr=w, z_ptr=w, GROUPS=1, INT4=False, HAS_ZERO=False, TILED=False)
    scale = w.scale.contiguous()
    zero = w.zero.contiguous() if w.zero is not None else scale  # (the scales again where there are none)
    return dict(
        w_ptr=w.packed.contiguous(),
        s_ptr=scale,
        z_ptr=zero,
        GROUPS=scale.shape[-1],
        INT4=True,
        HAS_ZERO=w.zero is not None,
        TILED=_tiled(w),
    )


def fused_experts_supported(w13: Experts, w2: Experts) -> bool:
    """Whether `fused_experts` serves these stacked experts (gate/up [E, 2I, H], down [E, H, I]),
    with Triton and the fused kernels on: float CUDA tensors, or int4 experts on CUDA with
    float scales whose groups split the input features evenly (their words of eight always
    do). A model whose MoE layers all pass can be captured in a CUDA graph."""
    if not (common.FUSED and triton is not None) or min(expert_shape(w2)[1:]) < MIN_DIM:
        return False
    if isinstance(w13, torch.Tensor):
        return w13.is_cuda and w13.dtype in FLOATS
    return all(
        w.packed.is_cuda and w.scale.dtype in FLOATS and expert_shape(w)[2] % w.scale.shape[-1] == 0 for w in (w13, w2)
    )


@dataclass(frozen=True)
class Tiles:
    """Both kernels' launch shape: weight tile BLOCK_K x BLOCK_N, warps and pipeline stages;
    split_k, the number of slices the input columns are cut into, each a program of its own,
    whose float32 sums are added atomically (more programs for a decode's few blocks, at the
    price of a float32 buffer and a finishing pass); and swap, the weight tile as the left
    operand of each product (`_mma`)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < MIN_DIM or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= {MIN_DIM}, got {v}")
        if self.split_k < 1:
            raise ValueError(f"Tiles.split_k must be >= 1 (1: no split), got {self.split_k}")

    def k_span(self, K: int) -> int:
        """Input columns per program over K: whole BLOCK_K steps, split_k slices (fewer where
        K has fewer steps)."""
        steps = -(-K // self.block_k)
        return -(-steps // self.split_k) * self.block_k


FLOAT_TILES = Tiles()
# int4 experts by pair count, the fastest shapes of a Kimi-K2.5-width sweep (BENCHMARKS.md): a
# decode's few pairs (8 measured) fill too few blocks to occupy the GPU unless each program
# takes a quarter of the input columns; from 32 pairs on, wider tiles without a split win.
INT4_FEW_PAIRS = 16
INT4_FEW_TILES = Tiles(block_n=64, block_k=64, split_k=4, swap=True)
INT4_TILES = Tiles(block_n=128, block_k=64, swap=True)


def default_tiles(pairs: int, int4: bool) -> Tiles:
    """The launch shape `fused_experts` takes unless told: float experts one shape, int4 ones
    the fastest measured for this many (token, expert) pairs."""
    if not int4:
        return FLOAT_TILES
    return INT4_FEW_TILES if pairs <= INT4_FEW_PAIRS else INT4_TILES


def block_m_for(pairs: int, experts: int) -> int:
    """Rows per block: the tensor cores' smallest tile while experts see a few pairs each
    (decode, verify, short prefills), wider once each sees many."""
    per_expert = pairs / experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def align_pairs(ids: torch.Tensor, experts: int, first: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts the pairs of expert ids [N, top_k] (global ids; this rank holds experts
    first..first+experts-1) by expert into blocks of `block_m` rows. Returns (pairs
    [blocks * block_m] int32: pair index token * top_k + slot, N * top_k on padding rows;
    block_expert [blocks] int32: the local expert of each block, `experts` past the last). Pairs
    routed to experts another rank holds are left out. Torch ops only, none waiting on the GPU."""
    P = ids.numel()
    blocks = aligned_blocks(P, experts, block_m)
    local = ids.reshape(-1).long() - first
    local = torch.where((local >= 0) & (local < experts), local, experts)  # others' experts: one more bucket
    counts = torch.zeros(experts + 1, dtype=torch.long, device=ids.device).scatter_add_(
        0, local, torch.ones_like(local)
    )
    padded = (counts[:experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(local, stable=True)
    sorted_e = local[order]
    rank = torch.arange(P, device=ids.device) - (counts.cumsum(0) - counts)[sorted_e]
    held = sorted_e < experts
    starts = torch.cat([ends.new_zeros(1), ends])  # starts[e] for e < experts; starts[experts] unused
    dest = torch.where(held, starts[sorted_e] + rank, blocks * block_m)  # not held: a slot cut off below
    pairs = torch.full((blocks * block_m + 1,), P, dtype=torch.int32, device=ids.device)
    pairs.scatter_(0, dest, order.int())
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=ids.device) * block_m, right=True)
    return pairs[:-1], block_expert.int()


def _align(ids: torch.Tensor, experts: int, first: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` in one program (`fused_align`) where it fits, else in torch ops."""
    align = fused_align if fused_routing_fits(ids.shape[0], ids.shape[1], experts) else align_pairs
    return align(ids, experts, first, block_m)


def _combine(
    out: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    x: torch.Tensor,
    add: torch.Tensor | None,
    first: int,
    experts: int,
    split: bool,
) -> torch.Tensor:
    """Each token's top_k rows of `out` [P, H] summed (`_combine_kernel`; `split`: the rows are unweighted
    products the routing weight is applied to here), plus `add` where given: [N, H] in x's dtype."""
    N, H = x.shape
    y = torch.empty_like(x)
    _combine_kernel[(N, triton.cdiv(H, COMBINE_BLOCK))](
        out,
        weights.contiguous(),
        ids.contiguous(),
        y if add is None else add.contiguous(),
        y,
        first,
        experts,
        H=H,
        TOP_K=ids.shape[1],
        SPLIT=split,
        ADD=add is not None,
        BLOCK=COMBINE_BLOCK,
        enable_fp_fusion=False,
        **pdl_args(x),
    )
    return y


log = logging.getLogger("specserve.kernels")

CUDA_WARPS = 4  # row tiles (warps a slice of the input features) a block of the CUDA int4 kernels
CUDA_SPLIT = 2  # slices of the input features a block shares out: twice the warps for a decode's few rows
CUDA_PAIRS = 8  # pairs a block serves: the m16n8k16 product's eight columns
CUDA_MAX_PAIRS = 64  # up to this many pairs (more per expert: Triton's wider tiles read each expert once)


@lru_cache(maxsize=None)
def _cuda_kernels(group: int) -> dict | None:
    """The CUDA int4 expert kernels for scale groups of `group` input features, compiled once a process
    by NVRTC (through torch); None, with a warning, where they cannot be built (no NVRTC library, a
    driver too old for its PTX): the Triton kernels serve instead."""
    try:
        return compile_cuda_kernels(CUDA_WARPS, CUDA_SPLIT, group)
    except (RuntimeError, OSError) as e:
        log.warning(
            "the CUDA int4 expert kernels could not be built (%s); int4 experts take the Triton kernels "
            "(SPECSERVE_INT4_MOE_CUDA=0 skips this attempt)",
            e,
        )
        return None


def compile_cuda_kernels(warps: int, split: int, group: int, options: tuple[str, ...] = ()) -> dict:
    """`kernels/csrc/int4_moe.cu` compiled for blocks of `warps` row tiles x `split` slices of the input
    features and scale groups of `group` features (plus nvcc-style `options`)."""
    src = (Path(__file__).parent / "csrc" / "int4_moe.cu").read_text()
    opts = [f"-DWARPS={warps}", f"-DSPLIT={split}", f"-DGROUP={group}", *options]
    return {
        name: torch.cuda._compile_kernel(src, name, nvcc_options=opts) for name in ("int4_moe_gate_up", "int4_moe_down")
    }


def _group(w: Int4Stack) -> int:
    return expert_shape(w)[2] // w.scale.shape[-1]


def _tiled(w: Int4Stack) -> bool:
    return bool(getattr(w, "tiled", False))


def int4_cuda_layout_fits(w13: Experts, w2: Experts) -> bool:
    """Whether the CUDA expert kernels can serve these int4 experts once tiled (`kernels.int4.tile_experts`,
    which `model.moe.MoE.weights_loaded` applies where this holds): symmetric int4 experts with bf16
    scales on an Ampere-or-later GPU, features in whole 128-column chunks and scale groups of whole
    32-column runs, whole tiles of rows, and torch's NVRTC compiler (torch.cuda._compile_kernel) at hand
    (SPECSERVE_INT4_MOE_CUDA=0: never)."""
    if isinstance(w13, torch.Tensor) or isinstance(w2, torch.Tensor) or w13.zero is not None or w2.zero is not None:
        return False
    if not (
        envs.INT4_MOE_CUDA.get()
        and w13.packed.is_cuda
        and hasattr(torch.cuda, "_compile_kernel")
        and torch.cuda.get_device_capability(w13.packed.device) >= (8, 0)
    ):
        return False
    _, _, H = expert_shape(w13)
    _, _, I = expert_shape(w2)
    for w, K in ((w13, H), (w2, I)):
        group = _group(w)
        if w.scale.dtype != torch.bfloat16 or K % 128 or group % 32 or K % group:
            return False
    return (
        I % (8 * CUDA_WARPS) == 0
        and H % (16 * CUDA_WARPS) == 0
        and all(_cuda_kernels(_group(w)) is not None for w in (w13, w2))
    )


def int4_cuda_fits(x: torch.Tensor, w13: Experts, w2: Experts, pairs: int) -> bool:
    """Whether `int4_cuda_experts` serves these: tiled int4 experts (`int4_cuda_layout_fits` held when
    they were tiled), bf16 activations and at most CUDA_MAX_PAIRS pairs."""
    return (
        not isinstance(w13, torch.Tensor)
        and _tiled(w13)
        and _tiled(w2)
        and envs.INT4_MOE_CUDA.get()
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and pairs <= CUDA_MAX_PAIRS
    )


def int4_cuda_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: Int4Stack,
    w2: Int4Stack,
    first: int = 0,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_experts` for tiled experts within `int4_cuda_fits`: pairs in blocks of eight of one expert,
    gate/up with SwiGLU (one kernel) and down (another) on the tensor cores, then `_combine_kernel`."""
    N, H = x.shape
    E, _, I = expert_shape(w2)
    top_k = ids.shape[1]
    P = N * top_k
    pairs, block_expert = _align(ids, E, first, CUDA_PAIRS)
    blocks = block_expert.numel()
    x = x.contiguous()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    threads = (32 * CUDA_WARPS * CUDA_SPLIT, 1, 1)
    # (the kernels index rows of whole experts: a rank's slice of a stack is contiguous, a copy otherwise)
    _cuda_kernels(_group(w13))["int4_moe_gate_up"](
        grid=(blocks, I // (8 * CUDA_WARPS), 1),
        block=threads,
        args=[x, w13.packed.contiguous(), w13.scale.contiguous(), h, pairs, block_expert, P, E, H, I, top_k],
    )
    out = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _cuda_kernels(_group(w2))["int4_moe_down"](
        grid=(blocks, H // (16 * CUDA_WARPS), 1),
        block=threads,
        args=[h, w2.packed.contiguous(), w2.scale.contiguous(), out, pairs, block_expert, P, E, H, I],
    )
    return _combine(out, weights, ids, x, add, first, E, split=True)  # (down products stored unweighted)


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: Experts,
    w2: Experts,
    first: int = 0,
    tiles: Tiles | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over k of weights[:, k] * expert_{ids[:, k]}(x) for x [N, H]; w13 [E, 2I, H] (gate
    rows then up rows) and w2 [E, H, I], float or int4 (`Int4Stack`), hold experts
    first..first+E-1; pairs routed elsewhere contribute zero (the other ranks add them). int4
    weights are dequantized tile by tile into x's dtype, as the reference dequantizes them.
    Returns [N, H] in x's dtype, plus `add` [N, H] (in x's dtype; one rounding, as `+` rounds)
    where given. `tiles`: the launch shape (benchmarks sweep it; default `default_tiles`)."""
    N, H = x.shape
    E, _, I = expert_shape(w2)
    top_k = ids.shape[1]
    P = N * top_k
    int4 = not isinstance(w2, torch.Tensor)
    if int4 and tiles is None and int4_cuda_fits(x, w13, w2, P):
        return int4_cuda_experts(x, weights, ids, w13, w2, first, add)
    tiles = tiles or default_tiles(P, int4)
    block_m = block_m_for(P, E)
    pairs, block_expert = _align(ids, E, first, block_m)
    blocks = block_expert.numel()
    x = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32 is ignored for 16-bit inputs)
    block_n, block_k = tiles.block_n, tiles.block_k
    span_h, span_i = tiles.k_span(H), tiles.k_span(I)
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        SWAP=tiles.swap,
        **pdl_args(x),
    )
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    # Split slices add into float32 sums, which start at zero: gate_up's [P, 2I] and down's
    # [P, H], one buffer zeroed once. Unsplit rows are stored whole (rows of pairs held
    # elsewhere stay unwritten: `_combine_kernel` skips them).
    split_h, split_i = span_h < H, span_i < I
    sums = torch.zeros(P * (2 * I * split_h + H * split_i), dtype=torch.float32, device=x.device)
    g = sums[: P * 2 * I].view(P, 2 * I) if split_h else h
    _gate_up_kernel[(blocks, triton.cdiv(I, block_n), triton.cdiv(H, span_h))](
        x,
        h_ptr=h,
        g_ptr=g,
        pairs_ptr=pairs,
        block_expert_ptr=block_expert,
        P=P,
        E=E,
        H=H,
        I=I,
        TOP_K=top_k,
        K_SPAN=span_h,
        **consts,
        **_weight_args(w13),
    )
    if split_h:
        _swiglu_kernel[(P, triton.cdiv(I, 1024))](g, h, I=I, BLOCK=1024, **pdl_args(x))
    out = sums[-P * H :].view(P, H) if split_i else torch.empty(P, H, dtype=x.dtype, device=x.device)
    rw = weights.contiguous()
    _down_kernel[(blocks, triton.cdiv(H, block_n), triton.cdiv(I, span_i))](
        h,
        rw_ptr=rw,
        out_ptr=out,
        pairs_ptr=pairs,
        block_expert_ptr=block_expert,
        P=P,
        E=E,
        H=H,
        I=I,
        K_SPAN=span_i,
        **consts,
        **_weight_args(w2),
    )
    return _combine(out, rw, ids, x, add, first, E, split_i)
