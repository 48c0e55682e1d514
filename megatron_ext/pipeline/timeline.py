"""One pipeline iteration joined across ranks: busy and wait time, bubble windows, critical path.

Pure: numpy and the schedule/simulator cores only. ``IterationRecord`` holds every rank's events
(on one clock: offsets are applied when the record is built) and the micro-batch layouts. Bubble
windows are the spans where a rank runs no forward/backward between the start of the iteration and
the end of the pipeline's last compute op; each says what ended it and how long the schedule's
structure expects it to be (the iteration's own op durations replayed through the simulator).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from megatron_ext.pipeline.bubbles import idle_fraction, idle_windows, schedule_bubble_fraction
from megatron_ext.pipeline.events import COMPUTE, Phase, assign_p2p_microbatches
from megatron_ext.pipeline.schedule_orders import BACKWARD, FORWARD, Op, ScheduleOrder, schedule_order

_PHASE_LETTER = {Phase.FORWARD: FORWARD, Phase.BACKWARD: BACKWARD}


@dataclasses.dataclass
class RankEvents:
    rank: int
    stage: int
    tp: int
    dp: int
    events: np.ndarray  # EVENT_DTYPE, times on the record's common clock

    def compute(self) -> np.ndarray:
        return self.events[np.isin(self.events["phase"], [int(p) for p in COMPUTE])]


@dataclasses.dataclass(frozen=True)
class BubbleWindow:
    rank: int
    stage: int
    t0: float
    t1: float
    ended_by: str          # "F3", "B0.1" (micro-batch 0, chunk 1) or "end"
    expected_s: float      # the schedule's idle before that op, given this iteration's op durations

    @property
    def duration_s(self) -> float:
        return self.t1 - self.t0


@dataclasses.dataclass
class IterationRecord:
    iteration: int
    schedule: str                     # "1f1b", "interleaved" or "deepspeed"
    num_stages: int
    num_microbatches: int
    num_chunks: int
    ranks: dict[int, RankEvents]
    doc_lengths: list[list[list[int]]] = dataclasses.field(default_factory=list)  # [microbatch][sequence]
    replica_doc_lengths: dict[int, list] = dataclasses.field(default_factory=dict)  # dp -> like doc_lengths

    # --- structure ---------------------------------------------------------------------------
    @property
    def order(self) -> ScheduleOrder:
        return schedule_order(self.schedule, self.num_stages, self.num_microbatches, self.num_chunks)

    def stage_ranks(self, stage: int) -> list[RankEvents]:
        return [r for r in self.ranks.values() if r.stage == stage]

    def representative(self, stage: int) -> RankEvents:
        """The tp-0, dp-0 rank of a stage (all ranks of a stage run the same schedule)."""
        return min(self.stage_ranks(stage), key=lambda r: (r.tp, r.dp, r.rank))

    def compute_order(self, rank: int) -> list[Op]:
        ev = self.ranks[rank].compute()
        return [Op(_PHASE_LETTER[Phase(int(e["phase"]))], int(e["microbatch"]), int(e["chunk"])) for e in ev]

    # --- time ------------------------------------------------------------------------------
    @property
    def t_start(self) -> float:
        return min(float(r.events["t0"].min()) for r in self.ranks.values() if len(r.events))

    @property
    def pipeline_end(self) -> float:
        """End of the last forward/backward on any rank."""
        return max(float(r.compute()["t1"].max()) for r in self.ranks.values() if len(r.compute()))

    @property
    def t_end(self) -> float:
        return max(float(np.nanmax(r.events["t1"])) for r in self.ranks.values() if len(r.events))

    def busy_wait(self, rank: int) -> dict[str, float]:
        """Compute time, time in p2p waits, and idle time within [t_start, pipeline_end]."""
        ev = self.ranks[rank].events
        span = self.pipeline_end - self.t_start
        comp = self.ranks[rank].compute()
        busy = float((comp["t1"] - comp["t0"]).sum())
        p2p = ev[np.isin(ev["phase"], [int(Phase.SEND), int(Phase.RECV)])]
        wait = float(np.clip(np.minimum(p2p["t1"], self.pipeline_end) - p2p["t0"], 0, None).sum())
        bubble = idle_fraction(zip(comp["t0"], comp["t1"]), self.t_start, self.pipeline_end) if span > 0 else 0.0
        return {"span_s": span, "busy_s": busy, "wait_s": wait, "idle_s": span - busy, "bubble_fraction": bubble}

    def stage_bubble_fractions(self) -> list[float]:
        return [self.busy_wait(self.representative(s).rank)["bubble_fraction"] for s in range(self.num_stages)]

    # --- bubbles ---------------------------------------------------------------------------
    def observed_durations(self) -> tuple[np.ndarray, np.ndarray]:
        """(fwd_s, bwd_s) shaped (stages, chunks, microbatches) from the representative ranks."""
        shape = (self.num_stages, self.num_chunks, self.num_microbatches)
        fwd, bwd = np.zeros(shape), np.zeros(shape)
        for s in range(self.num_stages):
            for e in self.representative(s).compute():
                target = fwd if e["phase"] == Phase.FORWARD else bwd
                target[s, e["chunk"], e["microbatch"]] = e["t1"] - e["t0"]
        return fwd, bwd

    def expected_bubbles(self) -> dict[int, dict[str, float]]:
        """Per stage: the simulated idle window before each op (keyed 'F3', 'B0.1', 'end')."""
        from megatron_ext.pipeline.pipesim import compile_plan, simulate

        plan = compile_plan(self.order)
        fwd, bwd = self.observed_durations()
        sim = simulate(plan, fwd, bwd)
        out: dict[int, dict[str, float]] = {}
        for s in range(self.num_stages):
            js = np.flatnonzero(plan.stage == s)
            t, windows = 0.0, {}
            for j in js:
                gap = float(sim.start[0, j]) - t
                if gap > 0:
                    windows[str(plan.op(j))] = gap
                t = float(sim.finish[0, j])
            end = float(sim.finish[0].max())
            if end - t > 0:
                windows["end"] = end - t
            out[s] = windows
        return out

    def schedule_check(self) -> dict[str, Any]:
        """This iteration against the schedule simulated with its own measured op durations.

        What differs is what the dataflow model of the schedule does not capture (blocking sends,
        launch gaps, a host that stalls a rank between ops), so on any host, loaded or not, the
        measured bubble should sit near ``expected_bubble``; the textbook (p-1)/(m+p-1) assumes
        equal op times, which an oversubscribed host or a slow stage never gives.
        Returns per stage the measured and expected bubble fraction, and ResiHP's pipeline
        simulator error (``timeline_error``): relative makespan error, mean start error, and the
        largest per-stage idle error in seconds."""
        from megatron_ext.pipeline.pipesim import compile_plan, simulate, timeline_error

        plan = compile_plan(self.order)
        fwd, bwd = self.observed_durations()
        sim = simulate(plan, fwd, bwd)
        observed: dict[tuple[int, str, int, int], tuple[float, float]] = {}
        for s in range(self.num_stages):
            for e in self.representative(s).compute():
                key = (s, _PHASE_LETTER[Phase(int(e["phase"]))], int(e["microbatch"]), int(e["chunk"]))
                observed[key] = (float(e["t0"]), float(e["t1"]))
        origin = min(t0 for t0, _ in observed.values())
        observed = {k: (t0 - origin, t1 - origin) for k, (t0, t1) in observed.items()}
        makespan = float(sim.finish[0].max())
        busy = np.zeros(self.num_stages)
        np.add.at(busy, plan.stage, sim.finish[0] - sim.start[0])
        expected = [float(1.0 - b / makespan) if makespan > 0 else 0.0 for b in busy]
        return {"measured_bubble": self.stage_bubble_fractions(), "expected_bubble": expected,
                "measured_makespan_s": max(t1 for _, t1 in observed.values()), "simulated_makespan_s": makespan,
                **timeline_error(sim, observed)}

    def bubble_windows(self, min_s: float = 0.0) -> list[BubbleWindow]:
        expected = self.expected_bubbles()
        t0, end = self.t_start, self.pipeline_end
        out = []
        for r in self.ranks.values():
            comp = r.compute()
            # the op that ends a window is the one starting at its end
            ends = {float(e["t0"]): str(Op(_PHASE_LETTER[Phase(int(e["phase"]))], int(e["microbatch"]), int(e["chunk"])))
                    for e in comp}
            for a, b in idle_windows(zip(comp["t0"], comp["t1"]), t0, end, min_s):
                name = ends.get(b, "end")
                out.append(BubbleWindow(r.rank, r.stage, a, b, name, expected[r.stage].get(name, 0.0)))
        return sorted(out, key=lambda w: (w.rank, w.t0))

    # --- p2p -------------------------------------------------------------------------------
    def p2p_messages(self) -> tuple[list[tuple], list[tuple]]:
        """(sends, recvs): each (direction, from_vstage, to_vstage, microbatch, rank, event index).

        The virtual stage of chunk v on stage s is v * p + s; activations flow to the next virtual
        stage, gradients to the previous one. Calls with no peer (the ends of the pipeline) are dropped.
        """
        p, v = self.num_stages, self.num_chunks
        last_vs = p * v - 1
        sends, recvs = [], []
        for r in self.ranks.values():
            info = assign_p2p_microbatches(r.events)
            for i, (e, d) in enumerate(zip(r.events, info)):
                if not d:
                    continue
                for direction in ("F", "B"):
                    if f"send_{direction}" in d:
                        vs = d[f"send_{direction}_chunk"] * p + r.stage
                        to = vs + 1 if direction == "F" else vs - 1
                        if 0 <= to <= last_vs:
                            sends.append((direction, vs, to, d[f"send_{direction}"], r.rank, i))
                    if f"recv_{direction}" in d:
                        vs = d[f"recv_{direction}_chunk"] * p + r.stage
                        frm = vs - 1 if direction == "F" else vs + 1
                        if 0 <= frm <= last_vs:
                            recvs.append((direction, frm, vs, d[f"recv_{direction}"], r.rank, i))
        return sends, recvs

    # --- critical path ---------------------------------------------------------------------
    def critical_path(self) -> list[tuple[int, Op, float, float]]:
        """Observed chain of compute ops that fixed the pipeline's end: (stage, op, t0, t1), in order.

        From the op that ends last, step to whichever constraint finished later before it started:
        the previous op on its stage, or the op on another stage that produced its input.
        """
        order = self.order
        times: dict[tuple[int, tuple], tuple[float, float]] = {}
        for s in range(self.num_stages):
            for e in self.representative(s).compute():
                op = Op(_PHASE_LETTER[Phase(int(e["phase"]))], int(e["microbatch"]), int(e["chunk"]))
                times[(s, op.key)] = (float(e["t0"]), float(e["t1"]))
        position = {(s, op.key): i for s, ops in enumerate(order.stages) for i, op in enumerate(ops)}
        last = max(times, key=lambda k: times[k][1])
        path = []
        cur = last
        while cur is not None:
            s, key = cur
            t0, t1 = times[cur]
            path.append((s, Op(*key), t0, t1))
            i = position[cur]
            cands = []
            if i > 0:
                prev = (s, order.stages[s][i - 1].key)
                cands.append(prev)
            prod = order.producer(s, Op(*key))
            if prod is not None:
                cands.append((prod[0], prod[1].key))
            cands = [c for c in cands if c in times and times[c][1] <= t0 + 1e-6]
            cur = max(cands, key=lambda c: times[c][1]) if cands else None
        return path[::-1]

    # --- export ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "schedule": self.schedule, "stages": self.num_stages,
                "microbatches": self.num_microbatches, "chunks": self.num_chunks,
                "span_s": self.pipeline_end - self.t_start, "bubble_fraction": self.stage_bubble_fractions()}


# The schedule's bubble (pipeline/bubbles.py), under the name the timeline tools use.
theoretical_bubble_fraction = schedule_bubble_fraction


def doc_lengths_of(record: IterationRecord, microbatch: int) -> list[list[int]]:
    return record.doc_lengths[microbatch] if 0 <= microbatch < len(record.doc_lengths) else []


