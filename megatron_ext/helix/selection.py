"""Measured selection of the compiled schedule (``--helix-select-rounds N``): the job times its
candidate graphs and keeps the fastest, as autotuners do, instead of trusting the simulator alone.

The candidates are whole compiled forwards of the model: the untiled graph (the Helix backend with
no pass, ``mode="baseline"``) first, then the schedule the simulator chose (``--helix-mode``). The
job runs one candidate per iteration: each once to compile and warm up (not timed), then ``N``
rounds in which every candidate runs once, the order rotated each round (``runtime/rounds.py``'s
``rotated_order``: each candidate goes first equally often over a multiple of their count), so that
a drift of the machine's load lands on every candidate alike. Every rank contributes its iteration
times; the slowest rank's time of each iteration is the sample (all-reduce MAX: every rank decides
on the same numbers, so every rank keeps the same graph).

The decision: per round, the ratio of each candidate's time to the untiled graph's of the same round;
a candidate wins only when the upper end of its ratio's bootstrap interval is below 1 (resolved
faster than untiled by the measurement's own spread); among winners the lowest median ratio. Anything
else -- equal, slower, or unresolved -- keeps the untiled graph. Pure Python and numpy: no torch.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from megatron_ext.runtime.rounds import ratio_interval, rotated_order


@dataclasses.dataclass
class Decision:
    chosen: str
    medians_s: dict[str, float]
    ratios: dict[str, dict]
    """candidate -> ``ratio_interval`` of its per-round time over the untiled graph's."""
    iterations: int
    """iterations the selection ran (warm-up included): its cost."""

    def line(self) -> str:
        parts = [f"{name} {t * 1e3:.1f} ms" for name, t in self.medians_s.items()]
        rel = [f"{name}/untiled {r['median']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
               for name, r in self.ratios.items()]
        return (f"helix: measured selection over {self.iterations} iterations: median {', '.join(parts)}; "
                f"{'; '.join(rel)} -> kept {self.chosen}")


class MeasuredSelection:
    """The iteration plan and the decision; ``names[0]`` is the untiled reference."""

    def __init__(self, names: Sequence[str], rounds: int) -> None:
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"measured selection needs two or more distinct candidates, got {list(names)}")
        if rounds < 1:
            raise ValueError(f"measured selection needs rounds >= 1, got {rounds}")
        self.names = list(names)
        self.rounds = rounds
        # warm-up: each candidate once (its graphs compile); then the timed rounds, rotated
        self.plan: list[tuple[str, int | None]] = [(n, None) for n in self.names]
        for r in range(rounds):
            self.plan += [(n, r) for n in rotated_order(self.names, r)]
        self.samples: list[float | None] = [None] * len(self.plan)

    def candidate(self, step: int) -> str | None:
        """The candidate of the selection's ``step``-th iteration; None once the plan is done."""
        return self.plan[step][0] if step < len(self.plan) else None

    @property
    def done_after(self) -> int:
        return len(self.plan)

    def record(self, step: int, seconds: float) -> None:
        if step < len(self.plan):
            self.samples[step] = float(seconds)

    def vector(self) -> list[float]:
        """Every step's sample (warm-up steps 0), to be all-reduced (MAX) over ranks."""
        return [0.0 if s is None else s for s in self.samples]

    def decide(self, agreed: Sequence[float] | None = None) -> Decision:
        """The decision on ``agreed`` (the all-reduced ``vector()``) or this rank's samples."""
        values = list(agreed) if agreed is not None else self.vector()
        per: dict[str, list[float]] = {n: [0.0] * self.rounds for n in self.names}
        for (name, r), v in zip(self.plan, values):
            if r is not None:
                per[name][r] = v
        ref = self.names[0]
        ratios = {n: ratio_interval(per[n], per[ref]) for n in self.names[1:]}
        winners = [n for n in self.names[1:] if ratios[n]["interval"][1] < 1.0]
        chosen = min(winners, key=lambda n: ratios[n]["median"]) if winners else ref
        return Decision(chosen=chosen, medians_s={n: statistics.median(per[n]) for n in self.names},
                        ratios=ratios, iterations=len(self.plan))
