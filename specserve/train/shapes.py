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
    intermediate: int  # the dense MLP's (the drafter's, and the target's when it has no experts)
    experts: int = 0  # > 0: the target is a Mixtral model with this many routed experts per layer
    top_k: int = 0  # experts chosen per token
    expert_intermediate: int | None = None  # each expert's MLP width (default: intermediate)

    @property
    def target_intermediate(self) -> int:
        """Width of the grown target's MLP: each expert's, for an MoE target."""
        return (self.expert_intermediate or self.intermediate) if self.experts else self.intermediate


PRESETS = {
    # Meta-Llama-3-8B / 3.1-8B (vocabulary aside, see specserve.train.grow).
    "llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336),
    # Qwen3-30B-A3B's hidden size, layers, heads, experts and their width, as a Mixtral model (Llama attention:
    # Qwen3's q/k RMSNorm would change the demo's attention); its dense 6144 is the drafter's MLP.
    "qwen3-moe-30b-a3b": Shape(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        intermediate=6144,
        experts=128,
        top_k=8,
        expert_intermediate=768,
    ),
    # Mixtral-8x7B (47B parameters: ~94 GB in bf16).
    "mixtral-8x7b": Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, experts=8, top_k=2
    ),
    # A mid-size grow of the demo pair that a CPU can run (checks of the construction on the real demo).
    "demo-mid": Shape(hidden=512, layers=32, heads=16, kv_heads=4, head_dim=128, intermediate=1792),
}
OUT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
READ_MODES = ("one", "all")  # how a grown linear reads duplicated units (see grow --read)
