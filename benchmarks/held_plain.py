"""Adaptive speculation held at plain decoding (the policy always answers K=0) against plain decoding
(K fixed 0) on one engine with the bundled demo pair: tok/s of each over runs in the order ABBA (their
geometric means and ratio), and the share of the held runs' wall time spent in drafter upkeep inside
decode steps (drafter forwards, input stores). Runs against whichever tree PYTHONPATH points at.

    PYTHONPATH=. python benchmarks/held_plain.py --batch 4 [--device cpu] [--tokens 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch

from specserve.config import DEMO_DIR, EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="ABBA rounds")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    demo = Path(DEMO_DIR)
    eng = Engine(EngineConfig(model=str(demo), draft=str(demo / "draft"), adaptive=True, max_spec_steps=4,
                              device=a.device, max_num_seqs=a.batch, prefix_cache=False))
    g = random.Random(0)
    prompts = [[g.randrange(100, 3000) for _ in range(48)] for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    upkeep = {"seconds": 0.0, "forwards": 0}
    in_decode = [False]

    def timed(obj, name, forward):
        f = getattr(obj, name)

        def wrapper(*args):
            t = time.perf_counter()
            out = f(*args)
            if in_decode[0]:  # (prefill's drafter forward is needed to speculate at all)
                upkeep["seconds"] += time.perf_counter() - t
                upkeep["forwards"] += forward
            return out
        setattr(obj, name, wrapper)
    timed(eng.runner, "drafter_extend", 1)
    timed(eng.proposer.pending, "set_at", 0)
    decode = eng._decode

    def decode_marked():
        in_decode[0] = True
        try:
            return decode()
        finally:
            in_decode[0] = False
    eng._decode = decode_marked
    eng.policy.choose = lambda B, remaining=None, stale=False: 0  # (K fixed 0 never asks the policy)

    def run(mode: str) -> float:
        eng.set_spec_steps(0 if mode == "plain" else None)
        for p in prompts:
            eng.add_request(p, params)
        eng.runner.sync()
        t, n = time.perf_counter(), 0
        while eng.has_work():
            n += sum(len(s.new_tokens) for s in eng.step())
        eng.runner.sync()
        return n / (time.perf_counter() - t)

    run("plain"), run("held")  # warm-up
    upkeep.update(seconds=0.0, forwards=0)
    rates: dict[str, list[float]] = {"plain": [], "held": []}
    held_wall = 0.0
    for mode in ["plain", "held", "held", "plain"] * a.rounds:
        rate = run(mode)
        rates[mode].append(rate)
        if mode == "held":
            held_wall += a.batch * a.tokens / rate
    gm = {m: math.exp(statistics.mean(math.log(r) for r in v)) for m, v in rates.items()}
    print(f"batch {a.batch}: plain {gm['plain']:.1f} tok/s, held at K=0 {gm['held']:.1f} tok/s, "
          f"held/plain {gm['held'] / gm['plain']:.3f}; upkeep in held decode steps: {upkeep['forwards']} drafter "
          f"forwards, {upkeep['seconds'] / held_wall * 100:.1f}% of their wall time")


if __name__ == "__main__":
    main()
