"""tiktoken-format tokenizers (the Kimi-K2 family's tiktoken.model): encoding equals the `tiktoken` package's own
with the same ranks and pattern, decoding round-trips byte for byte (whole and streamed), special tokens, chat
templates with tools and a thinking switch, and the reasoning split."""

from __future__ import annotations

import json

import pytest
import tiktoken

from specserve.config import ConfigError
from specserve.engine.tiktoken_vocab import KIMI_PATTERN, read_ranks
from specserve.engine.tokenizer import IncrementalDecoder, Tokenizer
from specserve.server.reasoning import ReasoningSplitter, resolve_parser

from kimi_repo import KIMI_SPECIALS, RESERVED, write_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog; it's what they'd've DONE, HeLLo WORLDs.",
    "月之暗面的人工智能助手可以回答问题。今天北京的天气很好，我们去公园散步吧。",
    "混合mixed文本Text123四五六7890 and 12345678 digits",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)\n\n\n",
    "Emoji: 🐙😀🎉🚀👨‍👩‍👧‍👦 🇫🇷 and ∑∫√, naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "   leading spaces and trailing   \r\n\r\n  ",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>why</think>ok[EOS]",
    "unknown-looking <|not_a_special|> stays text, [BOS] is one",
]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tok")
    write_tokenizer(d)
    return d, Tokenizer(d)


def reference(d):
    """The tiktoken package's own encoding with the repository's ranks, Kimi's pattern and its special tokens."""
    ranks = read_ranks(d / "tiktoken.model")
    specials = {v: len(ranks) + k for k, v in KIMI_SPECIALS.items()}
    specials |= {
        f"<|reserved_token_{i}|>": i
        for i in range(len(ranks), len(ranks) + RESERVED)
        if i - len(ranks) not in KIMI_SPECIALS
    }
    return tiktoken.Encoding("reference", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_encoding_equals_tiktoken_token_for_token(kimi_tok):
    d, tok = kimi_tok
    ref = reference(d)
    assert tok.kind == "tiktoken.model" and tok.vocab_size == ref.n_vocab
    for text in CORPUS + ["".join(CORPUS)]:
        assert tok.encode(text) == ref.encode(text, allowed_special="all"), text
    assert tok.encode("[BOS]") == [tok.token_to_id("[BOS]")] == [ref.n_vocab - RESERVED]
    assert tok.token_to_id("<|im_end|>") == ref.n_vocab - RESERVED + 2 and tok.end_of_turn_id == tok.token_to_id(
        "<|im_end|>"
    )
    assert tok.eos_token_ids == {tok.token_to_id("[EOS]")}


def test_every_declared_end_of_turn_stops(tmp_path):
    """tokenizer_config's eos, generation_config's and the wrapper config's text_config's eos_token_id."""
    write_tokenizer(tmp_path)
    base = len(read_ranks(tmp_path / "tiktoken.model"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "kimi_k25", "eos_token_id": base + 1, "text_config": {"eos_token_id": base + 2}})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [base + 9]}))
    tok = Tokenizer(tmp_path)
    assert tok.eos_token_ids == {tok.token_to_id(t) for t in ("[EOS]", "<|im_end|>", "[EOT]")}


def test_pattern_splits_as_kimis(kimi_tok):
    """Han runs apart from other letters, digits in threes: seen in the tokens' boundaries."""
    _, tok = kimi_tok
    pieces = [tok.token_bytes(i).decode("utf-8", "replace") for i in tok.encode("中文abc12345")]
    text_so_far, bounds = "", []
    for p in pieces:
        text_so_far += p
        bounds.append(len(text_so_far))
    assert 2 in bounds and 5 in bounds and 8 in bounds  # 中文 | abc | 123 | 45


def test_decoding_round_trips_byte_for_byte_whole_and_streamed(kimi_tok):
    _, tok = kimi_tok
    for text in CORPUS + ["".join(CORPUS)]:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
        for step in (1, 2, 3):  # characters split across tokens arrive whole, never as U+FFFD
            dec = IncrementalDecoder(tok)
            deltas = [dec.push(ids[i : i + step]) for i in range(0, len(ids), step)]
            assert "\ufffd" not in "".join(deltas)
            assert "".join(deltas) == tok.decode(ids)
    ids = tok.encode("🐙")
    assert len(ids) > 1  # an emoji the corpus lacks: several byte tokens


def test_skip_special_tokens_keeps_structure_markers(kimi_tok):
    _, tok = kimi_tok
    ids = tok.encode("<|im_assistant|>assistant<|im_middle|><think>r</think>answer<|im_end|>[EOS]")
    assert tok.decode(ids) == "assistant<think>r</think>answer"  # reasoning markers stay for the parser
    ids = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_end|>")
    assert tok.decode(ids) == "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_end|>"


