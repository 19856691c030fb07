"""The EAGLE-3 drafter: one Llama decoder layer whose attention reads the
concatenation [input_layernorm(embed(token)), hidden_norm(h)] (2H wide).

h is fc(target features) on the first draft step of a position (the target's
low/mid/high hidden states, 3H) and the drafter's own pre-norm output on later
steps. Logits cover the draft vocabulary; `d2t` maps a draft id to a target id
(target = draft + d2t[draft]).

The drafter is replicated on every tensor-parallel rank: it is one layer, so
sharding it would add two all-reduces per draft step for little memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import DraftConfig
from specserve.kernels.cpu_linear import column_major_copy
from specserve.kernels.linear import linear
from specserve.kernels.norm import silu_mul
from specserve.model.layers import (
    ForwardContext,
    HotPathModule,
    KVCacheAttention,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
)


class DraftAttention(HotPathModule):
    def __init__(self, cfg: DraftConfig, rope: RotaryEmbedding):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = ReplicatedLinear(2 * cfg.hidden_size, q_size)
        self.k_proj = ReplicatedLinear(2 * cfg.hidden_size, kv_size)
        self.v_proj = ReplicatedLinear(2 * cfg.hidden_size, kv_size)
        self.o_proj = ReplicatedLinear(q_size, cfg.hidden_size)
        self.rope = rope
        self.attn = KVCacheAttention(self.heads, self.kv_heads, self.head_dim)
        self.qkv_weight: torch.Tensor | None = None  # see Eagle3Drafter.fuse_projections

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv_weight is not None:
            heads = linear(x, self.qkv_weight).view(B, T, -1, self.head_dim)
            if not heads.is_cuda:
                return self.o_proj(self.attn.forward_packed(heads, ctx, self.rope))
            q, k, v = heads.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
            return self.o_proj(self.attn(q, k, v, ctx, self.rope))
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx, self.rope))

    def write_kv(self, x: torch.Tensor, ctx: ForwardContext) -> None:
        """`forward`'s cache writes alone (the KV it writes, nothing attended, nothing returned)."""
        B, T, _ = x.shape
        w = (
            self.qkv_weight
            if self.qkv_weight is not None
            else torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        )
        self.attn.write_kv(linear(x, w).view(B, T, -1, self.head_dim), ctx, self.rope)


class DraftMLP(HotPathModule):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden, intermediate)
        self.up_proj = ReplicatedLinear(hidden, intermediate)
        self.down_proj = ReplicatedLinear(intermediate, hidden)
        self.gate_up_weight: torch.Tensor | None = None  # see Eagle3Drafter.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return self.down_proj(silu_mul(linear(x, self.gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftMidLayer(HotPathModule):
    def __init__(self, cfg: DraftConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.post_attention_layernorm(self.self_attn(self._attention_input(embeds, hidden), ctx), hidden)
        return h + self.mlp(x)

    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DraftConfig, max_positions: int, has_embedding: bool):
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Without its own embedding the drafter reads the target's (set by the loader).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embedding else None
        self.target_embed: nn.Module | None = None
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = DraftMidLayer(cfg, self.rope)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def attention_modules(self) -> list[KVCacheAttention]:
        return [self.midlayer.self_attn.attn]

    def fuse_projections(self, column_major: bool = False) -> None:
        """For inference: q|k|v and gate|up each as one stacked weight, so a draft step runs one
        product where it ran three or two (on the GPU also one launch each, and silu*up in one
        kernel). The separate weights become views of the stacked ones (no second copy); training
        keeps using the separate modules. `column_major`: the stacked weights stored that way
        (see kernels.cpu_linear.column_major_copy)."""
        a, mlp = self.midlayer.self_attn, self.midlayer.mlp
        for owner, name, parts in (
            (a, "qkv_weight", (a.q_proj, a.k_proj, a.v_proj)),
            (mlp, "gate_up_weight", (mlp.gate_proj, mlp.up_proj)),
        ):
            stacked = torch.cat([m.weight.data for m in parts])
            if column_major:
                stacked = column_major_copy(stacked)
            for m, view in zip(parts, stacked.split([m.weight.shape[0] for m in parts])):
                m.weight.data = view
            setattr(owner, name, stacked)

    def product_weights(self) -> list[torch.Tensor]:
        """The weights a forward multiplies by (after `fuse_projections`, the stacked ones)."""
        a, mlp = self.midlayer.self_attn, self.midlayer.mlp
        attn = [a.qkv_weight] if a.qkv_weight is not None else [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        ffn = [mlp.gate_up_weight] if mlp.gate_up_weight is not None else [mlp.gate_proj.weight, mlp.up_proj.weight]
        return [self.fc.weight, *attn, a.o_proj.weight, *ffn, mlp.down_proj.weight, self.lm_head.weight]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self.target_embed)(ids)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """ids [B, T] (the token after each feature's position), hidden [B, T, 3H]
        target features or [B, T, H] own outputs. Returns the pre-norm output
        [B, T, H] that the next draft step feeds back."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        return self.midlayer(self.embed(ids).to(hidden.dtype), hidden, ctx)

    def write_kv(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> None:
        """The KV `forward` writes for entries (ids [B, T], target features [B, T, 3H]) and nothing more: what a
        prompt's prefill or a catch-up needs of the drafter (their outputs feed nothing), without the
        attention, output projection and MLP of its layer."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        m = self.midlayer
        m.self_attn.write_kv(m._attention_input(self.embed(ids).to(hidden.dtype), hidden), ctx)

    def logits(self, out: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Draft-vocabulary logits (float32, or the model's dtype for kernels that upcast as they read)."""
        logits = self.lm_head(self.norm(out))
        return logits.float() if upcast else logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def hf_weight_map(self, prefix: str = "") -> dict[str, tuple[nn.Parameter | torch.Tensor, int | None]]:
        m = self.midlayer
        names = {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": m.input_layernorm.weight,
            "midlayer.hidden_norm.weight": m.hidden_norm.weight,
            "midlayer.post_attention_layernorm.weight": m.post_attention_layernorm.weight,
            "midlayer.self_attn.q_proj.weight": m.self_attn.q_proj.weight,
            "midlayer.self_attn.k_proj.weight": m.self_attn.k_proj.weight,
            "midlayer.self_attn.v_proj.weight": m.self_attn.v_proj.weight,
            "midlayer.self_attn.o_proj.weight": m.self_attn.o_proj.weight,
            "midlayer.mlp.gate_proj.weight": m.mlp.gate_proj.weight,
            "midlayer.mlp.up_proj.weight": m.mlp.up_proj.weight,
            "midlayer.mlp.down_proj.weight": m.mlp.down_proj.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
            "d2t": self.d2t,
            "t2d": self.t2d,
        }
        if self.fc.bias is not None:
            names["fc.bias"] = self.fc.bias
        if self.embed_tokens is not None:
            names["embed_tokens.weight"] = self.embed_tokens.weight
        return {prefix + k: (v, None) for k, v in names.items()}
