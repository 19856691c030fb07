"""Shared-prefix workload on the paged KV cache: requests with one long system prompt and a
short distinct tail arrive at a Poisson rate; TTFT, throughput and the prefix-cache hit rate with
and without prefix caching, plainly and speculatively, on one engine (switched while idle).
Also the KV pool's size and how many sequences of a given length it holds.

    python benchmarks/prefix_bench.py --model M --draft D --out prefix.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams


def run(engine: Engine, prompts, rate: float, max_tokens: int, seed: int) -> dict:
    g = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in prompts:
        t += g.expovariate(rate)
        arrivals.append(t)
    kv0 = engine.kv_usage()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start, seqs, i = time.perf_counter(), [], 0
    while i < len(prompts) or engine.has_work():
        now = time.perf_counter() - start
        while i < len(prompts) and arrivals[i] <= now:
            s = engine.add_request(prompts[i], params)
            s.arrival = start + arrivals[i]
            seqs.append(s)
            i += 1
        if engine.has_work():
            engine.step()
        elif i < len(prompts):
            time.sleep(min(0.001, max(arrivals[i] - now, 0)))
    wall = time.perf_counter() - start
    kv = engine.kv_usage()
    ttft = [s.first_token_time - s.arrival for s in seqs]
    q = kv["prefix_queried_tokens"] - kv0["prefix_queried_tokens"]
    return {
        "requests": len(seqs),
        "wall_s": wall,
        "output_tok_s": sum(len(s.output_ids) for s in seqs) / wall,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": sorted(ttft)[int(0.9 * len(ttft))],
        "prefix_hit_rate": (kv["prefix_hit_tokens"] - kv0["prefix_hit_tokens"]) / q if q else None,
        "preemptions": kv["preemptions"] - kv0["preemptions"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--spec-steps", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=16.0, help="arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--fit-lengths", type=int, nargs="*", default=[32768])
    ap.add_argument("--out")
    a = ap.parse_args()
    g = random.Random(0)
    vocab = 4000
    prefix = [g.randrange(vocab) for _ in range(a.prefix_tokens)]
    prompts = [prefix + [g.randrange(vocab) for _ in range(a.tail_tokens)] for _ in range(a.requests)]
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=a.model,
            draft=a.draft,
            spec_steps=a.spec_steps if a.draft else 0,
            max_num_seqs=a.requests,
            max_model_len=a.max_model_len,
            prefix_cache=True,
            gpu_memory_utilization=a.gpu_memory_utilization,
        )
    )
    kv = engine.kv_usage()
    pool_tokens = kv["blocks_total"] * kv["block_size"]
    per_token = engine.runner.kv.nbytes() // engine.runner.kv.num_blocks // kv["block_size"]
    out = {
        "model": a.model,
        "draft": a.draft,
        "build_s": time.perf_counter() - t0,
        "pool_tokens": pool_tokens,
        "kv_bytes_per_token": per_token,
        "block_size": kv["block_size"],
        "fit": {str(n): pool_tokens // n for n in a.fit_lengths},
        "runs": [],
    }
    run(engine, prompts[:4], a.rate, 8, seed=99)  # warm-up (first eager shapes)
    for K in [0, a.spec_steps] if a.draft else [0]:
        if a.draft:
            engine.set_spec_steps(K)
        for on in (False, True):
            engine.set_prefix_cache(on)
            r = run(engine, prompts, a.rate, a.max_tokens, seed=1)
            r.update(spec_steps=K, prefix_cache=on)
            out["runs"].append(r)
            print(
                f"K={K} prefix_cache={on!s:5} TTFT mean {r['ttft_mean_s'] * 1e3:8.1f} ms p50 "
                f"{r['ttft_p50_s'] * 1e3:8.1f} p90 {r['ttft_p90_s'] * 1e3:8.1f}  {r['output_tok_s']:8.1f} tok/s  "
                f"hit rate {r['prefix_hit_rate']}",
                flush=True,
            )
            engine.check_idle_integrity()
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
