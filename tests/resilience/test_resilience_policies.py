"""The policies in the seed's setting: what each does after a loss, the detector model, the run loop."""
from __future__ import annotations

import math

import pytest

from megatron_ext.resilience import policies, resihp_policy, setting
from megatron_ext.resilience.detector import DetectorModel
from megatron_ext.resilience.faults import FaultTrace, healthy_state
from megatron_ext.resilience.run import run_policy
from megatron_ext.resilience.validate import sim_error

ALL = policies.BASELINES + resihp_policy.BEFORE + ("resihp",) + resihp_policy.GLUE


@pytest.fixture(scope="module")
def ctx():
    return setting.context("llama2-13b")


def test_without_faults_every_policy_runs_at_the_healthy_rate(ctx):
    tr = FaultTrace(ctx.num_devices, 8, [])
    for name in ALL:
        r = run_policy(resihp_policy.make(name), ctx, tr, end_s=600.0)
        assert r.throughput_vs_healthy == pytest.approx(1.0, abs=1e-9), name
        assert r.relayouts == r.restarts == 0


def test_every_finished_iteration_is_reported_once_and_they_add_up_to_the_run(ctx):
    it_s = ctx.sim.healthy(ctx.start).time_s
    seen = []
    r = run_policy(resihp_policy.make("recycle"), ctx, FaultTrace(ctx.num_devices, 8, []), end_s=600.0,
                   on_iteration=lambda t, n: seen.append((t, n)))
    times = [t for t, _ in seen]
    assert len(seen) == int(600.0 // it_s) and times == sorted(times) and times[-1] <= 600.0
    assert times[0] == pytest.approx(it_s)
    # the run's tokens are these iterations' and the share of the one cut off at the end
    cut = r.tokens - sum(n for _, n in seen)
    assert 0 <= cut < seen[0][1]
    # a loss: the iteration in flight is not reported; reported ones end before the onset or after
    # the heartbeat timeout and the policy's pause
    sc = setting.scenarios(ctx)["gpu_lost"]
    lost = []
    run_policy(resihp_policy.make("recycle"), ctx, setting.trace(ctx, sc), end_s=sc.end_s,
               measure_from_s=sc.measure_from_s, on_iteration=lambda t, n: lost.append(t))
    onset = sc.faults[0].start_s
    after = [t for t in lost if t > onset]
    assert after and after[0] >= onset + ctx.costs.heartbeat_timeout_s + it_s


def test_after_a_loss_every_policy_runs_without_the_lost_device(ctx):
    sc = setting.scenarios(ctx)["gpu_lost"]
    dead = sc.faults[0].target
    tr = setting.trace(ctx, sc)
    out = {}
    for name in ALL:
        pol = resihp_policy.make(name)
        r = run_policy(pol, ctx, tr, end_s=sc.end_s, measure_from_s=sc.measure_from_s)
        out[name] = r
        from megatron_ext.resilience.sim import computing_devices
        assert dead not in computing_devices(pol.job), name
        assert 0 < r.throughput_vs_healthy < 1.1, name
        assert pol.job.microbatches == ctx.start.microbatches, name
    # torchft stepped on with fewer replicas (a smaller global batch) while the lost group restarted
    # on the spare node; then it joined again.
    assert "quorum of 15/16 replica groups" in out["torchft"].events[0]
    assert "quorum of 16/16 replica groups (1 joining)" in out["torchft"].events[1]
    # A restart rolls back to the checkpoint; a live change does not.
    assert out["ckpt_restart"].restarts == 1 and out["oobleck"].restarts == 0
    assert out["ckpt_restart"].throughput_vs_healthy < out["oobleck"].throughput_vs_healthy


def test_resihp_decides_with_resihps_own_planner(ctx):
    sc = setting.scenarios(ctx)["gpu_slow_2x"]
    pol = resihp_policy.make("resihp")
    run_policy(pol, ctx, setting.trace(ctx, sc), end_s=sc.end_s, measure_from_s=sc.measure_from_s)
    assert len(pol.policy.plans) == 1
    it, plan = pol.policy.plans[0]
    assert plan.speeds == {sc.faults[0].target: 0.5}
    # exactly 2x: the window rule's 7 iterations (the severe rule is for more than 2x)
    assert ctx.detector_severe_factor == 2.0 and ctx.detector_severe_delay == 4
    assert it == pytest.approx((sc.faults[0].start_s - 0.0) / ctx.sim.healthy(ctx.start).time_s + 7, abs=1.5)


def test_the_detector_names_after_its_delay_and_only_devices_it_watches(ctx):
    det = DetectorModel(ctx.num_devices, 8, delay=3, window=2)
    st = healthy_state(ctx.num_devices)
    st.speed[5] = 0.5
    st.speed[260] = 0.5      # a spare: not in the job, not watched
    got = [det.observe(i, ctx.start, st)[0] for i in range(1, 5)]
    assert [len(v) for v in got] == [0, 0, 1, 0]
    assert got[2][0].kind == "fail_slow" and got[2][0].rank == 5 and got[2][0].factor == 2.0
    st.speed[5] = 1.0
    later = [det.observe(i, ctx.start, st)[0] for i in range(5, 7)]
    assert [v.kind for vs in later for v in vs] == ["recovered"]
    st.nic[5] = 0.25
    links = [det.observe(i, ctx.start, st)[1] for i in range(7, 10)]
    assert [(lv.kind, lv.target, lv.factor) for ls in links for lv in ls] == [("slow_nic", 5, 4.0)]


def test_a_convicted_device_back_in_the_job_is_watched_afresh(ctx):
    # Device 5 is named, then left out of the job (not watched) and taken back: named again if it
    # is still slow, 'recovered' once it runs healthy if not.
    from megatron_ext.resilience.job import Job
    without = Job(tuple(p for p in ctx.start.pipelines if 5 not in p.devices))
    for healed in (False, True):
        det = DetectorModel(ctx.num_devices, 8, delay=3, window=2)
        st = healthy_state(ctx.num_devices)
        st.speed[5] = 0.5
        assert [v.kind for i in range(1, 4) for v in det.observe(i, ctx.start, st)[0]] == ["fail_slow"]
        assert [v for i in range(4, 10) for v in det.observe(i, without, st)[0]] == []
        st.speed[5] = 1.0 if healed else 0.5
        back = [(i, v.kind) for i in range(10, 14) for v in det.observe(i, ctx.start, st)[0]]
        assert back == ([(11, "recovered")] if healed else [(12, "fail_slow")])


def test_the_detector_names_a_severe_slowdown_sooner(ctx):
    det = DetectorModel(ctx.num_devices, 8, delay=7, window=8, severe_factor=2.0, severe_delay=4)
    st = healthy_state(ctx.num_devices)
    st.speed[3], st.speed[9], st.speed[17] = 0.25, 0.5, 0.6     # 4x: severe; exactly 2x, 1.67x: not
    named = {v.rank: i for i in range(1, 10) for v in det.observe(i, ctx.start, st)[0]}
    assert named == {3: 4, 9: 7, 17: 7}
    with pytest.raises(ValueError, match="severe_factor must be >= threshold"):
        DetectorModel(ctx.num_devices, 8, severe_factor=1.1)


def test_the_run_loop_refuses_a_trace_of_another_cluster(ctx):
    with pytest.raises(ValueError, match="the trace covers 16 devices, the context 264"):
        run_policy(resihp_policy.make("resihp"), ctx, FaultTrace(16, 8, []), end_s=10.0)
    with pytest.raises(ValueError, match="unknown policy 'bamboo'"):
        resihp_policy.make("bamboo")


def test_every_scenario_hits_the_job(ctx):
    sc = setting.scenarios(ctx)
    assert {"gpu_slow_1.5x", "gpu_slow_2x", "gpu_slow_4x", "node_slow_2x", "nic_1/2", "nic_1/4", "pp_link_1/2",
            "pp_link_1/4", "gpu_lost", "node_lost", "mixed_day"} == set(sc)
    used = set(ctx.start.devices)
    for name, s in sc.items():
        st = setting.trace(ctx, s).state(s.faults[0].start_s)
        hit = ({d for d in used if st.speed[d] < 1 or st.nic[d] < 1}
               or {p for p in st.path if {p[0], p[1]} <= {d // 8 for d in used}})
        assert hit, name
    assert setting.stage_link(ctx.start, ctx.hw, setting.victim(ctx.start, ctx.hw)) == (4, 5)


def test_the_simulator_is_validated_against_recorded_runs():
    err = sim_error()
    assert err["cases"] >= 10
    assert all(math.isfinite(c["rel_error"]) for c in err["detail"])
    names = {c["case"] for c in err["detail"]}
    assert {"relayout-pp2-iter35", "relayout-pp2-iter75"} <= names
    assert not any(n.startswith("deepspeed") for n in names)
    # Per set and over the runs with a core per rank, beside (not instead of) the figure over all.
    assert sum(e["cases"] for e in err["by_set"].values()) == err["cases"]
    assert set(err["by_set"]) == {"resihp-traces", "relayout-timelines", "pp2-traces", "wide-traces"}
    own = [c for c in err["detail"] if c["one_rank_per_core"]]
    assert {c["set"] for c in own} == {"relayout-timelines", "pp2-traces"}
    assert err["one_rank_per_core"]["cases"] == len(own)
    assert {"megatron-pp2-healthy-r0", "megatron-pp2-slow1x2@25-r0"} <= names
    # The composition alone (each window's own op times) is given for every case.
    assert all(math.isfinite(c["rel_error_composition"]) for c in err["detail"])
    assert 0 <= err["composition"]["median"] <= err["composition"]["p95"]
    # Bounds, so that a regression fails (issue #47, item 5): the 1F1B composition's median error
    # within 5 %, the whole simulator's within 15 % (1.4 % and 11.2 % when the bounds were set).
    assert err["composition"]["median"] <= 0.05, err["composition"]
    assert err["median"] <= 0.15, (err["median"], err["p95"])
    # The whole simulator (compute, TP collectives, sends, DP reduce, optimizer from figures measured
    # once) on the TP2 x PP2 and PP2 x DP2 runs: 22.2 % median when the bound was set, the host's
    # core sharing most of it (docs/resilience.md); the healthy TP2 x PP2 runs within 10 % each.
    whole = err["whole_simulator"]
    assert whole["cases"] == 12 and {c["layout"] for c in whole["detail"]} == {"tp2pp2dp1", "tp1pp2dp2"}
    assert whole["median"] <= 0.30, whole["median"]
    healthy_tp = [c for c in whole["detail"] if c["layout"] == "tp2pp2dp1" and "healthy" in c["case"]]
    assert len(healthy_tp) == 2 and all(abs(c["rel_error"]) <= 0.10 for c in healthy_tp), healthy_tp
    assert all(c["grad_sync_s"] > 0 for c in whole["detail"] if c["layout"] == "tp1pp2dp2")
    assert err["by_set"]["wide-traces"]["composition"]["median"] <= 0.05


def _moe_record(it: int, slow: bool) -> dict:
    # DP2, one stage, 2 micro-batches a replica. Rank 0 is the injected slow one (2x from iteration
    # 10): its compute doubles, its dispatcher time does not; healthy rank 1 waits for it inside
    # the dispatcher (its dispatcher time grows by what rank 0's compute grew), its compute does not.
    fc, bc, fm, bm = [[0.1] * 2, [0.1] * 2], [[0.2] * 2, [0.2] * 2], [[0.3] * 2, [0.3] * 2], [[0.3] * 2, [0.3] * 2]
    if slow:
        fc[0], bc[0], fm[1], bm[1] = [0.2] * 2, [0.4] * 2, [0.4] * 2, [0.5] * 2
    return {"iteration": it, "iteration_s": 1.8 + 0.1 + (0.6 if slow else 0.0),
            "layout": {"tp": 1, "pp": 1, "dp": 2, "vp": 1, "schedule": "1f1b", "num_microbatches": 2,
                       "ranks": [[0, 0, 0], [0, 1, 0]]},
            "fwd_s": [[r] for r in fc], "bwd_s": [[r] for r in bc],
            "moe_comm_fwd_s": [[r] for r in fm], "moe_comm_bwd_s": [[r] for r in bm]}


def test_a_slow_moe_rank_is_predicted_with_its_compute_stretched_not_its_dispatcher_time(tmp_path):
    # As the injection slows a rank (Throttle.exclude_s) and the simulator prices a slow device: the
    # factor applies to the compute; the time an op spends in the token dispatcher's collectives is
    # the peers' pace. The host's load is read from the healthy rank's compute alone: its dispatcher
    # time grew only because it waited for the slow rank.
    import gzip
    import json

    from megatron_ext.resilience.validate import trace_case

    path = tmp_path / "moe-dp2-slow0x2@10-r0.trace.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for it in range(1, 21):
            fh.write(json.dumps(_moe_record(it, it >= 10)) + "\n")
    case = trace_case(str(path))
    # Healthy: 2 micro-batches x (0.1 + 0.3 forward + 0.2 + 0.3 backward) + a 0.1 s tail = 1.9 s.
    # Rank 0 at 2x: 2 x (0.2 + 0.3 + 0.4 + 0.3) + 0.1 = 2.5 s (stretching the full spans gave 3.7 s).
    assert case["predicted_s"] == pytest.approx(2.5)
    assert case["observed_s"] == pytest.approx(2.5)
    assert case["host_load_factor"] == pytest.approx(1.0)
    assert case["rel_error_load_normalised"] == pytest.approx(0.0, abs=1e-12)


def test_a_rollback_loses_exactly_the_work_since_the_last_checkpoint(ctx):
    from megatron_ext.resilience.run import Action

    class RollbackOnce(policies.Policy):
        name = "rollback_once"

        def react(self, ctx_, t, it, verdicts, links):
            if t >= 1000.0 and not getattr(self, "done", False):
                self.done = True
                return Action(rollback=True, note="test")
            return None

    h = ctx.sim.healthy(ctx.start)
    T, tok = h.time_s, h.tokens
    end = 3000.0
    r = run_policy(RollbackOnce(), ctx, FaultTrace(ctx.num_devices, 8, []), end_s=end)
    j = math.ceil(1000.0 / T)                       # the iteration after which it rolls back
    kept = math.floor(ctx.costs.checkpoint_interval_s / T)   # iterations the 900 s checkpoint holds
    assert r.restarts == 1
    assert r.tokens == pytest.approx(kept * tok + (end - j * T) / T * tok, rel=1e-9)


def test_reroute_first_reroutes_when_the_planner_sees_no_better_layout(ctx):
    import dataclasses

    from megatron_ext.resilience.job import balanced_layers, node_aligned_job

    # The tuned start (the simulator's fastest healthy layout), built directly: no search.
    start = node_aligned_job(ctx.shape, tp=2, pp=2, dp=64, global_microbatches=ctx.start.microbatches,
                             layers=balanced_layers(ctx.shape, 2))
    ctx = dataclasses.replace(ctx, start=start)
    sc = setting.scenarios(ctx)["gpu_slow_2x"]
    slow = sc.faults[0].target
    # Same shape only: the planner's best is a spare in the slow device's place, as fast as the
    # layout with the device's work rerouted, and no faster once its move is counted. (With every
    # knob its own model prefers PP1 here, a shape the simulator does not rank first.)
    from megatron_ext.resihp.planner import PlannerConfig

    pol = resihp_policy.ResiHP(config=PlannerConfig(reshape=False), reroute_first=True)
    run_policy(pol, ctx, setting.trace(ctx, sc), end_s=sc.end_s, measure_from_s=sc.measure_from_s)
    from megatron_ext.resilience.job import to_plan_layout
    assert pol.policy.layout == to_plan_layout(ctx.start)        # no re-layout
    hit = [p for p in pol.job.pipelines if slow in p.devices]
    assert len(hit) == 1 and hit[0].rerouted and max(hit[0].rerouted) == hit[0].microbatches


def test_oobleck_rebuilds_on_whole_nodes_and_malleus_keeps_membership(ctx):
    sc = setting.scenarios(ctx)["node_lost"]
    oob = resihp_policy.make("oobleck")
    run_policy(oob, ctx, setting.trace(ctx, sc), end_s=sc.end_s, measure_from_s=sc.measure_from_s)
    lost = sc.faults[0].target
    for p in oob.job.pipelines:
        nodes = {d // 8 for d in p.devices}
        assert lost not in nodes and len(p.devices) == 8 * len(nodes)     # whole nodes only
    assert oob.job.microbatches == ctx.start.microbatches
    sc = setting.scenarios(ctx)["gpu_slow_2x"]
    slow = sc.faults[0].target
    mal = resihp_policy.make("malleus")
    run_policy(mal, ctx, setting.trace(ctx, sc), end_s=sc.end_s, measure_from_s=sc.measure_from_s)
    assert [p.stages for p in mal.job.pipelines] == [p.stages for p in ctx.start.pipelines]   # membership kept
    hit = next(p for p in mal.job.pipelines if slow in p.devices)
    k = next(i for i, g in enumerate(hit.stages) if slow in g)
    assert hit.layers[k] < min(n for i, n in enumerate(hit.layers) if i != k)    # fewer layers on the slow stage
    other = next(p for p in mal.job.pipelines if slow not in p.devices)
    assert hit.microbatches < other.microbatches                                   # and fewer micro-batches


def test_resihp_takes_the_nic_verdict_and_moves_the_ring_off_the_slow_nic():
    # LLaMA-2-7B: a NIC at 1/4 costs the usual layout 7 % (13B: 3 %, under the planner's 5 % bar)
    ctx = setting.context("llama2-7b")
    sc = setting.scenarios(ctx)["nic_1/4"]
    victim = sc.faults[0].target
    tr = setting.trace(ctx, sc)
    runs = {}
    for name in ("resihp", "resihp-nicless", "resihp+rr"):
        pol = resihp_policy.make(name)
        runs[name] = (pol, run_policy(pol, ctx, tr, end_s=sc.end_s, measure_from_s=sc.measure_from_s))
    nicless, plain = runs["resihp-nicless"], runs["resihp"]
    assert nicless[0].policy.plans == [] and nicless[0].policy.nics == {}
    # The ring probe's verdict as the planner gets it: the NIC's bandwidth, not a device speed.
    assert plain[0].policy.nics == {victim: pytest.approx(ctx.hw.nic_bytes_per_s / 4)}
    assert (plain[0].policy.speeds == 1).all()
    (_, plan), = plain[0].policy.plans
    assert plan.nics == plain[0].policy.nics and plan.iteration_s_after < plan.iteration_s_before
    assert plain[1].throughput_vs_healthy > nicless[1].throughput_vs_healthy
    # Rerouting has nothing to offer a NIC: the glue takes the planner's plan as it stands.
    assert runs["resihp+rr"][0].policy.plans and runs["resihp+rr"][1].throughput_vs_healthy > nicless[1].throughput_vs_healthy


def test_a_slow_link_is_predicted_from_the_injected_bandwidth_through_blocking_sends(tmp_path):
    # PP2 over 2 ranks, one micro-batch: forward 0.1 s and backward 0.2 s on each stage, a 0.1 s
    # tail. From iteration 10 the link 0-1 carries 4 MB/s: each 256-token x 64-wide fp32 message
    # (65,536 bytes) is held 16.384 ms, once forward and once backward, and Megatron's sender waits.
    import gzip
    import json

    from megatron_ext.resilience.validate import trace_case

    hold = 256 * 64 * 4 / 4e6
    path = tmp_path / "megatron-pp2-link0-1at4@10-r0.trace.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for it in range(1, 21):
            fh.write(json.dumps({
                "iteration": it, "iteration_s": 0.7 + (2 * hold if it >= 10 else 0.0),
                "layout": {"tp": 1, "pp": 2, "dp": 1, "vp": 1, "schedule": "1f1b", "num_microbatches": 1,
                           "ranks": [[0, 0, 0], [1, 0, 0]]},
                "model": {"hidden_size": 64}, "documents": [[[200, 56]]],
                "fwd_s": [[[0.1]], [[0.1]]], "bwd_s": [[[0.2]], [[0.2]]]}) + "\n")
    case = trace_case(str(path))
    assert case["slow_link"] and case["set"] == "resihp-traces"
    assert case["predicted_s"] == pytest.approx(0.7 + 2 * hold)
    assert case["composed_s"] == pytest.approx(0.7 + 2 * hold)
    assert case["rel_error"] == pytest.approx(0.0, abs=1e-12)
