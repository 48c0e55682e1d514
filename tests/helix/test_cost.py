"""Cost models, presets, micro-benchmark cache and the Helix config."""
import dataclasses
import json

import pytest
import torch

from megatron_ext.config.base import ConfigError, build, field_names
from megatron_ext.helix import calibrate
from megatron_ext.helix.calibrate import CostCache, benchmark_graph_ops, device_key
from megatron_ext.helix.config import HelixConfig
from megatron_ext.helix.cost import (PRESETS, AnalyticalCostModel, DeviceSpec, Interconnect, MeasuredCostModel,
                                     op_signature, resolve_interconnect)
from megatron_ext.helix.ir import CollectiveInfo, GraphIR
from tests.conftest import FakeTime

DEV = DeviceSpec(name="t", peak_flops_per_s=1e9, mem_bandwidth_Bps=1e9, op_overhead_s=1e-6)


def _info(kind, n_bytes, group_size):
    return CollectiveInfo(kind=kind, group="0", group_size=group_size, dtype=torch.float32, in_bytes=n_bytes,
                          out_bytes=n_bytes, reduce_op="sum")


def test_link_time_uses_ring_algorithm_bytes_per_group_size():
    link = Interconnect("l", latency_s=1e-5, bandwidth_Bps=1e9)
    mb = 1_000_000
    assert link.time_of(_info("all_reduce", mb, 2)) == pytest.approx(1e-5 + 1e-3)        # 2(n-1)/n = 1
    assert link.time_of(_info("all_reduce", mb, 4)) == pytest.approx(1e-5 + 1.5e-3)      # 2*3/4
    assert link.time_of(_info("all_to_all", mb, 4)) == pytest.approx(1e-5 + 0.75e-3)     # 3/4
    assert link.time_of(_info("all_reduce", mb, 1)) == 0.0


def test_link_fit_recovers_latency_and_bandwidth():
    from megatron_ext.helix.cost import fit_link

    true = Interconnect("t", latency_s=2e-4, bandwidth_Bps=5e8)
    samples = [(b, true.collective_time_s("all_to_all", b, 4)) for b in (1 << 16, 1 << 20, 1 << 22)]
    link = fit_link("fit", "all_to_all", 4, samples)
    assert link.latency_s == pytest.approx(2e-4) and link.bandwidth_Bps == pytest.approx(5e8)
    flat = fit_link("flat", "all_reduce", 2, [(1000, 1e-3), (2000, 1e-3)])   # noise: no slope
    assert flat.latency_s == pytest.approx(1e-3, rel=1e-6) and flat.bandwidth_Bps > 1e12


def test_a_collective_costs_the_slower_of_the_emulated_link_and_the_measured_one():
    emulated = Interconnect("emu", latency_s=0.0, bandwidth_Bps=1e9)
    real = Interconnect("gloo", latency_s=5e-3, bandwidth_Bps=1e12)
    model = AnalyticalCostModel(DEV, emulated, measured={("0", "all_reduce"): real})
    small, big = _info("all_reduce", 1000, 2), _info("all_reduce", 100_000_000, 2)
    assert model.collective_s(small) == pytest.approx(real.time_of(small))
    assert model.collective_s(big) == pytest.approx(emulated.time_of(big))
    a2a = _info("all_to_all", 1000, 2)  # no measurement for this kind: the emulated link alone
    assert model.collective_s(a2a) == pytest.approx(emulated.time_of(a2a))


