"""Typed, validated configuration: model architecture (read from Hugging Face
`config.json`), EAGLE-3 drafter, and engine settings.

Everything that reads a checkpoint's config goes through here, so `specserve
check` validates exactly what the engine will later use, without loading a
single weight.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve.model.quant import QuantConfig, parse_quantization_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM")
MOE_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Multimodal wrappers whose `text_config` holds a supported text model: architecture -> the text
# model's tensor prefix in the checkpoint and the prefixes of the tensors it does not use (vision).
WRAPPER_ARCHITECTURES = {
    "KimiK25ForConditionalGeneration": ("language_model.", ("vision_tower.", "mm_projector.")),
    "Kimi_K25ForConditionalGeneration": ("language_model.", ("vision_tower.", "mm_projector.")),
}
WRAPPER_MODEL_TYPES = {"kimi_k25": "KimiK25ForConditionalGeneration"}
# Model types that are DeepSeek-V3 text models under another name.
DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"
# Default --max-model-len when none is given: min(target's max_position_embeddings, this).
DEFAULT_MAX_MODEL_LEN = {"cuda": 4096, "cpu": 1024}
# Tree drafts: each query carries its ancestors as bits of one int64 (bit 63 unused: the sign).
MAX_TREE_NODES = 63
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # prompt lengths (padded up) prefilled by a CUDA graph
# Fresh prompts a prefill graph takes at once, packed one after another (their lengths summed as one prompt's):
# an eager forward of a few short prompts costs the host ~2 ms a layer, a graph replay the GPU's time only.
PREFILL_GRAPH_PROMPTS = 16


def prefill_stage_len(longest: int) -> int:
    """Slots of the prefill graphs' one-row staging cache for prompts of up to `longest` tokens:
    those plus a scratch slot for the padding, rounded up to 16."""
    return -(-(longest + 1) // 16) * 16


class ConfigError(ValueError):
    """A checkpoint or setting that specserve cannot use; the message says what to do."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: expected a Hugging Face model directory with config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _rope_from_hf(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """Return (theta, scaling) from either the transformers 4.x keys
    (`rope_theta`, `rope_scaling`) or the 5.x `rope_parameters` dict."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        # 5.x may nest per layer type ({"full_attention": {...}}); we only have full attention.
        if "rope_type" not in params and "rope_theta" not in params and len(params) == 1:
            params = next(iter(params.values()))
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{path}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _check_quantized_moe(quant: QuantConfig, mla: MLAConfig | None, moe: MoEConfig | None, layers: int,
                         path: Path) -> None:
    """What of a quantized DeepSeek-V3 / Qwen3-MoE target may be int4, checked before any weight
    is read: routed experts (alike within a layer), shared experts, dense MLPs and Qwen3-MoE's
    attention may; latent-attention projections and routers load as float only."""
    mla_names = (("q_proj",) if mla is None or mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")) + (
        "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for name in (prefix + "self_attn." + n for n in mla_names) if mla is not None else ():
            if (fmt := quant.linear(name)) is not None:
                raise ConfigError(f"{path}: {name} is {fmt.describe()} in quantization_config; latent-attention "
                                  "projections load as float only (int4 checkpoints such as Kimi-K2.5 keep them "
                                  "bf16, listing 're:.*self_attn.*' in ignore)")
        if moe is None or i in moe.dense_layers:
            continue
        quant.experts(prefix + "mlp.", moe.num_experts)
        # Qwen3-MoE's router is an nn.Linear, so a `Linear` target covers it unless ignored;
        # DeepSeek-V3's is a plain weight no quantizer touches.
        if moe.scoring == "softmax" and (fmt := quant.linear(prefix + "mlp.gate")) is not None:
            raise ConfigError(f"{path}: the router {prefix}mlp.gate is {fmt.describe()} in quantization_config; "
                              "routers load as float only (quantizing tools list them in ignore: 're:.*mlp.gate$')")


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


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_from_hf(cfg: dict[str, Any], scaling: dict[str, Any] | None, path: Path) -> MLAConfig:
    need = lambda k: _need(cfg, k, path)  # noqa: E731
    nope, rope = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(need("kv_lora_rank")),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(need("v_head_dim")),
                     rope_interleave=bool(cfg.get("rope_interleave", True)), softmax_scale=scale)


