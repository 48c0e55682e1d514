"""Which of megatron-core's optional compiled kernels this machine can import.

megatron's local layer spec (the one the runtime builds without Transformer Engine) computes the
attention softmax with ``FusedScaleMaskSoftmax``. With ``masked_softmax_fusion`` on and bf16/fp16
scores it imports apex's compiled kernels inside its forward (``megatron/core/fusions/
fused_softmax.py``, 0.16.1) without a guard, so a GPU machine without apex failed at the first
forward. The fusion is turned on only where all three import (``runtime/model.py``); elsewhere
megatron computes the same softmax unfused. Standard library only.
"""
from __future__ import annotations

import importlib.util

# The extensions megatron's fused_softmax.py imports: causal, masked and unmasked.
APEX_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                        "scaled_softmax_cuda")


def apex_fused_softmax_available() -> bool:
    """All of apex's fused-softmax extensions can be found on this Python's path."""
    return all(importlib.util.find_spec(name) is not None for name in APEX_SOFTMAX_MODULES)


def transformer_engine_available() -> bool:
    """Transformer Engine can be found on this Python's path (megatron's TE layer spec, fp8, its
    fused attention backends); whether it imports is the layer spec's to find out."""
    return importlib.util.find_spec("transformer_engine") is not None
