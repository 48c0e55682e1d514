"""Results of a simulation: JCT and queueing statistics, makespan, utilization, per VC; JSON and CSV.

* JCT = completion - submit; queueing delay = time a job spent waiting for GPUs (before its first
  start and after each preemption; time as a bubble guest counts as running).
* makespan = last completion - first submit (per VC: of that VC's jobs).
* utilization = GPU-seconds held by jobs / (GPUs x makespan). A preempted job's restart overhead
  counts as busy time: the GPUs are held. Bubble guests are reported apart (``bubble_gpu_s``).
* p99 uses numpy's linear interpolation between order statistics.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from typing import Any

import numpy as np

from megatron_ext.cluster.engine import SimRun
from megatron_ext.cluster.state import VCRun

logger = logging.getLogger(__name__)

SUMMARY_KEYS = ("avg_jct_s", "median_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s", "utilization")
JOB_COLUMNS = ("job_id", "vc", "gpus", "submit_s", "start_s", "end_s", "duration_s", "jct_s", "queue_s",
               "preemptions", "bubble_s")


def _arrays(vcs: list[VCRun]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    submit = np.fromiter((js.submit for v in vcs for js in v.states), dtype=float)
    end = np.fromiter((js.end for v in vcs for js in v.states), dtype=float)
    wait = np.fromiter((js.wait_s for v in vcs for js in v.states), dtype=float)
    gpus = np.fromiter((js.gpus for v in vcs for js in v.states), dtype=float)
    return submit, end, wait, gpus


def _stats(vcs: list[VCRun]) -> dict[str, float]:
    submit, end, wait, _ = _arrays(vcs)
    jct = end - submit
    makespan = float(end.max() - submit.min()) if len(end) else 0.0
    total_gpus = sum(v.spec.gpus for v in vcs)
    busy = sum(v.busy_gpu_s for v in vcs)
    return {
        "jobs": int(len(jct)),
        "gpus": int(total_gpus),
        "avg_jct_s": float(jct.mean()) if len(jct) else 0.0,
        "median_jct_s": float(np.median(jct)) if len(jct) else 0.0,
        "p99_jct_s": float(np.percentile(jct, 99)) if len(jct) else 0.0,
        "avg_queue_s": float(wait.mean()) if len(wait) else 0.0,
        "makespan_s": makespan,
        "utilization": busy / (total_gpus * makespan) if makespan > 0 else 0.0,
        "preemptions": int(sum(js.preemptions for v in vcs for js in v.states)),
        "bubble_gpu_s": float(sum(v.bubble_gpu_s for v in vcs)),
    }


def summarize(run: SimRun) -> dict[str, Any]:
    """The JSON summary (the CLI's last line with ``--json``)."""
    out: dict[str, Any] = {"policy": run.policy, "load_scale": run.load_scale,
                           "helios_compat": run.helios_compat}
    out.update(_stats(run.vcs))
    out["per_vc"] = {v.spec.name: _stats([v]) for v in run.vcs}
    out["dropped_jobs"] = dict(sorted(run.dropped.items()))
    out["rejected_rows"] = run.rejected
    out["events"] = run.events
    out["wall_s"] = run.wall_s
    return out


def jcts(run: SimRun) -> np.ndarray:
    submit, end, _, _ = _arrays(run.vcs)
    return end - submit


def write_jobs_csv(run: SimRun, path: str | os.PathLike) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(JOB_COLUMNS)
        for v in run.vcs:
            for js in v.states:
                w.writerow([js.job.job_id, v.spec.name, js.gpus, f"{js.submit:g}", f"{js.start:g}",
                            f"{js.end:g}", f"{js.job.duration:g}", f"{js.end - js.submit:g}",
                            f"{js.wait_s:g}", js.preemptions, f"{js.bubble_s:g}"])


def summary_csv(summary: dict[str, Any]) -> str:
    """One row per VC plus an ``all`` row."""
    cols = ("vc", "jobs", "gpus") + SUMMARY_KEYS + ("preemptions",)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    rows = list(summary["per_vc"].items()) + [("all", summary)]
    for name, s in rows:
        w.writerow([name] + [f"{s[c]:.6g}" if isinstance(s[c], float) else s[c] for c in cols[1:]])
    return buf.getvalue()


def write_outputs(run: SimRun, summary: dict[str, Any], out_dir: str | os.PathLike) -> list[str]:
    """summary.json, per_vc.csv and jobs.csv under ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("summary.json", "per_vc.csv", "jobs.csv")]
    with open(paths[0], "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    with open(paths[1], "w", encoding="utf-8") as fh:
        fh.write(summary_csv(summary))
    write_jobs_csv(run, paths[2])
    return paths


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns``: (key, header, format spec)."""
    head = [h for _, h, _ in columns]
    body = [[format(r[k], f) if f else str(r[k]) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
