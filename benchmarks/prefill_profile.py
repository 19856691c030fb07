"""Where a prefill chunk's time goes: prompts of a given length prefilled together (one `generate` of one new
token, so the chunk and one decode step), timed and profiled by kernel.

    python benchmarks/prefill_profile.py --model M [--draft D] [--shapes 1x512 6x50 10x48] [--out FILE.json]

A shape PxT is P random prompts of T tokens at once (their chunks up to the engine's prefill chunk). Per shape:
the wall of the call (median of --repeats after a warm-up) and the kernels of one profiled call, by total time
(GPU: CUDA kernels; CPU: operators), their sum, and the specserve and Triton functions the host spends most
time in (cProfile of one more call). On a MoE target a chunk reads nearly every expert whatever its length:
compare the time with that of reading the expert weights once.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.engine.llm import LLM  # noqa: E402
from specserve.engine.sampling import SamplingParams  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    p, t = text.lower().split("x")
    return int(p), int(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--shapes", type=shape, nargs="+", default=[(1, 512), (6, 50), (10, 48)])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = max(p for p, _ in args.shapes)
    llm = LLM(
        args.model,
        args.draft,
        spec_steps=0,
        max_spec_steps=3 if args.draft else 0,
        adaptive=bool(args.draft),
        max_num_seqs=max(rows, 8),
    )
    cuda = llm.engine.device.type == "cuda"
    vocab = llm.engine.runner.model_cfg.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    result: dict = {"model": args.model, "device": str(llm.engine.device), "shapes": {}}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for P, T in args.shapes:

        def prompts():  # new ones every call: the prefix cache must find nothing
            return [torch.randint(0, vocab, (T,), generator=g).tolist() for _ in range(P)]

        def call(ids):
            sync()
            t0 = time.perf_counter()
            llm.generate(ids, [one] * P)
            sync()
            return time.perf_counter() - t0

        call(prompts())  # warm-up: compiles, lazy allocations
        walls = [call(prompts()) for _ in range(args.repeats)]
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ids = prompts()
        with profile(activities=acts) as prof:
            call(ids)
        key = "device_time_total" if cuda else "self_cpu_time_total"
        events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        if cuda:
            events = [e for e in events if e.device_type.name == "CUDA"] or events
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        top = [{"kernel": e.key[:100], "calls": e.count, "us": round(getattr(e, key), 1)} for e in events[: args.top]]
        busy_ms = sum(getattr(e, key) for e in events) / 1e3
        # The host's side: the specserve functions taking the most time, as cProfile sees one more call
        # (the wall a call spends beyond its kernels is the host's, where the GPU waits on it).
        prof_py = cProfile.Profile()
        ids = prompts()
        prof_py.enable()
        call(ids)
        prof_py.disable()
        stats = pstats.Stats(prof_py).stats
        host = sorted(
            (
                (v[3], v[1], f"{Path(k[0]).name}:{k[1]}:{k[2]}")
                for k, v in stats.items()
                if "specserve" in k[0] or "triton" in k[0]
            ),
            reverse=True,
        )[: args.top]
        result["shapes"][f"{P}x{T}"] = {
            "wall_ms": round(1e3 * statistics.median(walls), 3),
            "kernels_ms": round(busy_ms, 3),
            "kernels": top,
            "host": [{"function": f, "calls": n, "cumulative_ms": round(1e3 * t, 2)} for t, n, f in host],
        }
        print(
            f"{P} x {T} tokens: {1e3 * statistics.median(walls):.2f} ms a call (prefill + one step), "
            f"{busy_ms:.2f} ms of {'kernels' if cuda else 'operators'}"
        )
        for k in top:
            print(f"  {k['us']:>10.1f} us {k['calls']:>6}x  {k['kernel']}")
        print("  host (cProfile, cumulative):")
        for t, n, f in host:
            print(f"  {1e3 * t:>10.2f} ms {n:>6}x  {f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
