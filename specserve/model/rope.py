"""Rotary-embedding frequencies and YaRN's attention factor, from a config's rope parameters."""

from __future__ import annotations

import math
from typing import Any

import torch

from specserve.config.mla import yarn_mscale


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None):
    """Inverse frequencies for rotary embeddings, with Llama-3 / linear scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, factor, scaling)
    # llama3: low frequencies are divided by `factor`, high ones kept, a smooth blend between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv, head_dim: int, theta: float, factor: float, scaling: dict[str, Any]):
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are divided
    by `factor`, those turning more than beta_fast times are kept, with a linear ramp between."""
    old_ctx = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (inv / factor) * (1 - keep) + inv * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN applies to cos and sin (so to q.k twice): attention_factor if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) with both set, else mscale(factor)."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor, 1.0)
