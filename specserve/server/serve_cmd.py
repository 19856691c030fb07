"""`specserve serve`: the OpenAI-compatible HTTP server.

    specserve serve [--model DIR] [--draft DIR] [--spec-steps K] [--no-adaptive]
                    [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
                    [--max-num-seqs N] [--max-model-len N] [--max-queue N] [--max-n N] [--max-body-bytes N]

With no --model it serves the bundled demo pair. Start-up order: validate the
flags and run the preflight checks of `specserve check` (no weights read),
bind the socket, start answering HTTP (/health says 503 "loading"), then load
weights and capture CUDA graphs in the engine thread; /health turns 200 only
when the engine can serve. If loading fails the process exits with status 1.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import socket
import sys
import time
from pathlib import Path

from specserve import envs
from specserve.cli import port_number
from specserve.config import ConfigError, EngineConfig
from specserve.engine.generate_cmd import add_engine_arguments, engine_kwargs
from specserve.model.gguf import require_model
from specserve.server.reasoning import PARSER_CHOICES
from specserve.server.tool_calls import FORMATS

log = logging.getLogger("specserve.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, adaptive_flag=False)
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="always draft --spec-steps tokens (default with a drafter: adaptive K in 0..--spec-steps)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (0 = any free port; the log says which)")
    p.add_argument(
        "--api-key",
        default=envs.API_KEY.get(),
        help="require 'Authorization: Bearer KEY' on every /v1 route, /metrics and /server_info "
        "(default: $SPECSERVE_API_KEY)",
    )
    p.add_argument(
        "--metrics-no-auth",
        action="store_true",
        help="with --api-key, let /metrics answer without the key (for scrapers); default: key required",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are ended "
        "with an error (default 30)",
    )
    p.add_argument("--served-model-name", help="model id clients must use (default: the model directory's name)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="sequences that may wait for a KV row beyond --max-num-seqs; more get 429 (default 4x)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(FORMATS),
        default=None,
        help="how the model writes tool calls (default: read from its chat template, else hermes)",
    )
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices per prompt) accepted (default 8)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--skip-check", action="store_true", help="skip the preflight checks of `specserve check`")
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=PARSER_CHOICES,
        help="split chat replies into reasoning_content and content at these markers: think (<think> "
        "... </think>: DeepSeek-R1, Qwen3, Kimi-K2/K2.5), kimi_vl (Kimi's ◁think▷ ... ◁/think▷), "
        "none; auto (default): the chat template's own",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server and access log verbosity",
    )


def serve_engine_kwargs(args: argparse.Namespace) -> dict:
    """Engine kwargs for serving: adaptive speculation (max K = --spec-steps)
    unless --no-adaptive or K = 0."""
    args.adaptive = not args.no_adaptive and args.spec_steps != 0
    kw = engine_kwargs(args, default_max_num_seqs=64)
    kw["prefix_cache"] = not args.no_prefix_cache
    if kw["kv_cache_tokens"] is None and kw["gpu_memory_utilization"] is None and _on_gpu(kw["device"]):
        kw["gpu_memory_utilization"] = 0.9
    return kw


def _on_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def preflight(kw: dict) -> bool:
    """Run `specserve check`'s checks if that module is present; False on errors."""
    try:
        from specserve.ops.check import check_engine_kwargs, format_report, has_errors
    except ImportError:
        log.warning("preflight checks skipped: specserve.ops.check is not available")
        return True
    findings = check_engine_kwargs(kw)
    report = format_report(findings, show_ok=False)
    (log.error if has_errors(findings) else log.info)("preflight:\n%s", report)
    return not has_errors(findings)


def llm_class(tp: int):
    if tp <= 1:
        from specserve.engine.llm import LLM

        return LLM
    try:  # tensor-parallel workers (specserve/distributed) expose the same interface as LLM
        from specserve.distributed.tp_llm import TPLLM
    except ImportError:
        raise ConfigError("--tp > 1 is not yet supported by serve (specserve.distributed.tp_llm is missing)") from None
    return TPLLM


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a busy port fails at once with a clear message."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)  # connections queue from now on, even while uvicorn is still starting
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


