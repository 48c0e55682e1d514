"""The CPU shims the LLaMA-style and MoE models need do their job, and ``remove()`` undoes them."""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from megatron_ext.compat import megatron_cpu


@pytest.fixture
def applied():
    already = megatron_cpu.applied()
    megatron_cpu.apply()
    yield
    if not already:
        megatron_cpu.remove()


def _norm_config(**kw) -> types.SimpleNamespace:
    base = dict(layernorm_zero_centered_gamma=False, persist_layer_norm=False, sequence_parallel=False,
                memory_efficient_layer_norm=False, normalization="RMSNorm")
    return types.SimpleNamespace(**{**base, **kw})


def test_torch_norm_takes_sequence_parallel_and_marks_its_weights(applied):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(_norm_config(sequence_parallel=True), 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    plain = WrappedTorchNorm(_norm_config(), 8)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())


def test_torch_norm_refuses_sequence_parallel_without_the_shim():
    if megatron_cpu.applied():
        pytest.skip("shims applied by an earlier in-process test")
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(_norm_config(sequence_parallel=True), 8)


@pytest.mark.parametrize("normalization, torch_cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_torch_norm_takes_zero_centered_gamma(applied, normalization, torch_cls):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # --apply-layernorm-1p: the gain starts at zero and the norm scales by 1 + gain, so it computes
    # what the plain norm with gain 1 + g computes, under the same parameter names.
    norm = WrappedTorchNorm(_norm_config(layernorm_zero_centered_gamma=True, normalization=normalization), 8)
    plain = WrappedTorchNorm(_norm_config(normalization=normalization), 8)
    assert isinstance(norm, torch_cls) and not norm.weight.any()
    assert [n for n, _ in norm.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
        plain.weight.copy_(norm.weight + 1)
    assert torch.allclose(norm(x), plain(x))
    both = WrappedTorchNorm(_norm_config(layernorm_zero_centered_gamma=True, sequence_parallel=True), 8)
    assert all(getattr(p, "sequence_parallel", False) for p in both.parameters())


def test_alltoall_split_sizes_become_host_copies(applied):
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    splits = torch.tensor([3, 1])
    out = dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert out.tolist() == [3, 1] and not isinstance(out, torch.Tensor)
    splits[0] = 7  # a copy, as the GPU path's device-to-host copy is
    assert out.tolist() == [3, 1]
    assert dispatcher.maybe_move_tensor_to_cpu(splits) is splits
    streams = dispatcher.torch.cuda
    with streams.stream(streams.Stream()):
        streams.current_stream().wait_stream(None)
    streams.Stream().record_event().synchronize()


def test_router_gemm_name_exists_and_is_removed_again():
    if megatron_cpu.applied():
        pytest.skip("shims applied by an earlier in-process test")
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    had = hasattr(moe_utils, "te_general_gemm")
    megatron_cpu.apply()
    try:
        assert moe_utils.te_general_gemm is None or had
    finally:
        megatron_cpu.remove()
    assert hasattr(moe_utils, "te_general_gemm") == had
