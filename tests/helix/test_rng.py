"""helix/rng.py: megatron's CUDA RNG-state setter runs outside Dynamo while Helix compiles on a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch

from megatron_ext.compat import megatron_cpu
from megatron_ext.helix import rng

random = importlib.import_module(rng.RANDOM_MODULE)


@pytest.fixture
def setter_calls(monkeypatch):
    """megatron's own setter (a CPU run earlier in this process may have put the CPU shim's in its
    place: taken out for the test, put back after). It hands its closure to ``_lazy_call``; record,
    for each call, whether Dynamo was tracing it (the closure itself needs CUDA, so it is not run)."""
    shimmed = megatron_cpu.applied()
    if shimmed:
        megatron_cpu.remove()
    seen: list[bool] = []
    monkeypatch.setattr(random, "_lazy_call", lambda cb: seen.append(torch.compiler.is_compiling()))
    try:
        yield seen
    finally:
        rng.remove()
        monkeypatch.undo()
        if shimmed:
            megatron_cpu.apply()


def _compiled_step():
    torch._dynamo.reset()

    def step(x, state):
        random._set_cuda_rng_state(state)
        return x * 2

    return torch.compile(step, backend="eager", dynamic=False)


def test_the_pinned_torch_still_calls_back_under_its_lock():
    # The deadlock's condition (pytorch/pytorch#182948). When a torch without it is pinned, this
    # fails: then apply() does nothing and helix/rng.py can go.
    assert rng.lazy_call_reenters()


def test_unwrapped_the_setter_is_traced_by_dynamo(setter_calls):
    # The control: without the wrapper Dynamo inlines megatron's setter and its _lazy_call.
    out = _compiled_step()(torch.ones(2), torch.zeros(4, dtype=torch.uint8))
    assert torch.equal(out, torch.full((2,), 2.0)) and setter_calls == [True]


def test_wrapped_the_setter_runs_eagerly_and_remove_restores_it(setter_calls):
    original = random._set_cuda_rng_state
    assert rng.apply() and rng.apply() and rng.applied()  # idempotent: wrapped once
    assert random._set_cuda_rng_state is not original
    assert random._set_cuda_rng_state.__wrapped__ is original  # torch._dynamo.disable's wrapper
    out = _compiled_step()(torch.ones(2), torch.zeros(4, dtype=torch.uint8))
    assert torch.equal(out, torch.full((2,), 2.0)) and setter_calls == [False]
    rng.remove()
    assert random._set_cuda_rng_state is original and not rng.applied()


def test_a_torch_that_no_longer_reenters_is_left_alone(monkeypatch):
    monkeypatch.setattr(rng, "lazy_call_reenters", lambda: False)
    original = random._set_cuda_rng_state
    assert rng.apply() is False and random._set_cuda_rng_state is original


def test_a_megatron_without_the_setter_is_an_error_naming_it(monkeypatch):
    monkeypatch.delattr(random, rng.SETTER)
    with pytest.raises(RuntimeError, match=r"megatron\.core\.tensor_parallel\.random\._set_cuda_rng_state is gone"):
        rng.apply()
    assert not rng.applied()
