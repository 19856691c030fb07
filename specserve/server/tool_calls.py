"""Tool calls: a request's `tools` and `tool_choice` checked, the grammar that enforces
`required` / named calls, and the model's output parsed into OpenAI `tool_calls`.

Each model family writes calls its own way (`FORMATS`): Hermes / Qwen `<tool_call>{json}</tool_call>`,
Llama-3.1 bare JSON `{"name": ..., "parameters": ...}`, Kimi-K2's call section
(`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
<|tool_call_end|>...<|tool_calls_section_end|>`). The format is read from the chat template or set
with `--tool-call-parser`. Output that does not parse as the format's calls (a botched call) is
returned as plain content, never an error. `tool_choice: required` and a named function are
enforced by a grammar: exactly one call, in the format, its arguments following the tool's
parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.constrain.grammar import GrammarSpec
from specserve.server.errors import bad, show
from specserve.server.structured import MAX_SCHEMA_VALUES, check_schema, json_values

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""


# ------------------------------------------------------------------ formats
class Format:
    """One family's call syntax: how a call is written (for grammars and for conversations whose
    template cannot render calls) and how text is parsed back into calls."""

    name = ""
    start = ""  # text that opens the calls (everything before it is content)
    markers: tuple[str, ...] = ()  # special tokens of the syntax (kept when decoding)
    whole_reply = False  # calls are the whole reply (no content beside them)

    def write(self, calls: list[Call]) -> str:
        raise NotImplementedError

    def call_affixes(self, name: str) -> tuple[str, str]:
        """(text before, text after) the arguments of one call to `name`, as `write` puts them."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        """(content before the calls, the calls); None where `text` holds no well-formed calls."""
        raise NotImplementedError


def _arguments(value) -> str | None:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class Hermes(Format):
    name, start = "hermes", "<tool_call>"
    end = "</tool_call>"

    def write(self, calls: list[Call]) -> str:
        return "".join(f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>' for c in calls)

    def call_affixes(self, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        head, found, rest = text.partition(self.start)
        if not found:
            return None
        calls, i = [], len(head)
        while i < len(text):
            if not text.startswith(self.start, i):
                return None  # text between or after calls: not the format's call section
            got = _json_at(text, i + len(self.start))
            if got is None:
                return None
            obj, i = got
            args = _arguments(obj.get("arguments")) if isinstance(obj, dict) else None
            if args is None or not _named(obj.get("name")) or not text.startswith(self.end, i):
                return None
            calls.append(Call(obj["name"], args))
            i = _skip_space(text, i + len(self.end))
        return head, calls


def _named(name) -> bool:
    return isinstance(name, str) and NAME_RE.match(name) is not None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _json_at(text: str, i: int) -> tuple[object, int] | None:
    """The JSON value at text[i:] (leading white space skipped) and where the space after it ends."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text, _skip_space(text, i))
    except ValueError:
        return None
    return obj, _skip_space(text, end)


