"""Mixture-of-experts MLPs: a router picks top-k experts per token (DeepSeek-V3's grouped sigmoid
routing, or Qwen3-MoE's softmax), the chosen SwiGLU experts' outputs are summed with the routing
weights, and shared experts (DeepSeek-V3) see every token.

On the GPU the routed experts run fused (`kernels.moe.fused_experts`: pairs sorted by expert,
two grouped GEMMs), with fixed shapes and no host synchronisation, so a forward can be captured
in a CUDA graph; the routing is a Triton program at decode and verify sizes
(`kernels.moe_routing`) and torch ops beyond, neither waiting on the GPU. The CPU runs the
PyTorch reference, which is also the fused path's test oracle: tokens are grouped by expert and
each expert that any token chose runs once over its tokens. Its loop depends on the routing, so
it cannot be captured.

Under tensor parallelism the routed experts are sharded over the ranks (expert parallelism: rank r
holds a contiguous 1/tp of them); every rank routes every token, runs the chosen experts it holds,
and the partial sums are all-reduced. Shared experts are split like a dense MLP.

Routed experts are float parameters or, in compressed-tensors int4 checkpoints, `Int4Experts`:
each expert's packed words and scales stacked as they are stored, which the fused kernels
dequantize tile by tile and the reference path per chosen expert.
`expert_weights` / `experts_weights` give either as float weights.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ConfigError, MoEConfig
from specserve.distributed.parallel_state import all_reduce, tp_rank, tp_size
from specserve.kernels.common import use_triton
from specserve.kernels.int4 import PACK, dequantize_int4, tile_experts, untile_experts
from specserve.kernels.linear import linear
from specserve.kernels.moe import fused_experts, fused_experts_supported, int4_cuda_layout_fits
from specserve.kernels.moe_routing import FLOATS, fused_route, fused_routing_fits, router_logits
from specserve.kernels.norm import silu_mul
from specserve.model.int4_linear import check_float, check_int32, unpack_zero_points
from specserve.model.layers import HotPathModule
from specserve.model.mlp import SwiGLU
from specserve.model.quant import Int4Weights, QuantConfig


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
            raise ValueError(
                f"expected shape {tuple(target.shape)} for expert {expert}, checkpoint has {tuple(loaded.shape)}"
            )
        target.copy_(loaded)

    return load


class Int4Experts(nn.Module):
    """One projection of this rank's routed experts in int4, stacked: packed words [E_local,
    rows, K/8], scales [E_local, rows, G] and, when asymmetric, zero points unpacked to int8
    [E_local, rows, G]. Each expert stacks `parts` Hugging Face modules of `rows_per_part` rows
    (gate then up: 2 of I; down: 1 of H) over `in_features` input columns. The fused kernels
    read these three tensors as they are (`kernels.moe.Int4Stack`): row-major as stored, or once
    `tile` ran (`tiled`), in the order the CUDA expert kernels stream."""

    def __init__(self, local: int, first: int, rows_per_part: int, parts: int, in_features: int, fmt: Int4Weights):
        super().__init__()
        group = fmt.group_size or in_features
        if in_features % group or in_features % PACK:
            raise ConfigError(
                f"int4 experts with {in_features} input features do not split into whole groups of "
                f"{group} and words of {PACK}"
            )
        rows, groups = rows_per_part * parts, fmt.groups(in_features)
        self.interleave = rows_per_part if parts == 2 else 0  # (gate/up rows interleave in tiles)
        self.tiled = False
        place = _expert_loader(first, rows_per_part)
        self.register_buffer("packed", torch.empty(local, rows, in_features // PACK, dtype=torch.int32))
        self.packed.weight_loader = _checked(check_int32, place)
        self.register_buffer("scale", torch.empty(local, rows, groups))
        self.scale.weight_loader = _checked(check_float, place)
        if fmt.symmetric:
            self.zero = None
        else:
            self.register_buffer("zero", torch.empty(local, rows, groups, dtype=torch.int8))
            self.zero.weight_loader = lambda p, t, shard: place(p, unpack_zero_points(t, rows_per_part, groups), shard)
        # The [out, in] each module says it unpacks to, checked against the config and kept as
        # stored (like Int4Linear's), so loaded and checkpoint bytes agree.
        want = [rows_per_part, in_features]
        self.register_buffer("shape", torch.zeros(local, 2 * parts, dtype=torch.int64), persistent=False)
        self.shape.weight_loader = _checked(lambda t: _check_shape(t, want), _expert_loader(first, 2))

    def hf_tensors(self, name: str, shard) -> dict[str, tuple[torch.Tensor, object]]:
        """Checkpoint tensor names of Hugging Face module `name` (one expert's projection) -> (our tensor, shard)."""
        out = {
            f"{name}.weight_packed": (self.packed, shard),
            f"{name}.weight_scale": (self.scale, shard),
            f"{name}.weight_shape": (self.shape, shard),
        }
        if self.zero is not None:
            out[f"{name}.weight_zero_point"] = (self.zero, shard)
        return out

    def tile(self) -> None:
        """Words and scales rewritten in place in `kernels.int4.tile_experts`' order (after loading:
        the loaders place rows as stored), an expert at a time: a model that fills its GPU has room
        for one expert's copy, not a layer's."""
        if not self.tiled:
            for e in range(self.packed.shape[0]):
                packed, scale = tile_experts(self.packed[e], self.scale[e], self.interleave)
                self.packed[e].copy_(packed)
                self.scale[e].copy_(scale)
            self.tiled = True

    def weight(self, expert: int | slice, dtype: torch.dtype) -> torch.Tensor:
        """Local expert(s) `expert` dequantized to float weights [(E,) rows, in_features]."""
        zero = self.zero[expert] if self.zero is not None else None
        packed, scale = self.packed[expert], self.scale[expert]
        if self.tiled:
            packed, scale = untile_experts(packed, scale, self.interleave)
        return dequantize_int4(packed, scale, zero, dtype)


def _checked(check, place):
    """A weight loader that runs `check` (it raises) on the checkpoint's tensor, then `place`s it."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard) -> None:
        check(loaded)
        place(param, loaded, shard)

    return load


def _check_shape(loaded: torch.Tensor, want: list[int]) -> None:
    if loaded.tolist() != want:
        raise ValueError(f"weight_shape is {loaded.tolist()}, the config implies {want}")


class MoE(HotPathModule):
    """Router, routed experts (stacked: gate/up [E, 2I, H], down [E, H, I], float or int4) and
    shared experts. `quant` and `prefix` (the Hugging Face module name, `...mlp.`) make int4 the
    experts the checkpoint stores as int4."""

    def __init__(self, hidden: int, m: MoEConfig, quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        self.m = m
        E, inter = m.num_experts, m.intermediate_size
        self.local = local = E // tp_size()  # (CausalLM refuses experts that do not divide evenly)
        self.first = tp_rank() * local
        # DeepSeek-V3 routes in float32 whatever the model's dtype (its reference keeps the router
        # and the bias in float32); Qwen3-MoE routes in the model's dtype.
        router_dtype = torch.float32 if m.scoring == "sigmoid" else None
        self.gate = nn.Parameter(torch.empty(E, hidden, dtype=router_dtype))
        self.score_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32)) if m.scoring == "sigmoid" else None
        self.int4 = quant.experts(prefix, E) if quant is not None else None
        if self.int4 is None:
            self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
            self.w13.weight_loader = _expert_loader(self.first, inter)
            self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
            self.w2.weight_loader = _expert_loader(self.first)
        else:
            self.w13 = Int4Experts(local, self.first, inter, 2, hidden, self.int4)
            self.w2 = Int4Experts(local, self.first, hidden, 1, inter, self.int4)
        self.shared = (
            SwiGLU(hidden, m.shared_intermediate_size, quant=quant, prefix=prefix + "shared_experts.")
            if m.shared_intermediate_size
            else None
        )

    def expert_weights(self, expert: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `expert`'s (gate/up [2I, H], down [H, I]) as float weights: float experts'
        parameters themselves, or int4 experts dequantized into `dtype` (default the model's)."""
        return self._weights(expert, dtype)

    def experts_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every local expert's (gate/up [E_local, 2I, H], down [E_local, H, I]) as float weights,
        as `expert_weights`; int4 experts are dequantized all at once, a full float copy."""
        return self._weights(slice(None), dtype)

    def _weights(self, expert: int | slice, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.int4 is None:
            return self.w13[expert], self.w2[expert]
        dtype = dtype or self.w13.scale.dtype
        return self.w13.weight(expert, dtype), self.w2.weight(expert, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) for tokens x [N, hidden]. On CUDA a decode's or
        verify's few tokens route in one Triton program (`kernels.moe_routing.fused_route`),
        more tokens (and the CPU) through the torch functions."""
        logits = router_logits(x, self.gate)
        if (
            use_triton(logits, self.gate, self.score_bias)
            and logits.dtype in FLOATS
            and fused_routing_fits(logits.shape[0], self.m.top_k, self.m.num_experts)
        ):
            return fused_route(logits, self.m, self.score_bias)
        if self.score_bias is not None:
            return route_grouped_sigmoid(logits, self.score_bias, self.m)
        return route_softmax(logits, self.m)

    def weights_loaded(self) -> None:
        """Int4 experts the CUDA expert kernels can serve take the tiled order those kernels read."""
        if self.int4 is not None and int4_cuda_layout_fits(self.w13, self.w2):
            self.w13.tile()
            self.w2.tile()

    @property
    def graph_safe(self) -> bool:
        """Whether `forward` takes the fused path (float or int4 experts), which a CUDA graph can capture."""
        return fused_experts_supported(self.w13, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        trained = (self.w13, self.w2) if self.int4 is None else ()  # (int4 experts are buffers: never trained)
        shared = None
        if self.graph_safe and use_triton(x, *trained):
            # On one rank the shared experts' output joins the routed sum in its last kernel.
            shared = self.shared(x) if self.shared is not None and tp_size() == 1 else None
            out = fused_experts(x, weights, ids, self.w13, self.w2, self.first, add=shared)
        else:
            out = self.experts_ref(x, weights, ids)
        out = all_reduce(out)
        if self.shared is not None and shared is None:
            out = out + self.shared(x)
        return out.view(shape)

    def experts_ref(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts held here for tokens x [N, hidden] routed (weights, ids) [N, k]."""
        out = torch.zeros_like(x)
        # Tokens sorted by expert: each chosen expert held here runs once over the tokens that chose it.
        for e in ids.unique().tolist():
            if not 0 <= e - self.first < self.local:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            w13, w2 = self.expert_weights(e - self.first, x.dtype)
            y = linear(silu_mul(linear(x[tok], w13)), w2)
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out

    def hf_weights(self, prefix: str) -> dict[str, tuple[nn.Parameter, object]]:
        """Hugging Face tensor names under `prefix` (".../mlp." or, Mixtral, ".../block_sparse_moe.") ->
        (parameter, shard)."""
        out: dict[str, tuple[nn.Parameter, object]] = {prefix + "gate.weight": (self.gate, None)}
        if self.score_bias is not None:
            out[prefix + "gate.e_score_correction_bias"] = (self.score_bias, None)
        gate, up, down = EXPERT_TENSORS[self.m.hf_block]
        for e in range(self.m.num_experts):
            p = f"{prefix}experts.{e}."
            if self.int4 is None:
                out[p + gate + ".weight"] = (self.w13, (e, 0))
                out[p + up + ".weight"] = (self.w13, (e, 1))
                out[p + down + ".weight"] = (self.w2, e)
            else:
                out.update(self.w13.hf_tensors(p + gate, (e, 0)))
                out.update(self.w13.hf_tensors(p + up, (e, 1)))
                out.update(self.w2.hf_tensors(p + down, e))
        if self.shared is not None:
            out.update(self.shared.hf_weights(prefix + "shared_experts."))
        return out
