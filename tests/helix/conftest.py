import os
import sys

import pytest

# test_tiling.py and test_tiling_families.py still import helix_helpers by module name; every other
# module imports it as tests.helix.helix_helpers. This goes when they do too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own graphs with its own backend; no cache entries leak between tests.
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
