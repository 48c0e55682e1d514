"""Slow paths of the data-parallel ring (``megatron_ext/resihp/nic.py``, ``PathDetector``): the ring
probe's pair times, the detector's verdicts on hand-made probes (a path told from a NIC and a NIC
from a path, recovery, a pair moved apart), the injection flag, its adjacency rule and the engine's
refusal."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.resihp.injection import FaultInjectionConfig, dp_ring_neighbours, parse_slow_path
from megatron_ext.resihp.nic import NicDetector, PathDetector, path_times

BASE = 0.002
KB64 = 65536


def probe(members, *, nics=None, paths=None, jitter=0.0, rng=None):
    """What ``ring_probe`` returns on each rank of the ring ``members`` (launch ranks in rank order)
    when a message from device s to device t takes ``BASE + nics[s] + paths[{s, t}]``."""
    nics, paths = nics or {}, {frozenset(k): v for k, v in (paths or {}).items()}
    rng = rng or np.random.default_rng(0)
    w = len(members)

    def t(src, dst):
        s, d = members[src], members[dst]
        return BASE + nics.get(s, 0.0) + paths.get(frozenset((s, d)), 0.0) + jitter * rng.random()

    return [(t((r - 1) % w, r), t((r + 1) % w, r)) for r in range(w)]


def run(members_at, faults_at, iterations, *, warmup=5, window=4, jitter=5e-4):
    """Both detectors over ``iterations`` probes; ``members_at(it)`` / ``faults_at(it)`` (keyword
    arguments of ``probe``) per probe. Returns the verdicts and the two detectors."""
    nics, paths = (NicDetector(nbytes=KB64, warmup=warmup, window=window),
                   PathDetector(nbytes=KB64, warmup=warmup, window=window))
    rng = np.random.default_rng(3)
    out = []
    for it in range(1, iterations + 1):
        members = members_at(it)
        rows = probe(members, jitter=jitter, rng=rng, **faults_at(it))
        out += nics.observe(rows, members, it) + paths.observe(rows, members, it)
    return out, nics, paths


def test_pair_times_are_the_two_directions_of_each_neighbour_pair():
    rows = probe([0, 1, 2, 3], paths={(1, 2): 0.03})
    got = path_times(rows)
    assert set(got) == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert got[(1, 2)] == pytest.approx((BASE + 0.03, BASE + 0.03))
    assert got[(0, 1)] == pytest.approx((BASE, BASE))
    # A ring of two: each rank's two messages go to the one neighbour: no pair is told apart.
    assert path_times(probe([0, 1], paths={(0, 1): 0.03})) == {}


def test_a_slow_path_is_named_with_its_pair_and_bandwidth_and_not_as_a_nic():
    extra = KB64 / (3 * 1e6)                                    # 3 MB/s: 21.8 ms per 64 KB message
    found, nics, paths = run(lambda it: [0, 1, 2, 3], lambda it: {"paths": {(0, 1): extra}} if 10 <= it < 20 else {},
                             30)
    kinds = [(v.kind, v.link, v.iteration) for v in found]
    assert kinds == [("slow_path", (0, 1), 12), ("path_recovered", (0, 1), 23)], kinds   # no NIC verdict
    named = found[0]
    assert (named.rank, named.launch_rank, named.detail["peer_launch_rank"]) == (0, 0, 1)
    assert named.detail["extra_s_per_message"] == pytest.approx(extra, abs=1e-3)
    assert named.detail["mbps"] == pytest.approx(3.0, rel=0.05)
    assert named.detail["probe_bytes"] == KB64 and named.detector == "resihp-path"
    assert "rank 0 slow path to launch rank 1 (+21." in named.describe() and "about 3" in named.describe()
    assert paths.known_slow() == {} and nics.known_slow() == {}


def test_a_slow_nic_is_not_named_as_a_path_nor_are_a_paths_neighbours():
    # Device 2's NIC slows its messages to 1 and 3: pairs 1-2 and 2-3 have one slow direction each.
    # Two adjacent slow NICs (1 and 2) slow both directions of 1-2, which the ends' own egress explains.
    for nic in ({2: 0.03}, {1: 0.03, 2: 0.03}):
        found, _, paths = run(lambda it: [0, 1, 2, 3], lambda it, nic=nic: {"nics": nic} if it >= 8 else {}, 25)
        assert {v.kind for v in found} == {"slow_nic"}, found
        assert {v.launch_rank for v in found} == set(nic)
        assert paths.known_slow() == {}
    # A slow path on 1-2 of a ring of six: neither 0-1 nor 2-3 (the pair's neighbours) is named.
    found, _, paths = run(lambda it: [0, 1, 2, 3, 4, 5], lambda it: {"paths": {(1, 2): 0.03}} if it >= 8 else {}, 25)
    assert [(v.kind, v.link) for v in found] == [("slow_path", (1, 2))]
    assert set(paths.known_slow()) == {(1, 2)}


def test_a_ring_of_two_gives_no_path_verdict():
    found, nics, paths = run(lambda it: [0, 1], lambda it: {"paths": {(0, 1): 0.03}} if it >= 8 else {}, 25)
    assert [v for v in found if v.kind in ("slow_path", "path_recovered")] == []
    # ...each device's egress is both of its messages there: the NIC watch names both devices instead.
    assert {v.launch_rank for v in found if v.kind == "slow_nic"} == {0, 1}
    assert paths.base_s is None and paths.last == {}


def test_a_pair_moved_apart_keeps_its_verdict_and_devices_keep_their_pairs_when_renumbered():
    # Devices 0 and 1 (the slow path) are neighbours until probe 15; then a re-layout orders the
    # ranks 0, 2, 1, 3: the pair is no longer adjacent on the probe ring, is not observed, and its
    # verdict stands (no path_recovered) although the path is still slow.
    def members(it):
        return [0, 1, 2, 3] if it < 15 else [0, 2, 1, 3]

    found, _, paths = run(members, lambda it: {"paths": {(0, 1): 0.03}} if it >= 8 else {}, 40)
    assert [(v.kind, v.link) for v in found] == [("slow_path", (0, 1))]
    assert set(paths.known_slow()) == {(0, 1)}
    assert set(paths.last) == {(0, 2), (1, 2), (1, 3), (0, 3)}
    # Renumbered: device 1 at rank 0 and device 0 at rank 3 are still ring neighbours (3 -> 0):
    # the pair is found by launch rank and the verdict's rank is device 0's rank there.
    found, _, _ = run(lambda it: [1, 2, 3, 0] if it > 5 else [0, 1, 2, 3],
                      lambda it: {"paths": {(0, 1): 0.03}} if it >= 8 else {}, 20)
    (v,) = found
    assert (v.kind, v.link, v.rank) == ("slow_path", (0, 1), 3)


def test_errors_are_named():
    with pytest.raises(ValueError, match="PathDetector: need nbytes >= 4"):
        PathDetector(nbytes=2)
    with pytest.raises(ValueError, match="3 probe rows for 4 ranks"):
        PathDetector(nbytes=64).observe([(0, 0)] * 3, [0, 1, 2, 3], 1)


@pytest.mark.parametrize("spec,message", [
    ("0:1:20", "--inject-slow-path '0:1:20': expected A:B:ITER:MBPS"),
    ("0:x:20:3", "--inject-slow-path '0:x:20:3': expected A:B:ITER:MBPS"),
    ("1:1:20:3", "--inject-slow-path '1:1:20:3': need two different ranks A != B"),
    ("-1:1:20:3", "--inject-slow-path '-1:1:20:3': need ranks >= 0"),
    ("0:1:0:3", "--inject-slow-path '0:1:0:3': need ITER >= 1"),
    ("0:1:20:0", "--inject-slow-path '0:1:20:0': need 0 < MBPS < inf"),
    ("0:1:20:inf", "--inject-slow-path '0:1:20:inf': need 0 < MBPS < inf"),
])
def test_the_injection_spec_errors_name_the_form(spec, message):
    with pytest.raises(ConfigError) as err:
        parse_slow_path(spec)
    assert str(err.value).startswith(message), str(err.value)


def test_the_injection_names_a_pair_once_and_ranks_of_the_world():
    f = parse_slow_path("3:1:20:2.5")
    assert (f.a, f.b, f.since, f.mbps, f.pair) == (3, 1, 20, 2.5, (1, 3))
    with pytest.raises(ConfigError, match="--inject-slow-path names a pair of ranks more than once"):
        FaultInjectionConfig(inject_slow_path=["0:1:20:3", "1:0:30:2"])
    faults = FaultInjectionConfig(inject_slow_path=["0:4:20:3"])
    assert faults.any
    with pytest.raises(ConfigError, match="--inject-slow-path 0:4:20:3 names rank 4, but the world has 4 ranks"):
        faults.check_world(4)
    faults.check_world(5)


def test_the_gradient_ring_hold_needs_the_pair_to_be_dp_ring_neighbours():
    from megatron_ext.layout import Layout

    dp4 = Layout(1, 1, 4)                                        # one ring: 0-1-2-3-0
    assert dp_ring_neighbours(dp4, 0, 1) and dp_ring_neighbours(dp4, 3, 0) and not dp_ring_neighbours(dp4, 0, 2)
    # Re-laid out: ranks hold devices 0, 2, 1, 3: the ring runs 0-2-1-3-0, devices 0 and 1 apart.
    moved = dp4.with_members((0, 2, 1, 3))
    assert not dp_ring_neighbours(moved, 0, 1) and dp_ring_neighbours(moved, 1, 2)
    # PP2 x DP2: rings {0, 1} and {2, 3}; a ring of two counts; devices on other rings are not neighbours.
    pp2 = Layout(1, 2, 2)
    assert dp_ring_neighbours(pp2, 0, 1) and dp_ring_neighbours(pp2, 3, 2) and not dp_ring_neighbours(pp2, 1, 2)
    assert not dp_ring_neighbours(Layout(1, 4, 1), 0, 1)          # no data parallelism, no ring
    assert not dp_ring_neighbours(dp4, 0, 7)                       # a device not in the job


def test_deepspeed_refuses_the_path_injection_by_name():
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.extension import build_extensions

    cfg = config_from_values({"engine": "deepspeed", "inject_slow_path": ["0:1:20:3"], "resihp": True})
    with pytest.raises(ConfigError, match="--inject-slow-path throttles megatron-core's p2p calls"):
        build_extensions(cfg)
