"""Optional dependencies: what serving does not need lives in a pip extra (pyproject.toml), and a
feature that needs one names it when it is missing, before any work starts."""

from __future__ import annotations

import importlib
from types import ModuleType

from specserve.config import ConfigError


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise a ConfigError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{feature} needs the Python package '{module}', which specserve installs only with "
            f"an extra: pip install 'specserve[{extra}]' (or, from a checkout, "
            f"pip install -e '.[{extra}]')"
        ) from None
