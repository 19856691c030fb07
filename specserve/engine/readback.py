"""Reading small device tensors back to the host without waiting for work queued after them."""

from __future__ import annotations

import time

import torch


class DeviceWaits:
    """Seconds the host spent in `host_lists` reads waiting for the device. Beside the time a step takes
    on the host it tells a host-bound loop (little waiting: the device idles between steps) from a
    device-bound one (`specserve bench` reports both per config)."""

    def __init__(self) -> None:
        self.seconds = 0.0


def host_lists(device: torch.device, *tensors: torch.Tensor, waits: DeviceWaits | None = None):
    """Queue copies of small device tensors into pinned host memory now; the returned function
    waits for those copies alone (not for work queued after them) and gives the values as lists."""
    if device.type != "cuda":
        return lambda: [t.tolist() for t in tensors]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(hosts, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read():
        t0 = time.perf_counter()
        done.synchronize()
        if waits is not None:
            waits.seconds += time.perf_counter() - t0
        return [h.tolist() for h in hosts]

    return read
