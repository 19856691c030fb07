"""Timestamps for the per-cycle profile (draft, verify, accept spans)."""

from __future__ import annotations

import time

import torch


class Mark:
    """A timestamp: a CUDA event on GPU, a host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ev = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.cuda:
            self.ev.record()
        else:
            self.t = time.perf_counter()

    @staticmethod
    def spans(marks: list["Mark"], between: dict[str, tuple[int, int]]) -> dict:
        """Milliseconds {name: from mark i to mark j} for between = {name: (i, j)}."""
        if marks[0].cuda:
            marks[-1].ev.synchronize()
            return {n: marks[i].ev.elapsed_time(marks[j].ev) for n, (i, j) in between.items()}
        return {n: (marks[j].t - marks[i].t) * 1000 for n, (i, j) in between.items()}
