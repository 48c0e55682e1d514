"""What a live run says about its injected faults, and that verdicts are printed once (by the loop)."""
from __future__ import annotations

import logging

from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.detector import make_detector
from megatron_ext.resihp.injection import FaultInjectionConfig
from megatron_ext.resihp.extension import injection_outcome
from megatron_ext.resihp.synthetic import SlowFault, SyntheticSpec, generate
from megatron_ext.resihp.verdicts import Verdict


def slow_verdict(rank: int, iteration: int, factor: float) -> Verdict:
    return Verdict(kind="fail_slow", rank=rank, stage=1, iteration=iteration, factor=factor, confidence=1.0,
                   detector="resihp")


def test_a_missed_fault_says_so_at_the_end():
    faults = FaultInjectionConfig(inject_slow=["2:30:2.0"], inject_stop=["1:60"])
    assert injection_outcome(faults, [], 50) == [
        "injected: rank 2 x2 slow from iteration 30; no verdict in 21 iterations",
        "injected: rank 1 stopped at iteration 60; no verdict"]


def test_a_named_fault_gives_iteration_and_delay():
    faults = FaultInjectionConfig(inject_slow=["2:30:2.0"])
    verdicts = [slow_verdict(3, 33, 1.4), slow_verdict(2, 36, 1.93)]  # a wrong rank first: not counted
    assert injection_outcome(faults, verdicts, 50) == [
        "injected: rank 2 x2 slow from iteration 30; named at iteration 36 (x1.93, 6 iterations later)"]
    assert injection_outcome(faults, [], 20) == [
        "injected: rank 2 x2 slow from iteration 30; never reached (the run ended at iteration 20)"]


def test_the_detector_leaves_presenting_verdicts_to_its_caller(caplog):
    spec = SyntheticSpec(stages=2, microbatches=4, iterations=80, seed=3,
                         faults=(SlowFault(rank=1, since=40, factor=3.0),))
    detector = make_detector(ResiHPConfig(resihp=True))
    found = []
    with caplog.at_level(logging.INFO, logger="megatron_ext.resihp"):
        for record in generate(spec):
            found += detector.observe(record).verdicts
    assert any(v.kind == "fail_slow" and v.rank == 1 for v in found)
    assert not [r for r in caplog.records if "fail-slow" in r.getMessage()], "the detector logged a verdict too"


def test_faults_and_verdicts_meet_on_the_device_after_a_renumbering():
    # After a permutation rank 0 is launch rank 2 (devices (2, 1, 0, 3)): the heartbeat names the
    # stopped rank 0 of its generation, and on_devices records device 2 in the verdict.
    faults = FaultInjectionConfig(inject_slow=["2:30:2.0"], inject_stop=["2:60"])
    stop = Verdict(kind="fail_stop", rank=0, stage=0, iteration=61, factor=None, confidence=1.0, detector="heartbeat")
    devices = (2, 1, 0, 3)
    moved = stop.on_devices(devices)
    assert (moved.rank, moved.launch_rank, stop.launch_rank) == (0, 2, 0)
    assert moved.on_devices((0, 1, 2, 3)) is moved  # a recorded device is never overwritten
    assert "rank 0 (launch rank 2, stage 0)" in moved.describe()
    slow = slow_verdict(0, 36, 1.9).on_devices(devices)
    assert injection_outcome(faults, [slow, moved], 70) == [
        "injected: rank 2 x2 slow from iteration 30; named at iteration 36 (x1.90, 6 iterations later)",
        "injected: rank 2 stopped at iteration 60; named by heartbeat"]
    assert injection_outcome(faults, [slow_verdict(0, 36, 1.9), stop], 70)[1].endswith("no verdict")


def test_a_slow_link_is_named_by_its_pair_in_either_order():
    faults = FaultInjectionConfig(inject_slow_link=["2:0:25:2"])
    wrong = Verdict(kind="slow_link", rank=1, stage=None, iteration=28, factor=None, confidence=1.0,
                    detector="resihp-link", detail={"launch_rank": 1, "peer_launch_rank": 3, "extra_s_per_message": 0.02})
    right = Verdict(kind="slow_link", rank=0, stage=None, iteration=31, factor=None, confidence=1.0,
                    detector="resihp-link", detail={"launch_rank": 0, "peer_launch_rank": 2, "extra_s_per_message": 0.0328})
    assert injection_outcome(faults, [wrong, right], 60) == [
        "injected: link 2-0 at 2 MB/s from iteration 25; named at iteration 31 (+32.8 ms per message, 6 iterations later)"]
    assert injection_outcome(faults, [wrong], 60) == ["injected: link 2-0 at 2 MB/s from iteration 25; no verdict in 36 iterations"]
    assert injection_outcome(faults, [], 20) == [
        "injected: link 2-0 at 2 MB/s from iteration 25; never reached (the run ended at iteration 20)"]
