"""OpenAI request validation and response shapes.

Validation is explicit (no pydantic models) so that every refusal is a 4xx in
OpenAI's error shape naming the offending parameter, never a 422 or a 500.
Unknown fields are ignored, as clients send many optional ones; fields we
cannot honour (echo, penalties, ...) are refused rather than
silently ignored. `tools` / `tool_choice` are checked in server.tool_calls, `response_format`
in server.structured.

Log-probabilities (completions `logprobs: int`, chat `logprobs: true` + `top_logprobs`)
are the target's raw distribution at temperature 1 (engine.logprobs), after the grammar's
mask for constrained requests, one entry per generated token, including the tokens of a
matched stop string that the text leaves out.
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.constrain.grammar import GrammarSpec
from specserve.engine.logprobs import TokenLogprob
from specserve.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from specserve.server.errors import bad, show  # (handlers read them as bad, ...)

MAX_STOP = 4  # as OpenAI
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP_TOKEN_IDS = 64
MAX_USER_CHARS = 256  # the `user` field names a tenant (suffix speculation keeps one history per tenant)
MAX_JSON_DEPTH = 32  # no request field nests deeper; deeper bodies are refused before anything walks them
MAX_SEED = 2**63 - 1  # seeds (and any integer option) travel to the device as int64
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's /v1/completions
# Beyond these the float32 sampling arithmetic overflows or underflows (logits / T, the top-p mass test).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
MIN_TOP_P = 1e-6
# "developer" is OpenAI's newer name for "system"; templates know only the older one.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# ------------------------------------------------------------------ bodies
def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, refused with a 400 when it is not valid
    JSON, nests deeper than MAX_JSON_DEPTH or holds text that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(f"the JSON body nests too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Walk the body without recursion: bounded depth, and every string encodable
    as UTF-8 (JSON may carry lone surrogates such as \\ud800, which no tokenizer takes)."""
    stack: list[tuple[Any, int, tuple]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(f"{_path(path)} nests too deeply (at most {MAX_JSON_DEPTH} levels)", _param(path), "invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, v in items:
            for text in (key, v) if isinstance(key, str) else (v,):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        where = _path((*path, key))
                        raise bad(
                            f"{where} contains a lone UTF-16 surrogate (e.g. \\ud800): send valid Unicode text",
                            _param((*path, key)),
                            "invalid_text",
                        ) from None
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, (*path, key)))


def _path(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "the body"


def _param(path: tuple) -> str | None:
    return path[0] if path and isinstance(path[0], str) else None


# ------------------------------------------------------------------ fields
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if body.get("echo"):
        raise bad(
            "echo is not supported by this server (prompt tokens get no log-probabilities): leave it unset",
            "echo",
            "unsupported_parameter",
        )
    if body.get("suffix"):
        raise bad("suffix is not supported by this server", "suffix", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and (not _is_num(v) or v != 0):
            raise bad(f"{name} is not supported (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    # sampling extensions of other servers: ignoring one would silently change what is sampled
    for name, neutral in (("min_p", 0), ("repetition_penalty", 1), ("typical_p", 1)):
        v = body.get(name)
        if v is not None and (not _is_num(v) or v != neutral):
            raise bad(f"{name} is not supported (only {neutral}, its neutral value)", name, "unsupported_parameter")
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name) is not None:
                raise bad(f"{name} belongs to chat completions (/v1/chat/completions)", name, "unsupported_parameter")


@dataclass
class Sampling:
    """The validated generation options of one request."""

    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None = as much as the context allows (chat) / 16 (completions)
    max_tokens_field: str  # the name the client used: max_tokens or (chat) max_completion_tokens
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None = None  # alternatives per token with log-probabilities (None: none reported)
    tenant: str | None = None  # the OpenAI `user` field: whose finished texts suffix speculation may draft from
    reasoning: tuple[str, str] | None = None  # chat: (marker family, rendered prompt) to split replies by
    grammar: GrammarSpec | None = None  # what the output must follow (response_format, a required tool call)

    def params_for(self, choice: int, max_tokens: int) -> SamplingParams:
        # Distinct seeds make n > 1 choices differ when sampling; greedy ignores them.
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            tenant=self.tenant,
            grammar=self.grammar,
        )


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to report with log-probabilities; None: no log-probabilities."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise bad(
                "top_logprobs belongs to chat completions; /v1/completions takes logprobs: <0..5>", "top_logprobs"
            )
        k = body.get("logprobs")
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise bad(
                f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS} (alternatives per token), got {show(k)}",
                "logprobs",
            )
        return k
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad(
            f"logprobs must be a boolean for chat completions (top_logprobs sets the alternatives), got {show(on)}",
            "logprobs",
        )
    k = body.get("top_logprobs")
    if k is None:
        return 0 if on else None
    if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {show(k)}", "top_logprobs")
    if not on:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return k


