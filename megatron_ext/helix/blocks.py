"""Model-parallel layers written with the traceable regions: the benchmark and test workloads.

* :class:`TPTransformerLayer` -- Megatron-style tensor-parallel transformer layer (attention +
  MLP, column/row-parallel linears, f/g conjugate regions): two all-reduces forward, two backward.
* :class:`MoELayer` -- expert-parallel mixture of experts: top-1 routing with a per-sequence
  expert capacity, all-to-all dispatch, one expert MLP per rank, all-to-all combine.
* :class:`TPEPLayer` -- a tensor-parallel attention block followed by an expert-parallel MoE
  block, so one dimension's communication can hide under the other's computation.

Activations are batch-first ``[b, s, h]``; weights are initialised from a seed and sliced by
rank, so every rank holds its shard of the same model.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.helix.collectives import (GroupRef, all_to_all, copy_to_tensor_parallel_region,
                                            reduce_from_tensor_parallel_region)


def _init(shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * std


class TPAttention(nn.Module):
    """Pre-norm self-attention with heads split over the tensor-parallel group."""

    def __init__(self, hidden: int, heads: int, tp: GroupRef, seed: int = 0) -> None:
        super().__init__()
        if heads % tp.size or hidden % heads:
            raise ValueError(f"heads {heads} must divide by tp {tp.size} and hidden {hidden} by heads")
        self.tp, self.heads, self.head_dim = tp, heads // tp.size, hidden // heads
        local = self.heads * self.head_dim
        self.norm = nn.LayerNorm(hidden)
        qkv = _init((3, heads * self.head_dim, hidden), seed)
        rows = slice(tp.rank * local, (tp.rank + 1) * local)
        self.qkv = nn.Parameter(qkv[:, rows].reshape(3 * local, hidden).clone())
        self.proj = nn.Parameter(_init((hidden, hidden), seed + 1)[:, rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = copy_to_tensor_parallel_region(self.norm(x), self.tp)
        q, k, v = F.linear(h, self.qkv).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return x + reduce_from_tensor_parallel_region(F.linear(a, self.proj), self.tp)


class TPMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, tp: GroupRef, seed: int = 10) -> None:
        super().__init__()
        if ffn % tp.size:
            raise ValueError(f"ffn {ffn} must divide by tp {tp.size}")
        local = ffn // tp.size
        cols = slice(tp.rank * local, (tp.rank + 1) * local)
        self.tp = tp
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Parameter(_init((ffn, hidden), seed)[cols].clone())
        self.fc2 = nn.Parameter(_init((hidden, ffn), seed + 1)[:, cols].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = copy_to_tensor_parallel_region(self.norm(x), self.tp)
        return x + reduce_from_tensor_parallel_region(F.linear(F.gelu(F.linear(h, self.fc1)), self.fc2), self.tp)


class TPTransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, tp: GroupRef, seed: int = 0) -> None:
        super().__init__()
        self.attn = TPAttention(hidden, heads, tp, seed)
        self.mlp = TPMLP(hidden, ffn, tp, seed + 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class MoELayer(nn.Module):
    """Top-1 mixture of experts, one expert per expert-parallel rank.

    Routing keeps at most ``capacity`` tokens per expert *per sequence*, so that the batch is the
    unit of routing (tokens of one sequence never compete with another's) -- which is what makes
    it tileable along the batch.
    """

    def __init__(self, hidden: int, ffn: int, ep: GroupRef, capacity: int, seed: int = 20) -> None:
        super().__init__()
        self.ep, self.experts, self.capacity = ep, ep.size, capacity
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Parameter(_init((self.experts, hidden), seed, std=0.5))
        self.fc1 = nn.Parameter(_init((self.experts, ffn, hidden), seed + 1)[ep.rank].clone())
        self.fc2 = nn.Parameter(_init((self.experts, hidden, ffn), seed + 2)[ep.rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hdim = x.shape
        e, c = self.experts, self.capacity
        h = self.norm(x)
        probs = torch.softmax(F.linear(h, self.router), dim=-1)               # [b, s, e]
        choice = probs.argmax(dim=-1)                                           # [b, s]
        onehot = (choice.unsqueeze(-1) == torch.arange(e, device=x.device)).to(x.dtype)
        slot = torch.cumsum(onehot, dim=1) * onehot - 1.0                       # position in expert queue
        keep = (slot < c).to(x.dtype) * onehot
        slots = (slot.unsqueeze(-1) == torch.arange(c, device=x.device, dtype=x.dtype)).to(x.dtype)
        dispatch = (keep.unsqueeze(-1) * slots).view(b, s, e * c)               # [b, s, e*c]
        combine = dispatch * (probs * keep).sum(dim=-1, keepdim=True)
        tokens = torch.matmul(dispatch.transpose(1, 2), h)                      # [b, e*c, h]
        tokens = tokens.view(b, e, c, hdim).transpose(0, 1).contiguous()        # [e, b, c, h]
        local = all_to_all(tokens, self.ep)                                     # [src rank, b, c, h]
        out = F.linear(F.gelu(F.linear(local, self.fc1)), self.fc2)
        back = all_to_all(out, self.ep).transpose(0, 1).reshape(b, e * c, hdim)
        return x + torch.matmul(combine, back)


class TPEPLayer(nn.Module):
    """Tensor-parallel attention, then an expert-parallel MoE."""

    def __init__(self, hidden: int, heads: int, ffn: int, tp: GroupRef, ep: GroupRef, capacity: int,
                 seed: int = 0) -> None:
        super().__init__()
        self.attn = TPAttention(hidden, heads, tp, seed)
        self.moe = MoELayer(hidden, ffn, ep, capacity, seed + 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.attn(x))


def attention_flops(b: int, s: int, hidden: int, tp: int) -> float:
    """Forward FLOPs of one rank's TPAttention (for sizing benchmarks)."""
    local = hidden / tp
    return 2 * b * s * hidden * 3 * local + 4 * b * s * s * local + 2 * b * s * local * hidden


def mlp_flops(b: int, s: int, hidden: int, ffn: int, tp: int) -> float:
    return 4 * b * s * hidden * ffn / tp


def capacity_for(s: int, experts: int, factor: float = 1.25) -> int:
    return max(1, math.ceil(factor * s / experts))
