import os
import sys

import pytest

# pytest runs with --import-mode=importlib (no test dir on sys.path): make helix_helpers importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own graphs with its own backend; no cache entries leak between tests.
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
