"""The planner and its policy acting on a slow network path between two devices: it slows the
data-parallel ring that has the two as neighbours (and pipeline messages between them), so the
planner reorders the replicas so that no ring hop crosses it, or, where every order keeps them
neighbours, moves one end to another ring."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ext.resihp.planner import (Plan, PlanLayout, PlanningError, Workload, ring_factors, ring_order,
                                         state_move_bytes)
from megatron_ext.resihp.planner_policy import PlanPolicy
from megatron_ext.resihp.verdicts import Verdict
from tests.resihp.test_nic_planner import LINK, M350, ONLY, planner


DP4 = PlanLayout.even(num_layers=24, tp=1, pp=1, dp=4, num_microbatches=16)      # ring 0-1-2-3-0


def ring_hops(layout: PlanLayout) -> set[tuple[int, int]]:
    grid = layout.grid()
    pp, dp, tp = grid.shape
    return {tuple(sorted((int(grid[s, d, t]), int(grid[s, (d + 1) % dp, t]))))
            for s in range(pp) for d in range(dp) for t in range(tp) if dp > 1}


def path(a: int, b: int, it: int, mbps: float | None, kind: str = "slow_path") -> Verdict:
    detail = {"launch_rank": a, "peer_launch_rank": b}
    if mbps is not None:
        detail["mbps"] = mbps
    return Verdict(kind=kind, rank=a, stage=None, iteration=it, factor=None, confidence=1.0, detector="resihp-nic",
                   detail=detail)


def test_a_slow_path_slows_only_the_ring_that_has_its_devices_as_neighbours():
    assert ring_factors(DP4, None, LINK, {(0, 1): LINK / 4}).tolist() == [4.0]
    assert ring_factors(DP4, None, LINK, {(3, 0): LINK / 4}).tolist() == [4.0]     # the ring is closed
    assert ring_factors(DP4, None, LINK, {(0, 2): LINK / 4}).tolist() == [1.0]     # not neighbours
    assert ring_factors(DP4, {1: LINK / 2}, LINK, {(0, 1): LINK / 4}).tolist() == [4.0]
    assert ring_factors(DP4, {1: LINK / 8}, LINK, {(0, 1): LINK / 4}).tolist() == [8.0]
    pp2 = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)   # rings (0, 1) and (2, 3)
    assert ring_factors(pp2, None, LINK, {(2, 3): LINK / 4}).tolist() == [1.0, 4.0]
    p, ones = planner(), np.ones(4)
    healthy = p.iteration_s(DP4, ones)
    assert p.iteration_s(DP4, ones, paths={(0, 2): LINK / 10}) == healthy
    assert p.iteration_s(DP4, ones, paths={(0, 1): LINK / 10}) > 1.2 * healthy
    # The same bandwidth on a NIC of one end costs the ring the same.
    assert p.iteration_s(DP4, ones, paths={(0, 1): LINK / 10}) == pytest.approx(
        p.iteration_s(DP4, ones, nics={1: LINK / 10}), rel=1e-12)


def test_ring_order_takes_the_slow_pair_apart_and_moves_nothing():
    new = ring_order(DP4, {(0, 1): LINK / 4}, LINK)
    assert (0, 1) not in ring_hops(new) and sorted(new.devices) == [0, 1, 2, 3]
    assert ring_factors(new, None, LINK, {(0, 1): LINK / 4}).tolist() == [1.0]
    n = 4
    assert state_move_bytes(DP4, new, M350, Workload(seq_length=2048), n).sum() == 0
    # Two slow paths from one device: 0-1 and 0-3 leave 0 with one healthy neighbour (2) in a ring
    # of 4, which needs two: the best order keeps one slow hop.
    two = ring_order(DP4, {(0, 1): LINK / 4, (0, 3): LINK / 2}, LINK)
    assert ring_factors(two, None, LINK, {(0, 1): LINK / 4, (0, 3): LINK / 2}).tolist() == [2.0]
    # Nothing to gain: the order stays.
    assert ring_order(DP4, {(0, 2): LINK / 4}, LINK) is DP4
    three = PlanLayout.even(num_layers=24, tp=1, pp=1, dp=3, num_microbatches=12)
    assert ring_order(three, {(0, 1): LINK / 4}, LINK) is three              # every pair is a hop


@pytest.mark.parametrize("dp", [6, 12])
def test_ring_order_beyond_the_exhaustive_search_avoids_every_slow_pair_it_can(dp):
    lay = PlanLayout.even(num_layers=24, tp=2, pp=2, dp=dp, num_microbatches=4 * dp)
    grid = lay.grid()
    # Slow paths between consecutive replicas' stage-1 devices at TP rank 0, three of them.
    slow = {tuple(sorted((int(grid[1, d, 0]), int(grid[1, d + 1, 0])))): LINK / 5 for d in (0, 2, 4)}
    new = ring_order(lay, slow, LINK)
    assert ring_factors(new, None, LINK, slow).tolist() == [1.0, 1.0]
    assert sorted(new.devices) == sorted(lay.devices)
    # Replicas move whole: every replica of the new layout is one of the old ones.
    old_reps = {tuple(grid[:, d, :].reshape(-1).tolist()) for d in range(dp)}
    assert {tuple(new.grid()[:, d, :].reshape(-1).tolist()) for d in range(dp)} == old_reps


def test_the_planner_reorders_the_ring_around_a_slow_path():
    p = planner(**ONLY)
    ones = np.ones(4)
    plan = p.plan(DP4, ones, paths={(1, 2): LINK / 20})
    assert plan is not None and plan.actions == ("ring_order",), plan
    assert (1, 2) not in ring_hops(plan.new)
    assert plan.iteration_s_after == pytest.approx(p.iteration_s(DP4, ones), rel=1e-12)   # as if healthy
    assert plan.bytes_to_move == 0 and plan.paths == {(1, 2): LINK / 20}
    assert "path 1-2" in plan.describe()
    back = Plan.from_json(json.dumps(plan.to_dict()))
    assert back.paths == plan.paths and back.new == plan.new


def test_where_no_order_helps_one_end_moves_to_another_ring():
    # PP2 x DP2: the rings are (0, 1) at stage 0 and (2, 3) at stage 1; a slow path 0-1 is a hop of
    # any order. Swapping device 1 with its replica's stage-1 device (3) puts 0 and 1 on different
    # rings: 0-3 and 1-2, where 1-2 is no pipeline hop either (1 and 2 are in different replicas).
    pp2 = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)
    p = planner(**ONLY)
    plan = p.plan(pp2, np.ones(4), paths={(0, 1): LINK / 50})
    assert plan is not None and plan.actions == ("path_avoid",)
    assert (0, 1) not in ring_hops(plan.new)
    assert ring_factors(plan.new, None, LINK, {(0, 1): LINK / 50}).tolist() == [1.0, 1.0]
    assert plan.bytes_to_move > 0                    # the swapped ends hold other layers now


def test_a_slow_path_between_pipeline_neighbours_is_charged_to_their_messages():
    pp2 = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)     # hops 0-2 and 1-3
    p, ones = planner(), np.ones(4)
    healthy = p.iteration_s(pp2, ones)
    assert p.iteration_s(pp2, ones, paths={(0, 2): LINK / 1000}) > 1.1 * healthy
    assert p.iteration_s(pp2, ones, paths={(0, 3): LINK / 1000}) == healthy     # neither a hop nor a ring pair


def test_the_policy_believes_a_slow_path_at_once_and_its_recovery_after_the_clock():
    pol = PlanPolicy(planner(**ONLY), DP4, 4, recover_after=5)
    plan = pol.observe(10, [path(2, 1, 10, LINK / 20 / 1e6)])
    assert pol.paths == {(1, 2): pytest.approx(LINK / 20)}
    assert plan is not None and plan.actions == ("ring_order",) and pol.layout == plan.new
    assert pol.observe(11, [path(1, 2, 11, LINK / 20 / 1e6)]) is None            # same belief: nothing
    beliefs = pol.beliefs()
    assert beliefs["paths"] == {"1-2": pytest.approx(LINK / 20)}
    other = PlanPolicy(planner(**ONLY), pol.layout, 4, recover_after=5)
    other.restore(json.loads(json.dumps(beliefs)))
    assert other.paths == pol.paths
    pol.observe(20, [path(1, 2, 20, None, kind="path_recovered")])
    assert pol.paths and pol.update_beliefs(24) == []
    assert pol.update_beliefs(25) == ["path 1-2 healthy since iteration 20"] and pol.paths == {}


def test_a_path_verdict_without_a_bandwidth_or_with_one_device_is_refused():
    pol = PlanPolicy(planner(**ONLY), DP4, 4)
    with pytest.raises(PlanningError, match=r"slow_path verdict for devices \(1, 2\) at iteration 3 has no usable "
                                            r"bandwidth \(detail mbps None\)"):
        pol.observe(3, [path(1, 2, 3, None)])
    with pytest.raises(PlanningError, match=r"names devices \(2, 2\)"):
        pol.observe(3, [path(2, 2, 3, 10.0)])
    with pytest.raises(PlanningError, match=r"slow path \(0, 9\) at 1000.0 bytes/s: need two devices of the 4 known"):
        planner().plan(DP4, np.ones(4), paths={(0, 9): 1e3})
