"""Bucketing: which merges the knapsack DP takes, and the FX rewrite it applies."""
import pytest
import torch
import torch.fx as fx

from megatron_ext.helix.cost import AnalyticalCostModel, DeviceSpec, Interconnect
from megatron_ext.helix.ir import CollectiveInfo, Kind, collective_kind, is_wait
from megatron_ext.helix.passes.bucketing import BucketingReport, Candidate, choose_merges, merged_ops
from megatron_ext.helix.simulator import SimOp, simulate
from tests.helix.helix_helpers import B, H, S, build_block, fake_world

MB = 1 << 20


def _dev():
    return DeviceSpec(name="t", peak_flops_per_s=1e12, mem_bandwidth_Bps=1e12, op_overhead_s=0.0)


def _program(compute_between: float):
    """Two tiles: x0, x1 -> all-reduce each -> (compute) -> wait each -> y0(x0), y1(x1)."""
    g = fx.Graph()
    names = [g.placeholder(n) for n in ("c0", "c1", "w0", "w1")]
    info = CollectiveInfo(kind="all_reduce", group="tp", group_size=2, dtype=torch.float32, in_bytes=MB,
                          out_bytes=MB, reduce_op="sum")
    ops = [SimOp("x0", Kind.COMPUTE, compute_s=1e-3, alloc_bytes=MB, tile=0),                  # 0
           SimOp("x1", Kind.COMPUTE, compute_s=1e-3, alloc_bytes=MB, tile=1),                  # 1
           SimOp("c0", Kind.COLLECTIVE, inputs=(0,), alloc_bytes=MB, channel="tp", tile=0),    # 2
           SimOp("c1", Kind.COLLECTIVE, inputs=(1,), alloc_bytes=MB, channel="tp", tile=1),    # 3
           SimOp("mid", Kind.COMPUTE, compute_s=compute_between),                              # 4
           SimOp("w0", Kind.WAIT, wait_of=2, inputs=(2, 0), alias_of=2, tile=0),               # 5
           SimOp("y0", Kind.COMPUTE, compute_s=1e-3, inputs=(5, 0), alloc_bytes=MB, keep=True),  # 6
           SimOp("w1", Kind.WAIT, wait_of=3, inputs=(3, 1), alias_of=3, tile=1),               # 7
           SimOp("y1", Kind.COMPUTE, compute_s=1e-3, inputs=(7, 1), alloc_bytes=MB, keep=True)]  # 8
    cand = Candidate(graph="fw", colls=names[:2], waits=names[2:], info=info, op_index=[2, 3], wait_index=[5, 7],
                     input_index=[0, 1])
    return ops, cand


def _cost(latency_s, bandwidth):
    cost = AnalyticalCostModel(_dev(), Interconnect("l", latency_s=latency_s, bandwidth_Bps=bandwidth))
    return cost


def _with_comm(ops, cost, info):
    for op in ops:
        if op.kind == Kind.COLLECTIVE:
            op.comm_s = cost.collective_s(info)
    return ops


def test_latency_bound_collectives_are_merged():
    ops, cand = _program(0.0)
    cost = _cost(latency_s=5e-3, bandwidth=1e12)  # 5 ms per launch, transfer ~free
    _with_comm(ops, cost, cand.info)
    report = BucketingReport()
    chosen, result = choose_merges(ops, [cand], cost, None, report)
    assert chosen == [cand] and report.refused == []
    assert result.makespan_s < simulate(ops).makespan_s - 3e-3   # one 5 ms latency saved, 1 ms later start
    assert result.makespan_s == pytest.approx(simulate(merged_ops(ops, [cand], cost)).makespan_s)


def test_merging_that_delays_the_first_tile_is_refused():
    ops, cand = _program(2e-3)
    cost = _cost(latency_s=0.0, bandwidth=1e9)   # transfer-bound: merging only delays tile 0
    _with_comm(ops, cost, cand.info)
    report = BucketingReport()
    chosen, _ = choose_merges(ops, [cand], cost, None, report)
    assert chosen == []
    assert report.refused[0][0] == "fw:c0+c1"
    assert report.refused[0][1].startswith("no predicted gain (-")


def test_the_memory_budget_excludes_merges_that_raise_the_peak():
    ops, cand = _program(0.0)
    cost = _cost(latency_s=5e-3, bandwidth=1e12)
    _with_comm(ops, cost, cand.info)
    base_peak = simulate(ops).peak_bytes
    merged_peak = simulate(merged_ops(ops, [cand], cost)).peak_bytes
    assert merged_peak > base_peak  # the concatenated input buffer lives until the wait
    report = BucketingReport()
    chosen, _ = choose_merges(ops, [cand], cost, base_peak, report)
    assert chosen == []
    assert report.refused == [("fw:c0+c1", f"peak {merged_peak} B over the budget {base_peak} B")]


def test_fx_merge_replaces_tile_collectives_with_one_bucket():
    """On a real tiled graph: K collectives become one, issued after the last tile, waited where the
    first tile waited; every dependency holds (numerics are checked on gloo ranks)."""
    from megatron_ext.helix import HelixBackend

    slow_launch = Interconnect("latency-bound", latency_s=0.05, bandwidth_Bps=1e12)
    with fake_world(0) as g:
        m = build_block("tp", g)
        be = HelixBackend(2, interconnect=slow_launch, mode="helix")
        torch.compile(m, backend=be)(torch.randn(B, S, H, requires_grad=True))
    s = be.summaries[0]
    assert s.bucketing.taken, s.line()
    for tag in ("fw", "bw"):
        gm = s.graphs[tag]
        colls = [n for n in gm.graph.nodes if collective_kind(n)]
        untiled = [n for n in colls if "helix_tile" not in n.meta.get("custom", {})]
        taken = [c for c in s.bucketing.taken if c.startswith(tag + ":")]
        assert len(colls) == 4 - len(taken) and len(untiled) == len(taken)
        for c in untiled:
            assert c.args[0].target is torch.ops.aten.cat.default
            assert all(is_wait(u) or "emulated" in str(u.target) for u in c.users)
