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
    predicted_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """candidate -> the simulator's step makespan, summed over its graphs (the ranking)."""
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    """candidate -> why it was not timed (the same graphs as another; ranked below those timed)."""

    def line(self) -> str:
        parts = [f"{name} {t * 1e3:.1f} ms" for name, t in self.medians_s.items()]
        rel = [f"{name}/untiled {r['median']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
               for name, r in self.ratios.items()]
        pred = [f"{name} {t * 1e3:.1f} ms" for name, t in self.predicted_s.items()]
        extra = (f"; simulated {', '.join(pred)}" if pred else "") + (
            "; not timed: " + ", ".join(f"{n} ({why})" for n, why in self.dropped.items()) if self.dropped else "")
        if not self.medians_s:
            return f"helix: measured selection over {self.iterations} iterations{extra} -> kept {self.chosen}"
        return (f"helix: measured selection over {self.iterations} iterations: median {', '.join(parts)}; "
                f"{'; '.join(rel)}{extra} -> kept {self.chosen}")


class MeasuredSelection:
    """The iteration plan and the decision; ``names[0]`` is the untiled reference.

    ``measure``: how many candidates besides the untiled graph are timed. Every candidate runs its
    warm-up (its graphs compile, so the simulator's prediction of each exists); then ``narrow``
    takes the simulator's ranking and the timed rounds cover the untiled graph and the first
    ``measure`` of the ranking. None (or as many as there are): every candidate, no ranking asked
    unless ``ranked`` (then ``narrow`` also leaves out candidates that are another's graphs)."""

    def __init__(self, names: Sequence[str], rounds: int, *, measure: int | None = None,
                 ranked: bool = False) -> None:
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"measured selection needs two or more distinct candidates, got {list(names)}")
        if rounds < 1:
            raise ValueError(f"measured selection needs rounds >= 1, got {rounds}")
        if measure is not None and measure < 1:
            raise ValueError(f"measured selection needs measure >= 1 candidate besides the untiled graph, "
                             f"got {measure}")
        self.names = list(names)
        self.rounds = rounds
        self.measure = len(self.names) - 1 if measure is None else min(measure, len(self.names) - 1)
        # warm-up: each candidate once (its graphs compile); then the timed rounds, rotated
        self.plan: list[tuple[str, int | None]] = [(n, None) for n in self.names]
        self.samples: list[float | None] = [None] * len(self.plan)
        self.measured: list[str] | None = None
        self.predicted_s: dict[str, float] = {}
        self.dropped: dict[str, str] = {}
        if self.measure == len(self.names) - 1 and not ranked:
            self.narrow(self.names[1:])

    @property
    def warmups(self) -> int:
        return len(self.names)

    @property
    def narrowed(self) -> bool:
        return self.measured is not None

    def narrow(self, ranked: Sequence[str], *, predicted_s: dict[str, float] | None = None,
               dropped: dict[str, str] | None = None) -> list[str]:
        """After the warm-ups: ``ranked``, the candidates worth timing best first (the simulator's
        order; those it found the same as another are left out, ``dropped`` says why). Times the
        untiled graph and the first ``measure`` of them; returns what is timed. With none left the
        selection is over (``done_after`` is the warm-ups) and the untiled graph is kept."""
        if self.measured is not None:
            raise RuntimeError("measured selection: narrowed twice")
        unknown = [n for n in ranked if n not in self.names[1:]]
        if unknown:
            raise ValueError(f"measured selection: {unknown} are not candidates of {self.names}")
        self.predicted_s = dict(predicted_s or {})
        self.dropped = dict(dropped or {})
        keep = list(dict.fromkeys(ranked))[:self.measure]
        self.measured = [self.names[0], *keep] if keep else [self.names[0]]
        if keep:
            for r in range(self.rounds):
                self.plan += [(n, r) for n in rotated_order(self.measured, r)]
        self.samples += [None] * (len(self.plan) - len(self.samples))
        return list(self.measured)

    def candidate(self, step: int) -> str | None:
        """The candidate of the selection's ``step``-th iteration; None once the plan is done."""
        if step >= self.warmups and not self.narrowed:
            raise RuntimeError("measured selection: rank the candidates (narrow) after their warm-ups")
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
        if not self.narrowed:
            raise RuntimeError("measured selection: nothing timed yet (narrow after the warm-ups)")
        values = list(agreed) if agreed is not None else self.vector()
        names = self.measured
        ref = names[0]
        if len(names) == 1:
            return Decision(chosen=ref, medians_s={}, ratios={}, iterations=len(self.plan),
                            predicted_s=self.predicted_s, dropped=self.dropped)
        per: dict[str, list[float]] = {n: [0.0] * self.rounds for n in names}
        for (name, r), v in zip(self.plan, values):
            if r is not None:
                per[name][r] = v
        ratios = {n: ratio_interval(per[n], per[ref]) for n in names[1:]}
        winners = [n for n in names[1:] if ratios[n]["interval"][1] < 1.0]
        chosen = min(winners, key=lambda n: ratios[n]["median"]) if winners else ref
        return Decision(chosen=chosen, medians_s={n: statistics.median(per[n]) for n in names},
                        ratios=ratios, iterations=len(self.plan), predicted_s=self.predicted_s,
                        dropped=self.dropped)


