"""Pipeline events on megatron-core's schedules (4 gloo ranks) and the pure timeline analysis."""
from __future__ import annotations

import json
import pickle
import tracemalloc

import numpy as np
import pytest

from megatron_ext.pipeline.events import Call, EventRecorder, Phase, assign_p2p_microbatches
from megatron_ext.pipeline.timeline import theoretical_bubble_fraction
from tests.conftest import run_torchrun

SCENARIOS = {"pp4_m4": (4, 4, 1, 1), "pp4_m8": (4, 8, 1, 1), "pp2dp2_m4": (2, 4, 1, 2), "pp2_vpp2_m4": (2, 4, 2, 2)}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("timelines")
    run_torchrun("tests/pipeline/timeline_scenarios.py", str(out))
    recs = {}
    for name in SCENARIOS:
        with open(out / f"{name}.pkl", "rb") as fh:
            recs[name] = pickle.load(fh)
    recs["_dir"] = out
    return recs


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compute_order_is_the_schedule(records, name):
    rec = records[name]
    p, m, v, dp = SCENARIOS[name]
    assert (rec.num_stages, rec.num_microbatches, rec.num_chunks) == (p, m, v)
    assert len(rec.ranks) == 4 and {r.dp for r in rec.ranks.values()} == set(range(dp))
    order = rec.order
    for rank, r in rec.ranks.items():
        assert rec.compute_order(rank) == list(order.stages[r.stage]), f"rank {rank} stage {r.stage}"


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_recv_pairs_with_a_send(records, name):
    rec = records[name]
    p, m, v, dp = SCENARIOS[name]
    sends, recvs = rec.p2p_messages()
    key = lambda msg: msg[:4]  # noqa: E731  (direction, from virtual stage, to virtual stage, micro-batch)
    for dp_rank in range(dp):
        ranks = {r.rank for r in rec.ranks.values() if r.dp == dp_rank}
        s = sorted(key(x) for x in sends if x[4] in ranks)
        r = sorted(key(x) for x in recvs if x[4] in ranks)
        assert s == r
        # activations and gradients cross each of the p*v - 1 virtual-stage boundaries once per micro-batch
        assert len(s) == 2 * m * (p * v - 1)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["pp4_m4", "pp4_m8", "pp2dp2_m4"])
def test_bubbles_where_the_schedule_puts_them(records, name):
    rec = records[name]
    windows = rec.bubble_windows()
    for r in rec.ranks.values():
        mine = {w.ended_by: w for w in windows if w.rank == r.rank}
        if r.stage > 0:
            # warm-up: a downstream stage waits for micro-batch 0 to come through
            assert "F0" in mine and mine["F0"].duration_s > 0 and mine["F0"].expected_s > 0
        if r.stage == rec.num_stages - 1:
            # cool-down: the last stage is done while earlier stages still run backwards
            assert "end" in mine and mine["end"].expected_s > 0
    fractions = rec.stage_bubble_fractions()
    assert len(fractions) == rec.num_stages and all(0 < f < 1 for f in fractions)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_schedule_simulated_with_own_durations_bounds_the_run(records, name):
    # Fed the run's own op durations, the dataflow simulation starts every op as early as its
    # dependencies allow: a real run can only be as fast or slower (blocking sends, a descheduled
    # rank). So the simulated makespan is not longer than the measured one (clocks of different
    # ranks are aligned to within a fraction of a millisecond), and no stage idles less than the
    # schedule makes it.
    check = records[name].schedule_check()
    p = records[name].num_stages
    assert len(check["expected_bubble"]) == len(check["measured_bubble"]) == p
    assert all(0 <= e < 1 for e in check["expected_bubble"])
    assert check["makespan_rel_error"] <= 0.01
    assert check["idle_max_abs_error_s"] >= 0 and check["start_mae_s"] >= 0
    for measured, expected in zip(check["measured_bubble"], check["expected_bubble"]):
        assert measured >= expected - 0.02


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_critical_path_is_a_dependency_chain(records, name):
    rec = records[name]
    path = rec.critical_path()
    assert path[0][0] == 0 and str(path[0][1]) == "F0"
    # the path is that of the (tp 0, dp 0) replica: it ends where that replica's pipeline ends
    replica_end = max(float(rec.representative(s).compute()["t1"].max()) for s in range(rec.num_stages))
    assert path[-1][3] == replica_end
    for (_, _, _, t1), (_, _, t0, _) in zip(path, path[1:]):
        assert t0 >= t1 - 1e-6


