"""An EAGLE-3 drafter's config (SpecForge, SGLang and EAGLE-reference layouts) and the target layers
it taps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config.files import read_json
from specserve.config.hf import rope_from_hf
from specserve.errors import ConfigError

DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM")


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
        theta, scaling = rope_from_hf(cfg, path)
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
