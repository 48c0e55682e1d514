import os
import sys

import pytest
import torch

# pytest runs with --import-mode=importlib (no test dir on sys.path): make hydro_helpers importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # Two intra-op threads on a shared 2-core box make these tiny models 20-100x slower (OpenMP
    # workers spin while other processes hold the cores); one thread is also deterministic.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
