"""A rank's Bubble Squeezer figures: one record per run, kept across resumed runs.

``figures_rank<R>.json`` holds every run's record under ``runs`` (oldest first) and, at its top
level, the figures of all those runs together: the fields the cluster simulator
(``--bubble-speed-from``) and the benchmark read, as before records were kept. A run appends its
record and never replaces an earlier one, so a resumed run whose guests found the study finished
(and measured nothing) adds a record of zeros and leaves the totals as they were. A figure without
a sample (no window seen, no pause measured) is null in the file and "n/a" in the log, never NaN.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)

# Figures that add up over runs, lists that concatenate, and those that describe the latest run.
SUMS = ("window_s", "guest_busy_s", "guest_overrun_s", "guest_steps", "guest_trial_steps", "windows_offered",
        "windows_used", "windows_skipped", "units", "long_units", "restarts", "halts", "units_outlived",
        "pause_latencies_lost")
LISTS = ("pause_latencies_s", "blocks", "deaths")
LATEST = ("rank", "layout", "engine", "iterations")


def finite(x: Any) -> Any:
    """``x`` with every NaN or infinity (nested) replaced by None: a figure without a sample."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def read_runs(path: str) -> list[dict[str, Any]]:
    """The run records of ``path`` (none when it does not exist). A file written before records
    were kept (the figures at the top level, no ``runs``) is one run's record. An unreadable file is
    moved aside (``.unreadable``), not overwritten: what it held stays for a person to look at."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError) as exc:
        aside = path + ".unreadable"
        os.replace(path, aside)
        logger.warning("squeeze: %s was unreadable (%s): moved to %s, a new one started", path, exc, aside)
        return []
    runs = data.get("runs")
    if isinstance(runs, list):
        return [r for r in runs if isinstance(r, dict)]
    return [data]


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of ``runs`` together (the file's top level), with ``runs`` itself."""
    last = runs[-1]
    out: dict[str, Any] = {k: last.get(k) for k in LATEST}
    out["first_iteration"] = runs[0].get("first_iteration")
    for k in SUMS:
        out[k] = sum(r.get(k) or 0 for r in runs)
    for k in LISTS:
        out[k] = [x for r in runs for x in (r.get(k) or [])]
    busy, window = out["guest_busy_s"], out["window_s"]
    out["bubble_used"] = busy / window if window > 0 else 0.0
    out["guest_steps_per_busy_s"] = out["guest_steps"] / busy if busy > 0 else 0.0
    out["fusion"] = next((r["fusion"] for r in reversed(runs) if r.get("fusion")), 0)
    # error summaries do not add up: the latest run's that saw windows
    out["forecast"] = next((r["forecast"] for r in reversed(runs) if (r.get("forecast") or {}).get("windows")),
                           last.get("forecast"))
    out["runs"] = runs
    return out


def append_run(path: str, record: dict[str, Any]) -> dict[str, Any]:
    """Add this run's ``record`` to ``path`` (written whole, then renamed into place) and return
    the file's new content."""
    runs = read_runs(path)
    runs.append(finite(record))
    fig = combine(runs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(fig, fh, indent=1, allow_nan=False)
    os.replace(path + ".tmp", path)
    return fig


def p99_s(latencies: list[float]) -> float | None:
    lat = sorted(latencies)
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None


def end_line(rank: int, s: dict[str, Any], path: str, runs: int) -> str:
    """The rank's line at the end of a run (``s``: ``Squeezer.stats()``)."""
    used = f"{100 * s['used']:.0f}%" if s["window_s"] > 0 else "n/a"
    p99 = p99_s(s["latencies"])
    return (f"squeeze: rank {rank}: guest used {used} of {s['window_s']:.1f} s of bubbles ({s['windows_used']} of "
            f"{s['windows_offered']} windows), {s['trial_steps']} trial-steps, pause latency p99 "
            f"{'n/a' if p99 is None else f'{p99 * 1e3:.2f} ms'}, {s['restarts']} restarts; figures in {path} "
            f"({runs} run{'s' if runs != 1 else ''} kept)")
