"""Tiny random checkpoints written the way real tools write them, and the CPU stand-in for the CUDA graphs
the engine captures on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_target(
    out: Path,
    arch: str = "llama",
    vocab: int = 96,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    **extra,
) -> Path:
    """A random transformers model saved with save_pretrained (safetensors)."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 32)
        cfg, cls = transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    # Sharper logits than the default init: more decisive, more realistic greedy paths.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}


def make_moe_target(
    out: Path,
    arch: str = "deepseek_v3",
    vocab: int = 96,
    hidden: int = 64,
    layers: int = 4,
    experts: int = 8,
    seed: int = 0,
    **extra,
) -> Path:
    """A random transformers MoE model (DeepseekV3ForCausalLM with YaRN rope, Qwen3MoeForCausalLM,
    both with layer 0 dense, or MixtralForCausalLM), saved with save_pretrained. The router is sharpened and
    DeepSeek's selection bias made non-zero, so routing (and the bias's part in it) shows."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=None,
        pad_token_id=None,
    )
    if arch == "deepseek_v3":
        kw |= dict(
            num_key_value_heads=4,
            n_routed_experts=experts,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=24,
            num_mtp_layers=0,
            rope_parameters=dict(YARN),
        )
        cfg, cls = transformers.DeepseekV3Config(**(kw | extra)), transformers.DeepseekV3ForCausalLM
    elif arch == "qwen3_moe":
        kw |= dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=experts,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
        cfg, cls = transformers.Qwen3MoeConfig(**(kw | extra)), transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        kw |= dict(
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=experts,
            num_experts_per_tok=2,
            intermediate_size=hidden // 2,
            sliding_window=None,
        )
        kw.pop("moe_intermediate_size")
        cfg, cls = transformers.MixtralConfig(**(kw | extra)), transformers.MixtralForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def make_drafter(
    out: Path,
    target_dir: Path,
    layout: str = "specforge",
    draft_vocab: int | None = None,
    seed: int = 1,
    max_pos: int = 512,
    with_embedding: bool = False,
    aux_ids: list[int] | None = None,
) -> Path:
    """A random EAGLE-3 drafter in the SpecForge, SGLang or EAGLE-reference layout."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    heads, kv = tcfg["num_attention_heads"], tcfg.get("num_key_value_heads", tcfg["num_attention_heads"])
    hd = H // heads
    inter = tcfg["intermediate_size"]
    Vd = draft_vocab or V
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    t = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, H),
        "midlayer.mlp.up_proj.weight": r(inter, H),
        "midlayer.mlp.down_proj.weight": r(H, inter),
        "norm.weight": torch.ones(H),
        "lm_head.weight": r(Vd, H) * 5,
    }
    # Draft vocabulary: every other target id first, so d2t is a real (non-zero) map.
    ids = torch.cat([torch.arange(0, V, 2), torch.arange(1, V, 2)])[:Vd].sort().values
    t["d2t"] = ids - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    if with_embedding:
        t["embed_tokens.weight"] = r(V, H)
    cfg = {
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "max_position_embeddings": max_pos,
        "rope_theta": (tcfg.get("rope_parameters") or tcfg).get("rope_theta", 10000.0),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    if layout == "eagle":
        cfg |= {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
        t = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()}
    else:
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
        if layout == "sglang":
            L = tcfg["num_hidden_layers"]
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids or [1, L // 2 - 1, L - 4]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out


def linear_modules(tensors: dict) -> list[str]:
    """The Hugging Face Linear modules of a checkpoint: the projections (routed and shared
    experts' too), DeepSeek-V3's kv_a_proj_with_mqa, lm_head."""
    return sorted(
        n[: -len(".weight")]
        for n in tensors
        if n.endswith(("_proj.weight", "_proj_with_mqa.weight")) or n == "lm_head.weight"
    )


# Kimi-K2.5's ignore list: only the routed experts are int4 (attention, shared experts, the dense
# first layer's MLP and lm_head stay bf16).
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")
# A Qwen3-MoE quantized by llm-compressor: everything but the routers and lm_head.
QWEN3_MOE_IGNORE = ("lm_head", "re:.*mlp.gate$")


def make_int4_pair(
    src: Path,
    out: Path,
    twin: Path,
    group_size: int | None = 32,
    symmetric: bool = True,
    ignore: tuple[str, ...] = ("lm_head",),
) -> tuple[Path, Path]:
    """From the float checkpoint `src`: `out`, its linears (but `ignore`'s) quantized to int4 and
    written as compressed-tensors pack-quantized stores them; `twin`, the same model with those
    weights dequantized into plain float32 tensors."""
    import re

    from safetensors.torch import load_file

    from specserve.kernels.int4 import pack_int4, quantize_int4

    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    packed, plain = dict(tensors), dict(tensors)
    for m in linear_modules(tensors):
        if any(re.match(p[3:], m) if p.startswith("re:") else p == m for p in ignore):
            continue
        w = packed.pop(f"{m}.weight")
        q, scale, zero = quantize_int4(w.to(torch.bfloat16), group_size, symmetric)  # bf16 scales, as real checkpoints
        v = q.float().unflatten(-1, (scale.shape[-1], -1))
        if zero is not None:
            v = v - zero.float().unsqueeze(-1)
        plain[f"{m}.weight"] = (v * scale.float().unsqueeze(-1)).flatten(-2)
        packed[f"{m}.weight_packed"] = pack_int4(q)
        packed[f"{m}.weight_scale"] = scale
        packed[f"{m}.weight_shape"] = torch.tensor(w.shape)
        if zero is not None:
            packed[f"{m}.weight_zero_point"] = pack_int4(zero, dim=-2)
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group" if group_size else "channel",
        "group_size": group_size,
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
    for d, t, c in ((out, packed, {**cfg, "quantization_config": quant}), (twin, plain, cfg)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(c, indent=2))
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    return out, twin


def with_cache(model, length: int = 64):
    """`model` (a CausalLM) with a plain contiguous KV cache of `length` positions per layer."""
    for a in model.attention_modules():
        a.k_cache = torch.zeros(1, a.num_kv_heads, length, a.head_dim)
        a.v_cache = torch.zeros(1, a.num_kv_heads, length, a.v_dim) if a.v_dim else None
    return model


@torch.inference_mode()
def assert_logits_match(ours, ref, vocab: int, prompt_len: int = 13, steps: int = 8) -> None:
    """Two CausalLMs (caches from `with_cache`) give the same float32 logits for a random prompt's
    prefill, then for each of `steps` greedy decode steps."""
    from specserve.model.layers import ForwardContext

    g = torch.Generator().manual_seed(2)
    ids, pos = torch.randint(0, vocab, (1, prompt_len), generator=g), torch.arange(prompt_len).unsqueeze(0)
    h, _ = ours(ids, ForwardContext(0, pos, pos, prompt_len))
    h_ref, _ = ref(ids, ForwardContext(0, pos, pos, prompt_len))
    torch.testing.assert_close(ours.logits(h), ref.logits(h_ref), rtol=1e-5, atol=1e-5)
    token = ours.logits(h)[:, -1].argmax(-1, keepdim=True)
    for step in range(steps):
        p = torch.tensor([[prompt_len + step]])
        a, _ = ours(token, ForwardContext(0, p, p, prompt_len + step + 1))
        b, _ = ref(token, ForwardContext(0, p, p, prompt_len + step + 1))
        torch.testing.assert_close(ours.logits(a), ref.logits(b), rtol=1e-5, atol=1e-5)
        token = ours.logits(a)[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def assert_decode_matches(model_dir: Path, hf, prompt_len: int = 21, steps: int = 32) -> None:
    """Our target's logits equal transformers' `hf` (float32) for a random prompt's prefill, then
    for each of `steps` greedy decode steps."""
    from specserve.model.layers import ForwardContext
    from specserve.model.loader import load_target

    length = prompt_len + steps + 8
    ours = load_target(model_dir, torch.device("cpu"), torch.float32, length)
    for a in ours.attention_modules():
        a.k_cache = torch.zeros(1, a.num_kv_heads, length, a.head_dim)
        a.v_cache = torch.zeros(1, a.num_kv_heads, length, a.v_dim) if a.v_dim else None
    torch.manual_seed(0)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, prompt_len))
    pos = torch.arange(prompt_len).unsqueeze(0)
    hidden, _ = ours(ids, ForwardContext(0, pos, pos, prompt_len))
    ref = hf(ids, use_cache=True)
    torch.testing.assert_close(ours.logits(hidden), ref.logits, rtol=1e-4, atol=1e-4)
    cache, token = ref.past_key_values, ref.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(steps):
        p = torch.tensor([[prompt_len + step]])
        hidden, _ = ours(token, ForwardContext(0, p, p, prompt_len + step + 1))
        ref = hf(token, past_key_values=cache, use_cache=True)
        torch.testing.assert_close(ours.logits(hidden)[:, -1], ref.logits[:, -1], rtol=1e-4, atol=1e-4)
        cache, token = ref.past_key_values, ref.logits[:, -1].argmax(-1, keepdim=True)


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: replay() runs the body again, into the
    output tensors of its first run (as a graph's replay refills its static outputs)."""

    def __init__(self, body):
        self.body = body
        with torch.inference_mode():
            self.outputs = body()

    def replay(self):
        for out, new in zip(self.outputs, self.body()):
            if out is not None:
                out.copy_(new)


def eager_prefill_graphs(runner) -> None:
    """The runner's prompt prefill graphs (every bucket) played eagerly."""
    from specserve.engine.graphs import Graph, GraphKey

    for Tb in runner.prefill_buckets:
        g = EagerGraph(lambda Tb=Tb: runner._prefill_body(Tb))
        runner.graphs[GraphKey("prefill", 1, tokens=Tb)] = Graph(g, g.outputs)


def engine_with_prefill_graphs(buckets, **config):
    """An Engine (`config`: EngineConfig's options) whose runner holds prefill graphs for prompts of up to
    `buckets` tokens, played eagerly: on the CPU, the stand-in for the ones a GPU captures."""
    from unittest import mock

    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine
    from specserve.engine.runner import ModelRunner

    with mock.patch.object(ModelRunner, "_prefill_graph_buckets", lambda self: tuple(buckets)):
        engine = Engine(EngineConfig(**config))
    eager_prefill_graphs(engine.runner)
    return engine


# Prompts of the demo tokenizer on which make_lagging_drafter's drafts are accepted.
CODE_PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):", "for i in range(10):"]


def make_lagging_drafter(out: Path, target_dir: Path) -> Path:
    """An EAGLE-3 drafter that proposes from the target's own distribution, one
    position late: it taps the target's final hidden state (aux id L-1 in the
    SGLang convention = the input of layer L), passes it through unchanged
    (o_proj and down_proj are zero) and applies the target's norm and head. An
    EAGLE-3 head must predict p+2 from the features at p; this one predicts p+1,
    so greedy drafts are accepted where the target repeats a token and sampled
    ones where consecutive distributions overlap: real, multi-token acceptance
    on a random target, deterministic for fixed prompts and seeds."""
    cfg = json.loads((target_dir / "config.json").read_text())
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    hd = H // heads
    w = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    t = {
        "fc.weight": torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": torch.zeros(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, H),
        "midlayer.mlp.up_proj.weight": r(inter, H),
        "midlayer.mlp.down_proj.weight": torch.zeros(H, inter),
        "norm.weight": w["model.norm.weight"].float(),
        "lm_head.weight": w["lm_head.weight"].float(),
        "d2t": torch.zeros(V, dtype=torch.long),
        "t2d": torch.ones(V, dtype=torch.bool),
    }
    dcfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "draft_vocab_size": V,
        "max_position_embeddings": 512,
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [L - 1, L - 1, L - 1]},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dcfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out


# Token-id prompts for greedy engine runs (generate_greedy).
INT_PROMPTS = [[1, 5, 2, 7], [3] * 11, [4, 9, 0, 10, 2, 2, 6]]


def generate_greedy(model, prompts, draft=None, **kw):
    """Greedy 24-token outputs of `prompts` on one engine, checked idle afterwards; (outputs, engine)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine
    from specserve.engine.sampling import SamplingParams

    kw.setdefault("device", "cpu")
    engine = Engine(
        EngineConfig(model=str(model), draft=str(draft) if draft else None, max_num_seqs=len(prompts), **kw)
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine


def kimi_k25_config(text: dict) -> dict:
    """Kimi-K2.5's wrapper config around a DeepSeek-V3 text config (its vision tower named, not built)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"hidden_size": 1152},
        "media_placeholder_token_id": 163605,
    }
