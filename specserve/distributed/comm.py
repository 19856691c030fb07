"""Collective implementations for the TP workers, and the capture probe.

Three ways to all-reduce on GPUs (SPECSERVE_ALLREDUCE, set by a profile):

- `torch`: torch.distributed (ProcessGroupNCCL). Fine eagerly; capturing it in
  a CUDA graph can hang (ProcessGroupNCCL's watchdog queries events mid-capture), so it is not the default.
- `nccl` (default on CUDA): a communicator of our own, created with NCCL's C
  API through ctypes and launched on the current stream. NCCL documents graph
  capture of its collectives; this path has no ProcessGroupNCCL watchdog thread
  querying events during capture and no lazy communicator creation inside a
  capture (the communicator exists and is warmed up before any graph).
- `symm_mem`: torch symmetric memory one-shot all-reduce for messages up to a
  fixed buffer (decode sizes), the `nccl` communicator for everything else.

Every choice is set up on all ranks or on none (`all_ranks_agree`); a rank
that cannot set one up makes all ranks fall back to `torch`, with a warning.
On CPU (gloo) only `torch` exists.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from specserve import envs
from specserve.distributed import parallel_state as ps

log = logging.getLogger("specserve.tp")
BACKENDS = ("torch", "nccl", "symm_mem")

# ------------------------------------------------------------ NCCL via ctypes
_NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_NCCL_SUM = 0


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _load_libnccl() -> ctypes.CDLL:
    """The libnccl torch already uses (same soname), else the nvidia-nccl wheel's copy."""
    candidates = [envs.NCCL_LIB.get(), "libnccl.so.2", "libnccl.so"]
    try:
        import nvidia.nccl  # the pip wheel torch depends on

        for p in nvidia.nccl.__path__:
            candidates.append(str(Path(p) / "lib" / "libnccl.so.2"))
    except ImportError:
        pass
    errors = []
    for c in candidates:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise RuntimeError("could not load libnccl: " + "; ".join(errors))


class NcclComm:
    """A NCCL communicator of our own over the TP ranks (one GPU per rank)."""

    def __init__(self, rank: int, size: int, device: torch.device, control_group=None):
        import torch.distributed as dist

        self.lib = lib = _load_libnccl()
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.ncclAllGather.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        version = ctypes.c_int()
        self._check(lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value
        self.size, self.device = size, device
        uid = _UniqueId()
        if rank == 0:
            self._check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        obj = [bytes(uid.internal) if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0, group=control_group)
        ctypes.memmove(ctypes.byref(uid), obj[0], 128)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank), "ncclCommInitRank")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.ncclGetErrorString(rc).decode() if hasattr(self, "lib") else ""
            raise RuntimeError(f"{what} failed: NCCL error {rc} {msg}")

    def _dtype(self, x: torch.Tensor) -> int:
        if x.dtype not in _NCCL_DTYPES:
            raise TypeError(f"NCCL has no type for {x.dtype}")
        return _NCCL_DTYPES[x.dtype]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            y = x.contiguous()
            self.all_reduce(y)
            x.copy_(y)
            return x
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self._check(
            self.lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), self._dtype(x), _NCCL_SUM, self.comm, stream),
            "ncclAllReduce",
        )
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self._check(
            self.lib.ncclAllGather(x.data_ptr(), out.data_ptr(), x.numel(), self._dtype(x), self.comm, stream),
            "ncclAllGather",
        )
        # [tp, ..., n] -> [..., tp * n]: rank r's shard is columns r*n .. (r+1)*n.
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


