"""Tool-call formats and request checks without a model: each format's calls written and parsed
back (whole and streamed a character at a time), botched calls returned as text, the format read
from chat templates, and the 400s for tools, tool_choice and response_format."""

from __future__ import annotations

import json

import pytest

from specserve.server.errors import APIError
from specserve.server.protocol import parse_messages
from specserve.server.structured import parse_response_format
from specserve.server.tool_calls import (
    FORMATS,
    Call,
    CallStream,
    call_grammar,
    conversation,
    format_for,
    parse_output,
    parse_tools,
)

CALLS = [
    Call("get_weather", '{"city": "Paris", "unit": "C"}'),
    Call("add", '{"a": 1, "b": [2, {"c": "}</tool_call>"}]}'),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _reply(fmt, calls) -> str:
    return fmt.write(calls) if fmt.whole_reply else "Let me check. " + fmt.write(calls)


def _streamed(fmt, text: str) -> tuple[str, list[dict]]:
    stream, deltas = CallStream(fmt), []
    for ch in text:
        deltas += stream.feed(ch)
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    return content, [d["tool_calls"][0] for d in deltas if "tool_calls" in d]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_calls_written_parse_back_whole_and_streamed(name):
    fmt = FORMATS[name]
    text = _reply(fmt, CALLS)
    content, calls = parse_output(text, fmt)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in CALLS
    ]
    assert content == (None if fmt.whole_reply else "Let me check.")
    assert len({c["id"] for c in calls}) == 2
    streamed_content, streamed = _streamed(fmt, text)
    assert [(c["index"], c["function"]) for c in streamed] == [(i, c["function"]) for i, c in enumerate(calls)]
    assert streamed_content.strip() == (content or "")
    if name == "kimi_k2":  # Kimi's call ids are its own `functions.NAME:IDX`
        assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.add:1"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_botched_calls_are_returned_as_text(name):
    fmt = FORMATS[name]
    good = _reply(fmt, CALLS[:1])
    for botched in (
        good[:-4],
        good.replace('"city"', "city"),
        good + " and more words",
        "plain words, no call",
        good.replace("get_weather", ""),
    ):
        content, calls = parse_output(botched, fmt)
        assert calls == [] and content == botched, (name, botched)
        assert _streamed(fmt, botched) == (botched, [])


def test_format_is_read_from_the_template_or_the_flag():
    assert format_for("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert format_for("... <|tool_calls_section_begin|> ...").name == "kimi_k2"
    assert format_for("{{ '<|python_tag|>' }} ipython").name == "llama3_json"
    assert format_for(None).name == "hermes"
    assert format_for("<tool_call>", "kimi_k2").name == "kimi_k2"


def _status(fn, *args):
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "body,part",
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"functions": [{"name": "f"}]}, "deprecated"),
    ],
)
def test_tool_requests_refused_naming_the_part(body, part):
    err = _status(parse_tools, body)
    assert part in err.message and err.param in ("tools", "tool_choice", "functions"), err.message


@pytest.mark.parametrize(
    "fmt,part",
    [
        ("json", "response_format.type"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}}, "Regex"),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "a": {"type": "integer"},
                            "b": {"type": "array", "items": {"type": "string", "pattern": "(("}},
                        },
                    }
                },
            },
            "response_format.json_schema.schema.properties.b.items is not",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}, "nowhere"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
            "minimum",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": list(range(20_000))}}}, "too large"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ],
)
def test_response_formats_refused_naming_the_part(fmt, part):
    err = _status(parse_response_format, {"response_format": fmt})
    assert part in err.message and err.param == "response_format", err.message
    assert "/project/" not in err.message  # the engine's source location is not the client's business


def test_tool_messages_and_earlier_calls_reach_the_template():
    msgs = parse_messages(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
            ]
        }
    )
    assert msgs[2] == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
    hermes = FORMATS["hermes"]
    plain = conversation(msgs, hermes, "{{ messages }}")  # a template that knows no tool_calls: written as text
    assert parse_output(plain[1]["content"], hermes)[1][0]["function"]["name"] == "get_weather"
    rich = conversation(msgs, hermes, "{% for c in m.tool_calls %}{% endfor %}")
    assert rich[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    for bad in (
        {"role": "tool", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
        {"role": "assistant", "tool_calls": "x"},
    ):
        _status(parse_messages, {"messages": [bad]})


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_required_and_named_grammars_wrap_the_parameter_schema(name):
    import xgrammar as xgr

    fmt = FORMATS[name]
    req = parse_tools(
        {
            "tools": [WEATHER, {"type": "function", "function": {"name": "ping"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    spec = call_grammar(req, fmt)
    grammar = xgr.Grammar.from_ebnf(spec.text)  # the text is a grammar xgrammar reads back
    assert grammar is not None and spec.markers == fmt.markers
    assert call_grammar(parse_tools({"tools": [WEATHER]}), fmt) is None  # auto: nothing enforced
