"""GPU time of the engine's graph-replayed steps for one specserve tree: decode, a chain verify of
K+1 tokens and a K-step draft, at several batch sizes, on a random Llama-3.1-8B-shaped target
with a random EAGLE-3 drafter (written once under --work, shared by every tree).

    python benchmarks/step_ab.py --tree DIR [--out FILE.json]

A pure-GPU A/B of two trees (run once per tree, alternating, e.g. A B A B): graph replays timed
with CUDA events do not see the host's jitter that spreads end-to-end tok/s at batch 16 and 64,
so differences of a fraction of a percent show. Every row holds a whole sequence's KV
(`reserve_every_row` on a paged tree) and reads `--context` tokens of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True, help="folder holding the specserve package to time")
    ap.add_argument("--work", default="/tmp/specserve-models")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batch-invariant", action="store_true", help="time the tree's --batch-invariant GEMV shape")
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    import torch

    import specserve
    from specserve.config import EngineConfig
    from specserve.engine.runner import ModelRunner
    from specserve.engine.sampling import BatchSampling, SamplingParams

    from benchmarks.gpu_engine import gpu_ms  # (imports the tree's specserve, already on the path)
    from benchmarks.random_models import write_eagle3_drafter, write_llama

    work = Path(args.work)
    target, draft = work / "llama8b", work / "llama8b-eagle3"
    if not (draft / "config.json").exists():
        write_llama(target)
        write_eagle3_drafter(draft)
    t0 = time.perf_counter()
    cfg = EngineConfig(
        model=str(target),
        draft=str(draft),
        spec_steps=args.k,
        max_num_seqs=max(args.batches),
        max_model_len=args.context + 64,
        device="cuda",
        graph_batch_sizes=tuple(args.batches),
        **({"batch_invariant": True} if args.batch_invariant else {}),
    )
    runner = ModelRunner(cfg)
    if hasattr(runner, "reserve_every_row"):
        runner.reserve_every_row()
    runner.capture_graphs([args.k])
    res = {
        "tree": specserve.__file__,
        "load_s": time.perf_counter() - t0,
        "gpu": torch.cuda.get_device_name(),
        "context": args.context,
        "K": args.k,
        "batch_invariant": args.batch_invariant,
        "decode_ms": {},
        "verify_ms": {},
        "draft_ms": {},
    }

    K = args.k
    with torch.inference_mode():
        for B in args.batches:
            ids = torch.randint(0, 128000, (B,), device="cuda")
            pos = torch.full((B,), args.context, device="cuda")
            res["decode_ms"][B] = gpu_ms(lambda: runner.decode(ids, pos), args.reps)
            vids = torch.randint(0, 128000, (B, K + 1), device="cuda")
            res["verify_ms"][B] = gpu_ms(lambda: runner.verify(vids, pos), args.reps)
            s = BatchSampling.build([SamplingParams(temperature=0)] * B, [0] * B, torch.device("cuda"))
            entry = torch.full((B, K + 1), runner.scratch, device="cuda")
            entry[:, 0] = args.context - 1
            last = torch.zeros(B, dtype=torch.long, device="cuda")
            res["draft_ms"][B] = gpu_ms(lambda: runner.draft(K, entry, last, s), args.reps)
            print(
                f"batch {B}: decode {res['decode_ms'][B]:.4f} ms, verify {res['verify_ms'][B]:.4f} ms, "
                f"draft {res['draft_ms'][B]:.4f} ms",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
