"""NCCL profiles: named sets of environment variables for the TP workers, and
the rules that merge them with what the operator set.

A profile is a preset name (`default`, `pcie-low-latency`) or a file written by
`specserve nccl-tune` (or by hand): JSON `{"name": ..., "env": {KEY: VALUE}}`
or KEY=VALUE lines (`#` comments allowed). Besides NCCL_* variables a profile
may pick the all-reduce implementation with SPECSERVE_ALLREDUCE (torch | nccl |
symm_mem, see `specserve.distributed.comm`).

Merge order for a worker's environment (later wins, except where noted):
  1. the parent's environment (everything the operator exported);
  2. the profile's variables, but never over a variable the operator already
     set: an explicit operator choice is kept, and the merge says so;
  3. `--env KEY=VALUE` (the most explicit choice; wins over 1 and 2);
  4. NCCL_NVLS_ENABLE=0 when nobody set it (NVLink SHARP stays off on our
     machines; an explicit other value is kept, with a warning).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from specserve import envs
from specserve.config import ConfigError

PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    # Latency over bandwidth for small decode all-reduces on PCIe boxes. With NVLink it is slower
    # than `default` at decode sizes: measure (`specserve nccl-tune`), don't assume.
    "pcie-low-latency": {
        "NCCL_PROTO": "LL",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216",
        "NCCL_NTHREADS": "512",
    },
}
ALWAYS = {"NCCL_NVLS_ENABLE": "0"}
ALLREDUCE_VAR = envs.ALLREDUCE.name
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Profile:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    source: str = "preset"


@dataclass
class WorkerEnv:
    """The environment to give every worker, plus what must be checked and shown."""

    env: dict[str, str]  # the complete environment passed to the worker
    requested: dict[str, str]  # variables that must reach the worker with exactly these values
    notes: list[str]  # operator values kept over the profile, NVLS warnings


def _check_vars(env: dict, where: str) -> dict[str, str]:
    if not isinstance(env, dict):
        raise ConfigError(f"{where}: 'env' must be an object of VARIABLE: value")
    out = {}
    for k, v in env.items():
        if not isinstance(k, str) or not _NAME.match(k):
            raise ConfigError(f"{where}: {k!r} is not a valid environment variable name")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{where}: value of {k} must be a string or number, got {type(v).__name__}")
        out[k] = str(v)
    return out


def load_profile(spec: str | None) -> Profile:
    """A preset name or a profile file (JSON or KEY=VALUE lines)."""
    spec = spec or "default"
    if spec in PRESETS:
        return Profile(spec, dict(PRESETS[spec]))
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"NCCL profile {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing profile file"
        )
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(data, dict) or "env" not in data:
            raise ConfigError(f'{path}: a JSON profile needs an \'env\' object, e.g. {{"env": {{"NCCL_PROTO": "LL"}}}}')
        return Profile(str(data.get("name") or path.stem), _check_vars(data["env"], str(path)), str(path))
    env = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        if "=" not in line:
            raise ConfigError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        k, v = line.split("=", 1)
        env[k.strip()] = v.strip().strip("'\"")
    return Profile(path.stem, _check_vars(env, str(path)), str(path))


def parse_env_args(items: list[str] | None) -> dict[str, str]:
    """`--env KEY=VALUE` flags -> dict (a bad item is a clear error)."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--env {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        if not _NAME.match(k):
            raise ConfigError(f"--env {item!r}: {k!r} is not a valid environment variable name")
        out[k] = v
    return out


def build_worker_env(base: dict[str, str], profile: Profile, explicit: dict[str, str] | None = None) -> WorkerEnv:
    """Merge the parent's environment, a profile and --env values (see module doc)."""
    explicit = dict(explicit or {})
    env = dict(base)
    requested: dict[str, str] = {}
    notes: list[str] = []
    for k, v in profile.env.items():
        if k in explicit:
            continue
        if k in base:
            if base[k] != v:
                notes.append(
                    f"{k}={base[k]} kept from the operator's environment (profile {profile.name} would set {v})"
                )
            continue
        env[k] = v
    env.update(explicit)
    for k, v in ALWAYS.items():
        if k not in env:
            env[k] = v
        elif env[k] != v:
            notes.append(f"warning: {k}={env[k]} was set explicitly; specserve's default is {v}")
    # Everything NCCL-related and everything asked for must arrive unchanged.
    for k, v in env.items():
        if k.startswith(("NCCL_", "TORCH_NCCL_")) or k in profile.env or k in explicit or k == ALLREDUCE_VAR:
            requested[k] = v
    return WorkerEnv(env, requested, notes)


def write_profile(path: str | Path, name: str, env: dict[str, str], measured: dict | None = None) -> Path:
    """Write a JSON profile that `--nccl-profile PATH` reads back."""
    path = Path(path)
    data = {"name": name, "env": dict(env)}
    if measured:
        data["measured"] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path
