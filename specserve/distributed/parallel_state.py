"""Tensor-parallel rank/size and the two collectives the model needs.

With one process (the default) every call is a no-op, so model code is written
once for any TP size. Worker processes call `init_tensor_parallel` after
`torch.distributed.init_process_group`, and may install another collective
implementation with `set_collectives` (e.g. a communicator of our own that is
safe to capture in CUDA graphs, see `specserve.distributed.comm`).
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1
_GROUP = None
_IMPL = None  # object with all_reduce(x) and all_gather_last_dim(x); None = torch.distributed
_CONTROL_GROUP = None  # a CPU (gloo) group for small host-side agreements


def init_tensor_parallel(rank: int, size: int, group=None, control_group=None) -> None:
    global _TP_RANK, _TP_SIZE, _GROUP, _CONTROL_GROUP, _IMPL
    _TP_RANK, _TP_SIZE, _GROUP, _CONTROL_GROUP, _IMPL = rank, size, group, control_group, None


def set_collectives(impl) -> None:
    """Route all_reduce / all_gather_last_dim through `impl` (None: torch.distributed)."""
    global _IMPL
    _IMPL = impl


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place; returns `x`."""
    if _TP_SIZE == 1:
        return x
    if _IMPL is not None:
        return _IMPL.all_reduce(x)
    import torch.distributed as dist

    dist.all_reduce(x, group=_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP_SIZE == 1:
        return x
    if _IMPL is not None:
        return _IMPL.all_gather_last_dim(x)
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)


def broadcast_int(value: int, src: int = 0) -> int:
    """Every rank gets rank `src`'s integer (host-side decisions such as the adaptive K)."""
    if _TP_SIZE == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, src=src, group=_CONTROL_GROUP)
    return int(t.item())


def all_ranks_agree(ok: bool) -> bool:
    """True only if `ok` is true on every rank (e.g. an optional backend set up everywhere)."""
    if _TP_SIZE == 1:
        return ok
    import torch.distributed as dist

    t = torch.tensor([1 if ok else 0], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return bool(t.item())


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's integer (sizes each rank must agree on, e.g. the KV pool)."""
    if _TP_SIZE == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return int(t.item())


def init_distributed(rank: int, size: int, device, timeout_s: float, store_prefix: str = "") -> None:
    """Join the group through the driver's store (under `store_prefix`: the driver's group);
    `timeout_s` bounds the rendezvous and every collective."""
    import datetime
    import os

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout=timeout)
    if store_prefix:
        store = dist.PrefixStore(store_prefix, store)
    # gloo for CPU tensors (control messages) everywhere; NCCL for CUDA tensors on GPUs.
    backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo")
    init_tensor_parallel(rank, size, dist.group.WORLD, control)
