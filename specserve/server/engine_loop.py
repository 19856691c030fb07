"""The engine thread: the one place that touches the (not thread-safe) engine.

HTTP handlers `submit` jobs and `abort` them through a locked inbox; the
thread drains it, runs `engine.step()` while there is work and sleeps on a
condition when idle. Text deltas and finish events go back to each request
through a `sink` callable (the server wraps `loop.call_soon_threadsafe`).
After every step it publishes a snapshot (gauges, speculative counters, KV
usage) that /metrics and /server_info read without touching the engine.

When the thread ends on an error (loading failed, a step left the engine
broken, the TP workers are gone, a bug in the loop itself), every request in
flight or queued gets an error event, later submissions get one at once, and
`on_error` is called: `serve` then exits non-zero, never leaving an HTTP front
over a dead engine.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from specserve.engine.llm import cut_at_stop
from specserve.engine.sampling import SamplingParams
from specserve.engine.tokenizer import IncrementalDecoder
from specserve.server.metrics import Metrics

log = logging.getLogger("specserve.server")


class QueueFull(Exception):
    """More sequences in flight than running rows + queue allow."""


class EngineBroken(Exception):
    """A failed step left the engine unusable: the loop ends (`EngineLoop._stopped`)."""


@dataclass
class Event:
    index: int  # choice index within the request
    kind: str  # "delta" | "finish" | "error"
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    message: str = ""
    status: int = 500  # HTTP status for an error event
    reason: str = ""  # why an error event ended the sequence: engine_error, shutdown, invalid_request
    logprobs: list | None = None  # TokenLogprob of the tokens since the last event, when the request asks


@dataclass
class Job:
    """One sequence to generate (a request with n > 1 or several prompts submits several)."""

    seq_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    received: float = field(default_factory=time.perf_counter)
    keep_special: bool = False  # text keeps special tokens (a tool-call format's markers), not the final stop token


class _Track:
    """Per-sequence streaming state, owned by the engine thread."""

    def __init__(self, job: Job, tokenizer):
        self.job = job
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=not job.keep_special)
        self.sent = ""
        # Text that could be the start of a stop string is held back until it cannot be.
        self.holdback = max((len(s) for s in job.params.stop), default=1) - 1
        self.first_seen = False
        self.logprobs_sent = 0  # output tokens whose log-probabilities went out with an event


class EngineLoop:
    def __init__(
        self, build: Callable[[], Any], metrics: Metrics, capacity: int, on_error: Callable[[str], None] | None = None
    ):
        """`build()` runs in the engine thread and returns an object with
        `.engine` and `.tokenizer` (an LLM). `capacity` bounds sequences in
        flight (running rows + queue). `on_error(message)` is called when
        loading fails or the engine is left broken (serve then exits)."""
        self.build = build
        self.on_error = on_error
        self.metrics = metrics
        self.capacity = capacity
        self.llm = None
        self.ready = threading.Event()
        self.error: str | None = None  # set when loading failed or the engine broke
        self.load_seconds: float | None = None
        self.started = time.time()
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._in_flight = 0
        self._stop = False
        self._tracks: dict[str, _Track] = {}
        self._snap_lock = threading.Lock()
        self._snap = _empty_snapshot()
        self.thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)

    # ------------------------------------------------------ HTTP-side API
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, jobs: list[Job]) -> None:
        """Queue all jobs of one request, or none (raises QueueFull)."""
        with self._cv:
            if self.error:  # the engine thread is gone: nobody else would ever answer these jobs
                for job in jobs:
                    job.sink(
                        Event(
                            job.index,
                            "error",
                            message=f"engine unavailable: {self.error}",
                            status=503,
                            reason="engine_unavailable",
                        )
                    )
                return
            if self._in_flight + len(jobs) > self.capacity:
                raise QueueFull(f"{self._in_flight} sequences in flight, limit {self.capacity}")
            self._in_flight += len(jobs)
            self._inbox.extend(("add", j) for j in jobs)
            self._cv.notify()

    def abort(self, seq_ids: list[str]) -> None:
        with self._cv:
            self._inbox.extend(("abort", s) for s in seq_ids)
            self._cv.notify()

    def end_all(self, message: str) -> None:
        """End every sequence in flight with a 503 error event (shutdown past its grace period)."""
        with self._cv:
            self._inbox.append(("end_all", message))
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._snap_lock:
            return self._snap

    # -------------------------------------------------------- engine thread
    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.llm = self.build()
        except BaseException as e:  # report instead of dying silently: /health shows it
            self._stopped(f"loading failed: {type(e).__name__}: {e}")
            return
        self.load_seconds = time.perf_counter() - t0
        try:
            self._publish()
            self.ready.set()
            self._serve()
        except EngineBroken as e:
            self._stopped(str(e))
        except BaseException as e:  # the loop cannot go on: fail every request, never a live front over it
            self._stopped(f"the engine loop stopped: {type(e).__name__}: {e}")
        finally:
            close = getattr(self.llm, "close", None)  # TP: stop the worker processes
            if close is not None:
                close()

    def _serve(self) -> None:
        engine = self.llm.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.has_work() and not self._stop:
                    self._cv.wait()
                if self._stop:
                    break
                cmds = list(self._inbox)
                self._inbox.clear()
            for kind, arg in cmds:
                if kind == "add":
                    self._add(arg)
                elif kind == "abort":
                    self._abort(arg)
                else:
                    self._fail(list(self._tracks), arg, status=503, reason="shutdown")
            if engine.has_work():
                try:
                    touched = engine.step()
                except Exception as e:
                    self._engine_failed(e)
                    continue
                for seq in touched:
                    self._emit(seq)
            self._publish()
        self._fail(list(self._tracks), "the server is shutting down", status=503, reason="shutdown")

    def _stopped(self, error: str) -> None:
        """The engine thread ends on an error: every sequence in flight or still queued gets a 500 error
        event, later submissions get one at once, and `on_error` (serve: exit non-zero) is told."""
        log.error("%s\n%s", error, traceback.format_exc())
        with self._cv:
            self.error = self.error or error
            queued = [job for kind, job in self._inbox if kind == "add"]
            self._inbox.clear()
        self._fail(list(self._tracks), self.error, status=500, reason="engine_error")
        for job in queued:
            self._done(job.seq_id)
            job.sink(Event(job.index, "error", message=self.error, status=500, reason="engine_error"))
        if self.on_error:
            self.on_error(self.error)

    def _add(self, job: Job) -> None:
        try:
            job.params.validate()  # parameters that cannot be packed would break the whole batch's step
            self.llm.engine.add_request(job.prompt_ids, job.params, seq_id=job.seq_id)
        except ValueError as e:
            self._done(job.seq_id)
            job.sink(Event(job.index, "error", message=str(e), status=400, reason="invalid_request"))
            return
        self._tracks[job.seq_id] = _Track(job, self.llm.tokenizer)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(job.prompt_ids)

    def _abort(self, seq_id: str) -> None:
        if self._tracks.pop(seq_id, None) is None:
            return  # already finished
        self.llm.engine.abort(seq_id)
        self._done(seq_id)
        with self.metrics.lock:
            self.metrics.aborted += 1

    def _done(self, seq_id: str) -> None:
        with self._cv:
            self._in_flight -= 1

    def _emit(self, seq) -> None:
        tr = self._tracks.get(seq.seq_id)
        if tr is None:
            return
        job, now = tr.job, time.perf_counter()
        if not tr.first_seen and seq.first_token_time is not None:
            tr.first_seen = True
            with self.metrics.lock:
                self.metrics.ttft.observe(seq.first_token_time - job.received)
        if seq.new_tokens:
            tr.decoder.push(seq.new_tokens)
        if seq.finish_reason is None:
            text = tr.decoder.text
            safe = len(text) - tr.holdback if job.params.stop else len(text)
            if safe > len(tr.sent) and text.startswith(tr.sent):
                delta = text[len(tr.sent) : safe]
                tr.sent += delta
                job.sink(
                    Event(
                        job.index,
                        "delta",
                        text=delta,
                        completion_tokens=len(seq.output_ids),
                        logprobs=self._new_logprobs(tr, seq),
                    )
                )
            return
        # Finished: the full text, cut at a stop string, exactly as LLM.generate returns it.
        text = self._final_text(seq, job)
        if job.params.stop:
            text = cut_at_stop(text, job.params.stop)[0]
        delta = text[len(tr.sent) :] if text.startswith(tr.sent) else ""
        del self._tracks[seq.seq_id]
        self._done(seq.seq_id)
        n = len(seq.output_ids)
        with self.metrics.lock:
            m = self.metrics
            m.success[seq.finish_reason] = m.success.get(seq.finish_reason, 0) + 1
            m.generation_tokens += n
            m.e2e.observe(now - job.received)
            if n > 1 and seq.first_token_time is not None:
                m.tpot.observe((seq.finish_time - seq.first_token_time) / (n - 1))
        job.sink(
            Event(
                job.index,
                "finish",
                text=delta,
                finish_reason=seq.finish_reason,
                completion_tokens=n,
                logprobs=self._new_logprobs(tr, seq),
            )
        )

    def _final_text(self, seq, job: Job) -> str:
        if not job.keep_special:
            return self.llm.tokenizer.decode(seq.output_ids)
        ids = seq.output_ids
        if (
            seq.finish_reason == "stop"
            and ids
            and (ids[-1] in self.llm.tokenizer.eos_token_ids or ids[-1] in job.params.stop_token_ids)
        ):
            ids = ids[:-1]
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False)

    @staticmethod
    def _new_logprobs(tr: _Track, seq) -> list | None:
        """Log-probabilities not yet sent: those of every token since the last event, so the
        events of a sequence carry each token's once, whatever text was held back."""
        if seq.logprobs is None:
            return None
        new = seq.logprobs[tr.logprobs_sent :]
        tr.logprobs_sent = len(seq.logprobs)
        return new

    def _engine_failed(self, e: Exception) -> None:
        """A step raised: fail the sequences that were in it (holding a row, or
        just admitted to one), free their rows, and keep serving the waiting
        ones only if the engine is verifiably clean afterwards. When no sequence
        held a row, the step failed while admitting: then every sequence was in it."""
        log.error("engine step failed: %s\n%s", e, traceback.format_exc())
        waiting = {seq.seq_id for seq in self.llm.engine.waiting}
        in_step = [sid for sid in self._tracks if sid not in waiting] or list(self._tracks)
        self._fail(in_step, f"engine error: {type(e).__name__}: {e}", status=500, reason="engine_error")
        try:
            self.llm.engine.check_idle_integrity()
        except Exception as e2:
            raise EngineBroken(f"engine broken after a failed step: {e2}") from e2
        self._publish()

    def _fail(self, seq_ids: list[str], message: str, status: int, reason: str) -> None:
        for seq_id in seq_ids:
            tr = self._tracks.pop(seq_id)
            try:
                self.llm.engine.abort(seq_id)
            except Exception:  # the engine may be the thing that broke; the row is freed on the next check
                pass
            self._done(seq_id)
            tr.job.sink(Event(tr.job.index, "error", message=message, status=status, reason=reason))

    def _publish(self) -> None:
        engine = self.llm.engine
        kv = engine.kv_usage()
        running = kv["rows_used"]
        # Every draft position and K the engine can run has its series from the start (at 0), so
        # a scrape before the first speculative cycle already lists them, as Prometheus expects.
        k_max = engine.policy.k_max if engine.policy else 0
        snap = {
            "running": running,
            "waiting": max(self._in_flight - running, 0),
            "kv": kv,
            "spec": {
                "cycles": engine.totals.cycles,
                "drafted": engine.totals.drafted,
                "accepted": engine.totals.accepted,
                "accepted_per_pos": _padded(engine.totals.accepted_per_pos, k_max),
                "drafted_per_pos": _padded(engine.totals.drafted_per_pos, k_max),
                "accept_length_mean": engine.totals.accept_length,
                "accept_per_position": engine.totals.accept_per_position,
            },
            "last_k": engine.last_k,
            "k_choices": {K: 0 for K in range(k_max + 1)} | (engine.policy.choices if engine.policy else {}),
            "acceptance_estimate": engine.policy.acceptance() if engine.policy else [],
            "acceptance_estimate_tree": engine.policy.acceptance(True)
            if engine.policy and engine.cfg.spec_topk > 1
            else None,
            "tokens_generated": engine.tokens_generated,
            "idle": not engine.has_work(),
            "idle_integrity": None,
        }
        # The adaptive policy's costs per batch and context bucket, taken while idle (a TP engine asks rank 0).
        snap["policy_costs"] = (
            engine.policy.snapshot() if engine.policy is not None and snap["idle"] else self._snap["policy_costs"]
        )
        if snap["idle"] and not self._tracks:
            try:
                engine.check_idle_integrity()
                snap["idle_integrity"] = "ok"
            except AssertionError as e:
                snap["idle_integrity"] = str(e)
        with self._snap_lock:
            self._snap = snap


def _padded(counts: list[int], n: int) -> list[int]:
    """`counts` extended with zeros to at least `n` entries."""
    return list(counts) + [0] * (n - len(counts))


def _empty_snapshot() -> dict:
    return {
        "running": 0,
        "waiting": 0,
        "kv": {
            "rows_total": 0,
            "rows_used": 0,
            "usage": 0.0,
            "tokens_cached": 0,
            "preemptions": 0,
            "blocks_total": 0,
            "blocks_used": 0,
            "blocks_free": 0,
            "blocks_cached": 0,
            "block_size": 0,
            "prefix_cache": False,
            "prefix_hit_tokens": 0,
            "prefix_queried_tokens": 0,
            "prefix_evictions": 0,
        },
        "spec": {
            "cycles": 0,
            "drafted": 0,
            "accepted": 0,
            "accepted_per_pos": [],
            "drafted_per_pos": [],
            "accept_length_mean": None,
            "accept_per_position": [],
        },
        "last_k": 0,
        "k_choices": {},
        "acceptance_estimate": [],
        "acceptance_estimate_tree": None,
        "tokens_generated": 0,
        "idle": True,
        "idle_integrity": None,
        "policy_costs": None,
    }
