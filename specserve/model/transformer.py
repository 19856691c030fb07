"""The target model: Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3 decoders in one implementation.

The dense three differ only in q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3)
and their configs' spelling, which `ModelConfig` normalizes. Qwen3-MoE is Qwen3 with
routed experts in place of most MLPs (`moe.MoE`), Mixtral is Llama with routed experts in
every layer; DeepSeek-V3 adds latent attention
(`mla.MLASelfAttention`) and shared experts.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ConfigError, ModelConfig
from specserve.distributed.parallel_state import tp_size
from specserve.kernels.cpu_linear import NATIVE
from specserve.kernels.cpu_native import MAX_ROWS, fused_ops
from specserve.model.int4_linear import column_linear, linear_tensors, row_linear
from specserve.model.layers import (
    ColumnParallelLinear,
    ForwardContext,
    HotPathModule,
    KVCacheAttention,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _divide,
)
from specserve.model.mla import MLASelfAttention
from specserve.model.mlp import SwiGLU
from specserve.model.moe import MoE

QKV = ("q_proj", "k_proj", "v_proj")  # the Hugging Face modules stacked into qkv_proj


class SelfAttention(HotPathModule):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, prefix: str):
        """`prefix`: the Hugging Face module name (`model.layers.0.self_attn.`)."""
        super().__init__()
        tp = tp_size()
        self.heads = _divide(cfg.num_heads, tp, "num_attention_heads")
        self.kv_heads = _divide(cfg.num_kv_heads, tp, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = column_linear(
            cfg.quant, [prefix + n for n in QKV], cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias
        )
        self.o_proj = row_linear(cfg.quant, prefix + "o_proj", q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope = rope
        self.attn = KVCacheAttention(self.heads, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        if not qkv.is_cuda and self.q_norm is None:
            return self.o_proj(self.attn.forward_packed(qkv.view(B, T, -1, self.head_dim), ctx, self.rope))
        q_len, kv_len = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_len, kv_len, kv_len], dim=-1)
        q = q.view(B, T, self.heads, self.head_dim)
        k = k.view(B, T, self.kv_heads, self.head_dim)
        v = v.view(B, T, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, ctx, self.rope))

    def hf_weights(self, prefix: str) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Hugging Face tensor names under `prefix` (".../self_attn.") -> (our tensor, shard)."""
        out = {
            **linear_tensors(self.qkv_proj, [prefix + n for n in QKV]),
            **linear_tensors(self.o_proj, [prefix + "o_proj"]),
        }
        if self.q_norm is not None:
            out[prefix + "q_norm.weight"] = (self.q_norm.weight, None)
            out[prefix + "k_norm.weight"] = (self.k_norm.weight, None)
        return out


class DecoderLayer(HotPathModule):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, index: int):
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mla is not None:
            self.self_attn = MLASelfAttention(cfg, rope)
        else:
            self.self_attn = SelfAttention(cfg, rope, prefix + "self_attn.")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and index not in cfg.moe.dense_layers:
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg.quant, prefix + "mlp.")
        else:
            self.mlp = SwiGLU(
                cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, quant=cfg.quant, prefix=prefix + "mlp."
            )
        # The products a CPU step may run in one native call (`_native_step`): a plain dense layer's, unsharded.
        attn, mlp = self.self_attn, self.mlp
        plain = (
            isinstance(attn, SelfAttention)
            and attn.q_norm is None
            and attn.head_dim % 16 == 0
            and isinstance(mlp, SwiGLU)
            and tp_size() == 1
        )  # (the native rope takes 16-wide heads)
        products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj) if plain else ()
        self.native_products = (
            products
            if products
            and all(type(m) in (ColumnParallelLinear, RowParallelLinear) and m.bias is None for m in products)
            else None
        )

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """h: the previous sub-layer's output (the embeddings for layer 0), residual: the stream
        it adds to (None for layer 0). Residual adds are fused into the norms that follow them.
        Returns (MLP output, residual, the residual stream entering this layer)."""
        if self.native_products is not None and not h.is_cuda:
            out = self._native_step(h, residual, ctx)
            if out is not None:
                return out
        if residual is None:
            stream, x = h, self.input_layernorm(h)
        else:
            x, stream = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, ctx), stream)
        return self.mlp(x), residual, stream

    def hf_weights(self, p: str) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Hugging Face tensor names under `p` ("model.layers.N.") -> (our tensor, shard)."""
        block = self.mlp.m.hf_block if isinstance(self.mlp, MoE) else "mlp"
        return {
            **self.self_attn.hf_weights(p + "self_attn."),
            **self.mlp.hf_weights(f"{p}{block}."),
            p + "input_layernorm.weight": (self.input_layernorm.weight, None),
            p + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None),
        }

    def _native_step(self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """`forward` in one native call (`cpu_native` dense_layer) for a float32 CPU step of at most
        MAX_ROWS rows (no tree) whose four products the start-up tuning gave the panel GEMV at this
        row count; None elsewhere. Between a small model's ops, Python costs more than the ops."""
        rows = h.numel() // h.shape[-1]
        if rows > MAX_ROWS or h.dtype != torch.float32 or ctx.tree_anc is not None or not h.is_contiguous():
            return None
        w = [m.weight for m in self.native_products]
        plans = [getattr(x, "cpu_plan", None) for x in w]
        native = fused_ops()
        if native is None or any(p is None or p.by_rows[rows] != NATIVE for p in plans):
            return None
        a = self.self_attn
        cos, sin = ctx.rope_tables(a.rope, h.dtype)
        blocks = ctx.row_table() if ctx.block_table is not None else None
        return tuple(
            native.dense_layer(
                h,
                residual,
                self.input_layernorm.weight,
                self.post_attention_layernorm.weight,
                self.input_layernorm.eps,
                plans[0].panels,
                w[0].shape[0],
                plans[1].panels,
                w[1].shape[0],
                plans[2].panels,
                w[2].shape[0],
                plans[3].panels,
                w[3].shape[0],
                a.heads,
                a.head_dim,
                cos,
                sin,
                a.attn.k_cache,
                a.attn.v_cache,
                blocks,
                ctx.row_start,
                ctx.write_idx,
                ctx.kv_len,
                a.attn.scale,
            )
        )


