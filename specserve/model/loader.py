"""Loading checkpoints from local Hugging Face directories.

safetensors only by default: `*.bin` checkpoints are pickles and can run code
when loaded, so they need `allow_pickle=True` (then read with
`torch.load(weights_only=True)`). Every parameter must be filled exactly once
with the right shape; unknown tensors are an error too (they usually mean the
wrong architecture), except a few known-harmless buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.config import ConfigError, DraftConfig, ModelConfig, checkpoint_files, draft_tensor_name

if TYPE_CHECKING:
    from specserve.model.eagle3 import Eagle3Drafter
    from specserve.model.transformer import CausalLM

log = logging.getLogger(__name__)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available on this machine; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, config_dtype: str, device: torch.device) -> torch.dtype:
    """'auto' = the checkpoint's dtype on GPU; float32 on CPU (bf16 matmuls are slow there)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from auto, float32, float16, bfloat16")
    return DTYPES[dtype]


def iter_tensors(files: list[Path], keep=lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor whose name `keep` accepts (the others are not read)."""
    from safetensors import safe_open

    for i, f in enumerate(files):
        log.info("loading weights: file %d/%d %s/%s", i + 1, len(files), f.parent.name, f.name)  # start-up progress
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if keep(name):
                        yield name, st.get_tensor(name)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from ((n, t) for n, t in state.items() if keep(n))


def tensor_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt", device="cpu") as st:
                names.update(st.keys())
        else:
            names.update(torch.load(f, map_location="cpu", weights_only=True).keys())
    return names


def _fill(
    module: nn.Module,
    weight_map: dict,
    tensors: Iterator[tuple[str, torch.Tensor]],
    where: str,
    rename=lambda n: n,
    optional: frozenset[str] = frozenset(),
) -> None:
    seen: set[str] = set()
    unexpected: list[str] = []
    for raw_name, tensor in tensors:
        name = rename(raw_name)
        if name not in weight_map:
            if not name.endswith(_IGNORED_SUFFIXES):
                unexpected.append(raw_name)
            continue
        param, shard = weight_map[name]
        loader = getattr(param, "weight_loader", None)
        # Float tensors arrive in the model's dtype; integer ones as stored, for their loaders to check.
        value = tensor.to(param.dtype) if param.dtype.is_floating_point else tensor
        try:
            if loader is None:
                if param.shape != value.shape:
                    raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint has {tuple(value.shape)}")
                param.data.copy_(value)
            else:
                loader(param, value, shard)
        except ValueError as e:
            raise ConfigError(f"{where}: tensor {raw_name!r} does not fit: {e}") from None
        seen.add(name)
    missing = sorted(set(weight_map) - seen - optional)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(f"{where}: checkpoint is missing tensor(s): {shown}")
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise ConfigError(f"{where}: checkpoint has tensor(s) this architecture does not use: {shown}")


class _build_on:
    """Context: construct modules directly on `device` in `dtype` (no CPU round trip)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    def __enter__(self):
        self.prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        self.dev = torch.device(self.device)
        self.dev.__enter__()

    def __exit__(self, *exc):
        self.dev.__exit__(*exc)
        torch.set_default_dtype(self.prev)


def load_target(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_positions: int, allow_pickle: bool = False
) -> "CausalLM":
    from specserve.model.gguf import find_gguf, iter_hf_tensors
    from specserve.model.transformer import CausalLM

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    gguf_file = find_gguf(model_dir)
    skipped: set[str] = set()

    def text_name(name: str) -> str:  # the text model's tensors, named as in a text-only checkpoint
        return name[len(cfg.tensor_prefix) :] if cfg.tensor_prefix and name.startswith(cfg.tensor_prefix) else name

    def keep(name: str) -> bool:  # not a tensor the text model skips (a vision tower, MTP layers)
        hit = next((p for p in cfg.skip_prefixes if name.startswith(p) or text_name(name).startswith(p)), None)
        if hit is not None:
            skipped.add(hit)
        return hit is None

    tensors = iter_hf_tensors(gguf_file) if gguf_file else iter_tensors(checkpoint_files(model_dir, allow_pickle), keep)
    with _build_on(device, dtype):
        model = CausalLM(cfg, max_positions)
    # Tied models may still ship lm_head.weight (transformers writes it): drop it.
    weights = ((n, t) for n, t in tensors if not (cfg.tie_word_embeddings and text_name(n) == "lm_head.weight"))
    _fill(model, model.hf_weight_map(), weights, str(model_dir), rename=text_name)
    model.weights_loaded()
    if skipped:
        log.info(
            "%s: skipped the checkpoint's tensors under %s (not part of the %s text model)",
            model_dir,
            ", ".join(sorted(skipped)),
            cfg.architecture,
        )
    return model.eval().requires_grad_(False)


def load_drafter(
    draft_dir: str | Path,
    target,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    allow_pickle: bool = False,
) -> "Eagle3Drafter":
    from specserve.model.eagle3 import Eagle3Drafter

    draft_dir = Path(draft_dir)
    cfg = DraftConfig.from_dir(draft_dir)
    files = checkpoint_files(draft_dir, allow_pickle)
    names = {draft_tensor_name(n) for n in tensor_names(files)}
    with _build_on(device, dtype):
        drafter = Eagle3Drafter(cfg, max_positions, has_embedding="embed_tokens.weight" in names)
    # d2t/t2d may be absent when the draft vocabulary is the full target vocabulary.
    optional = frozenset({"d2t", "t2d"}) if cfg.draft_vocab_size == cfg.vocab_size else frozenset({"t2d"})
    _fill(
        drafter,
        drafter.hf_weight_map(),
        iter_tensors(files),
        str(draft_dir),
        rename=draft_tensor_name,
        optional=optional,
    )
    if drafter.embed_tokens is None:
        drafter.target_embed = target.embed_tokens
    return drafter.eval().requires_grad_(False)