def _moe_from_hf(cfg: dict[str, Any], arch: str, layers: int, path: Path) -> MoEConfig:
    need = lambda k: _need(cfg, k, path)  # noqa: E731
    shared, n_group, topk_group, scaling_factor, dense, block = 0, 1, 1, 1.0, (), "mlp"
    if arch == "DeepseekV3ForCausalLM":
        scoring = cfg.get("scoring_func", "sigmoid")
        method = cfg.get("topk_method", "noaux_tc")
        if (scoring, method) != ("sigmoid", "noaux_tc"):
            raise ConfigError(f"{path}: DeepseekV3 routing scoring_func {scoring!r} with topk_method {method!r} is "
                              "not supported; supported: scoring_func 'sigmoid' with topk_method 'noaux_tc'")
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
        raise ConfigError(f"{path}: n_routed_experts {experts} must split into n_group {n_group} groups, of which "
                          f"topk_group {topk_group} are kept (1 <= topk_group <= n_group)")
    if not 1 <= top_k <= experts // n_group * topk_group:
        raise ConfigError(f"{path}: num_experts_per_tok {top_k} must be in 1..{experts // n_group * topk_group} "
                          f"(the experts of the topk_group {topk_group} kept groups)")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, scoring=scoring, norm_topk_prob=norm,
                     routed_scaling_factor=scaling_factor, n_group=n_group, topk_group=topk_group,
                     shared_intermediate_size=shared, dense_layers=dense, hf_block=block)


