"""The planner and its policy acting on a slow NIC: the data-parallel ring's gradient all-reduce
waits for its slowest member's NIC, so the planner replaces the device behind it by a spare, or,
with no spare, moves layers off the stage whose ring is slow."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.planner import (Cluster, Plan, PlanLayout, Planner, PlannerConfig, PlanningError, Workload,
                                         ring_factors)
from megatron_ext.resihp.planner_policy import PlanPolicy
from megatron_ext.resihp.verdicts import Verdict

M350 = ModelSpec(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304)
LINK = 25e9
ONLY = dict(tp_regroup=False, pp_repartition=False, dp_migration=False, drop_replicas=False, grow_replicas=False,
            reshape=False)


def planner(**cfg) -> Planner:
    cl = Cluster(device_flops=150e12, memory_bytes=80e9, link_bytes_per_s=LINK, relayout_pause_s=10.0,
                 tp_bytes_per_s=300e9)
    return Planner(M350, cl, Workload(seq_length=2048), PlannerConfig(**{"horizon_iterations": 1000, **cfg}))


START = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)   # stage 0: devices 0, 1


def nic(rank: int, it: int, mbps: float | None, kind: str = "slow_nic") -> Verdict:
    return Verdict(kind=kind, rank=rank, stage=None, iteration=it, factor=None, confidence=1.0, detector="resihp-nic",
                   detail={} if mbps is None else {"mbps": mbps})


def test_a_slow_nic_slows_the_rings_of_its_stage_only():
    assert ring_factors(START, {1: LINK / 4}, LINK).tolist() == [4.0, 1.0]
    assert ring_factors(START, {3: LINK / 2, 2: LINK / 8}, LINK).tolist() == [1.0, 8.0]
    assert ring_factors(START, {1: 2 * LINK}, LINK).tolist() == [1.0, 1.0]        # no faster than the link
    one_replica = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=1, num_microbatches=16)
    assert ring_factors(one_replica, {1: LINK / 4}, LINK).tolist() == [1.0, 1.0]   # no ring, nothing to wait for
    p, ones = planner(), np.ones(4)
    healthy, slow = p.iteration_s(START, ones), p.iteration_s(START, ones, nics={1: LINK / 10})
    assert slow > 1.5 * healthy
    assert p.iteration_s(START, ones, nics={1: LINK}) == healthy
    # What it adds is stage 0's all-reduce, nine more times over.
    tail = p.iteration_s(START, ones, nics={1: LINK / 2}) - healthy
    assert slow - healthy == pytest.approx(9 * tail, rel=1e-9)


def test_the_planner_replaces_the_device_behind_a_slow_nic_by_a_spare():
    # Same shape (with every knob, it takes PP6 x DP1 over all six: no ring left to wait for).
    assert planner().plan(START, np.ones(6), nics={1: LINK / 10}).new.dp == 1
    p = planner(reshape=False)
    sp = np.ones(6)                                    # devices 4 and 5 are spares
    plan = p.plan(START, sp, nics={1: LINK / 10})
    assert plan is not None and 1 not in plan.new.devices and plan.new.devices[0] == 0
    assert "replace" in plan.actions and plan.nics == {1: LINK / 10}
    assert plan.iteration_s_after <= p.iteration_s(START, sp) * (1 + 1e-9)    # as fast as with a healthy NIC
    assert plan.iteration_s_after < plan.iteration_s_before / 1.5
    # A faster device beats a better NIC: a slow device is not swapped in for a healthy one.
    sp2 = np.ones(6)
    sp2[4:] = 0.5
    plan = p.plan(START, sp2, nics={1: LINK / 10})
    assert plan is None or 4 not in plan.new.devices and 5 not in plan.new.devices


def test_without_a_spare_layers_leave_the_stage_whose_ring_is_slow():
    p = planner(**{**ONLY, "pp_repartition": True})
    plan = p.plan(START, np.ones(4), nics={0: LINK / 20})
    assert plan is not None and plan.actions == ("pp_repartition",) and plan.new.devices == START.devices
    assert plan.new.stage_layers[0] < plan.new.stage_layers[1]
    slow_on_1 = p.plan(START, np.ones(4), nics={3: LINK / 20})
    assert slow_on_1.new.stage_layers[1] < slow_on_1.new.stage_layers[0]


def test_a_reshape_that_leaves_a_slow_nic_out_is_not_pruned_by_the_bound():
    # Eight devices, four of them spares, the last behind a slow NIC. A closed-form bound blind to
    # NICs ranks a shape over every device above one over the seven without the slow NIC (more
    # devices, same speeds); with one shape kept per search, the shapes over the seven were never
    # scored (no plan at all). The bound charges the slow NIC to the ring: a bigger shape leaving
    # device 7 out of every ring.
    p = planner(**{**ONLY, "reshape": True, "max_reshapes": 1})
    plan = p.plan(START, np.ones(8), nics={7: LINK / 50})
    assert plan is not None and "reshape" in plan.actions, plan
    assert 7 not in plan.new.devices and len(plan.new.devices) > len(START.devices)
    assert plan.iteration_s_after < p.iteration_s(START, np.ones(8)) / 1.3


def test_the_policy_keeps_a_slow_nic_until_it_has_recovered_for_long_enough():
    # (no DP growth: the recovered device and the last spare would make a third replica)
    p = planner(reshape=False, grow_replicas=False)
    pol = PlanPolicy(p, START, 6, recover_after=30)
    plans = {}
    for it in range(120):
        vs = {10: [nic(1, 10, LINK / 10 / 1e6)], 20: [nic(1, 20, None, "nic_recovered")],
              25: [nic(1, 25, LINK / 10 / 1e6)], 40: [nic(1, 40, None, "nic_recovered")]}.get(it, [])
        if it == 45:
            handed = json.loads(json.dumps(pol.beliefs()))
            assert handed == {"speeds": {}, "recovering": {}, "nics": {"1": LINK / 10}, "nics_recovering": {"1": 40},
                              "chosen": True}
            pol2 = PlanPolicy(p, pol.layout, 6, recover_after=30)
            pol2.restore(handed)
            pol = pol2
        plan = pol.observe(it, vs)
        if plan is not None:
            plans[it] = plan
    # One re-layout at the verdict; the NIC counts as healthy 30 iterations after the last
    # 'nic_recovered', when the spare already holds the slot: nothing to gain by going back.
    assert sorted(plans) == [10] and 1 not in plans[10].new.devices
    assert pol.nics == {}


def test_a_slow_nic_verdict_without_a_bandwidth_is_an_error_naming_it():
    pol = PlanPolicy(planner(), START, 4)
    with pytest.raises(PlanningError, match=re.escape(
            "slow_nic verdict for device 1 at iteration 7 has no usable bandwidth (detail mbps None)")):
        pol.observe(7, [nic(1, 7, None)])
    with pytest.raises(PlanningError, match=re.escape(
            "slow NIC of device 9 at 1000000.0 bytes/s: need a device of the 4 known and a finite bandwidth > 0")):
        planner().plan(START, np.ones(4), nics={9: 1e6})


def test_plan_json_carries_the_nics_and_the_log_line_names_them():
    plan = planner(reshape=False).plan(START, np.ones(6), nics={1: LINK / 10})
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.nics == {1: LINK / 10}
    assert "for NIC 1 2.5 GB/s:" in plan.describe()


def test_a_slow_nic_also_holds_its_devices_pipeline_messages():
    # PP4 x DP1: no ring; device 1's sends to both neighbours cross its NIC, as two slow links would.
    p = planner()
    pipe = PlanLayout.even(num_layers=24, tp=1, pp=4, dp=1, num_microbatches=16)
    ones = np.ones(4)
    msg = 2.0 * 2048 * 1024                            # a micro-batch's bf16 activations
    extra = msg / (LINK / 10) - msg / LINK
    with_nic = p.iteration_s(pipe, ones, nics={1: LINK / 10})
    assert with_nic > p.iteration_s(pipe, ones)
    assert with_nic == pytest.approx(p.iteration_s(pipe, ones, links={(0, 1): extra, (1, 2): extra}), rel=1e-12)
    # A link verdict measured across the slow NIC is the NIC: the larger figure counts, not both.
    assert p.iteration_s(pipe, ones, links={(0, 1): extra / 2}, nics={1: LINK / 10}) == pytest.approx(with_nic, rel=1e-12)


def test_the_memory_model_is_told_the_replicas_so_a_sharded_optimizer_fits():
    # A distributed optimizer: state sharded over the replicas. The layout fits at DP 2 and not at
    # DP 1: the planner asks with each candidate's own DP, so a same-shape fix is a candidate and a
    # shrink to one replica is not.
    seen = []

    def sharded(spec, workload, tp, pp, layers, dp):
        seen.append(dp)
        return np.full(pp, 60e9 if dp == 1 else 40e9)

    cl = Cluster(device_flops=150e12, memory_bytes=50e9, link_bytes_per_s=LINK, relayout_pause_s=10.0,
                 tp_bytes_per_s=300e9)
    p = Planner(M350, cl, Workload(seq_length=2048), PlannerConfig(horizon_iterations=1000, reshape=False),
                memory_model=sharded)
    assert p.fits(START, cl.memory_of(6)) and 2 in seen
    plan = p.plan(START, np.ones(6), nics={1: LINK / 10})
    assert plan is not None and plan.new.dp == 2 and 1 not in plan.new.devices
    sp = np.ones(4)
    sp[1] = 0.0                                        # a loss: no room for one replica alone
    with pytest.raises(PlanningError, match="no layout runs without rank"):
        p.plan(START, sp)
