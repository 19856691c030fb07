"""`response_format`: plain text, any JSON object, or JSON following a schema (OpenAI's shapes),
turned into the grammar the engine enforces; schemas the grammar engine cannot compile are
refused with a 400 naming where they sit."""

from __future__ import annotations

import json

from specserve.constrain.grammar import GrammarSpec, engine_message
from specserve.server.errors import bad, show

MAX_SCHEMA_VALUES = 10_000


def parse_response_format(body: dict) -> GrammarSpec | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad(
            f'response_format.type must be "text", "json_object" or "json_schema", got {show(kind)}', "response_format"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad(
            'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": bool}', "response_format"
        )
    name, strict = spec.get("name"), spec.get("strict", False)
    if name is not None and not isinstance(name, str):
        raise bad("response_format.json_schema.name must be a string", "response_format")
    if not isinstance(strict, bool) and strict is not None:
        raise bad(f"response_format.json_schema.strict must be a boolean, got {show(strict)}", "response_format")
    schema = spec.get("schema", {})
    check_schema(schema, "response_format.json_schema.schema", "response_format", bool(strict))
    return GrammarSpec("json_schema", json.dumps(schema), strict=bool(strict))


def check_schema(schema: dict, where: str, param: str, strict: bool = True) -> None:
    """Refuse a JSON schema the grammar engine cannot compile, or one so large that compiling it
    would hold the server for minutes (many alternatives of many optional properties), naming
    where it sits."""
    if json_values(schema) > MAX_SCHEMA_VALUES:
        raise bad(
            f"{where} is too large: at most {MAX_SCHEMA_VALUES} JSON values (keywords, properties, enum "
            f"entries) in all",
            param,
            "invalid_schema",
        )
    error = _schema_error(schema, strict)
    if error is not None:
        path = where + "".join(_locate(schema, strict, error))
        raise bad(f"{path} is not a JSON schema this server can enforce: {error}", param, "invalid_schema")


def _schema_error(schema, strict: bool) -> str | None:
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
    except (RuntimeError, ValueError, TypeError, RecursionError) as e:
        return engine_message(e)
    return None


def _locate(schema, strict: bool, error: str) -> list[str]:
    """The path (as ".properties.x" parts) of the innermost subschema that fails alone with the same
    error: the engine's message names no place."""
    path: list[str] = []
    while True:
        for key, child in _children(schema):
            if isinstance(child, dict) and _schema_error(child, strict) == error:
                path.append(key)
                schema = child
                break
        else:
            return path


def _children(schema: dict):
    for word in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(word), dict):
            yield from ((f".{word}.{k}", v) for k, v in schema[word].items())
    for word in ("items", "additionalProperties", "not", "contains"):
        yield f".{word}", schema.get(word)
    for word in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(word), list):
            yield from ((f".{word}[{i}]", v) for i, v in enumerate(schema[word]))


def json_values(tree) -> int:
    """JSON values in `tree`, counted without recursion."""
    count, stack = 0, [tree]
    while stack:
        v = stack.pop()
        count += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return count
