"""Chrome-trace JSON of an IterationRecord (loads in Perfetto and chrome://tracing).

One process per rank (named with its stage, TP and DP coordinates); thread 0 carries the rank's
events coloured by phase, thread 1 its bubble windows, thread 2 (when given) the intervals its
Bubble Squeezer guest ran. Timestamps are microseconds from the start
of the iteration. Forward and backward events carry the micro-batch's per-document token lengths.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from megatron_ext.pipeline.events import Phase
from megatron_ext.pipeline.timeline import IterationRecord, doc_lengths_of

# Chrome's reserved colour names (Perfetto picks its own palette but keeps the categories).
COLOURS = {Phase.FORWARD: "thread_state_running", Phase.BACKWARD: "rail_animation",
           Phase.SEND: "thread_state_iowait", Phase.RECV: "thread_state_uninterruptible",
           Phase.GRAD_REDUCE: "rail_load", Phase.OPTIMIZER: "rail_idle", Phase.OTHER: "generic_work"}
BUBBLE_COLOUR = "terrible"
GUEST_COLOUR = "good"


def _name(e: np.void) -> str:
    phase = Phase(int(e["phase"]))
    if phase in (Phase.FORWARD, Phase.BACKWARD):
        return f"{'F' if phase == Phase.FORWARD else 'B'}{int(e['microbatch'])}" + (
            f".{int(e['chunk'])}" if int(e["chunk"]) else "")
    return phase.label


def to_chrome_trace(record: IterationRecord, *, min_bubble_s: float = 1e-4,
                    guests: dict[int, list[tuple[float, float]]] | None = None) -> dict[str, Any]:
    """``guests``: per rank, the intervals its bubble guest ran (record clock) -- thread 2."""
    origin = record.t_start
    us = lambda t: (float(t) - origin) * 1e6  # noqa: E731
    events: list[dict[str, Any]] = []
    for r in sorted(record.ranks.values(), key=lambda r: r.rank):
        events.append({"ph": "M", "name": "process_name", "pid": r.rank,
                       "args": {"name": f"rank {r.rank} (stage {r.stage}, tp {r.tp}, dp {r.dp})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r.rank, "args": {"sort_index": r.rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": 0, "args": {"name": "work"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": 1, "args": {"name": "bubbles"}})
        for e in r.events:
            if not np.isfinite(e["t1"]):
                continue
            phase = Phase(int(e["phase"]))
            args: dict[str, Any] = {"phase": phase.label}
            if phase in (Phase.FORWARD, Phase.BACKWARD):
                args.update(microbatch=int(e["microbatch"]), chunk=int(e["chunk"]),
                            doc_lengths=doc_lengths_of(record, int(e["microbatch"])))
            events.append({"ph": "X", "name": _name(e), "cat": phase.label, "pid": r.rank, "tid": 0,
                           "ts": us(e["t0"]), "dur": max((float(e["t1"]) - float(e["t0"])) * 1e6, 0.0),
                           "cname": COLOURS[phase], "args": args})
    for w in record.bubble_windows(min_s=min_bubble_s):
        events.append({"ph": "X", "name": f"bubble -> {w.ended_by}", "cat": "bubble", "pid": w.rank, "tid": 1,
                       "ts": us(w.t0), "dur": w.duration_s * 1e6, "cname": BUBBLE_COLOUR,
                       "args": {"stage": w.stage, "ended_by": w.ended_by, "duration_ms": w.duration_s * 1e3,
                                "expected_ms": w.expected_s * 1e3}})
    t_end = record.t_end
    for rank, runs in sorted((guests or {}).items()):
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 2, "args": {"name": "guest"}})
        for t0, t1 in runs:
            t0, t1 = max(t0, origin), min(t1, t_end)
            if t1 > t0:
                events.append({"ph": "X", "name": "guest", "cat": "guest", "pid": rank, "tid": 2, "ts": us(t0),
                               "dur": (t1 - t0) * 1e6, "cname": GUEST_COLOUR, "args": {"duration_ms": (t1 - t0) * 1e3}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"megatron_ext": record.summary()}}


def write_chrome_trace(record: IterationRecord, path: str,
                       guests: dict[int, list[tuple[float, float]]] | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(to_chrome_trace(record, guests=guests), fh)
    os.replace(tmp, path)
    return path
