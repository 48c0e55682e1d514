"""The backend on fake process groups: rank-identical decisions, round-robin order, summaries."""
import copy
import re

import pytest
import torch
import torch.fx as fx

from megatron_ext.helix import HelixBackend, backend
from megatron_ext.helix.ir import collective_kind, is_wait, op_name, tile_of
from megatron_ext.helix.measure import step_peak_bytes, train_step
from megatron_ext.helix.passes.checks import DependencyError, check_dependencies
from megatron_ext.helix.passes.reorder import reorder_graph
from tests.helix.helix_helpers import B, H, S, build_block, fake_world


def _compile(kind: str, rank: int, **kw):
    with fake_world(rank) as g:
        torch.manual_seed(0)
        m = build_block(kind, g)
        be = HelixBackend(**({"tiles": 2, "interconnect": "cross_node"} | kw))
        c = torch.compile(m, backend=be)
        x = torch.randn(B, S, H, requires_grad=True)
        gy = torch.randn(B, S, H)
        train_step(c, x, gy, m.parameters())
        peak = step_peak_bytes(c, x, gy, m.parameters())
        return be, peak


def _schedule(gm: fx.GraphModule) -> list[tuple[str, int | None]]:
    return [(op_name(n), tile_of(n)) for n in gm.graph.nodes]


@pytest.fixture(scope="module")
def tpep_per_rank():
    torch._dynamo.reset()
    out = {}
    for rank in (0, 1):
        torch._dynamo.reset()
        out[rank] = _compile("tpep", rank)
    return out


def test_decisions_and_orders_are_identical_on_every_rank(tpep_per_rank):
    (b0, _), (b1, _) = tpep_per_rank[0], tpep_per_rank[1]
    s0, s1 = b0.summaries[0], b1.summaries[0]
    assert s0.tiled and s1.tiled
    assert s0.order == s1.order
    assert s0.order["fw"] == ["all_reduce:0"] * 2 + ["all_to_all:0"] * 4
    assert s0.decisions == s1.decisions and s0.refused == s1.refused
    for tag in ("fw", "bw"):
        assert _schedule(s0.graphs[tag]) == _schedule(s1.graphs[tag])
    assert s0.helix.makespan_s == s1.helix.makespan_s and s0.helix.peak_bytes == s1.helix.peak_bytes


def test_summary_line_reports_collectives_exposure_makespan_memory_and_decisions(tpep_per_rank):
    s = tpep_per_rank[0][0].summaries[0]
    line = s.line()
    assert re.fullmatch(r"helix graph 0: 3\+3 collectives \(fw\+bw\) \| exposed comm [\d.]+ -> [\d.]+ ms \(simulated\) \| "
                        r"makespan [\d.]+ -> [\d.]+ ms \| peak [\d.]+ MiB -> [\d.]+ MiB \| taken: tiling into 2 "
                        r"streams \+ round-robin \(predicted gain \+[\d.]+%\).* \| refused: .*", line), line
    assert s.helix.exposed_comm_s < s.baseline.exposed_comm_s
    assert s.helix.makespan_s < s.baseline.makespan_s


def test_simulated_peak_memory_matches_the_profiler(tpep_per_rank):
    be, measured = tpep_per_rank[0]
    predicted = be.summaries[0].chosen.peak_bytes
    # The fake process group frees collective inputs at issue; the model keeps them until the
    # wait (what real process groups do), so it may only over-estimate, and by little.
    assert measured <= predicted <= 1.05 * measured


def test_round_robin_puts_the_other_streams_compute_under_each_collective(tpep_per_rank):
    s = tpep_per_rank[0][0].summaries[0]
    for tag in ("fw", "bw"):
        gm = s.graphs[tag]
        check_dependencies(None, gm.graph)
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        hidden = 0
        for c in nodes:
            if collective_kind(c) is None or tile_of(c) is None:
                continue
            w = next(u for u in c.users if is_wait(u))
            between = nodes[pos[c] + 1:pos[w]]
            hidden += any(tile_of(n) not in (None, tile_of(c)) and n.op == "call_function" and "mm" in op_name(n)
                          for n in between)
        assert hidden >= 2, f"{tag}: too few collectives overlap another stream's matmuls"


