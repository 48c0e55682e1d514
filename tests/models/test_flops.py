"""The FLOPs model (models/flops.py) against torch's FlopCounterMode on real layers with per-document attention,
and an iteration's FLOPs from the model flags."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from megatron_ext.models.flops import (
    ModelSpec, doc_stats, microbatch_flops, model_iteration_flops, stage_cost, stage_costs, stage_layer_counts)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny ops: intra-op threads only contend with each other on a shared machine (30x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Layer(torch.nn.Module):
    """A GPT layer: fused QKV (GQA-capable), per-document causal attention, output projection, MLP."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, (spec.num_attention_heads + 2 * spec.groups) * d)
        self.proj = torch.nn.Linear(spec.num_attention_heads * d, h)
        self.fc1 = torch.nn.Linear(h, spec.ffn * (2 if spec.gated_linear_unit else 1))
        self.fc2 = torch.nn.Linear(spec.ffn, h)

    def attention(self, x, docs):
        a, g, d = self.spec.num_attention_heads, self.spec.groups, self.spec.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([a * d, g * d, g * d], dim=-1)
        outs, offset = [], 0
        for n in docs:  # block-diagonal: each document attends only to itself
            qd = q[offset:offset + n].view(n, a, d).transpose(0, 1)
            kd = k[offset:offset + n].view(n, g, d).transpose(0, 1).repeat_interleave(a // g, 0)
            vd = v[offset:offset + n].view(n, g, d).transpose(0, 1).repeat_interleave(a // g, 0)
            scores = qd @ kd.transpose(1, 2) / d ** 0.5
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            outs.append((probs @ vd).transpose(0, 1).reshape(n, a * d))
            offset += n
        return self.proj(torch.cat(outs))

    def forward(self, x, docs):
        x = x + self.attention(x, docs)
        y = self.fc1(self.norm2(x))
        if self.spec.gated_linear_unit:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return x + self.fc2(y)


class Stage(torch.nn.Module):
    def __init__(self, spec: ModelSpec, num_layers: int, first: bool, last: bool):
        super().__init__()
        self.spec, self.first, self.last = spec, first, last
        self.embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.layers = torch.nn.ModuleList(Layer(spec) for _ in range(num_layers))
        self.head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None

    def forward(self, inp, docs):
        x = self.embed(inp) if self.first else inp
        for layer in self.layers:
            # Reentrant, like megatron's full recompute: the whole layer forward runs again (the
            # non-reentrant variant stops early and skips the last product).
            x = checkpoint(layer, x, docs, use_reentrant=True) if self.spec.recompute else layer(x, docs)
        if self.last:
            return F.cross_entropy(self.head(x), torch.zeros(x.shape[0], dtype=torch.long))
        return x.square().mean()


def counted(spec: ModelSpec, docs, num_layers, first, last):
    torch.manual_seed(0)
    stage = Stage(spec, num_layers, first, last)
    tokens = sum(docs)
    inp = (torch.randint(0, spec.vocab_size, (tokens,)) if first
           else torch.randn(tokens, spec.hidden_size, requires_grad=True))
    with FlopCounterMode(display=False) as fwd_counter:
        loss = stage(inp, docs)
    with FlopCounterMode(display=False) as bwd_counter:
        loss.backward()
    return fwd_counter.get_total_flops(), bwd_counter.get_total_flops()


SPECS = {
    "mha": ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50),
    "gqa_swiglu": ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, gated_linear_unit=True, vocab_size=40),
    "kv_channels": ModelSpec(num_layers=2, hidden_size=24, num_attention_heads=2, kv_channels=16, vocab_size=30),
    "recompute": ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=20, recompute=True),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True), (True, True)])
def test_matches_flop_counter(name, first, last):
    spec = SPECS[name]
    docs = [5, 17, 1, 9]
    fwd, bwd = microbatch_flops(spec, docs, 2, first_stage=first, last_stage=last)
    ref_fwd, ref_bwd = counted(spec, docs, 2, first, last)
    assert fwd.total == ref_fwd
    assert bwd.total == ref_bwd


def test_attention_follows_sum_of_squares_not_tokens():
    spec = SPECS["mha"]
    one_long, many_short = [32], [8, 8, 8, 8]
    f_long, b_long = counted(spec, one_long, 1, False, False)
    f_short, b_short = counted(spec, many_short, 1, False, False)
    m_long, _ = microbatch_flops(spec, one_long, 1)
    m_short, _ = microbatch_flops(spec, many_short, 1)
    assert m_long.linear == m_short.linear  # same tokens
    assert m_long.attention == 4 * m_short.attention  # 32^2 vs 4 * 8^2
    assert f_long - f_short == m_long.total - m_short.total
    assert b_long - b_short == 2 * (m_long.attention - m_short.attention)


