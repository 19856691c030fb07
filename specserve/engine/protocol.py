"""What the server, bench and `LLM` callers use of an engine: `Engine` in one process and
`TPEngineView` over tensor-parallel workers both provide it."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from specserve.config import EngineConfig
from specserve.engine.sampling import SamplingParams
from specserve.engine.sequence import Sequence, SpecStats


@runtime_checkable
class ServingEngine(Protocol):
    cfg: EngineConfig
    device: torch.device
    max_model_len: int
    graph_seconds: float  # CUDA graph capture time at start-up (0 without graphs)
    runner: Any  # read for model_cfg, dtype, rows, load_seconds and drafter (None without one)
    policy: Any  # the speculation policy (`choices`, `acceptance(tree)`), None without a drafter
    totals: SpecStats  # speculation statistics over every sequence so far
    tokens_generated: int
    last_k: int  # draft tokens of the last decode step (0: plain)
    n_running: int
    free_rows: int
    profile: list[dict]  # per speculative cycle timings, while profiling is on

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> Sequence: ...

    def step(self) -> list[Sequence]: ...

    def abort(self, seq_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def kv_usage(self) -> dict: ...

    def check_idle_integrity(self) -> None: ...
