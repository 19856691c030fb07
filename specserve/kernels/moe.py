"""Fused routed experts: every (token, chosen expert) pair through its expert's SwiGLU in two
grouped GEMMs, with fixed shapes and no host synchronisation, so an MoE forward can be captured
in a CUDA graph.

- ``align_pairs``  sorts the N x top_k pairs by expert into blocks of BLOCK_M rows, each expert's
                   run padded to whole blocks, and names each block's expert. The buffers are
                   sized for the worst case (every held expert chosen), so their shapes depend
                   only on N, top_k, the expert count and BLOCK_M: blocks no pair fills are
                   marked with the expert count and their programs exit at once.
- ``fused_experts`` gate_up with silu(gate) * up fused (one kernel), then down times the routing
                   weight (a second), then the top_k rows of each token summed.

Roundings follow the reference (`model.moe.MoE`): each product is accumulated in float32 and
rounded to the model's dtype where `linear` rounds, silu and the routing weight are applied as
the reference applies them, and only the final sum of a token's top_k contributions is taken in
float32 and rounded once (the reference adds them one expert at a time in the model's dtype).
float32 products use IEEE float32 on the tensor cores, not TF32, so float32 runs match the
reference to the order of a float32 sum.

int4 experts (W4A16) run the same kernels with their weight tiles read as packed words and
dequantized in registers (`_weight_tile`): a quarter of a 16-bit weight's bytes cross memory,
which is what a decode step's expert GEMMs wait on, and the tile the tensor cores multiply is
the reference's dequantized weight exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Protocol, Union

import torch

from specserve.kernels import common
from specserve.kernels.common import pdl_args, triton
from specserve.kernels.int4 import PACK

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, z_ptr, e, rows, nmask, k0, ROWS: tl.constexpr, K: tl.constexpr,
                     GROUPS: tl.constexpr, INT4: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """Expert e's weight [ROWS, K] at rows `rows` [BLOCK_N] and columns k0..k0+BLOCK_K, as a
        [BLOCK_K, BLOCK_N] tile (zero outside the weight). Float weights load as they are; int4
        ones load BLOCK_K/8 words per row and are unpacked and dequantized in registers to
        float32, (v - zero) * scale: exact there, so the caller's one rounding into the
        activations' dtype gives what dequantizing in that dtype does."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & nmask[None, :]
        if INT4:
            WORDS: tl.constexpr = K // 8
            e_rows = e * ROWS + rows  # (int64: the expert's offset)
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(w_ptr + e_rows[None, :] * WORDS + offs_w[:, None],
                            mask=(offs_w < WORDS)[:, None] & nmask[None, :], other=0)
            # Column 8j+i of a row is bits 4i..4i+3 of its word j, stored as value + 8
            # (arithmetic shifts: the mask drops the sign).
            nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            v = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32) - 8.0
            group = e_rows[None, :] * GROUPS + offs_k[:, None] // (K // GROUPS)
            if HAS_ZERO:
                v = v - tl.load(z_ptr + group, mask=mask, other=0).to(tl.float32)
            return v * tl.load(s_ptr + group, mask=mask, other=0.0).to(tl.float32)
        else:
            return tl.load(w_ptr + (e * ROWS + rows[None, :]) * K + offs_k[:, None], mask=mask, other=0.0)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, h_ptr, pairs_ptr, block_expert_ptr, P, E,
                        H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, GROUPS: tl.constexpr,
                        INT4: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        # Program (block, n): BLOCK_M pairs of one expert times BLOCK_N gate and up features each.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
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
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=valid[:, None] & (offs_k < H)[None, :],
                        other=0.0)
            wg = _weight_tile(w_ptr, s_ptr, z_ptr, e, offs_n, nmask, k0, 2 * I, H, GROUPS, INT4, HAS_ZERO,
                              BLOCK_N, BLOCK_K).to(dt)
            wu = _weight_tile(w_ptr, s_ptr, z_ptr, e, I + offs_n, nmask, k0, 2 * I, H, GROUPS, INT4, HAS_ZERO,
                              BLOCK_N, BLOCK_K).to(dt)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(h_ptr + pair[:, None] * I + offs_n[None, :], (s * u).to(dt), mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, s_ptr, z_ptr, rw_ptr, out_ptr, pairs_ptr, block_expert_ptr, P, E,
                     H: tl.constexpr, I: tl.constexpr, GROUPS: tl.constexpr, INT4: tl.constexpr,
                     HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        # Program (block, n): BLOCK_M pairs of one expert times BLOCK_N output features, each row
        # scaled by its routing weight.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
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
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + pair[:, None] * I + offs_k[None, :], mask=valid[:, None] & (offs_k < I)[None, :],
                        other=0.0)
            b = _weight_tile(w_ptr, s_ptr, z_ptr, e, offs_n, nmask, k0, H, I, GROUPS, INT4, HAS_ZERO,
                             BLOCK_N, BLOCK_K).to(dt)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        y = acc.to(dt).to(tl.float32)
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair[:, None] * H + offs_n[None, :], (y * rw[:, None]).to(dt),
                 mask=valid[:, None] & nmask[None, :])


