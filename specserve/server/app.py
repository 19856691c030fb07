"""The FastAPI application: OpenAI-compatible routes, /health, /metrics and
/server_info, on top of an `EngineLoop` (which owns the engine thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.server import protocol as P
from specserve.server.engine_loop import EngineLoop, Event, Job, QueueFull
from specserve.server.metrics import Metrics

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


def create_app(loop: EngineLoop, metrics: Metrics, cfg: ServerConfig, info: dict[str, Any] | None = None) -> FastAPI:
    """`info` is static configuration shown by /server_info (engine config, flags)."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loop, app.state.metrics, app.state.cfg = loop, metrics, cfg
    info = info or {}

    # ------------------------------------------------------------ errors
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        metrics.reject(e.status_code)
        return JSONResponse(P.error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    # ------------------------------------------------------------ helpers
    def auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise P.APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    def ready_llm():
        if loop.error:
            raise P.APIError(503, f"engine unavailable: {loop.error}", code="engine_unavailable")
        if not loop.ready.is_set():
            raise P.APIError(503, "the model is still loading; retry shortly", code="model_loading",
                             headers={"Retry-After": str(cfg.retry_after_s)})
        return loop.llm

    async def read_json(request: Request) -> dict:
        limit = cfg.max_body_bytes
        too_big = P.APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds chunked bodies without a length
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise P.bad(f"invalid JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise P.bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise P.bad("model must be a string", "model")
        if model is not None and model != cfg.served_model_name:
            raise P.APIError(404, f"model {model!r} does not exist; this server serves {cfg.served_model_name!r}",
                             "model", "model_not_found")
        return body

    def model_card() -> dict:
        llm = loop.llm
        card = {"id": cfg.served_model_name, "object": "model", "created": int(loop.started), "owned_by": "specserve"}
        if llm is not None:
            card["max_model_len"] = llm.engine.max_model_len
        return card

    # ------------------------------------------------------------ /v1
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != cfg.served_model_name:
            raise P.APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    app.include_router(v1)

    async def generate(request: Request, chat: bool):
        llm = ready_llm()
        body = await read_json(request)
        s = P.parse_sampling(body, chat, cfg.max_n)
        if chat:
            messages = P.parse_messages(body)
            try:
                text = llm.tokenizer.apply_chat_template(messages)
            except Exception as e:  # no template, or the template refused (raise_exception)
                raise P.bad(f"cannot apply the chat template: {e}", "messages") from None
            prompts = [llm.tokenizer.encode(text)]
        else:
            prompts = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in P.parse_prompts(body)]
        jobs_spec = []
        for ids in prompts:
            max_tokens = _check_prompt(ids, s, llm, chat, cfg)
            jobs_spec.append((ids, max_tokens))
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:  # called from the engine thread
            try:
                aloop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # event loop closed (shutdown)
                pass

        jobs = [Job(f"{rid}-{p * s.n + j}", p * s.n + j, ids, s.params_for(j, mt), sink)
                for p, (ids, mt) in enumerate(jobs_spec) for j in range(s.n)]
        if len(jobs) > loop.capacity:  # could never be admitted: retrying would not help, so not a 429
            raise P.bad(f"this request needs {len(jobs)} sequences (prompts x n) but the server holds at most "
                        f"{loop.capacity} at a time", "n")
        try:
            loop.submit(jobs)
        except QueueFull as e:
            raise P.APIError(429, f"server busy ({e}); retry later", code="queue_full",
                             headers={"Retry-After": str(cfg.retry_after_s)}) from None
        prompt_tokens = sum(len(ids) for ids, _ in jobs_spec)
        ids_by_index = {j.index: j.seq_id for j in jobs}
        if s.stream:
            return StreamingResponse(
                stream(rid, chat, s, queue, ids_by_index, prompt_tokens),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, rid, chat, queue, ids_by_index, prompt_tokens)

    async def collect(request, rid, chat, queue, ids_by_index, prompt_tokens):
        texts = {i: [] for i in ids_by_index}
        reasons: dict[int, str] = {}
        completion_tokens = 0
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while len(reasons) < len(ids_by_index):
                try:
                    ev = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() >= next_check:
                    if await request.is_disconnected():
                        return None  # the finally block frees the sequences
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if ev is None:
                    continue
                if ev.kind == "error":
                    raise P.APIError(ev.status, ev.message, code="generation_failed")
                texts[ev.index].append(ev.text)
                if ev.kind == "finish":
                    reasons[ev.index] = ev.finish_reason
                    completion_tokens += ev.completion_tokens
        finally:
            unfinished = [sid for i, sid in ids_by_index.items() if i not in reasons]
            if unfinished:
                loop.abort(unfinished)
        make = P.chat_choice if chat else P.completion_choice
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": P.now(),
                "model": cfg.served_model_name,
                "choices": [make(i, "".join(texts[i]), reasons[i]) for i in sorted(ids_by_index)],
                "usage": P.usage(prompt_tokens, completion_tokens)}

    async def stream(rid, chat, s, queue, ids_by_index, prompt_tokens) -> AsyncIterator[str]:
        created, name = P.now(), cfg.served_model_name
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            data = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices, **extra}
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

        def choice(index: int, text: str | None, reason: str | None) -> dict:
            if chat:
                return P.chat_chunk_choice(index, {} if text is None else {"content": text}, reason)
            return P.completion_choice(index, text or "", reason)

        done: set[int] = set()
        completion_tokens = 0
        try:
            if chat:  # the role comes first, as OpenAI sends it
                for i in sorted(ids_by_index):
                    yield chunk([P.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)])
            while len(done) < len(ids_by_index):
                ev = await queue.get()
                if ev.kind == "error":
                    err = P.error_body(ev.message, "server_error" if ev.status >= 500 else "invalid_request_error")
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if ev.kind == "delta":
                    yield chunk([choice(ev.index, ev.text, None)])
                else:
                    done.add(ev.index)
                    completion_tokens += ev.completion_tokens
                    yield chunk([choice(ev.index, ev.text or None, ev.finish_reason)])
            else:
                if s.include_usage:
                    yield chunk([], usage=P.usage(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            # Client gone (the response task is cancelled) or error: free rows and KV now.
            unfinished = [sid for i, sid in ids_by_index.items() if i not in done]
            if unfinished:
                loop.abort(unfinished)

    # ------------------------------------------------------- operations
    @app.get("/health")
    async def health():
        if loop.error:
            return JSONResponse({"status": "error", "message": loop.error}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503,
                                headers={"Retry-After": str(cfg.retry_after_s)})
        if not loop.thread.is_alive():
            return JSONResponse({"status": "error", "message": "the engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(loop.snapshot()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/server_info")
    async def server_info():
        snap = loop.snapshot()
        llm = loop.llm
        engine = llm.engine if llm is not None else None
        state = "error" if loop.error else ("ready" if loop.ready.is_set() else "loading")
        with metrics.lock:
            served = {"success": dict(metrics.success), "aborted": metrics.aborted,
                      "rejected": dict(metrics.rejected), "prompt_tokens": metrics.prompt_tokens,
                      "generation_tokens": metrics.generation_tokens}
        return {
            "state": state,
            "error": loop.error,
            "model": cfg.served_model_name,
            "uptime_s": round(time.time() - loop.started, 3),
            "load_seconds": loop.load_seconds,
            "graph_capture_seconds": getattr(engine, "graph_seconds", None),
            "max_model_len": getattr(engine, "max_model_len", None),
            "config": _jsonable({**info, "server": {k: v for k, v in dataclasses.asdict(cfg).items()
                                                    if k != "api_key"} | {"api_key_set": cfg.api_key is not None,
                                                                          "queue_capacity": loop.capacity}}),
            "versions": _versions(),
            "kv": snap["kv"],
            "idle_integrity": snap["idle_integrity"],
            "requests": {"running": snap["running"], "waiting": snap["waiting"], "in_flight": loop.in_flight,
                         **served},
            "speculation": {"drafter": bool(engine is not None and engine.policy is not None),
                            "last_k": snap["last_k"], "k_choices": snap["k_choices"],
                            "acceptance_estimate": snap["acceptance_estimate"],
                            "acceptance_estimate_tree": snap["acceptance_estimate_tree"], "since_start": snap["spec"]},
            "tokens_generated": snap["tokens_generated"],
        }

    return app


def _check_prompt(ids: list[int], s: P.Sampling, llm, chat: bool, cfg: ServerConfig) -> int:
    """Refuse what the engine cannot run; return this prompt's max_tokens."""
    engine = llm.engine
    limit, vocab = engine.max_model_len, engine.runner.model_cfg.vocab_size
    if not ids:
        raise P.bad("the prompt is empty", "messages" if chat else "prompt")
    if min(ids) < 0 or max(ids) >= vocab:
        raise P.bad(f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
    if len(ids) >= limit:
        raise P.bad(f"this model's maximum context length is {limit} tokens and the prompt has {len(ids)} tokens "
                    f"(room is needed for at least one new token)", "messages" if chat else "prompt",
                    "context_length_exceeded")
    room = limit - len(ids)
    if s.max_tokens is None:
        return room if chat else min(cfg.completion_default_max_tokens, room)
    if s.max_tokens > room:
        raise P.bad(f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} tokens and "
                    f"max_tokens asks for {s.max_tokens} more (at most {room})", "max_tokens",
                    "context_length_exceeded")
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
