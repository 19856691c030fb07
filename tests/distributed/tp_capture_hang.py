"""A TP worker whose CUDA-graph phase stalls on the last rank, the way a rank stuck in a captured
NCCL call does (CPU has no graphs to capture): test_tp starts it in place of
``python -m specserve.distributed.worker``. The other ranks leave the phase without graphs."""

import os
import sys
import time

from specserve.distributed import worker


def stalled_probe(ch, cfg, device, hidden_size, dtype, rank, size) -> bool:
    if not cfg.cuda_graphs:  # the restart without graphs runs normally
        return False
    ch.progress("graphs", "pretending to capture")
    if rank == size - 1:
        time.sleep(3600)
    return False


if __name__ == "__main__":
    worker.probe_graph_capture = stalled_probe
    code = worker.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
