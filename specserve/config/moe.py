"""Routed experts (DeepSeek-V3, Qwen3-MoE, Mixtral) as their config.json describes them, and what of a
quantized MoE checkpoint may be int4."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config.files import need_key
from specserve.config.mla import MLAConfig
from specserve.errors import ConfigError
from specserve.model.quant import QuantConfig


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts replacing the MLP of the layers not in `dense_layers`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    scoring: str  # "sigmoid" (DeepSeek-V3, grouped top-k with a selection bias) | "softmax" (Qwen3-MoE, Mixtral)
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    shared_intermediate_size: int  # 0: no shared experts
    dense_layers: tuple[int, ...]
    hf_block: str = "mlp"  # the checkpoint's name of the layer's MoE block: "mlp" | "block_sparse_moe" (Mixtral)


def moe_from_hf(cfg: dict[str, Any], arch: str, layers: int, path: Path) -> MoEConfig:
    need = lambda k: need_key(cfg, k, path)  # noqa: E731
    shared, n_group, topk_group, scaling_factor, dense, block = 0, 1, 1, 1.0, (), "mlp"
    if arch == "DeepseekV3ForCausalLM":
        scoring = cfg.get("scoring_func", "sigmoid")
        method = cfg.get("topk_method", "noaux_tc")
        if (scoring, method) != ("sigmoid", "noaux_tc"):
            raise ConfigError(
                f"{path}: DeepseekV3 routing scoring_func {scoring!r} with topk_method {method!r} is "
                "not supported; supported: scoring_func 'sigmoid' with topk_method 'noaux_tc'"
            )
        experts, inter = int(need("n_routed_experts")), int(need("moe_intermediate_size"))
        dense = tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), layers)))
        shared = int(cfg.get("n_shared_experts") or 0) * inter
        n_group = int(cfg.get("n_group") or 1)
        topk_group = int(cfg.get("topk_group") or n_group)
        scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
        norm = bool(cfg.get("norm_topk_prob", True))
    elif arch == "MixtralForCausalLM":  # every layer routed; the chosen weights are always renormalised
        scoring, norm, block = "softmax", True, "block_sparse_moe"
        experts, inter = int(need("num_local_experts")), int(need("intermediate_size"))
    else:  # Qwen3MoeForCausalLM
        scoring, norm = "softmax", bool(cfg.get("norm_topk_prob", False))
        experts, inter = int(cfg.get("num_experts") or need("num_local_experts")), int(need("moe_intermediate_size"))
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    top_k = int(need("num_experts_per_tok"))
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(
            f"{path}: n_routed_experts {experts} must split into n_group {n_group} groups, of which "
            f"topk_group {topk_group} are kept (1 <= topk_group <= n_group)"
        )
    if not 1 <= top_k <= experts // n_group * topk_group:
        raise ConfigError(
            f"{path}: num_experts_per_tok {top_k} must be in 1..{experts // n_group * topk_group} "
            f"(the experts of the topk_group {topk_group} kept groups)"
        )
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=inter,
        scoring=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling_factor,
        n_group=n_group,
        topk_group=topk_group,
        shared_intermediate_size=shared,
        dense_layers=dense,
        hf_block=block,
    )


def check_quantized_moe(
    quant: QuantConfig, mla: MLAConfig | None, moe: MoEConfig | None, layers: int, path: Path
) -> None:
    """What of a quantized DeepSeek-V3 / Qwen3-MoE target may be int4, checked before any weight
    is read: routed experts (alike within a layer), shared experts, dense MLPs and Qwen3-MoE's
    attention may; latent-attention projections and routers load as float only."""
    mla_names = (("q_proj",) if mla is None or mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")) + (
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    )
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for name in (prefix + "self_attn." + n for n in mla_names) if mla is not None else ():
            if (fmt := quant.linear(name)) is not None:
                raise ConfigError(
                    f"{path}: {name} is {fmt.describe()} in quantization_config; latent-attention "
                    "projections load as float only (int4 checkpoints such as Kimi-K2.5 keep them "
                    "bf16, listing 're:.*self_attn.*' in ignore)"
                )
        if moe is None or i in moe.dense_layers:
            continue
        quant.experts(prefix + "mlp.", moe.num_experts)
        # Qwen3-MoE's router is an nn.Linear, so a `Linear` target covers it unless ignored;
        # DeepSeek-V3's is a plain weight no quantizer touches.
        if moe.scoring == "softmax" and (fmt := quant.linear(prefix + "mlp.gate")) is not None:
            raise ConfigError(
                f"{path}: the router {prefix}mlp.gate is {fmt.describe()} in quantization_config; "
                "routers load as float only (quantizing tools list them in ignore: 're:.*mlp.gate$')"
            )
