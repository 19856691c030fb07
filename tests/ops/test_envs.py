"""The registry of environment switches (specserve/envs.py) is complete and parses strictly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specserve import envs

PACKAGE = Path(envs.__file__).parent


def _package_files():
    return [p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".json", ".txt", ".sh")]


def test_every_specserve_variable_in_the_package_is_registered():
    seen: dict[str, str] = {}
    for path in _package_files():
        for name in re.findall(r"\bSPECSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            seen.setdefault(name, str(path.relative_to(PACKAGE)))
    missing = {n: f for n, f in seen.items() if n not in envs.REGISTRY}
    assert not missing, f"SPECSERVE_* names without an entry in specserve/envs.py: {missing}"
    assert "SPECSERVE_PDL" in seen  # the scan finds names at all


def test_variables_are_read_only_through_the_registry():
    """Outside envs.py no module reads a SPECSERVE_* variable from os.environ itself."""
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["']SPECSERVE_""")
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "envs.py" and direct.search(p.read_text())
    ]
    assert offenders == []


def test_registry_entries_are_documented_and_marked():
    for var in envs.REGISTRY.values():
        assert var.name.startswith("SPECSERVE_") and var.doc and var.type in (bool, int, str)
    internal = {v.name for v in envs.REGISTRY.values() if v.internal}
    assert {
        "SPECSERVE_TP_RANK",
        "SPECSERVE_TP_SIZE",
        "SPECSERVE_TP_FD",
        "SPECSERVE_TP_PARENT_PID",
        "SPECSERVE_LAUNCH_ID",
    } == internal


def test_parsing(monkeypatch):
    monkeypatch.delenv("SPECSERVE_PDL", raising=False)
    assert envs.PDL.get() is True
    for raw, want in (("0", False), ("off", False), ("1", True), ("TRUE", True), ("", True)):
        monkeypatch.setenv("SPECSERVE_PDL", raw)
        assert envs.PDL.get() is want
    monkeypatch.setenv("SPECSERVE_PDL", "maybe")
    with pytest.raises(ValueError, match=r"SPECSERVE_PDL='maybe': expected 1 or 0"):
        envs.PDL.get()
    monkeypatch.setenv("SPECSERVE_TP_DRAFT_EMBED", "sharded")
    with pytest.raises(ValueError, match=r"SPECSERVE_TP_DRAFT_EMBED='sharded': choose one of replicated, shared"):
        envs.TP_DRAFT_EMBED.get()
    monkeypatch.setenv("SPECSERVE_TP_RANK", "x")
    with pytest.raises(ValueError, match="SPECSERVE_TP_RANK='x': expected an integer"):
        envs.TP_RANK.get()
    monkeypatch.delenv("SPECSERVE_TP_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="SPECSERVE_TP_SIZE is not set"):
        envs.TP_SIZE.require()


def test_cli_reference_lists_the_registry():
    """docs/cli.md's environment table is `envs.reference_table()` (regenerate it after editing the registry)."""
    reference = (PACKAGE.parent / "docs" / "cli.md").read_text()
    assert envs.reference_table() in reference
