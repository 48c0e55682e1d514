#!/usr/bin/env python
"""Gantt chart (PNG) of pipeline iterations from ``--timeline-out`` Chrome-trace JSON files.

    python tools/plot_timeline.py RUN/timeline_iter0000005.json -o docs/img/pipeline_deepspeed.png
    # before and after a re-layout: one panel per file, on one time scale
    python tools/plot_timeline.py RUN/timeline_iter0000020.json RUN/timeline_iter0000040.json -o out.png \
        --title "before" --title "after"

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


def plot(trace: dict[str, Any] | list[dict[str, Any]], out: str, *, title: str | list[str] | None = None,
         dpi: int = 130) -> str:
    """Write the PNG: one panel per trace, stacked, on the same time scale (so that iterations of
    one run before and after a change compare by length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traces = trace if isinstance(trace, list) else [trace]
    titles = title if isinstance(title, list) else [title] * len(traces)
    if len(titles) != len(traces):
        raise ValueError(f"{len(titles)} titles for {len(traces)} traces: give one --title per trace, or none")
    rows = [_ranks(t) for t in traces]
    end_ms = max(_end_ms(t) for t in traces)
    heights = [0.9 * len(r[0]) + 0.9 for r in rows]
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    guests = False
    for ax, t, (ranks, names), ttl in zip(axes[:, 0], traces, rows, titles):
        guests |= _draw(ax, t, ranks, names, end_ms, ttl)
    ax = axes[-1, 0]
    ax.set_xlabel("ms from the start of the iteration")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles += [Patch(color=BUBBLE_MEASURED, label="bubble (measured)"),
                Patch(color=BUBBLE_EXPECTED, label="bubble (schedule predicts)")]
    if guests:
        handles.append(Patch(color=GUEST, label="bubble guest ran"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.1 / len(rows[-1][0])), ncol=5,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _ranks(trace: dict[str, Any]) -> tuple[list[int], dict[int, str]]:
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    stage_of = {pid: int(name.split("stage ")[1].split(",")[0]) for pid, name in names.items()}
    return sorted(names, key=lambda pid: (stage_of[pid], pid)), names


def _end_ms(trace: dict[str, Any]) -> float:
    return max((e["ts"] + e["dur"]) / 1000 for e in trace["traceEvents"] if e.get("ph") == "X")


def _draw(ax, trace: dict[str, Any], ranks: list[int], names: dict[int, str], end_ms: float,
          title: str | None) -> bool:
    """One iteration's rows on ``ax``; returns whether it has guest intervals."""
    meta = trace["metadata"]["megatron_ext"]
    row = {pid: i for i, pid in enumerate(ranks)}
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
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
    fractions = meta.get("bubble_fraction", [])
    p, m, v = meta["stages"], meta["microbatches"], meta.get("chunks", 1)
    theory = (p - 1) / (v * m + p - 1)
    own_ms = _end_ms(trace)
    default_title = (f"{meta['schedule']} schedule, {p} stages, {m} micro-batches, iteration {meta['iteration']} "
                     f"({own_ms:.0f} ms): bubble per stage {', '.join(f'{f:.2f}' for f in fractions)} "
                     f"(theory {theory:.2f})")
    ax.set_title(title or default_title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return any(e["cat"] == "guest" for e in spans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="+", help="timeline_iterNNNNNNN.json files written by --timeline-out "
                        "(several: one panel each, on one time scale)")
    parser.add_argument("-o", "--out", required=True, help="PNG file to write")
    parser.add_argument("--title", action="append", default=None, help="a panel's title (once per trace, in order)")
    parser.add_argument("--dpi", type=int, default=130)
    args = parser.parse_args(argv)
    if args.title is not None and len(args.title) != len(args.trace):
        print(f"plot_timeline.py: error: {len(args.title)} --title for {len(args.trace)} traces: give one per trace, "
              "or none", file=sys.stderr)
        return 2
    try:
        traces = [load_trace(t) for t in args.trace]
    except (OSError, ValueError) as exc:
        print(f"plot_timeline.py: error: {exc}", file=sys.stderr)
        return 2
    print(plot(traces, args.out, title=args.title, dpi=args.dpi))
    return 0


if __name__ == "__main__":
    sys.exit(main())
