"""Fused multi-head causal self-attention (trial dim folded into the batch: one SDPA call)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

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
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.d_model, self.n_heads, self.scale, self.causal = d_model, n_heads, scale, causal
        self.qkv = FusedLinear(num_trials, d_model, 3 * d_model, bias, device=device, dtype=dtype)
        self.proj = FusedLinear(num_trials, d_model, d_model, bias, device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Module]) -> "FusedSelfAttention":
        check_same_config(plains, ("d_model", "n_heads", "scale", "causal"))
        p0 = plains[0]
        fused = cls.__new__(cls)
        FusedModule.__init__(fused)
        fused.d_model, fused.n_heads, fused.scale, fused.causal = p0.d_model, p0.n_heads, p0.scale, p0.causal
        fused.qkv = FusedLinear.from_plain([p.qkv for p in plains])
        fused.proj = FusedLinear.from_plain([p.proj for p in plains])
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(n, t, d))