class CausalLM(nn.Module):
    """Decoder-only transformer. `forward` returns the final normed hidden
    states and, when `aux_layers` is set, the EAGLE-3 features: the residual
    stream entering each listed layer, concatenated to [B, T, 3H]."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        if cfg.moe is not None and cfg.moe.num_experts % tp_size():
            raise ConfigError(
                f"{cfg.architecture}: {cfg.moe.num_experts} routed experts do not shard evenly over "
                f"--tp {tp_size()} ranks"
            )
        self.cfg = cfg
        rope_dim = cfg.mla.qk_rope_head_dim if cfg.mla is not None else cfg.head_dim
        self.rope = RotaryEmbedding(rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else column_linear(cfg.quant, ["lm_head"], cfg.hidden_size, [cfg.vocab_size], gather_output=True)
        )  # vocab split, logits gathered
        self.aux_layers: tuple[int, ...] = ()

    @property
    def graph_safe(self) -> bool:
        """Whether a forward can be captured in a CUDA graph: not through the MoE reference path,
        whose expert loop depends on the routing (MoE layers capture where they run fused)."""
        return all(layer.mlp.graph_safe for layer in self.layers if isinstance(layer.mlp, MoE))

    def weights_loaded(self) -> None:
        """Called once every weight is in place: layers rewrite what they keep in a device order."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.weights_loaded()

    def attention_modules(self) -> list[KVCacheAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, ids: torch.Tensor, ctx: ForwardContext):
        h, residual = self.embed_tokens(ids), None
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h, residual, taps[i] = layer(h, residual, ctx)
        out, taps[len(self.layers)] = self.norm(h, residual)
        taps[len(self.layers) + 1] = out  # the normed output: what an MTP layer reads (aux_layers = (L + 1,))
        features = torch.cat([taps[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        return out, features

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Next-token logits (float32, or the model's dtype where only an argmax reads them)."""
        if self.lm_head is None:  # tied: reuse the (vocab-parallel) embedding matrix
            from specserve.distributed.parallel_state import all_gather_last_dim
            from specserve.kernels.linear import linear

            logits = all_gather_last_dim(linear(hidden, self.embed_tokens.weight))
        else:
            logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def hf_weight_map(self) -> dict[str, tuple[nn.Parameter, int | None]]:
        """Hugging Face tensor name -> (our parameter, shard id within a stacked weight)."""
        out: dict[str, tuple[nn.Parameter, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight, None)
        }
        out["model.norm.weight"] = (self.norm.weight, None)
        if self.lm_head is not None:
            out.update(linear_tensors(self.lm_head, ["lm_head"]))
        for i, layer in enumerate(self.layers):
            out.update(layer.hf_weights(f"model.layers.{i}."))
        return out
