"""Replay a ResiHP trace offline: run the detectors over it, print their verdicts and, when the
trace carries fault labels, precision / recall / F1 / detection delay / false alarms.

    python -m megatron_ext.resihp.replay TRACE.jsonl [--detector resihp|raw|both]
        [--resihp-threshold 1.25 --resihp-window 7 ...] [--plot FIG.png] [--json]

Detector settings are the training flags (``--resihp-*``). Fail-stop is replayed from the
records' ``time_s``: a rank beats whenever it reports durations, and a rank silent for
``--ft-heartbeat-timeout-s`` of trace time is declared stopped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from typing import Iterable, Sequence

from megatron_ext.config.base import ArgumentParser, add_flags, build
from megatron_ext.errors import UserError, report
from megatron_ext.ft.config import FaultToleranceConfig
from megatron_ext.ft.liveness import HeartbeatTracker
from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.detector import IterationReport, make_detector
from megatron_ext.resihp.metrics import DetectionMetrics, labels_of, score
from megatron_ext.resihp.trace import TraceRecord, read_trace
from megatron_ext.resihp.verdicts import Verdict, VerdictLog

PROG = "python -m megatron_ext.resihp.replay"
HEARTBEAT_TIMEOUT_S = FaultToleranceConfig().ft_heartbeat_timeout_s

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReplayResult:
    detector: str
    verdicts: list[Verdict]
    reports: list[IterationReport]
    metrics: DetectionMetrics | None


def replay(records: Sequence[TraceRecord], config: ResiHPConfig, detector: str,
           keep_reports: bool = False, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> ReplayResult:
    """Run one detector (and the heartbeat tracker, ``--ft-heartbeat-timeout-s``) over records."""
    det = make_detector(config, detector)
    verdicts: list[Verdict] = []
    reports: list[IterationReport] = []
    tracker: HeartbeatTracker | None = None
    stage_of: dict[int, int] = {}
    for rec in records:
        rep = det.observe(rec)
        verdicts += rep.verdicts
        if keep_reports:
            reports.append(rep)
        if rec.time_s is None:
            continue
        if tracker is None or set(tracker.last_seen) != set(range(rec.layout.world_size)):
            stage_of = {r: rec.layout.coords(r)[0] for r in range(rec.layout.world_size)}
            tracker = HeartbeatTracker(range(rec.layout.world_size), heartbeat_timeout_s,
                                       start_s=rec.time_s - rec.iteration_s)
        tracker.set_iteration(rec.iteration)
        for r in [int(x) for x in rec.present.nonzero()[0]]:
            tracker.beat(r, rec.time_s)
        verdicts += [Verdict.fail_stop(s, stage=stage_of.get(s.rank)) for s in tracker.check(rec.time_s)]
    labelled = any(r.faults for r in records)
    metrics = score(labels_of(records), verdicts) if labelled else None
    return ReplayResult(det.name, verdicts, reports, metrics)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def metrics_table(results: Iterable[ReplayResult]) -> str:
    # "wrong" counts every verdict that names no fault; the false-alarm rate counts only those in
    # healthy iterations (a wrong rank named during a fault lowers precision, not that rate).
    rows = ["detector   verdicts  wrong  precision  recall     f1  delay_iters  false_alarms/10k_healthy"]
    for res in results:
        m = res.metrics
        if m is None:
            continue
        rows.append(f"{res.detector:<9} {m.verdicts:>9} {m.wrong:>6} {_fmt(m.precision):>10} {_fmt(m.recall):>7} "
                    f"{_fmt(m.f1):>6} {_fmt(m.delay_iters, '.1f'):>12} {_fmt(m.false_alarms_per_10k, '.2f'):>25}")
    return "\n".join(rows)


def plot(records: Sequence[TraceRecord], result: ReplayResult, path: str, title: str) -> None:
    """Observed vs expected iteration time, fault onsets and verdicts marked; iterations drawn
    from the long-document corpus are not labelled in traces, so they are not marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r.iteration for r in result.reports if r.expected_s is not None]
    obs = [r.observed_s for r in result.reports if r.expected_s is not None]
    exp = [r.expected_s for r in result.reports if r.expected_s is not None]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[2, 1])
    ax.plot(its, obs, lw=1, label="observed iteration time")
    ax.plot(its, exp, lw=1, label="expected (FLOPs / calibrated throughput, pipeline-simulated)")
    ax.set_ylabel("seconds")
    ax2.plot(its, [o / e for o, e in zip(obs, exp)], lw=1, color="C2", label="observed / expected")
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_ylabel("ratio")
    ax2.set_xlabel("iteration")
    onsets = {(f.rank, f.since, f.factor) for r in records for f in r.faults if f.kind == "slow"}
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for rank, since, factor in sorted(onsets):
        for a in (ax, ax2):
            a.axvline(since, color="red", ls="--", lw=1)
        ax.text(since, 0.02, f" fault: rank {rank} x{factor:g}", transform=top, color="red", fontsize=8)
    for v in result.verdicts:
        if v.kind == "fail_slow":
            for a in (ax, ax2):
                a.axvline(v.iteration, color="black", ls=":", lw=1)
            ax2.text(v.iteration, 0.85, f" verdict: rank {v.launch_rank} x{v.factor:.2f}",
                     transform=ax2.get_xaxis_transform(), fontsize=8)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="trace file (JSON lines, format v1)")
    parser.add_argument("--detector", choices=("resihp", "raw", "both"), default="both")
    parser.add_argument("--plot", default="", help="write observed vs expected iteration time to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON line of the results last")
    add_flags(parser, ResiHPConfig)
    parser.add_argument("--ft-heartbeat-timeout-s", "--resihp-heartbeat-timeout-s", type=float,
                        default=HEARTBEAT_TIMEOUT_S, help="A rank whose beats stop for this long (trace time) is "
                        f"declared stopped, as the job's fault-tolerance core would (default: {HEARTBEAT_TIMEOUT_S})")
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: warning: %(message)s")
    try:
        args = parser.parse_args(argv)
        config = build(ResiHPConfig, vars(args), where="command line")
        records = list(read_trace(args.trace))
    except UserError as exc:
        return report(PROG, exc)
    if not records:
        return report(PROG, f"{args.trace}: no records")
    names = ["resihp", "raw"] if args.detector == "both" else [args.detector]
    results = [replay(records, config, n, keep_reports=bool(args.plot) and n == "resihp",
                      heartbeat_timeout_s=args.ft_heartbeat_timeout_s) for n in names]
    print(f"{args.trace}: {len(records)} iterations ({records[0].iteration}..{records[-1].iteration})")
    log = VerdictLog(config.resihp_verdicts_out) if config.resihp_verdicts_out else None
    for res in results:
        print(f"\n[{res.detector}] {len(res.verdicts)} verdict(s)")
        for v in res.verdicts:
            print("  " + v.describe())
            if log is not None:
                log.write(v)
    if log is not None:
        log.close()
    if any(r.metrics is not None for r in results):
        print("\n" + metrics_table(results))
    else:
        print("\n(no fault labels in the trace: nothing to score)")
    if args.plot:
        res = next((r for r in results if r.detector == "resihp"), None)
        if res is None:
            return report(PROG, "--plot needs the resihp detector (--detector resihp or both)")
        plot(records, res, args.plot, f"ResiHP replay of {os.path.basename(args.trace)}")
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({r.detector: {"verdicts": [v.to_dict() for v in r.verdicts],
                                       "metrics": None if r.metrics is None else r.metrics.summary()}
                          for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
