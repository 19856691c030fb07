"""Shapes `specserve grow` can build: torch-free, so that `grow --help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


PRESETS = {
    # Meta-Llama-3-8B / 3.1-8B (vocabulary aside, see specserve.train.grow).
    "llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336),
    # A mid-size grow of the demo pair that a CPU can run (checks of the construction on the real demo).
    "demo-mid": Shape(hidden=512, layers=32, heads=16, kv_heads=4, head_dim=128, intermediate=1792),
}
OUT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
READ_MODES = ("one", "all")  # how a grown linear reads duplicated units (see grow --read)
