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
    def __init__(self, num_trials: int, d_model: int, hidden: int, activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        self.fc1 = FusedLinear(num_trials, d_model, hidden, bias)
        self.act = nn.GELU() if activation == "gelu" else nn.SiLU()
        self.fc2 = FusedLinear(num_trials, hidden, d_model, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FusedSwiGLU(FusedModule):
    """B copies of ``hydro.models.SwiGLU``: the gate product is elementwise, so only the three
    matrices are fused."""

    def __init__(self, num_trials: int, d_model: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.gate = FusedLinear(num_trials, d_model, hidden, bias)
        self.fc1 = FusedLinear(num_trials, d_model, hidden, bias)
        self.act = nn.SiLU()
        self.fc2 = FusedLinear(num_trials, hidden, d_model, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.gate(x)) * self.fc1(x))


class FusedGPTBlock(FusedModule):
    def __init__(self, num_trials: int, shape: GPTShape) -> None:
        super().__init__()
        B = num_trials
        self.ln1 = _fused_norm(shape.norm, B, shape.d_model)
        self.attn = FusedSelfAttention(B, shape.d_model, shape.n_heads, shape.attn_scale(), bias=shape.attn_bias,
                                       n_query_groups=shape.n_query_groups, rotary_base=shape.rope_base)
        self.ln2 = _fused_norm(shape.norm, B, shape.d_model)
        self.mlp = (FusedSwiGLU(B, shape.d_model, shape.ffn_size, shape.bias) if shape.swiglu
                    else FusedMLP(B, shape.d_model, shape.ffn_size, shape.activation, shape.bias))
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
        self.pos = FusedEmbedding(B, shape.seq_len, shape.d_model) if shape.position == "learned" else None
        self.drop = FusedDropout(B, shape.dropout)
        self.blocks = nn.ModuleList(FusedGPTBlock(B, shape) for _ in range(shape.n_layers))
        self.ln_f = _fused_norm(shape.norm, B, shape.d_model)
        self.head = FusedLinear(B, shape.d_model, shape.vocab_size, shape.bias, input_mult=readout_mult)

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
        x = self.tok(idx)
        if self.pos is not None:
            n, t = idx.shape
            x = x + self.pos(torch.arange(t, device=idx.device).unsqueeze(0).expand(n, t))
        x = self.drop(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
