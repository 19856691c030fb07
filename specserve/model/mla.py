"""Multi-head latent attention (DeepSeek-V3, Kimi-K2), weight-absorbed, over a latent KV cache.

Per token and layer the cache holds one "head": the normalised kv_lora_rank latent c and the
rotated shared key k_rot (qk_rope_head_dim), and no values. kv_b_proj would expand c into each
head's key (W_UK) and value (W_UV); instead every forward absorbs them:
q_nope . (W_UK c) = (W_UK^T q_nope) . c, and softmax(..) (W_UV c) = W_UV (softmax(..) c), so
attention runs over the latent itself with queries [W_UK^T q_nope, q_rot] and the latent as the
value, and W_UV maps its output to the heads' values.

Under tensor parallelism the heads are split across ranks (q_b_proj / q_proj and kv_b_proj by
head, o_proj by input); the latent projection and the latent cache are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import tp_rank, tp_size
from specserve.kernels.latent_attention import (
    head_product,
    latent_attention_ok,
    latent_attention_triton,
    rope_store_latent_ok,
    rope_store_latent_triton,
)
from specserve.model.layers import (
    ColumnParallelLinear,
    ForwardContext,
    HotPathModule,
    KVCacheAttention,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    _divide,
)

# The reference normalises the q and kv latents with this epsilon whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class LatentAttention(KVCacheAttention):
    """Attention of H absorbed query heads over a one-head latent cache (latent + rope dims), whose
    first `latent_dim` dims also serve as the values: the module keeps no V cache (v_dim 0)."""

    def __init__(self, num_heads: int, latent_dim: int, rope_dim: int, scale: float):
        super().__init__(num_heads, 1, latent_dim + rope_dim)
        self.v_dim = 0
        self.latent_dim = latent_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, latent: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [B, T, H, latent + rope] (absorbed, rotated), latent [B, T, 1, latent + rope] -> [B, T, H * latent]."""
        ctx.store(self.k_cache, latent)
        return self.attend(q, ctx)

    def attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`forward` once the tokens' latents are in the cache."""
        if ctx.key_lo is None and latent_attention_ok(q, self.k_cache, ctx.write_idx, self.latent_dim):  # decode...
            B, T = q.shape[:2]
            out = latent_attention_triton(
                q,
                self.k_cache,
                self.latent_dim,
                ctx.row_start,
                ctx.write_idx,
                ctx.cache_length(self.k_cache) - 1,
                self.scale,
                tree_base=ctx.tree_base,
                tree_anc=ctx.tree_anc,
                block_table=ctx.block_table,
                block_size=ctx.block_size,
            )
            return out.view(B, T, -1)
        keys = ctx.cached(self.k_cache)
        return self._sdpa(q, keys, keys[..., : self.latent_dim], ctx)


KV_A = "kv_a_proj_with_mqa"  # the checkpoint's key/value down-projection (latent + rope rows)


def _rows_permuted(loader, rows: torch.Tensor, name: str, only_shard: str | None = None):
    """A weight loader that stores the checkpoint tensor `name`'s rows in the order `rows` (of shard
    `only_shard` alone where given)."""

    def load(param, loaded, shard=None):
        if only_shard is None or shard == only_shard:
            if loaded.shape[0] != rows.numel():
                raise ValueError(f"{name}: expected {rows.numel()} rows, checkpoint has shape {tuple(loaded.shape)}")
            loaded = loaded.index_select(0, rows.to(loaded.device))
        loader(param, loaded, shard)

    return load


