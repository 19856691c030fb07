"""Random checkpoints with real models' shapes, written in Hugging Face format
(config.json + sharded safetensors). Built on the GPU when there is one, so an
8B-class model takes seconds, not minutes. Used by the GPU benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def _rand(*shape, device, std=0.02):
    return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * std).cpu()


def write_llama(out: Path, shape: dict = LLAMA3_8B, device: str = "cuda", layers_per_shard: int = 4) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    nh, nkv, V = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    hd = H // nh
    weight_map, shard, n = {}, {}, 0

    def flush():
        nonlocal shard, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name))
            weight_map.update({k: name for k in shard})
            shard, n = {}, n + 1

    shard["model.embed_tokens.weight"] = _rand(V, H, device=device)
    for i in range(L):
        p = f"model.layers.{i}."
        shard |= {
            p + "self_attn.q_proj.weight": _rand(nh * hd, H, device=device),
            p + "self_attn.k_proj.weight": _rand(nkv * hd, H, device=device),
            p + "self_attn.v_proj.weight": _rand(nkv * hd, H, device=device),
            p + "self_attn.o_proj.weight": _rand(H, nh * hd, device=device),
            p + "mlp.gate_proj.weight": _rand(I, H, device=device),
            p + "mlp.up_proj.weight": _rand(I, H, device=device),
            p + "mlp.down_proj.weight": _rand(H, I, device=device),
            p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        }
        if (i + 1) % layers_per_shard == 0:
            flush()
    shard["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    shard["lm_head.weight"] = _rand(V, H, device=device)
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "head_dim": hd,
        **shape,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_eagle3_drafter(
    out: Path, target_shape: dict = LLAMA3_8B, draft_vocab: int = 32000, device: str = "cuda"
) -> Path:
    """A random EAGLE-3 drafter (SpecForge layout) for a target of `target_shape`."""
    out.mkdir(parents=True, exist_ok=True)
    H, I = target_shape["hidden_size"], target_shape["intermediate_size"]
    nh, nkv, V = target_shape["num_attention_heads"], target_shape["num_key_value_heads"], target_shape["vocab_size"]
    hd = H // nh
    t = {
        "fc.weight": _rand(H, 3 * H, device=device),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": _rand(nh * hd, 2 * H, device=device),
        "midlayer.self_attn.k_proj.weight": _rand(nkv * hd, 2 * H, device=device),
        "midlayer.self_attn.v_proj.weight": _rand(nkv * hd, 2 * H, device=device),
        "midlayer.self_attn.o_proj.weight": _rand(H, nh * hd, device=device),
        "midlayer.mlp.gate_proj.weight": _rand(I, H, device=device),
        "midlayer.mlp.up_proj.weight": _rand(I, H, device=device),
        "midlayer.mlp.down_proj.weight": _rand(H, I, device=device),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": _rand(draft_vocab, H, device=device),
    }
    ids = torch.arange(draft_vocab)
    t["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # draft vocab = the first ids of the target's
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    save_file(t, str(out / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "num_hidden_layers": 1,
        "head_dim": hd,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "rope_theta": target_shape.get("rope_theta", 10000.0),
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
