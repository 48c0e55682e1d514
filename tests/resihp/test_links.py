"""Slow links: the injection's spec, the link detector on hand-made two-stage timelines (a slow link
named, a slow device not), the planner and its policy moving traffic off a named link."""
from __future__ import annotations

import re

import numpy as np
import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.injection import (ErrorFault, FaultInjectionConfig, SlowFault, SlowNicFault, StopFault, parse_error,
                                          parse_slow, parse_slow_link, parse_slow_nic, parse_stop, slow_from,
                                          slow_link_from)
from megatron_ext.resihp.links import LinkDetector, round_trips
from megatron_ext.resihp.planner import Cluster, Plan, PlanLayout, Planner, PlannerConfig, Workload, link_seconds
from megatron_ext.resihp.planner_policy import PlanPolicy
from megatron_ext.resihp.verdicts import Verdict
from tests.resihp.link_timelines import record, two_stage


def test_the_round_trip_is_the_link_not_the_waits():
    healthy = round_trips(record(two_stage(), two_stage()), members=[0, 1, 2, 3])
    assert healthy == {(0, 2): pytest.approx(0.0, abs=1e-12), (1, 3): pytest.approx(0.0, abs=1e-12)}
    slow = round_trips(record(two_stage(link_s=0.03), two_stage()), members=[0, 1, 2, 3])
    assert slow[(0, 2)] == pytest.approx(0.06) and slow[(1, 3)] == pytest.approx(0.0, abs=1e-12)
    # A slow device downstream makes stage 0 wait for its gradients, and stage 1 posts its receives
    # late: no message is in flight longer once both ends are ready.
    device = round_trips(record(two_stage(f1=0.05), two_stage()), members=[0, 1, 2, 3])
    assert device[(0, 2)] == pytest.approx(0.0, abs=1e-12)
    # Devices by launch rank: after a permutation the same link keeps its name.
    assert set(round_trips(record(two_stage(link_s=0.03), two_stage()), members=[0, 1, 3, 2])) == {(0, 3), (1, 2)}


def test_a_clock_offset_between_the_ends_does_not_make_a_link_slow():
    # An offset shifts one direction's in-flight time up and the other's down; both are clipped at
    # 0 and the slow link's figure stays within the offset.
    for offset in (-0.004, 0.004):
        rt = round_trips(record(two_stage(offset=offset), two_stage()), members=[0, 1, 2, 3])
        assert rt[(0, 2)] <= 0.0041
        slow = round_trips(record(two_stage(link_s=0.03, offset=offset), two_stage()), members=[0, 1, 2, 3])
        assert slow[(0, 2)] == pytest.approx(0.06, abs=0.0041)


def test_the_detector_names_a_slow_link_after_its_window_and_releases_it():
    det = LinkDetector(warmup=5, window=4, floor_s=0.01)
    seen = []
    for it in range(1, 31):
        link_s = 0.03 if 10 <= it < 20 else 0.0
        jitter = 0.0005 * (it % 3)
        rec = record(two_stage(link_s=link_s + jitter), two_stage(link_s=jitter), iteration=it)
        seen += [(it, v) for v in det.observe(rec, [0, 1, 2, 3], it)]
    assert [(it, v.kind, v.link) for it, v in seen] == [(12, "slow_link", (0, 2)), (23, "link_recovered", (0, 2))]
    v = seen[0][1]
    assert v.detail["extra_s_per_message"] == pytest.approx(0.03, abs=0.002)
    assert v.detail["peer_launch_rank"] == 2 and v.rank == 0 and v.factor is None
    assert v.describe().startswith("resihp[resihp-link] iteration 12: rank 0 slow link to launch rank 2 (+30.")
    assert Verdict.from_dict(v.to_dict()) == v


def test_a_slow_device_is_not_a_slow_link():
    det = LinkDetector(warmup=5, window=4)
    found = []
    for it in range(1, 31):
        rec = record(two_stage(f1=0.05 if it >= 10 else 0.01), two_stage(), iteration=it)
        found += det.observe(rec, [0, 1, 2, 3], it)
    assert found == []


def test_injection_spec_and_its_errors():
    assert parse_slow_link(slow_link_from(0, 2, 25, 2)).pair == (0, 2)
    assert parse_slow_link("3:1:5:0.5").pair == (1, 3)
    with pytest.raises(ConfigError, match=re.escape("--inject-slow-link '0:2:25': expected A:B:ITER:MBPS")):
        parse_slow_link("0:2:25")
    with pytest.raises(ConfigError, match=re.escape("need two different ranks >= 0, ITER >= 1 and 0 < MBPS < inf")):
        parse_slow_link("2:2:25:1")
    with pytest.raises(ConfigError, match=re.escape("names a pair of ranks more than once")):
        FaultInjectionConfig(inject_slow_link=["0:2:5:1", "2:0:9:3"])
    cfg = FaultInjectionConfig(inject_slow_link=["0:5:5:1"])
    assert cfg.any
    with pytest.raises(ConfigError, match=re.escape("--inject-slow-link 0:5:5:1 names rank 5, but the world has 4 "
                                                    "ranks (0..3)")):
        cfg.check_world(4)


