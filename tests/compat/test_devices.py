"""compat/devices.py: one meaning of ``auto`` for the device and the backend, for the process group
set-up, the checks before launch and the tuner alike."""
from __future__ import annotations

import pytest
import torch

from megatron_ext.compat.devices import resolve_backend, resolve_device


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_is_cuda_exactly_where_torch_sees_a_gpu_and_explicit_settings_stay(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == ("cuda" if cuda else "cpu")
    # What was asked for, GPU or not: the process group set-up refuses cuda without one.
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda") == "cuda"


def test_the_auto_backend_is_nccl_on_cuda_and_gloo_on_the_cpu():
    assert resolve_backend("auto", "cuda") == "nccl" and resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cuda") == "gloo" and resolve_backend("nccl", "cpu") == "nccl"


@pytest.mark.parametrize("call, message", [
    (lambda: resolve_device("gpu"), "device must be one of auto, cpu, cuda, got 'gpu'"),
    (lambda: resolve_backend("mpi", "cpu"), "distributed backend must be one of auto, gloo, nccl, got 'mpi'"),
    (lambda: resolve_backend("auto", "auto"), "resolve_backend: device must be a resolved device ('cpu' or "
                                              "'cuda'), got 'auto'"),
])
def test_a_value_outside_the_choices_is_refused_by_name(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value) == message


def test_the_process_group_set_up_resolves_auto_the_same_way(monkeypatch):
    from megatron_ext.config.run import parse_run_config
    from megatron_ext.runtime.distributed import device_and_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, backend = device_and_backend(parse_run_config([]).parallel)
    assert (device, backend) == (torch.device(resolve_device("auto")), resolve_backend("auto", "cpu"))
    with pytest.raises(RuntimeError, match="--device cuda requested but CUDA is not available"):
        device_and_backend(parse_run_config(["--device", "cuda"]).parallel)
