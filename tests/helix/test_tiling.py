"""Tiling pass: sound rules, tiled forward *and* backward equal to the original, logged refusals."""
import logging

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.helix.passes.tiling_rules import Refuse
from megatron_ext.helix.passes.tiling_shape_rules import reshape_tile_dim
from tests.helix.helix_helpers import parity, tiling_backend


@pytest.mark.parametrize("src, dst, d, want", [
    ((8, 16, 32), (128, 32), 0, 0),        # flatten with the tile dim outermost: blocks stay contiguous
    ((8, 16, 32), (8, 512), 0, 0),
    ((32, 4), (8, 4, 4), 0, 0),            # split the tile dim: its outer factor carries the tiles
    ((2, 8, 16), (2, 8, 4, 4), 1, 1),
    ((1, 8, 16), (8, 16), 1, 0),           # size-1 dims do not count
])
def test_reshape_keeps_the_tile_dim_when_blocks_stay_contiguous(src, dst, d, want):
    assert reshape_tile_dim(src, dst, d, 2) == want


@pytest.mark.parametrize("src, dst, d, message", [
    ((16, 8, 32), (128, 32), 1, "reshape (16, 8, 32) -> (128, 32) mixes the tile dim 1 with outer dims"),
    ((6, 4), (3, 8), 0, "reshape puts the tile dim into a dim of size 3, not divisible by 2"),
])
def test_reshape_refuses_to_mix_tiles(src, dst, d, message):
    with pytest.raises(Refuse) as exc:
        reshape_tile_dim(src, dst, d, 2)
    assert str(exc.value) == message


