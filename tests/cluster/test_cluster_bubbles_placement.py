"""Bubble resources (slots, memory, speed, displacement, the tuning scenario) and placement rules."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cluster.bubbles import bubble_fraction_from_timeline, host_slots
from megatron_ext.cluster.tuning import TuningScenario, run_tuning_scenario
from megatron_ext.cluster.cluster import NodePool
from megatron_ext.cluster.engine import VCSimulator
from megatron_ext.cluster.state import JobState
from megatron_ext.cluster.policies import noisy_estimates
from megatron_ext.cluster.trace import VCSpec
from megatron_ext.config.base import ConfigError
from tests.cluster import helios_reference as ref
from tests.cluster.cluster_helpers import cfg, job


def test_bubble_fraction_from_schedule_or_measurement():
    assert job("p", 0, 1, 8, kind="pipeline", pp_stages=4, micro_batches=8).bubble == pytest.approx(3 / 11)
    assert job("p", 0, 1, 8, kind="pipeline", pp_stages=8, micro_batches=1).bubble == pytest.approx(7 / 8)
    assert job("p", 0, 1, 8, kind="pipeline", pp_stages=4, micro_batches=8, bubble_fraction=0.1).bubble == 0.1
    assert job("t", 0, 1, 8, kind="train").bubble == 0.0


def test_bubble_fraction_from_a_measured_timeline():
    # stage busy 0-3, 2-6 (overlap counted once) and 8-9 in a 10 s window: 7 s busy
    assert bubble_fraction_from_timeline([(0, 3), (2, 6), (8, 9)], 0, 10) == pytest.approx(0.3)
    assert bubble_fraction_from_timeline([(-5, 20)], 0, 10) == 0.0
    assert bubble_fraction_from_timeline([], 0, 10) == 1.0
    # a 1F1B stage of p=4, m=8 with unit forward/backward: busy 2m of the 2(m+p-1) iteration
    p, m = 4, 8
    assert bubble_fraction_from_timeline([(3 + k, 4 + k) for k in range(2 * m)], 0, 2 * (m + p - 1)) == \
        pytest.approx((p - 1) / (m + p - 1))


def test_host_slots_memory_per_stage_and_speed_cap():
    host = JobState(job("p", 0, 100, 8, kind="pipeline", pp_stages=4, micro_batches=8, mem_gb=40, act_mem_gb=8), 0)
    slots = host_slots(host, bubble_speed=0.15, gpu_mem_gb=80)
    # 1F1B: stage s holds min(p - s, m) micro-batches -> 72, 64, 56, 48 GB used; 2 GPUs per stage
    assert [s.spare_gb for s in slots] == [8, 8, 16, 16, 24, 24, 32, 32]
    assert all(s.speed == 0.15 for s in slots)
    thin = JobState(job("q", 0, 100, 2, kind="pipeline", pp_stages=2, micro_batches=64), 0)
    assert [s.speed for s in host_slots(thin, 0.15, 80)] == pytest.approx([1 / 65, 1 / 65])  # capped by b


def test_trials_use_only_slots_with_room_and_at_bubble_speed():
    # one 4-GPU pipeline job fills the only node; two trials: one fits the roomy stages only
    jobs = [job("gpt", 0, 10_000, 4, kind="pipeline", pp_stages=4, micro_batches=8, mem_gb=40, act_mem_gb=8),
            job("t-small", 0, 150, 1, kind="hpo", mem_gb=20), job("t-big", 0, 150, 1, kind="hpo", mem_gb=33)]
    r = VCSimulator(VCSpec("vc", 1, 4), jobs, cfg(policy="fifo"), record=True).run()
    small, big = r.states[1], r.states[2]
    assert (small.start, small.end) == (0, pytest.approx(1000.0))  # 150 s of work at 0.15
    assert small.bubble_s == pytest.approx(1000.0)
    assert big.start == 10_000  # no stage has 33 GB spare: it waits for exclusive GPUs
    slot = next(seg[4] for seg in r.segments if seg[0] == "t-small")
    assert slot.spare_gb >= 20 and slot.stage >= 2


def test_guest_displaced_when_host_ends_then_finishes_exclusively():
    jobs = [job("gpt", 0, 100, 2, kind="pipeline", pp_stages=2, micro_batches=2),  # b = 1/3 -> speed .15
            job("trial", 0, 60, 1, kind="hpo")]
    r = VCSimulator(VCSpec("vc", 1, 2), jobs, cfg(policy="fifo"), record=True).run()
    trial = r.states[1]
    # 100 s as a guest = 15 s of work; displaced at 100 (+7 s restart), then 52 s exclusive
    assert trial.preemptions == 1 and trial.bubble_s == pytest.approx(100.0)
    assert trial.end == pytest.approx(100 + 60 - 15 + 7)


def test_guest_migrates_to_a_freed_gpu():
    jobs = [job("gpt", 0, 10_000, 2, kind="pipeline", pp_stages=2, micro_batches=2),
            job("blocker", 0, 50, 1), job("trial", 0, 200, 1, kind="hpo")]
    r = VCSimulator(VCSpec("vc", 1, 3), jobs, cfg(policy="fifo"), record=True).run()
    trial = r.states[2]
    # guest for 50 s (7.5 s of work), then the blocker's GPU frees: migrate (+7 s), run the rest
    assert trial.end == pytest.approx(50 + 200 - 7.5 + 7)
    assert trial.preemptions == 0 and trial.restart_s == 7


def test_without_bubbles_trials_run_only_exclusively():
    jobs = [job("gpt", 0, 10_000, 2, kind="pipeline", pp_stages=2, micro_batches=2), job("trial", 0, 60, 1, kind="hpo")]
    r = VCSimulator(VCSpec("vc", 1, 2), jobs, cfg(policy="fifo"), use_bubbles=False).run()
    assert r.states[1].start == 10_000 and r.bubble_gpu_s == 0


def test_tuning_scenario_makespans():
    scn = TuningScenario()
    out = run_tuning_scenario(scn, cfg())
    # exclusive only: the trials run back to back on the single GPU
    durations = [j.duration for j in scn.jobs() if j.kind == "hpo"]
    assert out["makespan_exclusive_s"] == pytest.approx(sum(durations))
    assert out["usable_bubble_slots"] == 16 and out["guest_speed"] == 0.15
    # bubbles add at most 16 x 0.15 GPUs of throughput to the one exclusive GPU
    assert 1.0 < out["makespan_ratio"] <= 1 + 16 * 0.15
    more = run_tuning_scenario(TuningScenario(scenario_trial_mem_gb=10.0), cfg())  # 24 usable slots
    assert more["usable_bubble_slots"] == 24 and more["makespan_ratio"] > out["makespan_ratio"]
    none = run_tuning_scenario(TuningScenario(scenario_trial_mem_gb=60.0), cfg())  # fits nowhere
    assert none["usable_bubble_slots"] == 0 and none["makespan_ratio"] == 1.0


def test_tuning_scenario_validation():
    with pytest.raises(ConfigError, match="exceed the scenario's 40 GPUs"):
        TuningScenario(scenario_pipeline_jobs=2)
    with pytest.raises(ConfigError, match="is not a multiple of --scenario-pp-stages"):
        TuningScenario(scenario_pipeline_gpus=30)


@settings(max_examples=300, deadline=None)
@given(gpn=st.sampled_from([2, 4, 8]), free=st.lists(st.integers(0, 8), min_size=1, max_size=6),
       gpus=st.integers(1, 40))
def test_consolidate_matches_the_reference_placer(gpn, free, gpus):
    free = [min(f, gpn) for f in free]
    pool = NodePool(len(free), gpn)
    pool.take([(i, gpn - f) for i, f in enumerate(free) if gpn - f])
    assert pool.place_consolidate(gpus) == ref._place(list(free), gpn, gpus)


@settings(max_examples=200, deadline=None)
@given(gpn=st.sampled_from([2, 4, 8]), free=st.lists(st.integers(0, 8), min_size=1, max_size=6),
       gpus=st.integers(1, 40), rule=st.sampled_from(["consolidate_first", "scatter"]))
def test_fallback_placements_use_free_gpus_only(gpn, free, gpus, rule):
    free = [min(f, gpn) for f in free]
    pool = NodePool(len(free), gpn)
    pool.take([(i, gpn - f) for i, f in enumerate(free) if gpn - f])
    alloc = pool.place(gpus, rule)
    if gpus > sum(free):
        assert alloc is None
        return
    assert alloc is not None and sum(n for _, n in alloc) == gpus
    assert all(0 < n <= free[i] for i, n in alloc) and len({i for i, _ in alloc}) == len(alloc)
    if rule == "scatter":  # spread: no node gets two more GPUs than another that still had room
        counts = dict(alloc)
        for i, n in alloc:
            for j, f in enumerate(free):
                if counts.get(j, 0) < f:
                    assert n <= counts.get(j, 0) + 1


def test_pool_refuses_over_allocation_and_double_release():
    pool = NodePool(1, 4)
    pool.take([(0, 3)])
    with pytest.raises(RuntimeError, match="over-allocation: node 0 has 1 free GPUs, asked 2"):
        pool.take([(0, 2)])
    pool.release([(0, 3)])
    with pytest.raises(RuntimeError, match="double release: node 0 would have 5 > 4 free GPUs"):
        pool.release([(0, 1)])


def test_noisy_estimator_follows_the_helios_error_bands():
    d = np.full(200_000, 1000.0)
    err = np.abs(noisy_estimates(d, seed=3) - d) / d
    for bound, share in ((0.1, 0.1), (0.5, 0.5), (1.0, 0.7), (10.0, 0.9), (100.0, 1.0)):
        assert np.mean(err <= bound + 1e-9) == pytest.approx(share, abs=0.01)
    assert (noisy_estimates(d, seed=3) == noisy_estimates(d, seed=3)).all()


def test_guest_speed_from_a_squeezer_run_figures(tmp_path):
    import json

    from megatron_ext.cluster.config import ClusterSimConfig

    run = tmp_path / "squeeze"
    run.mkdir()
    # two ranks: 40 % of 10 s and 10 % of 30 s of bubbles used -> 0.175 weighted by bubble time
    (run / "figures_rank0.json").write_text(json.dumps({"bubble_used": 0.4, "window_s": 10.0}))
    (run / "figures_rank1.json").write_text(json.dumps({"bubble_used": 0.1, "window_s": 30.0}))
    c = ClusterSimConfig(bubble_speed_from=str(run))
    assert c.work_per_bubble_s == pytest.approx(0.175)
    host = JobState(job("p", 0, 100, 2, kind="pipeline", pp_stages=2, micro_batches=4), 0)   # b = 0.2
    assert [s.speed for s in host_slots(host, c.bubble_speed, 80, c.work_per_bubble_s)] == \
        pytest.approx([0.175 * 0.2] * 2)
    assert c.guest_speed(0.2) == pytest.approx(0.035) and ClusterSimConfig().guest_speed(0.2) == 0.15
    # the benchmark's measured figure wins over the training run's in-window share
    (run / "figures_rank0.json").write_text(json.dumps({"work_per_bubble_s": 0.3, "bubble_used": 0.9}))
    assert ClusterSimConfig(bubble_speed_from=str(run / "figures_rank0.json")).work_per_bubble_s == 0.3


def test_bad_squeezer_figures_are_one_line_errors(tmp_path):
    from megatron_ext.cluster.config import ClusterSimConfig

    with pytest.raises(ConfigError, match="holds no figures_rank"):
        ClusterSimConfig(bubble_speed_from=str(tmp_path))
    bad = tmp_path / "figures_rank0.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=r"figures_rank0.json: not JSON"):
        ClusterSimConfig(bubble_speed_from=str(bad))
    bad.write_text('{"bubble_used": 3}')
    with pytest.raises(ConfigError, match=r"no work_per_bubble_s or bubble_used in \[0, 1\]"):
        ClusterSimConfig(bubble_speed_from=str(bad))
    with pytest.raises(ConfigError, match="No such file"):
        ClusterSimConfig(bubble_speed_from=str(tmp_path / "missing.json"))
