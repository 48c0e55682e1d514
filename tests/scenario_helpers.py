"""What the multi-rank scenario scripts share: the tiny model they train and the gather of the
logging rank's values.

A scenario script is launched as a file (torchrun, ``tests/warm_run.py``), so Python puts its own
folder first on ``sys.path``, not the repository root; each script puts the root there before it
imports from ``tests``::

    ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, ROOT)
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_ext.config.defaults import FORMER_DEFAULTS

TINY = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "global_batch_size": 8,
        "micro_batch_size": 2, "eval_iters": 0, "progress": False,
        **FORMER_DEFAULTS, "split": "949,50,1", "log_interval": 1}
"""The tiny GPT every scenario starts from: the config's default model and batch (4 layers, hidden size
64, 4 heads, 64 tokens; 8 sequences an iteration in micro-batches of 2), no dropout and the
optimizer's defaults of before Megatron-LM's (FORMER_DEFAULTS), no validation, no progress
lines, the default corpus split 949,50,1 (the split every scenario was written with; Megatron-LM's default
is 969,30,1), the extensions' per-log-interval figures (bubbles, the squeezer's) every iteration
(--log-interval 1, as every scenario was written with; Megatron-LM's default is 100). A scenario
states only what it changes: ``{**TINY, "num_layers": 8}``."""

CURVE = {**TINY, "train_iters": 10, "lr_decay_style": "constant", "lr": 2e-3}
"""The loss-curve runs of tests/runtime and tests/deepspeed_patches (their single-rank megatron
references included): 10 iterations at a constant learning rate of 2e-3."""

LLAMA_STYLE = {"group_query_attention": True, "num_query_groups": 2, "normalization": "RMSNorm", "swiglu": True,
               "position_embedding_type": "rope", "disable_bias_linear": True}
"""The LLaMA-style family's switches over any sizes: grouped-query attention (2 key/value groups),
RMSNorm, SwiGLU, rotary positions, no biases."""

TIMELINE = {**TINY, "train_iters": 3, "micro_batch_size": 1, "num_layers": 8, "timeline": True}
"""The timeline scenarios of tests/pipeline and tests/deepspeed_patches: 3 iterations of 8 layers (two
a stage under PP4), one sequence a micro-batch, the config's default learning rate and decay."""


def from_logging_rank(ctx, mine: Any) -> Any:
    """``mine`` of the logging rank (``ctx.is_logging_rank``: the last stage's, where the loss is), on
    every rank; what the other ranks pass is dropped. A collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine if ctx.is_logging_rank else None)
    return next(c for c in out if c is not None)


def curve(trainer, key: str = "loss") -> list:
    """``key`` of every train iteration in the logging rank's history (the loss by default), on every
    rank. A collective: every rank calls it."""
    mine = [h.get(key) for h in trainer.history if h["kind"] == "train"] if trainer.ctx.is_logging_rank else None
    return from_logging_rank(trainer.ctx, mine)