def test_flash_backward_matches_torch_sdpa_formulas():
    spec = ModelSpec(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     vocab_size=10, flash_attention=True)
    docs = [7, 3, 12]
    a, g, d = 4, 2, 8
    fwd_ref = sum(sdpa_flop_count((1, a, n, d), (1, g, n, d), (1, g, n, d)) for n in docs)
    bwd_ref = sum(sdpa_backward_flop_count((1, a, n, d), (1, a, n, d), (1, g, n, d), (1, g, n, d)) for n in docs)
    fwd, bwd = microbatch_flops(spec, docs, 1)
    assert fwd.attention == fwd_ref
    assert bwd.attention == bwd_ref


def test_tensor_parallel_divides_and_coefficients_agree():
    spec = SPECS["gqa_swiglu"]
    docs = [10, 20, 2]
    tokens, sq = doc_stats(docs)
    assert (tokens, sq) == (32.0, 504.0)
    full = stage_cost(spec, 3, last_stage=True)
    half = stage_cost(spec, 3, last_stage=True, tp=2)
    assert half.forward(tokens, sq).total * 2 == full.forward(tokens, sq).total
    f, b = microbatch_flops(spec, docs, 3, last_stage=True, tp=2)
    assert (f, b) == (half.forward(tokens, sq), half.backward(tokens, sq))


def test_stage_layout_places_embedding_and_head():
    spec = ModelSpec(num_layers=8, hidden_size=16, num_attention_heads=2, vocab_size=100)
    assert stage_layer_counts(8, 2, 2) == [[2, 2], [2, 2]]
    costs = stage_costs(spec, pp=2, vp=2)
    head = 2.0 * 16 * 100
    assert costs[1][1].fwd_per_token - costs[0][1].fwd_per_token == head  # last virtual stage only
    assert costs[1][0].fwd_per_token == costs[0][0].fwd_per_token
    with pytest.raises(ValueError, match=r"num_layers 8 is not divisible by pp \* vp = 3"):
        stage_layer_counts(8, 3)
    with pytest.raises(ValueError, match=r"layers \[\[3\], \[3\]\] hold 6 layers, the model has 8"):
        stage_costs(spec, pp=2, layers=[[3], [3]])


def test_spec_errors():
    with pytest.raises(ValueError, match="hidden_size 30 is not divisible by num_attention_heads 4; give kv_channels"):
        ModelSpec(num_layers=1, hidden_size=30, num_attention_heads=4, vocab_size=10)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_query_groups 3"):
        ModelSpec(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=3, vocab_size=10)
    with pytest.raises(ValueError, match="trace.jsonl:3: model: unknown key hidden"):
        ModelSpec.from_dict({"hidden": 3}, where="trace.jsonl:3: model")


def test_iteration_flops_follow_the_model_flags():
    import types

    model = types.SimpleNamespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                  ffn_hidden_size=128, group_query_attention=True, num_query_groups=2, swiglu=True,
                                  num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None)
    cfg = types.SimpleNamespace(model=model, training=types.SimpleNamespace(global_batch_size=4))
    h, d = 64, 16
    # Per layer: QKV with GQA (Q h x h, K and V h x (2 groups x 16)), output h x h, SwiGLU's three
    # h x ffn matrices; two layers, then the vocabulary head.
    per_token_fwd = 2 * (2 * h * (h + 2 * 2 * d) + 2 * h * h + 2 * h * 128 * 3) + 2 * h * 128
    attention_fwd = 2 * 4 * 4 * d * 32 * 32
    assert model_iteration_flops(cfg, 128) == pytest.approx(3 * 4 * (per_token_fwd * 32 + attention_fwd))
    # A mixture of experts counts its top-k experts per token (it was dropped before the family
    # registry gave the FLOPs shape): 4 experts of width 32, top-2, instead of the dense MLP.
    moe = types.SimpleNamespace(**{**vars(model), "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32})
    per_token_moe = 2 * (2 * h * (h + 2 * 2 * d) + 2 * h * h + 2 * h * 4 + 2 * 2 * h * 32 * 3) + 2 * h * 128
    assert model_iteration_flops(types.SimpleNamespace(model=moe, training=cfg.training), 128) == \
        pytest.approx(3 * 4 * (per_token_moe * 32 + attention_fwd))
