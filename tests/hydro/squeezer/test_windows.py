"""Bubble windows at run time: positions, low-quantile forecasts and their error, the recorder's live
observer on the wait phases, and the one bubble definition."""
from __future__ import annotations

import pytest

from megatron_ext.pipeline.bubbles import idle_fraction, idle_windows, schedule_bubble_fraction
from megatron_ext.pipeline.events import Call, EventRecorder, Phase
from megatron_ext.pipeline.windows import BubbleWindows, WindowForecaster, quantile


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def window_open(self, w) -> None:
        self.events.append(("open", w.position, w.t_open, w.forecast_s))

    def window_close(self, w, t) -> None:
        self.events.append(("close", w.position, t))


def _wired(capacity: int = 8, **kw):
    """A recorder on a test clock, with windows observing it and a listener keeping what it hears."""
    clock = Clock()
    rec = EventRecorder(capacity=capacity, clock=clock)
    windows = BubbleWindows(clock=clock, **kw)
    seen = Listener()
    windows.listeners.append(seen)
    rec.observer = windows
    return clock, rec, windows, seen


def test_quantile_interpolates_order_statistics():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.0) == 1.0
    assert quantile([4.0, 1.0, 3.0, 2.0], 1.0) == 4.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    assert quantile([1.0, 2.0], 0.5) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_forecast_is_a_low_quantile_of_the_positions_history_and_errs_short():
    f = WindowForecaster(quantile_q=0.2, history=5, min_samples=3)
    pos = (0, int(Phase.RECV), int(Call.RECV_FORWARD))
    assert f.forecast(pos) is None
    for v in (10.0, 12.0):
        f.observe(pos, v)
    assert f.forecast(pos) is None                   # fewer than min_samples
    f.observe(pos, 11.0)
    assert f.forecast(pos) == pytest.approx(quantile([10.0, 12.0, 11.0], 0.2))
    for v in (50.0, 50.0, 50.0, 50.0, 50.0):        # history 5: the old lengths are forgotten
        f.observe(pos, v)
    assert f.forecast(pos) == 50.0
    assert f.forecast((1, int(Phase.RECV), int(Call.RECV_FORWARD))) is None   # its own history
    f.observe(pos, 40.0, forecast_s=50.0)            # shorter than forecast: an over-forecast
    f.observe(pos, 100.0, forecast_s=50.0)           # twice as long: error +0.5 (safe side)
    s = f.error_summary()
    assert s["windows"] == 2 and s["over_forecast"] == 0.5
    assert s["abs_err_p50"] == pytest.approx((0.25 + 0.5) / 2)


def test_the_recorder_tells_its_observer_every_wait_live_and_positions_restart_each_iteration():
    clock, rec, windows, seen = _wired(4, forecaster=WindowForecaster(min_samples=1))
    for it in range(2):
        rec.reset()
        slot = rec.begin(Phase.FORWARD, 0, 0)       # compute: no window
        clock.t += 1
        rec.end(slot)
        slot = rec.begin(Phase.RECV, 0, -1, Call.RECV_BACKWARD)
        clock.t += 2 + it
        rec.end(slot)
        slot = rec.begin(Phase.GRAD_REDUCE)
        clock.t += 1
        rec.end(slot)
        slot = rec.begin(Phase.SEND, 0, -1, Call.SEND_FORWARD)   # the 4th event: buffer full from here
        clock.t += 1
        rec.end(slot)
    pos = [e[1] for e in seen.events if e[0] == "open"]
    assert pos[:3] == [(0, int(Phase.RECV), int(Call.RECV_BACKWARD)), (1, int(Phase.GRAD_REDUCE), 0),
                       (2, int(Phase.SEND), int(Call.SEND_FORWARD))]
    assert pos[3:] == pos[:3]                                     # same positions next iteration
    opens = [e for e in seen.events if e[0] == "open"]
    assert opens[0][3] is None and opens[3][3] == 2.0              # forecast = last iteration's length
    assert windows.open_s == pytest.approx(2 + 1 + 1 + 3 + 1 + 1)
    assert windows.iterations == 2


def test_a_full_recorder_still_drives_windows():
    clock, rec, windows, seen = _wired(1)
    rec.end(rec.begin(Phase.FORWARD))
    slot = rec.begin(Phase.RECV, call=Call.RECV_FORWARD)
    assert slot == -1 and rec.dropped == 1
    clock.t = 5.0
    rec.end(slot)
    assert [e[0] for e in seen.events] == ["open", "close"] and seen.events[1][2] == 5.0


def test_a_reopened_span_is_a_new_window_and_a_reset_closes_a_dangling_one():
    # DeepSpeed's Send/Recv instructions make one blocking call per tensor inside one event
    clock, rec, windows, seen = _wired()
    slot = rec.begin(Phase.RECV, call=Call.RECV_FORWARD)
    rec.end(slot)
    rec.reopen(slot)
    rec.end(slot)
    assert [e[0] for e in seen.events] == ["open", "close", "open", "close"]
    rec.begin(Phase.SEND, call=Call.SEND_FORWARD)                   # left open by an exception
    rec.reset()
    assert [e[0] for e in seen.events][-2:] == ["open", "close"]


def test_phases_limit_which_waits_are_windows():
    clock, rec, windows, seen = _wired(phases=(int(Phase.RECV),))
    rec.end(rec.begin(Phase.GRAD_REDUCE))
    rec.end(rec.begin(Phase.RECV, call=Call.RECV_FORWARD))
    assert [e[1][1] for e in seen.events if e[0] == "open"] == [int(Phase.RECV)]


def test_one_bubble_definition():
    assert idle_fraction([(0, 3), (2, 6), (8, 9)], 0, 10) == pytest.approx(0.3)
    assert idle_windows([(0, 3), (2, 6), (8, 9)], 0, 10) == [(6, 8), (9, 10)]
    assert idle_windows([(1, 2)], 0, 10, min_s=1.5) == [(2, 10)]
    assert idle_windows([], 0, 4) == [(0, 4)]
    p, m = 4, 8
    busy = [(3 + k, 4 + k) for k in range(2 * m)]
    assert idle_fraction(busy, 0, 2 * (m + p - 1)) == pytest.approx(schedule_bubble_fraction(p, m))
    assert schedule_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="empty span"):
        idle_fraction([], 1, 1)
    with pytest.raises(ValueError, match=">= 1"):
        schedule_bubble_fraction(0, 4)
