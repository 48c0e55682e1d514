"""Issue #47 item 1: every baseline readmits and regrows on ResiHP's signal, gets the verdicts its
design can act on, and no policy asks the simulator."""
from __future__ import annotations

import pytest

from megatron_ext.resilience import policies, resihp_policy, setting
from megatron_ext.resilience.detector import DetectorModel
from megatron_ext.resilience.faults import Fault, FaultTrace, healthy_state
from megatron_ext.resilience.job import Job
from megatron_ext.resilience.run import run_policy

ALL = policies.BASELINES + resihp_policy.BEFORE + ("resihp",) + resihp_policy.GLUE
READMIT = policies.READMIT_AFTER_S


@pytest.fixture(scope="module")
def ctx():
    return setting.context("llama2-13b")


def test_the_context_a_policy_is_handed_has_no_simulator(ctx):
    with pytest.raises(RuntimeError, match="a policy asked the simulator for 'healthy'"):
        ctx.for_policy().sim.healthy(ctx.start)

    class Peeks(policies.Policy):
        name = "peeks"

        def react(self, ctx_, t, it, verdicts, links):
            return None

        def start(self, ctx_):
            ctx_.sim.healthy(ctx_.start)

    with pytest.raises(RuntimeError, match="policies decide from the detector's verdicts"):
        run_policy(Peeks(), ctx, FaultTrace(ctx.num_devices, 8, []), end_s=60.0)
    # Every policy runs through a loss and a slowdown without asking.
    sc = setting.scenarios(ctx)
    for name in ALL:
        for s in ("gpu_lost", "gpu_slow_4x"):
            run_policy(resihp_policy.make(name), ctx, setting.trace(ctx, sc[s]), end_s=sc[s].end_s,
                       measure_from_s=sc[s].measure_from_s)


def test_torchft_restarts_a_group_that_lost_a_node_on_the_spare_node(ctx):
    sc = setting.scenarios(ctx)["node_lost"]
    pol = resihp_policy.make("torchft")
    r = run_policy(pol, ctx, setting.trace(ctx, sc), end_s=sc.end_s, measure_from_s=sc.measure_from_s)
    spare = set(ctx.spares)
    assert len(pol.job.pipelines) == len(ctx.start.pipelines)
    assert spare <= set(pol.job.devices)
    assert "(1 joining)" in r.events[-1]
    # It joined after the group's restart, the others training meanwhile.
    t_drop, t_join = (float(e.split("s ")[0]) for e in r.events[:2])
    assert t_join - t_drop >= ctx.costs.restart_s


def test_torchft_drops_the_group_behind_a_slow_nic_and_readmits_it_on_resihps_signal():
    # LLaMA-2-7B: one pipeline a node; a NIC at 1/4 slows every step's gradient all-reduce by more
    # than one group of 32 is worth.
    c7 = setting.context("llama2-7b")
    d = setting.victim(c7.start, c7.hw)
    onset, heal = 450.0, 1500.0
    tr = FaultTrace(c7.num_devices, 8, [Fault("slow_nic", d, onset, heal, factor=4.0)])
    pol = resihp_policy.make("torchft")
    r = run_policy(pol, c7, tr, end_s=onset + READMIT + 600.0)
    assert [e.split(": ")[2].split(" (pause")[0] for e in r.events] == [
        "quorum of 31/32 replica groups", "quorum of 32/32 replica groups (1 joining)"]
    t_drop, t_back = (float(e.split("s ")[0]) for e in r.events)
    assert t_back - t_drop == pytest.approx(READMIT, abs=2 * c7.sim.healthy(c7.start).time_s)
    # Still slow when readmitted: named again once it is back in the job, and dropped again.
    tr = FaultTrace(c7.num_devices, 8, [Fault("slow_nic", d, onset, factor=4.0)])
    r = run_policy(resihp_policy.make("torchft"), c7, tr, end_s=onset + READMIT + 600.0)
    assert [e.split(": ")[2].split(" (")[0] for e in r.events] == [
        "quorum of 31/32 replica groups", "quorum of 32/32 replica groups", "quorum of 31/32 replica groups"]


def test_torchft_drops_the_group_behind_a_slow_path(ctx):
    c7 = setting.context("llama2-7b")
    sc = setting.scenarios(c7)["pp_link_1/4"]
    r = run_policy(resihp_policy.make("torchft"), c7, setting.trace(c7, sc), end_s=sc.end_s,
                   measure_from_s=sc.measure_from_s)
    assert len(r.events) == 1 and "quorum of 31/32" in r.events[0]
    before = run_policy(resihp_policy.make("torchft"), c7, FaultTrace(c7.num_devices, 8, sc.faults), end_s=sc.end_s,
                        measure_from_s=sc.measure_from_s)
    assert before.throughput_vs_healthy == r.throughput_vs_healthy


def test_ckpt_restart_takes_its_excluded_slow_node_back_as_a_spare(ctx):
    d = setting.victim(ctx.start, ctx.hw)
    node = d // 8
    tr = FaultTrace(ctx.num_devices, 8, [Fault("slow_device", d, 450.0, 900.0, factor=4.0)])
    pol = resihp_policy.make("ckpt_restart")
    run_policy(pol, ctx, tr, end_s=450.0 + READMIT + 300.0)
    assert node not in {x // 8 for x in pol.job.devices}     # restarted without it, on the spare
    assert pol.free_nodes == [node] and not pol.excluded      # and then readmitted as the spare


def test_ckpt_restart_regrows_a_dropped_pipeline_onto_a_readmitted_node():
    # LLaMA-2-70B (four pipelines of eight nodes): the spare goes to a slow node; a node lost later
    # leaves no spare, so its pipeline is dropped. An hour after it was left out, the slow node is
    # back as a spare, and a restart regrows the pipeline: a quarter of the job pays for it.
    c70 = setting.context("llama2-70b")
    d = setting.victim(c70.start, c70.hw)
    tr = FaultTrace(c70.num_devices, 8, [Fault("slow_device", d, 450.0, 2000.0, factor=4.0),
                                         Fault("stop_node", 20, 2500.0)])
    pol = resihp_policy.make("ckpt_restart")
    r = run_policy(pol, c70, tr, end_s=450.0 + READMIT + 1200.0)
    assert r.restarts == 3, r.events
    assert len(pol.job.pipelines) == len(c70.start.pipelines)
    used = {x // 8 for x in pol.job.devices}
    assert d // 8 in used and 20 not in used
    assert "back on readmitted node(s)" in r.events[-1]
    # A pipeline of sixteen is not worth a restart and its lost work: LLaMA-2-13B stays on 15.
    c13 = setting.context("llama2-13b")
    tr = FaultTrace(c13.num_devices, 8, [Fault("slow_device", setting.victim(c13.start, c13.hw), 450.0, 900.0,
                                               factor=4.0), Fault("stop_node", 20, 1200.0)])
    pol = resihp_policy.make("ckpt_restart")
    assert run_policy(pol, c13, tr, end_s=450.0 + READMIT + 600.0).restarts == 2
    assert len(pol.job.pipelines) == 15 and pol.free_nodes == [setting.victim(c13.start, c13.hw) // 8]


def test_a_link_out_of_the_job_is_not_reported_recovered_and_is_named_again_when_back(ctx):
    det = DetectorModel(ctx.num_devices, 8, delay=2, window=2)
    st = healthy_state(ctx.num_devices)
    st.nic[5] = 0.25
    assert [(lv.kind, lv.factor) for i in range(1, 3) for lv in det.observe(i, ctx.start, st)[1]] == [("slow_nic", 4.0)]
    without = Job(tuple(p for p in ctx.start.pipelines if 5 not in p.devices))
    assert [lv for i in range(3, 8) for lv in det.observe(i, without, st)[1]] == []
    back = [(i, lv.factor) for i in range(8, 11) for lv in det.observe(i, ctx.start, st)[1]]
    assert back == [(9, 4.0)]
    det.observe(11, without, st)
    st.nic[5] = 1.0
    assert [(lv.factor) for lv in det.observe(12, ctx.start, st)[1]] == [1.0]


def test_resihp_readmits_a_slow_nic_whose_device_it_left_out_after_the_same_window(ctx):
    pol = resihp_policy.make("resihp")
    pol.start(ctx.for_policy())
    pol.policy.nics[5] = ctx.hw.nic_bytes_per_s / 4
    pol.policy.nics[20] = ctx.hw.nic_bytes_per_s / 4
    pol.job = Job(tuple(p for p in ctx.start.pipelines if 5 not in p.devices))   # 20 stays in the job
    assert pol._readmit_nics(100.0, 10) == []
    assert pol._readmit_nics(100.0 + READMIT - 1, 11) == []
    (v,) = pol._readmit_nics(100.0 + READMIT, 12)
    assert (v.kind, v.rank, v.detector) == ("nic_recovered", 5, "readmission")
    assert pol._readmit_nics(100.0 + 2 * READMIT, 13) == []
