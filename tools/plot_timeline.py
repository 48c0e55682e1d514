#!/usr/bin/env python
"""Gantt chart (PNG) of one pipeline iteration from a ``--timeline-out`` Chrome-trace JSON.

    python tools/plot_timeline.py RUN/timeline_iter0000005.json -o docs/img/pipeline_deepspeed.png

One row per rank (ordered by stage), time in ms from the start of the iteration. Forward and
backward passes are labelled with their micro-batch; p2p waits, gradient reduce, optimizer and
other work have their own colours. Under each row, the bubble lane: the measured idle window before
each op (light) and, right-aligned in it, the idle time the schedule's structure predicts for it
given this iteration's op durations (dark); above it, when the trace has them, the intervals the
Bubble Squeezer's guest ran (green). The title gives the measured bubble fraction per stage
and (p - 1) / (m + p - 1).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "send": "#c8a2c8", "recv": "#b0b0b0",
           "grad-reduce": "#dd8452", "optimizer": "#937860", "other": "#e5d8a0"}
BUBBLE_MEASURED = "#f4b6b6"
BUBBLE_EXPECTED = "#c0392b"
GUEST = "#2ca02c"


def load_trace(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        trace = json.load(fh)
    if "traceEvents" not in trace or "megatron_ext" not in trace.get("metadata", {}):
        raise ValueError(f"{path}: not a megatron_ext timeline (no traceEvents / metadata.megatron_ext)")
    return trace


def plot(trace: dict[str, Any], out: str, *, title: str | None = None, dpi: int = 130) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    meta = trace["metadata"]["megatron_ext"]
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    stage_of = {pid: int(name.split("stage ")[1].split(",")[0]) for pid, name in names.items()}
    ranks = sorted(names, key=lambda pid: (stage_of[pid], pid))
    row = {pid: i for i, pid in enumerate(ranks)}
    spans = [e for e in events if e.get("ph") == "X"]
    end_ms = max((e["ts"] + e["dur"]) / 1000 for e in spans)

    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.6))
    height, lane = 0.55, 0.22
    for e in spans:
        y = row[e["pid"]]
        t0, dur = e["ts"] / 1000, e["dur"] / 1000
        if e["cat"] == "guest":
            ax.broken_barh([(t0, dur)], (y - height / 2 - 0.15, 0.13), facecolors=GUEST, edgecolor="none")
            continue
        if e["cat"] == "bubble":
            yb = y + height / 2 + 0.04
            ax.broken_barh([(t0, dur)], (yb, lane), facecolors=BUBBLE_MEASURED, edgecolor="none")
            exp = min(e["args"].get("expected_ms", 0.0), dur)
            if exp > 0:
                ax.broken_barh([(t0 + dur - exp, exp)], (yb, lane), facecolors=BUBBLE_EXPECTED, edgecolor="none")
            continue
        colour = COLOURS.get(e["cat"], "#999999")
        ax.broken_barh([(t0, dur)], (y - height / 2, height), facecolors=colour, edgecolor="white", linewidth=0.3)
        if e["cat"] in ("forward", "backward") and dur > end_ms / 90:
            ax.text(t0 + dur / 2, y, e["name"], ha="center", va="center", fontsize=7,
                    color="white", fontweight="bold")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names[pid].replace(" (", "\n(") for pid in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("ms from the start of the iteration")
    fractions = meta.get("bubble_fraction", [])
    p, m, v = meta["stages"], meta["microbatches"], meta.get("chunks", 1)
    theory = (p - 1) / (v * m + p - 1)
    default_title = (f"{meta['schedule']} schedule, {p} stages, {m} micro-batches, iteration {meta['iteration']}: "
                     f"bubble per stage {', '.join(f'{f:.2f}' for f in fractions)} (theory {theory:.2f})")
    ax.set_title(title or default_title, fontsize=10)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles += [Patch(color=BUBBLE_MEASURED, label="bubble (measured)"),
                Patch(color=BUBBLE_EXPECTED, label="bubble (schedule predicts)")]
    if any(e["cat"] == "guest" for e in spans):
        handles.append(Patch(color=GUEST, label="bubble guest ran"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.1 / len(ranks)), ncol=5,
              fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a timeline_iterNNNNNNN.json written by --timeline-out")
    parser.add_argument("-o", "--out", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)
    parser.add_argument("--dpi", type=int, default=130)
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"plot_timeline.py: error: {exc}", file=sys.stderr)
        return 2
    print(plot(trace, args.out, title=args.title, dpi=args.dpi))
    return 0


if __name__ == "__main__":
    sys.exit(main())