def parse_sampling(body: dict, chat: bool, max_n: int, vocab_size: int) -> Sampling:
    """Every generation option range-checked, so that what reaches the engine can
    always be packed into its batch tensors (int64, finite float32)."""
    _refuse_unsupported(body, chat)

    def get(name: str, default: Any) -> Any:
        v = body.get(name)
        return default if v is None else v

    n = get("n", 1)
    if not _is_int(n) or not 1 <= n <= max_n:
        raise bad(f"n must be an integer in 1..{max_n}, got {show(n)}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of is not supported (it must equal n)", "best_of", "unsupported_parameter")
    stream = get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {show(stream)}", "stream")
    opts = get("stream_options", {})
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    if opts and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise bad(f"{name} must be a positive integer, got {show(max_tokens)}", name)
    temperature = get("temperature", 1.0)
    if not _is_num(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise bad(
            f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {show(temperature)}",
            "temperature",
        )
    top_p = get("top_p", 1.0)
    if not _is_num(top_p) or not MIN_TOP_P <= top_p <= 1:
        raise bad(f"top_p must be a number in [{MIN_TOP_P}, 1], got {show(top_p)}", "top_p")
    top_k = get("top_k", 0)  # extension; -1 (vLLM) and 0 both mean off
    if not _is_int(top_k) or not -1 <= top_k <= MAX_SEED:
        raise bad(f"top_k must be an integer in 0..{MAX_SEED} (0 or -1 = off), got {show(top_k)}", "top_k")
    if top_k >= vocab_size:  # keeps the whole vocabulary: the same as no top-k
        top_k = 0
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise bad(f"seed must be an integer in 0..{MAX_SEED}, got {show(seed)}", "seed")
    stop = get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    stop_ids = get("stop_token_ids", [])  # extension
    if (
        not isinstance(stop_ids, list)
        or len(stop_ids) > MAX_STOP_TOKEN_IDS
        or not all(_is_int(t) and 0 <= t < vocab_size for t in stop_ids)
    ):
        raise bad(
            f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in 0..{vocab_size - 1}",
            "stop_token_ids",
        )
    ignore_eos = get("ignore_eos", False)  # extension
    if not isinstance(ignore_eos, bool):
        raise bad(f"ignore_eos must be a boolean, got {show(ignore_eos)}", "ignore_eos")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad(f"user must be a string of at most {MAX_USER_CHARS} characters, got {show(user)}", "user")
    return Sampling(
        n=n,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        max_tokens_field=name,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        logprobs=parse_logprobs(body, chat),
        tenant=user or None,
    )


def parse_prompts(body: dict) -> list[str | list[int]]:
    """/v1/completions `prompt`: a string, a list of strings, a list of token
    ids, or a list of token-id lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
        prompts = list(p)
    else:
        raise bad(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    return prompts


def parse_messages(body: dict) -> list[dict]:
    """/v1/chat/completions `messages`, with content parts flattened to text."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = CHAT_ROLES.get(m["role"])
        if role is None:
            raise bad(
                f"messages[{i}].role {show(m['role'])} is not supported: use one of {', '.join(CHAT_ROLES)}", "messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        msg = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = check_tool_calls(m["tool_calls"], i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"messages[{i}] (role tool) needs tool_call_id: the id of the call it answers", "messages")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def check_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, checked (arguments must be JSON object text)."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad(
                f'{where} must be {{"id": ..., "type": "function", "function": {{"name": str, "arguments": str}}}}',
                "messages",
            )
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad(
                f"{where}.function.arguments must be a JSON object as text, got {show(fn['arguments'])}", "messages"
            )
        out.append(
            {
                "id": str(c.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


# --------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class LogprobWriter:
    """One choice's log-probabilities in OpenAI's shapes, fed in order, a step's tokens at a time
    (streaming sends each piece with its chunk). Completions' `text_offset` counts characters of
    the generated tokens' text before each token."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("ignore")

    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:  # part of a character: named by its bytes, as OpenAI does
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def piece(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text, raw = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets, tops = [], [], []
        for e in entries:
            text, raw = self._token(e.token)
            tokens.append(text)
            offsets.append(self.chars)
            self.chars += len(self._utf8.decode(raw))
            # The sampled token is always listed, so a dict may hold one more than asked (as OpenAI).
            top = {self._token(t)[0]: lp for t, lp in e.top}
            top.setdefault(text, e.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }
