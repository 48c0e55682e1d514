"""Event core: invariants over random traces for every policy/placement/backfill, and exact
hand-computed schedules for preemption, demotion, leases, backfilling and placement."""
from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cluster.cluster_helpers import cfg, data, job
from megatron_ext.cluster.config import POLICIES
from megatron_ext.cluster.engine import VCSimulator, simulate
from megatron_ext.cluster.state import DONE
from megatron_ext.cluster.trace import Job, VCSpec, read_trace, read_vc_config


def run(jobs, nodes=1, gpn=8, record=True, **kw):
    c = cfg(**kw)
    return VCSimulator(VCSpec("vc", nodes, gpn), jobs, c, record=record).run()


def check_invariants(result, c, gpn):
    states = {js.job.job_id: js for js in result.states}
    segs = collections.defaultdict(list)
    node_events = []
    slot_use = collections.defaultdict(list)
    for job_id, t0, t1, alloc, slot, rate in result.segments:
        assert t1 >= t0
        segs[job_id].append((t0, t1, rate, alloc, slot))
        if alloc is not None:
            for node, n in alloc:
                node_events.append((t0, 1, node, n))
                node_events.append((t1, 0, node, -n))  # releases sort before acquisitions
        else:
            slot_use[id(slot)].append((t0, t1, slot, states[job_id]))
    # gang placement never over-allocates a node
    used = collections.Counter()
    for _, _, node, n in sorted(node_events):
        used[node] += n
        assert 0 <= used[node] <= gpn, f"node {node} holds {used[node]} of {gpn} GPUs"
    # a bubble slot hosts one guest at a time, with room for it, while its host runs
    for uses in slot_use.values():
        uses.sort(key=lambda u: u[0])
        for (a0, a1, *_), (b0, *_rest) in zip(uses, uses[1:]):
            assert b0 >= a1
        for t0, t1, slot, guest in uses:
            assert slot.spare_gb >= guest.job.mem_gb and guest.job.kind == "hpo"
            host_runs = [(s0, s1) for s0, s1, _, alloc, _ in segs[slot.host.job.job_id] if alloc]
            assert any(s0 <= t0 and t1 <= s1 for s0, s1 in host_runs)
    for job_id, js in states.items():
        assert js.state == DONE, f"{job_id} never finished"
        runs = sorted(segs[job_id], key=lambda s: (s[0], s[1]))
        assert runs and runs[0][0] >= js.submit, f"{job_id} started before it arrived"
        assert js.start == runs[0][0] and js.end == pytest.approx(runs[-1][1])
        for (a0, a1, *_), (b0, *_rest) in zip(runs, runs[1:]):
            assert b0 >= a1 - 1e-9, f"{job_id} runs twice at once"
        # preemption accounting: work done = run time + restart costs charged
        work = sum((t1 - t0) * rate for t0, t1, rate, _, _ in runs)
        assert work == pytest.approx(js.job.duration + js.restart_s, rel=1e-9, abs=1e-6)
        busy = sum(t1 - t0 for t0, t1, *_ in runs)
        assert js.end - js.submit == pytest.approx(js.wait_s + busy, rel=1e-9, abs=1e-6)
        if js.restart_s:
            assert js.restart_s >= js.preemptions * min(c.restart_cost_s)
        if not c.restart_cost_s or max(c.restart_cost_s) == 0:
            pass
    if not VCSimulator(VCSpec("x", 1, 1), [], c).preemptive:
        # non-preemptive policies preempt nobody; only bubble guests can lose their slot
        assert all(js.preemptions == 0 for js in states.values() if js.job.kind != "hpo")