MIN_DIM = 16  # tl.dot's smallest tile: experts narrower than this take the reference path
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Int4Stack(Protocol):
    """Stacked int4 experts as `model.moe.Int4Experts` holds them (`kernels.int4`'s layout):
    packed words [E, rows, K/8] int32, scales [E, rows, G] and, when asymmetric, zero points
    unpacked to int8 [E, rows, G]; group g covers input columns g*K/G..(g+1)*K/G-1."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


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
        return dict(w_ptr=w, s_ptr=w, z_ptr=w, GROUPS=1, INT4=False, HAS_ZERO=False)
    scale = w.scale.contiguous()
    zero = w.zero.contiguous() if w.zero is not None else scale
    return dict(w_ptr=w.packed.contiguous(), s_ptr=scale, z_ptr=zero, GROUPS=scale.shape[-1], INT4=True,
                HAS_ZERO=w.zero is not None)


def fused_experts_supported(w13: Experts, w2: Experts) -> bool:
    """Whether `fused_experts` serves these stacked experts (gate/up [E, 2I, H], down [E, H, I]),
    with Triton and the fused kernels on: float CUDA tensors, or int4 experts on CUDA with
    float scales whose groups split the input features evenly (their words of eight always
    do). A model whose MoE layers all pass can be captured in a CUDA graph."""
    if not (common.FUSED and triton is not None) or min(expert_shape(w2)[1:]) < MIN_DIM:
        return False
    if isinstance(w13, torch.Tensor):
        return w13.is_cuda and w13.dtype in FLOATS
    return all(w.packed.is_cuda and w.scale.dtype in FLOATS and expert_shape(w)[2] % w.scale.shape[-1] == 0
               for w in (w13, w2))


@dataclass(frozen=True)
class Tiles:
    """Both kernels' launch shape: weight tile BLOCK_K x BLOCK_N, warps and pipeline stages."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = Tiles()


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
    blocks = min(P, experts) + -(-P // block_m)  # each chosen expert wastes under one block
    local = ids.reshape(-1).long() - first
    local = torch.where((local >= 0) & (local < experts), local, experts)  # others' experts: one more bucket
    counts = torch.zeros(experts + 1, dtype=torch.long, device=ids.device).scatter_add_(0, local,
                                                                                       torch.ones_like(local))
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


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: Experts,
                  w2: Experts, first: int = 0, tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """sum over k of weights[:, k] * expert_{ids[:, k]}(x) for x [N, H]; w13 [E, 2I, H] (gate
    rows then up rows) and w2 [E, H, I], float or int4 (`Int4Stack`), hold experts
    first..first+E-1; pairs routed elsewhere contribute zero (the other ranks add them). int4
    weights are dequantized tile by tile into x's dtype, as the reference dequantizes them.
    Returns [N, H] in x's dtype. `tiles`: the launch shape (benchmarks sweep it)."""
    N, H = x.shape
    E, _, I = expert_shape(w2)
    top_k = ids.shape[1]
    P = N * top_k
    block_m = block_m_for(P, E)
    pairs, block_expert = align_pairs(ids, E, first, block_m)
    blocks = block_expert.numel()
    x = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32 is ignored for 16-bit inputs)
    block_n, block_k, launch = tiles.block_n, tiles.block_k, dict(num_warps=tiles.num_warps,
                                                                   num_stages=tiles.num_stages)
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(I, block_n))](
        x, h_ptr=h, pairs_ptr=pairs, block_expert_ptr=block_expert, P=P, E=E, H=H, I=I, TOP_K=top_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, **launch, **_weight_args(w13),
        **pdl_args(x))
    out = torch.zeros(P, H, dtype=x.dtype, device=x.device)  # rows of pairs held elsewhere stay zero
    _down_kernel[(blocks, triton.cdiv(H, block_n))](
        h, rw_ptr=weights.contiguous(), out_ptr=out, pairs_ptr=pairs, block_expert_ptr=block_expert, P=P, E=E, H=H,
        I=I, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, **launch,
        **_weight_args(w2), **pdl_args(x))
    return out.view(N, top_k, H).sum(1, dtype=torch.float32).to(x.dtype)
