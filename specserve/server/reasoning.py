"""A thinking model's reply split into `reasoning_content` and `content`, whole or as a stream of deltas.

The markers come from the model family (the chat template's own) or `--reasoning-parser`. Where the reply
starts is read from the prompt: a generation prompt that opens the block (Kimi-K2.5 with thinking on ends
with `<think>`) starts the reply inside it; one that closes it (`<think></think>`: thinking off) leaves
the whole reply as content; otherwise a reply that opens with the start marker reasons first (Qwen3)."""

from __future__ import annotations

from specserve.engine.chat_template import REASONING_MARKERS, TemplateFeatures

# --reasoning-parser names: the marker families, and the names vLLM and SGLang users know them by.
PARSER_ALIASES = {"deepseek_r1": "think", "qwen3": "think", "kimi_k2": "think", "kimi": "kimi_vl"}
PARSER_CHOICES = ("auto", "none", *REASONING_MARKERS, *PARSER_ALIASES)


def resolve_parser(name: str, features: TemplateFeatures | None) -> str | None:
    """The marker family a server splits replies with: `auto` takes the chat template's, `none` none."""
    if name == "none":
        return None
    if name == "auto":
        return features.reasoning if features is not None else None
    return PARSER_ALIASES.get(name, name)


class ReasoningSplitter:
    """Feeds on the reply's text deltas; each push returns (reasoning delta, content delta). Text that may
    be the start of a marker is held back until the next push (or `finish`) decides."""

    def __init__(self, family: str, prompt: str):
        self.start, self.end = REASONING_MARKERS[family]
        tail = prompt.rstrip()
        self.mode = "reasoning" if tail.endswith(self.start) else "content" if tail.endswith(self.end) else "opening"
        self.held = ""
        self.entered = self.mode == "reasoning"  # the reply has a reasoning part (maybe empty)

    def push(self, text: str) -> tuple[str, str]:
        buf = self.held + text
        self.held = ""
        reasoning = ""
        if self.mode == "opening":
            lead = buf.lstrip()
            if lead.startswith(self.start):
                buf, self.mode, self.entered = lead[len(self.start) :], "reasoning", True
            elif self.start.startswith(lead):  # a start marker may still be coming
                self.held = buf
                return "", ""
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            before, found, after = buf.partition(self.end)
            if not found:
                keep = _marker_prefix_len(buf, self.end)
                self.held = buf[len(buf) - keep :] if keep else ""
                return buf[: len(buf) - keep], ""
            reasoning, buf, self.mode = before, after, "content"
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply is complete."""
        held, self.held = self.held, ""
        return (held, "") if self.mode == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply: (reasoning or None when the reply has none, content)."""
        reasoning, content = self.push(text)
        r, c = self.finish()
        reasoning, content = reasoning + r, content + c
        return (reasoning if self.entered else None), content


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
