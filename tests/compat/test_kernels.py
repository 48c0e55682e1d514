"""compat/kernels.py: megatron's softmax fusion is on only on a GPU where apex's kernels import."""
from __future__ import annotations

import importlib.util

import pytest

from megatron_ext.compat import kernels
from megatron_ext.config.run import parse_run_config
from megatron_ext.runtime.model import build_transformer_config


def _find_spec_with(present: set[str]):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in kernels.APEX_SOFTMAX_MODULES:
            return importlib.util.spec_from_loader(name, loader=None) if name in present else None
        return real(name, *args, **kwargs)
    return find_spec


@pytest.mark.parametrize("present, fused_on_gpu", [
    (set(), False),                                            # no apex: the GPU machine that failed
    ({"scaled_masked_softmax_cuda"}, False),                   # one of three is not enough
    (set(kernels.APEX_SOFTMAX_MODULES), True),                 # apex built with its kernels
])
def test_softmax_fusion_follows_the_kernels(monkeypatch, present, fused_on_gpu):
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_with(present))
    assert kernels.apex_fused_softmax_available() is fused_on_gpu
    cfg = parse_run_config([])
    assert build_transformer_config(cfg, on_gpu=True).masked_softmax_fusion is fused_on_gpu
    # Never on CPU, kernels or not; the other GPU fusions do not depend on apex.
    assert build_transformer_config(cfg, on_gpu=False).masked_softmax_fusion is False
    assert build_transformer_config(cfg, on_gpu=True).bias_dropout_fusion is True


def test_this_machine_has_no_apex_kernels():
    # The suite's machines have no apex: the real lookup answers no (and the test above is the fake).
    assert kernels.apex_fused_softmax_available() is False
