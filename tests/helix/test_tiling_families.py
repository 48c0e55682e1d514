"""Tiling rules for the LLaMA-style and MoE blocks (RMSNorm, rotary embeddings, GQA's repeat of K/V,
SwiGLU, router top-k, capacity dropping, token sorting/selection, gradient attachments): tiled
forward and backward equal the original; what mixes rows across the batch is joined, with the reason.

Rotary embeddings and the router's routing and token dropping are megatron-core's own functions."""
import logging

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.helix import HelixBackend
from megatron_ext.helix.collectives import reduce_from_tensor_parallel_region
from tests.helix.helix_helpers import fake_world, parity, tiling_backend

S, B, H, HEADS, GROUPS = 8, 4, 32, 4, 2


def _compile(fn, inputs, params=(), **kw):
    reports = []
    compiled = torch.compile(fn, backend=tiling_backend(2, reports, **kw))
    err = parity(fn, compiled, list(inputs), list(params))
    assert err["missing_grads"] == 0
    assert err["out"] < 1e-5 and err["grad"] < 1e-4, err  # as the GPT-block tests (float32 sums)
    return reports[0][1]


class LlamaBlock(torch.nn.Module):
    """The LLaMA-style layer's ops on megatron's [s, b, ...] layout: RMSNorm, rotary embeddings
    (megatron-core's), grouped-query attention with K/V repeated per query head as megatron's
    DotProductAttention does, SwiGLU as megatron's MLP computes it."""

    def __init__(self):
        super().__init__()
        d = H // HEADS
        self.norm = torch.nn.RMSNorm(H)
        self.q_norm = torch.nn.RMSNorm(d)
        self.qkv = torch.nn.Linear(H, (HEADS + 2 * GROUPS) * d, bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.fc1 = torch.nn.Linear(H, 2 * 48, bias=False)
        self.fc2 = torch.nn.Linear(48, H, bias=False)
        inv = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(S).float(), inv)
        self.register_buffer("freqs", torch.cat([freqs, freqs], dim=-1)[:, None, None, :])

    def forward(self, x):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        s, b, _ = x.shape
        d = H // HEADS
        qkv = self.qkv(self.norm(x)).view(s, b, GROUPS, (HEADS // GROUPS + 2) * d)
        q, k, v = torch.split(qkv, [HEADS // GROUPS * d, d, d], dim=3)
        q = self.q_norm(q.reshape(s, b, HEADS, d))
        q, k = _apply_rotary_pos_emb_bshd(q, self.freqs), _apply_rotary_pos_emb_bshd(k, self.freqs)
        k = k.repeat_interleave(HEADS // GROUPS, dim=2)
        v = v.repeat_interleave(HEADS // GROUPS, dim=2)
        a = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                           is_causal=True)
        h = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, H))
        gate, up = torch.chunk(self.fc1(self.norm(h)), 2, dim=-1)
        return h + self.fc2(F.silu(gate) * up)


def test_llama_block_ops_tile_without_a_join():
    torch.manual_seed(0)
    m = LlamaBlock()
    report = _compile(m, [torch.randn(S, B, H, requires_grad=True)], m.parameters(), batch_size=B)
    assert report.tiled_inputs == {"l_x_": 1}
    assert report.joins == []


@pytest.mark.parametrize("fn, why", [
    (lambda x: x.repeat_interleave(2, dim=1), "repeats along the tile dim 1"),
    (lambda x: x.repeat(1, 2, 1), "repeats along the tile dim (2 times)"),
])
def test_repeating_along_the_tile_dim_is_joined(fn, why):
    report = _compile(lambda x: fn(x * 2) + 1, [torch.randn(S, B, H, requires_grad=True)], batch_size=B)
    assert [j[2] for j in report.joins] == [why]


def test_kv_expand_and_repeat_along_the_heads_tile():
    def fn(k):  # [s, b, g, d] -> [s, b, g * r, d], by expand + reshape and by repeat
        s, b, g, d = k.shape
        e = k.unsqueeze(3).expand(s, b, g, 2, d).reshape(s, b, g * 2, d)
        return e + k.repeat(1, 1, 2, 1)

    report = _compile(fn, [torch.randn(S, B, GROUPS, 8, requires_grad=True)], batch_size=B)
    assert report.joins == []


def _routing(logits):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs, routing_map = topk_routing_with_score_function(logits * 1.0, 2, score_function="softmax")
    return probs, routing_map.float()


def test_router_top_k_is_per_token():
    # megatron's top-k routing on batch-major tokens: softmax, top-k and the scatters of the
    # probabilities and the routing map work within each token's row.
    report = _compile(_routing, [torch.randn(B * S, 4, requires_grad=True)])
    assert report.joins == [] and report.tiled_calls > 5


def test_capacity_dropping_over_the_batch_is_joined_never_changed():
    # A capacity per expert over all tokens of the micro-batch keeps the top tokens of each expert
    # column: tiles compete for the same slots, so the tiles are joined before the selection and
    # the drops are the untiled graph's.
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    def fn(logits):
        probs, routing_map = _routing(logits)
        probs, kept = apply_router_token_dropping(probs, routing_map.bool(), router_topk=2, capacity_factor=0.5)
        return probs, kept.float()

    logits = torch.randn(B * S, 4, requires_grad=True)
    report = _compile(fn, [logits])
    assert ("torch.topk", "selects the top k along the tile dim 0 (over the whole batch)") in \
        [(op, why) for _, op, why in report.joins]
    _, kept = fn(logits)
    assert 0 < kept.sum() < 2 * B * S  # the capacity dropped tokens


@pytest.mark.parametrize("fn, op, why", [
    (lambda x: x[torch.argsort(x[:, 0])], "torch.argsort", "sorts along the tile dim 0: the order mixes tiles"),
    (lambda x: x.index_select(0, torch.arange(x.shape[0] - 1, -1, -1)), "method.index_select",
     "selects rows along the tile dim 0: an index may point into another tile"),
])
def test_token_permutations_across_the_batch_are_joined(fn, op, why):
    report = _compile(lambda x: fn(x * 2) * 3, [torch.randn(B * S, H, requires_grad=True)])
    assert (op, why) in [(o, w) for _, o, w in report.joins]


def test_token_sorting_and_selection_within_rows_tile():
    def fn(x):
        values, order = torch.sort(x, dim=-1, descending=True)
        top = x.index_select(1, torch.arange(3))
        return values * 2 + torch.gather(x, 1, order) + top.sum(-1, keepdim=True)

    assert _compile(fn, [torch.randn(B * S, H, requires_grad=True)]).joins == []


def test_scatter_with_a_broadcast_index_is_refused():
    def fn(x):  # one row of indices for a [T, E] tensor: scatter does not broadcast it
        return torch.zeros_like(x).scatter(0, torch.zeros(1, x.shape[1], dtype=torch.long), x[:1] * 2) + x

    report = _compile(fn, [torch.randn(B * S, 4, requires_grad=True)])
    assert any(op == "method.scatter" for _, op, _ in report.joins), report.joins


def test_group_norm_tiles_only_along_the_batch():
    gn = torch.nn.GroupNorm(2, 8)
    assert _compile(gn, [torch.randn(B, 8, 6, requires_grad=True)], gn.parameters()).joins == []
    report = _compile(gn, [torch.randn(B, 8, 6, requires_grad=True)], gn.parameters(), input_dims={"l_args_0_": 1})
    assert [j[2] for j in report.joins] == ["group norm normalises over dim 1, the tile dim"]


@pytest.fixture()
def aux_scale():
    """megatron's global MoE aux-loss scale, restored after the test."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    old = MoEAuxLossAutoScaler.main_loss_backward_scale
    yield MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.main_loss_backward_scale = old


def test_a_gradient_attachment_counts_the_aux_gradient_once(aux_scale):
    # The router attaches its load-balancing loss to the probabilities (identity forward, the loss
    # gets megatron's scale as gradient). Per tile it attaches once; the scale is read when the
    # backward runs (megatron's schedule sets it after the forward).
    from megatron_ext.helix.adapter_moe import _AttachAuxLoss

    w = torch.nn.Parameter(torch.randn(H, 4))

    def fn(x):
        probs = torch.softmax(x @ w, dim=-1)
        aux = (probs.mean(0) ** 2).sum()      # over the batch: joined, exact
        return _AttachAuxLoss.apply(probs, aux) * 3

    x = torch.randn(B * S, H, requires_grad=True)
    reports = []
    compiled = torch.compile(fn, backend=tiling_backend(2, reports))
    grads = {}
    for name, f in (("eager", fn), ("tiled", compiled)):
        aux_scale.main_loss_backward_scale = torch.ones(1)
        x.grad = w.grad = None
        out = f(x)
        aux_scale.set_loss_scale(torch.full((1,), 0.25))  # in place, between forward and backward
        out.sum().backward()
        grads[name] = (x.grad.clone(), w.grad.clone())
    report = reports[0][1]
    assert [op for _, op, _ in report.joins] == ["method.mean"]
    for a, b in zip(grads["eager"], grads["tiled"]):
        assert (a - b).abs().max() < 1e-5
    # the aux loss did contribute: without it the router weight's gradient differs
    x.grad = w.grad = None
    (torch.softmax(x @ w, dim=-1) * 3).sum().backward()
    assert (w.grad - grads["eager"][1]).abs().max() > 1e-4


class _SideGradient(torch.autograd.Function):
    """Identity forward, but the second input's gradient depends on the output gradient: not an
    attachment -- tile 0 alone would see a part of it."""

    @staticmethod
    def forward(ctx, x, y):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, g.mean()


def test_a_side_gradient_that_reads_the_output_gradient_is_not_attached_once():
    w = torch.nn.Parameter(torch.randn(H, 4))

    def fn(x):
        h = x @ w
        return _SideGradient.apply(h, h.sum()) * 2

    report = _compile(fn, [torch.randn(B * S, H, requires_grad=True)], [w])
    assert any(op == "higher_order.autograd_function_apply" for _, op, _ in report.joins), report.joins


def test_a_declined_graph_names_the_op_without_a_rule(caplog):
    with fake_world(0) as g:
        w = torch.nn.Parameter(torch.randn(H, H))

        def fn(x):
            h = reduce_from_tensor_parallel_region(x @ w, g)
            return torch.kthvalue(h, 2, dim=-1).values

        be = HelixBackend(2, interconnect="cross_node")
        caplog.set_level(logging.INFO, logger="megatron_ext.helix.compiler")
        torch.compile(fn, backend=be)(torch.randn(B, S, H, requires_grad=True)).sum().backward()
    s = be.summaries[0]
    assert "no tiling rule for torch.kthvalue (1 call)" in s.refused
    assert "no tiling rule for torch.kthvalue (1 call)" in caplog.text


def test_the_compute_only_copy_keeps_gathered_and_scattered_shapes():
    # The whole-graph timing of the calibrated cost model runs the graphs without collectives; a
    # gather's output is group-size times its input, a reduce-scatter's a chunk of it.
    from megatron_ext.helix.calibrate import compute_only_copy
    from megatron_ext.helix.collectives import (gather_from_sequence_parallel_region,
                                                reduce_scatter_to_sequence_parallel_region)

    graphs = []

    def grab(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    with fake_world(0) as g:
        w = torch.nn.Parameter(torch.randn(H, H))

        def fn(x):  # SP region: [s/2, b, h] -> gather [s, b, h] -> linear -> reduce-scatter [s/2, b, h]
            full = gather_from_sequence_parallel_region(x, g)
            return reduce_scatter_to_sequence_parallel_region(full @ w, g), full * 2

        out, full = torch.compile(fn, backend=grab)(torch.randn(S // 2, B, H, requires_grad=True))
        (out.sum() + full.sum()).backward()
    for gm in graphs:
        copy = compute_only_copy(gm)
        args = [torch.randn(n.meta["val"].shape) for n in copy.graph.nodes if n.op == "placeholder"]
        outs = copy(*args)
        want = [n.meta["val"].shape for n in gm.graph.find_nodes(op="output")[0].args[0] if n is not None]
        assert [o.shape for o in outs if o is not None] == want


def test_moe_features_the_static_dispatch_lacks_are_refused_by_name():
    import types

    from megatron_ext.helix.adapter_moe import make_moe_traceable

    class SequentialMLP:
        pass

    class TEGroupedMLP:
        pass

    class TopKRouter:
        routing_type = "aux_loss"

    cfg = types.SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_z_loss_coeff=None)
    layer = types.SimpleNamespace(config=cfg, router=TopKRouter(), experts=SequentialMLP(), use_shared_expert=False)
    from megatron_ext.helix.adapter_moe import _refusals

    assert _refusals(layer) == []
    cfg.moe_token_dispatcher_type, cfg.moe_z_loss_coeff = "flex", 1e-3
    layer.experts, layer.use_shared_expert = TEGroupedMLP(), True
    layer.router.routing_type = "seq_aux_loss"
    with pytest.raises(ValueError) as exc:
        make_moe_traceable("decoder.layers.0.mlp", layer)
    assert str(exc.value) == (
        "helix adapter: decoder.layers.0.mlp (MoELayer) uses --moe-token-dispatcher-type flex, shared experts, "
        "TEGroupedMLP experts (grouped GEMM); use the local spec's SequentialMLP, --moe-router-load-balancing-type "
        "seq_aux_loss, moe_z_loss_coeff, which the traceable MoE dispatch does not implement -- turn it off for --helix")
