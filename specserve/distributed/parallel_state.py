"""Tensor-parallel rank/size and the two collectives the model needs.

With one process (the default) every call is a no-op, so model code is written
once for any TP size. Worker processes call `init_tensor_parallel` after
`torch.distributed.init_process_group`.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1
_GROUP = None


def init_tensor_parallel(rank: int, size: int, group=None) -> None:
    global _TP_RANK, _TP_SIZE, _GROUP
    _TP_RANK, _TP_SIZE, _GROUP = rank, size, group


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)
