"""Bubble windows at run time: where a stage is about to sit idle, and for how long.

Pure (no torch). The schedule says *where*: every wait of a rank -- a p2p receive or send, the
gradient reduce -- is a window, and an iteration's waits come in the same order every iteration,
so the k-th wait (with its phase and p2p call) is a *position*. Recent iterations say *how long*:
``WindowForecaster`` gives, per position, a low quantile of that position's recent lengths, so a
forecast errs short (a guest that trusts it parks before the stage needs its device).

``BubbleWindows`` is the recorder's live observer (``EventRecorder.observer``): both engines feed
the recorder, so both drive the same windows. Listeners hear ``window_open(window)`` with the
forecast and ``window_close(window, t_close)``; every closed window is scored against its forecast.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Protocol

Position = tuple[int, int, int]  # (ordinal of the wait in the iteration, phase, p2p call)


@dataclasses.dataclass
class Window:
    position: Position
    t_open: float
    forecast_s: float | None   # None: no history for this position yet

    @property
    def phase(self) -> int:
        return self.position[1]


class WindowListener(Protocol):
    def window_open(self, window: Window) -> None: ...

    def window_close(self, window: Window, t_close: float) -> None: ...


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` by linear interpolation between order statistics."""
    if not values:
        raise ValueError("quantile of no values")
    xs = sorted(values)
    k = q * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class WindowForecaster:
    """Per-position forecast of a window's length: the ``q``-quantile of its last ``history``
    lengths, once it has ``min_samples`` of them. Scores each forecast against the length that
    followed (``errors``: (actual - forecast) / actual, positive = the forecast was short, safe)."""

    def __init__(self, quantile_q: float = 0.2, history: int = 16, min_samples: int = 3,
                 keep_errors: int = 4096) -> None:
        if not 0.0 <= quantile_q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile_q}")
        if history < 1 or not 1 <= min_samples <= history:
            raise ValueError(f"need history >= 1 and 1 <= min_samples <= history, got {history}, {min_samples}")
        self.q, self.history, self.min_samples = quantile_q, history, min_samples
        self._lengths: dict[Position, collections.deque] = {}
        self.errors: collections.deque = collections.deque(maxlen=keep_errors)

    def forecast(self, position: Position) -> float | None:
        past = self._lengths.get(position)
        if past is None or len(past) < self.min_samples:
            return None
        return quantile(list(past), self.q)

    def observe(self, position: Position, length_s: float, forecast_s: float | None = None) -> None:
        self._lengths.setdefault(position, collections.deque(maxlen=self.history)).append(length_s)
        if forecast_s is not None and length_s > 0:
            self.errors.append((length_s - forecast_s) / length_s)

    def reset(self) -> None:
        """Forget every position (a re-layout changes the schedule)."""
        self._lengths.clear()

    def error_summary(self) -> dict[str, float | int]:
        """Median and p90 of |relative error|, and the share of windows shorter than forecast."""
        errs = list(self.errors)
        if not errs:
            return {"windows": 0, "abs_err_p50": float("nan"), "abs_err_p90": float("nan"), "over_forecast": 0.0}
        mags = [abs(e) for e in errs]
        return {"windows": len(errs), "abs_err_p50": quantile(mags, 0.5), "abs_err_p90": quantile(mags, 0.9),
                "over_forecast": sum(e < 0 for e in errs) / len(errs)}


class BubbleWindows:
    """The recorder's ``WaitObserver``: turns waits into windows with forecasts for listeners.

    ``phases`` limits which waits are windows (default: every wait the recorder reports)."""

    def __init__(self, forecaster: WindowForecaster | None = None, *, clock: Callable[[], float] = time.perf_counter,
                 phases: tuple[int, ...] | None = None) -> None:
        self.forecaster = forecaster or WindowForecaster()
        self.clock = clock
        self.phases = phases
        self.listeners: list[WindowListener] = []
        self.iterations = 0
        self.open_s = 0.0          # total window time seen (for the share guests used)
        self._ordinal = 0
        self._open: Window | None = None

    def wait_begin(self, phase: int, call: int) -> None:
        if self.phases is not None and phase not in self.phases:
            return
        pos = (self._ordinal, int(phase), int(call))
        self._ordinal += 1
        w = Window(pos, self.clock(), self.forecaster.forecast(pos))
        self._open = w
        for listener in self.listeners:
            listener.window_open(w)

    def wait_end(self) -> None:
        w, self._open = self._open, None
        if w is None:
            return
        t = self.clock()
        length = t - w.t_open
        self.open_s += length
        self.forecaster.observe(w.position, length, w.forecast_s)
        for listener in self.listeners:
            listener.window_close(w, t)

    def iteration_reset(self) -> None:
        if self._open is not None:
            self.wait_end()
        self._ordinal = 0
        self.iterations += 1
