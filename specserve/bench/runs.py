"""What one benchmarked unit (an engine configuration or a peer) gives back for one batch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunOutput:
    """One unit running one batch once."""

    tokens: list[list[int]]
    wall: float
    ttft: list[float]
    tpot: list[float | None]
    spec: dict | None = None  # summed counters (engine) or {"cycles", "tokens"} (assisted peer)
    profile: list[dict] = field(default_factory=list)
    host: dict | None = None  # engine steps, host seconds inside them and of those waiting for the device
