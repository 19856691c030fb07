"""GPU fake server: holds GPU memory in two processes, then hangs silently.

The main process allocates --gib GiB on cuda:0 and starts a worker (multiprocessing,
spawn, like the schedulers of real servers) that allocates as much again and ignores
SIGTERM; both then block without output, like a server stuck in CUDA graph capture.
Needs torch with CUDA; used by the GPU-marked supervisor test only.
"""

import argparse
import multiprocessing as mp
import os
import signal
import time


def worker(gib: float, ready) -> None:
    import torch

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ready.set()
    while True:
        time.sleep(3600)
    del x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--pidfile")
    args = p.parse_args()
    print("importing torch", flush=True)
    import torch

    x = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print(f"allocated {args.gib:g} GiB; starting the worker", flush=True)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    w = ctx.Process(target=worker, args=(args.gib, ready), daemon=False)
    w.start()
    t0 = time.time()
    while not ready.wait(1.0):  # progress while the worker starts: slow is not hung
        print(f"waiting for the worker ({time.time() - t0:.0f} s)", flush=True)
        if time.time() - t0 > 120:
            raise SystemExit("worker did not start")
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(f"{os.getpid()}\n{w.pid}\n")
    print(f"main {os.getpid()} and worker {w.pid} hold {args.gib:g} GiB each on cuda:0", flush=True)
    print("capturing CUDA graphs for batch sizes [1, 2, 4, 8]", flush=True)
    while True:
        time.sleep(3600)
    del x


if __name__ == "__main__":
    main()
