"""GPU time of the dense W4A16 product (`kernels.int4.int4_matmul`) against bf16 at decode and
verify row counts, on Llama-3-8B and Kimi-K2.5 (attention, shared expert) shapes.

    python benchmarks/int4_linear_gpu.py [--rows 1 2 4 8 16 32 64] [--group 32 128] [--out FILE.json]

Each product runs on weight copies that together exceed the GPU's L2 cache, cycled in one CUDA
graph of many calls, so every call streams its weight from memory as in a real forward; the time
is the graph's replay over the calls (median of several replays). Reported per shape and row
count: us a call, GB/s of the int4 bytes (packed words + scales) and of the bf16 weight, and the
speed-up over bf16 (cuBLAS, or the tuned Triton GEMV where it wins, as the engine runs it). The
int4 product runs as the engine runs it too: with the launch shape (tiles, K slices) that
`tune_int4` chose at start-up; the JSON also holds that config and the untuned default's time
(`default_config`, as the tuner timed it). Each int4 result is checked against the dequantized
reference first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.kernels.gemv import rows_bucket, tune_linear  # noqa: E402
from specserve.kernels.int4 import dequantize_int4, int4_matmul, pack_int4, quantize_int4, tune_int4  # noqa: E402
from specserve.kernels.linear import linear  # noqa: E402

SHAPES = {  # name: (out features N, in features K)
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "kimi.q_a": (1536, 7168),
    "kimi.kv_a": (576, 7168),
    "kimi.o": (7168, 8192),
    "kimi.shared_gate_up": (4096, 7168),
    "kimi.shared_down": (7168, 2048),
}
CACHE_BYTES = 256 << 20  # past the H200's 50 MB L2, with room


def graph_us(fns, reps: int = 7) -> float:
    """us per call of the callables `fns` run in turn inside one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:  # warm-up (Triton compiles, cuBLAS picks) outside the capture
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(fns))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--group", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    print(
        f"{'shape':22} {'group':>5} {'rows':>4} {'int4 us':>8} {'int4 GB/s':>9} {'bf16 us':>8} {'bf16 GB/s':>9} "
        f"{'speed-up':>8} {'default us':>10} config"
    )
    for name in args.shapes:
        N, K = SHAPES[name]
        w = torch.randn(N, K, device=dev, dtype=dt) * 0.02
        copies_bf16 = max(2, -(-CACHE_BYTES // w.nbytes))
        bf16 = [w.clone() for _ in range(copies_bf16)]
        tune_linear(bf16, max_rows=max(args.rows))  # the engine's bf16 product: the GEMV where it wins
        for group in args.group:
            if K % group:
                continue
            q, scale, _ = quantize_int4(w, group)
            packed = pack_int4(q)
            int4_bytes = packed.nbytes + scale.nbytes
            copies = max(2, -(-CACHE_BYTES // int4_bytes))
            stack = [(packed.clone(), scale.clone()) for _ in range(copies)]
            tuned = next(iter(tune_int4([(p, s, None) for p, s in stack], max_rows=max(args.rows)).values()))
            for rows in args.rows:
                x = torch.randn(rows, K, device=dev, dtype=dt)
                want = x.float() @ dequantize_int4(packed, scale, None, dt).float().t()
                got = int4_matmul(x, *stack[0]).float()  # (the tuned launch shape)
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    raise SystemExit(f"{name} group {group} rows {rows}: int4 product off by {err:.3g} of its range")
                t4 = graph_us([lambda p=p, s=s: int4_matmul(x, p, s) for p, s in stack])
                tb = graph_us([lambda c=c: linear(x, c) for c in bf16])
                default_us, _, cfg = tuned[rows_bucket(rows)]
                row = {
                    "shape": name,
                    "N": N,
                    "K": K,
                    "group": group,
                    "rows": rows,
                    "int4_us": t4,
                    "int4_GBs": int4_bytes / t4 / 1e3,
                    "bf16_us": tb,
                    "bf16_GBs": w.nbytes / tb / 1e3,
                    "speedup": tb / t4,
                    "max_rel_err": err,
                    "int4_config": cfg,
                    "int4_default_us": default_us,
                }
                res["results"].append(row)
                print(
                    f"{name:22} {group:5} {rows:4} {t4:8.1f} {row['int4_GBs']:9.0f} {tb:8.1f} {row['bf16_GBs']:9.0f} "
                    f"{row['speedup']:7.2f}x {default_us:10.1f} {cfg}"
                )
            del stack
        del bf16
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
