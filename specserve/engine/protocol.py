"""What the server, bench and `LLM` callers use of an engine: `Engine` in one process and
`TPEngineView` over tensor-parallel workers both provide it, down to the policy and runner
facts they expose. `missing_members` checks an object against these protocols (tests run it
on both engines), so a member the server reads cannot exist on one engine only."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.engine.sampling import SamplingParams
from specserve.engine.sequence import Sequence, SpecStats


@runtime_checkable
class SpeculationPolicy(Protocol):
    k_max: int  # the largest K the engine drafts
    choices: dict[int, int]  # how often each K was chosen

    def acceptance(self, tree: bool = False) -> list[float]: ...

    def snapshot(self) -> dict: ...  # per batch bucket, context bucket and K: start-up and live costs (bench details)


@runtime_checkable
class RunnerFacts(Protocol):
    model_cfg: ModelConfig
    dtype: torch.dtype
    rows: int  # KV rows (sequences decoded at once)
    load_seconds: float
    drafter: Any  # None without a drafter


@runtime_checkable
class ServingEngine(Protocol):
    cfg: EngineConfig
    device: torch.device
    max_model_len: int
    graph_seconds: float  # CUDA graph capture time at start-up (0 without graphs)
    runner: RunnerFacts
    policy: SpeculationPolicy | None  # None without a drafter
    totals: SpecStats  # speculation statistics over every sequence so far
    tokens_generated: int
    last_k: int  # draft tokens of the last decode step (0: plain)
    n_running: int
    free_rows: int
    waiting: Collection[Sequence]  # added and not yet holding a KV row
    profile: list[dict]  # per speculative cycle timings, while profiling is on

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> Sequence: ...

    def step(self) -> list[Sequence]: ...

    def abort(self, seq_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def kv_usage(self) -> dict: ...

    def check_idle_integrity(self) -> None: ...


@runtime_checkable
class ServingLLM(Protocol):
    """`LLM` in one process and `TPLLM` over workers: what serve, generate and bench use."""

    config: EngineConfig
    tokenizer: Any
    engine: ServingEngine

    def generate(self, prompts, sampling_params=None, progress: bool = False) -> list: ...

    def encode_prompts(self, prompts) -> list[list[int]]: ...

    def profile_summary(self) -> dict: ...


def protocol_members(proto: type) -> dict[str, Any]:
    """Name -> type hint (None for methods) of every public member `proto` declares."""
    hints = typing.get_type_hints(proto)
    methods = {n: None for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return {**{n: h for n, h in hints.items() if not n.startswith("_")}, **methods}


def _protocols_in(hint) -> list[type]:
    args = typing.get_args(hint) or (hint,)
    return [a for a in args if isinstance(a, type) and getattr(a, "_is_protocol", False)]


_ABSENT = object()


def missing_members(obj, proto: type, path: str = "") -> list[str]:
    """Dotted names of the members of `proto` that `obj` lacks, following members whose type is
    itself one of these protocols (`engine.policy.k_max`). Properties are found without being
    run, except those that lead to a nested protocol."""
    missing = []
    for name, hint in protocol_members(proto).items():
        where = f"{path}{name}"
        found = inspect.getattr_static(obj, name, _ABSENT)
        if found is _ABSENT or found is vars(proto).get(name, _ABSENT):
            missing.append(where)  # absent, or only the protocol's own stub (an explicit subclass inherits it)
            continue
        nested = _protocols_in(hint) if hint is not None else []
        if nested:
            value = getattr(obj, name)
            if value is not None:
                missing += missing_members(value, nested[0], where + ".")
    return missing
