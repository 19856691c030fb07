"""tiktoken-format BPE vocabularies (`tiktoken.model`: a base64 token, a space and its rank per line), as the
Kimi-K2 family ships them, encoded by the `tiktoken` package. No repository code runs: the ranks are read
as data, the split pattern is taken from tokenizer_config.json where the repository states it (`pat_str`)
and built in for the known families, the special tokens and their ids come from `added_tokens_decoder`.

`TiktokenVocab` offers the part of `tokenizers.Tokenizer`'s interface that specserve's `Tokenizer` reads,
so either backs it."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from specserve.config import ConfigError

# Kimi-K2's split (tokenization_kimi.py's pat_str, public): Han runs apart from other letters, cased
# words with English contractions, numbers in runs of up to three digits. `&&` is a class intersection,
# which tiktoken's regex engine supports.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        (
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
            r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
        ),
        (
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
            r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
        ),
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Families whose tokenizer code carries the pattern: tokenizer_config.json's tokenizer_class -> pattern.
BUILT_IN_PATTERNS = {"TikTokenTokenizer": KIMI_PATTERN}
# Kimi's tokenizer reserves this many ids after the ranks for special tokens, named or not.
KIMI_RESERVED_SPECIALS = 256


@dataclass(frozen=True)
class SpecialToken:
    """An entry of added_tokens_decoder, shaped like tokenizers.AddedToken where specserve reads one."""

    content: str
    special: bool = True


class _Encoding:
    def __init__(self, ids: list[int]):
        self.ids = ids


def read_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken.model file, refused by line when one is malformed."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ConfigError(f"{path}: line {n} is not '<base64 token> <rank>' ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: the ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    )


class TiktokenVocab:
    def __init__(self, ranks: dict[bytes, int], pattern: str, specials: dict[int, SpecialToken]):
        import tiktoken

        self.ranks = ranks
        self.specials = specials
        self.special_ids = {t.content: i for i, t in specials.items()}
        self.enc = tiktoken.Encoding(
            "specserve", pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        self._bytes = {r: t for t, r in ranks.items()} | {i: t.content.encode() for i, t in specials.items()}
        self.decoder = None  # no tokenizers decoder: token_bytes holds each token's bytes

    @classmethod
    def from_dir(cls, model_dir: Path, config: dict) -> TiktokenVocab:
        path = model_dir / "tiktoken.model"
        ranks = read_ranks(path)
        pattern = config.get("pat_str") or BUILT_IN_PATTERNS.get(config.get("tokenizer_class", ""))
        if pattern is None:
            raise ConfigError(
                f"{path}: no split pattern: tokenizer_config.json names no 'pat_str' and its "
                f"tokenizer_class {config.get('tokenizer_class')!r} is none of the known families "
                f"({', '.join(BUILT_IN_PATTERNS)}); add the pattern as 'pat_str'"
            )
        specials: dict[int, SpecialToken] = {}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not str(key).isdigit() or not isinstance(content, str):
                raise ConfigError(
                    f"{model_dir}/tokenizer_config.json: added_tokens_decoder entry {key!r} needs an "
                    "integer id and a 'content' string"
                )
            if int(key) < len(ranks):
                raise ConfigError(
                    f"{model_dir}/tokenizer_config.json: added token {content!r} has id {key}, "
                    f"inside the {len(ranks)} BPE ranks of {path.name}"
                )
            specials[int(key)] = SpecialToken(content, bool(entry.get("special", True)))
        if config.get("tokenizer_class") in BUILT_IN_PATTERNS:  # the family's unnamed reserved ids
            for i in range(len(ranks), len(ranks) + KIMI_RESERVED_SPECIALS):
                specials.setdefault(i, SpecialToken(f"<|reserved_token_{i}|>"))
        return cls(ranks, pattern, dict(sorted(specials.items())))

    # ---- the tokenizers.Tokenizer interface specserve's Tokenizer reads
    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        # Special-token text in the input is the special token, as a tokenizer.json's added tokens are.
        return _Encoding(self.enc.encode(text, allowed_special="all"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.specials or not self.specials[i].special]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._bytes[token_id]
        except KeyError:
            raise ValueError(f"token id {token_id} is outside this vocabulary of {self.get_vocab_size()}") from None

    def token_to_id(self, text: str) -> int | None:
        got = self.special_ids.get(text)
        return got if got is not None else self.ranks.get(text.encode())

    def id_to_token(self, token_id: int) -> str | None:
        raw = self._bytes.get(token_id)
        return None if raw is None else raw.decode("utf-8", errors="backslashreplace")

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return max(self._bytes) + 1 if with_added_tokens else len(self.ranks)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        ids = self._bytes if with_added_tokens else self.ranks.values()
        return {self.id_to_token(i): i for i in ids}

    def get_added_tokens_decoder(self) -> dict[int, SpecialToken]:
        return dict(self.specials)
