"""How long one real all-reduce takes on these CPU ranks, by payload (issue #48 item 3): the term of
Helix's cost model that its compile-time calibration measures (``calibrate.measure_collectives``).

Two gloo ranks pinned one per core, as bench_helix runs them. For every payload, rounds of one
all-reduce each in two conditions, the order of the (payload, condition) pairs rotated every round:

  idle           right after a small all-reduce that lines the ranks up (how the compiler measures)
  after compute  the same, then --compute-ms of matmuls on both ranks first (as in a step, where
                 a collective follows the layer's compute)
  idle (A/A)     "idle" again: the noise floor of the comparison

For each: the mean, the mean less the slowest and the fastest run (what the compiler keeps since
400b5e1), the median (what it kept before) and the quartiles, rank 0's wall time from the start
of the collective to the end of its wait, and the share of runs that stalled: slower than the
fastest tenth of that payload's runs (every condition) by more than --stall-ms.

Prints a table, then one JSON line:
  {"bench": "bench_gloo_sizes", "payloads": {"524288": {"idle": {"mean_ms", "trimmed_mean_ms",
   "median_ms", "q1_ms", "q3_ms", "stalled"}, "after compute": {...}, "idle (A/A)": {...}}, ...},
   "args": {...}}
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report, aa_name, rotated_order  # noqa: E402
from megatron_ext.helix.calibrate import trimmed_mean  # noqa: E402
from tools import bench_helix as bh  # noqa: E402

CONDITIONS = ("idle", "after compute", aa_name("idle"))


def summarise(times: dict[str, list[float]], stall_s: float) -> dict[str, dict]:
    """Per condition, the statistics of its run times (seconds) in ms; a run stalled where it is
    slower than the fastest tenth of all the payload's runs by more than ``stall_s``."""
    every = sorted(t for v in times.values() for t in v)
    if not every:
        raise ValueError("bench_gloo_sizes: no runs to summarise")
    fast = every[max(0, len(every) // 10 - 1)]
    out = {}
    for cond, v in times.items():
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        out[cond] = {"mean_ms": statistics.mean(v) * 1e3, "trimmed_mean_ms": trimmed_mean(v) * 1e3,
                     "median_ms": statistics.median(v) * 1e3, "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3,
                     "stalled": sum(t > fast + stall_s for t in v) / len(v)}
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    with bh.rank_session(rank, world, port, []):
        ops = torch.ops._c10d_functional
        group = dist.group.WORLD.group_name
        sync = torch.zeros(8)
        a, b = torch.randn(256, 512), torch.randn(512, 512)
        bufs = {p: torch.randn(p // 4) for p in args.payloads}

        def compute(seconds: float) -> None:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                torch.mm(a, b)

        for buf in bufs.values():   # warm-up: connections and buffers
            ops.wait_tensor(ops.all_reduce(buf, "sum", group))
        pairs = [(p, c) for p in args.payloads for c in CONDITIONS]
        times = {pair: [] for pair in pairs}
        for r in range(args.rounds):
            for p, cond in rotated_order(pairs, r):
                ops.wait_tensor(ops.all_reduce(sync, "sum", group))
                if cond == "after compute":
                    compute(args.compute_ms / 1e3)
                t0 = time.perf_counter()
                ops.wait_tensor(ops.all_reduce(bufs[p], "sum", group))
                times[(p, cond)].append(time.perf_counter() - t0)
        if rank == 0:
            queue.put({p: {c: times[(p, c)] for c in CONDITIONS} for p in args.payloads})


def table(results: dict[int, dict[str, dict]]) -> str:
    lines = ["gloo all-reduce on 2 CPU ranks (one core each), rank 0's time per run, ms",
             f"{'payload':>9} {'condition':<14} {'mean':>7} {'trimmed':>8} {'median':>7} {'q1':>6} {'q3':>6} "
             f"{'stalled':>8}", "-" * 74]
    for p, conds in results.items():
        for cond, s in conds.items():
            lines.append(f"{p // 1024:>5} KiB {cond:<14} {s['mean_ms']:7.2f} {s['trimmed_mean_ms']:8.2f} "
                         f"{s['median_ms']:7.2f} {s['q1_ms']:6.2f} {s['q3_ms']:6.2f} {s['stalled']:8.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--payloads", nargs="+", type=int, default=[k << 10 for k in (64, 128, 256, 512, 1024, 2048)],
                   help="bytes (float32, a multiple of 8)")
    p.add_argument("--rounds", type=int, default=61, help="runs per payload and condition")
    p.add_argument("--compute-ms", type=float, default=3.0, help="compute before the collective ('after compute')")
    p.add_argument("--stall-ms", type=float, default=1.5, help="how much slower than the fastest tenth is a stall")
    args = p.parse_args(argv)
    if any(b <= 0 or b % 8 for b in args.payloads):
        p.error(f"--payloads must be positive multiples of 8 bytes, got {args.payloads}")
    if args.rounds < 2:
        p.error(f"--rounds must be at least 2, got {args.rounds}")
    report = Report("bench_gloo_sizes")
    raw = bh._spawn_ranks(worker, 2, (args,), "the ranks")
    results = {b: summarise(raw[b], args.stall_ms / 1e3) for b in args.payloads}
    report.emit({"payloads": {str(b): s for b, s in results.items()}, "args": vars(args)}, table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