def limit_malloc_arenas(n: int = 2) -> None:
    """Cap glibc's malloc arenas before the engine and HTTP threads start. With one arena per
    thread (up to 8 per core) the engine thread's and the event loop's short-lived buffers
    fragment several heaps, and RSS creeps up request after request without a plateau. An
    operator's own MALLOC_ARENA_MAX wins; other C libraries are left alone."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-8, n)  # -8: M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        pass


def draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a drain before its own shutdown: the first SIGTERM/SIGINT
        stops admissions (503, /health not ready) and lets running requests finish
        for up to `grace` seconds, then ends the rest with an error event and
        [DONE]; only then does uvicorn close the connections. A second signal ends
        the rest at once, a third exits without waiting."""

        def __init__(self, config, st, grace: float):
            super().__init__(config)
            self.st, self.grace = st, grace
            self.deadline: float | None = None  # set by the first signal
            self.ended_rest = False

        def handle_exit(self, sig, frame) -> None:  # a signal handler: only sets flags
            if self.deadline is None:
                self.deadline = time.monotonic() + self.grace
                self.st.draining = True
            elif self.should_exit:
                self.force_exit = True
            else:
                self.deadline = time.monotonic()

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and not self.should_exit:
                loop = self.st.loop
                if counter % 10 == 0 and loop.in_flight:
                    log.info(
                        "shutting down: %d sequences still running (%.0f s left)",
                        loop.in_flight,
                        max(self.deadline - time.monotonic(), 0),
                    )
                if not loop.in_flight:
                    self.should_exit = True
                elif time.monotonic() >= self.deadline and not self.ended_rest:
                    self.ended_rest = True
                    loop.end_all(f"the server is shutting down: the request did not finish within {self.grace:g} s")
            return await super().on_tick(counter)

    return DrainingServer


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specserve.server.app import ServerConfig, create_app
    from specserve.server.engine_loop import EngineLoop
    from specserve.server.metrics import Metrics

    limit_malloc_arenas()
    DrainingServer = draining_server_class()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        kw = serve_engine_kwargs(args)
        require_model(str(kw["model"]))
        engine_cfg = EngineConfig.from_kwargs(**kw)  # validate flags before binding or loading
        if engine_cfg.parallel.node_rank:  # a headless node: no HTTP, node 0 drives its workers
            from specserve.distributed.multinode import run_node

            return run_node(engine_cfg.parallel)
        cls = llm_class(args.tp)
        if args.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
        for name, v in (
            ("--max-queue", args.max_queue),
            ("--max-n", args.max_n),
            ("--max-body-bytes", args.max_body_bytes),
        ):
            if v is not None and v < (0 if name == "--max-queue" else 1):
                raise ConfigError(f"{name} must be positive, got {v}")
        if not args.skip_check and not preflight(kw):
            print("error: preflight checks failed (see above; --skip-check to override)", file=sys.stderr)
            return 1
        sock = bind(args.host, args.port)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    max_queue = args.max_queue if args.max_queue is not None else 4 * engine_cfg.max_num_seqs
    cfg = ServerConfig(
        served_model_name=args.served_model_name or Path(kw["model"]).resolve().name,
        api_key=args.api_key,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        metrics_no_auth=args.metrics_no_auth,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )
    server: DrainingServer | None = None

    def build():
        t0 = time.perf_counter()
        log.info(
            "loading %s%s (health: 503 until ready)", kw["model"], f" + drafter {kw['draft']}" if kw["draft"] else ""
        )
        extra = {}
        if "on_graph_progress" in inspect.signature(cls.__init__).parameters:
            extra["on_graph_progress"] = lambda n, total, key, B: log.info(
                "captured graph %d/%d %s batch %d", n, total, key, B
            )
        if "on_group_lost" in inspect.signature(cls.__init__).parameters:
            extra["on_group_lost"] = group_lost
        llm = cls(**kw, **extra)
        log.info(
            "ready in %.1f s (graph capture %.1f s); serving %r",
            time.perf_counter() - t0,
            llm.engine.graph_seconds,
            cfg.served_model_name,
        )
        return llm

    def fatal(message: str) -> None:
        if server is not None:
            server.should_exit = True

    def group_lost(reason: str) -> None:  # a node or TP worker went away: the group is gone, so is serving
        loop.error = f"the TP group ended: {reason}"
        fatal(loop.error)

    metrics = Metrics()
    loop = EngineLoop(build, metrics, capacity=engine_cfg.max_num_seqs + max_queue, on_error=fatal)
    info = {"engine": engine_cfg.flat(), "tp": args.tp}
    app = create_app(loop, metrics, cfg, info)
    server = DrainingServer(
        uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, timeout_keep_alive=30),
        app.state.srv,
        args.shutdown_timeout,
    )
    shown = f"[{host}]" if ":" in host else host
    print(
        f"specserve: listening on http://{shown}:{port} (model id {cfg.served_model_name!r}"
        f"{', API key required' if cfg.api_key else ''})",
        flush=True,
    )
    if host not in ("127.0.0.1", "::1", "localhost") and not cfg.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
    if loop.error:
        print(f"error: {loop.error}", file=sys.stderr)
        return 1
    return 0