class Llama3Json(Format):
    name, start = "llama3_json", "{"
    whole_reply = True
    _tag = "<|python_tag|>"
    openings = ("{", _tag)

    def write(self, calls: list[Call]) -> str:
        return "; ".join(f'{{"name": "{c.name}", "parameters": {c.arguments}}}' for c in calls)

    def call_affixes(self, name: str) -> tuple[str, str]:
        return f'{{"name": "{name}", "parameters": ', "}"

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        body = text.strip().removeprefix(self._tag).strip()
        if not body.startswith("{"):
            return None
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                return None
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if _arguments(args) is None or not _named(obj.get("name")):
                return None
            calls.append(Call(obj["name"], _arguments(args)))
            rest = body[i:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            i = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return "", calls


class KimiK2(Format):
    name, start = "kimi_k2", "<|tool_calls_section_begin|>"
    end = "<|tool_calls_section_end|>"
    begin, argument, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    markers = (start, end, begin, argument, call_end)
    _header = re.compile(
        r"<\|tool_call_begin\|>\s*(?:functions\.)?([A-Za-z0-9_-]{1,64}):(\d+)\s*"
        r"<\|tool_call_argument_begin\|>"
    )

    def write(self, calls: list[Call]) -> str:
        body = "".join(
            f"{self.begin}functions.{c.name}:{i}{self.argument}{c.arguments}{self.call_end}"
            for i, c in enumerate(calls)
        )
        return f"{self.start}{body}{self.end}"

    def call_affixes(self, name: str) -> tuple[str, str]:
        return f"{self.start}{self.begin}functions.{name}:0{self.argument}", f"{self.call_end}{self.end}"

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        head, found, rest = text.partition(self.start)
        if not found:
            return None
        section, closed, after = rest.partition(self.end)
        if not closed or after.strip():
            return None
        calls, i = [], _skip_space(section, 0)
        while i < len(section):
            m = self._header.match(section, i)
            got = _json_at(section, m.end()) if m else None
            if got is None:
                return None
            args, i = _arguments(got[0]), got[1]
            if args is None or not section.startswith(self.call_end, i):
                return None
            calls.append(Call(m.group(1), args, id=f"functions.{m.group(1)}:{m.group(2)}"))
            i = _skip_space(section, i + len(self.call_end))
        if not calls:
            return None
        return head, calls


FORMATS: dict[str, Format] = {f.name: f for f in (Hermes(), Llama3Json(), KimiK2())}


def format_for(chat_template: str | None, override: str | None = None) -> Format:
    """The tool-call format: `override` (--tool-call-parser), else the one the chat template writes,
    else Hermes (the most common among open models)."""
    if override:
        return FORMATS[override]
    t = chat_template or ""
    if KimiK2.start in t:
        return FORMATS["kimi_k2"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


# ------------------------------------------------------------------ requests
@dataclass
class ToolRequest:
    tools: list[Tool]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    template_tools: list[dict] | None = None  # the tools as the template receives them

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def parse_tools(body: dict) -> ToolRequest:
    """`tools` and `tool_choice` checked, each refusal naming the offending part."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad(
                f"{legacy} is the deprecated form of tools: send tools and tool_choice instead",
                legacy,
                "unsupported_parameter",
            )
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    tools, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise bad(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {show(name)}", "tools")
        if name in seen:
            raise bad(f"{where}.function.name {name!r} is given twice: tool names must be unique", "tools")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description must be a string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object, got {show(params)}", "tools")
        check_schema(params, f"{where}.function.parameters", "tools")
        tools.append(Tool(name, params))
    if json_values(raw) > MAX_SCHEMA_VALUES:
        raise bad(f"tools are too large: at most {MAX_SCHEMA_VALUES} JSON values in all their definitions", "tools")
    choice = body.get("tool_choice")
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        named, choice = fn["name"], "named"
        if named not in seen:
            raise bad(f"tool_choice names {show(named)}, which is not among tools", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad(
            f'tool_choice must be "none", "auto", "required" or a named function, got {show(choice)}', "tool_choice"
        )
    if choice in ("required", "named", "auto") and not tools and body.get("tool_choice") is not None:
        raise bad(f"tool_choice {show(body.get('tool_choice'))} needs tools", "tool_choice")
    return ToolRequest(tools, choice, named, raw or None)


def call_grammar(req: ToolRequest, fmt: Format) -> GrammarSpec | None:
    """The grammar of `required` (one call to any tool) or a named call; None otherwise."""
    if req.choice not in ("required", "named"):
        return None
    import xgrammar as xgr

    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    calls = []
    for tool in req.tools:
        if req.choice == "named" and tool.name != req.named:
            continue
        before, after = fmt.call_affixes(tool.name)
        args = xgr.Grammar.from_json_schema(json.dumps(tool.parameters), any_whitespace=False)
        calls.append(xgr.Grammar.concat(literal(before), args, literal(after)))
    grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    return GrammarSpec("ebnf", str(grammar), markers=fmt.markers)


# ------------------------------------------------------------------ messages
def conversation(messages: list[dict], fmt: Format, template: str | None) -> list[dict]:
    """Messages for the chat template: an assistant's earlier calls as the template expects them
    (`tool_calls` with arguments as objects), or written into its content in the model's format
    where the template knows no `tool_calls`."""
    renders_calls = "tool_calls" in (template or "")
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and not renders_calls:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = m["content"] + fmt.write(
                [Call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            )
        elif calls:
            m = {
                **m,
                "tool_calls": [
                    {
                        **c,
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": json.loads(c["function"]["arguments"]),
                        },
                    }
                    for c in calls
                ],
            }
        out.append(m)
    return out


# ------------------------------------------------------------------ responses
def openai_calls(calls: list[Call]) -> list[dict]:
    return [
        {
            "id": c.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def parse_output(text: str, fmt: Format) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply; a reply that holds no well-formed calls is all content."""
    parsed = fmt.parse(text)
    if parsed is None:
        return text, []
    head, calls = parsed
    return (head.strip() or None), openai_calls(calls)


class CallStream:
    """A streamed reply's deltas: content flows until the format's opening text could begin, the rest
    is held back and parsed when the reply ends, then sent as whole tool calls (one delta each,
    with its complete arguments) or, where it does not parse, as content."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calls = 0

    def _held_from(self) -> int:
        """Where the text that may be calls begins (len(text): nowhere yet)."""
        if self.fmt.whole_reply:  # calls are the whole reply: held while it may still open with one
            head = self.text.lstrip()
            opens = not head or head.startswith(self.fmt.openings) or any(o.startswith(head) for o in self.fmt.openings)
            return 0 if self.sent == 0 and opens else len(self.text)
        start = self.fmt.start
        i = self.text.find(start, self.sent)
        if i >= 0:
            return i
        for k in range(min(len(start) - 1, len(self.text) - self.sent), 0, -1):  # a prefix of the opening
            if self.text.endswith(start[:k]):
                return len(self.text) - k
        return len(self.text)

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        end = self._held_from()
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : end], end
        return [{"content": piece}]

    def finish(self) -> list[dict]:
        rest = self.text[self.sent :]
        if not rest:
            return []
        parsed = self.fmt.parse(rest)
        if parsed is None:
            self.sent = len(self.text)
            return [{"content": rest}]
        head, calls = parsed
        out = [{"content": head}] if head.strip() else []
        for i, c in enumerate(openai_calls(calls)):
            out.append({"tool_calls": [{"index": i, **c}]})
        self.calls = len(calls)
        self.sent = len(self.text)
        return out
