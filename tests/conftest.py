import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (specserve/kernels/) run on CPU in Triton's interpreter; must be set
    # before they are defined. It changes nothing else: without CUDA the engine never calls them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
            draft_dir = (
                drafter(root / "draft", target_dir)
                if drafter is not None
                else make_drafter(root / "draft", target_dir, **(draft or {}))
            )
            built[key] = (target_dir, draft_dir)
        return built[key]

    return build


@pytest.fixture(scope="session")
def small_pair(make_pair) -> tuple:
    """A random 12-token target and its drafter: small enough that random drafts are often accepted."""
    return make_pair(vocab=12, hidden=32, layers=4, heads=2, kv_heads=1, draft={"draft_vocab": 8})


@pytest.fixture(scope="session")
def demo_pair() -> tuple[str, str]:
    """The bundled demo pair: the small trained target and its trained drafter."""
    from specserve.config import DEMO_DIR

    return str(DEMO_DIR), str(DEMO_DIR / "draft")


@pytest.fixture
def fake_gpus(monkeypatch):
    """Replace NVML: each argument is (used MiB, total MiB) of one GPU."""
    from specserve.ops import nvml

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(*mem: tuple[float, float]) -> None:
        gpus = [
            nvml.Gpu(
                index=i,
                name="FakeGPU",
                uuid=f"GPU-fake-{i}",
                minor=i,
                memory_used_mib=u,
                memory_total_mib=t,
                utilization_pct=0,
            )
            for i, (u, t) in enumerate(mem)
        ]
        monkeypatch.setattr(nvml, "query", lambda processes=True: nvml.GpuQuery(True, "", "1.0", gpus))

    return install
