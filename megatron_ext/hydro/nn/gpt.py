"""A fused GPT built directly from fused layers (the hand-written twin of ``fuse_model(GPT)``).

Parameter names match ``hydro.models.GPT`` so ``from_plain`` is stacking and ``unfuse`` is indexing.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models import GPT, GPTShape
from .attention import FusedSelfAttention
from .base import FusedModule, load_stacked
from .dropout import FusedDropout
from .linear import FusedEmbedding, FusedLinear
from .norm import FusedLayerNorm, FusedRMSNorm


def _fused_norm(kind: str, B: int, d: int) -> FusedModule:
    return FusedLayerNorm(B, d) if kind == "layernorm" else FusedRMSNorm(B, d, eps=1e-5)


class FusedMLP(FusedModule):
    def __init__(self, num_trials: int, d_model: int, hidden: int, activation: str = "gelu") -> None:
        super().__init__()
        self.fc1 = FusedLinear(num_trials, d_model, hidden)
        self.act = nn.GELU() if activation == "gelu" else nn.SiLU()
        self.fc2 = FusedLinear(num_trials, hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FusedGPTBlock(FusedModule):
    def __init__(self, num_trials: int, shape: GPTShape) -> None:
        super().__init__()
        B = num_trials
        self.ln1 = _fused_norm(shape.norm, B, shape.d_model)
        self.attn = FusedSelfAttention(B, shape.d_model, shape.n_heads, shape.attn_scale(), bias=shape.attn_bias)
        self.ln2 = _fused_norm(shape.norm, B, shape.d_model)
        self.mlp = FusedMLP(B, shape.d_model, shape.ffn_mult * shape.d_model, shape.activation)
        self.drop = FusedDropout(B, shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class FusedGPT(FusedModule):
    """B GPTs of one shape: ids ``[B*N, T]`` (or ``[N, T]`` with ``shared_input``) -> ``[B*N, T, V]``."""

    def __init__(self, num_trials: int, shape: GPTShape, readout_mult: float = 1.0) -> None:
        super().__init__()
        B = num_trials
        self.shape = shape
        self.tok = FusedEmbedding(B, shape.vocab_size, shape.d_model)
        self.pos = FusedEmbedding(B, shape.seq_len, shape.d_model)
        self.drop = FusedDropout(B, shape.dropout)
        self.blocks = nn.ModuleList(FusedGPTBlock(B, shape) for _ in range(shape.n_layers))
        self.ln_f = _fused_norm(shape.norm, B, shape.d_model)
        self.head = FusedLinear(B, shape.d_model, shape.vocab_size, input_mult=readout_mult)

    @classmethod
    def from_plain(cls, plains: Sequence[GPT]) -> "FusedGPT":
        shape = plains[0].shape
        for i, p in enumerate(plains):
            if p.shape != shape:
                raise ValueError(f"trial {i} has shape {p.shape}, trial 0 has {shape}")
        mult = FusedLinear.from_plain([plains[0].head]).input_mult
        fused = cls(len(plains), shape, readout_mult=mult).to(plains[0].tok.weight.device, plains[0].tok.weight.dtype)
        load_stacked(fused, plains)
        for m in fused.modules():
            if isinstance(m, FusedDropout):
                m.p.fill_(shape.dropout)
        return fused

    def forward(self, idx: torch.Tensor, shared_input: bool = False) -> torch.Tensor:
        B = self.tok.weight.shape[0]
        if shared_input:
            idx = idx.repeat(B, 1)
        n, t = idx.shape
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand(n, t)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
