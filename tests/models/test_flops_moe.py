"""FLOPs model of mixture-of-experts layers against torch's FlopCounterMode, and the spec the live
run builds for each model family."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_ext.config.run import parse_run_config
from megatron_ext.models.flops import ModelSpec, microbatch_flops, spec_of_model


class MoEMLP(torch.nn.Module):
    """Router + top-k experts (SwiGLU or GELU), tokens dispatched by index as megatron permutes them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, e = spec.hidden_size, spec.expert_ffn, spec.num_experts
        self.spec = spec
        self.router = torch.nn.Linear(h, e, bias=False)
        width = f * (2 if spec.gated_linear_unit else 1)
        self.fc1 = torch.nn.ModuleList(torch.nn.Linear(h, width, bias=False) for _ in range(e))
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(f, h, bias=False) for _ in range(e))
        s = spec.shared_expert_ffn_hidden_size
        self.shared = None if not s else torch.nn.Sequential(
            torch.nn.Linear(h, s * (2 if spec.gated_linear_unit else 1), bias=False), torch.nn.Linear(s, h, bias=False))

    def act(self, y):
        return F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1] if self.spec.gated_linear_unit else F.gelu(y)

    def forward(self, x):
        probs, experts = torch.topk(self.router(x).softmax(-1), self.spec.moe_router_topk, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.spec.num_experts):
            rows, slot = (experts == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.act(self.fc1[e](x[rows]))
            out = out.index_add(0, rows, self.fc2[e](y) * probs[rows, slot, None])
        if self.shared is not None:     # every token, beside its top-k experts (Qwen2-MoE, DeepSeek)
            out = out + self.shared[1](self.act(self.shared[0](x)))
        return out


def counted_mlp(spec: ModelSpec, tokens: int, seed: int) -> tuple[int, int]:
    torch.manual_seed(seed)
    mlp = MoEMLP(spec)
    x = torch.randn(tokens, spec.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        loss = mlp(x).square().mean()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("shared", [0, 20])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moe_mlp_flops_are_exact_whatever_the_routing(glu, seed, shared):
    dense = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10, ffn_hidden_size=24,
                      gated_linear_unit=glu)
    moe = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10, ffn_hidden_size=24,
                    gated_linear_unit=glu, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12,
                    shared_expert_ffn_hidden_size=shared)
    tokens = 37
    fwd, bwd = counted_mlp(moe, tokens, seed)
    # Both specs share the attention projections, so the MoE MLP's share of the model's count is the
    # MoE spec's minus the dense spec's, plus the dense MLP (2 h ffn per matrix and token).
    dense_mlp = 2 * 16 * 24 * (3 if glu else 2)
    moe_fwd, moe_bwd = microbatch_flops(moe, [tokens], 1)
    dense_fwd, dense_bwd = microbatch_flops(dense, [tokens], 1)
    assert fwd == moe_fwd.linear + moe_fwd.expert - dense_fwd.linear + dense_mlp * tokens
    # Input and weight gradients: backward is twice the forward, as for every product.
    assert bwd == moe_bwd.linear + moe_bwd.expert - dense_bwd.linear + 2 * dense_mlp * tokens


def test_topk_and_the_shared_expert_are_checked():
    with pytest.raises(ValueError, match="moe_router_topk 5 must be between 1 and num_experts 4"):
        ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10, num_experts=4,
                  moe_router_topk=5)
    with pytest.raises(ValueError, match="shared_expert_ffn_hidden_size 16 needs to be >= 0, and 0 for a dense model"):
        ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10, shared_expert_ffn_hidden_size=16)


def test_live_spec_carries_gqa_swiglu_and_experts():
    llama = parse_run_config(["--config", "configs/llama3_tiny.yaml"]).model
    spec = spec_of_model(llama, 4096)
    assert (spec.num_query_groups, spec.gated_linear_unit, spec.ffn, spec.num_experts) == (2, True, 320, None)
    moe = parse_run_config(["--config", "configs/qwen3_moe_tiny.yaml"]).model
    spec = spec_of_model(moe, 4096)
    assert (spec.num_experts, spec.moe_router_topk, spec.expert_ffn) == (4, 2, 128)
    assert spec.shared_expert_ffn_hidden_size == 0
    shared = parse_run_config(["--config", "configs/qwen3_moe_tiny.yaml", "--moe-shared-expert-intermediate-size",
                               "96"]).model
    assert spec_of_model(shared, 4096).shared_expert_ffn_hidden_size == 96
    # Old traces (no MoE keys) still read.
    assert ModelSpec.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                                "vocab_size": 10}).num_experts is None


@pytest.mark.parametrize("glu", [False, True])
def test_an_expert_rank_does_the_flops_of_the_pairs_routed_to_it(glu):
    # Expert parallelism splits the experts into slices, one per rank: a slice's work is its
    # routed (token, expert) pairs times one expert's FLOPs per token, however skewed the routing.
    from megatron_ext.models.flops import layer_expert_flops_per_pair

    spec = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10, gated_linear_unit=glu,
                     num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12)
    torch.manual_seed(3)
    mlp = MoEMLP(spec)
    x = torch.randn(41, spec.hidden_size)
    with torch.no_grad():
        logits = mlp.router(x)
        logits[:, :2] += 1.5  # skew: most pairs go to experts 0 and 1 (EP rank 0 of two)
        _, experts = torch.topk(logits.softmax(-1), spec.moe_router_topk, dim=-1)
    per_rank = []
    for ep_rank in range(2):
        pairs = 0
        with FlopCounterMode(display=False) as counter:
            for e in range(2 * ep_rank, 2 * ep_rank + 2):
                rows, _ = (experts == e).nonzero(as_tuple=True)
                pairs += rows.numel()
                y = mlp.fc1[e](x[rows])
                y = F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1] if glu else F.gelu(y)
                mlp.fc2[e](y)
        per_rank.append(pairs)
        assert counter.get_total_flops() == layer_expert_flops_per_pair(spec) * pairs
    assert sum(per_rank) == 41 * 2 and per_rank[0] > 2 * per_rank[1]
    fwd, _ = microbatch_flops(spec, [41], 1, routed_pairs=per_rank[0])
    assert fwd.expert == layer_expert_flops_per_pair(spec) * per_rank[0]
