"""``hydro.nn``: B trials in one module (see ``base`` for the layout and state invariants)."""
from .attention import FusedSelfAttention
from .base import FusedModule, expand_trials, resize_trials, trial_view, unfuse_state
from .conv import FusedConv2d
from .dropout import FusedDropout
from .gpt import FusedGPT, FusedGPTBlock, FusedMLP, FusedSwiGLU
from .linear import FusedEmbedding, FusedLinear
from .loss import fused_cross_entropy, fused_mse
from .norm import FusedBatchNorm, FusedLayerNorm, FusedRMSNorm

__all__ = [
    "FusedModule", "FusedLinear", "FusedEmbedding", "FusedLayerNorm", "FusedRMSNorm", "FusedBatchNorm",
    "FusedConv2d", "FusedDropout", "FusedSelfAttention", "FusedMLP", "FusedSwiGLU", "FusedGPTBlock", "FusedGPT",
    "fused_cross_entropy", "fused_mse", "expand_trials", "resize_trials", "trial_view", "unfuse_state",
]
