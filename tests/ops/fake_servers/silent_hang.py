"""Fake server that hangs silently, like one stuck in CUDA graph capture.

Prints a few start-up lines, then sleeps without a word and never serves /health.
With `--works-with NAME` and `--NAME` on its command line (the supervisor's
fallback args, e.g. --works-with disable-cuda-graph), it instead says so and exits 0. `--pidfile F` appends its PID to F;
`--touch F` creates F (the fake NVML counts memory while it exists).
"""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pidfile")
p.add_argument("--touch")
p.add_argument("--port")
p.add_argument("--works-with")
args, rest = p.parse_known_args()

if args.pidfile:
    with open(args.pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
if args.touch:
    open(args.touch, "w").close()
if args.works_with and f"--{args.works_with}" in rest:
    print(f"fallback flag --{args.works_with} given: starting without CUDA graphs, then exiting cleanly")
    sys.exit(0)
print("loading weights: done")
print("capturing CUDA graphs for batch sizes [1, 2, 4, 8]")
sys.stdout.flush()
while True:
    time.sleep(3600)
