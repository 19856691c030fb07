"""A request's state in the engine (`Sequence`), its lifecycle (`Status`) and
speculation statistics (`SpecStats`, per sequence and engine-wide)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from specserve.engine.logprobs import TokenLogprob
from specserve.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def record(self, K: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += K
        self.accepted += accepted
        while len(self.drafted_per_pos) < K:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(K):
            self.drafted_per_pos[i] += 1
            if i < accepted:
                self.accepted_per_pos[i] += 1

    @property
    def accept_length(self) -> float | None:
        """Mean tokens per speculative cycle: accepted drafts + the one target token."""
        return 1 + self.accepted / self.cycles if self.cycles else None

    @property
    def accept_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "accept_length_mean": self.accept_length,
            "accept_per_position": self.accept_per_position,
        }


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1
    prefilled: int = 0  # tokens of `prefill_len` already through the target (or found in the prefix cache)
    prefill_len: int = 0  # tokens a prefill computes: the prompt, or after a preemption all but the last token
    blocks: list[int] = field(default_factory=list)  # KV blocks, in order (see engine.scheduler)
    num_cached: int = 0  # tokens with target KV
    pending: int = 0  # drafter inputs waiting (see spec.proposer.PendingInputs)
    stale: int = 0  # the last of those, from plain steps that stored none (see spec.proposer.Proposer.catch_up)
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    new_tokens: list[int] = field(default_factory=list)  # produced by the last step
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asks (params.logprobs)
    matcher: Any = None  # the grammar state of a constrained request (constrain.grammar.Matcher)
    serial: int = field(default_factory=itertools.count().__next__)  # unique per engine process, never reused

    def __post_init__(self):
        self.prefill_len = self.prefill_len or len(self.prompt_ids)

    @property
    def resumed(self) -> bool:
        """Preempted and prefilled again: its prefill ends at a token it already has."""
        return self.prefill_len > len(self.prompt_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]
