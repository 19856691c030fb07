"""The routed int4 experts at decode sizes: the CUDA kernels (`kernels.moe.int4_cuda_experts`) against
the Triton ones and a dequantized bf16 reference, at Kimi-K2.5 width (384 experts of 2048, hidden 7168,
top-8, int4 in groups of 32, random weights), on one GPU.

    python benchmarks/int4_moe_cuda.py [--tokens 1 2 4 8] [--sweep] [--out FILE.json]

Per token count: the largest difference of each path from the reference (relative to the reference's
largest value), and each path's time as a CUDA-graph replay with the int4 bytes and scales of the
distinct experts touched, streamed from memory (8 experts are ~200 MB, four times the L2). `--sweep` also
times the CUDA kernels compiled with other pipeline depths (chunks in flight), row tiles a block and slices
of the input features a tile's warps share (the error beside each time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.kernels import moe  # noqa: E402
from specserve.kernels.int4 import dequantize_int4, tile_experts  # noqa: E402
from specserve.kernels.moe import default_tiles, fused_experts, int4_cuda_experts, int4_cuda_fits  # noqa: E402

from benchmarks.gpu_engine import copy_bandwidth, gpu_ms  # noqa: E402


def experts(E: int, rows: int, K: int, group: int, gen: torch.Generator) -> SimpleNamespace:
    packed = torch.randint(-(2**31), 2**31 - 1, (E, rows, K // 8), dtype=torch.int32, device="cuda", generator=gen)
    scale = (torch.rand(E, rows, K // group, device="cuda", generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    return SimpleNamespace(packed=packed, scale=scale, zero=None, tiled=False)


def tiled(w: SimpleNamespace, interleave: int) -> SimpleNamespace:
    """The stack in the order loading gives int4 experts on a GPU (`kernels.int4.tile_experts`)."""
    packed, scale = tile_experts(w.packed, w.scale, interleave)
    return SimpleNamespace(packed=packed, scale=scale, zero=None, tiled=True)


def reference(x, weights, ids, w13, w2) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    I = w2.packed.shape[2] * 8
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = x[t] @ dequantize_int4(w13.packed[e], w13.scale[e], None, torch.bfloat16).T
            h = (torch.nn.functional.silu(gu[:I].float()) * gu[I:].float()).to(torch.bfloat16)
            y = h @ dequantize_int4(w2.packed[e], w2.scale[e], None, torch.bfloat16).T
            out[t] += (y.float() * weights[t, k].float()).to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return gpu_ms(g.replay, iters=100)


def sweep(run, ref, scale, group: int) -> dict:
    """ms (and the error) of `run` with the kernels compiled for other pipeline depths, warps a block and
    slices of the input features."""
    kept, warps, split = moe._cuda_kernels, moe.CUDA_WARPS, moe.CUDA_SPLIT
    out = {}
    try:
        stage_bytes = 1280  # static shared memory a warp and stage
        for stages in (2, 4, 6):
            for w in (2, 4, 8):
                for k in (1, 2, 4):
                    if stages * w * k * stage_bytes + (k - 1) * w * 512 > 48 * 1024:
                        continue
                    compiled = moe.compile_cuda_kernels(w, k, group, (f"-DSTAGES={stages}",))
                    moe._cuda_kernels, moe.CUDA_WARPS, moe.CUDA_SPLIT = (lambda g, c=compiled: c), w, k
                    out[f"stages{stages}-warps{w}-split{k}"] = {
                        "ms": graph_ms(run),
                        "rel_err": (run().float() - ref).abs().max().item() / scale,
                    }
    finally:
        moe._cuda_kernels, moe.CUDA_WARPS, moe.CUDA_SPLIT = kept, warps, split
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    H, I, top_k, group, E = 7168, 2048, 8, 32, args.experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = experts(E, 2 * I, H, group, gen), experts(E, H, I, group, gen)  # (the reference's)
    t13, t2 = tiled(w13, I), tiled(w2, 0)  # (both kernels')
    bw = copy_bandwidth()
    expert_bytes = 2 * I * H // 2 + 2 * I * (H // group) * 2 + H * I // 2 + H * (I // group) * 2
    rows = []
    for N in args.tokens:
        x = (torch.randn(N, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:top_k] for _ in range(N)])
        weights = torch.rand(N, top_k, device="cuda", generator=gen).to(torch.bfloat16)
        P = N * top_k
        assert int4_cuda_fits(x, t13, t2, P)
        ref = reference(x, weights, ids, w13, w2).float()
        scale = ref.abs().max().item()
        cuda = lambda: int4_cuda_experts(x, weights, ids, t13, t2)  # noqa: E731
        tri = lambda: fused_experts(x, weights, ids, t13, t2, tiles=default_tiles(P, True))  # noqa: E731
        err = {name: (fn().float() - ref).abs().max().item() / scale for name, fn in (("cuda", cuda), ("triton", tri))}
        touched = ids.unique().numel()
        ms = {name: graph_ms(fn) for name, fn in (("cuda", cuda), ("triton", tri))}
        nbytes = touched * expert_bytes
        row = {
            "tokens": N,
            "pairs": P,
            "experts_touched": touched,
            "bytes": nbytes,
            "rel_err": err,
            "ms": ms,
            "tb_s": {k: nbytes / (v * 1e-3) / 1e12 for k, v in ms.items()},
            "roofline_ms": nbytes / bw * 1e3,
        }
        if args.sweep:
            row["sweep"] = sweep(lambda: int4_cuda_experts(x, weights, ids, t13, t2), ref, scale, group)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_tb_s": bw / 1e12,
        "shape": {"hidden": H, "moe_intermediate": I, "experts": E, "top_k": top_k, "group": group},
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"{'tokens':>6}{'experts':>8}{'cuda ms':>9}{'TB/s':>7}{'triton ms':>10}{'TB/s':>7}{'roof ms':>8}"
        f"{'err cuda':>10}{'err tri':>9}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6}{r['experts_touched']:>8}{r['ms']['cuda']:>9.3f}{r['tb_s']['cuda']:>7.2f}"
            f"{r['ms']['triton']:>10.3f}{r['tb_s']['triton']:>7.2f}{r['roofline_ms']:>8.3f}"
            f"{r['rel_err']['cuda']:>10.2e}{r['rel_err']['triton']:>9.2e}"
        )
    for r in rows:
        if "sweep" in r:
            best = sorted(r["sweep"].items(), key=lambda kv: kv[1]["ms"])
            print(
                f"tokens {r['tokens']}: " + ", ".join(f"{k} {v['ms']:.3f} ms (err {v['rel_err']:.1e})" for k, v in best)
            )


if __name__ == "__main__":
    main()
