"""A stand-in for nvidia-ml-py's `pynvml`, driven by a JSON file, for CPU-only CI.

Put this directory first on PYTHONPATH and point FAKE_NVML_STATE at a JSON file:

    {"gpus": [{"name": "Fake H200", "total_mib": 143771, "base_mib": 500, "util": 3,
               "pidfile": "/tmp/pids", "pidfile_mib": 1000,
               "holders": [{"pid": 999999, "mib": 2048, "when_file": "/tmp/flag"}]}]}

Used memory = base + pidfile_mib for every *live* PID listed in `pidfile` + each holder
whose `when_file` exists (or that has none). Those PIDs are the compute processes.
Without FAKE_NVML_STATE, nvmlInit fails like a machine without a driver.
"""

import json
import os
from types import SimpleNamespace

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


def _state():
    path = os.environ.get("FAKE_NVML_STATE")
    if not path:
        raise NVMLError("Driver Not Loaded")
    with open(path) as f:
        return json.load(f)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _holders(gpu):
    out = []
    pf = gpu.get("pidfile")
    if pf and os.path.exists(pf):
        with open(pf) as f:
            for tok in f.read().split():
                if _alive(int(tok)):
                    out.append((int(tok), gpu.get("pidfile_mib", 0)))
    for h in gpu.get("holders", []):
        if not h.get("when_file") or os.path.exists(h["when_file"]):
            out.append((int(h["pid"]), h["mib"]))
    return out


def nvmlInit():
    _state()


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "999.99-fake"


def nvmlDeviceGetCount():
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(i):
    gpus = _state()["gpus"]
    if not 0 <= i < len(gpus):
        raise NVMLError("Invalid Argument")
    return i


def _gpu(h):
    return _state()["gpus"][h]


def nvmlDeviceGetMemoryInfo(h):
    g = _gpu(h)
    used = g.get("base_mib", 0) + sum(m for _, m in _holders(g))
    total = g.get("total_mib", 81559)
    return SimpleNamespace(used=used * MIB, total=total * MIB, free=(total - used) * MIB)


def nvmlDeviceGetName(h):
    return _gpu(h).get("name", "Fake GPU")


def nvmlDeviceGetUUID(h):
    return f"GPU-fake-{h:04d}"


def nvmlDeviceGetMinorNumber(h):
    return 4000 + h  # /dev/nvidia4000...: no real process holds these device files


def nvmlDeviceGetUtilizationRates(h):
    return SimpleNamespace(gpu=_gpu(h).get("util", 0), memory=0)


def nvmlDeviceGetComputeRunningProcesses(h):
    return [SimpleNamespace(pid=pid, usedGpuMemory=m * MIB) for pid, m in _holders(_gpu(h))]


def nvmlDeviceGetGraphicsRunningProcesses(h):
    return []
