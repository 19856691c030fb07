"""Tokenizer from a local Hugging Face directory (tokenizer.json +
tokenizer_config.json) or a GGUF file's vocabulary, with EOS ids, the chat template and incremental
detokenization for streaming."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from specserve.config import ConfigError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        from specserve.model.gguf import find_gguf, hf_config, tokenizer_parts

        model_dir = Path(model_dir)
        gguf_file = find_gguf(model_dir)
        side_configs: list[dict] = []  # where EOS ids beyond the tokenizer's own eos_token are declared
        if gguf_file is not None:
            self.tok, self.config = tokenizer_parts(gguf_file)
            side_configs.append(hf_config(gguf_file))
        else:
            path = model_dir / "tokenizer.json"
            if not path.exists():
                raise ConfigError(f"{model_dir} has no tokenizer.json (a fast Hugging Face tokenizer is required)")
            self.tok = HFTokenizer.from_file(str(path))
            cfg_path = model_dir / "tokenizer_config.json"
            self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
            tmpl = model_dir / "chat_template.jinja"
            if self.config.get("chat_template") is None and tmpl.exists():
                self.config["chat_template"] = tmpl.read_text()
            side_configs += [json.loads(p.read_text()) for p in (model_dir / "generation_config.json",
                                                                  model_dir / "config.json") if p.exists()]
        self.chat_template = self.config.get("chat_template")
        self.bos_token = self._token_text(self.config.get("bos_token"))
        self.eos_token = self._token_text(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.tok.token_to_id(self.eos_token))
        for side in side_configs:
            eos = side.get("eos_token_id")
            if eos is not None:
                self.eos_token_ids.update(eos if isinstance(eos, list) else [eos])
        self.vocab_size = self.tok.get_vocab_size()
        self._added = {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()}
        self._byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: byte-level BPE tokens may hold part of a UTF-8
        character, which decoding the token alone would turn into U+FFFD."""
        got = self._bytes.get(token_id)
        if got is None:
            if token_id in self._added:
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
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def end_of_turn_id(self) -> int | None:
        """The special token the chat template closes an assistant turn with (<|im_end|>,
        <|eot_id|>, ...), read by rendering a one-exchange conversation: chat replies stop
        there even where generation_config.json does not list it as an EOS."""
        probe = "specserve probe reply"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": probe}], add_generation_prompt=False)
        except Exception:  # no template, or one that refuses this conversation: nothing to learn
            return None
        after = text.partition(probe)[2].lstrip()
        specials = sorted((t.content for t in self.tok.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        for content in specials:
            if content and after.startswith(content):
                return self.tok.token_to_id(content)
        return None

    @functools.cached_property
    def _compiled_template(self):
        """The chat template compiled once: compiling costs ~100x a render, which a trainer
        rendering thousands of conversations would pay each time."""
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ConfigError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools,
        )


def _raise(message: str):
    raise ValueError(message)


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

        before = decode(self.ids[self.prefix: self.read])
        window = decode(self.ids[self.prefix:])
        if window.endswith("\ufffd") or len(window) <= len(before):
            return ""  # wait for the rest of the character
        delta = window[len(before):]
        self.text += delta
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return delta