@st.composite
def traces(draw):
    nodes = draw(st.integers(1, 3))
    gpn = draw(st.sampled_from([2, 4, 8]))
    n = draw(st.integers(1, 30))
    jobs = []
    for k in range(n):
        kind = draw(st.sampled_from(["train", "train", "hpo", "pipeline"]))
        if kind == "pipeline":
            pp = draw(st.sampled_from([2, 4]))
            gpus = pp * draw(st.integers(1, max(1, nodes * gpn // pp)))
            if gpus > nodes * gpn:
                gpus = pp if pp <= nodes * gpn else 1
            extra = dict(pp_stages=pp if gpus % pp == 0 else 1, micro_batches=draw(st.integers(1, 8)),
                         mem_gb=draw(st.sampled_from([20.0, 40.0])), act_mem_gb=draw(st.sampled_from([0.0, 8.0])))
            if extra["pp_stages"] == 1:
                extra["bubble_fraction"] = 0.3
        elif kind == "hpo":
            gpus = draw(st.sampled_from([1, 1, 2]))
            extra = dict(mem_gb=draw(st.sampled_from([0.0, 10.0, 30.0])))
        else:
            gpus = draw(st.integers(1, nodes * gpn))
            extra = {}
        jobs.append(Job(f"j{k}", 0, float(draw(st.integers(0, 200))), float(draw(st.integers(1, 300))),
                        min(gpus, nodes * gpn), "vc", kind=kind, **extra))
    jobs.sort(key=lambda j: j.submit)
    return nodes, gpn, jobs


@settings(max_examples=150, deadline=None)
@given(trace=traces(), policy=st.sampled_from(POLICIES),
       placement=st.sampled_from(["consolidate", "consolidate_first", "scatter"]),
       backfill=st.sampled_from(["none", "greedy", "easy"]), slowdown=st.sampled_from([1.0, 1.5]))
def test_invariants_hold_for_every_policy(trace, policy, placement, backfill, slowdown):
    nodes, gpn, jobs = trace
    c = cfg(policy=policy, placement=placement, backfill=backfill, spread_slowdown=slowdown,
            las_thresholds_gpu_s=[50.0, 400.0], ftf_lease_s=60.0, las_promote_knob=2.0)
    result = VCSimulator(VCSpec("vc", nodes, gpn), jobs, c, record=True).run()
    check_invariants(result, c, gpn)


@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_on_the_philly_fixture_under_pressure(policy):
    vcs = read_vc_config(data("philly_vc_tight.csv"))
    trace = read_trace(data("philly_small.csv"), vcs, load_scale=20.0)
    c = cfg(policy=policy, ftf_lease_s=600.0)
    result = simulate(trace, c, record=True)
    queued = 0
    for vc in result.vcs:
        check_invariants(vc, c, vc.spec.gpus_per_node)
        queued += sum(js.wait_s > 0 for js in vc.states)
    assert queued > 20, "the fixture must queue jobs at this load"


def test_srtf_preempts_the_longer_job_and_charges_the_restart():
    r = run([job("long", 0, 100), job("short", 10, 5)], gpn=1, policy="srtf")
    long_, short = r.states
    assert (short.start, short.end) == (10, 15)
    # long: 10 s done, 90 left + 7 s restart -> resumes at 15, ends 112
    assert (long_.end, long_.preemptions, long_.wait_s, long_.restart_s) == (112, 1, 5, 7)


def test_a_restarted_job_earns_back_its_restart_cost_before_another_preemption():
    # A is preempted by B at 10 and restarts at 15 having paid 7 s: it is protected until 15+7+1.
    # C (3 s, shorter than A's 96 s left) arrives at 16 and preempts A only at 23, via a wake-up.
    r = run([job("a", 0, 100), job("b", 10, 5), job("c", 16, 3)], gpn=1, policy="srtf")
    a, b, c = r.states
    assert (b.start, b.end, c.start, c.end) == (10, 15, 23, 26)
    assert (a.preemptions, a.end) == (2, 26 + (100 - 10 - 8) + 2 * 7)


def test_thrashing_thresholds_still_terminate_with_progress():
    # Tiresias with a threshold crossed in 12.5 s by a 4-GPU job while a restart costs 30 s, and
    # starvation promotion: without the restart protection this never ends.
    jobs = [job(f"j{k}", 5.0 * k, 200.0, 4) for k in range(6)]
    r = run(jobs, gpn=8, policy="tiresias", las_thresholds_gpu_s=[50.0], las_promote_knob=1.0)
    check_invariants(r, cfg(policy="tiresias"), 8)
    assert sum(s.preemptions for s in r.states) > 0


def test_srtf_does_not_preempt_a_job_closer_to_finishing():
    r = run([job("long", 0, 100), job("newer", 90, 20)], gpn=1, policy="srtf")
    assert [(s.start, s.end, s.preemptions) for s in r.states] == [(0, 100, 0), (100, 120, 0)]


def test_tiresias_demotion_lets_a_fresh_job_preempt():
    # 1 GPU; threshold 100 GPU-s. B arrives at 50 but A (earlier, same queue) keeps running until
    # it crosses 100 GPU-s at t=100, is demoted and preempted by B.
    r = run([job("a", 0, 1000), job("b", 50, 30)], gpn=1, policy="tiresias", las_thresholds_gpu_s=[100.0])
    a, b = r.states
    assert (b.start, b.end) == (100, 130)
    assert (a.end, a.preemptions) == (130 + 900 + 7, 1)


def test_tiresias_counts_gpus_in_attained_service():
    # a 4-GPU job crosses 100 GPU-s after 25 s; B (80 GPU-s of work) then runs to completion
    r = run([job("a", 0, 1000, 4), job("b", 10, 20, 4)], gpn=4, policy="tiresias", las_thresholds_gpu_s=[100.0])
    a, b = r.states
    assert (b.start, b.end) == (25, 45)
    # with 30 s of work B would cross the threshold too, and A (same queue, earlier) takes back over
    r = run([job("a", 0, 1000, 4), job("b", 10, 30, 4)], gpn=4, policy="tiresias", las_thresholds_gpu_s=[100.0])
    a, b = r.states
    assert (b.start, b.preemptions, a.end, b.end) == (25, 1, 50 + 975 + 30, 1055 + 5 + 30)


def test_ftf_preempts_only_at_lease_rounds():
    r = run([job("a", 0, 10000), job("b", 10, 100)], gpn=1, policy="ftf", ftf_lease_s=3600.0)
    a, b = r.states
    assert (b.start, b.end) == (3610, 3710)
    assert (a.end, a.preemptions) == (3710 + (10000 - 3610) + 7, 1)


@pytest.mark.parametrize("mode, starts", [
    ("none", [0, 100, 150, 150]),    # B blocks everything behind it
    ("greedy", [0, 202, 2, 100]),   # C and D jump the queue; C delays B by 102 s
    ("easy", [0, 100, 150, 3]),     # only D, which ends before B's reservation, backfills
])
def test_backfill_modes(mode, starts):
    jobs = [job("a", 0, 100, 4), job("b", 1, 50, 8), job("c", 2, 200, 4), job("d", 3, 50, 4)]
    r = run(jobs, gpn=8, policy="fifo", backfill=mode)
    assert [s.start for s in r.states] == starts


def test_scatter_slows_a_spread_job_and_consolidate_does_not():
    jobs = [job("a", 0, 100, 2)]
    assert run(jobs, nodes=2, gpn=4, placement="scatter", spread_slowdown=1.5).states[0].end == 150
    assert run(jobs, nodes=2, gpn=4, placement="consolidate", spread_slowdown=1.5).states[0].end == 100
    # a job that needs two nodes anyway is not "spread"
    assert run([job("b", 0, 100, 8)], nodes=2, gpn=4, placement="scatter", spread_slowdown=1.5).states[0].end == 100


def test_consolidate_first_falls_back_when_fragmented():
    jobs = [job("a", 0, 1000, 3), job("b", 0, 1000, 3), job("c", 1, 100, 2)]
    strict = run(jobs, nodes=2, gpn=4, placement="consolidate", spread_slowdown=2.0).states[2]
    loose = run(jobs, nodes=2, gpn=4, placement="consolidate_first", spread_slowdown=2.0).states[2]
    assert (strict.start, strict.end) == (1000, 1100)
    assert (loose.start, loose.end) == (1, 201)


def test_qssf_history_estimates_from_finished_jobs_of_the_user():
    jobs = [job("u1", 0, 100, user="ann"), job("u2", 0, 300, user="ann"), job("v1", 0, 50, user="bob"),
            # queued behind the 1-GPU blocker; ordered by the users' mean durations
            job("blocker", 1000, 500), job("ann3", 1001, 10, user="ann"), job("bob2", 1002, 10, user="bob"),
            job("new", 1003, 10, user="cat")]
    r = run(jobs, gpn=1, policy="qssf")
    by = {s.job.job_id: s for s in r.states}
    est = {k: by[k].est for k in ("ann3", "bob2", "new")}
    assert est["ann3"] == pytest.approx(200.0) and est["bob2"] == pytest.approx(50.0)
    assert est["new"] == pytest.approx((100 + 300 + 50) / 3)  # unknown user: the VC's 1-GPU mean
    assert by["bob2"].start < by["new"].start < by["ann3"].start


def test_every_policy_runs_the_fixture_and_sjf_beats_fifo_under_load():
    vcs = read_vc_config(data("philly_vc_tight.csv"))
    trace = read_trace(data("philly_small.csv"), vcs, load_scale=20.0)
    from megatron_ext.cluster.metrics import summarize

    res = {p: summarize(simulate(trace, cfg(policy=p))) for p in POLICIES}
    assert all(r["jobs"] == len(trace.jobs) for r in res.values())
    assert res["sjf"]["avg_jct_s"] < res["fifo"]["avg_jct_s"]
    assert res["srtf"]["avg_jct_s"] < res["fifo"]["avg_jct_s"]
    assert res["srtf"]["preemptions"] > 0 and res["fifo"]["preemptions"] == 0
