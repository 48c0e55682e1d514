"""The safety monitor: interleaved control iterations, a significance test, escalation."""
from __future__ import annotations

import random

import pytest

from megatron_ext.hydro.squeezer.safety import SlowdownMonitor, level_settings, mann_whitney_greater


def test_mann_whitney_matches_its_textbook_values():
    # exact one-sided p of U=0 for 5 vs 5 disjoint samples is 1/252; the normal approximation is close
    assert mann_whitney_greater([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == pytest.approx(0.0061, abs=0.003)
    assert mann_whitney_greater([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) > 0.99
    assert mann_whitney_greater([1.0] * 6, [1.0] * 6) == 1.0          # all tied: no evidence either way
    assert mann_whitney_greater([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]) == pytest.approx(0.5, abs=0.1)
    assert mann_whitney_greater([], [1.0]) == 1.0


def _feed(mon: SlowdownMonitor, start: int, n: int, on: float, off: float, rng: random.Random, noise: float):
    results = []
    for it in range(start, start + n):
        base = off if mon.is_control(it) else on
        res = mon.observe(it, base * (1 + rng.uniform(-noise, noise)))
        if res is not None:
            results.append(res)
    return results


def test_no_slowdown_keeps_the_guests_on_noise_or_not():
    rng = random.Random(0)
    mon = SlowdownMonitor(max_slowdown=0.01, control_every=4, block=40)
    results = _feed(mon, 1, 400, on=1.0, off=1.0, rng=rng, noise=0.3)
    assert len(results) == 10
    assert sum(r.action != "keep" for r in results) <= 1     # 5 % false alarms at most, here 10 blocks
    assert not mon.stopped


def test_a_real_slowdown_backs_off_twice_then_stops():
    rng = random.Random(1)
    mon = SlowdownMonitor(max_slowdown=0.01, control_every=4, block=40, levels=2)
    results = _feed(mon, 1, 160, on=1.10, off=1.0, rng=rng, noise=0.02)
    assert [r.action for r in results[:3]] == ["back off", "back off", "stop"]
    assert results[0].slowdown == pytest.approx(0.10, abs=0.03) and results[0].p_value < 0.05
    assert mon.stopped and mon.observe(999, 5.0) is None


def test_a_slowdown_below_the_limit_is_kept():
    rng = random.Random(2)
    mon = SlowdownMonitor(max_slowdown=0.05, control_every=4, block=40)
    results = _feed(mon, 1, 120, on=1.02, off=1.0, rng=rng, noise=0.005)
    assert all(r.action == "keep" for r in results) and all(r.p_value < 0.05 for r in results)


def test_blocks_do_not_overlap_and_count_their_iterations():
    mon = SlowdownMonitor(control_every=4, block=12)
    results = _feed(mon, 5, 36, on=1.0, off=1.0, rng=random.Random(3), noise=0.1)
    assert [r.iterations for r in results] == [(5, 16), (17, 28), (29, 40)]
    assert all(r.on == 9 and r.off == 3 for r in results)


def test_forced_actions_and_levels():
    mon = SlowdownMonitor()
    mon.force("back off")
    assert mon.level == 1 and level_settings(1) == (0.25, 0.5)
    mon.force("stop")
    assert mon.stopped
    with pytest.raises(ValueError, match="control_every must be >= 2"):
        SlowdownMonitor(control_every=1)
    with pytest.raises(ValueError, match="at least two control iterations"):
        SlowdownMonitor(control_every=10, block=12)
