"""The FastAPI application: OpenAI-compatible routes, /health, /metrics and
/server_info, on top of an `EngineLoop` (which owns the engine thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import platform
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.constrain.grammar import GrammarError, Grammars
from specserve.server import protocol as P
from specserve.server import tool_calls as TC
from specserve.server.chat_request import chat_pieces, parse_template_kwargs, split_message
from specserve.server.engine_loop import EngineLoop, Event, Job, QueueFull
from specserve.server.errors import APIError, bad, error_body, show
from specserve.server.metrics import Metrics
from specserve.server.reasoning import ReasoningSplitter, resolve_parser
from specserve.server.structured import parse_response_format

# While a non-streaming request waits, check this often whether its client is still there.
DISCONNECT_POLL_S = 0.5


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_n: int = 8  # n above this is refused with 400
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    retry_after_s: int = 1  # Retry-After on 429 (queue full) and 503 (loading)
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    metrics_no_auth: bool = False  # with an API key, /metrics answers without it (for scrapers)
    reasoning_parser: str = "auto"  # --reasoning-parser: marker family, "auto" (the template's) or "none"
    tool_call_parser: str | None = None  # the tool-call format (server.tool_calls.FORMATS); None: from the template


@dataclass
class AppState:
    """What every route needs: the engine loop, the metrics and the server's settings."""

    loop: EngineLoop
    metrics: Metrics
    cfg: ServerConfig
    info: dict[str, Any] = field(default_factory=dict)  # static configuration shown by /server_info
    draining: bool = False  # shutting down: nothing new is admitted, running requests finish
    _text: "TextLimits | None" = None
    _grammars: Grammars | None = None

    def grammars(self, llm) -> Grammars:
        """The engine's grammar compiler (a tensor-parallel engine's lives in its workers: the server
        then compiles with its own, to refuse what cannot compile before it is sent)."""
        own = getattr(llm.engine, "grammars", None)
        if own is not None:
            return own
        if self._grammars is None:
            ends = {llm.tokenizer.end_of_turn_id} - {None}
            self._grammars = Grammars(
                llm.tokenizer, llm.engine.runner.model_cfg.vocab_size, set(llm.tokenizer.eos_token_ids) | ends
            )
        return self._grammars

    def tool_format(self, llm) -> TC.Format:
        return TC.format_for(llm.tokenizer.chat_template, self.cfg.tool_call_parser)

    def text_limits(self, tokenizer) -> "TextLimits":
        if self._text is None:  # computed once, in a worker thread (it reads the whole vocabulary)
            self._text = TextLimits.of(tokenizer)
        return self._text


@dataclass
class TextLimits:
    """What the tokenizer implies before any text is tokenized."""

    max_token_chars: int | None  # the longest vocabulary entry: a prompt of N tokens has <= N x this characters
    end_of_turn_id: int | None  # the special token the chat template closes an assistant turn with

    @classmethod
    def of(cls, tokenizer) -> "TextLimits":
        tok = getattr(tokenizer, "tok", None)  # the Hugging Face tokenizer inside specserve's wrapper
        if tok is None:
            return cls(None, None)
        return cls(max(map(len, tok.get_vocab(with_added_tokens=True))), tokenizer.end_of_turn_id)


