"""Prometheus text exposition (format 0.0.4), written by hand to avoid a
dependency: a few counters and histograms the engine thread updates, plus
gauges and speculative counters read from the engine loop's snapshot.

Metric names are a contract: `specserve bench --url` reads the
`specserve:spec_decode_*` counters.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


class Metrics:
    """Request-level statistics. Updated by the engine thread and the HTTP
    handlers, read by /metrics and /server_info; one lock guards it all."""

    def __init__(self):
        self.lock = threading.Lock()
        self.success: dict[str, int] = {}  # finish reason -> count
        self.aborted = 0
        self.ended: dict[tuple[str, str], int] = {}  # (outcome, reason) -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def end(self, outcome: str, reason: str) -> None:
        """Count one ended generation request, exactly once: outcome is finished,
        rejected (refused before it ran), failed (an error ended it) or
        client_disconnect; reason is the finish reason or the error code."""
        with self.lock:
            self.ended[(outcome, reason)] = self.ended.get((outcome, reason), 0) + 1

    def ended_by_outcome(self) -> dict[str, dict[str, int]]:
        with self.lock:
            out: dict[str, dict[str, int]] = {}
            for (outcome, reason), n in sorted(self.ended.items()):
                out.setdefault(outcome, {})[reason] = n
            return out

    def render(self, snap: dict) -> str:
        """The full exposition; `snap` is the engine loop's latest snapshot."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP specserve:{name} {help_text}")
            out.append(f"# TYPE specserve:{name} {kind}")
            for labels, value in samples:
                out.append(f"specserve:{name}{labels} {_num(value)}")

        with self.lock:
            metric(
                "num_requests_running", "gauge", "Sequences holding KV (prefill or decode).", [("", snap["running"])]
            )
            metric(
                "num_requests_waiting", "gauge", "Sequences accepted but not yet holding KV.", [("", snap["waiting"])]
            )
            kv = snap["kv"]
            metric(
                "kv_cache_usage_perc",
                "gauge",
                "Fraction of KV blocks held by sequences (1 = full).",
                [("", kv["usage"])],
            )
            metric("kv_blocks_used", "gauge", "KV blocks held by sequences.", [("", kv["blocks_used"])])
            metric(
                "kv_blocks_free",
                "gauge",
                "KV blocks free or holding cached prefixes nobody uses.",
                [("", kv["blocks_total"] - kv["blocks_used"])],
            )
            metric("kv_blocks_cached", "gauge", "KV blocks findable by the prefix cache.", [("", kv["blocks_cached"])])
            metric(
                "prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                [("", kv["prefix_queried_tokens"])],
            )
            metric(
                "prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache (not recomputed).",
                [("", kv["prefix_hit_tokens"])],
            )
            metric(
                "num_preemptions_total",
                "counter",
                "Running sequences preempted (recomputed later) for KV blocks.",
                [("", kv["preemptions"])],
            )
            metric(
                "request_success_total",
                "counter",
                "Finished requests (sequences) by finish reason.",
                [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(self.success.items())] or [("", 0)],
            )
            metric(
                "request_aborted_total",
                "counter",
                "Sequences dropped because the client went away.",
                [("", self.aborted)],
            )
            metric(
                "request_ended_total",
                "counter",
                "Requests ended, each counted once, by outcome (finished, rejected, failed, client_disconnect) "
                "and reason (finish reason or error code).",
                [(f'{{outcome="{o}",reason="{r}"}}', n) for (o, r), n in sorted(self.ended.items())] or [("", 0)],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Time from request arrival to the first token."),
                ("time_per_output_token_seconds", self.tpot, "Mean time per output token after the first."),
                ("e2e_request_latency_seconds", self.e2e, "Time from request arrival to its last token."),
            ):
                out.append(f"# HELP specserve:{name} {help_text}")
                out.append(f"# TYPE specserve:{name} histogram")
                out.extend(hist.lines(f"specserve:{name}"))
        t = snap["spec"]
        metric(
            "spec_decode_num_drafts_total",
            "counter",
            "Draft proposals (one per sequence per speculative cycle).",
            [("", t["cycles"])],
        )
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", t["drafted"])])
        metric(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted by the target.",
            [("", t["accepted"])],
        )
        metric(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Accepted draft tokens by draft position.",
            [(f'{{position="{i}"}}', n) for i, n in enumerate(t["accepted_per_pos"])],
        )
        metric(
            "spec_decode_num_draft_tokens_per_pos_total",
            "counter",
            "Proposed draft tokens by draft position.",
            [(f'{{position="{i}"}}', n) for i, n in enumerate(t["drafted_per_pos"])],
        )
        metric(
            "spec_decode_steps",
            "gauge",
            "Draft steps K used by the last engine step (0 = plain decoding).",
            [("", snap["last_k"])],
        )
        metric(
            "spec_decode_steps_chosen_total",
            "counter",
            "Engine steps run with each K (adaptive choice).",
            [(f'{{k="{k}"}}', n) for k, n in sorted(snap["k_choices"].items())],
        )
        return "\n".join(out) + "\n"
