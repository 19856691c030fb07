"""Reading a checkpoint directory's files: its JSON configs and the list of its weight files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specserve.errors import ConfigError

DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: expected a Hugging Face model directory with config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def need_key(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{path}: required key {key!r} is missing")
    return cfg[key]


def checkpoint_files(model_dir: Path, allow_pickle: bool) -> list[Path]:
    """The weight files of a checkpoint directory: a safetensors index, else
    *.safetensors, else pickles (*.bin / *.pt) only with `allow_pickle`, because
    unpickling can execute code."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ConfigError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
    if pickles:
        if not allow_pickle:
            raise ConfigError(
                f"{model_dir} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}); "
                "pickles can execute code when loaded. Convert them to safetensors, or pass --allow-pickle "
                "if you trust their source"
            )
        return pickles
    raise ConfigError(f"{model_dir} has no weights (*.safetensors, or *.bin with --allow-pickle)")


def draft_tensor_name(name: str) -> str:
    """EAGLE-reference tensor names (`layers.0.*`, optional `model.` prefix) -> SpecForge names (`midlayer.*`)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return name
