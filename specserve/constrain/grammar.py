"""Grammars a request constrains its output with, compiled for one tokenizer.

`GrammarSpec` is what travels with `SamplingParams` (plain, picklable text, so tensor-parallel
workers compile the same grammar); `Grammars` compiles specs for the engine's vocabulary and hands
out one `Matcher` per sequence. xgrammar is the engine: its per-token mask fill is the fastest of
the maintained engines on CPU (benchmarks/grammar_mask.py), and its matcher rolls back, which
speculative verification needs.

Special tokens (added tokens marked special) are left out of the grammar's vocabulary, so no
constrained output ever contains one, except the stop tokens (allowed where the grammar is
complete) and the `markers` a spec names (a tool-call format's section markers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the server's flags read this module; `serve --help` loads no torch)
    import torch

KINDS = ("json_schema", "json_object", "ebnf")
MAX_KEPT = 256  # compiled grammars kept for reuse (oldest dropped first)


class GrammarError(ValueError):
    """A spec the grammar engine cannot compile; the message names what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_schema (text: the schema as JSON), json_object (any JSON object) or ebnf (an
    xgrammar EBNF grammar, e.g. a tool-call format around its tools' parameter schemas); strict:
    for json_schema, objects admit no properties beyond those listed (OpenAI's `strict`)."""

    kind: str
    text: str = ""
    strict: bool = True
    markers: tuple[str, ...] = ()  # special tokens the grammar may emit

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")


def vocabulary(tokenizer, vocab_size: int, markers: tuple[str, ...], stops: list[int]) -> list[bytes]:
    """Each token id's bytes for the grammar engine; b"" (never allowed inside the grammar) for
    stop tokens, special tokens not in `markers` and ids past the tokenizer's vocabulary (a padded
    embedding)."""
    special = {i for i, t in tokenizer.tok.get_added_tokens_decoder().items() if t.special and t.content not in markers}
    special.update(stops)
    n = min(tokenizer.vocab_size, vocab_size)
    return [b"" if i in special else tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)


class Grammars:
    """Compiles `GrammarSpec`s for one tokenizer and model vocabulary (the logits' width);
    `stop_token_ids` end a sequence, allowed once its grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compilers: dict[tuple[str, ...], object] = {}
        self._compiled: dict[GrammarSpec, object] = {}

    def _compiler(self, markers: tuple[str, ...]):
        if markers not in self._compilers:
            self._compilers[markers] = self._new_compiler(markers)
        return self._compilers[markers]

    def _new_compiler(self, markers: tuple[str, ...]):
        import xgrammar as xgr

        vocab = vocabulary(self.tokenizer, self.vocab_size, markers, self.stop_token_ids)
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar (kept for the next request with the same spec); GrammarError naming
        the problem when it does not compile."""
        if spec not in self._compiled:
            if len(self._compiled) >= MAX_KEPT:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = self._compile(spec)
        return self._compiled[spec]

    def _compile(self, spec: GrammarSpec):
        compiler = self._compiler(spec.markers)
        try:
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:  # xgrammar's errors for bad input
            raise GrammarError(engine_message(e)) from None

    def matcher(self, spec: GrammarSpec, stop_token_ids: list[int] = ()) -> Matcher:
        """A matcher for one sequence; `stop_token_ids`: its own stop tokens beside the engine's."""
        return Matcher(self.compile(spec), self.vocab_size, sorted({*self.stop_token_ids, *stop_token_ids}))


def engine_message(e: Exception) -> str:
    """The grammar engine's error without its source location: what the client can act on."""
    text = str(e).strip()
    line = text.splitlines()[-1] if text else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)


class Matcher:
    """One sequence's grammar state. It advances only over emitted tokens (`accept`); speculative
    verification tries drafted tokens on it and rolls them back (`masks_along`)."""

    def __init__(self, compiled, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    @property
    def done(self) -> bool:
        return self.m.is_terminated()

    def fill(self, out: torch.Tensor) -> None:
        """The next token's allowed set as a bitmask row (int32, bit j of word i: id 32 i + j)."""
        if self.m.is_terminated():  # (only when the stop token is not the sequence's end: ignore_eos)
            out.fill_(-1)
            return
        self.m.fill_next_token_bitmask(out.view(1, -1))

    def masks_along(self, paths: list[list[int]], out: torch.Tensor) -> None:
        """out[i]: the mask after the tokens of paths[i] (each a path of drafted tokens from the
        current state). Where a path leaves the grammar, no token of it can be the target's
        (verification masks the position before), so its row allows every token: whatever is
        drawn there is never emitted."""
        for i, path in enumerate(paths):
            taken = 0
            for tok in path:
                if not self.m.accept_token(tok):
                    break
                taken += 1
            if taken == len(path):
                self.fill(out[i])
            else:
                out[i].fill_(-1)
            if taken:
                self.m.rollback(taken)
