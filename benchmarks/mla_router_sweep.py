"""Launch shapes of two small decode kernels of an MLA + MoE layer at Kimi-K2.5 width, against the
torch paths they replace, on one GPU:

    python benchmarks/mla_router_sweep.py [--tokens 1 2 4 8 16 32] [--out FILE.json]

- `router_logits_triton`: a float32 router (384 x 7168) times 1-8 bf16 tokens, against the cast
  and cuBLAS's float32 product;
- `head_product_triton`: MLA's absorbed query (q_nope . W_UK, W_h [128, 512], 64 heads) against
  torch.einsum; the values' product (out . W_UV^T), which einsum serves, is timed beside it.

Each time is a CUDA-graph replay over distinct copies of the weights (more than the L2 holds, as a
decode step reads them), per call. Printed last: each kernel's best launch shape over the counts
timed, and the counts at which it beats the torch path (what ROUTER_CONFIG / ROUTER_ROWS and
HEAD_PRODUCT_CONFIG / HEAD_PRODUCT_MAX_TOKENS rest on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.kernels import latent_attention as la  # noqa: E402
from specserve.kernels import moe_routing as mr  # noqa: E402
from specserve.kernels.gemv import graph_us  # noqa: E402
from specserve.kernels.linear import linear  # noqa: E402

E, HIDDEN, HEADS, NOPE, V, LATENT = 384, 7168, 64, 128, 128, 512
ROUTER_CONFIGS = [
    (2, 256, 4, 1),
    (2, 256, 4, 3),
    (4, 256, 4, 3),
    (2, 512, 4, 3),
    (1, 1024, 4, 3),
    (4, 512, 8, 3),
    (8, 256, 8, 3),
    (1, 2048, 8, 2),
    (4, 128, 4, 4),
]
HEAD_CONFIGS = [
    (64, 64, 4, 1),
    (64, 128, 4, 1),
    (32, 128, 4, 1),
    (128, 128, 8, 1),
    (64, 64, 4, 2),
    (32, 64, 4, 2),
    (128, 32, 4, 3),
]
L2_BYTES = 60 << 20  # more than the H200's L2 (50 MB): copies until the weights read exceed it


def copies(make, nbytes: int) -> list[torch.Tensor]:
    return [make() for _ in range(max(2, -(-2 * L2_BYTES // nbytes)))]


def timed(fn, ws) -> float:
    return graph_us([lambda w=w: fn(w) for w in ws])


def best_row(rows: dict, tokens: list[int]) -> dict:
    """The config with the least total time over the counts, and the counts at which it beats torch."""
    configs = [c for c in rows[tokens[0]] if c != "torch"]
    best = min(configs, key=lambda c: sum(rows[m][c] for m in tokens))
    return {"config": best, "beats_torch_at": [m for m in tokens if rows[m][best] < rows[m]["torch"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"gpu": torch.cuda.get_device_name(), "router": {}, "head_product": {}, "values_einsum": {}}

    routers = copies(lambda: torch.randn(E, HIDDEN, device=dev, generator=g) * 0.02, E * HIDDEN * 4)
    for m in [t for t in args.tokens if t <= 8]:
        x = torch.randn(m, HIDDEN, device=dev, generator=g).to(torch.bfloat16)
        ref = linear(x.float(), routers[0])
        row = {"torch": timed(lambda w: linear(x.to(torch.float32), w), routers)}
        for cfg in ROUTER_CONFIGS:
            err = (mr.router_logits_triton(x, routers[0], cfg) - ref).abs().max().item()
            assert err < 1e-3, f"router {cfg}: max error {err}"
            row[str(cfg)] = timed(lambda w, c=cfg: mr.router_logits_triton(x, w, c), routers)
        result["router"][m] = row
        print(f"router {m} tokens: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)

    kv_bs = copies(
        lambda: (torch.randn(HEADS, NOPE + V, LATENT, device=dev, generator=g) * 0.05).to(torch.bfloat16),
        HEADS * (NOPE + V) * LATENT * 2,
    )
    for m in args.tokens:
        q = torch.randn(1, m, HEADS, NOPE + 64, device=dev, generator=g).to(torch.bfloat16)
        a = q[..., :NOPE]  # strided as the model's q_nope is
        ref = torch.einsum("bthk,hkn->bthn", a.float(), kv_bs[0][:, :NOPE].float())
        row = {"torch": timed(lambda w: torch.einsum("bthk,hkn->bthn", a, w[:, :NOPE]), kv_bs)}
        for cfg in HEAD_CONFIGS:
            got = la.head_product_triton(a, kv_bs[0][:, :NOPE], cfg).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"head product {cfg}: relative error {err}"
            row[str(cfg)] = timed(lambda w, c=cfg: la.head_product_triton(a, w[:, :NOPE], c), kv_bs)
        out = torch.randn(1, m, HEADS, LATENT, device=dev, generator=g).to(torch.bfloat16)
        values = timed(lambda w: torch.einsum("bthk,hnk->bthn", out, w[:, NOPE:]), kv_bs)
        result["head_product"][m], result["values_einsum"][m] = row, values
        print(
            f"head product {m} tokens: "
            + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
            + f"; values (einsum) {values:.1f}",
            flush=True,
        )

    chosen = {
        "router": best_row(result["router"], [t for t in args.tokens if t <= 8]),
        "head_product": best_row(result["head_product"], args.tokens),
    }
    result["chosen"] = chosen
    print("best launch shapes, and the token counts where they beat torch:", json.dumps(chosen))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