def test_a_measured_link_answers_at_its_payloads_between_them_linearly_and_beyond_them_by_its_fit():
    from megatron_ext.helix.calibrate import trimmed_mean
    from megatron_ext.helix.cost import MeasuredLink

    # gloo's step: fast up to 256 KiB, 3 ms more at 512 KiB -- which no line through 64 KiB and 1 MiB gives.
    fit = Interconnect("fit", latency_s=1e-4, bandwidth_Bps=3e8)
    link = MeasuredLink("m", ((1 << 16, 2.5e-4), (1 << 18, 4e-4), (1 << 19, 3.4e-3), (1 << 20, 3.7e-3)), fit)
    assert link.time_of(_info("all_reduce", 1 << 18, 2)) == pytest.approx(4e-4)
    assert link.time_of(_info("all_reduce", 1 << 19, 2)) == pytest.approx(3.4e-3)
    assert link.time_of(_info("all_reduce", 3 << 17, 2)) == pytest.approx((4e-4 + 3.4e-3) / 2)
    beyond = _info("all_reduce", 1 << 22, 2)
    assert link.time_of(beyond) == pytest.approx(fit.time_of(beyond))
    assert link.time_of(_info("all_reduce", 16, 2)) == pytest.approx(fit.time_of(_info("all_reduce", 16, 2)))
    assert link.time_of(_info("all_reduce", 1 << 19, 1)) == 0.0
    model = AnalyticalCostModel(DEV, None, measured={("0", "all_reduce"): link})
    assert model.collective_s(_info("all_reduce", 1 << 19, 2)) == pytest.approx(3.4e-3)
    with pytest.raises(ValueError, match="sorted by payload"):
        MeasuredLink("bad", ((1 << 20, 1e-3), (1 << 16, 1e-4)), fit)
    with pytest.raises(ValueError, match="finite times"):
        MeasuredLink("bad", ((1 << 16, float("nan")),), fit)
    # The statistic: a mixture of fast runs and 3 ms stalls costs its mean, one outlier each side dropped.
    assert trimmed_mean([0.3, 0.3, 3.3, 0.3, 3.3, 40.0, 0.0]) == pytest.approx((0.3 * 3 + 3.3 * 2) / 5)
    assert trimmed_mean([1.0, 3.0]) == pytest.approx(2.0)


def test_presets_scale_with_the_device_and_keep_their_ratio():
    fast = dataclasses.replace(DEV, peak_flops_per_s=4e9)
    intra, cross = (PRESETS[k].resolve(DEV) for k in ("intra_node", "cross_node"))
    assert intra.bandwidth_Bps / cross.bandwidth_Bps == pytest.approx(480 / 80)
    assert PRESETS["cross_node"].resolve(fast).bandwidth_Bps == pytest.approx(4 * cross.bandwidth_Bps)
    assert resolve_interconnect(None, DEV) is None and resolve_interconnect("none", DEV) is None
    with pytest.raises(ValueError, match="unknown interconnect 'infiniband'"):
        resolve_interconnect("infiniband", DEV)


def _mm_graph(n=64):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda a, b: torch.mm(a, b).relu())(torch.randn(n, n), torch.randn(n, n))


def test_analytical_compute_is_a_roofline_plus_overhead():
    gm = _mm_graph(64)
    ir = GraphIR(gm)
    model = AnalyticalCostModel(DEV)
    mm = next(n for n in ir.nodes if n.op == "aten::mm.default")
    relu = next(n for n in ir.nodes if n.op == "aten::relu.default")
    assert model.compute_s(mm) == pytest.approx(1e-6 + 2 * 64 ** 3 / 1e9)             # compute-bound
    assert model.compute_s(relu) == pytest.approx(1e-6 + 2 * 64 * 64 * 4 / 1e9)        # memory-bound
    assert model.collective_s(_info("all_reduce", 10, 2)) == 0.0                        # no link: free


def test_measured_model_uses_the_table_scaled_and_falls_back_to_the_roofline():
    gm = _mm_graph(32)
    ir = GraphIR(gm)
    mm = next(n for n in ir.nodes if n.op == "aten::mm.default")
    relu = next(n for n in ir.nodes if n.op == "aten::relu.default")
    fallback = AnalyticalCostModel(DEV)
    model = MeasuredCostModel({op_signature(mm.node): 0.5}, fallback, scale=2.0)
    assert model.compute_s(mm) == pytest.approx(1.0)
    assert model.compute_s(relu) == pytest.approx(2 * fallback.compute_s(relu))
    assert model.misses == 1


