"""Slow NICs (``megatron_ext/resihp/nic.py``): the ring probe's egress times, the detector's verdicts
on hand-made probes, the injection flag and the engine's refusal."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.resihp.injection import FaultInjectionConfig, parse_slow_nic
from megatron_ext.resihp.links import LinkDetector
from megatron_ext.resihp.nic import NicDetector, egress_times
from megatron_ext.resihp.verdicts import Verdict
from tests.resihp.link_timelines import record, two_stage

BASE = 0.002


def probe(world: int, slow: dict[int, float] | None = None, jitter: float = 0.0, rng=None) -> list[tuple[float, float]]:
    """What ``ring_probe`` returns on each rank when device r's sends take ``BASE + slow[r]`` (each
    round starts after a barrier: one hold per message)."""
    slow = slow or {}
    rng = rng or np.random.default_rng(0)
    out = []
    for r in range(world):
        prev, nxt = (r - 1) % world, (r + 1) % world
        from_prev = BASE + slow.get(prev, 0.0)                                 # round 1: prev's send to its next
        from_next = BASE + slow.get(nxt, 0.0)                                  # round 2: next's send to its previous
        out.append((from_prev + jitter * rng.random(), from_next + jitter * rng.random()))
    return out


def test_egress_is_the_faster_of_a_devices_two_messages():
    eg = egress_times(probe(4, {2: 0.05}))
    assert eg == pytest.approx([BASE, BASE, BASE + 0.05, BASE])
    # A ring of two: both messages go to the same neighbour.
    assert egress_times(probe(2, {1: 0.03})) == pytest.approx([BASE, BASE + 0.03])
    assert egress_times([(0.0, 0.0)]).tolist() == [0.0]


def test_a_slow_nic_is_named_after_the_window_and_released_after_it():
    det = NicDetector(nbytes=65536, warmup=5, window=4, floor_s=0.01)
    members = [0, 1, 2, 3]
    rng = np.random.default_rng(1)
    got = {}
    for it in range(1, 30):
        slow = {2: 0.033} if 10 <= it < 20 else {}
        for v in det.observe(probe(4, slow, jitter=5e-4, rng=rng), members, it):
            got.setdefault(v.kind, []).append(v)
    (named,) = got["slow_nic"]
    assert (named.launch_rank, named.rank, named.iteration) == (2, 2, 12)     # 3 of the last 4 probes flagged
    assert named.detail["extra_s_per_message"] == pytest.approx(0.033, abs=1e-3)
    assert named.detail["mbps"] == pytest.approx(65536 / 0.033 / 1e6, rel=0.05)
    (back,) = got["nic_recovered"]
    assert (back.launch_rank, back.iteration) == (2, 23)
    assert det.known_slow() == {}
    assert "rank 2 slow NIC (+32.9 ms per 64 KB probe message, about 1.989 MB/s" in named.describe()


def test_devices_keep_their_record_when_ranks_are_renumbered_and_neighbours_are_not_named():
    det = NicDetector(nbytes=65536, warmup=3, window=3, floor_s=0.01)
    for it in range(1, 4):
        det.observe(probe(4), [0, 1, 2, 3], it)
    # launch rank 2 now sits at rank 0 (a permutation): its sends are slow there
    verdicts = [v for it in range(4, 8) for v in det.observe(probe(4, {0: 0.02}), [2, 0, 3, 1], it)]
    assert [(v.kind, v.launch_rank, v.rank) for v in verdicts] == [("slow_nic", 2, 0)]
    assert det.known_slow() == {2: pytest.approx(0.02, abs=1e-6)}


def test_a_link_verdict_a_suspected_nic_may_explain_waits_for_the_nic_probe():
    # Device 2's NIC slows its link to 0 from iteration 10, but the probe misses iteration 10: the
    # link watch convicts at 12 and the NIC watch at 13. Link 1-3 is slow by itself; device 3's
    # probe is flagged once (noise) at 12, the iteration that link is convicted.

    def run(with_nics: bool):
        links, nics = LinkDetector(warmup=5, window=4, floor_s=0.01), NicDetector(nbytes=65536, warmup=5, window=4)
        out = []
        for it in range(1, 16):
            slow = {2: 0.033} if it >= 11 else {}
            if it == 12:
                slow[3] = 0.02
            found = nics.observe(probe(4, slow), [0, 1, 2, 3], it)
            delay = 0.033 if it >= 10 else 0.0
            rec = record(two_stage(link_s=delay), two_stage(link_s=delay), iteration=it)
            found += links.observe(rec, [0, 1, 2, 3], it, nics=nics if with_nics else None)
            out += [(it, v.kind, v.link or v.launch_rank) for v in found]
        return out, links

    alone, _ = run(False)
    assert alone == [(12, "slow_link", (0, 2)), (12, "slow_link", (1, 3)), (13, "slow_nic", 2)]
    after, links = run(True)
    # 0-2 waits for device 2's NIC and follows its verdict; 1-3 waits one probe for device 3's
    # to come back clean
    assert after == [(13, "slow_nic", 2), (13, "slow_link", (0, 2)), (13, "slow_link", (1, 3))]
    assert links.held == []
    # A link that recovers while its verdict waits: neither verdict goes out.
    nics = NicDetector(nbytes=65536, warmup=1, window=2)
    for it in (1, 2):
        nics.observe(probe(4, {2: 0.05} if it == 2 else {}), [0, 1, 2, 3], it)
    assert nics.suspect(2) and not nics.suspect(0)
    slow = Verdict(kind="slow_link", rank=0, stage=None, iteration=2, factor=None, confidence=1.0,
                   detector="resihp-link", detail={"launch_rank": 0, "peer_launch_rank": 2, "extra_s_per_message": 0.03})
    back = Verdict(kind="link_recovered", rank=0, stage=None, iteration=3, factor=None, confidence=1.0,
                   detector="resihp-link", detail={"launch_rank": 0, "peer_launch_rank": 2})
    det = LinkDetector()
    assert det._after_nics([slow], nics) == [] and det.held == [slow]
    assert det._after_nics([back], nics) == [] and det.held == []


def test_errors_are_named():
    with pytest.raises(ValueError, match="NicDetector: need nbytes >= 4"):
        NicDetector(nbytes=2)
    with pytest.raises(ValueError, match="3 probe rows for 4 ranks"):
        NicDetector(nbytes=64).observe([(0, 0)] * 3, [0, 1, 2, 3], 1)
    with pytest.raises(ConfigError, match="expected RANK:ITER:MBPS"):
        parse_slow_nic("1:20")
    with pytest.raises(ConfigError, match="need RANK >= 0, ITER >= 1 and 0 < MBPS < inf"):
        parse_slow_nic("1:20:0")
    with pytest.raises(ConfigError, match="--inject-slow-nic names rank"):
        FaultInjectionConfig(inject_slow_nic=["1:20:4", "1:30:2"])
    faults = FaultInjectionConfig(inject_slow_nic=["5:20:4"])
    with pytest.raises(ConfigError, match="--inject-slow-nic 5:20:4 names rank 5, but the world has 4 ranks"):
        faults.check_world(4)
    with pytest.raises(ValueError, match="verdict kind must be one of"):
        Verdict(kind="slow_nick", rank=0, stage=None, iteration=1, factor=None, confidence=1.0, detector="x")


def test_deepspeed_refuses_the_nic_injection_by_name():
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.extension import build_extensions

    cfg = config_from_values({"engine": "deepspeed", "inject_slow_nic": ["1:20:4"], "resihp": True})
    with pytest.raises(ConfigError, match="--inject-slow-nic throttles megatron-core's p2p calls"):
        build_extensions(cfg)


def test_the_gradient_ring_hold_is_the_ranks_ring_share_at_the_nics_bandwidth():
    import types

    from megatron_ext.resihp.injection import GradRingThrottle

    calls = []
    config = types.SimpleNamespace(finalize_model_grads_func=lambda *a, **k: calls.append((a, k)) or "done")
    original = config.finalize_model_grads_func
    bw = {"now": None}
    ring = GradRingThrottle(config, grad_bytes=4e4, dp=4, bytes_per_s=lambda: bw["now"])
    assert config.finalize_model_grads_func("x", y=1) == "done" and ring.held_s == 0.0   # healthy: no hold
    bw["now"] = 1e6
    config.finalize_model_grads_func()
    assert ring.held_s == pytest.approx(2 * 3 / 4 * 4e4 / 1e6)                           # 2 (dp - 1) / dp of the bytes
    assert len(calls) == 2
    ring.remove()
    assert config.finalize_model_grads_func is original
    # Someone (the timeline's recorder) replaced the wrapper since: remove leaves theirs alone.
    ring = GradRingThrottle(config, grad_bytes=4e4, dp=1, bytes_per_s=lambda: 1e6)
    config.finalize_model_grads_func()
    assert ring.held_s == 0.0                                                             # no replica, no ring
    theirs = config.finalize_model_grads_func = lambda *a, **k: None
    ring.remove()
    assert config.finalize_model_grads_func is theirs


def test_the_ring_probe_sends_from_the_device_it_is_given(monkeypatch):
    # NCCL sends no CPU tensor: the probe's two messages live on the device the caller names (the
    # extension passes the world group's collective device), the CPU when it names none. A stand-in
    # for torch.distributed (two ranks, this one rank 0) records what each call was handed.
    import torch.distributed as dist

    from megatron_ext.resihp import nic

    seen = []

    class Done:
        def wait(self):
            return True

    def p2p(kind):
        def call(tensor, **kwargs):
            seen.append((kind, tensor.device.type, tensor.numel(), kwargs.get("src", kwargs.get("dst"))))
            return Done()
        return call

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(dist, "irecv", p2p("recv"))
    monkeypatch.setattr(dist, "isend", p2p("send"))
    for device, expected in (("meta", "meta"), (None, "cpu")):
        seen.clear()
        times = nic.ring_probe(4096, device=device)
        assert len(times) == 2 and all(t >= 0 for t in times)
        assert seen == [("recv", expected, 1024, 1), ("send", expected, 1024, 1)] * 2, seen


def test_the_severe_rule_names_a_nic_far_past_the_margin_before_the_window():
    # Window 8: the window rule needs 7 of 8 probes flagged. The severe rule (2x the margin, here
    # the 10 ms floor, in each of 3 probes) names a 33 ms excess after 3; a 15 ms one (1.5x the
    # margin) still waits for the window.
    def named_at(extra: float, **severe) -> tuple[int, str]:
        det = NicDetector(nbytes=65536, warmup=5, window=8, floor_s=0.01, **severe)
        rng = np.random.default_rng(3)
        for it in range(1, 40):
            for v in det.observe(probe(4, {2: extra} if it >= 10 else {}, jitter=5e-4, rng=rng), [0, 1, 2, 3], it):
                if v.kind == "slow_nic":
                    return v.iteration, v.detail["rule"]
        raise AssertionError("never named")

    assert named_at(0.033) == (16, "window")
    assert named_at(0.033, severe_factor=2.0, severe_window=3) == (12, "severe")
    assert named_at(0.015, severe_factor=2.0, severe_window=3) == (16, "window")
    with pytest.raises(ValueError, match=r"NicDetector: need severe_factor 0 \(off\) or > 1 and severe_window >= 1"):
        NicDetector(nbytes=65536, severe_factor=0.5)
