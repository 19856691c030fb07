"""int4 weights in compressed-tensors' `pack-quantized` layout: packing, unpacking, dequantizing.

A weight [..., N, K] is stored as int32 words [..., N, K/8]: input columns 8j..8j+7 of a row in
word j, column 8j+i in bits 4i..4i+3, each value v in [-8, 7] stored as v + 8. Scales are
[..., N, G] (G groups of K/G columns; G = 1 per channel); asymmetric zero points are int values
[..., N, G], which checkpoints pack the same way but along the output dimension (`dim=-2`).
The weight is (v - zero) * scale.

These are plain functions over any leading dimensions, so dense linears and stacked MoE experts
[E, N, K/8] share them; `int4_linear` is the CPU reference product a GPU kernel replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