@pytest.mark.multirank
def test_chrome_trace_written_and_loadable(records):
    path = records["_dir"] / "pp4_m4" / "timeline_iter0000003.json"
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    procs = {e["pid"] for e in events if e.get("name") == "process_name"}
    assert procs == {0, 1, 2, 3}
    assert any(e.get("cat") == "bubble" for e in events)
    fwd = [e for e in events if e.get("cat") == "forward"]
    assert len(fwd) == 4 * 4 and all("doc_lengths" in e["args"] for e in fwd)
    assert all(sum(map(sum, [e["args"]["doc_lengths"][0]])) == 64 for e in fwd)  # one sequence of 64 tokens


# --- pure parts ---------------------------------------------------------------------------------

def test_recorder_does_not_allocate_per_event():
    rec = EventRecorder(capacity=20000)
    for _ in range(100):  # warm up caches
        rec.end(rec.begin(Phase.FORWARD, 0, 1))
    rec.reset()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(10000):
        rec.end(rec.begin(Phase.FORWARD, 0, i))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert len(rec) == 10000
    assert grown < 64 * 1024, f"{grown} bytes allocated for 10000 events"


def test_recorder_disabled_and_overflow():
    rec = EventRecorder(capacity=2, enabled=False)
    assert rec.begin(Phase.FORWARD) == -1 and len(rec) == 0
    rec.enabled = True
    for _ in range(3):
        rec.end(rec.begin(Phase.RECV))
    assert len(rec) == 2 and rec.dropped == 1
    ev = rec.events()
    assert np.all(ev["t1"] >= ev["t0"])


def test_p2p_microbatch_assignment():
    clock = iter(range(100)).__next__
    rec = EventRecorder(clock=lambda: float(clock()))
    for phase, mb, call in [(Phase.RECV, -1, Call.RECV_FORWARD), (Phase.FORWARD, 0, 0),
                            (Phase.RECV, -1, Call.SEND_FORWARD_RECV_BACKWARD), (Phase.BACKWARD, 0, 0),
                            (Phase.SEND, -1, Call.SEND_BACKWARD)]:
        rec.end(rec.begin(phase, 0, mb, call))
    info = assign_p2p_microbatches(rec.events())
    assert info[0] == {"recv_F": 0, "recv_F_chunk": 0}
    assert info[2] == {"send_F": 0, "send_F_chunk": 0, "recv_B": 0, "recv_B_chunk": 0}
    assert info[4] == {"send_B": 0, "send_B_chunk": 0}
    assert Call.SEND_FORWARD_RECV_BACKWARD.sends == ("F",) and Call.SEND_FORWARD_RECV_BACKWARD.recvs == ("B",)


def test_theoretical_bubble_fraction():
    assert theoretical_bubble_fraction(2, 4) == pytest.approx(0.2)
    assert theoretical_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_hooks_symbols_present_and_install_is_exclusive():
    from megatron_ext.pipeline.megatron_hooks import MegatronPipelineHooks, missing_symbols

    assert missing_symbols() == []
    import megatron.core.pipeline_parallel.schedules as sched

    original = sched.forward_step
    a = MegatronPipelineHooks(EventRecorder(), []).install()
    try:
        assert sched.forward_step is not original
        with pytest.raises(RuntimeError, match="already installed"):
            MegatronPipelineHooks(EventRecorder(), []).install()
    finally:
        a.uninstall()
    assert sched.forward_step is original
