"""`response_format`: plain text, any JSON object, or JSON following a schema (OpenAI's shapes),
turned into the grammar the engine enforces; schemas the grammar engine cannot compile are
refused with a 400 naming where they sit."""

from __future__ import annotations

import json

from specserve.constrain.grammar import GrammarSpec, engine_message
from specserve.server.protocol import bad, show


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
        raise bad(f'response_format.type must be "text", "json_object" or "json_schema", got {show(kind)}',
                  "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad('response_format.json_schema must be {"name": ..., "schema": {...}, "strict": bool}',
                  "response_format")
    name, strict = spec.get("name"), spec.get("strict", False)
    if name is not None and not isinstance(name, str):
        raise bad("response_format.json_schema.name must be a string", "response_format")
    if not isinstance(strict, bool) and strict is not None:
        raise bad(f"response_format.json_schema.strict must be a boolean, got {show(strict)}", "response_format")
    schema = spec.get("schema", {})
    check_schema(schema, "response_format.json_schema.schema", "response_format", bool(strict))
    return GrammarSpec("json_schema", json.dumps(schema), strict=bool(strict))


def check_schema(schema: dict, where: str, param: str, strict: bool = True) -> None:
    """Refuse a JSON schema the grammar engine cannot compile, naming where it sits."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
    except (RuntimeError, ValueError, TypeError, RecursionError) as e:
        raise bad(f"{where} is not a JSON schema this server can enforce: {engine_message(e)}", param,
                  "invalid_schema") from None
