"""The gated MLP of every supported family (and of MoE experts' shared path): SwiGLU over float or
int4 projections, whichever the checkpoint stores."""

from __future__ import annotations

import torch

from specserve.kernels.norm import silu_mul
from specserve.model.int4_linear import column_linear, linear_tensors, row_linear
from specserve.model.layers import HotPathModule


class SwiGLU(HotPathModule):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, quant=None, prefix: str = ""):
        """`quant` (a model.quant.QuantConfig) and `prefix` (the Hugging Face module name, `...mlp.`)
        make int4 those projections the checkpoint stores as int4."""
        super().__init__()
        self.gate_up_proj = column_linear(
            quant, [prefix + "gate_proj", prefix + "up_proj"], hidden, [intermediate, intermediate], bias=bias
        )
        self.down_proj = row_linear(quant, prefix + "down_proj", intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def hf_weights(self, prefix: str) -> dict[str, tuple[torch.Tensor, int]]:
        """Hugging Face tensor names under `prefix` (".../mlp.") -> (our tensor, shard)."""
        return {
            **linear_tensors(self.gate_up_proj, [prefix + "gate_proj", prefix + "up_proj"]),
            **linear_tensors(self.down_proj, [prefix + "down_proj"]),
        }
