"""CPU products of a decode step's weight shapes: MKL (column-major weight), oneDNN (packed once)
and the native panel GEMV, at a few row counts, with weights cycled like a real forward.

    PYTHONPATH=. python benchmarks/cpu_products.py --threads 1

Every method runs the same sequence of `--layers` layers' products (each layer its own weights,
so they come from memory as in a decode step, not from cache); the methods are interleaved
round by round, so a load change on a shared machine hits each alike. Prints GB/s per shape.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from specserve.kernels import cpu_native
from specserve.kernels.cpu_linear import MKL, NATIVE, ONEDNN, products, column_major_copy

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_native.ops()

    layers = [{k: column_major_copy(torch.randn(n, kk) * 0.02) for k, (n, kk) in SHAPES.items()}
              for _ in range(args.layers)]
    head = column_major_copy(torch.randn(49152, 576) * 0.02)
    packed = [{k: torch.ops.mkldnn._reorder_linear_weight(w, 8) for k, w in layer.items()} for layer in layers]
    panels = [{k: cpu_native.pack_panels(w) for k, w in layer.items()} for layer in layers]
    head_pk, head_pn = torch.ops.mkldnn._reorder_linear_weight(head, 8), cpu_native.pack_panels(head)
    copies = {MKL: layers, ONEDNN: packed, NATIVE: panels}
    heads = {MKL: head, ONEDNN: head_pk, NATIVE: head_pn}
    # each kernel as the engine's tuner times it (`cpu_linear._products`), one weight at a time here
    methods = {m: (lambda x, i, k, m=m: products(m, x, [copies[m][i][k] if k != "head" else heads[m]],
                                                  SHAPES[k][0] if k != "head" else head.shape[0]))
               for m in (MKL, ONEDNN, NATIVE) if m != NATIVE or ops is not None}
    out = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, kk) for k, (n, kk) in {**SHAPES, "head": (49152, 576)}.items()}
        spent = {m: {k: [] for k in xs} for m in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                acc = dict.fromkeys(xs, 0.0)
                for i in range(args.layers):
                    for k in SHAPES:
                        t0 = time.perf_counter()
                        fn(xs[k], i, k)
                        acc[k] += time.perf_counter() - t0
                t0 = time.perf_counter()
                fn(xs["head"], 0, "head")
                acc["head"] += time.perf_counter() - t0
                for k in xs:
                    spent[name][k].append(acc[k] / (1 if k == "head" else args.layers))
        res = {}
        for name in methods:
            res[name] = {}
            for k in xs:
                n, kk = SHAPES.get(k, (49152, 576))
                us = min(spent[name][k]) * 1e6
                res[name][k] = {"us": round(us, 1), "gb_s": round(n * kk * 4 / us / 1e3, 1)}
        out[rows] = res
        print(rows, json.dumps(res))


if __name__ == "__main__":
    main()
