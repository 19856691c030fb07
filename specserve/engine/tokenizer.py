"""Tokenizer from a local Hugging Face directory (tokenizer.json, a tiktoken.model BPE file, or a
SentencePiece tokenizer.model converted by transformers; with tokenizer_config.json) or a GGUF file's
vocabulary, with EOS ids, the chat template and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from specserve.config import ConfigError
from specserve.engine.chat_template import (
    REASONING_MARKERS,
    TOOL_CALL_MARKERS,
    compile_template,
    template_features,
    template_kwargs,
)

# Special tokens that carry a reply's structure: decoded text keeps them even when it skips special
# tokens, so the reasoning and tool-call parsers see where a part begins and ends.
STRUCTURE_TOKENS = frozenset(
    {m for pair in REASONING_MARKERS.values() for m in pair}
    | {
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        *TOOL_CALL_MARKERS.values(),
        "</tool_call>",
    }
)


def tokenizer_kind(model_dir: Path) -> str:
    """Which file holds a model directory's vocabulary (GGUF directories are found by the caller)."""
    for name in ("tokenizer.json", "tiktoken.model", "tokenizer.model"):
        if (model_dir / name).exists():
            return name
    raise ConfigError(
        f"{model_dir} has no tokenizer.json, tiktoken.model or tokenizer.model: specserve reads a "
        "Hugging Face tokenizer.json, tiktoken BPE ranks (with tokenizer_config.json) or a SentencePiece "
        "model (save a tokenizer.json with transformers' "
        "AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
    )


def _sentencepiece(model_dir: Path):
    """A SentencePiece tokenizer.model converted to a tokenizers.Tokenizer by transformers (no remote code)."""
    import importlib.util

    missing = [m for m in ("sentencepiece", "google.protobuf") if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise ConfigError(
            f"{model_dir}/tokenizer.model is a SentencePiece model, which specserve converts with "
            f"transformers; that needs {' and '.join(missing)} (pip install sentencepiece protobuf). "
            "Or convert it once: AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes "
            "tokenizer.json"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False).backend_tokenizer
    except Exception as e:  # transformers raises many kinds; the file and the way out matter
        raise ConfigError(
            f"{model_dir}/tokenizer.model could not be converted to a fast tokenizer ({e}); save a "
            "tokenizer.json beside it"
        ) from None


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        from specserve.model.gguf import find_gguf, hf_config, tokenizer_parts

        model_dir = Path(model_dir)
        gguf_file = find_gguf(model_dir)
        side_configs: list[dict] = []  # where EOS ids beyond the tokenizer's own eos_token are declared
        if gguf_file is not None:
            self.kind = "GGUF"
            self.tok, self.config = tokenizer_parts(gguf_file)
            side_configs.append(hf_config(gguf_file))
        else:
            self.kind = tokenizer_kind(model_dir)
            cfg_path = model_dir / "tokenizer_config.json"
            self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
            if self.kind == "tokenizer.json":
                self.tok = HFTokenizer.from_file(str(model_dir / self.kind))
            elif self.kind == "tiktoken.model":
                from specserve.engine.tiktoken_vocab import TiktokenVocab

                self.tok = TiktokenVocab.from_dir(model_dir, self.config)
            else:
                self.tok = _sentencepiece(model_dir)
            tmpl = model_dir / "chat_template.jinja"
            if self.config.get("chat_template") is None and tmpl.exists():
                self.config["chat_template"] = tmpl.read_text()
            side_configs += [
                json.loads(p.read_text())
                for p in (model_dir / "generation_config.json", model_dir / "config.json")
                if p.exists()
            ]
        self.chat_template = self.config.get("chat_template")
        self.bos_token = self._token_text(self.config.get("bos_token"))
        self.eos_token = self._token_text(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.tok.token_to_id(self.eos_token))
        # A multimodal wrapper (Kimi-K2.5) declares its language model's end of turn in text_config.
        side_configs += [side["text_config"] for side in side_configs if isinstance(side.get("text_config"), dict)]
        for side in side_configs:
            eos = side.get("eos_token_id")
            if eos is not None:
                self.eos_token_ids.update(eos if isinstance(eos, list) else [eos])
        self.vocab_size = self.tok.get_vocab_size()
        added = self.tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        specials = {i for i, t in added.items() if t.special}
        self._kept = {i for i in specials if added[i].content in STRUCTURE_TOKENS}
        self._skipped = specials - self._kept
        self._byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: byte-level BPE tokens may hold part of a UTF-8
        character, which decoding the token alone would turn into U+FFFD."""
        got = self._bytes.get(token_id)
        if got is None:
            if hasattr(self.tok, "token_bytes"):
                got = self.tok.token_bytes(token_id)
            elif token_id in self._added:
                got = self._added[token_id].encode()
            elif self._byte_level:
                table = _unicode_to_byte()
                got = bytes(table[c] for c in self.tok.id_to_token(token_id) or "")
            else:
                piece = self.tok.id_to_token(token_id) or ""
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
                    got = bytes([int(piece[3:5], 16)])
                else:
                    got = self.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = got
        return got

    @staticmethod
    def _token_text(tok) -> str | None:
        if isinstance(tok, dict):
            return tok.get("content")
        return tok

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.tok.token_to_id(self.bos_token), *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._kept:  # skip the special tokens but the structure markers
            return self.tok.decode([i for i in ids if i not in self._skipped], skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    @functools.cached_property
    def end_of_turn_id(self) -> int | None:
        """The special token the chat template closes an assistant turn with (<|im_end|>,
        <|eot_id|>, ...), read by rendering a one-exchange conversation: chat replies stop
        there even where generation_config.json does not list it as an EOS."""
        probe = "specserve probe reply"
        try:
            text = self.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                add_generation_prompt=False,
            )
        except Exception:  # no template, or one that refuses this conversation: nothing to learn
            return None
        after = text.partition(probe)[2].lstrip()
        specials = sorted(
            (t.content for t in self.tok.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )
        for content in specials:
            if content and after.startswith(content):
                return self.tok.token_to_id(content)
        return None

    @functools.cached_property
    def _compiled_template(self):
        return compile_template(self.chat_template)

    @functools.cached_property
    def template_features(self):
        """What the chat template can render (tools, a thinking switch, reasoning and tool-call markers)."""
        return template_features(self.chat_template) if self.chat_template else None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """The conversation as the model reads it; `kwargs` are a request's chat_template_kwargs
        (thinking / enable_thinking, ...), which the template reads as variables."""
        if not self.chat_template:
            raise ConfigError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        return self._compiled_template.render(
            **template_kwargs(self.template_features, kwargs),
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


_BYTE_TABLE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes: printable Latin-1 bytes stand for themselves,
    the other 68 bytes for code points 256.. in byte order."""
    if not _BYTE_TABLE:
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        others = [b for b in range(256) if b not in printable]
        _BYTE_TABLE.update({chr(b): b for b in printable})
        _BYTE_TABLE.update({chr(256 + i): b for i, b in enumerate(others)})
    return _BYTE_TABLE


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back bytes
    of an unfinished UTF-8 character (byte-level BPE splits characters).

    Only a short window is re-decoded per push (from `prefix`, a few tokens
    before the text already emitted), so a long stream costs O(new tokens).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # window start
        self.read = 0  # ids[:read] are fully emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

        before = decode(self.ids[self.prefix : self.read])
        window = decode(self.ids[self.prefix :])
        if window.endswith("\ufffd") or len(window) <= len(before):
            return ""  # wait for the rest of the character
        delta = window[len(before) :]
        self.text += delta
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return delta
