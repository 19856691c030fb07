"""Skinny matmul on one GPU: cuBLAS against specserve's Triton GEMV and (one row) its CUDA GEMV, timed
inside CUDA graphs.

    python benchmarks/gemv_sweep.py [--shapes llama8b|kimi] [--rows 1 4 16 32 64] [--out DIR]

Decode multiplies 1-16 token rows by each weight, a verify forward up to 64 (a
31-node tree: 32); the step is bound by how fast those weights stream from HBM. Each timing is a CUDA graph of 8 products over 8
distinct copies of the weight (so nothing is served from the 60 MB L2), replayed
20 times; GB/s = weight bytes / time. The kernel is specserve's GEMV
(specserve/kernels/gemv.py); this sweep chose the configs the engine tunes among. Shapes: Llama-3.1-8B's
qkv, o, gate_up, down and lm_head, or Kimi-K2.5's latent projection, q_b, o, shared expert and lm_head.
Writes gemv_sweep.json and prints the best config per shape against cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.kernels.gemv import gemv, gemv_config_group, gemv_cuda_fits, graph_us  # noqa: E402

SHAPES = {
    "llama8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    "kimi": [(2112, 7168), (12288, 1536), (7168, 8192), (4096, 7168), (7168, 2048), (163840, 7168)],
}
# the CUDA GEMV's launch shapes for one row: ("cuda", warps a block, weight rows a warp, warps a row, loads)
CUDA_CONFIGS = [
    ("cuda", w, r, s, u) for w, r, s, u in itertools.product((4, 8), (1, 2), (1, 2, 4), (2, 4, 8)) if w % s == 0
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--shapes", choices=list(SHAPES), default="llama8b")
    args = ap.parse_args()
    shapes = SHAPES[args.shapes]
    configs = {
        1: list(itertools.product((8, 16, 32), (256, 512), (4, 8), (4,))),
        2: list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))),
        16: list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4))),
    }
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "shapes": {}}
    for (N, K), M in itertools.product(shapes, args.rows):
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8 if N * K < 1e8 else 3)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        gb = N * K * 2 / 1e3  # bytes / 1e3 -> GB/s when divided by us
        ref = F.linear(x, ws[0]).float()
        entry = {"cublas_GBs": gb / graph_us([lambda w=w: F.linear(x, w) for w in ws], reps=20), "triton": []}
        cuda = CUDA_CONFIGS if gemv_cuda_fits(x, ws[0]) else []
        for cfg in configs[gemv_config_group(M)] + cuda:
            try:
                err = ((gemv(x, ws[0], cfg).float() - ref).norm() / ref.norm()).item()
                us = graph_us([lambda w=w: gemv(x, w, cfg) for w in ws], reps=20)
                entry["triton"].append({"cfg": cfg, "GBs": gb / us, "rel_err": err})
            except Exception as e:  # a config may not compile or fit: note it
                entry["triton"].append({"cfg": cfg, "error": repr(e)[:200]})
        ok = [t for t in entry["triton"] if "GBs" in t and t["rel_err"] < 1e-2]
        entry["best"] = max(ok, key=lambda t: t["GBs"]) if ok else None
        res["shapes"][f"{N}x{K} M={M}"] = entry
        best = entry["best"]
        print(
            f"{N}x{K} M={M}: cublas {entry['cublas_GBs']:.0f} GB/s, triton best "
            f"{best['GBs']:.0f} GB/s {best['cfg']} err {best['rel_err']:.1e}"
            if best
            else "no valid config",
            flush=True,
        )
        for kind in ("cuda", "triton"):  # the best of each kernel, beside the best of all
            own = [t for t in ok if (t["cfg"][0] == "cuda") == (kind == "cuda")]
            if own:
                b = max(own, key=lambda t: t["GBs"])
                print(f"    best {kind}: {b['GBs']:.0f} GB/s {b['cfg']}", flush=True)
        del ws
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv_sweep.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
