"""The bubble of a pipeline stage: one definition for the timeline, the cluster simulator and the
Bubble Squeezer.

Pure (no torch, no numpy). A stage's *bubble fraction* over a span is the share of the span in
which it runs no forward or backward: ``idle_fraction`` measures it from busy intervals, and
``schedule_bubble_fraction`` is what a schedule gives when every op takes the same time. A bubble
*window* is one idle interval (``idle_windows``).
"""
from __future__ import annotations

from typing import Iterable


def _clipped(busy: Iterable[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    return sorted((max(float(a), start), min(float(b), end)) for a, b in busy if b > start and a < end)


def busy_seconds(busy: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end)`` covered by the intervals; overlapping intervals count once."""
    covered, reach = 0.0, start
    for t0, t1 in _clipped(busy, start, end):
        if t1 <= reach:
            continue
        covered += t1 - max(t0, reach)
        reach = t1
    return covered


def idle_fraction(busy: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Idle share of ``[start, end)`` given the busy intervals (a stage's forward/backward ops)."""
    if end <= start:
        raise ValueError(f"empty span [{start}, {end})")
    return 1.0 - busy_seconds(busy, start, end) / (end - start)


def idle_windows(busy: Iterable[tuple[float, float]], start: float, end: float,
                 min_s: float = 0.0) -> list[tuple[float, float]]:
    """The idle intervals of ``[start, end)`` longer than ``min_s``, in time order."""
    out, reach = [], start
    for t0, t1 in _clipped(busy, start, end):
        if t0 - reach > min_s:
            out.append((reach, t0))
        reach = max(reach, t1)
    if end - reach > min_s:
        out.append((reach, end))
    return out


def schedule_bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle share of a stage under 1F1B / GPipe (v = 1) or the
    interleaved schedule (v chunks per rank) when every op takes the same time."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, micro-batches and chunks must be >= 1, got {p}, {m}, {v}")
    return (p - 1) / (v * m + p - 1)
