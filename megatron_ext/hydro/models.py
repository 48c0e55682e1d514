"""Plain (unfused) reference models: the small GPT and CNN that Hydro shrinks, fuses and tunes.

Written so that torch.fx traces them and the trial-major fused layout works unchanged: every
reshape takes its batch size from the input (``x.shape[0]``), and position ids are per sample.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

try:  # muP readout layer (1/width output multiplier); optional at import, required for parametrization="mup"
    from mup import MuReadout
except ImportError:  # pragma: no cover - mup is a pinned dependency
    MuReadout = None


@dataclasses.dataclass(kw_only=True)
class GPTShape:
    """Shape and parametrization of the small GPT."""
    vocab_size: int
    seq_len: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_mult: int = 4
    activation: str = "gelu"      # gelu | silu
    norm: str = "layernorm"       # layernorm | rmsnorm
    dropout: float = 0.0
    parametrization: str = "sp"   # sp | mup
    attn_mult: float = 1.0        # muP: attention scale is attn_mult / head_dim
    output_mult: float = 1.0      # muP: readout multiplier (divided by the width multiplier)
    # No attention biases by default: the key bias has an analytically zero gradient (softmax is
    # shift-invariant), so its float32 gradient is rounding noise that Adam's normalization turns
    # into full-size steps, and no two summation orders (fused or not) agree on that noise.
    attn_bias: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.activation not in ("gelu", "silu"):
            raise ValueError(f"activation must be gelu or silu, got {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be layernorm or rmsnorm, got {self.norm!r}")
        if self.parametrization not in ("sp", "mup"):
            raise ValueError(f"parametrization must be sp or mup, got {self.parametrization!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def attn_scale(self) -> float:
        # muP: 1/d (q and k align during training, so q.k grows like d, not sqrt(d)).
        if self.parametrization == "mup":
            return self.attn_mult / self.head_dim
        return 1.0 / math.sqrt(self.head_dim)


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit softmax scale."""

    def __init__(self, d_model: int, n_heads: int, scale: float, causal: bool = True, bias: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.d_model, self.n_heads, self.scale, self.causal = d_model, n_heads, scale, causal
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(n, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, activation: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.act = nn.GELU() if activation == "gelu" else nn.SiLU()
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _norm(kind: str, d: int) -> nn.Module:
    return nn.LayerNorm(d) if kind == "layernorm" else nn.RMSNorm(d, eps=1e-5)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln1 = _norm(shape.norm, shape.d_model)
        self.attn = SelfAttention(shape.d_model, shape.n_heads, shape.attn_scale(), bias=shape.attn_bias)
        self.ln2 = _norm(shape.norm, shape.d_model)
        self.mlp = MLP(shape.d_model, shape.ffn_mult * shape.d_model, shape.activation)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Small decoder-only GPT: ids ``[N, T]`` -> logits ``[N, T, V]``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos = nn.Embedding(shape.seq_len, shape.d_model)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.ln_f = _norm(shape.norm, shape.d_model)
        if shape.parametrization == "mup":
            if MuReadout is None:
                raise ImportError("parametrization='mup' needs the mup package (pip install mup==1.0.0)")
            self.head = MuReadout(shape.d_model, shape.vocab_size, output_mult=shape.output_mult)
        else:
            self.head = nn.Linear(shape.d_model, shape.vocab_size)
        # Embeddings keep torch's N(0, 1) init: constant in width (what muP wants for input
        # weights), and ``reset_parameters`` reproduces it, so re-seeding a copy re-inits it exactly.

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, t = idx.shape
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand(n, t)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class SmallCNN(nn.Module):
    """Conv-BN-ReLU x2, global pooling, linear classifier: images ``[N, C, H, W]`` -> logits."""

    def __init__(self, in_channels: int = 3, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        # No conv biases before BatchNorm: BN removes them, so their gradient is analytically zero
        # and Adam would turn its float32 rounding noise into full-size (and order-dependent) steps.
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        x = self.act(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))
