"""Linear layers with int4 weights kept as compressed-tensors stores them, and the choice
between those and float linears per Hugging Face module (`column_linear`, `row_linear`).

`Int4Linear` holds the packed words, scales and zero points of `kernels.int4` as buffers (not
parameters: nothing tunes or re-lays them out as float weights) and shards them under tensor
parallelism like its float counterparts. Its product is `kernels.int4.int4_matmul`: the W4A16
Triton kernel on CUDA for decode and verify rows, the dequantizing reference otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from specserve.kernels.int4 import PACK, int4_matmul, unpack_int4
from specserve.model.layers import ColumnParallelLinear, HotPathModule, RowParallelLinear, _divide
from specserve.model.quant import Int4Weights, QuantConfig


def check_int32(t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"packed int4 tensors are int32, checkpoint has {t.dtype}")


def check_float(t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"scales are floats, checkpoint has {t.dtype}")


def unpack_zero_points(loaded: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """A module's zero points as checkpoints store them (int32 words along the output dimension,
    [ceil(rows/8), groups]) -> int8 [rows, groups], ready to stack and shard by row."""
    check_int32(loaded)
    if tuple(loaded.shape) != (-(-rows // PACK), groups):
        raise ValueError(
            f"expected packed zero points of shape {(-(-rows // PACK), groups)}, checkpoint has {tuple(loaded.shape)}"
        )
    return unpack_int4(loaded, rows, dim=-2)


class Int4Linear(HotPathModule):
    """y = x W^T + b for an int4 W [out, in]. `split` "column": output features split across
    ranks, several Hugging Face modules stacked (`shard_sizes`, as ColumnParallelLinear);
    "row": input features split, partial sums all-reduced (as RowParallelLinear)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        fmt: Int4Weights,
        split: str = "column",
        bias: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.tp = tp_size()
        self.split, self.fmt, self.gather_output = split, fmt, gather_output
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        if split == "column":
            self.local_sizes = [_divide(s, self.tp, "output features") for s in shard_sizes]
            self.local_in = in_features
        else:
            self.local_sizes = list(shard_sizes)
            self.local_in = _divide(in_features, self.tp, "input features")
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(shard_sizes))]
        group = fmt.group_size or in_features
        if in_features % group or self.local_in % group or self.local_in % PACK:
            raise ValueError(
                f"int4 weight with {in_features} input features ({self.local_in} per rank) does not "
                f"split into whole groups of {group} and words of {PACK}"
            )
        # Per channel, every rank's slice of a row shares that row's one scale.
        self.group = fmt.group_size
        groups = 1 if fmt.group_size is None else self.local_in // fmt.group_size
        out = sum(self.local_sizes)
        self.register_buffer("weight_packed", torch.empty(out, self.local_in // PACK, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(out, groups))
        self.weight_packed.weight_loader = self._load_packed
        self.weight_scale.weight_loader = self._load_scale
        if fmt.symmetric:
            self.weight_zero_point = None
        else:
            # Unpacked at load: checkpoints pack zero points along the output dimension, which
            # stacking and sharding cut at any row; one byte per group costs 1/16 of the weight at group 32.
            self.register_buffer("weight_zero_point", torch.empty(out, groups, dtype=torch.int8))
            self.weight_zero_point.weight_loader = self._load_zero
        # The [out, in] each Hugging Face module says it unpacks to, checked against the config.
        self.register_buffer("weight_shape", torch.zeros(len(shard_sizes), 2, dtype=torch.int64), persistent=False)
        self.weight_shape.weight_loader = self._load_shape
        if bias:
            self.bias = nn.Parameter(torch.zeros(out if split == "column" else shard_sizes[0]))
            self.bias.weight_loader = self._load_bias
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.shard_sizes}, {self.fmt.describe()}, split={self.split}"

    def hf_tensors(self, name: str, shard: int) -> dict[str, tuple[torch.Tensor, int]]:
        """Checkpoint tensor names of Hugging Face module `name` (stacked as `shard`) -> (our tensor, shard)."""
        out = {
            f"{name}.weight_packed": (self.weight_packed, shard),
            f"{name}.weight_scale": (self.weight_scale, shard),
            f"{name}.weight_shape": (self.weight_shape, shard),
        }
        if self.weight_zero_point is not None:
            out[f"{name}.weight_zero_point"] = (self.weight_zero_point, shard)
        if self.bias is not None:
            out[f"{name}.bias"] = (self.bias, shard)
        return out

    # ------------------------------------------------------------------ loading
    def _place(self, buf: torch.Tensor, loaded: torch.Tensor, shard: int, per_col: int | None) -> None:
        """Copy one module's full tensor [its out, in / per_col] into this rank's rows (column
        split) or columns (row split) of `buf`; per_col None: columns not split (channel scales)."""
        size = self.local_sizes[shard]
        cols = 1 if per_col is None else self.in_features // per_col
        if tuple(loaded.shape) != (self.shard_sizes[shard], cols):
            raise ValueError(f"expected shape {(self.shard_sizes[shard], cols)}, checkpoint has {tuple(loaded.shape)}")
        if self.tp > 1 and self.split == "column":
            loaded = loaded.narrow(0, tp_rank() * size, size)
        elif self.tp > 1 and per_col is not None:
            local = self.local_in // per_col
            loaded = loaded.narrow(1, tp_rank() * local, local)
        buf.narrow(0, self.offsets[shard], size).copy_(loaded)

    def _load_packed(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        check_int32(loaded)
        self._place(param, loaded, shard or 0, PACK)

    def _load_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        check_float(loaded)
        self._place(param, loaded, shard or 0, self.group)

    def _load_zero(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        shard = shard or 0
        rows = self.shard_sizes[shard]
        self._place(param, unpack_zero_points(loaded, rows, self.fmt.groups(self.in_features)), shard, self.group)

    def _load_shape(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        shard = shard or 0
        want = [self.shard_sizes[shard], self.in_features]
        if loaded.tolist() != want:
            raise ValueError(f"weight_shape is {loaded.tolist()}, the config implies {want}")
        param[shard] = loaded

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        shard = shard or 0
        if self.split == "row":
            size, offset, start = self.shard_sizes[0], 0, 0
        else:
            size, offset, start = self.local_sizes[shard], self.offsets[shard], tp_rank() * self.local_sizes[shard]
        if loaded.shape[0] != self.shard_sizes[shard]:
            raise ValueError(f"expected bias of {self.shard_sizes[shard]}, checkpoint has {tuple(loaded.shape)}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    # ------------------------------------------------------------------ product
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "row":
            y = all_reduce(int4_matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point))
            return y + self.bias if self.bias is not None else y
        y = int4_matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.bias)
        return all_gather_last_dim(y) if self.gather_output else y


def column_linear(
    quant: QuantConfig | None,
    names: list[str],
    in_features: int,
    shard_sizes: list[int],
    bias: bool = False,
    gather_output: bool = False,
) -> nn.Module:
    """The output-split linear of Hugging Face modules `names` (stacked in that order): int4
    where the checkpoint's quantization config says so, else float."""
    fmt = quant.stacked(names) if quant is not None else None
    if fmt is None:
        return ColumnParallelLinear(in_features, shard_sizes, bias=bias, gather_output=gather_output)
    return Int4Linear(in_features, shard_sizes, fmt, "column", bias=bias, gather_output=gather_output)


def row_linear(
    quant: QuantConfig | None, name: str, in_features: int, out_features: int, bias: bool = False
) -> nn.Module:
    """The input-split linear of Hugging Face module `name`: int4 or float, as `column_linear`."""
    fmt = quant.linear(name) if quant is not None else None
    if fmt is None:
        return RowParallelLinear(in_features, out_features, bias=bias)
    return Int4Linear(in_features, [out_features], fmt, "row", bias=bias)


def linear_tensors(module: nn.Module, names: list[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """Checkpoint tensor name -> (our tensor, shard) for a linear built by `column_linear` or
    `row_linear` from Hugging Face modules `names`."""
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for shard, name in enumerate(names):
        if isinstance(module, Int4Linear):
            out.update(module.hf_tensors(name, shard))
            continue
        out[f"{name}.weight"] = (module.weight, shard)
        if module.bias is not None:
            out[f"{name}.bias"] = (module.bias, shard)
    return out
