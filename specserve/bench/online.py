"""Online benchmark: drive any OpenAI-compatible server (specserve, SGLang,
vLLM) over HTTP with streaming requests, at a fixed concurrency or with
Poisson arrivals, and read speculative acceptance from /metrics deltas.

Never imports torch: it runs on any client machine.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field

from specserve.bench import report
from specserve.config import ConfigError

# Counter families per server: drafts, draft tokens, accepted tokens, accepted per position
# (label position="i"), drafted per position. A trailing _total (prometheus_client's counter
# suffix) is optional. Per-position rates divide by the drafted-per-position counter where the
# server has one (specserve: right under adaptive K), else by the drafts (vLLM: fixed K).
SPEC_COUNTERS = {
    "specserve": (
        "specserve:spec_decode_num_drafts",
        "specserve:spec_decode_num_draft_tokens",
        "specserve:spec_decode_num_accepted_tokens",
        "specserve:spec_decode_num_accepted_tokens_per_pos",
        "specserve:spec_decode_num_draft_tokens_per_pos",
    ),
    "vllm": (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        None,
    ),
}
STEPS_CHOSEN = "specserve:spec_decode_steps_chosen"  # {k="K"}: engine steps per K (adaptive)
# SGLang exports no draft counters: verify calls and generated tokens are counters, acceptance
# length and rate are gauges of recent batches.
SGLANG_VERIFY, SGLANG_GEN, SGLANG_REQS = ("sglang:spec_verify_calls", "sglang:generation_tokens", "sglang:num_requests")
SGLANG_GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text format -> {name without _total: [(labels, value)]}."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith("_created"):  # creation timestamps of counters, not counts
            continue
        name = name.removesuffix("_total")
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), v))
    return out


def _sum(m: dict, name: str) -> float | None:
    return sum(v for _, v in m[name]) if name in m else None


def _per_pos(m: dict, name: str) -> dict[int, float]:
    pos: dict[int, float] = {}
    for labels, v in m.get(name, []):
        if "position" in labels:
            i = int(labels["position"])
            pos[i] = pos.get(i, 0.0) + v
    return pos


def acceptance_delta(before: dict, after: dict, completed: int) -> dict | None:
    """Acceptance over the run from counter deltas (None if the server exports none)."""
    for source, (drafts, draft_toks, accepted, per_pos, drafted_pos) in SPEC_COUNTERS.items():
        if drafts not in after:
            continue
        d = (_sum(after, drafts) or 0) - (_sum(before, drafts) or 0)
        dt = (_sum(after, draft_toks) or 0) - (_sum(before, draft_toks) or 0)
        a = (_sum(after, accepted) or 0) - (_sum(before, accepted) or 0)
        pa, pb = _per_pos(after, per_pos), _per_pos(before, per_pos)
        acc_pos = [pa[i] - pb.get(i, 0.0) for i in sorted(pa)]
        if drafted_pos and drafted_pos in after:
            da, db = _per_pos(after, drafted_pos), _per_pos(before, drafted_pos)
            den = [da.get(i, 0.0) - db.get(i, 0.0) for i in sorted(pa)]
        else:
            den = [d] * len(acc_pos)
        out = {
            "source": source,
            "drafts": d,
            "draft_tokens": dt,
            "accepted_tokens": a,
            "accept_length": 1 + a / d if d else None,
            "accept_rate": a / dt if dt else None,
            "accept_per_position": [x / n if n else None for x, n in zip(acc_pos, den)] if d and acc_pos else None,
        }
        if STEPS_CHOSEN in after:
            kb = {lb.get("k"): v for lb, v in before.get(STEPS_CHOSEN, [])}
            out["steps_chosen"] = {lb.get("k"): v - kb.get(lb.get("k"), 0.0) for lb, v in after[STEPS_CHOSEN]}
        return out
    if SGLANG_VERIFY in after:
        v = (_sum(after, SGLANG_VERIFY) or 0) - (_sum(before, SGLANG_VERIFY) or 0)
        g = (_sum(after, SGLANG_GEN) or 0) - (_sum(before, SGLANG_GEN) or 0)
        r = ((_sum(after, SGLANG_REQS) or 0) - (_sum(before, SGLANG_REQS) or 0)) if SGLANG_REQS in after else completed
        gauges = {n.split(":")[1]: _sum(after, n) for n in SGLANG_GAUGES if n in after}
        # Each request's first token comes from prefill; every later token from a verify step.
        return {
            "source": "sglang",
            "verify_calls": v,
            "generated_tokens": g,
            "accept_length": (g - r) / v if v else None,
            "accept_rate": gauges.get("spec_accept_rate"),
            "accept_per_position": None,
            "gauges_after": gauges,
        }
    return None


def percentiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)

    def q(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(s) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {
        "mean": statistics.fmean(s),
        "p50": q(50),
        "p90": q(90),
        "p99": q(99),
        "min": s[0],
        "max": s[-1],
        "count": len(s),
    }


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival times of content chunks
    usage_tokens: int | None = None


async def _one(client, base: str, model: str, prompt: dict, args) -> Result:
    import httpx

    chat = prompt["prompt"] is None
    body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos or (args.ignore_eos is None and not chat):  # (a chat answer ends at its turn by default)
        body["ignore_eos"] = True  # an extension (vLLM, SGLang, specserve) for equal output lengths
    if chat:
        body["messages"] = prompt["messages"]
    else:
        body["prompt"] = prompt["prompt"]
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    res = Result()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {json.dumps(obj['error'])[:200]}"
                    return res
                if obj.get("usage"):
                    res.usage_tokens = obj["usage"].get("completion_tokens")
                for ch in obj.get("choices") or []:
                    piece = ch.get("delta", {}).get("content") if chat else ch.get("text")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        res.chunks.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = True
    return res


async def _scrape(client, base: str) -> dict | None:
    import httpx

    try:
        r = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


async def _json_get(client, url: str):
    import httpx

    try:
        r = await client.get(url)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _run(args, prompts: list[dict]) -> dict:
    from specserve.extras import require

    httpx = require("httpx", "bench", "bench --url")

    base = args.url.rstrip("/")
    n = args.num_requests or len(prompts)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        try:
            models = (await client.get(f"{base}/v1/models")).json()
        except (httpx.HTTPError, ValueError) as e:
            if args.served_model_name is None:
                raise ConfigError(
                    f"cannot read {base}/v1/models ({type(e).__name__}: {e}); is the server up? "
                    f"(or pass --served-model-name)"
                ) from None
            models = None
        model = args.served_model_name or ((models or {}).get("data") or [{}])[0].get("id")
        if not model:
            raise ConfigError(f"{base}/v1/models lists no model; pass --served-model-name")
        server_info = await _json_get(client, f"{base}/server_info")
        load_avg_start = report.load_average()
        before = await _scrape(client, base)

        bar = None
        if args.progress:
            import sys

            from tqdm import tqdm

            bar = tqdm(total=n, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True, disable=None)
        results: list[Result] = [Result() for _ in range(n)]

        async def task(i: int, sem: asyncio.Semaphore | None):
            if sem is None:
                results[i] = await _one(client, base, model, prompts[i % len(prompts)], args)
            else:
                async with sem:
                    results[i] = await _one(client, base, model, prompts[i % len(prompts)], args)
            if bar:
                bar.update(1)

        t0 = time.perf_counter()
        if args.request_rate:
            rng = random.Random(args.seed)
            sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
            tasks, start = [], t0
            for i in range(n):
                tasks.append(asyncio.create_task(task(i, sem)))
                start += rng.expovariate(args.request_rate)  # Poisson process: exponential gaps
                await asyncio.sleep(max(0.0, start - time.perf_counter()))
            await asyncio.gather(*tasks)
            load = {"mode": "poisson", "request_rate": args.request_rate, "max_concurrency": args.concurrency}
        else:
            conc = args.concurrency or 1
            sem = asyncio.Semaphore(conc)
            await asyncio.gather(*(task(i, sem) for i in range(n)))
            load = {"mode": "concurrency", "concurrency": conc}
        duration = time.perf_counter() - t0
        if bar:
            bar.close()
        after = await _scrape(client, base)

    ok = [r for r in results if r.ok]
    have_usage = ok and all(r.usage_tokens is not None for r in ok)
    tokens = [r.usage_tokens if have_usage else len(r.chunks) for r in ok]
    ttft = [1000 * r.ttft for r in ok if r.ttft is not None]
    tpot = [1000 * (r.e2e - r.ttft) / (t - 1) for r, t in zip(ok, tokens) if r.ttft is not None and t > 1]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    e2e = [1000 * r.e2e for r in ok]
    acc = acceptance_delta(before, after, len(ok)) if before is not None and after is not None else None
    out_tok = sum(tokens)
    label = args.label or model
    online = {
        "url": base,
        "model": model,
        "server_info": server_info,
        "load": {**load, "num_requests": n, "seed": args.seed},
        "completed": len(ok),
        "failed": n - len(ok),
        "errors": [r.error for r in results if r.error][:5],
        "duration_s": duration,
        "output_tokens": out_tok,
        "tokens_counted_by": "usage" if have_usage else "chunks (no usage in stream)",
        "output_tok_s": out_tok / duration if duration else 0.0,
        "request_s": len(ok) / duration if duration else 0.0,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
        "metrics_available": after is not None,
        "acceptance": acc,
    }
    tps = online["output_tok_s"]
    row = {
        "config": label,
        "kind": "server",
        "batch_size": load.get("concurrency"),
        "category": "all",
        "available": bool(ok),
        "reason": None if ok else "no request completed",
        "tok_s": {"median": tps, "min": tps, "max": tps, "values": [tps]} if ok else None,
        "tpot_ms": None,
        "ttft_ms": None,
        "tokens_per_repeat": out_tok,
        "accept_length": acc and acc.get("accept_length"),
        "accept_per_position": acc and acc.get("accept_per_position"),
        "speedup": None,
        "speedup_values": None,
        "matches_baseline": None,
        "match_rate": None,
        "details": {},
    }
    if ok:
        row["tpot_ms"] = (
            {
                "median": online["tpot_ms"]["p50"],
                "min": online["tpot_ms"]["min"],
                "max": online["tpot_ms"]["max"],
                "values": [],
            }
            if online["tpot_ms"]
            else None
        )
        row["ttft_ms"] = (
            {
                "median": online["ttft_ms"]["p50"],
                "min": online["ttft_ms"]["min"],
                "max": online["ttft_ms"]["max"],
                "values": [],
            }
            if online["ttft_ms"]
            else None
        )
    return {
        "schema_version": report.SCHEMA_VERSION,
        "mode": "online",
        "created": report.now_iso(),
        "command": report.command_line(),
        "machine": report.machine_info(None),
        "versions": report.versions(),
        "model": {"path": None, "name": model, "preset": None},
        "draft": None,
        "settings": {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": "plain-text prompts" if args.ignore_eos is None else args.ignore_eos,
            "prompts": {"path": str(args.prompts or "bundled"), "count": len(prompts)},
        },
        "wall_s": round(duration, 3),
        "load_average": {"start": load_avg_start, "end": report.load_average()},
        "results": [row],
        "by_category": [],
        "cost_model": None,
        "online": online,
    }


def run_online(args, prompts: list[dict]) -> dict:
    return asyncio.run(_run(args, prompts))
