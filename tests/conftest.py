import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (specserve/kernels/) run on CPU in Triton's interpreter; must be set
    # before they are defined. It changes nothing else: without CUDA the engine never calls them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_pair(tmp_path_factory):
    """Builds a random target and an EAGLE-3 drafter for it (tests/tiny.py), once per session for
    each spec: ``make_pair(tokenizer=None, drafter=None, draft=None, **target)`` -> (target_dir,
    draft_dir), side by side under one folder. `target`: make_target's shape keywords;
    `tokenizer`: "demo" copies the bundled demo tokenizer (4096 entries, for text prompts), a
    callable(target_dir) writes one; `drafter`: callable(out, target_dir) -> draft_dir, else
    make_drafter with the `draft` keywords."""
    import shutil

    from specserve.config import DEMO_DIR
    from tiny import make_drafter, make_target

    built: dict[tuple, tuple] = {}

    def build(tokenizer=None, drafter=None, draft: dict | None = None, **target):
        key = (tokenizer, drafter, tuple(sorted((draft or {}).items())), tuple(sorted(target.items())))
        if key not in built:
            root = tmp_path_factory.mktemp("pair")
            target_dir = make_target(root / "target", **target)
            if tokenizer == "demo":
                for f in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(DEMO_DIR / f, target_dir / f)
            elif tokenizer is not None:
                tokenizer(target_dir)
            draft_dir = (drafter(root / "draft", target_dir) if drafter is not None
                         else make_drafter(root / "draft", target_dir, **(draft or {})))
            built[key] = (target_dir, draft_dir)
        return built[key]

    return build


@pytest.fixture(scope="session")
def demo_pair() -> tuple[str, str]:
    """The bundled demo pair: the small trained target and its trained drafter."""
    from specserve.config import DEMO_DIR

    return str(DEMO_DIR), str(DEMO_DIR / "draft")
