"""Chat templates as repositories ship them (chat_template.jinja, or `chat_template` in tokenizer_config.json),
rendered as transformers renders them: a sandboxed Jinja environment with loop controls, transformers'
`tojson` (no HTML escaping, `separators`, `indent`), `raise_exception` and `strftime_now`. What a template
can do (a tool section, a thinking switch, reasoning markers) is read from its source, so `check` can
report it and the server can choose a reasoning parser."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

# Switches templates read to turn thinking on or off: Kimi-K2.5 reads `thinking`, Qwen3 `enable_thinking`.
THINKING_SWITCHES = ("thinking", "enable_thinking")
# Reasoning delimiters by family: `<think>` (DeepSeek-R1, Qwen3, Kimi-K2 thinking) and Kimi-VL's own markers.
REASONING_MARKERS = {"think": ("<think>", "</think>"), "kimi_vl": ("◁think▷", "◁/think▷")}
# Tool-call markers in a template's assistant section, by format.
TOOL_CALL_MARKERS = {"kimi_k2": "<|tool_calls_section_begin|>", "hermes": "<tool_call>"}


def _raise(message: str):
    raise ValueError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str):
    """The template compiled once: compiling costs ~100x a render."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    return env.from_string(source)


@dataclass(frozen=True)
class TemplateFeatures:
    tools: bool  # renders the request's `tools`
    thinking_switch: str | None  # the variable that turns thinking off (thinking / enable_thinking), if any
    reasoning: str | None  # the reasoning markers' family (REASONING_MARKERS), if the template writes any
    tool_calls: str | None  # the tool-call format whose markers the template writes (TOOL_CALL_MARKERS)

    def words(self) -> str:
        parts = [
            "tools" if self.tools else "no tool section",
            f"thinking switch '{self.thinking_switch}'" if self.thinking_switch else "no thinking switch",
            f"reasoning markers {' '.join(REASONING_MARKERS[self.reasoning])}"
            if self.reasoning
            else "no reasoning markers",
        ]
        if self.tool_calls:
            parts.append(f"tool calls as {self.tool_calls} ({TOOL_CALL_MARKERS[self.tool_calls]})")
        return ", ".join(parts)


def template_features(source: str) -> TemplateFeatures:
    from jinja2 import Environment, meta
    from jinja2.ext import loopcontrols

    names = meta.find_undeclared_variables(Environment(extensions=[loopcontrols]).parse(source))
    switch = next((s for s in THINKING_SWITCHES if s in names), None)
    reasoning = next((fam for fam, (start, _) in REASONING_MARKERS.items() if start in source), None)
    calls = next((fmt for fmt, marker in TOOL_CALL_MARKERS.items() if marker in source), None)
    return TemplateFeatures("tools" in names, switch, reasoning, calls)


def template_kwargs(features: TemplateFeatures, kwargs: dict) -> dict:
    """A request's chat_template_kwargs with its thinking switch under the name this template reads
    (`enable_thinking` sent to a template reading `thinking`, or the other way round)."""
    out = dict(kwargs)
    want = features.thinking_switch
    for name in THINKING_SWITCHES:
        if want and name != want and name in out and want not in out:
            out[want] = out.pop(name)
    return out
