import pytest


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own graphs with its own backend; no cache entries leak between tests.
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
