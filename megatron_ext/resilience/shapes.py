"""Model shapes of the seed's setting and what one token costs on them: FLOPs, parameters, bytes.

The shapes are the public Hugging Face ``config.json`` of each model (the source is named per
entry). The FLOPs are counted here, not taken from ResiHP's FLOPs model, so that the simulator that
scores ResiHP shares no formula with the planner that decides for it; ``tests/resilience`` checks
the two counts agree where they count the same thing (the dense projections).

Counting: 2 FLOPs per multiply-add; attention scores and the weighted sum over a packed document of
``L`` tokens cost ``4 * heads * head_dim * L**2`` with a full score matrix, and half of that with a
causal mask run by a flash kernel that skips masked blocks (what Megatron's fused attention does);
backward is twice the forward for projections and 2.5 times for flash attention (the scores are
recomputed). MoE layers route every token to ``topk`` experts (dropless) and through the shared
expert, if any.
"""
from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape, Megatron's names."""

    name: str
    source: str
    """Where the numbers come from."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    """Dense MLP width (SwiGLU: the gate and up projections each this wide); unused by MoE layers."""
    vocab_size: int
    num_experts: int | None = None
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"ModelShape {self.name!r}: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"ModelShape {self.name!r}: num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_query_groups {self.num_query_groups}")
        if self.num_experts is not None and not (1 <= self.moe_topk <= self.num_experts and self.moe_ffn_hidden_size > 0):
            raise ValueError(f"ModelShape {self.name!r}: an MoE shape needs 1 <= moe_topk <= num_experts and "
                             f"moe_ffn_hidden_size > 0, got topk {self.moe_topk}, experts {self.num_experts}, "
                             f"width {self.moe_ffn_hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    # ---- parameters ----

    def attention_params(self) -> float:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        return float(h * (q + 2 * kv) + q * h)

    def layer_params(self) -> float:
        """Parameters of one transformer layer (norms are noise at these sizes)."""
        h = self.hidden_size
        if not self.is_moe:
            return self.attention_params() + 3.0 * h * self.ffn_hidden_size
        return (self.attention_params() + h * self.num_experts + 3.0 * h * self.moe_ffn_hidden_size * self.num_experts
                + 3.0 * h * self.shared_expert_ffn_hidden_size)

    def embedding_params(self) -> float:
        """The input embedding (first stage) or the untied output layer (last stage), each."""
        return float(self.hidden_size * self.vocab_size)

    def total_params(self) -> float:
        return self.num_layers * self.layer_params() + 2 * self.embedding_params()

    # ---- FLOPs of one token / one squared document length ----

    def layer_linear_flops(self) -> float:
        """Forward FLOPs per token of one layer's projections (for MoE: router, the token's top-k
        experts and the shared expert)."""
        h = self.hidden_size
        if not self.is_moe:
            return 2.0 * (self.attention_params() + 3.0 * h * self.ffn_hidden_size)
        return 2.0 * (self.attention_params() + h * self.num_experts
                      + 3.0 * h * self.moe_ffn_hidden_size * self.moe_topk + 3.0 * h * self.shared_expert_ffn_hidden_size)

    def layer_attention_flops_per_sq(self) -> float:
        """Forward FLOPs of one layer's causal attention per squared document length."""
        return 2.0 * self.num_attention_heads * self.head_dim

    def head_flops(self) -> float:
        """Forward FLOPs per token of the output layer."""
        return 2.0 * self.hidden_size * self.vocab_size


BWD_LINEAR = 2.0
BWD_ATTENTION = 2.5

# Sources: the config.json of each model on the Hugging Face hub.
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape(name="llama2-7b", source="meta-llama/Llama-2-7b-hf config.json", num_layers=32, hidden_size=4096,
               num_attention_heads=32, num_query_groups=32, ffn_hidden_size=11008, vocab_size=32000),
    ModelShape(name="llama2-13b", source="meta-llama/Llama-2-13b-hf config.json", num_layers=40, hidden_size=5120,
               num_attention_heads=40, num_query_groups=40, ffn_hidden_size=13824, vocab_size=32000),
    ModelShape(name="llama2-70b", source="meta-llama/Llama-2-70b-hf config.json", num_layers=80, hidden_size=8192,
               num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672, vocab_size=32000),
    ModelShape(name="qwen2.5-14b", source="Qwen/Qwen2.5-14B config.json", num_layers=48, hidden_size=5120,
               num_attention_heads=40, num_query_groups=8, ffn_hidden_size=13824, vocab_size=152064),
    ModelShape(name="qwen2-57b-a14b", source="Qwen/Qwen2-57B-A14B config.json (MoE: 64 experts, top-8, "
               "shared expert)", num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
               ffn_hidden_size=18944, vocab_size=151936, num_experts=64, moe_topk=8, moe_ffn_hidden_size=2560,
               shared_expert_ffn_hidden_size=20480),
)}


def shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
