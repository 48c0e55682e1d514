"""Graph IR: node classes, collective metadata, lifetimes -- on Dynamo and AOT graphs."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megatron_ext.helix.collectives import all_gather_dim0, all_reduce, all_to_all_dim0, reduce_scatter_dim0
from megatron_ext.helix.ir import GraphIR, Kind, collective_signature
from tests.helix.helix_helpers import fake_world


def _aten_graph(g):
    def fn(x, w):
        h = (x @ w).relu()                   # compute
        v = h.view(-1)                       # view
        r = all_reduce(v, g)                 # collective + wait
        ag = all_gather_dim0(h, g)
        rs = reduce_scatter_dim0(ag, g)
        a2a = all_to_all_dim0(rs, g)
        return r.sum() + a2a.sum()

    return make_fx(fn)(torch.randn(4, 8), torch.randn(8, 8))


def test_every_node_is_classified_and_collectives_carry_their_group():
    with fake_world(0) as g:
        ir = GraphIR(_aten_graph(g), group_size=lambda name: 2)
    kinds = {n.name: n.kind for n in ir.nodes}
    assert kinds["mm"] == Kind.COMPUTE and kinds["relu"] == Kind.COMPUTE
    assert kinds["view"] == Kind.VIEW
    assert kinds["x_1"] == Kind.OTHER  # placeholder
    colls = ir.collectives()
    assert [c.collective.kind for c in colls] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    assert {c.collective.group for c in colls} == {g.name}
    assert all(c.collective.group_size == 2 for c in colls)
    ag = colls[1].collective
    assert (ag.in_bytes, ag.out_bytes) == (4 * 8 * 4, 2 * 4 * 8 * 4)
    for c in colls:
        w = ir.wait_for(c)
        assert w.kind == Kind.WAIT and w.wait_of == c.index and w.alias_of == c.index
    assert len(collective_signature(ir)) == 4


def test_all_reduce_group_size_needs_a_resolver():
    with fake_world(0) as g:
        gm = make_fx(lambda x: all_reduce(x, g))(torch.randn(4))
    with pytest.raises(ValueError) as exc:
        GraphIR(gm)
    assert str(exc.value) == (f"helix IR: group size of all_reduce (all_reduce on group '{g.name}') is not in the "
                              "graph; pass group_size=<callable(group_name) -> int>")


def test_lifetimes_follow_views_and_outputs():
    gm = make_fx(lambda x: (x.exp().view(-1) + 1, x.sin()))(torch.randn(4, 4))
    ir = GraphIR(gm)
    by = {n.name: n for n in ir.nodes}
    life = ir.lifetimes()
    end = len(ir) - 1
    exp, view, add, sin = by["exp"], by["view"], by["add"], by["sin"]
    assert ir.storage_root(view.index) == exp.index
    assert life[exp.index] == (exp.index, add.index)     # alive through its view's last use
    assert life[add.index] == (add.index, end)           # outputs live to the end
    assert life[sin.index] == (sin.index, end)
    assert exp.alloc_bytes == 64 and view.alloc_bytes == 0


def test_multi_output_ops_free_their_outputs_separately():
    gm = make_fx(lambda x, w, b: torch.native_layer_norm(x, [8], w, b, 1e-5)[0] * 2)(
        torch.randn(4, 8), torch.randn(8), torch.randn(8))
    ir = GraphIR(gm)
    ln = next(n for n in ir.nodes if "native_layer_norm" in n.op)
    items = [ir.nodes[u] for u in ln.users]
    assert ln.out_bytes == 4 * 8 * 4 + 2 * 4 * 4
    # Each item is owned (and freed) by its getitem, so unused mean/rstd die at once while the
    # normalised output lives on; the parent allocates nothing of its own.
    assert [i.alloc_bytes for i in items] == [4 * 8 * 4, 4 * 4, 4 * 4]
    assert ln.alloc_bytes == 0
    life = ir.lifetimes()
    assert life[items[1].index] == (items[1].index, items[1].index)


def test_dynamo_graphs_are_classified_too():
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return gm.forward

    with fake_world(0) as g:
        from megatron_ext.helix.collectives import reduce_from_tensor_parallel_region

        lin = torch.nn.Linear(8, 8)
        torch.compile(lambda x: reduce_from_tensor_parallel_region(lin(x).transpose(0, 1), g),
                      backend=capture)(torch.randn(4, 8, requires_grad=True))
    ir = GraphIR(graphs[0])
    kinds = {n.op: n.kind for n in ir.nodes}
    assert kinds["torch._C._nn.linear"] == Kind.COMPUTE
    assert kinds["method.transpose"] == Kind.VIEW
    assert kinds["higher_order.autograd_function_apply"] == Kind.COMPUTE
