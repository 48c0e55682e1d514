"""Scoring verdicts against fault labels: precision, recall, F1, detection delay, false alarms.

Definitions (the benchmark and the replay tool both use them):

* a fault is one labelled (kind, rank, since) seen in the trace, active from ``since`` to the last
  record that carries it;
* labels and verdicts meet on the device: a label's rank is a launch rank (the trace's ``devices``
  map ranks to them), a verdict's device is ``Verdict.launch_rank``; without a re-layout both are
  the rank;
* a ``fail_slow`` verdict is correct when a ``slow`` fault of the same device is active at the
  verdict's iteration; a ``fail_stop`` verdict likewise for a ``stop`` fault (or any later
  iteration, since a stopped rank stays stopped);
* precision = correct verdicts / verdicts; recall = faults with at least one correct verdict /
  faults; F1 their harmonic mean; delay = iterations from ``since`` to the first correct
  verdict (median over detected faults);
* a false alarm is an incorrect verdict issued while no fault at all is active; the rate is per
  10,000 such healthy iterations. ``recovered`` verdicts are not scored.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

from megatron_ext.resihp.trace import FaultLabel, TraceRecord
from megatron_ext.resihp.verdicts import Verdict

_KIND_OF = {"fail_slow": "slow", "fail_stop": "stop"}


@dataclasses.dataclass
class FaultSpan:
    kind: str
    rank: int
    since: int
    until: int
    factor: float | None


@dataclasses.dataclass
class DetectionMetrics:
    """Counts that add up over traces; the rates are properties."""

    verdicts: int = 0
    correct: int = 0
    faults: int = 0
    detected: int = 0
    delays: list[int] = dataclasses.field(default_factory=list)
    false_alarms: int = 0
    healthy_iterations: int = 0
    iterations: int = 0

    def __add__(self, other: "DetectionMetrics") -> "DetectionMetrics":
        return DetectionMetrics(self.verdicts + other.verdicts, self.correct + other.correct,
                                self.faults + other.faults, self.detected + other.detected,
                                self.delays + other.delays, self.false_alarms + other.false_alarms,
                                self.healthy_iterations + other.healthy_iterations,
                                self.iterations + other.iterations)

    @property
    def precision(self) -> float:
        # No verdict at all is perfectly precise; recall then says what was missed.
        return self.correct / self.verdicts if self.verdicts else 1.0

    @property
    def recall(self) -> float:
        return self.detected / self.faults if self.faults else float("nan")

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        if math.isnan(r):
            return float("nan")
        return 2 * p * r / (p + r) if p + r > 0 else 0.0

    @property
    def delay_iters(self) -> float:
        return float(np.median(self.delays)) if self.delays else float("nan")

    @property
    def wrong(self) -> int:
        """Verdicts that name no fault: false alarms in healthy iterations, and verdicts during a
        fault that name the wrong rank or kind (e.g. the slow rank's waiting peer)."""
        return self.verdicts - self.correct

    @property
    def false_alarms_per_10k(self) -> float:
        return 1e4 * self.false_alarms / self.healthy_iterations if self.healthy_iterations else float("nan")

    def summary(self) -> dict[str, float | None]:
        def clean(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 4)

        return {"f1": clean(self.f1), "precision": clean(self.precision), "recall": clean(self.recall),
                "wrong_verdicts": self.wrong,
                "delay_iters": clean(self.delay_iters), "false_alarms_per_10k": clean(self.false_alarms_per_10k)}


def fault_spans(labels: Iterable[tuple[int, Sequence[FaultLabel]]]) -> list[FaultSpan]:
    """Faults from (iteration, labels active at it) pairs."""
    spans: dict[tuple[str, int, int], FaultSpan] = {}
    for it, faults in labels:
        for f in faults:
            key = (f.kind, f.rank, f.since)
            if key in spans:
                spans[key].until = max(spans[key].until, it)
            else:
                spans[key] = FaultSpan(f.kind, f.rank, f.since, it, f.factor)
    return list(spans.values())


def score(labels: Sequence[tuple[int, Sequence[FaultLabel]]], verdicts: Iterable[Verdict]) -> DetectionMetrics:
    """Score one trace's verdicts against its labels (see the module docstring)."""
    spans = fault_spans(labels)
    active_any = {it for it, faults in labels if faults}
    out = DetectionMetrics(faults=len(spans), iterations=len(labels),
                           healthy_iterations=sum(1 for it, _ in labels if it not in active_any))
    first: dict[int, int] = {}
    for v in verdicts:
        kind = _KIND_OF.get(v.kind)
        if kind is None:
            continue
        out.verdicts += 1
        hit = None
        for k, s in enumerate(spans):
            end = math.inf if s.kind == "stop" else s.until
            if s.kind == kind and s.rank == v.launch_rank and s.since <= v.iteration <= end:
                hit = k
                break
        if hit is None:
            if v.iteration not in active_any:
                out.false_alarms += 1
            continue
        out.correct += 1
        if hit not in first:
            first[hit] = v.iteration - spans[hit].since
    out.detected = len(first)
    out.delays = sorted(first.values())
    return out


def labels_of(records: Iterable[TraceRecord]) -> list[tuple[int, tuple[FaultLabel, ...]]]:
    return [(r.iteration, r.faults) for r in records]