class MLASelfAttention(HotPathModule):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        m = cfg.mla
        H, hidden = _divide(cfg.num_heads, tp_size(), "num_attention_heads"), cfg.hidden_size
        self.heads, self.nope, self.rope_dim, self.latent, self.v_dim = (
            H,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        )
        qk = self.nope + self.rope_dim
        # Both down-projections of x (q_a_proj's, with a query latent, and kv_a_proj_with_mqa's) are one
        # replicated product, [q_lora_rank + latent + rope, hidden]: one launch and one read of x.
        self.q_lora = m.q_lora_rank or 0
        if m.q_lora_rank is None:
            self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(hidden, [cfg.num_heads * qk])
            q_out = self.q_proj
        else:
            self.q_proj = None
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [cfg.num_heads * qk])
            q_out = self.q_b_proj
        self.latent_proj = ReplicatedLinear(
            hidden,
            self.q_lora + self.latent + self.rope_dim,
            bias=cfg.o_bias,
            parts={"q_a_proj": self.q_lora, KV_A: self.latent + self.rope_dim},
        )
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        # kv_b_proj as [H, nope + v, latent]: W_UK = [:, :nope], W_UV = [:, nope:] (3-D, so the
        # linear tuning, which re-lays out 2-D weights, leaves it as it is).
        self.kv_b = nn.Parameter(torch.empty(H, self.nope + self.v_dim, self.latent))
        self.kv_b.weight_loader = self._load_kv_b
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, hidden, bias=cfg.o_bias)
        if m.rope_interleave:
            # Rope pairs are adjacent in the checkpoint ((x0, x1), (x2, x3)...); storing the rope rows
            # of q and k evens-then-odds makes them the rotate-half pairs (x_i, x_i+R/2) of the usual
            # rope, for q and k alike, so q.k is unchanged.
            R = self.rope_dim
            pairs = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
            q_rows = torch.cat([torch.arange(self.nope), self.nope + pairs])
            q_rows = (torch.arange(cfg.num_heads).unsqueeze(1) * qk + q_rows).flatten()
            kv_rows = torch.cat([torch.arange(self.latent), self.latent + pairs])
            q_name = "q_b_proj" if self.q_lora else "q_proj"
            q_out.weight.weight_loader = _rows_permuted(q_out.weight.weight_loader, q_rows, q_name)
            for p in self.latent_proj.parameters():
                p.weight_loader = _rows_permuted(p.weight_loader, kv_rows, KV_A, only_shard=KV_A)
        self.rope = rope
        self.attn = LatentAttention(H, self.latent, self.rope_dim, m.softmax_scale)

    def _load_kv_b(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        want = (self.heads * tp_size() * (self.nope + self.v_dim), self.latent)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expected shape {want}, checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.view(-1, *param.shape[1:]).narrow(0, tp_rank() * self.heads, self.heads))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        q_a, c, k_rot = self.latent_proj(x).split([self.q_lora, self.latent, self.rope_dim], dim=-1)
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(q_a))
        q_nope, q_rot = q.view(B, T, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c, k_rot = self.kv_a_layernorm(c), k_rot.unsqueeze(2)
        q_latent = head_product(q_nope, self.kv_b[:, : self.nope])  # W_UK^T q_nope a head
        cache = self.attn.k_cache
        if rope_store_latent_ok(q_rot, k_rot, cache, ctx.write_idx, ctx.positions, self.latent):
            # (one launch for both rotations, the query's concatenation and the cache write)
            q = rope_store_latent_triton(
                q_latent,
                q_rot,
                c,
                k_rot,
                self.rope.cos,
                self.rope.sin,
                ctx.positions,
                cache,
                ctx.row_start,
                ctx.write_idx,
                ctx.block_table,
                ctx.block_size,
            )
            out = self.attn.attend(q, ctx)
        else:
            q_rot = KVCacheAttention._rotate(q_rot, ctx, self.rope)
            latent = torch.cat([c.unsqueeze(2), KVCacheAttention._rotate(k_rot, ctx, self.rope)], dim=-1)
            out = self.attn(torch.cat([q_latent, q_rot], dim=-1), latent, ctx)
        v = torch.einsum("bthl,hvl->bthv", out.view(B, T, self.heads, self.latent), self.kv_b[:, self.nope :])
        return self.o_proj(v.reshape(B, T, self.heads * self.v_dim))

    def hf_weights(self, prefix: str) -> dict[str, tuple[nn.Parameter, int | None]]:
        """Hugging Face tensor names under `prefix` (".../self_attn.") -> (parameter, shard)."""
        mods = {
            "q_proj": self.q_proj,
            "q_a_layernorm": self.q_a_layernorm,
            "q_b_proj": self.q_b_proj,
            "kv_a_layernorm": self.kv_a_layernorm,
            "o_proj": self.o_proj,
        }
        out: dict[str, tuple[nn.Parameter, int | str | None]] = {prefix + "kv_b_proj.weight": (self.kv_b, None)}
        for name in ("q_a_proj", KV_A) if self.q_lora else (KV_A,):
            out.update({f"{prefix}{name}.{p}": (t, name) for p, t in self.latent_proj.named_parameters()})
        for name, mod in mods.items():
            if mod is not None:
                out.update({f"{prefix}{name}.{p}": (t, None) for p, t in mod.named_parameters()})
        return out
