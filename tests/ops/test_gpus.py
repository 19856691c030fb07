"""`specserve gpus` and the NVML wrapper, against a fake `pynvml` (no GPU needed)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.ops import gpus, nvml

FAKE_NVML = Path(__file__).parent / "fake_servers" / "fake_nvml"
PY = sys.executable


@pytest.fixture
def fake_pynvml(monkeypatch, tmp_path):
    """Swap in the fake pynvml; returns a function that writes its state."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    state = tmp_path / "state.json"

    def set_state(s: dict | None) -> None:
        if s is None:
            monkeypatch.delenv("FAKE_NVML_STATE", raising=False)
        else:
            state.write_text(json.dumps(s))
            monkeypatch.setenv("FAKE_NVML_STATE", str(state))
        nvml.reset()

    yield set_state
    nvml.reset()


@pytest.fixture
def sleeper():
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gpus.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def two_gpus(tmp_path, holder_pid=None, mib=70000):
    pidfile = tmp_path / "pids"
    pidfile.write_text(f"{holder_pid}\n" if holder_pid else "")
    return {
        "gpus": [
            {"name": "Fake H200", "total_mib": 143771, "base_mib": 500, "util": 7},
            {"name": "Fake H200", "total_mib": 143771, "base_mib": 500, "pidfile": str(pidfile), "pidfile_mib": mib},
        ]
    }


def test_no_nvml(fake_pynvml, capsys):
    fake_pynvml(None)
    q = nvml.query()
    assert not q.available and q.reason.startswith(nvml.NO_NVML_MESSAGE) and q.gpus == []
    assert nvml.memory_used() is None
    assert gpus.run(args()) == 0
    assert "no NVIDIA GPU/NVML" in capsys.readouterr().out
    assert gpus.run(args(json=True)) == 0
    assert json.loads(capsys.readouterr().out)["nvml"] is False
    assert gpus.run(args(wait_free=True, timeout=1.0)) == 0
    assert "nothing to wait for" in capsys.readouterr().out


def test_table_and_json(fake_pynvml, tmp_path, sleeper, capsys):
    fake_pynvml(two_gpus(tmp_path, sleeper.pid))
    assert gpus.run(args()) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["GPU", "NAME", "USED"]
    assert "500 / 143771" in lines[1] and "7%" in lines[1] and lines[1].rstrip().endswith("-")
    assert "70500 / 143771" in lines[2] and f"pid {sleeper.pid} (70000 MiB)" in lines[2]
    assert "time.sleep(60)" in lines[2]  # the command line, from psutil
    assert gpus.run(args(json=True)) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["nvml"] is True and [g["index"] for g in d["gpus"]] == [0, 1]
    g1 = d["gpus"][1]
    assert g1["memory_used_mib"] == 70500 and g1["memory_total_mib"] == 143771
    assert g1["processes"][0]["pid"] == sleeper.pid and g1["processes"][0]["used_mib"] == 70000
    assert gpus.run(args(json=True, devices="1")) == 0
    assert [g["index"] for g in json.loads(capsys.readouterr().out)["gpus"]] == [1]


def test_wait_free_times_out_then_succeeds(fake_pynvml, tmp_path, sleeper, capsys):
    fake_pynvml(two_gpus(tmp_path, sleeper.pid))
    assert gpus.run(args(wait_free=True, timeout=0.6, interval=0.2)) == gpus.EXIT_TIMEOUT
    out = capsys.readouterr().out
    assert "still busy after 0.6 s" in out and f"pid {sleeper.pid}" in out and "GPU 0" not in out
    # Only GPU 0 selected: free at once.
    assert gpus.run(args(wait_free=True, timeout=0.6, interval=0.2, devices="0")) == 0
    capsys.readouterr()
    sleeper.kill()
    sleeper.wait()
    assert gpus.run(args(wait_free=True, timeout=5, interval=0.2)) == 0
    assert "all 2 GPU(s) free" in capsys.readouterr().out
    assert gpus.run(args(wait_free=True, json=True, timeout=5, interval=0.2)) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "free"


