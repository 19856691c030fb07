"""DeepSeek-V3's multi-token-prediction (MTP, "NextN") layer as a drafter
(`--speculative-method mtp`).

The checkpoint stores it after the decoder's layers (`num_nextn_predict_layers: 1`:
`model.layers.{L}`): `enorm` and `hnorm` (RMSNorms), `eh_proj` [H, 2H], a full decoder block
(latent attention and MoE, named as the decoder's) and `shared_head.norm`. From the token at
position p + 1 and the hidden state at p it predicts the token at p + 2:

    h' = block(eh_proj([enorm(embed(token)), hnorm(h)]))      logits = head(shared_head.norm(h'))

h is the target's final normed hidden state on the first draft step of a position, and the layer's
own output h' on later ones: one layer drafts K tokens recursively, as SGLang and vLLM run it.
The embedding and output head are the target's (the checkpoint's `embed_tokens` and
`shared_head.head` copies of them are not read). Its latent KV lives in the paged cache beside
the target's, like an EAGLE-3 drafter's; the engine drives both through the same interface
(forward, write_kv, logits, to_target_ids), and it shards under tensor parallelism as the
target's layers do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.config import ConfigError, ModelConfig, checkpoint_files
from specserve.model.layers import (
    ForwardContext,
    KVCacheAttention,
    ReplicatedLinear,
    RMSNorm,
)

SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's own tensors, copied into the layer


class MTPDrafter(nn.Module):
    def __init__(self, cfg: ModelConfig, target):
        from specserve.model.transformer import DecoderLayer

        super().__init__()
        self.index = cfg.num_layers  # the first MTP layer's number in the checkpoint
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * H, H)
        self.block = DecoderLayer(cfg, target.rope, self.index)
        self.shared_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long))  # its vocabulary is the target's
        self._target = (target,)  # (a tuple: not registered as a submodule)

    @property
    def graph_safe(self) -> bool:
        return getattr(self.block.mlp, "graph_safe", True)

    def attention_modules(self) -> list[KVCacheAttention]:
        return [self.block.self_attn.attn]

    def fuse_projections(self, column_major: bool = False) -> None:
        """(The block's products are stacked at load, as the target's.)"""

    def product_weights(self) -> list[torch.Tensor]:
        return [p for p in self.parameters() if p.dim() == 2]

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """ids [B, T] (the token after each hidden state's position), hidden [B, T, H]: the target's
        normed output or this layer's own. Returns the layer's output [B, T, H], fed back on later steps."""
        target = self._target[0]
        x = self.eh_proj(torch.cat([self.enorm(target.embed_tokens(ids).to(hidden.dtype)), self.hnorm(hidden)], -1))
        out, residual, _ = self.block(x, None, ctx)
        return out + residual

    def write_kv(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> None:
        """The KV `forward` writes for these entries (a prompt's prefill, a catch-up)."""
        self.forward(ids, hidden, ctx)

    def logits(self, out: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self._target[0].logits(self.shared_norm(out), upcast=upcast)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def hf_weight_map(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        p = f"model.layers.{self.index}."
        return {
            **self.block.hf_weights(p),
            p + "enorm.weight": (self.enorm.weight, None),
            p + "hnorm.weight": (self.hnorm.weight, None),
            p + "eh_proj.weight": (self.eh_proj.weight, None),
            p + "shared_head.norm.weight": (self.shared_norm.weight, None),
        }


def has_mtp_layer(cfg: ModelConfig) -> bool:
    return cfg.mtp_layers > 0


def load_mtp(model_dir: str | Path, target, device: torch.device, dtype: torch.dtype, allow_pickle: bool = False):
    """The target checkpoint's first MTP layer as a drafter for `target` (already loaded)."""
    from specserve.model.loader import _build_on, _fill, iter_tensors

    cfg = target.cfg
    if not has_mtp_layer(cfg):
        raise ConfigError(
            f"{model_dir}: --speculative-method mtp needs a checkpoint with a multi-token-prediction "
            f"layer (num_nextn_predict_layers >= 1 in config.json, as DeepSeek-V3 / R1 ship); "
            f"{cfg.architecture} here has none: use eagle3 (--draft), ngram or suffix"
        )
    prefix = f"model.layers.{cfg.num_layers}."

    def text(name: str) -> str:  # the text model's name (a multimodal wrapper's prefix removed)
        return name[len(cfg.tensor_prefix) :] if cfg.tensor_prefix and name.startswith(cfg.tensor_prefix) else name

    def keep(name: str) -> bool:  # the MTP layer's own tensors
        return text(name).startswith(prefix) and text(name)[len(prefix) :] not in SHARED

    with _build_on(device, dtype):
        mtp = MTPDrafter(cfg, target)
    _fill(
        mtp,
        mtp.hf_weight_map(),
        iter_tensors(checkpoint_files(Path(model_dir), allow_pickle), keep),
        f"{model_dir} (MTP layer {prefix[:-1]})",
        rename=text,
    )
    if hasattr(mtp.block.mlp, "weights_loaded"):
        mtp.block.mlp.weights_loaded()
    return mtp.eval().requires_grad_(False)
