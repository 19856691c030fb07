"""DeepSeek-V3's multi-head latent attention, as its config.json describes it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config.files import need_key


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3): keys and values are expanded per head from one
    normalised latent of kv_lora_rank dims per token, plus qk_rope_head_dims of a shared rotated key."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope pairs are adjacent dims (x0, x1), (x2, x3)... in the checkpoint
    softmax_scale: float  # qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_from_hf(cfg: dict[str, Any], scaling: dict[str, Any] | None, path: Path) -> MLAConfig:
    need = lambda k: need_key(cfg, k, path)  # noqa: E731
    nope, rope = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(need("v_head_dim")),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
    )
