import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (specserve/model/kernels.py) run on CPU in Triton's interpreter; must be set
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
