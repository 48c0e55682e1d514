"""Benchmark of the cluster scheduler simulator (megatron_ext.cluster).

For every policy, the whole Philly trace (82k jobs) at load scales 1 and 5: wall time of parsing the
CSV plus simulating (median over --repeats; the (policy, load) cells interleaved, their order rotated
every repeat -- megatron_ext.bench.harness.rotated_order -- so that machine load hits them alike),
simulated events per second, average JCT and queueing delay; then the built-in bubble tuning
scenario's makespan ratio. The figures that matter (JCT, queueing, makespan) come from a
deterministic simulation: identical on every repeat and machine, so no A/A arm is run; the wall and
CPU times are secondary. Prints a table, then one JSON line (docs/benchmarks.md: with the commit, a
dirty-tree flag, the command line and the load average before and after):

    {"bench": "bench_cluster", "policies": {"fifo": {"avg_jct_s": ..., "avg_queue_s": ..., "wall_s": ...,
     ..., "load_5": {...}}, ...}, "bubble_scenario": {"makespan_ratio": ..., ...}, "commit": ..., ...}

Usage: python tools/bench_cluster.py [--trace PATH --vc-config PATH] [--repeats 3]
(default data: the embedded Philly trace, megatron_ext/cluster/data; see its NOTICE.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.bench.harness import Report, rotated_order  # noqa: E402
from megatron_ext.cluster.tuning import TuningScenario, run_tuning_scenario  # noqa: E402
from megatron_ext.cluster.config import POLICIES, ClusterSimConfig  # noqa: E402
from megatron_ext.cluster.engine import simulate  # noqa: E402
from megatron_ext.cluster.metrics import format_table, summarize  # noqa: E402
from megatron_ext.cluster.trace import default_trace, read_trace, read_vc_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    trace, vc_config = default_trace()
    ap.add_argument("--trace", default=trace)
    ap.add_argument("--vc-config", default=vc_config)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--load-scales", nargs="+", type=float, default=[1.0, 5.0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    report = Report("bench_cluster")
    for path in (args.trace, args.vc_config):
        if not os.path.isfile(path):
            print(f"error: {path} not found (pass --trace and --vc-config)", file=sys.stderr)
            return 2

    cells = [(p, s) for s in args.load_scales for p in args.policies]
    walls: dict[tuple, list[float]] = {c: [] for c in cells}
    cpus: dict[tuple, list[float]] = {c: [] for c in cells}
    sims: dict[tuple, list[float]] = {c: [] for c in cells}
    summaries: dict[tuple, dict] = {}
    for repeat in range(args.repeats):
        for policy, scale in rotated_order(cells, repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            vcs = read_vc_config(args.vc_config)
            trace = read_trace(args.trace, vcs, load_scale=scale)
            run = simulate(trace, ClusterSimConfig(policy=policy, load_scale=scale))
            walls[(policy, scale)].append(time.perf_counter() - t0)
            cpus[(policy, scale)].append(time.process_time() - c0)
            sims[(policy, scale)].append(run.wall_s)
            summaries[(policy, scale)] = summarize(run)  # deterministic: identical every repeat

    rows = []
    for policy, scale in cells:
        s = summaries[(policy, scale)]
        fifo = summaries.get(("fifo", scale))
        rows.append({"policy": policy, "load": scale, "avg_jct_s": s["avg_jct_s"], "p99_jct_s": s["p99_jct_s"],
                     "avg_queue_s": s["avg_queue_s"], "utilization": s["utilization"],
                     "jct_vs_fifo": s["avg_jct_s"] / fifo["avg_jct_s"] if fifo else float("nan"),
                     "preemptions": s["preemptions"], "events": s["events"],
                     "events_per_s": s["events"] / statistics.median(sims[(policy, scale)]),
                     "wall_s": statistics.median(walls[(policy, scale)]),
                     "cpu_s": statistics.median(cpus[(policy, scale)])})
    table = []
    table.append(f"Philly trace: {summaries[cells[0]]['jobs']} jobs, {len(summaries[cells[0]]['per_vc'])} VCs; "
                 f"median of {args.repeats} runs, cells in an order rotated every run; wall = CSV parsing + "
                 f"simulation (cpu: this process's CPU time, which a shared machine's load does not inflate)")
    table.append("No A/A arm: JCT, queueing and makespan come from a deterministic simulator (the same on "
                 "every run); only wall s, cpu s and events/s are timings.")
    table.append(format_table(rows, [("policy", "policy", ""), ("load", "load", "g"), ("avg_jct_s", "avg JCT s", ".0f"),
                              ("p99_jct_s", "p99 JCT s", ".0f"), ("avg_queue_s", "avg queue s", ".0f"),
                              ("jct_vs_fifo", "JCT/FIFO", ".3f"), ("utilization", "util", ".3f"),
                              ("preemptions", "preempt", "d"), ("events", "events", "d"),
                              ("events_per_s", "events/s", ".0f"), ("wall_s", "wall s", ".2f"),
                              ("cpu_s", "cpu s", ".2f")]))

    t0 = time.perf_counter()
    scenario = run_tuning_scenario(TuningScenario(), ClusterSimConfig())
    scenario_wall = time.perf_counter() - t0
    table.append("")
    table.append("Bubble scenario (1 exclusive GPU, 32-GPU 4-stage pipeline job holding the cluster):")
    table.append(format_table([scenario], [("makespan_exclusive_s", "exclusive only s", ".0f"),
                                    ("makespan_bubbles_s", "with bubbles s", ".0f"),
                                    ("makespan_ratio", "ratio", ".3f"),
                                    ("usable_bubble_slots", "usable slots", ".0f"),
                                    ("guest_speed", "guest speed", ".3f")]))

    out: dict = {"policies": {}, "load_scales": args.load_scales, "repeats": args.repeats,
                 "aa_arm": None, "why_no_aa_arm": "deterministic simulator: the figures repeat exactly"}
    for policy in args.policies:
        entry: dict = {}
        for i, scale in enumerate(args.load_scales):
            row = next(r for r in rows if r["policy"] == policy and r["load"] == scale)
            vals = {k: row[k] for k in ("avg_jct_s", "avg_queue_s", "p99_jct_s", "jct_vs_fifo", "wall_s",
                                        "cpu_s", "events_per_s")}
            if i == 0:
                entry.update(vals)
            else:
                entry[f"load_{scale:g}"] = vals
        out["policies"][policy] = entry
    out["bubble_scenario"] = {k: scenario[k] for k in ("makespan_ratio", "makespan_exclusive_s", "makespan_bubbles_s",
                                                       "usable_bubble_slots", "guest_speed")}
    out["bubble_scenario"]["wall_s"] = scenario_wall
    report.emit(out, "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
