"""A small NVML wrapper that returns plain dataclasses and never raises for "no GPU".

Used by `specserve gpus` and by the supervisor (`specserve launch`) for the
before/after GPU-memory check. It imports `pynvml` (from the nvidia-ml-py package)
lazily, so importing this module is cheap and works on machines without a driver.
No torch here: NVML sees every process on the device and does not create a CUDA
context (which would itself take memory on every GPU).

Things worth knowing about the numbers:
- `memory_used_mib` is what NVML reports for the whole device; on an idle GPU it is
  not zero (the driver reserves a few hundred MiB), hence "free" is always a threshold.
- per-process memory (`GpuProcess.used_mib`) may be None: NVML omits it without
  privileges and on some MIG/vGPU setups.
- inside a container NVML reports host PIDs; such a PID either does not exist in the
  container's PID namespace or (worse) names a different process. `GpuProcess.visible`
  is False when the PID is not found here; the command line is only filled in when it is.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024 * 1024

NO_NVML_MESSAGE = "no NVIDIA GPU/NVML"


@dataclass
class GpuProcess:
    pid: int
    used_mib: float | None = None  # None: NVML did not say
    name: str | None = None
    cmdline: str | None = None
    visible: bool = True  # False: PID not found in this PID namespace
    kind: str = "compute"  # compute | graphics | device-file

    def describe(self, width: int = 100) -> str:
        what = self.cmdline or self.name
        if not self.visible:
            what = "(PID not visible here: other PID namespace or already gone)"
        elif not what:
            what = "?"
        if len(what) > width:
            what = what[: width - 3] + "..."
        mem = f"{self.used_mib:.0f} MiB" if self.used_mib is not None else "? MiB"
        return f"pid {self.pid} ({mem}): {what}"


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str | None
    minor: int | None  # /dev/nvidia<minor>
    memory_used_mib: float
    memory_total_mib: float
    utilization_pct: int | None
    processes: list[GpuProcess] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuQuery:
    available: bool
    reason: str  # why NVML is not available ("" when it is)
    driver_version: str | None = None
    gpus: list[Gpu] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nvml": self.available,
            "reason": self.reason,
            "driver_version": self.driver_version,
            "gpus": [g.to_dict() for g in self.gpus],
        }


_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ok": False, "reason": "", "mod": None}


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml():
    """Initialise NVML once per process; return the pynvml module or None."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml  # type: ignore[import-not-found]
            except Exception as exc:  # not installed, or broken
                _state["reason"] = (
                    f"{NO_NVML_MESSAGE} (pynvml not importable: {exc}; it comes with pip install 'specserve[ops]')"
                )
                return None
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # library not found, driver not loaded, ...
                _state["reason"] = f"{NO_NVML_MESSAGE} ({exc})"
                return None
            _state["ok"] = True
            _state["mod"] = pynvml
        return _state["mod"] if _state["ok"] else None


def reset() -> None:
    """Forget the cached NVML state (tests swap in a fake pynvml)."""
    with _lock:
        mod = _state["mod"]
        if mod is not None:
            try:
                mod.nvmlShutdown()
            except Exception:
                pass
        _state.update(tried=False, ok=False, reason="", mod=None)


def driver_without_package() -> bool:
    """An NVIDIA driver is loaded but pynvml (the `ops` extra) is not installed."""
    import importlib.util

    return importlib.util.find_spec("pynvml") is None and Path("/proc/driver/nvidia/gpus").is_dir()


def available() -> tuple[bool, str]:
    mod = _nvml()
    return (mod is not None), ("" if mod is not None else _state["reason"])


def describe_pid(pid: int) -> tuple[bool, str | None, str | None]:
    try:
        import psutil

        p = psutil.Process(pid)
        name = p.name()
        try:
            cmd = " ".join(p.cmdline()) or name
        except (psutil.AccessDenied, psutil.ZombieProcess):
            cmd = name
        return True, name, cmd
    except Exception:
        return False, None, None


def _device_processes(mod, handle) -> list[GpuProcess]:
    procs: dict[int, GpuProcess] = {}
    for kind, fn_name in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        fn = getattr(mod, fn_name, None)
        if fn is None:
            continue
        try:
            entries = fn(handle)
        except Exception:
            continue
        for e in entries or []:
            pid = int(getattr(e, "pid", -1))
            used = getattr(e, "usedGpuMemory", None)
            used_mib = None if used is None else float(used) / MIB
            if pid in procs:  # a process can be both compute and graphics
                if used_mib is not None:
                    procs[pid].used_mib = max(procs[pid].used_mib or 0.0, used_mib)
                continue
            visible, name, cmd = describe_pid(pid)
            procs[pid] = GpuProcess(pid=pid, used_mib=used_mib, name=name, cmdline=cmd, visible=visible, kind=kind)
    return sorted(procs.values(), key=lambda p: p.pid)


def query(processes: bool = True) -> GpuQuery:
    """Every GPU NVML sees, with memory, utilisation and (optionally) processes."""
    mod = _nvml()
    if mod is None:
        return GpuQuery(available=False, reason=_state["reason"])
    try:
        driver = _str(mod.nvmlSystemGetDriverVersion())
    except Exception:
        driver = None
    try:
        count = int(mod.nvmlDeviceGetCount())
    except Exception as exc:
        return GpuQuery(available=False, reason=f"{NO_NVML_MESSAGE} (device count failed: {exc})")
    gpus: list[Gpu] = []
    for i in range(count):
        try:
            h = mod.nvmlDeviceGetHandleByIndex(i)
            mem = mod.nvmlDeviceGetMemoryInfo(h)
        except Exception as exc:  # e.g. a GPU that fell off the bus
            gpus.append(
                Gpu(
                    index=i,
                    name=f"<error: {exc}>",
                    uuid=None,
                    minor=None,
                    memory_used_mib=float("nan"),
                    memory_total_mib=float("nan"),
                    utilization_pct=None,
                )
            )
            continue

        def opt(fn_name, *a):
            try:
                return getattr(mod, fn_name)(*a)
            except Exception:
                return None

        name = opt("nvmlDeviceGetName", h)
        uuid = opt("nvmlDeviceGetUUID", h)
        minor = opt("nvmlDeviceGetMinorNumber", h)
        util = opt("nvmlDeviceGetUtilizationRates", h)
        gpus.append(
            Gpu(
                index=i,
                name=_str(name) if name is not None else "?",
                uuid=_str(uuid) if uuid is not None else None,
                minor=int(minor) if minor is not None else None,
                memory_used_mib=float(mem.used) / MIB,
                memory_total_mib=float(mem.total) / MIB,
                utilization_pct=int(util.gpu) if util is not None else None,
                processes=_device_processes(mod, h) if processes else [],
            )
        )
    return GpuQuery(available=True, reason="", driver_version=driver, gpus=gpus)


def memory_used() -> dict[int, float] | None:
    """GPU index -> used MiB, or None without NVML."""
    q = query(processes=False)
    if not q.available:
        return None
    return {g.index: g.memory_used_mib for g in q.gpus}