def test_every_fault_spec_parses_to_its_fault():
    assert parse_slow(slow_from(2, 30, 1.5)) == SlowFault(2, 30, 1.5)
    assert parse_stop("3:40") == StopFault(3, 40, "start") and parse_stop("3:40:save") == StopFault(3, 40, "save")
    assert parse_error("2:5") == ErrorFault(2, 5, "value") and parse_error("2:5:collective") == ErrorFault(2, 5, "collective")
    assert parse_slow_nic("1:20:4") == SlowNicFault(1, 20, 4.0)


@pytest.mark.parametrize("parse, spec, message", [
    (parse_slow, "2:30", "--inject-slow '2:30': expected RANK:ITER:FACTOR, e.g. 2:30:1.5"),
    (parse_slow, "2:x:1.5", "--inject-slow '2:x:1.5': expected RANK:ITER:FACTOR"),
    (parse_slow, "2:30:1", "--inject-slow '2:30:1': need RANK >= 0, ITER >= 1 and FACTOR > 1"),
    (parse_stop, "3:40:step:x", "--inject-stop '3:40:step:x': expected RANK:ITER[:POINT], e.g. 3:40 or 3:40:step"),
    (parse_stop, "3:0", "--inject-stop '3:0': need RANK >= 0 and ITER >= 1"),
    (parse_stop, "3:40:stpe", "--inject-stop '3:40:stpe': POINT must be one of start, step, save, relayout, got 'stpe'"),
    (parse_error, "2", "--inject-error '2': expected RANK:ITER[:KIND], e.g. 2:5 or 2:5:collective"),
    (parse_error, "2:5:io", "--inject-error '2:5:io': KIND must be one of value, collective, got 'io'"),
    (parse_slow_nic, "1:20:0", "--inject-slow-nic '1:20:0': need RANK >= 0, ITER >= 1 and 0 < MBPS < inf"),
])
def test_every_fault_spec_error_names_the_flag_the_spec_and_the_form(parse, spec, message):
    with pytest.raises(ConfigError) as err:
        parse(spec)
    assert str(err.value).startswith(message), str(err.value)


SPEC = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000)


def planner(**knobs) -> Planner:
    return Planner(SPEC, Cluster(device_flops=100e12, memory_bytes=80e9, link_bytes_per_s=25e9, relayout_pause_s=1.0),
                   Workload(seq_length=2048), PlannerConfig(**knobs))


def test_the_planner_moves_pipeline_traffic_off_a_slow_link_without_moving_state():
    # Only the permutations (a healthy layer repartition would gain a little here too).
    p = planner(pp_repartition=False, dp_migration=False, reshape=False)
    start = PlanLayout.even(num_layers=8, tp=1, pp=2, dp=2, num_microbatches=8)   # replicas 0->2, 1->3
    ones = np.ones(4)
    healthy = p.iteration_s(start, ones, links={})
    per_mb = healthy / 5      # about one micro-batch's stage time (4 per replica)
    links = {(2, 0): per_mb}  # either order names the link
    assert link_seconds(start, {(0, 2): 1.0}).tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert p.iteration_s(start, ones, links=links) > 1.5 * healthy
    plan = p.plan(start, ones, links=links)
    assert "link_avoid" in plan.actions and plan.links == {(0, 2): per_mb}
    grid = plan.new.grid()
    pipes = {(int(grid[0, d, 0]), int(grid[1, d, 0])) for d in range(2)}
    assert (0, 2) not in pipes and (2, 0) not in pipes
    assert plan.bytes_to_move == 0
    assert plan.iteration_s_after == pytest.approx(healthy, rel=1e-6)
    assert "for link 0-2 +" in plan.describe()
    back = Plan.from_json(plan.to_json())
    assert back.links == plan.links and back.new == plan.new


def test_the_policy_acts_on_a_link_verdict_and_forgets_it_after_the_recovery_clock():
    p = planner()
    start = PlanLayout.even(num_layers=8, tp=1, pp=2, dp=2, num_microbatches=8)
    pol = PlanPolicy(p, start, 4, recover_after=5)
    extra = p.iteration_s(start, np.ones(4), links={}) / 5
    slow = Verdict(kind="slow_link", rank=0, stage=None, iteration=10, factor=None, confidence=1.0,
                   detector="resihp-link", detail={"launch_rank": 0, "peer_launch_rank": 2, "extra_s_per_message": extra})
    plan = pol.observe(10, [slow])
    assert plan is not None and "link_avoid" in plan.actions and pol.links == {(0, 2): extra}
    assert pol.observe(11, [slow]) is None          # the same belief: nothing to re-plan
    carried = PlanPolicy(p, pol.layout, 4, recover_after=5)
    carried.restore(pol.beliefs())
    assert carried.links == pol.links
    rec = Verdict(kind="link_recovered", rank=0, stage=None, iteration=20, factor=None, confidence=1.0,
                  detector="resihp-link", detail={"launch_rank": 2, "peer_launch_rank": 0})
    assert pol.update_beliefs(20, [rec]) == []
    assert pol.update_beliefs(24) == [] and pol.update_beliefs(25) == ["link 0-2 healthy since iteration 20"]
    assert pol.links == {}
    bad = Verdict(**{**slow.to_dict(), "detail": {"launch_rank": 0, "peer_launch_rank": 2}})
    with pytest.raises(Exception, match=re.escape("slow_link verdict for devices (0, 2) at iteration 10 has no usable "
                                                  "extra_s_per_message (0.0)")):
        pol.update_beliefs(30, [bad])