def test_pattern_as_data_and_unknown_family(tmp_path):
    write_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "SomethingElse"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no split pattern.*add the pattern as 'pat_str'"):
        Tokenizer(tmp_path)
    cfg["pat_str"] = r"\S+|\s+"  # stated by the repository: taken as data
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    ranks = read_ranks(tmp_path / "tiktoken.model")
    ref = tiktoken.Encoding(
        "r",
        pat_str=r"\S+|\s+",
        mergeable_ranks=ranks,
        special_tokens={v: len(ranks) + k for k, v in KIMI_SPECIALS.items()},
    )
    assert tok.encode(CORPUS[0]) == ref.encode(CORPUS[0])
    (tmp_path / "tiktoken.model").write_text("not-base64!! 0\n")
    with pytest.raises(ConfigError, match="line 1 is not '<base64 token> <rank>'"):
        Tokenizer(tmp_path)


def test_a_directory_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(ConfigError, match="has no tokenizer.json, tiktoken.model or tokenizer.model"):
        Tokenizer(tmp_path)


def test_sentencepiece_without_its_packages_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("sentencepiece", "google") else real(name, *a)
    )
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(
        ConfigError,
        match=r"tokenizer.model is a SentencePiece model.*pip install sentencepiece "
        r"protobuf.*save_pretrained",
    ):
        Tokenizer(tmp_path)


def test_chat_template_tools_and_thinking_switch(kimi_tok):
    _, tok = kimi_tok
    f = tok.template_features
    assert (f.tools, f.thinking_switch, f.reasoning, f.tool_calls) == (True, "thinking", "think", "kimi_k2")
    msgs = [{"role": "user", "content": "weather?"}]
    on = tok.apply_chat_template(msgs)
    assert on.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    for kwargs in ({"thinking": False}, {"enable_thinking": False}):  # either name reaches the template's switch
        assert tok.apply_chat_template(msgs, **kwargs).endswith("<|im_middle|><think></think>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(msgs, tools=tools)
    assert text.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":'
        '"get_weather","parameters":{"type":"object"}}}]<|im_end|>'
    )
    history = [
        *msgs,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    text = tok.apply_chat_template(history, tools=tools)
    assert (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ) in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in text


@pytest.mark.parametrize(
    "prompt_end, reply, want",
    [
        ("<think>", "plan</think>answer", ("plan", "answer")),  # Kimi-K2.5, thinking on
        ("<think></think>", "answer </think> x", (None, "answer </think> x")),  # thinking off: all content
        ("assistant\n", "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),  # Qwen3: the reply opens it
        ("assistant\n", "answer", (None, "answer")),
        ("<think>", "still thinking", ("still thinking", "")),  # cut by max_tokens inside the reasoning
    ],
)
def test_reasoning_split_whole_and_streamed(prompt_end, reply, want):
    assert ReasoningSplitter("think", "p" + prompt_end).split(reply) == want
    for step in (1, 2, 5):
        s = ReasoningSplitter("think", "p" + prompt_end)
        parts = [s.push(reply[i : i + step]) for i in range(0, len(reply), step)] + [s.finish()]
        reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
        assert (reasoning if s.entered else None, content) == want


def test_reasoning_parser_choice(kimi_tok):
    _, tok = kimi_tok
    assert resolve_parser("auto", tok.template_features) == "think"
    assert resolve_parser("none", tok.template_features) is None
    assert resolve_parser("kimi_k2", None) == "think" and resolve_parser("kimi", None) == "kimi_vl"
    assert ReasoningSplitter("kimi_vl", "◁think▷").split("a◁/think▷b") == ("a", "b")


def test_built_in_kimi_pattern_is_the_published_one():
    """tokenization_kimi.py's pat_str as published, on one line."""
    published = (
        r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}"""
        r"""\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}"""
        r"""\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
        r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )
    assert KIMI_PATTERN == published


def test_template_renders_as_transformers_does(kimi_tok):
    """The chat template through transformers' own renderer gives the same text (tools, history, thinking)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    _, tok = kimi_tok
    tools = [{"type": "function", "function": {"name": "f", "description": "é ü", "parameters": {"type": "object"}}}]
    history = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q <b>&"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
        {"role": "user", "content": "again"},
    ]
    for kwargs in ({}, {"thinking": False}, {"thinking": True}):
        for msgs, tls in ((history, tools), (history[1:2], None)):
            ours = tok.apply_chat_template(msgs, tools=tls, **kwargs)
            (theirs,), _ = render_jinja_template(
                [msgs], tools=tls, chat_template=tok.chat_template, add_generation_prompt=True, **kwargs
            )
            assert ours == theirs, kwargs
