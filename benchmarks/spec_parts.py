"""Time the parts of one speculative cycle, chain against tree, on any target/drafter pair.

    python benchmarks/spec_parts.py --model DIR --draft DIR [--batch-sizes 1 4 16] \
        [--trees 4:1:- 6:1:- 4:4:16 6:4:24 6:8:48] [--out parts.json]

Each tree setting is K:topk:nodes ("-" = the default node count; topk 1 = a chain). For every
setting and batch size, one engine with CUDA graphs (one per setting) replays each part back to
back at a context of 256 tokens and reports the median time (CUDA events, host launch gaps
included) of: the decode step, the draft, the verify forward and the acceptance (greedy rule;
for trees it runs inside the verify graph, with the KV move). Costs only: the drafts are
whatever the weights give. With --kernels N, each part's graph replay is also profiled: its N
costliest kernels (GPU us per replay, count) and the sum of all kernel time, so the gap to the
replay's wall time is what launch gaps and idle cost. With --sequence, each part's kernels of one
replay in launch order (name, GPU us) go into the JSON: where a part's kernel count comes from.
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_engine import gpu_ms  # (this folder)

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import BatchSampling, SamplingParams
from specserve.spec.verify import accept_drafts


def _profiled(fn, reps: int):
    """The CUDA profile of `reps` calls of fn (after one unprofiled call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def top_kernels(fn, n: int, reps: int = 10) -> dict:
    """GPU time per call of fn's kernels (CUDA graph replays included): the n costliest, and the sum."""
    prof = _profiled(fn, reps)
    kernels = [
        (ev.self_device_time_total / reps, ev.count / reps, ev.key)
        for ev in prof.key_averages()
        if ev.device_type.name == "CUDA" and ev.self_device_time_total > 0
    ]
    kernels.sort(reverse=True)
    return {
        "kernel_us": round(sum(k[0] for k in kernels), 1),
        "kernels_per_call": round(sum(k[1] for k in kernels), 1),
        "top": [{"us": round(us, 1), "count": round(c, 1), "name": name[:90]} for us, c, name in kernels[:n]],
    }


def kernel_sequence(fn) -> list[tuple[str, float]]:
    """The kernels of one call of fn in the order they ran: (name, GPU us)."""
    evs = sorted(
        (e for e in _profiled(fn, 1).events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    return [(e.name[:80], round(e.time_range.elapsed_us(), 1)) for e in evs]


def parts(
    model: str,
    draft: str,
    K: int,
    topk: int,
    nodes: int | None,
    batch_sizes: list[int],
    ctx: int,
    kernels: int = 0,
    sequence: bool = False,
) -> list[dict]:
    eng = Engine(
        EngineConfig(
            model=model,
            draft=draft,
            spec_steps=K,
            spec_topk=topk,
            spec_tokens=nodes,
            max_num_seqs=max(batch_sizes),
            graph_batch_sizes=tuple(batch_sizes),
            max_model_len=ctx + 128,
        )
    )
    r, out = eng.runner, []
    for B in batch_sizes:
        dev = r.device
        ids = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.full((B,), ctx, dtype=torch.long, device=dev)
        entry = torch.full((B, K + 1), r.scratch, dtype=torch.long, device=dev)
        entry[:, 0] = ctx - 1
        last = torch.zeros(B, dtype=torch.long, device=dev)
        greedy = BatchSampling.build([SamplingParams(temperature=0)] * B, [0] * B, dev)
        on = torch.ones(B, dtype=torch.bool, device=dev)
        fns = {"decode": lambda: r.decode(ids, pos)}
        if topk > 1:  # the verify graph includes acceptance, the KV move and the drafter inputs
            r.draft_tree(K, entry, last)
            fns.update(draft=lambda: r.draft_tree(K, entry, last), verify=lambda: r.verify_tree(K, ids, pos, on))
        else:
            d = r.draft(K, entry, last, greedy)
            v_ids = torch.cat([ids.unsqueeze(1), d.tokens], 1)
            logits, _ = r.verify(v_ids, pos)
            fns.update(draft=lambda: r.draft(K, entry, last, greedy), verify=lambda: r.verify(v_ids, pos))
        row = {
            "K": K,
            "topk": topk,
            "nodes": eng.cfg.tree_nodes(K),
            "batch": B,
            "linear_tuning": r.linear_tuning,
            **{f"{name}_ms": gpu_ms(fn) for name, fn in fns.items()},
            "accept_ms": gpu_ms(lambda: accept_drafts(logits, d, greedy, pos, on)) if topk == 1 else 0.0,
        }
        if kernels:
            row["kernels"] = {name: top_kernels(fn, kernels) for name, fn in fns.items()}
        if sequence:
            row["sequence"] = {name: kernel_sequence(fn) for name, fn in fns.items()}
        row["cycle_ms"] = row["draft_ms"] + row["verify_ms"] + row["accept_ms"]
        row["cycle_over_decode"] = row["cycle_ms"] / row["decode_ms"]
        out.append(row)
    del eng
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--trees", nargs="+", default=["4:1:-", "6:1:-", "4:4:16", "6:4:24", "6:8:48"])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--kernels", type=int, default=0, metavar="N", help="profile each part: its N costliest kernels")
    p.add_argument("--sequence", action="store_true", help="each part's kernels of one replay, in order (JSON)")
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for spec in args.trees:
        K, topk, nodes = spec.split(":")
        rows += parts(
            args.model,
            args.draft,
            int(K),
            int(topk),
            None if nodes == "-" else int(nodes),
            args.batch_sizes,
            args.context,
            args.kernels,
            args.sequence,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": args.context, "parts": rows}, f, indent=1)
    print("| K | topk | nodes | batch | decode ms | draft ms | verify ms | accept ms | cycle / decode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['K']} | {x['topk']} | {x['nodes']} | {x['batch']} | {x['decode_ms']:.2f} | {x['draft_ms']:.2f} | "
            f"{x['verify_ms']:.2f} | {x['accept_ms']:.3f} | {x['cycle_over_decode']:.2f} |"
        )
    for x in rows:
        for part, k in x.get("kernels", {}).items():
            print(
                f"\n{part} K={x['K']} topk={x['topk']} B={x['batch']}: {k['kernel_us']} us in "
                f"{k['kernels_per_call']} kernels"
            )
            for t in k["top"]:
                print(f"  {t['us']:8.1f} us  x{t['count']:<5} {t['name']}")


if __name__ == "__main__":
    main()
