"""Plain (unfused) reference models: the small GPT and CNN that Hydro shrinks, fuses and tunes.

Written so that torch.fx traces them and the trial-major fused layout works unchanged: every
reshape takes its batch size from the input (``x.shape[0]``), and position ids are per sample.

``GPT`` builds the two dense blocks of the runtime's model families (``models/families.py``):
``gpt`` (LayerNorm, GELU MLP, learned positions, biases) and ``llama`` (RMSNorm, SwiGLU, rotary
positions, grouped-query attention, no biases; ``llama_shape``). The flags mean what Megatron-LM's
do: ``swiglu`` is ``--swiglu`` (a gated unit with SiLU, three matrices), ``n_query_groups`` is
``--num-query-groups`` (query head i reads key/value group i // (heads / groups)), ``position=
"rope"`` is ``--position-embedding-type rope`` (megatron's default, non-interleaved rotation of
the two halves of each head) with ``rotary_base``, and ``bias=False`` is ``--disable-bias-linear``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.models.families import family_of, swiglu_ffn_hidden_size

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
    swiglu: bool = False          # MLP: silu(gate(x)) * fc1(x) -> fc2 (activation is then SiLU)
    ffn_hidden: int = 0           # MLP hidden size; 0 = ffn_mult * d_model
    n_query_groups: int = 0       # key/value heads (grouped-query attention); 0 = n_heads
    position: str = "learned"     # learned (a position embedding) | rope (rotary, in attention)
    rotary_base: float = 10000.0
    bias: bool = True             # biases of the MLP and readout linears (False: --disable-bias-linear)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.n_query_groups < 0 or (self.n_query_groups and self.n_heads % self.n_query_groups):
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_query_groups {self.n_query_groups}")
        if self.position not in ("learned", "rope"):
            raise ValueError(f"position must be learned or rope, got {self.position!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        if self.swiglu and self.activation != "silu":
            raise ValueError("swiglu gates with SiLU: set activation='silu'")
        if self.ffn_hidden < 0:
            raise ValueError(f"ffn_hidden must be >= 0, got {self.ffn_hidden}")
        if self.activation not in ("gelu", "silu"):
            raise ValueError(f"activation must be gelu or silu, got {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be layernorm or rmsnorm, got {self.norm!r}")
        if self.parametrization not in ("sp", "mup"):
            raise ValueError(f"parametrization must be sp or mup, got {self.parametrization!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_query_groups or self.n_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden or self.ffn_mult * self.d_model

    def model_flags(self) -> dict:
        """The run's ``ModelConfig`` fields this shape stands for (Megatron-LM's flags)."""
        return {"normalization": "RMSNorm" if self.norm == "rmsnorm" else "LayerNorm", "swiglu": self.swiglu,
                "group_query_attention": self.kv_heads != self.n_heads,
                "position_embedding_type": "rope" if self.position == "rope" else "learned_absolute",
                "disable_bias_linear": not self.bias, "qk_layernorm": False, "num_experts": None}

    @property
    def family(self) -> str:
        """The model family the runtime would build for these flags (``models.families.family_of``)."""
        import types

        return family_of(types.SimpleNamespace(**self.model_flags())).name

    @property
    def rope_base(self) -> float:
        """The rotary base attention uses; 0 = no rotary embedding."""
        return float(self.rotary_base) if self.position == "rope" else 0.0

    def attn_scale(self) -> float:
        # muP: 1/d (q and k align during training, so q.k grows like d, not sqrt(d)).
        if self.parametrization == "mup":
            return self.attn_mult / self.head_dim
        return 1.0 / math.sqrt(self.head_dim)


def llama_shape(*, vocab_size: int, seq_len: int, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                n_query_groups: int = 0, ffn_hidden: int = 0, rotary_base: float = 10000.0, **kw) -> GPTShape:
    """The LLaMA-style block: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no
    biases. ``ffn_hidden=0`` takes Megatron-LM's SwiGLU size, or 4 x d_model where that is 0."""
    ffn = ffn_hidden or swiglu_ffn_hidden_size(d_model) or 4 * d_model
    return GPTShape(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                    norm="rmsnorm", activation="silu", swiglu=True, ffn_hidden=ffn, n_query_groups=n_query_groups,
                    position="rope", rotary_base=rotary_base, bias=False, **kw)


