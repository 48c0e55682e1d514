import os
import sys

import pytest
import torch

# pytest runs with --import-mode=importlib (no test dir on sys.path): make helix_helpers importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # One intra-op thread: deterministic, and far faster on a shared 2-core box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own graphs with its own backend; no cache entries leak between tests.
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
