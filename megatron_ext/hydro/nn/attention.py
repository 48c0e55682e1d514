"""Fused multi-head causal self-attention (trial dim folded into the batch: one SDPA call).

Grouped-query attention and rotary positions need nothing fused either: both act on each row
of the batch on its own (the shared core is ``models.attend``)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models import attend
from .base import FusedModule, check_same_config
from .linear import FusedLinear


class FusedSelfAttention(FusedModule):
    """B copies of ``hydro.models.SelfAttention``: fused ``qkv`` and ``proj`` projections; the
    attention core needs nothing fused because trials are separate rows of the batch.

    ``scale`` is the softmax temperature: muP uses ``attn_mult / head_dim`` so attention logits
    stay O(1) as width grows (query and key become correlated during training); standard
    parametrization uses ``1 / sqrt(head_dim)``.
    """

    def __init__(self, num_trials: int, d_model: int, n_heads: int, scale: float, causal: bool = True,
                 bias: bool = True, device=None, dtype=None, *, n_query_groups: int = 0,
                 rotary_base: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        kv = n_query_groups or n_heads
        if n_heads % kv:
            raise ValueError(f"n_heads {n_heads} is not divisible by n_query_groups {kv}")
        self.d_model, self.n_heads, self.scale, self.causal = d_model, n_heads, scale, causal
        self.kv_heads, self.rotary_base = kv, float(rotary_base)
        hd = d_model // n_heads
        self.qkv = FusedLinear(num_trials, d_model, d_model + 2 * kv * hd, bias, device=device, dtype=dtype)
        self.proj = FusedLinear(num_trials, d_model, d_model, bias, device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Module]) -> "FusedSelfAttention":
        check_same_config(plains, ("d_model", "n_heads", "kv_heads", "scale", "causal", "rotary_base"))
        p0 = plains[0]
        fused = cls.__new__(cls)
        FusedModule.__init__(fused)
        fused.d_model, fused.n_heads, fused.scale, fused.causal = p0.d_model, p0.n_heads, p0.scale, p0.causal
        fused.kv_heads, fused.rotary_base = p0.kv_heads, p0.rotary_base
        fused.qkv = FusedLinear.from_plain([p.qkv for p in plains])
        fused.proj = FusedLinear.from_plain([p.proj for p in plains])
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.qkv(x), self.n_heads, self.kv_heads, self.scale, self.causal, self.rotary_base))