def test_micro_benchmarks_fill_and_reuse_the_cache(tmp_path):
    gm = _mm_graph(32)
    path = tmp_path / "costs.json"
    cache = CostCache(str(path))
    table = benchmark_graph_ops([gm], "cpu", cache, rounds=2)
    cache.save()
    sigs = {op_signature(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert set(table) == sigs and all(0 < t < 1 for t in table.values())
    stored = json.loads(path.read_text())[device_key("cpu")]["ops"]
    assert set(stored) == sigs
    # Everything cached: nothing is measured, cached values come back unchanged.
    again = benchmark_graph_ops([gm], "cpu", CostCache(str(path)))
    assert again == stored
    # One call not cached: all are measured again in one session (no mixing across sessions).
    bigger = _mm_graph(48)
    fresh = benchmark_graph_ops([gm, bigger], "cpu", CostCache(str(path)), rounds=1)
    assert set(fresh) == sigs | {op_signature(n) for n in bigger.graph.nodes if n.op == "call_function"}


def test_op_signature_names_shapes_strides_and_literals():
    gm = _mm_graph(8)
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    assert op_signature(mm) == "aten::mm.default(T(8, 8)s(8, 1)float32,T(8, 8)s(8, 1)float32;)"


# -- config ----------------------------------------------------------------------------------------

def test_flags_are_pinned():
    assert field_names(HelixConfig) == ["helix", "helix_tiles", "helix_memory_budget_gb", "helix_seq_tiling",
                                        "helix_bucketing", "helix_min_gain", "helix_cost_model", "helix_cost_cache",
                                        "helix_interconnect", "helix_host_interference", "helix_mode",
                                        "helix_select_rounds", "helix_select_candidates", "helix_select_measure"]


@pytest.mark.parametrize("values, message", [
    ({"helix_tiles": 0}, "--helix-tiles must be >= 1, got 0"),
    ({"helix_memory_budget_gb": -1}, "--helix-memory-budget-gb must be > 0, got -1.0"),
    ({"helix_min_gain": 1.5}, "--helix-min-gain must be in [0, 1), got 1.5"),
    ({"helix_host_interference": 1.0}, "--helix-host-interference must be in [0, 1), got 1.0"),
    # a YAML value outside a field's choices is refused by the config loader, naming the file
    ({"helix_interconnect": "ib"},
     "run.yaml: key 'helix_interconnect' must be one of 'none', 'intra_node', 'cross_node', got 'ib'"),
    ({"helix_mode": "always"}, "run.yaml: key 'helix_mode' must be one of 'auto', 'tiled', 'baseline', got 'always'"),
    ({"helix_tiles": "two"}, "run.yaml: key 'helix_tiles' expects int, got 'two'"),
])
def test_bad_values_are_named(values, message):
    with pytest.raises(ConfigError) as exc:
        build(HelixConfig, values, "run.yaml")
    assert str(exc.value) == message


def test_budget_in_bytes_and_backend_from_config():
    from megatron_ext.helix import backend_from_config

    cfg = build(HelixConfig, {"helix": True, "helix_tiles": 4, "helix_memory_budget_gb": 0.5,
                              "helix_interconnect": "cross_node", "helix_cost_model": "analytical"}, "run.yaml")
    assert cfg.memory_budget_bytes == 1 << 29
    be = backend_from_config(cfg, batch_size=8)
    assert (be.tiles, be.memory_budget_bytes, be.interconnect_spec, be.batch_size) == (4, 1 << 29, "cross_node", 8)
    assert be.mode == "auto"
    forced = build(HelixConfig, {"helix": True, "helix_mode": "tiled"}, "run.yaml")
    assert backend_from_config(forced).mode == "helix"   # the tiled schedule whatever the simulator says


def test_starting_a_collective_is_charged_to_the_compute_thread_and_the_link_window_follows_it():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from megatron_ext.helix.ir import Kind
    from megatron_ext.helix.simulator import graph_ops, simulate
    from tests.helix.helix_helpers import fake_world

    emulated = Interconnect("emu", latency_s=1e-4, bandwidth_Bps=1e12)
    real = Interconnect("gloo", latency_s=5e-3, bandwidth_Bps=1e12)
    issue = Interconnect("issue", latency_s=2e-3, bandwidth_Bps=1e12)
    model = AnalyticalCostModel(DEV, emulated, measured={("0", "all_reduce"): real},
                                issue={("0", "all_reduce"): issue})
    info = _info("all_reduce", 1000, 2)
    assert model.issue_s(info) == pytest.approx(2e-3 + 1e-9)
    # the measured fit (start to end) less its start; never below the emulated link
    assert model.collective_s(info) == pytest.approx(3e-3)
    assert model.host_collective_s(info) == pytest.approx(3e-3)
    assert AnalyticalCostModel(DEV, emulated, measured={("0", "all_reduce"): real}).collective_s(info) == \
        pytest.approx(real.time_of(info))   # unmeasured start: as before
    ops = torch.ops._c10d_functional
    with fake_world(0) as g:
        def f(x: torch.Tensor) -> torch.Tensor:
            return ops.wait_tensor(ops.all_reduce(x * 2, "sum", g.name)).sum()

        gm = make_fx(f)(torch.randn(250))
    ir = GraphIR(gm, lambda name: 2)
    (coll,) = [n for n in ir.nodes if n.kind == Kind.COLLECTIVE]
    model = AnalyticalCostModel(DEV, emulated, measured={(coll.collective.group, "all_reduce"): real},
                                issue={(coll.collective.group, "all_reduce"): issue})
    assert model.compute_s(coll) == pytest.approx(model.issue_s(coll.collective))
    res = simulate(graph_ops(ir, model))
    without = simulate(graph_ops(ir, AnalyticalCostModel(DEV, emulated, measured={(coll.collective.group,
                                                                                 "all_reduce"): real})))
    # start + the rest of the transfer = the measured collective: the step is as long (less the fixed
    # op overhead the start replaces), but the start is compute-thread time that no overlap can hide
    assert res.makespan_s == pytest.approx(without.makespan_s - DEV.op_overhead_s, rel=1e-6)
    assert res.compute_s == pytest.approx(without.compute_s - DEV.op_overhead_s + model.issue_s(coll.collective))


def test_the_live_copy_runs_the_real_collectives_without_the_emulated_link_and_times_their_starts_and_waits():
    from torch.fx.experimental.proxy_tensor import make_fx

    from megatron_ext.helix.cost import Interconnect
    from megatron_ext.helix.interconnect import emulation_stats, install_emulation, reset_emulation
    from megatron_ext.helix.ir import is_emulated_issue
    from tests.helix.helix_helpers import fake_world

    with fake_world(0, 2) as g:
        def layer(x):
            y = torch.ops._c10d_functional.all_reduce(x * 2, "sum", g.name)
            return torch.ops._c10d_functional.wait_tensor(y) + 1

        x = torch.randn(4, 8)
        gm = make_fx(layer)(x)
        assert install_emulation(gm, Interconnect("link", latency_s=1e-4, bandwidth_Bps=1e9), lambda _: 2) == 1
        live = calibrate.live_copy(gm)
        assert not any(is_emulated_issue(n) for n in live.graph.nodes)
        targets = [getattr(n.target, "__name__", "") for n in live.graph.nodes if n.op == "call_function"]
        assert "_timed_wait" in targets and any(t.startswith("timed_") for t in targets), targets
        assert "emulated_wait" not in targets
        reset_emulation()
        calibrate._CollectiveClock.reset()
        out = live(x)
        assert emulation_stats().waits == 0 and emulation_stats().collectives == 0   # the link is not in it
        torch.testing.assert_close(out, gm(x))
        assert emulation_stats().waits == 1   # the original still goes through the emulated link
        assert calibrate._CollectiveClock.waits > 0 and calibrate._CollectiveClock.starts > 0


def test_live_timing_counts_the_computation_and_not_the_collectives_starts_and_waits(monkeypatch):
    # The wait takes 5 s of a fake clock, the computation after it 1 s: each repetition counts 1 s;
    # the first run is dropped and ``sync`` runs before every run.
    from torch.fx.experimental.proxy_tensor import make_fx

    from tests.helix.helix_helpers import fake_world

    clock = FakeTime()
    monkeypatch.setattr(calibrate, "time", clock)

    def slow_wait(x):
        clock.now += 5.0
        return torch.ops._c10d_functional.wait_tensor.default(x)

    def one_second(x):
        clock.now += 1.0
        return x

    monkeypatch.setattr(calibrate, "_wait_op", slow_wait)
    with fake_world(0, 2) as g:
        def layer(x):
            y = torch.ops._c10d_functional.all_reduce(x * 2, "sum", g.name)
            return torch.ops._c10d_functional.wait_tensor(y) + 1

        gm = make_fx(layer)(torch.randn(4, 8))
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            tick = gm.graph.call_function(one_second, (out.args[0],))
        out.args = (tick,)
        gm.recompile()
        synced = []
        got = calibrate.time_graphs_live([gm, gm], reps=3, sync=lambda: synced.append(clock.now))
    assert got == 2.0 and len(synced) == 4