class SymmMemAllReduce:
    """One-shot all-reduce through torch symmetric memory for messages that fit
    `max_bytes`; larger ones and all-gathers go to `fallback`."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, fallback, max_bytes: int = 8 << 20):
        import torch.distributed._symmetric_memory as symm_mem

        self.fallback, self.dtype = fallback, dtype
        self.group_name = group.group_name if group is not None else torch.distributed.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(self.group_name)  # needed by older torch, deprecated later
            except Exception:  # noqa: BLE001 - newer torch needs nothing here
                pass
        self.numel = max_bytes // torch.tensor([], dtype=dtype).element_size()
        self.buf = symm_mem.empty(self.numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.group_name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if x.dtype != self.dtype or n > self.numel or not x.is_contiguous():
            return self.fallback.all_reduce(x)
        part = self.buf[:n]  # a prefix: storage offset 0 inside the registered buffer
        part.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group_name, out=x.view(-1))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return self.fallback.all_gather_last_dim(x)


def install(
    backend: str, rank: int, size: int, device: torch.device, dtype: torch.dtype, group=None, control_group=None
) -> str:
    """Set up `backend` on every rank (or fall back to torch everywhere); returns the one in use."""
    if size == 1:
        return "none"
    if device.type != "cuda":
        if backend not in ("torch", "auto"):
            log.info("SPECSERVE_ALLREDUCE=%s needs CUDA; using torch.distributed (gloo) on CPU", backend)
        ps.set_collectives(None)
        return "torch"
    if backend == "auto":
        backend = "nccl"
    if backend not in BACKENDS:
        raise ValueError(f"SPECSERVE_ALLREDUCE={backend!r}: choose one of {', '.join(BACKENDS)}")
    impl, error = None, None
    if backend != "torch":
        try:
            impl = NcclComm(rank, size, device, control_group)
            if backend == "symm_mem":
                impl = SymmMemAllReduce(group, device, dtype, impl)
            _self_test(impl, size, device, dtype)
        except Exception as e:  # noqa: BLE001 - any failure means: fall back on all ranks
            impl, error = None, f"{type(e).__name__}: {e}"
    if backend != "torch" and not ps.all_ranks_agree(impl is not None):
        log.warning(
            "all-reduce backend %s could not be set up on every rank (%s); using torch.distributed",
            backend,
            error or "failed on another rank",
        )
        backend, impl = "torch", None
    ps.set_collectives(impl)
    return backend


def _self_test(impl, size: int, device: torch.device, dtype: torch.dtype) -> None:
    """One small all-reduce and all-gather through `impl`, checked (ranks run the same code,
    so a failure here is normally the same on every rank)."""
    x = torch.ones(64, dtype=dtype, device=device)
    impl.all_reduce(x)
    g = impl.all_gather_last_dim(x.view(1, -1))
    torch.cuda.synchronize(device)
    if not torch.all(x == size) or g.shape != (1, 64 * size):
        raise RuntimeError(f"self-test gave wrong results ({x[0].item()} instead of {size})")


def warm_up(device: torch.device, hidden: int, dtype: torch.dtype) -> None:
    """Eager collectives on the device before any capture: communicators are
    created and their buffers registered outside every graph."""
    x = torch.ones(hidden, dtype=dtype, device=device)
    ps.all_reduce(x)
    ps.all_gather_last_dim(x.view(1, -1))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    expected = float(ps.tp_size())
    if not torch.all(x == expected):
        raise RuntimeError(f"all-reduce warm-up gave {x[0].item()} instead of {expected}")


def probe_capture(device: torch.device, hidden: int, dtype: torch.dtype, step=lambda s: None) -> None:
    """Capture an all-reduce and an all-gather in a CUDA graph, replay it twice
    and check the values. `step(name)` reports progress, so a hang is located."""
    tp = ps.tp_size()
    src = (torch.arange(hidden, device=device) % 64).to(dtype)  # sums stay exact in bf16
    buf = torch.empty_like(src)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        buf.copy_(src)
        ps.all_reduce(buf)
        ps.all_gather_last_dim(buf.view(1, -1))
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    step("probe: eager warm-up on the capture stream done")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        buf.copy_(src)
        ps.all_reduce(buf)
        gathered = ps.all_gather_last_dim(buf.view(1, -1))
    step("probe: captured")
    for i in range(2):
        graph.replay()
        torch.cuda.synchronize(device)
        step(f"probe: replay {i + 1} done")
    want = src.float() * tp
    if not torch.allclose(buf.float(), want) or gathered.shape[-1] != tp * hidden:
        raise RuntimeError("a captured all-reduce gave wrong values")
