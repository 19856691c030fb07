"""What a drafter catch-up costs on a GPU, and why: eager SDPA at catch-up shapes under each backend (the
first call of a new shape, then two repeats, ms) and `Proposer.catch_up` timed after 16-400 plain steps on
the demo pair (the policy forced to plain decoding, then K=3), with a profile of one (kernels, host ops).

    python benchmarks/catch_up_probe.py   (writes $OUT/catchup.json)

cuDNN's attention builds an execution plan for every new shape on the host (tens of ms to a second), and
catch-ups and continued prompt chunks come in ever new lengths: `model.layers._CUDA_SDPA` leaves it out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.engine.llm import LLM, demo_paths  # noqa: E402
from specserve.engine.sampling import SamplingParams  # noqa: E402


def sdpa_ms(T: int, L: int, backend: SDPBackend | None, G: int = 3, Hkv: int = 3, D: int = 64) -> list[float]:
    """Masked SDPA of one row's G*T queries a KV head over L keys: the first call, then two more."""
    q = torch.randn(1, Hkv, G * T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, G * T, L, device="cuda", dtype=torch.bfloat16)
    out = []
    with sdpa_kernel([backend]) if backend is not None else torch.no_grad():
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            out.append(round((time.perf_counter() - t) * 1e3, 3))
    return out


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    res: dict = {}
    backends = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "math": SDPBackend.MATH}
    for T, L in ((100, 300), (101, 301), (200, 400), (384, 500)):
        row = {}
        for name, b in backends.items():
            try:
                row[name] = sdpa_ms(T, L, b)
            except RuntimeError as e:  # a backend that does not take these inputs
                row[name] = str(e)[:80]
        res[f"sdpa T={T} L={L}"] = row
        print(T, L, row, flush=True)

    llm = LLM(*demo_paths(), spec_steps=0, max_spec_steps=6, adaptive=True)
    eng, pr = llm.engine, llm.engine.proposer
    real = pr.catch_up
    prompt = list(range(5, 40))
    for stale in (16, 64, 128, 256, 400):
        steps, times = [0], []

        def choose(B, remaining=None, stale_rows=False, at=(stale, 2 * stale + 1)):
            steps[0] += 1
            return 3 if steps[0] in at else 0

        def timed(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            real(*a, **k)
            torch.cuda.synchronize()
            times.append(round((time.perf_counter() - t) * 1e3, 2))
        eng.policy.choose, pr.catch_up = choose, timed
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2 * stale + 10, ignore_eos=True))
        res[f"catch_up stale={stale}"] = times
        print("catch_up", stale, times, flush=True)

    steps = [0]

    def choose_once(B, remaining=None, stale_rows=False):
        steps[0] += 1
        return 3 if steps[0] == 256 else 0

    def profiled(*a, **k):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            real(*a, **k)
            torch.cuda.synchronize()
        ka = p.key_averages()
        cuda = sorted((e for e in ka if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[:12]
        res["profile_cuda"] = [(e.key[:70], e.count, round(e.self_device_time_total / 1e3, 3)) for e in cuda]
        res["profile_cpu"] = [(e.key[:70], e.count, round(e.self_cpu_time_total / 1e3, 3))
                              for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]]
        res["profile_cuda_total_ms"] = round(sum(e.self_device_time_total for e in ka) / 1e3, 3)
    eng.policy.choose, pr.catch_up = choose_once, profiled
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=266, ignore_eos=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "catchup.json").write_text(json.dumps(res, indent=1))
    for row in res.get("profile_cuda", []):
        print("cuda", row)
    print("device time of the profiled catch-up (ms):", res.get("profile_cuda_total_ms"))


if __name__ == "__main__":
    main()
