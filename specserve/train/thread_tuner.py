"""The CPU thread count that trains fastest under the machine's current load."""

from __future__ import annotations

import time


class ThreadTuner:
    """Picks the intra-op thread count that is fastest *now* (single-process training only).

    On an idle 2-core machine 2 threads beat 1 by ~1.5x, but when other processes compete for the
    cores, 2 OpenMP threads keep waiting for each other at every barrier and a step can become 5-10x
    slower than with 1 thread. So every
    ``every_s`` seconds the tuner runs ``trial`` real training steps with another thread count and
    keeps whichever count had the lower median step time. A trial is cut short as soon as one of
    its steps is clearly slower, and the pause between trials doubles (up to ``max_every_s``) after
    each trial that did not pay off, so exploring costs little when the answer is stable.
    """

    def __init__(self, choices: list[int], every_s: float = 90.0, trial: int = 4, max_every_s: float = 720.0):
        import torch

        self.torch = torch
        self.choices = sorted(set(choices))
        self.current = max(self.choices)
        self.every_s, self.trial = every_s, trial
        self.base_every_s, self.max_every_s = every_s, max_every_s
        self.recent: list[float] = []
        self.trial_times: list[float] = []
        self.trying: int | None = None
        self.last_explore = time.perf_counter()
        self.switches: list[tuple[float, int]] = []
        torch.set_num_threads(self.current)

    @property
    def active(self) -> int:
        return self.trying if self.trying is not None else self.current

    def record(self, step_seconds: float) -> str | None:
        """Call after each step with its duration; returns a message when the choice changed."""
        msg = None
        if self.trying is None:
            self.recent = (self.recent + [step_seconds])[-self.trial :]
            if (
                len(self.choices) > 1
                and len(self.recent) >= self.trial
                and time.perf_counter() - self.last_explore >= self.every_s
            ):
                others = [c for c in self.choices if c != self.current]
                self.trying = others[len(self.switches) % len(others)] if len(others) > 1 else others[0]
                self.trial_times = []
                self.torch.set_num_threads(self.trying)
            return None
        self.trial_times.append(step_seconds)
        cur = sorted(self.recent)[len(self.recent) // 2]
        # the first step after a switch is discarded; a clearly slower step ends the trial early
        losing = len(self.trial_times) >= 2 and step_seconds > 1.5 * cur
        if losing or len(self.trial_times) >= self.trial + 1:
            alt = sorted(self.trial_times[1:])[len(self.trial_times[1:]) // 2]
            if not losing and alt < 0.9 * cur:
                msg = f"threads {self.current} -> {self.trying} (median step {cur:.2f}s -> {alt:.2f}s)"
                self.current = self.trying
                self.recent = self.trial_times[1:]
                self.switches.append((time.perf_counter(), self.current))
                self.every_s = self.base_every_s
            else:
                self.every_s = min(2 * self.every_s, self.max_every_s)
            self.trying = None
            self.last_explore = time.perf_counter()
            self.torch.set_num_threads(self.current)
        return msg