def test_wait_free_ignores_the_callers_own_memory(fake_pynvml, tmp_path, capsys):
    """A caller holding the GPU itself (e.g. a script that used CUDA) is not waited for."""
    fake_pynvml(two_gpus(tmp_path, os.getpid(), mib=5000))
    assert gpus.busy(gpus.collect(), threshold_mib=1024) != []  # someone else's view: busy
    assert gpus.busy(gpus.collect(), threshold_mib=1024, ignore={os.getpid()}) == []
    assert os.getpid() in gpus.caller_pids() and os.getppid() in gpus.caller_pids()
    assert gpus.run(args(wait_free=True, timeout=2, interval=0.2)) == 0
    assert "all 2 GPU(s) free" in capsys.readouterr().out


def test_threshold(fake_pynvml, tmp_path, sleeper):
    # 300 MiB held by a compute process: not free, whatever the threshold.
    fake_pynvml(two_gpus(tmp_path, sleeper.pid, mib=300))
    q = gpus.collect()
    assert gpus.busy(q, threshold_mib=1024) and gpus.busy(q, threshold_mib=100)
    # Idle driver reservation only: free under the default threshold.
    fake_pynvml({"gpus": [{"name": "x", "total_mib": 1000, "base_mib": 600}]})
    assert gpus.busy(gpus.collect(), threshold_mib=1024) == []
    assert gpus.busy(gpus.collect(), threshold_mib=512) != []


def test_invisible_pid(fake_pynvml, tmp_path):
    s = {"gpus": [{"name": "x", "total_mib": 1000, "base_mib": 10, "holders": [{"pid": 4194000, "mib": 500}]}]}
    fake_pynvml(s)
    p = nvml.query().gpus[0].processes[0]
    assert p.pid == 4194000 and not p.visible and "not visible" in p.describe()


def test_usage_error(fake_pynvml):
    fake_pynvml(None)
    assert gpus.run(args(devices="a,b")) == gpus.EXIT_USAGE


def test_cli_without_gpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(FAKE_NVML))
    env.pop("FAKE_NVML_STATE", None)
    r = subprocess.run([PY, "-m", "specserve", "gpus"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "no NVIDIA GPU/NVML" in r.stdout
    r = subprocess.run(
        [PY, "-m", "specserve", "gpus", "--json", "--wait-free", "--timeout", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "no-nvml"


@pytest.mark.gpu
def test_real_gpu_holders_and_wait_free(tmp_path):
    """Real NVML: the processes of a GPU job are listed, and --wait-free sees them go."""
    fake_servers = Path(__file__).parent / "fake_servers"
    pidfile = tmp_path / "pids"
    job = subprocess.Popen(
        [PY, str(fake_servers / "gpu_hang.py"), "--gib", "3", "--pidfile", str(pidfile)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in job.stdout:  # progress lines, then "... hold N GiB each"
            if "hold" in line:
                break
        pids = [int(x) for x in pidfile.read_text().split()]
        r = subprocess.run([PY, "-m", "specserve", "gpus", "--json"], capture_output=True, text=True, timeout=300)
        d = json.loads(r.stdout)
        assert r.returncode == 0 and d["nvml"] is True and d["gpus"]
        listed = {p["pid"]: p for p in d["gpus"][0]["processes"]}
        print(r.stdout)
        # Inside a container NVML may report host PIDs; the /dev/nvidia* scan still finds ours.
        assert set(pids) <= set(listed)
        r = subprocess.run(
            [PY, "-m", "specserve", "gpus", "--wait-free", "--timeout", "2", "--devices", "0"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == gpus.EXIT_TIMEOUT and "still busy" in r.stdout
    finally:
        os.killpg(job.pid, 9)
        job.wait()
    r = subprocess.run(
        [PY, "-m", "specserve", "gpus", "--wait-free", "--timeout", "60", "--devices", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(r.stdout)
    assert r.returncode == 0
