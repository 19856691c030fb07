"""GGUF checkpoints (llama.cpp's single-file format) for Llama, Qwen2 and Qwen3.

The `gguf` package reads the file. Its metadata becomes a Hugging Face
config dict (so ModelConfig validates a GGUF exactly as it validates a
config.json), its tensors are dequantized and renamed to Hugging Face names
(so the loader fills parameters through the same weight map), and its
tokenizer is rebuilt by transformers' GGUF tokenizer converter, which makes
the token ids identical to what transformers produces for the same file.

llama.cpp stores Llama's q/k projections with the rows of each head
reordered from the half-split rotary layout to the interleaved one; they are
put back here. Qwen2/Qwen3 files keep the Hugging Face order.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.errors import ConfigError

if TYPE_CHECKING:
    import torch

# GGUF general.architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Per-layer tensor suffixes: llama.cpp name -> Hugging Face name (under model.layers.N.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# general.file_type of unquantized files -> the dtype to run in when the user says "auto"
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def _reader(path: Path):
    """The file's reader, shared by every caller while the file is unchanged: parsing a real model's
    metadata (its vocabulary is ~500,000 fields) takes seconds, and a load asks for it several times."""
    try:
        stat = Path(path).stat()
    except OSError as e:
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from None
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(f"{path} is a GGUF file, which needs the gguf package; run: pip install gguf") from None
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from None


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a known model name, a .gguf file, or a folder
    holding exactly one .gguf and no config.json); None for anything else."""
    from specserve.model.catalog import known_model_path

    known = known_model_path(str(model))
    if known is not None:
        return known
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(
            f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
            "pass --model with the one to use"
        )
    return found[0] if found else None


def require_model(model: str) -> None:
    """A clear error, before anything loads, when `model` names nothing loadable."""
    from specserve.model.catalog import KNOWN_MODELS

    if Path(model).is_dir() or find_gguf(model) is not None:
        return
    raise ConfigError(
        f"--model {model!r} is neither a Hugging Face model directory, a .gguf file, nor a known "
        f"model name ({', '.join(KNOWN_MODELS)})"
    )


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(path: Path, reader=None) -> dict[str, Any]:
    """The file's metadata as a Hugging Face config.json dict."""
    r = reader or _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError(
            f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1-style scaling) are not "
            "supported in GGUF files; convert the Hugging Face checkpoint instead"
        )

    def need(key: str) -> Any:
        value = _field(r, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = r.fields.get("tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": ARCHITECTURES[arch][1],
        "vocab_size": int(_field(r, f"{arch}.vocab_size") or (len(tokens.data) if tokens else need("vocab_size"))),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": _FILE_DTYPES.get(_field(r, "general.file_type"), "bfloat16"),
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"{path}: GGUF rope scaling {scaling!r} is not supported (supported: none, linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(r, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None when it has no counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def supported_quant_types() -> list[str]:
    import gguf.quants

    return ["F32", "F16", *(t.name for t in getattr(gguf.quants, "_type_traits", {}))]


def tensor_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Hugging Face name -> (GGUF tensor type, shape), read from the header alone."""
    r = _reader(path)
    out = {}
    for t in r.tensors:
        name = hf_name(t.name)
        out[name or t.name] = (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
    return out


def vocab(path: Path) -> dict[str, int]:
    """Token -> id, from the metadata alone."""
    tokens = _field(_reader(path), "tokenizer.ggml.tokens")
    if tokens is None:
        raise ConfigError(f"{path} has no tokenizer (tokenizer.ggml.tokens is missing)")
    return {tok: i for i, tok in enumerate(tokens)}


def _unpermute(w: "torch.Tensor", heads: int) -> "torch.Tensor":
    """Undo llama.cpp's rotary reordering of a q/k projection: within each head it
    stores the rows as (pairs, 2) where Hugging Face has them as (2, pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_hf_tensors(path: Path) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The file's tensors, dequantized to float32, under Hugging Face names and layout."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    r = _reader(path)
    cfg = hf_config(path, r)
    llama = cfg["model_type"] == "llama"
    for t in r.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(f"{path}: tensor {t.name!r} has no counterpart in a {cfg['architectures'][0]}")
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConfigError(
                f"{path}: tensor {t.name} uses GGUF type {t.tensor_type.name}, which cannot be "
                f"dequantized; supported types: {', '.join(supported_quant_types())}"
            ) from None
        w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(int(d) for d in reversed(t.shape)))
        if llama and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif llama and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, w


def tokenizer_parts(path: Path) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) built from the file's vocabulary."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path}: cannot build a tokenizer from this GGUF file's vocabulary: {e}") from None
    config = {
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "add_bos_token": bool(getattr(hf, "add_bos_token", False)),
        "chat_template": hf.chat_template,
    }
    return hf.backend_tokenizer, config


def convert(src: Path, out_dir: Path) -> None:
    """Write `src` as a Hugging Face folder (float32 safetensors) that `--model out_dir` loads."""
    from safetensors.torch import save_file

    cfg = hf_config(src)
    tok, tok_cfg = tokenizer_parts(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(iter_hf_tensors(src)), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def add_arguments(p) -> None:
    p.add_argument("gguf", help="the .gguf file (or a known model name, e.g. smollm2-135m-instruct)")
    p.add_argument("out_dir", help="folder to write config.json, model.safetensors and the tokenizer into")


def run(args) -> int:
    import sys

    try:
        src = find_gguf(args.gguf)
        if src is None:
            raise ConfigError(f"{args.gguf} is not a .gguf file, a folder holding one, or a known model name")
        convert(src, Path(args.out_dir))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} (from {src})")
    return 0
