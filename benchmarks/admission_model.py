"""A queueing model of serving with a fixed number of requests in flight: what letting arrivals in
together (`--admit-wait`) should do when a prefill chunk costs about the same however few prompts it
holds (a MoE target: it reads nearly every expert). A model from measured step costs, not a run.

    python benchmarks/admission_model.py [--prefill-ms 27] [--plain-ms 4.8] [--cycle-ms 10] [--waits 0 1 2 4 8]

Each finished request is replaced at once (the bench's --concurrency load). A step first admits the
waiting requests as `Engine._admission_deferred` would (the rows free for them, once they fill a prefill
chunk or rows have stood free `wait` steps), each chunk of up to --chunk prompt tokens costing
--prefill-ms, then decodes every running row: plain decoding one token a row in --plain-ms, or a K-step
chain in --cycle-ms accepting each draft with the measured per-position rates (the grown MoE pair's by
default, BENCHMARKS.md 9). Prints tokens a second per wait and speculation's ratio to plain decoding.
"""

from __future__ import annotations

import argparse
import random


def serve(speculate: bool, wait: int, a: argparse.Namespace, seed: int = 0) -> tuple[float, int]:
    """(output tokens a second, prefill chunks) for one load of a.requests requests."""
    rnd = random.Random(seed)
    per_chunk = max(1, a.chunk // a.prompt)
    running: list[int] = []  # tokens each running request still needs
    waiting = [a.output] * a.in_flight
    sent, ms, tokens, step, chunks, since = a.in_flight, 0.0, 0, 0, 0, None
    while waiting or running:
        step += 1
        free = a.in_flight - len(running)
        if waiting and free:
            fit = min(free, len(waiting))
            full = fit * a.prompt >= a.chunk
            if not running or full or not wait:
                admit = True
            else:
                since = step if since is None else since
                admit = step - since >= wait
            if admit:
                since = None
                n = -(-fit // per_chunk)
                chunks += n
                ms += n * a.prefill_ms
                for _ in range(fit):
                    running.append(waiting.pop() - 1)  # the prefill emits the first token
                    tokens += 1
        if not running:
            continue
        ms += a.cycle_ms if speculate else a.plain_ms
        left = []
        for need in running:
            got = 1
            if speculate:
                for rate in a.acceptance[: a.k]:
                    if rnd.random() >= rate:
                        break
                    got += 1
            got = min(got, need)
            tokens += got
            if need - got > 0:
                left.append(need - got)
            elif sent < a.requests:
                waiting.append(a.output)
                sent += 1
        running = left
    return tokens / ms * 1e3, chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--output", type=int, default=64, help="tokens a request")
    ap.add_argument("--prompt", type=int, default=47, help="prompt tokens a request")
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens a prefill chunk holds")
    ap.add_argument("--prefill-ms", type=float, default=27.0, help="a prefill chunk, however full")
    ap.add_argument("--plain-ms", type=float, default=4.8, help="a plain decode step of the full batch")
    ap.add_argument("--cycle-ms", type=float, default=10.0, help="a speculative cycle of the full batch")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.75, 0.6, 0.53, 0.5, 0.45],
        help="conditional acceptance by draft position",
    )
    ap.add_argument("--waits", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    a = ap.parse_args()
    print(f"{'wait':>5}{'plain tok/s':>13}{'chunks':>8}{'spec tok/s':>12}{'chunks':>8}{'spec/plain':>12}")
    for wait in a.waits:
        plain, pc = serve(False, wait, a)
        spec, sc = serve(True, wait, a)
        print(f"{wait:>5}{plain:>13.0f}{pc:>8}{spec:>12.0f}{sc:>8}{spec / plain:>11.2f}x")


if __name__ == "__main__":
    main()