_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotary_cos_sin(t: int, head_dim: int, base: float, device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[t, head_dim]`` of megatron's rotary embedding (frequencies in float32, as
    megatron computes them; float64 models get float64). Constants, cached per shape."""
    key = (t, head_dim, base, device, dtype)
    hit = _ROPE_CACHE.get(key)
    if hit is None:
        ft = torch.float64 if dtype == torch.float64 else torch.float32
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=ft, device=device) / head_dim))
        ang = torch.outer(torch.arange(t, dtype=ft, device=device), inv)
        emb = torch.cat([ang, ang], dim=-1)
        hit = (emb.cos().to(dtype), emb.sin().to(dtype))
        if len(_ROPE_CACHE) > 64:
            _ROPE_CACHE.clear()
        _ROPE_CACHE[key] = hit
    return hit


def apply_rotary(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x [n, heads, t, head_dim]`` by position: megatron's non-interleaved rotary embedding
    (``x * cos + rotate_half(x) * sin``, the halves of each head paired)."""
    cos, sin = rotary_cos_sin(x.shape[-2], x.shape[-1], base, x.device, x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(qkv: torch.Tensor, n_heads: int, kv_heads: int, scale: float, causal: bool, rope_base: float
           ) -> torch.Tensor:
    """The attention core on the fused ``qkv`` projection ``[n, t, (heads + 2 kv_heads) * head_dim]``
    -> ``[n, t, heads * head_dim]``. Shared by ``SelfAttention`` and its fused twin: it treats every
    row of the batch on its own, so B trials' rows need nothing fused."""
    n, t, width = qkv.shape
    hd = width // (n_heads + 2 * kv_heads)
    q, k, v = qkv.split([n_heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = q.reshape(n, t, n_heads, hd).transpose(1, 2)
    k, v = (z.reshape(n, t, kv_heads, hd).transpose(1, 2) for z in (k, v))
    if rope_base:
        q, k = apply_rotary(q, rope_base), apply_rotary(k, rope_base)
    if kv_heads != n_heads:   # query head i reads group i // (heads / groups), as megatron's GQA
        k, v = (z.repeat_interleave(n_heads // kv_heads, dim=1) for z in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return y.transpose(1, 2).reshape(n, t, n_heads * hd)


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit softmax scale, optionally with grouped
    key/value heads (``n_query_groups``) and rotary positions (``rotary_base > 0``)."""

    def __init__(self, d_model: int, n_heads: int, scale: float, causal: bool = True, bias: bool = True,
                 n_query_groups: int = 0, rotary_base: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        kv = n_query_groups or n_heads
        if n_heads % kv:
            raise ValueError(f"n_heads {n_heads} is not divisible by n_query_groups {kv}")
        self.d_model, self.n_heads, self.scale, self.causal = d_model, n_heads, scale, causal
        self.kv_heads, self.rotary_base = kv, float(rotary_base)
        hd = d_model // n_heads
        self.qkv = nn.Linear(d_model, d_model + 2 * kv * hd, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.qkv(x), self.n_heads, self.kv_heads, self.scale, self.causal, self.rotary_base))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=bias)
        self.act = nn.GELU() if activation == "gelu" else nn.SiLU()
        self.fc2 = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nn.Module):
    """``fc2(silu(gate(x)) * fc1(x))``: megatron's gated linear unit with SiLU (its ``linear_fc1``
    holds gate and fc1 side by side). Two separate matrices keep the product elementwise in the
    graph, so ``shrink_model`` sees that gate and fc1 share the hidden width."""

    def __init__(self, d_model: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.fc1 = nn.Linear(d_model, hidden, bias=bias)
        self.act = nn.SiLU()
        self.fc2 = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.gate(x)) * self.fc1(x))


def _norm(kind: str, d: int) -> nn.Module:
    return nn.LayerNorm(d) if kind == "layernorm" else nn.RMSNorm(d, eps=1e-5)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln1 = _norm(shape.norm, shape.d_model)
        self.attn = SelfAttention(shape.d_model, shape.n_heads, shape.attn_scale(), bias=shape.attn_bias,
                                  n_query_groups=shape.n_query_groups, rotary_base=shape.rope_base)
        self.ln2 = _norm(shape.norm, shape.d_model)
        self.mlp = (SwiGLU(shape.d_model, shape.ffn_size, shape.bias) if shape.swiglu
                    else MLP(shape.d_model, shape.ffn_size, shape.activation, shape.bias))
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
        self.pos = nn.Embedding(shape.seq_len, shape.d_model) if shape.position == "learned" else None
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.ln_f = _norm(shape.norm, shape.d_model)
        if shape.parametrization == "mup":
            if MuReadout is None:
                raise ImportError("parametrization='mup' needs the mup package (pip install mup==1.0.0)")
            self.head = MuReadout(shape.d_model, shape.vocab_size, bias=shape.bias, output_mult=shape.output_mult)
        else:
            self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=shape.bias)
        # Embeddings keep torch's N(0, 1) init: constant in width (what muP wants for input
        # weights), and ``reset_parameters`` reproduces it, so re-seeding a copy re-inits it exactly.

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:   # rotary positions live in attention instead
            n, t = idx.shape
            x = x + self.pos(torch.arange(t, device=idx.device).unsqueeze(0).expand(n, t))
        x = self.drop(x)
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