def create_app(loop: EngineLoop, metrics: Metrics, cfg: ServerConfig, info: dict[str, Any] | None = None) -> FastAPI:
    """`info` is static configuration shown by /server_info (engine config, flags)."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.srv = AppState(loop, metrics, cfg, info or {})
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)
    app.include_router(v1)
    app.include_router(ops)
    return app


def state(request: Request) -> AppState:
    return request.app.state.srv


# ---------------------------------------------------------------- errors
async def _api_error(request: Request, e: APIError):
    state(request).metrics.end(e.outcome, e.reason)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: StarletteHTTPException):
    state(request).metrics.end("rejected", f"http_{e.status_code}")
    return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)


async def _crash(request: Request, e: Exception):
    state(request).metrics.end("failed", "internal_error")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)


# --------------------------------------------------------------- helpers
def auth(request: Request) -> None:
    cfg = state(request).cfg
    if cfg.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def metrics_auth(request: Request) -> None:
    if not state(request).cfg.metrics_no_auth:
        auth(request)


def ready_llm(st: AppState):
    loop = st.loop
    if st.draining:
        raise APIError(503, "the server is shutting down; send this request to another instance", code="shutting_down")
    if loop.error:
        raise APIError(503, f"engine unavailable: {loop.error}", code="engine_unavailable")
    if not loop.ready.is_set():
        raise APIError(
            503,
            "the model is still loading; retry shortly",
            code="model_loading",
            headers={"Retry-After": str(st.cfg.retry_after_s)},
        )
    return loop.llm


async def read_body(request: Request, cfg: ServerConfig) -> bytes:
    limit = cfg.max_body_bytes
    too_big = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds chunked bodies without a length
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(body: dict, cfg: ServerConfig) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if model is not None and model != cfg.served_model_name:
        raise APIError(
            404,
            f"model {show(model)} does not exist; this server serves {cfg.served_model_name!r}",
            "model",
            "model_not_found",
        )


def model_card(st: AppState) -> dict:
    llm = st.loop.llm
    card = {"id": st.cfg.served_model_name, "object": "model", "created": int(st.loop.started), "owned_by": "specserve"}
    if llm is not None:
        card["max_model_len"] = llm.engine.max_model_len
    return card


# -------------------------------------------------------------------- /v1
v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])


@v1.get("/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(state(request))]}


@v1.get("/models/{model_id:path}")
async def model(request: Request, model_id: str):
    st = state(request)
    if model_id != st.cfg.served_model_name:
        raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
    return model_card(st)


@v1.post("/completions")
async def completions(request: Request):
    return await generate(request, chat=False)


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, chat=True)


async def generate(request: Request, chat: bool):
    st = state(request)
    loop, cfg = st.loop, st.cfg
    llm = ready_llm(st)
    raw = await read_body(request, cfg)
    # Parsing, validation and tokenization run in a worker thread: a megabyte of text
    # must not stall the event loop that serves every other stream and /health.
    s, jobs_spec, calls_format = await asyncio.to_thread(prepare, st, llm, raw, chat)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    aloop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(ev: Event) -> None:  # called from the engine thread
        try:
            aloop.call_soon_threadsafe(queue.put_nowait, ev)
        except RuntimeError:  # event loop closed (shutdown)
            pass

    keep = bool(calls_format and calls_format.markers)  # the format's markers are special tokens
    jobs = [
        Job(f"{rid}-{p * s.n + j}", p * s.n + j, ids, params, sink, keep_special=keep)
        for p, (ids, choice_params) in enumerate(jobs_spec)
        for j, params in enumerate(choice_params)
    ]
    if len(jobs) > loop.capacity:  # could never be admitted: retrying would not help, so not a 429
        raise bad(
            f"this request needs {len(jobs)} sequences (prompts x n) but the server holds at most "
            f"{loop.capacity} at a time",
            "n",
        )
    try:
        loop.submit(jobs)
    except QueueFull as e:
        raise APIError(
            429, f"server busy ({e}); retry later", code="queue_full", headers={"Retry-After": str(cfg.retry_after_s)}
        ) from None
    out = _Output(
        st,
        rid,
        chat,
        queue,
        {j.index: j.seq_id for j in jobs},
        sum(len(ids) for ids, _ in jobs_spec),
        llm.tokenizer if s.logprobs is not None else None,
        s.reasoning,
        calls_format,
    )
    if s.stream:
        return StreamingResponse(
            stream(out, s.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await collect(request, out)


def prepare(st: AppState, llm, raw: bytes, chat: bool):
    """The body parsed and checked, its prompts tokenized: (options, [(prompt ids,
    SamplingParams per choice)], the tool-call format replies are parsed with or None).
    Everything cheap is checked before tokenizing."""
    body = P.parse_body(raw)
    check_model(body, st.cfg)
    vocab = llm.engine.runner.model_cfg.vocab_size
    s = P.parse_sampling(body, chat, st.cfg.max_n, vocab)
    tools = TC.parse_tools(body) if chat else TC.ToolRequest([], "none")
    fmt = st.tool_format(llm)
    s.grammar = _grammar(st, llm, body, tools, fmt)
    limits = st.text_limits(llm.tokenizer)
    field_name = "messages" if chat else "prompt"
    if chat:
        messages = TC.conversation(P.parse_messages(body), fmt, llm.tokenizer.chat_template)
        kwargs = parse_template_kwargs(body)
        _check_text_size(sum(len(m["content"]) for m in messages), llm, limits, field_name)
        try:
            text = llm.tokenizer.apply_chat_template(
                messages, tools=tools.template_tools if tools.parses_calls else None, **kwargs
            )
        except Exception as e:  # no template, or the template refused (raise_exception)
            raise bad(f"cannot apply the chat template: {e}", "messages") from None
        family = resolve_parser(st.cfg.reasoning_parser, llm.tokenizer.template_features)
        s.reasoning = (family, text) if family else None
        _check_text_size(len(text), llm, limits, field_name)
        prompts = [llm.tokenizer.encode(text)]
        if limits.end_of_turn_id is not None and not s.ignore_eos:
            s.stop_token_ids = [*s.stop_token_ids, limits.end_of_turn_id]
    else:
        raw_prompts = P.parse_prompts(body)
        for p in raw_prompts:
            if isinstance(p, str):
                _check_text_size(len(p), llm, limits, field_name)
        prompts = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in raw_prompts]
    out = []
    for ids in prompts:
        max_tokens = _check_prompt(ids, s, llm, chat, st.cfg)
        try:
            out.append((ids, [s.params_for(j, max_tokens) for j in range(s.n)]))
        except ValueError as e:  # protocol checks admit only packable values; this names any that slipped by
            raise bad(f"invalid sampling parameters: {e}") from None
    return s, out, (fmt if tools.parses_calls else None)


def _grammar(st: AppState, llm, body: dict, tools: TC.ToolRequest, fmt: TC.Format):
    """The grammar the reply must follow (response_format, or tool_choice required / named), compiled
    once here so that one the engine cannot take is a 400 naming it; None: unconstrained."""
    reply = parse_response_format(body)
    call = TC.call_grammar(tools, fmt)
    if reply is not None and call is not None:
        raise bad(
            "response_format and a required or named tool_choice both constrain the reply: send one", "response_format"
        )
    spec = reply or call
    if spec is not None:
        try:
            st.grammars(llm).compile(spec)
        except GrammarError as e:
            part = "response_format" if reply is not None else "tools"
            raise bad(f"{part} cannot be enforced: {e}", part, "invalid_schema") from None
    return spec


def _check_text_size(n: int, llm, limits: TextLimits, field_name: str) -> None:
    """Refuse n characters of text that cannot fit the context whatever their
    tokenization, without tokenizing them."""
    limit = llm.engine.max_model_len
    per_token = limits.max_token_chars or 0
    if per_token and n > limit * per_token:
        raise bad(
            f"the prompt has {n} characters, more than this model's {limit}-token context can hold; shorten it",
            field_name,
            "context_length_exceeded",
        )


# ------------------------------------------------------------ responses
@dataclass
class _Output:
    """One admitted request on its way out: where its events arrive and which sequences it owns."""

    st: AppState
    rid: str
    chat: bool
    queue: asyncio.Queue
    ids_by_index: dict[int, str]  # choice index -> sequence id
    prompt_tokens: int
    logprobs_tokenizer: Any = None  # set when the request asks for log-probabilities
    reasoning: tuple[str, str] | None = None  # chat replies split into reasoning_content and content
    tool_format: TC.Format | None = None  # set when replies may hold tool calls

    def splitters(self) -> dict[int, ReasoningSplitter]:
        return {i: ReasoningSplitter(*self.reasoning) for i in self.ids_by_index} if self.reasoning else {}

    def logprob_writers(self) -> dict[int, P.LogprobWriter]:
        if self.logprobs_tokenizer is None:
            return {}
        return {i: P.LogprobWriter(self.logprobs_tokenizer, self.chat) for i in self.ids_by_index}

    def abort_unfinished(self, finished) -> None:
        unfinished = [sid for i, sid in self.ids_by_index.items() if i not in finished]
        if unfinished:
            self.st.loop.abort(unfinished)


async def collect(request: Request, out: _Output):
    texts = {i: [] for i in out.ids_by_index}
    logprobs = {i: [] for i in out.ids_by_index}
    reasons: dict[int, str] = {}
    completion_tokens = 0
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while len(reasons) < len(out.ids_by_index):
            try:
                ev = await asyncio.wait_for(out.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    out.st.metrics.end("client_disconnect", "waiting")
                    return None  # the finally block frees the sequences
                next_check = time.monotonic() + DISCONNECT_POLL_S
            if ev is None:
                continue
            if ev.kind == "error":
                raise APIError(ev.status, ev.message, code=ev.reason, outcome="failed")
            texts[ev.index].append(ev.text)
            logprobs[ev.index].extend(ev.logprobs or ())
            if ev.kind == "finish":
                reasons[ev.index] = ev.finish_reason
                completion_tokens += ev.completion_tokens
    finally:
        out.abort_unfinished(reasons)
    out.st.metrics.end("finished", _request_finish_reason(reasons.values()))
    writers = out.logprob_writers()
    splitters = out.splitters()

    def choice(i: int) -> dict:
        text, lp = "".join(texts[i]), writers[i].piece(logprobs[i]) if writers else None
        if not out.chat:
            return P.completion_choice(i, text, reasons[i], lp)
        message = {"content": text}
        if i in splitters:  # the reasoning first: tool calls follow it, in the content
            split_message(message, splitters[i])
        calls = []
        if out.tool_format is not None:
            message["content"], calls = TC.parse_output(message["content"], out.tool_format)
        c = P.chat_choice(
            i, message["content"], "tool_calls" if calls and reasons[i] == "stop" else reasons[i], lp, calls
        )
        if "reasoning_content" in message:
            c["message"]["reasoning_content"] = message["reasoning_content"]
        return c

    choices = [choice(i) for i in sorted(out.ids_by_index)]
    return {
        "id": out.rid,
        "object": "chat.completion" if out.chat else "text_completion",
        "created": P.now(),
        "model": out.st.cfg.served_model_name,
        "choices": choices,
        "usage": P.usage(out.prompt_tokens, completion_tokens),
    }


def _request_finish_reason(reasons) -> str:
    """One reason per request for the metrics: "length" if any choice ran out of tokens."""
    reasons = set(reasons)
    return "length" if "length" in reasons else (min(reasons) if reasons else "stop")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream(out: _Output, include_usage: bool) -> AsyncIterator[str]:
    created, name, chat = P.now(), out.st.cfg.served_model_name, out.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    # With include_usage every chunk carries the key, null until the final usage-only chunk (as OpenAI).
    pending_usage = {"usage": None} if include_usage else {}

    def chunk(choices: list, **extra) -> str:
        return _sse(
            {
                "id": out.rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": choices,
                **(extra or pending_usage),
            }
        )

    writers = out.logprob_writers()
    splitters = out.splitters()

    calls = {i: TC.CallStream(out.tool_format) for i in out.ids_by_index} if chat and out.tool_format else {}

    def deltas(ev: Event, final: bool) -> list[dict]:
        """A chat event's text as deltas: the reasoning apart (its own deltas), the content through the
        tool-call stream where replies may hold calls."""
        pieces = chat_pieces(ev.text or "", splitters.get(ev.index), final)
        cs = calls.get(ev.index)
        if cs is None:
            return pieces
        out_: list[dict] = []
        for d in pieces:
            out_ += cs.feed(d["content"]) if "content" in d else [d]
        return out_ + (cs.finish() if final else [])

    def chunks(ev: Event, ds: list[dict], reason: str | None) -> list[str]:
        """The event as chunks: a completion's text, or a chat event's deltas (the log-probabilities ride the
        first, the finish reason the last)."""
        lp = writers[ev.index].piece(ev.logprobs or []) if writers else None
        if not chat:
            return [chunk([P.completion_choice(ev.index, ev.text or "", reason, lp)])]
        if not ds and reason is None and lp is None:
            return []
        ds = ds or [{}]
        last = len(ds) - 1
        return [
            chunk([P.chat_chunk_choice(ev.index, d, reason if k == last else None, lp if k == 0 else None)])
            for k, d in enumerate(ds)
        ]

    reasons: dict[int, str] = {}
    completion_tokens = 0
    outcome = ("client_disconnect", "streaming")  # unless the stream reaches its end
    try:
        if chat:  # the role comes first, as OpenAI sends it
            for i in sorted(out.ids_by_index):
                yield chunk([P.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)])
        while len(reasons) < len(out.ids_by_index):
            ev = await out.queue.get()
            if ev.kind == "error":
                outcome = ("failed", ev.reason)
                yield _sse(
                    error_body(
                        ev.message, "server_error" if ev.status >= 500 else "invalid_request_error", code=ev.reason
                    )
                )
                break
            if ev.kind == "delta":
                for c in chunks(ev, deltas(ev, final=False) if chat else [], None):
                    yield c
            else:
                reasons[ev.index] = ev.finish_reason
                completion_tokens += ev.completion_tokens
                ds = deltas(ev, final=True) if chat else []
                cs = calls.get(ev.index)
                if cs is not None and cs.calls and ev.finish_reason == "stop":
                    reasons[ev.index] = "tool_calls"
                for c in chunks(ev, ds, reasons[ev.index]):
                    yield c
        else:
            outcome = ("finished", _request_finish_reason(reasons.values()))
            if include_usage:
                yield chunk([], usage=P.usage(out.prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception:
        outcome = ("failed", "internal_error")
        raise
    finally:
        out.st.metrics.end(*outcome)
        # Client gone (the response task is cancelled) or error: free rows and KV now.
        out.abort_unfinished(reasons)


# ------------------------------------------------------------ operations
ops = APIRouter()


@ops.get("/health")
async def health(request: Request):
    st = state(request)
    loop = st.loop
    if loop.error:
        return JSONResponse({"status": "error", "message": loop.error}, status_code=503)
    if st.draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    if not loop.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": str(st.cfg.retry_after_s)})
    if not loop.thread.is_alive():
        return JSONResponse({"status": "error", "message": "the engine thread stopped"}, status_code=503)
    return {"status": "ok"}


@ops.get("/metrics", dependencies=[Depends(metrics_auth)])
async def prometheus(request: Request):
    st = state(request)
    return PlainTextResponse(
        st.metrics.render(st.loop.snapshot()), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


@ops.get("/server_info", dependencies=[Depends(auth)])
async def server_info(request: Request):
    st = state(request)
    loop, metrics, cfg = st.loop, st.metrics, st.cfg
    snap = loop.snapshot()
    llm = loop.llm
    engine = llm.engine if llm is not None else None
    state_ = (
        "error" if loop.error else ("shutting_down" if st.draining else ("ready" if loop.ready.is_set() else "loading"))
    )
    with metrics.lock:
        served = {
            "success": dict(metrics.success),
            "aborted": metrics.aborted,
            "prompt_tokens": metrics.prompt_tokens,
            "generation_tokens": metrics.generation_tokens,
        }
    server = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    return {
        "state": state_,
        "error": loop.error,
        "model": cfg.served_model_name,
        "uptime_s": round(time.time() - loop.started, 3),
        "load_seconds": loop.load_seconds,
        "graph_capture_seconds": getattr(engine, "graph_seconds", None),
        "max_model_len": getattr(engine, "max_model_len", None),
        "config": _jsonable(
            {**st.info, "server": server | {"api_key_set": cfg.api_key is not None, "queue_capacity": loop.capacity}}
        ),
        "versions": _versions(),
        "kv": snap["kv"],
        "idle_integrity": snap["idle_integrity"],
        "requests": {
            "running": snap["running"],
            "waiting": snap["waiting"],
            "in_flight": loop.in_flight,
            "ended": metrics.ended_by_outcome(),
            **served,
        },
        "speculation": {
            "drafter": bool(engine is not None and engine.policy is not None),
            "method": engine.cfg.spec.method if engine is not None and engine.policy is not None else None,
            "last_k": snap["last_k"],
            "k_choices": snap["k_choices"],
            "acceptance_estimate": snap["acceptance_estimate"],
            "acceptance_estimate_tree": snap["acceptance_estimate_tree"],
            "since_start": snap["spec"],
            "costs": snap["policy_costs"],
        },
        "tokens_generated": snap["tokens_generated"],
    }


def _check_prompt(ids: list[int], s: P.Sampling, llm, chat: bool, cfg: ServerConfig) -> int:
    """Refuse what the engine cannot run; return this prompt's max_tokens."""
    engine = llm.engine
    limit, vocab = engine.max_model_len, engine.runner.model_cfg.vocab_size
    if not ids:
        raise bad("the prompt is empty", "messages" if chat else "prompt")
    if min(ids) < 0 or max(ids) >= vocab:
        raise bad(f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
    if len(ids) >= limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens and the prompt has {len(ids)} tokens "
            f"(room is needed for at least one new token)",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    room = limit - len(ids)
    if s.max_tokens is None:
        return room if chat else min(cfg.completion_default_max_tokens, room)
    if s.max_tokens > room:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} tokens and "
            f"{s.max_tokens_field} asks for {show(s.max_tokens)} more (at most {room})",
            s.max_tokens_field,
            "context_length_exceeded",
        )
    return s.max_tokens


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("specserve", "torch", "transformers", "tokenizers", "fastapi", "uvicorn"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
