"""The target model's config: one normalized shape for every supported family, from config.json or a
GGUF file's metadata."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config.files import need_key, read_json
from specserve.config.hf import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, rope_from_hf, unwrap_text_config
from specserve.config.mla import MLAConfig, mla_from_hf
from specserve.config.moe import MoEConfig, check_quantized_moe, moe_from_hf
from specserve.errors import ConfigError
from specserve.model.gguf import find_gguf
from specserve.model.gguf import hf_config as gguf_hf_config
from specserve.model.quant import QuantConfig, parse_quantization_config

# Default --max-model-len when none is given: min(target's max_position_embeddings, this).
DEFAULT_MAX_MODEL_LEN = {"cuda": 4096, "cpu": 1024}


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
        gguf_file = find_gguf(model_dir)  # a GGUF file carries its config in its metadata
        if gguf_file is not None:
            return cls.from_hf_dict(gguf_hf_config(gguf_file), gguf_file)
        path = Path(model_dir) / "config.json"
        return cls.from_hf_dict(read_json(path), path)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], path: Path | str = "config.json") -> "ModelConfig":
        path = Path(path)
        cfg, prefix, skip = unwrap_text_config(cfg, path)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{path}: sliding-window attention (use_sliding_window=true) is not supported")
        if arch == "MixtralForCausalLM" and cfg.get("sliding_window") is not None:
            raise ConfigError(
                f"{path}: sliding-window attention (sliding_window={cfg['sliding_window']}) is not "
                "supported; set it to null for full attention"
            )

        def need(key: str) -> Any:
            return need_key(cfg, key, path)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        theta, scaling = rope_from_hf(cfg, path)
        layers = int(need("num_hidden_layers"))
        mla = moe = None
        mtp = 0
        if arch == "DeepseekV3ForCausalLM":
            mla = mla_from_hf(cfg, scaling, path)
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            # Multi-token-prediction layers follow the decoder's: the text model skips them, `--speculative-method
            # mtp` drafts with the first (model.mtp).
            mtp = int(cfg.get("num_nextn_predict_layers") or 0)
            skip = skip + tuple(f"model.layers.{layers + i}." for i in range(mtp))
        if arch in MOE_ARCHITECTURES:
            moe = moe_from_hf(cfg, arch, layers, path)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        quant = cfg.get("quantization_config")
        quant = parse_quantization_config(quant, str(path), prefix) if quant is not None else None
        if quant is not None and (mla is not None or moe is not None):
            check_quantized_moe(quant, mla, moe, layers, path)
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


def default_max_model_len(cfg: ModelConfig, device_type: str) -> int:
    return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN["cuda" if device_type == "cuda" else "cpu"])
