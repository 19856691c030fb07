"""Mixture-of-experts MLPs: a router picks top-k experts per token (DeepSeek-V3's grouped sigmoid
routing, or Qwen3-MoE's softmax), the chosen SwiGLU experts' outputs are summed with the routing
weights, and shared experts (DeepSeek-V3) see every token.

This is the PyTorch reference path, run on the CPU and, unfused, on the GPU: tokens are grouped by
expert and each expert that any token chose runs once over its tokens. Its loop depends on the
routing, so a forward through it cannot be captured in a CUDA graph.

Under tensor parallelism the routed experts are sharded over the ranks (expert parallelism: rank r
holds a contiguous 1/tp of them); every rank routes every token, runs the chosen experts it holds,
and the partial sums are all-reduced. Shared experts are split like a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import MoEConfig
from specserve.distributed.parallel_state import all_reduce, tp_rank, tp_size
from specserve.kernels.linear import linear
from specserve.kernels.norm import silu_mul
from specserve.model.layers import HotPathModule, SwiGLU


def route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 `noaux_tc` routing of router logits [N, E]: sigmoid scores; the bias steers which
    experts are chosen but not their weights. Experts form n_group groups ranked by the sum of each
    group's best two biased scores; the top-k experts are picked within the best topk_group groups.
    Returns (weights [N, k], expert ids [N, k])."""
    scores = logits.sigmoid()
    choice = scores + bias
    if m.n_group > 1:
        N, per = scores.shape[0], m.num_experts // m.n_group
        strength = choice.view(N, m.n_group, per).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(strength, dtype=torch.bool)
        kept.scatter_(1, strength.topk(m.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(m.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, ids


def route_softmax(logits: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: the top-k of a float32 softmax over the experts, optionally renormalised."""
    weights, ids = logits.softmax(-1, dtype=torch.float32).topk(m.top_k, dim=-1)
    if m.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


# Checkpoint names of each expert's (gate, up, down) projections, by the MoE block's name.
EXPERT_TENSORS = {"mlp": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe": ("w1", "w3", "w2")}


def _expert_loader(first: int, width: int | None = None):
    """Loads one expert's tensor into a stacked [E_local, rows, cols] weight holding experts first..:
    shard (expert, part) puts it at rows part*width.. of that expert (gate then up in one [2I, H]
    block), shard `expert` whole; experts another rank holds are passed over."""
    def load(param: torch.Tensor, loaded: torch.Tensor, shard) -> None:
        expert, part = shard if isinstance(shard, tuple) else (shard, None)
        expert -= first
        if not 0 <= expert < param.shape[0]:
            return
        target = param.data[expert] if part is None else param.data[expert].narrow(0, part * width, width)
        if target.shape != loaded.shape:
            raise ValueError(f"expected shape {tuple(target.shape)} for expert {expert}, checkpoint has "
                             f"{tuple(loaded.shape)}")
        target.copy_(loaded)

    return load


class MoE(HotPathModule):
    """Router, routed experts (stacked: gate/up [E, 2I, H], down [E, H, I]) and shared experts."""

    def __init__(self, hidden: int, m: MoEConfig):
        super().__init__()
        self.m = m
        E, inter = m.num_experts, m.intermediate_size
        local = E // tp_size()  # (CausalLM refuses experts that do not divide evenly)
        self.first = tp_rank() * local
        # DeepSeek-V3 routes in float32 whatever the model's dtype (its reference keeps the router
        # and the bias in float32); Qwen3-MoE routes in the model's dtype.
        router_dtype = torch.float32 if m.scoring == "sigmoid" else None
        self.gate = nn.Parameter(torch.empty(E, hidden, dtype=router_dtype))
        self.score_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32)) if m.scoring == "sigmoid" else None
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w13.weight_loader = _expert_loader(self.first, inter)
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
        self.w2.weight_loader = _expert_loader(self.first)
        self.shared = SwiGLU(hidden, m.shared_intermediate_size) if m.shared_intermediate_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) for tokens x [N, hidden]."""
        logits = linear(x.to(self.gate.dtype), self.gate)
        if self.score_bias is not None:
            return route_grouped_sigmoid(logits, self.score_bias, self.m)
        return route_softmax(logits, self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        # Tokens sorted by expert: each chosen expert held here runs once over the tokens that chose it.
        for e in ids.unique().tolist():
            if not 0 <= e - self.first < self.w13.shape[0]:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = linear(silu_mul(linear(x[tok], self.w13[e - self.first])), self.w2[e - self.first])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        out = all_reduce(out)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    def hf_weights(self, prefix: str) -> dict[str, tuple[nn.Parameter, object]]:
        """Hugging Face tensor names under `prefix` (".../mlp." or, Mixtral, ".../block_sparse_moe.") ->
        (parameter, shard)."""
        out: dict[str, tuple[nn.Parameter, object]] = {prefix + "gate.weight": (self.gate, None)}
        if self.score_bias is not None:
            out[prefix + "gate.e_score_correction_bias"] = (self.score_bias, None)
        gate, up, down = EXPERT_TENSORS[self.m.hf_block]
        for e in range(self.m.num_experts):
            p = f"{prefix}experts.{e}."
            out[p + gate + ".weight"] = (self.w13, (e, 0))
            out[p + up + ".weight"] = (self.w13, (e, 1))
            out[p + down + ".weight"] = (self.w2, e)
        if self.shared is not None:
            out.update(self.shared.hf_weights(prefix + "shared_experts."))
        return out