def _need(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{path}: required key {key!r} is missing")
    return cfg[key]


def _unwrap_text_config(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """A multimodal wrapper's text model: (its config, the prefix of its tensors, the prefixes of the
    tensors to skip); a plain text config comes back as it is."""
    archs = cfg.get("architectures") or []
    wrapper = archs[0] if archs and archs[0] in WRAPPER_ARCHITECTURES else None
    wrapper = wrapper or WRAPPER_MODEL_TYPES.get(cfg.get("model_type"))
    if wrapper is None:
        return cfg, "", ()
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: {wrapper} needs a text_config object holding its language model's config")
    text = dict(text)
    if cfg.get("quantization_config") and not text.get("quantization_config"):
        text["quantization_config"] = cfg["quantization_config"]  # Kimi keeps it at the top level
    if not text.get("architectures") and text.get("model_type", "deepseek_v3") in DEEPSEEK_V3_MODEL_TYPES:
        text["architectures"] = ["DeepseekV3ForCausalLM"]
    for key in ("eos_token_id", "bos_token_id"):  # wrappers may keep the special tokens at the top level
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    prefix, skip = WRAPPER_ARCHITECTURES[wrapper]
    return text, prefix, skip


@dataclass(frozen=True)
class ModelConfig:
    """The target transformer's shape, normalized across Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and
    DeepSeek-V3 (and the Kimi-K2/K2.5 configs that wrap it)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    path: str = ""
    quant: QuantConfig | None = None  # which linears hold int4 weights (None: all float)
    mla: MLAConfig | None = None  # latent attention instead of GQA
    moe: MoEConfig | None = None  # routed experts instead of the MLP (except in moe.dense_layers)
    tensor_prefix: str = ""  # the text model's tensors are named with this prefix (multimodal wrappers)
    skip_prefixes: tuple[str, ...] = ()  # checkpoint tensors the text model does not use (vision, MTP layers)
    mtp_layers: int = 0  # DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers), after the decoder's

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dims, value dims) of one layer's KV cache per token: latent attention caches
        one normalised latent plus the rotated key dims, and no values."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        from specserve.model.gguf import find_gguf, model_config

        gguf_file = find_gguf(model_dir)  # a GGUF file carries its config in its metadata
        if gguf_file is not None:
            return model_config(gguf_file)
        path = Path(model_dir) / "config.json"
        return cls.from_hf_dict(read_json(path), path)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], path: Path | str = "config.json") -> "ModelConfig":
        path = Path(path)
        cfg, prefix, skip = _unwrap_text_config(cfg, path)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{path}: sliding-window attention (use_sliding_window=true) is not supported")
        if arch == "MixtralForCausalLM" and cfg.get("sliding_window") is not None:
            raise ConfigError(f"{path}: sliding-window attention (sliding_window={cfg['sliding_window']}) is not "
                              "supported; set it to null for full attention")

        def need(key: str) -> Any:
            return _need(cfg, key, path)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        theta, scaling = _rope_from_hf(cfg, path)
        layers = int(need("num_hidden_layers"))
        mla = moe = None
        mtp = 0
        if arch == "DeepseekV3ForCausalLM":
            mla = _mla_from_hf(cfg, scaling, path)
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            # Multi-token-prediction layers follow the decoder's: the text model skips them, `--speculative-method
            # mtp` drafts with the first (model.mtp).
            mtp = int(cfg.get("num_nextn_predict_layers") or 0)
            skip = skip + tuple(f"model.layers.{layers + i}." for i in range(mtp))
        if arch in MOE_ARCHITECTURES:
            moe = _moe_from_hf(cfg, arch, layers, path)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        quant = cfg.get("quantization_config")
        quant = parse_quantization_config(quant, str(path), prefix) if quant is not None else None
        if quant is not None and (mla is not None or moe is not None):
            _check_quantized_moe(quant, mla, moe, layers, path)
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Qwen3 say so with attention_bias.
            qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=(not is_qwen2) and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            path=str(path.parent),
            quant=quant,
            mla=mla,
            moe=moe,
            tensor_prefix=prefix,
            skip_prefixes=skip,
            mtp_layers=mtp,
        )


@dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 drafter: one Llama decoder layer fed [embed(token), fc(aux hidden)]."""

    layout: str  # "specforge" | "sglang" | "eagle"
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # as written in the checkpoint (layer *outputs*, SGLang convention)
    fc_bias: bool
    dtype: str
    path: str = ""

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> "DraftConfig":
        path = Path(draft_dir) / "config.json"
        return cls.from_hf_dict(read_json(path), path)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], path: Path | str = "config.json") -> "DraftConfig":
        path = Path(path)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in DRAFT_ARCHITECTURES:
            raise ConfigError(
                f"{path}: {arch!r} is not an EAGLE-3 drafter; expected architectures "
                f"['LlamaForCausalLMEagle3'] (SpecForge/SGLang) or a one-layer ['LlamaForCausalLM'] (EAGLE reference)"
            )
        if arch == "LlamaForCausalLM" and int(cfg.get("num_hidden_layers", 0)) != 1:
            raise ConfigError(
                f"{path}: a LlamaForCausalLM drafter must have num_hidden_layers 1 (EAGLE-3 reference layout), "
                f"found {cfg.get('num_hidden_layers')}; is this a target model rather than a drafter?"
            )
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ConfigError(f"{path}: required key {key!r} is missing")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        layout = "eagle" if arch == "LlamaForCausalLM" else ("sglang" if eagle else "specforge")
        theta, scaling = _rope_from_hf(cfg, path)
        return cls(
            layout=layout,
            hidden_size=hidden,
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
            fc_bias=bool(cfg.get("bias", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            path=str(path.parent),
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps: the hidden states *entering* layers 2, L//2 and L-3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def resolve_aux_layers(draft: DraftConfig, num_layers: int, convention: str = "sglang") -> tuple[int, ...]:
    """Return the target layer indices whose *input* hidden state is captured.

    Checkpoints written by SpecForge/SGLang list layer ids whose *output* is
    wanted, so the hidden state entering layer id+1 is captured ("sglang", the
    default). vLLM reads the same list as the layers whose input is captured
    ("vllm"). Without a list, EAGLE-3's default taps apply.
    """
    if convention not in ("sglang", "vllm"):
        raise ConfigError(f"aux layer convention must be 'sglang' or 'vllm', got {convention!r}")
    if draft.aux_layer_ids is None:
        return default_aux_layers(num_layers)
    shift = 1 if convention == "sglang" else 0
    ids = tuple(i + shift for i in draft.aux_layer_ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            f"{draft.path}: eagle_aux_hidden_state_layer_ids {list(draft.aux_layer_ids)} ({convention} convention) "
            f"point outside the target's {num_layers} layers (captured inputs {list(ids)} must lie in 0..{num_layers})"
        )
    return ids


SPEC_METHODS = ("eagle3", "mtp", "ngram", "suffix")
DRAFT_FREE_METHODS = ("ngram", "suffix")  # drafts come from token history: no drafter forward


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: where drafts come from (`method`), how many tokens to draft per cycle
    and in what shape."""

    method: str = "eagle3"  # eagle3 (--draft), mtp (the target's own MTP layer), ngram or suffix (draft-free)
    steps: int = 0  # K draft tokens per cycle; 0 = plain decoding
    max_steps: int | None = None  # largest K the adaptive policy may use (default: steps)
    adaptive: bool = False
    topk: int = 1  # >1: a tree of drafts (the best `topk` branches kept at each depth)
    tokens: int | None = None  # tree nodes verified per cycle (default: topk * K, at most 63)
    tree_max_batch: int = 2  # larger batches draft chains: verifying a tree per sequence is compute-bound there
    draft_position_extension: bool = False  # draft past the drafter's max_position_embeddings
    ngram_min: int = 2  # ngram: shortest suffix of the text matched against its earlier tokens
    ngram_max: int = 5  # ngram: longest (the longest that matches is used)
    # With a drafter model (eagle3, mtp): also draft from the text by this draft-free method, and use those drafts
    # in cycles where they are likely to do better (spec.draft_free.TextFirst)
    text_drafts: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"--speculative-method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.text_drafts is not None and (self.text_drafts not in DRAFT_FREE_METHODS or self.draft_free):
            raise ConfigError(f"--text-drafts takes {' or '.join(DRAFT_FREE_METHODS)}, beside a drafter model "
                              f"(--speculative-method eagle3 or mtp); got {self.text_drafts!r} with {self.method}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(f"--ngram-min / --ngram-max must satisfy 1 <= min <= max <= 64, "
                              f"got {self.ngram_min} / {self.ngram_max}")
        if self.steps < 0 or self.steps > 16:
            raise ConfigError(f"--spec-steps must be in 0..16, got {self.steps}")
        if self.max_steps is None:
            object.__setattr__(self, "max_steps", self.steps)
        if self.max_steps < self.steps:
            raise ConfigError("--max-spec-steps must be at least --spec-steps")
        if not 1 <= self.topk <= 16:
            raise ConfigError(f"--spec-topk must be in 1..16, got {self.topk}")
        if self.topk > 1:
            k_max = self.max_steps
            if self.topk * max(k_max - 1, 0) > MAX_TREE_NODES:
                raise ConfigError(f"--spec-topk {self.topk} with up to {k_max} steps needs "
                                  f"{self.topk * (k_max - 1)} drafter tree slots; at most {MAX_TREE_NODES} "
                                  f"are supported: lower --spec-topk or --spec-steps")
            if self.tokens is not None and not 1 <= self.tokens <= MAX_TREE_NODES:
                raise ConfigError(f"--spec-tokens must be in 1..{MAX_TREE_NODES}, got {self.tokens}")
            if self.tree_max_batch < 1:
                raise ConfigError(f"--spec-tree-max-batch must be at least 1, got {self.tree_max_batch}")
        elif self.tokens is not None:
            raise ConfigError("--spec-tokens sizes a tree of drafts: it needs --spec-topk > 1")

    @property
    def draft_free(self) -> bool:
        return self.method in DRAFT_FREE_METHODS

    def cache_room(self, k_max: int) -> int:
        """KV slots past a sequence's end that one cycle may write (`k_max`: the largest K, 0
        without a drafter): K verify tokens for a chain; for a tree the most verify nodes or
        drafter frontier slots (top-k per depth after the first)."""
        if self.topk > 1 and k_max:
            return max(k_max, self.tree_nodes(k_max), self.topk * (k_max - 1))
        return k_max

    def drafts_tree(self, B: int) -> bool:
        """Whether a speculative cycle over B sequences drafts a tree (else a chain): small
        batches only, since verifying a tree per sequence makes large batches compute-bound."""
        return self.topk > 1 and B <= self.tree_max_batch

    def tree_nodes(self, K: int) -> int:
        """Draft tokens verified per cycle at depth K: K for a chain (top-k 1), else the best
        `tokens` of the tree's candidates (top-k at depth 1, top-k of each kept branch after)."""
        if self.topk == 1:
            return K
        candidates = self.topk + (K - 1) * self.topk ** 2
        return min(candidates, self.tokens or self.topk * K, MAX_TREE_NODES)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks, their environment and collectives tuning."""

    tp: int = 1
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the TP workers
    nccl_profile: str = "default"
    capture_timeout: float = 300.0  # seconds a worker's graph capture may stall before a restart without graphs
    nnodes: int = 1  # machines the tp ranks are spread over (tp / nnodes workers on each)
    node_rank: int = 0  # this machine's place: 0 drives the step (HTTP, generate, bench), the others are headless
    dist_init_addr: str | None = None  # HOST:PORT of node 0, reachable from every node (PORT and PORT+1 are used)
    dist_timeout: float = 300.0  # seconds for a node to join and for any collective across nodes

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes} "
                              f"(0..{self.nnodes - 1}; node 0 drives, the others are headless)")
        if self.dist_timeout <= 0:
            raise ConfigError(f"--dist-timeout must be positive seconds, got {self.dist_timeout}")
        if self.nnodes == 1:
            if self.dist_init_addr is not None:
                raise ConfigError("--dist-init-addr is only used with --nnodes > 1 (one node needs no address)")
            return
        if self.dist_init_addr is None:
            raise ConfigError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT: node 0's address, "
                              "reachable from every node")
        parse_dist_addr(self.dist_init_addr)
        if self.tp % self.nnodes:
            raise ConfigError(f"--tp {self.tp} is not divisible by --nnodes {self.nnodes}: every node runs "
                              "tp / nnodes workers")

    @property
    def local_tp(self) -> int:
        """Workers on each node."""
        return self.tp // self.nnodes


def parse_dist_addr(text: str) -> tuple[str, int]:
    """`--dist-init-addr HOST:PORT` (IPv6 as [ADDR]:PORT) -> (host, port). PORT is the
    rendezvous store and PORT+1 node 0's channel to the other nodes' launchers."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--dist-init-addr {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    if not 1 <= int(port) <= 65534:
        raise ConfigError(f"--dist-init-addr {text!r}: port must be 1..65534 (PORT and PORT+1 are used)")
    return host, int(port)


class _Grouped:
    """A flat name of a grouped setting, read through the group: `cfg.spec_steps` is
    `cfg.spec.steps`; on the class, the group's default (`EngineConfig.spec_tree_max_batch`)."""

    def __init__(self, group: str, key: str):
        self.group, self.key = group, key

    def __get__(self, obj, owner=None):
        if obj is None:
            default = {"spec": SpecConfig, "parallel": ParallelConfig}[self.group].__dataclass_fields__[self.key].default
            return None if default is dataclasses.MISSING else default
        return getattr(getattr(obj, self.group), self.key)


# The flat option names (CLI flags, `LLM(**kwargs)`, `EngineConfig(**kwargs)`) of the grouped
# settings: flat name -> (group attribute, field name).
_GROUPED = {
    "spec_method": ("spec", "method"),
    "ngram_min": ("spec", "ngram_min"),
    "ngram_max": ("spec", "ngram_max"),
    "spec_text_drafts": ("spec", "text_drafts"),
    "spec_steps": ("spec", "steps"),
    "max_spec_steps": ("spec", "max_steps"),
    "adaptive": ("spec", "adaptive"),
    "spec_topk": ("spec", "topk"),
    "spec_tokens": ("spec", "tokens"),
    "spec_tree_max_batch": ("spec", "tree_max_batch"),
    "allow_draft_position_extension": ("spec", "draft_position_extension"),
    "tp": ("parallel", "tp"),
    "env": ("parallel", "env"),
    "nccl_profile": ("parallel", "nccl_profile"),
    "graph_capture_timeout": ("parallel", "capture_timeout"),
    "nnodes": ("parallel", "nnodes"),
    "node_rank": ("parallel", "node_rank"),
    "dist_init_addr": ("parallel", "dist_init_addr"),
    "dist_timeout": ("parallel", "dist_timeout"),
}


def check_max_num_seqs(n: int) -> None:
    """Every engine needs a KV row: a count below 1 is refused, never replaced by a default."""
    if n < 1:
        raise ConfigError(f"--max-num-seqs must be at least 1, got {n}")


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Settings of one engine instance, frozen once built: engine-wide fields here, speculation in
    `spec`, tensor parallelism in `parallel`. Built from the flat option names (as the CLI and
    `LLM(**kwargs)` give them: `spec_steps`, `tp`, ...), which also read back (`cfg.spec_steps`);
    `dataclasses.replace` makes a changed copy, flat names included."""

    model: str = str(DEMO_DIR)
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    prefill_chunk: int = 512
    admit_wait: int = 0  # steps free rows may wait for more arrivals to prefill together (Engine._admission_deferred)
    kv_block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = None  # KV pool size in tokens (None: see gpu_memory_utilization)
    gpu_memory_utilization: float | None = None  # GPU: size the pool to this fraction of memory (None: max_num_seqs x max_model_len)
    prefix_cache: bool = False  # share full prompt blocks across requests by content
    cuda_graphs: bool = True
    batch_invariant: bool = False  # GPU products of 1-64 rows take one fixed GEMV shape (tune_linear, tune_int4)
    graph_batch_sizes: tuple[int, ...] | None = None
    aux_layer_convention: str = "sglang"
    allow_pickle: bool = False
    profile: bool = False  # per-cycle timing from the start (`Engine.profiling` switches it at run time)
    seed: int = 0
    spec: SpecConfig = SpecConfig()
    parallel: ParallelConfig = ParallelConfig()

    def __init__(self, spec: SpecConfig | None = None, parallel: ParallelConfig | None = None, **options: Any):
        groups = {"spec": {}, "parallel": {}}
        for name in [n for n in options if n in _GROUPED]:
            group, key = _GROUPED[name]
            groups[group][key] = options.pop(name)
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"EngineConfig got unknown option(s): {', '.join(unknown)}")
        for f in dataclasses.fields(self):
            if f.name in ("spec", "parallel"):
                continue
            object.__setattr__(self, f.name, options.get(f.name, f.default))
        spec = dataclasses.replace(spec, **groups["spec"]) if spec is not None else SpecConfig(**groups["spec"])
        parallel = (dataclasses.replace(parallel, **groups["parallel"]) if parallel is not None
                    else ParallelConfig(**groups["parallel"]))
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "parallel", parallel)
        self._validate()

    def _validate(self) -> None:
        method = self.spec.method
        if self.spec.steps and method == "eagle3" and not self.draft:
            raise ConfigError("--spec-steps > 0 needs a drafter: pass --draft DIR (or a draft-free "
                              "--speculative-method ngram / suffix, or mtp for a checkpoint with an MTP layer)")
        if self.draft and method != "eagle3":
            raise ConfigError(f"--speculative-method {method} takes no --draft: "
                              + ("the target's own MTP layer drafts" if method == "mtp" else "it drafts from the text itself"))
        check_max_num_seqs(self.max_num_seqs)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if not isinstance(self.admit_wait, int) or self.admit_wait < 0:
            raise ConfigError(f"--admit-wait must be a whole number of steps >= 0, got {self.admit_wait!r}")
        if not 1 <= self.kv_block_size <= 4096:
            raise ConfigError(f"--kv-block-size must be 1..4096 tokens, got {self.kv_block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens must be at least 1, got {self.kv_cache_tokens}")
        if self.gpu_memory_utilization is not None and not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(f"--gpu-memory-utilization must be within 0.05..0.99, got {self.gpu_memory_utilization}")
        if self.kv_cache_tokens is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("give --kv-cache-tokens or --gpu-memory-utilization, not both")

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat option name: `EngineConfig(**cfg.flat()) == cfg`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("spec", "parallel")}
        out.update({name: getattr(self, name) for name in _GROUPED})
        return out

    @classmethod
    def option_names(cls) -> set[str]:
        """The flat option names `from_kwargs` takes."""
        return {f.name for f in dataclasses.fields(cls) if f.name not in ("spec", "parallel")} | set(_GROUPED)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        unknown = sorted(set(kwargs) - cls.option_names())
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)


for _name, (_group, _key) in _GROUPED.items():
    setattr(EngineConfig, _name, _Grouped(_group, _key))
for _name in ("cache_room", "drafts_tree", "tree_nodes"):  # spec methods, also read as `cfg.tree_nodes(K)`
    setattr(EngineConfig, _name, _Grouped("spec", _name))
del _name, _group, _key


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None):
    """Inverse frequencies for rotary embeddings, with Llama-3 / linear scaling."""
    import torch

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
    import torch

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
        return _yarn_mscale(factor, float(scaling["mscale"])) / _yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return _yarn_mscale(factor, 1.0)


def default_max_model_len(cfg: ModelConfig, device_type: str) -> int:
    return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN["cuda" if device_type == "cuda" else "cpu"])


def checkpoint_files(model_dir: Path, allow_pickle: bool) -> list[Path]:
    """The weight files of a checkpoint directory: a safetensors index, else
    *.safetensors, else pickles (*.bin / *.pt) only with `allow_pickle`, because
    unpickling can execute code."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ConfigError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
    if pickles:
        if not allow_pickle:
            raise ConfigError(
                f"{model_dir} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}); "
                "pickles can execute code when loaded. Convert them to safetensors, or pass --allow-pickle "
                "if you trust their source"
            )
        return pickles
    raise ConfigError(f"{model_dir} has no weights (*.safetensors, or *.bin with --allow-pickle)")


def draft_tensor_name(name: str) -> str:
    """EAGLE-reference tensor names (`layers.0.*`, optional `model.` prefix) -> SpecForge names (`midlayer.*`)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name
