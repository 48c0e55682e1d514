import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Two intra-op threads on a shared 2-core box make these tiny models 20-100x slower (OpenMP
    # workers spin while other processes hold the cores); one thread is also deterministic.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
