"""Latent attention (MLA) kernel alone on one GPU: correctness at full width and time against its rooflines.

    python benchmarks/mla_attention_gpu.py [--contexts 4096 32768 131072 262144] [--out DIR] [--sweep]

For Kimi-K2.5 (64 heads) and DeepSeek-V3 (128 heads) shapes (latent 512, rope 64, bf16 paged cache of
64-token blocks in shuffled order), batch 1 and 4, decode (T=1) and verify blocks of K+1 tokens (K=1..4):
  - checks the kernel against a float32 reference (decode, chain and tree verify, short rows in a long
    cache, 128k with every split), relative error ||out - ref|| / ||ref||;
  - times it with CUDA-graph replays (several caches in turn where one would sit in L2) and sets it
    against its two floors: the latent cache's bytes over the measured copy bandwidth and the products'
    FLOPs over the measured bf16 matmul rate; verify(K+1)/decode against the same ratio of floors;
  - with --sweep, first times launch shapes (key tile, stages, waves) at 128k and keeps the fastest;
  - with --old MODULE, times that module's `latent_attention_triton` too at T = 1 and K_max + 1 (the kernel
    before: `git show c9b30be:specserve/kernels/latent_attention.py > benchmarks/_old_latent.py`, then
    --old benchmarks._old_latent).
Writes mla_attention_bs<block size>.json under --out (default $OUT) and prints a table last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.kernels import latent_attention as la  # noqa: E402

from benchmarks.gpu_engine import copy_bandwidth, gpu_ms  # noqa: E402

L, R, BS = 512, 64, 64
SHAPES = {"kimi-k2.5": 64, "deepseek-v3": 128}
SCALE = (128 + 64) ** -0.5
POOL_BYTES = 512 << 20  # caches cycled through per timing: several times the 50 MB L2


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (gpu_ms(lambda: a @ a, 20) / 1e3)


def make_case(B, T, H, ctx, copies, g):
    """`copies` independent caches of B rows (one block pool), queries, write indices ending at ctx - 1."""
    cols = math.ceil((ctx + 64) / BS)
    rows = B * copies
    pool = torch.randn(rows * cols, 1, BS, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(rows * cols, device="cuda", generator=g).view(rows, cols)
    q = torch.randn(B, T, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    widx = (ctx - T + torch.arange(T, device="cuda")).view(1, T).repeat(B, 1).contiguous()
    return pool, table, q, widx, cols * BS - 1


def reference(q, pool, table, row_start, widx, scratch, tree_base=None, tree_anc=None):
    """Float32 attention of q over rows row_start.. of the paged cache, the kernel's masking rules."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, L, device="cuda")
    for b in range(B):
        n = int(widx[b].max()) + 1
        keys = pool[table[row_start + b]].reshape(-1, L + R)[:n].float()
        s = torch.einsum("thd,nd->thn", q[b].float(), keys) * SCALE
        pos = torch.arange(n, device="cuda")
        seen = pos.view(1, n) <= widx[b].view(T, 1)
        if tree_anc is not None:
            rel = pos - tree_base[b]
            bits = (tree_anc[b].view(T, 1) >> rel.clamp(0, 62).view(1, n)) & 1
            seen &= (rel < 0).view(1, n) | ((rel < 63).view(1, n) & (bits == 1))
        seen &= (widx[b] != scratch).view(T, 1)
        s = s.masked_fill(~seen.view(T, 1, n), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[b] = torch.einsum("thn,nl->thl", p, keys[:, :L])
    return out


def rel_err(got, want) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def checks(g) -> list[dict]:
    res = []
    cases = [
        ("decode", 64, 1, 2, 3000, False),
        ("verify K=4", 64, 5, 2, 3000, False),
        ("tree verify", 128, 6, 2, 3000, True),
        ("decode tp8", 8, 1, 3, 5000, False),
        ("verify K=3 tp8", 16, 4, 3, 5000, False),
        ("decode 128k", 64, 1, 1, 131072, False),
        ("verify K=4 128k", 128, 5, 1, 131072, False),
    ]
    for name, H, T, B, ctx, tree in cases:
        pool, table, q, widx, scratch = make_case(B, T, H, ctx, 1, g)
        widx[0] -= ctx // 2  # a short row beside long ones
        base = anc = None
        if tree:  # the block's tokens are tree nodes, each seeing the context and the nodes its bits name
            base = widx[:, 0].contiguous()
            anc = torch.tensor([[1, 0b11, 0b101, 0b1011, 0b10101, 0b110011][:T]] * B, device="cuda")
        if B > 2:
            widx[-1, -1] = scratch  # a padding query
        got = la.latent_attention_triton(
            q, pool, L, 0, widx, scratch, SCALE, tree_base=base, tree_anc=anc, block_table=table, block_size=BS
        )
        want = reference(q, pool, table, 0, widx, scratch, base, anc)
        err = rel_err(got, want)
        finite = bool(torch.isfinite(got).all())
        res.append(
            {
                "case": name,
                "H": H,
                "T": T,
                "B": B,
                "context": ctx,
                "rel_err": err,
                "finite": finite,
                "splits": la.latent_splits(
                    table.shape[1] * BS, B, T, H, torch.cuda.get_device_properties(0).multi_processor_count
                ),
                "ok": finite and err < 1e-2,
            }
        )
        print(res[-1], flush=True)
    return res


def time_case(fn_attn, B, T, H, ctx, g, paged=True) -> float:
    """Median us of one call, CUDA-graph replays over several caches in turn (paged, or the same keys as
    one slot cache [rows, 1, length, L + R] with `paged` False)."""
    copies = max(1, min(16, POOL_BYTES // (B * ctx * (L + R) * 2)))
    pool, table, q, widx, scratch = make_case(B, T, H, ctx, copies, g)
    calls = max(copies, 8)
    kw = {"block_table": table, "block_size": BS}
    if not paged:
        pool, kw = pool.view(table.shape[0], 1, -1, L + R), {}

    def run():
        for i in range(calls):
            fn_attn(q, pool, L, (i % copies) * B, widx, scratch, SCALE, **kw)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = gpu_ms(graph.replay, 20)
    return ms * 1e3 / calls


def floors(B, T, H, ctx, bw, rate):
    bytes_ = B * ctx * (L + R) * 2 + B * T * H * (L + R + L) * 2
    flops = 2 * B * T * H * ctx * (L + R + L)
    return bytes_ / bw * 1e6, flops / rate * 1e6


def sweep(g, sms) -> dict:
    configs = [(8, 32, 2, 1), (8, 32, 3, 1), (8, 64, 1, 1), (8, 64, 2, 1), (16, 32, 2, 1), (8, 32, 3, 2)]
    points = [(64, 1, 1), (64, 1, 5), (64, 4, 1), (128, 1, 1), (128, 4, 3)]
    out = {}
    for w, bn, st, waves in configs:
        la.LATENT_WARPS, la.LATENT_BLOCK_N, la.LATENT_STAGES, la.LATENT_WAVES = w, bn, st, waves
        key = f"{w}/{bn}/{st}/{waves}"
        try:
            out[key] = [time_case(la.latent_attention_triton, B, T, H, 131072, g) for H, B, T in points]
            out[key].append(time_case(la.latent_attention_triton, 1, 1, 64, 4096, g))
        except Exception as e:  # noqa: BLE001 (a launch shape past the shared memory)
            out[key] = str(e)[:200]
        print("sweep", key, out[key], resources()[-1:], flush=True)
    ok = {k: v for k, v in out.items() if isinstance(v, list)}
    best = min(ok, key=lambda k: sum(ok[k]))
    la.LATENT_WARPS, la.LATENT_BLOCK_N, la.LATENT_STAGES, la.LATENT_WAVES = map(int, best.split("/"))
    return {"points_H_B_T_at_131072_then_4k_b1": points, "us": out, "best": best}


def resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled partial kernel (Triton's JIT cache)."""
    out = []
    for cache in la._latent_partial_kernel.device_caches.values():
        for k in cache[0].values():
            out.append(
                {
                    "regs": k.n_regs,
                    "spills": k.n_spills,
                    "shared": k.metadata.shared,
                    "warps": k.metadata.num_warps,
                    "stages": k.metadata.num_stages,
                }
            )
    return out


def main() -> None:
    global BS
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072, 262144])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--block-size", type=int, default=BS, help="tokens per cache block")
    ap.add_argument("--old", default=None, help="module of the kernel before, timed beside")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    BS = args.block_size
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw, rate = copy_bandwidth(), matmul_rate()
    res = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "matmul_flops": rate, "checks": checks(g)}
    if args.sweep:
        res["sweep"] = sweep(g, sms)
    res["config"] = {
        "block_size": BS,
        "warps": la.LATENT_WARPS,
        "block_n": la.LATENT_BLOCK_N,
        "stages": la.LATENT_STAGES,
        "waves": la.LATENT_WAVES,
        "min_chunk": la.LATENT_MIN_CHUNK,
        "rows": la.LATENT_ROWS,
    }
    old = importlib.import_module(args.old).latent_attention_triton if args.old else None
    rows = []
    for shape, H in SHAPES.items():
        for ctx in args.contexts:
            for B in args.batches:
                for T in range(1, args.k_max + 2):
                    us = time_case(la.latent_attention_triton, B, T, H, ctx, g)
                    tb, tf = floors(B, T, H, ctx, bw, rate)
                    row = {
                        "shape": shape,
                        "H": H,
                        "context": ctx,
                        "B": B,
                        "T": T,
                        "us": us,
                        "bytes_us": tb,
                        "flops_us": tf,
                        "of_roofline": max(tb, tf) / us,
                        "splits": la.latent_splits(math.ceil((ctx + 64) / BS) * BS, B, T, H, sms),
                    }
                    if old is not None and T in (1, args.k_max + 1):
                        row["old_us"] = time_case(old, B, T, H, ctx, g)
                    rows.append(row)
                    print(row, flush=True)
    res["rows"] = rows
    try:
        res["resources"] = resources()
        print("partial kernels:", res["resources"])
    except Exception as e:  # noqa: BLE001 (Triton's cache layout differs between versions)
        print("no resource report:", e)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"mla_attention_bs{BS}.json").write_text(json.dumps(res, indent=1))
    print(
        f"\ncopy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s, checks "
        f"{'all ok' if all(c['ok'] for c in res['checks']) else 'FAILED'}; config {res['config']}"
    )
    print(f"{'shape':12} {'ctx':>7} B {'decode us':>9} {'%roof':>5} {'old us':>7} | verify(K+1)/decode K=1..4 (floor)")
    for shape in SHAPES:
        for ctx in args.contexts:
            for B in args.batches:
                sel = {r["T"]: r for r in rows if r["shape"] == shape and r["context"] == ctx and r["B"] == B}
                d = sel[1]
                floor = {t: max(sel[t]["bytes_us"], sel[t]["flops_us"]) for t in sel}
                ratios = " ".join(
                    f"{sel[t]['us'] / d['us']:.2f}({floor[t] / floor[1]:.2f})" for t in range(2, args.k_max + 2)
                )
                old_s = f"{d['old_us']:7.1f}" if "old_us" in d else "      -"
                print(f"{shape:12} {ctx:7d} {B} {d['us']:9.1f} {100 * d['of_roofline']:4.0f}% {old_s} | {ratios}")


if __name__ == "__main__":
    main()
