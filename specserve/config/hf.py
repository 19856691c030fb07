"""What every Hugging Face config shares: the supported architectures, rope parameters (4.x and 5.x
keys) and the unwrapping of multimodal wrappers around a text model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.errors import ConfigError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
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


def rope_from_hf(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
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


def unwrap_text_config(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], str, tuple[str, ...]]:
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
