"""Typed, validated configuration: the target model (read from a Hugging Face `config.json` or a GGUF
file), the EAGLE-3 drafter, and the engine's settings.

Everything that reads a checkpoint's config goes through here, so `specserve check` validates
exactly what the engine will later use, without loading a single weight. The modules: `files`
(JSON and weight files), `hf` (what every family's config shares), `mla` and `moe` (DeepSeek-V3's
latent attention, routed experts), `model`, `draft`, `engine`.
"""

from specserve.config.draft import DRAFT_ARCHITECTURES, DraftConfig, default_aux_layers, resolve_aux_layers
from specserve.config.engine import (
    DRAFT_FREE_METHODS,
    MAX_TREE_NODES,
    PREFILL_GRAPH_PROMPTS,
    PREFILL_GRAPH_TOKENS,
    SPEC_METHODS,
    EngineConfig,
    ParallelConfig,
    SpecConfig,
    check_max_num_seqs,
    parse_dist_addr,
    prefill_stage_len,
)
from specserve.config.files import DEMO_DIR, checkpoint_files, draft_tensor_name, read_json
from specserve.config.hf import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from specserve.config.mla import MLAConfig
from specserve.config.model import DEFAULT_MAX_MODEL_LEN, ModelConfig, default_max_model_len
from specserve.config.moe import MoEConfig
from specserve.errors import ConfigError

__all__ = [
    "ConfigError",
    "DRAFT_FREE_METHODS",
    "SPEC_METHODS",
    "DEFAULT_MAX_MODEL_LEN",
    "DEMO_DIR",
    "DRAFT_ARCHITECTURES",
    "DraftConfig",
    "EngineConfig",
    "MAX_TREE_NODES",
    "PREFILL_GRAPH_PROMPTS",
    "PREFILL_GRAPH_TOKENS",
    "MLAConfig",
    "MOE_ARCHITECTURES",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "SUPPORTED_ARCHITECTURES",
    "SpecConfig",
    "check_max_num_seqs",
    "checkpoint_files",
    "default_aux_layers",
    "default_max_model_len",
    "draft_tensor_name",
    "parse_dist_addr",
    "prefill_stage_len",
    "read_json",
    "resolve_aux_layers",
]