def _needed_by(node: fx.Node, stream: int) -> set[str]:
    """Names of the nodes of ``stream`` that ``node`` depends on, transitively within the stream."""
    seen, todo = set(), [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if tile_of(a) == stream and a.name not in seen:
                seen.add(a.name)
                todo.append(a)
    return seen


def test_reordering_interleaves_streams_and_issues_each_collective_first():
    """Per stream, what a collective needs keeps its original order and runs before the rest of its
    segment (weight gradients, values saved for the backward), which then overlaps the collective
    in flight; the streams alternate."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from megatron_ext.helix.passes.tiling import tile_graph

    graphs = {}

    def keep(tag):
        def compiler(g, _):
            graphs[tag] = g
            return make_boxed_func(g.forward)
        return compiler

    def capture(gm, ex):
        tiled, _ = tile_graph(gm, 2)
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))(tiled, ex)

    with fake_world(0) as g:
        m = build_block("tp", g)
        torch.compile(m, backend=capture)(torch.randn(B, S, H, requires_grad=True)).sum().backward()
    deferred = 0
    for tag in ("fw", "bw"):
        before = graphs[tag]
        after = copy.deepcopy(before)
        _, report = reorder_graph(after)
        assert report.streams == 2 and report.moved > 0
        original = [n.name for n in before.graph.nodes]
        new = list(after.graph.nodes)
        assert [n.name for n in new] != original
        for t in (0, 1):
            mine = [n for n in new if tile_of(n) == t and n.op != "placeholder"]  # (saved activations)
            colls = [n for n in mine if collective_kind(n) is not None]
            assert colls
            critical = set().union(*(_needed_by(c, t) | {c.name} for c in colls))
            names = {n.name for n in mine}
            assert [n.name for n in mine if n.name in critical] == [x for x in original if x in critical & names]
            # Segments end at waits; in each, the collective comes before the work it does not need.
            seg: list[fx.Node] = []
            for n in mine + [None]:
                if n is None or is_wait(n):
                    for c in (x for x in seg if collective_kind(x) is not None):
                        need = _needed_by(c, t)
                        later = [x.name for x in seg[:seg.index(c)] if x.name not in need]
                        assert later == [], (tag, c.name, later)
                        moved = [x.name for x in seg[seg.index(c) + 1:] if original.index(x.name) < original.index(c.name)]
                        deferred += len(moved)
                    seg = []
                if n is not None:
                    seg.append(n)
    assert deferred > 0  # e.g. weight gradients now run after the collective they used to delay


def test_dependency_check_rejects_broken_orders():
    with fake_world(0) as g:
        from torch.fx.experimental.proxy_tensor import make_fx

        from megatron_ext.helix.collectives import all_reduce

        gm = make_fx(lambda x: all_reduce(x * 2, g) + 1)(torch.randn(4))
    names = [n.name for n in gm.graph.nodes]
    coll = next(n for n in gm.graph.nodes if collective_kind(n))
    wait = next(n for n in gm.graph.nodes if is_wait(n))
    coll.prepend(wait)  # the wait now precedes the collective it waits for
    with pytest.raises(DependencyError, match=f"{wait.name} uses {coll.name} before it is computed"):
        check_dependencies(names, gm.graph)
    wait.append(coll)
    coll.append(wait)
    add = next(n for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target))
    add.args = (coll, add.args[1])  # reads the in-flight buffer, not the waited result
    with pytest.raises(DependencyError, match=f"{add.name} read {coll.name} before its wait"):
        check_dependencies(names, gm.graph)


def test_tiling_is_declined_when_it_does_not_pay_and_the_baseline_runs():
    be, _ = _compile("tp", 0, interconnect="intra_node", min_gain=0.5)
    s = be.summaries[0]
    assert not s.tiled and s.chosen is s.baseline
    assert s.refused[0].startswith("tiled schedule: predicted gain") and "below 50%" in s.refused[0]
    assert all(tile_of(n) is None for n in s.graphs["fw"].graph.nodes)


def test_a_declined_tiling_returns_the_untiled_trace_without_tracing_it_again(monkeypatch):
    traced = []
    trace = HelixBackend._trace

    def counted(self, gm, example_inputs, tiled):
        traced.append(tiled)
        return trace(self, gm, example_inputs, tiled)

    monkeypatch.setattr(HelixBackend, "_trace", counted)
    torch._dynamo.reset()
    with fake_world(0) as g:
        torch.manual_seed(0)
        m = build_block("tpep", g)
        ref = copy.deepcopy(m)
        be = HelixBackend(tiles=2, interconnect="intra_node", min_gain=0.9)
        x, gy = torch.randn(B, S, H, requires_grad=True), torch.randn(B, S, H)
        xr = x.detach().clone().requires_grad_(True)
        train_step(torch.compile(m, backend=be), x, gy, m.parameters())
        train_step(ref, xr, gy, ref.parameters())
    assert traced == [False, True] and not be.summaries[0].tiled
    assert torch.equal(x.grad, xr.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))


def test_memory_budget_refuses_schedules_above_it():
    be, _ = _compile("tp", 0, memory_budget_bytes=1024, mode="helix")
    s = be.summaries[0]
    assert not s.tiled
    assert any(r.startswith("tiled schedule: predicted peak") and "over the budget 0.00 MiB" in r for r in s.refused)


def test_public_backend_signature():
    import inspect

    sig = inspect.signature(backend)
    assert list(sig.parameters) == ["tiles", "memory_budget_bytes", "interconnect"]
    assert [p.default for p in sig.parameters.values()] == [2, None, None]
    be = backend(tiles=3, memory_budget_bytes=123, interconnect="intra_node")
    assert (be.tiles, be.memory_budget_bytes, be.interconnect_spec) == (3, 123, "intra_node")
    with pytest.raises(ValueError, match="helix backend: tiles must be >= 1, got 0"):
        backend(tiles=0)


def test_dynamic_shapes_run_unchanged_with_a_refusal():
    with fake_world(0) as g:
        m = build_block("tp", g)
        be = HelixBackend(2, interconnect="cross_node")
        c = torch.compile(m, backend=be, dynamic=True)
        x = torch.randn(B, S, H)
        torch.testing.assert_close(c(x), m(x))
    s = be.summaries[0]
    assert s.refused == ["all passes: dynamic shapes (compile with dynamic=False)"] and not s.tiled


def test_the_decision_prices_both_variants_at_one_scale_and_the_tiled_prediction_at_its_own(monkeypatch, tmp_path):
    # The whole-graph timing says the tiled graphs' computation takes a second, the untiled graphs'
    # no more than their operators. The decision's gain is the untiled scale's for both variants;
    # the prediction of the tiled step -- what the job ranks candidates by and simulate_compiled
    # reproduces -- carries the tiled graphs' second.
    timed = []

    def whole(self, graphs, device):
        tiled = any(tile_of(n) is not None for g in graphs for n in g.graph.nodes)
        timed.append(tiled)
        return 1.0 if tiled else 1e-9

    monkeypatch.setattr(HelixBackend, "_time_computation", whole)
    torch._dynamo.reset()
    be, _ = _compile("tp", 0, cost_model="calibrated", cost_cache=str(tmp_path / "c.json"), mode="helix")
    s = be.summaries[0]
    assert timed == [False, False, True]     # untiled alone, then untiled and tiled in one session
    assert s.tiled and s.chosen is s.helix and s.helix.makespan_s < 0.5
    gain = (s.baseline.makespan_s - s.helix.makespan_s) / s.baseline.makespan_s
    assert s.decisions[0].endswith(f"(forced; predicted gain {gain:+.1%})"), s.decisions
    # a second of computation (bucketing, after the timing, adds or removes a few copies)
    assert s.prediction is s.predicted and s.predicted.compute_s == pytest.approx(1.0, rel=0.25)
    assert f"| predicted step {s.predicted.makespan_s * 1e3:.2f} ms (the tiled graphs timed whole) |" in s.line()
    with fake_world(0):
        assert be.simulate_compiled(0).makespan_s == pytest.approx(s.predicted.makespan_s)
    torch._dynamo.reset()
    untiled, _ = _compile("tp", 0, cost_model="calibrated", cost_cache=str(tmp_path / "c.json"), mode="baseline")
    assert untiled.summaries[0].predicted is None and untiled.summaries[0].prediction is untiled.summaries[0].baseline