# ---- candidates ---------------------------------------------------------------------------------

def rank(names: Sequence[str], predicted_s: Sequence[float], tiled: Sequence[bool], *,
         same_as: dict[str, Sequence[str]] | None = None,
         always: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The simulator's ranking of ``names[1:]`` (``names[0]``: the untiled graph) by ``predicted_s``,
    best first, and why the others are left out: a candidate that tiled no graph is the untiled
    graph (unless in ``always``: Inductor's scheduler changes the untiled graph's order);
    ``same_as[c]``: the candidates whose graphs are c's (c is left out once one of them is ranked)."""
    same_as = same_as or {}
    dropped: dict[str, str] = {}
    ranked: list[str] = []
    for k in sorted(range(1, len(names)), key=lambda k: (predicted_s[k], k)):
        n = names[k]
        if n not in always and not tiled[k]:
            dropped[n] = "the simulator tiled no graph: the untiled graph"
        elif any(d in ranked for d in same_as.get(n, ())):
            dropped[n] = f"the same graphs as {next(d for d in ranked if d in same_as[n])}"
        else:
            ranked.append(n)
    return ranked, dropped


@dataclasses.dataclass(frozen=True)
class CandidateSpec:
    """A schedule the selection may compile: the backend's mode, tiles and bucketing."""

    name: str
    mode: str          # "auto", "tiled", "baseline" or "inductor" (Inductor's own overlap scheduler)
    tiles: int = 2
    bucketing: bool = True

    @property
    def key(self) -> tuple:
        """What the backend is built from: two candidates with one key are one schedule."""
        return (self.mode, self.tiles, self.bucketing)


def parse_candidate(spec: str) -> CandidateSpec:
    """``tiled-kN[-unbucketed]``, ``auto-kN[-unbucketed]`` or ``inductor``; a clear error otherwise."""
    text = spec.strip().lower()
    if text == "inductor":
        return CandidateSpec(name="inductor", mode="inductor")
    parts = text.split("-")
    ok = (len(parts) in (2, 3) and parts[0] in ("tiled", "auto") and parts[1][:1] == "k" and parts[1][1:].isdigit()
          and int(parts[1][1:]) >= 2 and (len(parts) == 2 or parts[2] == "unbucketed"))
    if not ok:
        raise ValueError(f"--helix-select-candidates {spec!r}: expected tiled-kN, auto-kN (N >= 2, optionally "
                         f"-unbucketed) or inductor")
    return CandidateSpec(name=text, mode=parts[0], tiles=int(parts[1][1:]), bucketing=len(parts) == 2)