class Block(torch.nn.Module):
    """Exercises the rules: linear, layer norm, views/permutes, attention, max, chunk, indexing,
    cat, embedding, gather, softmax, broadcasting with a shared input."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(32, 16)

    def forward(self, ids, x, bias):
        b, s = ids.shape
        h = self.norm(x + self.emb(ids)) + bias                         # bias: [1, s, 16], broadcast
        q, k, v = self.lin(h).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # [b, 2, s, 8]
        a = a.transpose(1, 2).reshape(b, s, 16)
        m, _ = a.max(dim=-1, keepdim=True)
        left, right = torch.cat([a - m, a], dim=-1).chunk(2, dim=-1)
        y = self.out(torch.cat([left, right], -1))
        probs = torch.softmax(y, dim=-1)
        picked = probs.gather(-1, (ids % 16).unsqueeze(-1))
        return y[:, :, :8] * picked + probs.sum(-1, keepdim=True)


def test_tiled_graph_matches_the_original_forward_and_backward():
    torch.manual_seed(0)
    m = Block()
    ids = torch.randint(0, 50, (4, 6))
    x = torch.randn(4, 6, 16, requires_grad=True)
    bias = torch.randn(1, 6, 16, requires_grad=True)
    reports = []
    compiled = torch.compile(m, backend=tiling_backend(2, reports))
    err = parity(m, compiled, [ids, x, bias], list(m.parameters()))
    tiled, report = reports[0]
    assert report.tiled_inputs == {"l_ids_": 0, "l_x_": 0}
    assert report.joins == [], report.joins
    assert report.tiled_calls > 20
    assert err["missing_grads"] == 0
    assert err["out"] < 1e-5 and err["grad"] < 1e-4, err
    # Every tiled call carries its stream; there are exactly two streams.
    tiles = {n.meta["custom"]["helix_tile"] for n in tiled.graph.nodes if "helix_tile" in n.meta.get("custom", {})}
    assert tiles == {0, 1}


def test_a_call_without_a_rule_joins_the_tiles_and_logs_why(caplog):
    def fn(x, w):
        h = torch.relu(x @ w)
        s = torch.kthvalue(h, 2, dim=-1).values  # no tiling rule: tiles joined before it
        return (s * 2).sum(0)                 # untiled region after the join

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8))
    reports = []
    caplog.set_level(logging.INFO, logger="megatron_ext.helix.passes.tiling")
    compiled = torch.compile(fn, backend=tiling_backend(2, reports))
    err = parity(fn, compiled, [x, w], [])
    _, report = reports[0]
    assert [(op, why) for _, op, why in report.joins] == [("torch.kthvalue", "no tiling rule for torch.kthvalue")]
    assert "joining 2 tiles before kthvalue (torch.kthvalue): no tiling rule for torch.kthvalue" in caplog.text
    assert err["out"] < 1e-5 and err["grad"] < 1e-5


def test_a_reduction_over_the_tile_dim_is_refused_not_mis_tiled():
    def fn(x):
        return torch.softmax(x, dim=0) * x.mean()

    x = torch.randn(4, 3, requires_grad=True)
    reports = []
    compiled = torch.compile(fn, backend=tiling_backend(2, reports))
    err = parity(fn, compiled, [x], [])
    whys = sorted(why for _, _, why in reports[0][1].joins)
    assert whys == ["reduces over every dim, including the tile dim", "reduces/scans along the tile dim 0"]
    assert err["out"] < 1e-6 and err["grad"] < 1e-6


def test_inputs_to_tile_are_chosen_by_batch_size_or_named():
    def fn(h, labels):            # sequence-first hidden [s, b, d] next to labels [b, s]
        return h.transpose(0, 1).sum(-1) + labels

    h = torch.randn(6, 4, 8)
    labels = torch.randn(4, 6)
    for kw, want in (({"batch_size": 4}, {"l_h_": 1, "l_labels_": 0}),
                     ({"input_dims": {"l_h_": 1, "l_labels_": 0}}, {"l_h_": 1, "l_labels_": 0})):
        torch._dynamo.reset()
        reports = []
        out = torch.compile(fn, backend=tiling_backend(2, reports, **kw))(h, labels)
        assert reports[0][1].tiled_inputs == want
        assert reports[0][1].joins == []
        torch.testing.assert_close(out, fn(h, labels))


def test_nothing_is_tiled_when_the_batch_does_not_split():
    reports = []
    torch.compile(lambda x: x * 2, backend=tiling_backend(2, reports))(torch.randn(3, 5))
    assert reports[0][1].reason == "batch size 3 is not divisible by 2 tiles"
    assert not reports[0][1].applied


def _masked_scores(x, w, mask):
    # The shape of megatron-core's attention softmax (core attention + attention_mask_func): scores
    # are a view of a matmul result, updated in place, and read afterwards through the same name.
    h = x @ w
    h += 1                                        # operator.iadd on a tiled tensor
    scores = h.view(x.shape[0], 2, 4)
    scores.masked_fill_(mask, -10000.0)           # twin: masked_fill, per tile
    F.relu(scores, inplace=True)                  # no twin: the update writes into the joined tiles
    keep = (scores > 0) & (scores < 5)            # operator.and_ is not an in-place update
    return torch.softmax(scores, dim=-1) * keep


def test_in_place_updates_of_tiled_tensors_are_seen_by_later_readers():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8))
    mask = torch.tensor([[True, False, False, True]])
    reports = []
    compiled = torch.compile(_masked_scores, backend=tiling_backend(2, reports))
    err = parity(_masked_scores, compiled, [x, w, mask], [])
    assert err["missing_grads"] == 0
    assert err["out"] < 1e-6 and err["grad"] < 1e-5, err
    _, report = reports[0]
    assert report.applied
    assert [(op, why) for _, op, why in report.joins] == [
        ("torch.nn.functional.relu", "in-place update: no out-of-place twin with an elementwise rule")]


def test_an_update_seen_through_an_older_view_leaves_the_graph_untiled():
    def fn(x, w):
        h = x @ w
        v = h.view(4, 2, 4)
        v.mul_(2)                                # h's storage changes; h itself is read below
        return h.sum(-1)

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8))
    reports = []
    compiled = torch.compile(fn, backend=tiling_backend(2, reports))
    err = parity(fn, compiled, [x, w], [])
    tiled, report = reports[0]
    assert report.reason == "in-place method.mul_ at mul_: h views the updated storage and is read afterwards"
    assert not report.applied and report.joins == []
    assert err["out"] < 1e-6 and err["grad"] < 1e-5, err


def test_an_update_of_a_graph_input_leaves_the_graph_untiled():
    def fn(x):
        x.add_(1)
        return x * 2

    x = torch.randn(4, 8)
    reports = []
    out = torch.compile(fn, backend=tiling_backend(2, reports))(x.clone())
    assert reports[0][1].reason == "in-place method.add_ at add_: updates the graph input l_x_ in place"
    torch.testing.assert_close(out, fn(x.clone()))
