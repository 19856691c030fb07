"""A Kimi-K2.5-shaped repository at tiny sizes, and an EAGLE-3 drafter for it, built the way the real ones are laid
out: the `kimi_k25` wrapper config around a DeepSeek-V3 text model (latent attention, MoE with noaux_tc sigmoid
routing, YaRN), vision-tower and projector tensors beside `language_model.`, routed experts in compressed-tensors
pack-quantized int4 (group 32) with the top-level quantization_config and its ignore list, a tiktoken tokenizer
(`tiktoken.model` ranks learnt from a small multilingual corpus, Kimi's split pattern, Kimi's special-token
layout after the ranks) with tokenizer_config.json, and a chat_template.jinja with tools and thinking.

    python tests/kimi_repo.py OUT     # OUT/kimi (the target), OUT/kimi-eagle3 (the drafter), OUT/kimi-twin
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny import KIMI_IGNORE, make_drafter, make_int4_pair, make_moe_target

# Kimi-K2's special tokens by their offset after the BPE ranks (163584 in the real vocabulary).
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
RESERVED = 256  # ids reserved for special tokens after the ranks, named or not

CORPUS = (
    """The quick brown fox jumps over the lazy dog. You are Kimi, an AI assistant created by Moonshot AI.
user assistant system tool_declare: What is the weather in Paris today? It's sunny, and we'll see 23 degrees.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for (int i = 0; i < 100; ++i) { total += values[i] * 3.14159; }
月之暗面的人工智能助手可以回答问题。今天北京的天气很好，我们去公园散步吧。中文分词和英文单词不同。
Emoji too: 😀🎉🚀 and ∑∫√ maths, naïve café résumé, Ελληνικά, русский текст, 日本語のテキスト。
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Numbers 1234567890 2026-12-03 12:30:45, prices $19.99 and €5,00; URLs https://example.com/path?q=1.
"""
    * 3
)

CHAT_TEMPLATE = r"""{%- macro render_content(msg) -%}
{%- set c = msg.get('content') -%}
{%- if c is string -%}{{ c }}{%- elif c is not none -%}{%- for part in c -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- macro role_header(msg) -%}
{%- set name = msg.get('name') or msg['role'] -%}
{%- if msg['role'] == 'user' -%}<|im_user|>{{ name }}<|im_middle|>
{%- elif msg['role'] == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>
{%- else -%}<|im_system|>{{ name }}<|im_middle|>{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(msg) -%}
<|tool_calls_section_begin|>
{%- for call in msg['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endmacro -%}
{#- Reasoning is kept only after the last assistant turn that called no tool. -#}
{%- set ns = namespace(last=-1) -%}
{%- for i in range(messages|length - 1, -1, -1) -%}
{%- if messages[i]['role'] == 'assistant' and not messages[i].get('tool_calls') -%}
{%- set ns.last = i -%}{%- break -%}
{%- endif -%}
{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for msg in messages -%}
{{- role_header(msg) -}}
{%- if msg['role'] == 'assistant' -%}
{%- if loop.index0 > ns.last -%}<think>{{ msg.get('reasoning_content') or '' }}</think>
{%- else -%}<think></think>{%- endif -%}
{{- render_content(msg) -}}
{%- if msg.get('tool_calls') -%}{{- render_tool_calls(msg) -}}{%- endif -%}
{%- elif msg['role'] == 'tool' -%}## Return of {{ msg.get('tool_call_id') }}
{{ render_content(msg) }}
{%- else -%}{{- render_content(msg) -}}{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}"""


def learn_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks learnt from `text` pre-split by Kimi's pattern: the 256 bytes, then each
    merge of the most frequent adjacent pair, in order."""
    import regex

    from specserve.engine.tiktoken_vocab import KIMI_PATTERN

    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall("(?V1)" + KIMI_PATTERN, text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_tokenizer(out: Path, merges: int = 200) -> int:
    """tiktoken.model, tokenizer_config.json and chat_template.jinja in `out`; returns the vocabulary size."""
    from specserve.engine.tiktoken_vocab import write_ranks

    ranks = learn_ranks(CORPUS, merges)
    base = len(ranks)
    out.mkdir(parents=True, exist_ok=True)
    write_ranks(ranks, out / "tiktoken.model")
    added = {
        str(base + k): {
            "content": v,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for k, v in KIMI_SPECIALS.items()
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return base + RESERVED


def build(root: Path, layers: int = 4, max_pos: int = 256, draft_max_pos: int = 128) -> tuple[Path, Path, Path]:
    """(target, drafter, twin) under `root`: the twin is the target's text model with the int4 experts
    dequantized, as a plain DeepSeek-V3 checkpoint transformers loads."""
    from specserve.engine.tiktoken_vocab import KIMI_RESERVED_SPECIALS

    assert RESERVED == KIMI_RESERVED_SPECIALS
    kimi = root / "kimi"
    vocab = write_tokenizer(kimi)
    think_end = vocab - RESERVED + 23
    src = make_moe_target(
        root / "src",
        vocab=vocab,
        layers=layers,
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        max_position_embeddings=max_pos,
        eos_token_id=vocab - RESERVED + 2,
        rope_theta=50000.0,
    )
    # The random model closes its reasoning now and then, so replies show both parts.
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"][think_end] *= 4.5
    save_file(tensors, src / "model.safetensors")
    q, twin = make_int4_pair(src, root / "int4", root / "kimi-twin", 32, True, KIMI_IGNORE)
    text = json.loads((q / "config.json").read_text())
    quant = text.pop("quantization_config")
    quant["ignore"] = ["language_model.lm_head", *quant["ignore"][1:], "re:.*vision_tower.*", "re:.*mm_projector.*"]
    text |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    g = torch.Generator().manual_seed(5)
    tensors = {"language_model." + k: v for k, v in load_file(q / "model.safetensors").items()}
    for name, shape in (
        ("vision_tower.patch_embed.proj.weight", (32, 3, 14, 14)),
        ("vision_tower.encoder.blocks.0.attn.wqkv.weight", (96, 32)),
        ("mm_projector.pre_norm.weight", (128,)),
        ("mm_projector.proj.0.weight", (64, 128)),
    ):
        tensors[name] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    save_file(tensors, kimi / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "text_config": text,
        "vision_config": {"model_type": "moonvit3d", "hidden_size": 32, "patch_size": 14, "num_hidden_layers": 1},
        "media_placeholder_token_id": vocab - RESERVED + 21,
        "pad_token_id": vocab - RESERVED + 255,
        "bos_token_id": vocab - RESERVED,
        "eos_token_id": vocab - RESERVED + 1,
        "quantization_config": quant,
        "torch_dtype": "bfloat16",
    }
    (kimi / "config.json").write_text(json.dumps(config, indent=2))
    (kimi / "generation_config.json").write_text(
        json.dumps({"eos_token_id": vocab - RESERVED + 2, "max_length": max_pos})
    )
    draft = make_drafter(root / "kimi-eagle3", q, layout="specforge", max_pos=draft_max_pos)
    return kimi, draft, twin


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for path in build(Path(sys.argv[1])):
        print(path)
