"""Benchmark the ResiHP fail-slow detector against the raw busy-time baseline.

(a) Synthetic: random labelled jobs (8-64 stages, 1F1B and interleaved, TP/DP 1-2, heavy-tailed
    packed documents, unlabelled short slow bursts; half of the jobs with one or two spans of
    data from a long-document corpus), half of them with one fail-slow fault of a random factor
    in [1.1, 3] at a random rank and iteration. Both detectors see the same traces
    with the same settings (defaults of ResiHPConfig); the headline figures (JSON) are over the
    jobs whose fault is at least 1.3x (the target) plus the healthy jobs; the table also shows the
    1.1-1.3x faults.
(b) Live: pretrain_gpt.py on 4 CPU ranks (PP2 x DP2, packed documents) with --resihp: one run
    with rank 2 made 2x slower from iteration 30 (throttled, --inject-slow), one where rank 3 dies
    (SIGKILL, --inject-stop) with a 3 s heartbeat timeout; ranks are started directly so only the
    heartbeat names the dead rank. stop_delay_s is the time from the last heartbeat the survivors saw
    to the verdict (an upper bound of the time from the death). ``--no-live`` skips it.

Prints a table, then one JSON line:
  {"synthetic": {"resihp": {...}, "baseline": {...}}, "live": {...}}
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.resihp.config import ResiHPConfig  # noqa: E402
from megatron_ext.resihp.detector import RawTimeDetector, ResiHPDetector  # noqa: E402
from megatron_ext.resihp.metrics import DetectionMetrics, labels_of, score  # noqa: E402
from megatron_ext.resihp.synthetic import generate, random_spec  # noqa: E402

DETECTORS = (("resihp", ResiHPDetector), ("baseline", RawTimeDetector))


def bucket(spec) -> str:
    if not spec.faults:
        return "healthy"
    return "slow>=1.3x" if spec.faults[0].factor >= 1.3 else "slow<1.3x"


def run(args: argparse.Namespace) -> dict:
    cfg = ResiHPConfig()
    rng = np.random.default_rng(args.seed)
    per: dict[tuple[str, str], DetectionMetrics] = {}
    by_size: dict[tuple[str, int], DetectionMetrics] = {}
    by_data: dict[tuple[str, str], DetectionMetrics] = {}
    cost_ms: dict[str, list[float]] = {name: [] for name, _ in DETECTORS}
    jobs = []
    t0 = time.time()
    for k in range(args.jobs):
        spec = random_spec(rng, iterations=args.iterations, fault_prob=args.fault_prob, warmup=cfg.resihp_warmup,
                           seed=args.seed * 100_003 + k)
        records = generate(spec)
        # Warm-up iterations cannot raise a verdict; leave them out of the healthy-iteration count.
        labels = [lab for lab in labels_of(records) if lab[0] > cfg.resihp_warmup]
        jobs.append(spec)
        for name, cls in DETECTORS:
            det = cls(cfg)
            verdicts = []
            t = time.perf_counter()
            for rec in records:
                verdicts += det.observe(rec).verdicts
            cost_ms[name].append(1e3 * (time.perf_counter() - t) / len(records))
            m = score(labels, verdicts)
            key = (name, bucket(spec))
            per[key] = per.get(key, DetectionMetrics()) + m
            by_size[(name, spec.stages)] = by_size.get((name, spec.stages), DetectionMetrics()) + m
            data = "data-mix shifts" if spec.long_document_spans else "steady data"
            by_data[(name, data)] = by_data.get((name, data), DetectionMetrics()) + m
        if args.verbose:
            print(f"job {k}: {spec.stages} stages x {spec.microbatches} mb, {spec.schedule}, tp{spec.tp} dp{spec.dp}, "
                  f"faults {[(f.rank, f.since, f.factor) for f in spec.faults]}", file=sys.stderr)
    wall = time.time() - t0

    def fmt(x: float, spec: str = ".3f") -> str:
        return "-" if x != x else format(x, spec)

    print(f"ResiHP detector benchmark (a): {args.jobs} synthetic jobs x {args.iterations} iterations, "
          f"seed {args.seed}, {wall:.0f} s")
    print(f"settings: threshold {cfg.resihp_threshold}, zscore {cfg.resihp_zscore}, window {cfg.resihp_window}, "
          f"warm-up {cfg.resihp_warmup}")
    header = f"{'detector':<9} {'jobs':<12} {'n':>4} {'faults':>6} {'prec':>6} {'recall':>6} {'f1':>6} " \
             f"{'delay':>6} {'FA/10k':>7} {'healthy it':>10}"
    print(header)
    print("-" * len(header))
    counts = {b: sum(1 for s in jobs if bucket(s) == b) for b in ("healthy", "slow>=1.3x", "slow<1.3x")}
    for name, _ in DETECTORS:
        for b in ("healthy", "slow>=1.3x", "slow<1.3x"):
            m = per.get((name, b), DetectionMetrics())
            print(f"{name:<9} {b:<12} {counts[b]:>4} {m.faults:>6} {fmt(m.precision):>6} {fmt(m.recall):>6} "
                  f"{fmt(m.f1):>6} {fmt(m.delay_iters, '.1f'):>6} {fmt(m.false_alarms_per_10k, '.2f'):>7} "
                  f"{m.healthy_iterations:>10}")
    print("\nby data (all jobs; 'data-mix shifts': spans of 10-40 iterations from a long-document corpus)")
    for name, _ in DETECTORS:
        row = [f"{name:<9}"]
        for data in ("steady data", "data-mix shifts"):
            m = by_data.get((name, data), DetectionMetrics())
            row.append(f"{data}: prec {fmt(m.precision)} recall {fmt(m.recall)} FA/10k "
                       f"{fmt(m.false_alarms_per_10k, '.1f')}")
        print("  ".join(row))
    print("\nby pipeline size (all jobs)")
    for name, _ in DETECTORS:
        row = [f"{name:<9}"]
        for stages in sorted({s.stages for s in jobs}):
            m = by_size[(name, stages)]
            row.append(f"{stages:>2} stages: f1 {fmt(m.f1)} FA/10k {fmt(m.false_alarms_per_10k, '.1f')}")
        print("  ".join(row))
    print("\ndetector cost per iteration (median over jobs): " +
          ", ".join(f"{n} {np.median(c):.2f} ms" for n, c in cost_ms.items()))
    headline = {}
    for name, _ in DETECTORS:
        m = per.get((name, "healthy"), DetectionMetrics()) + per.get((name, "slow>=1.3x"), DetectionMetrics())
        headline[name] = m.summary()
    return {"synthetic": headline, "live": None}


def run_live(slow_at: int = 30, stop_at: int = 8) -> dict:
    import tempfile

    from megatron_ext.runtime.launch import launch_ranks

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    common = ["pretrain_gpt.py", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "1",
              "--global-batch-size", "8", "--eval-iters", "0", "--lr-decay-style", "constant",
              "--doc-length-dist", "lognormal:3.5,1", "--resihp", "--resihp-warmup", "15", "--log-interval", "10"]
    with tempfile.TemporaryDirectory() as tmp:
        slow_file = os.path.join(tmp, "slow.jsonl")
        launch_ranks(common + ["--train-iters", str(slow_at + 30), "--inject-slow", f"2:{slow_at}:2.0",
                               "--resihp-verdicts-out", slow_file], 4, cwd=root)
        slow = [json.loads(x) for x in open(slow_file)] if os.path.exists(slow_file) else []
        stop_file = os.path.join(tmp, "stop.jsonl")
        launch_ranks(common + ["--train-iters", "200", "--inject-stop", f"3:{stop_at}",
                               "--resihp-heartbeat-interval-s", "0.5", "--resihp-heartbeat-timeout-s", "3",
                               "--resihp-verdicts-out", stop_file], 4, cwd=root)
        stop = [json.loads(x) for x in open(stop_file)] if os.path.exists(stop_file) else []
    slow_v = [v for v in slow if v["kind"] == "fail_slow"]
    stop_v = [v for v in stop if v["kind"] == "fail_stop"]
    first = slow_v[0] if slow_v else None
    live = {
        "slow_detected": bool(slow_v),
        "slow_rank_ok": bool(first and first["rank"] == 2 and all(v["rank"] == 2 for v in slow_v)),
        "slow_delay_iters": (first["iteration"] - slow_at) if first else None,
        "stop_detected": bool(stop_v),
        "stop_rank_ok": bool(stop_v and stop_v[0]["rank"] == 3),
        "stop_delay_s": round(stop_v[0]["detail"]["silent_s"], 3) if stop_v else None,
    }
    print("\nlive (4 CPU ranks, PP2 x DP2): fail-slow x2.0 on rank 2 from iteration "
          f"{slow_at}: detected {live['slow_detected']}, right rank {live['slow_rank_ok']}, delay "
          f"{live['slow_delay_iters']} iterations; fail-stop of rank 3: detected {live['stop_detected']}, "
          f"right rank {live['stop_rank_ok']}, {live['stop_delay_s']} s after its last heartbeat")
    return live


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=80, help="synthetic jobs (default 80)")
    parser.add_argument("--iterations", type=int, default=300, help="iterations per job (default 300)")
    parser.add_argument("--fault-prob", type=float, default=0.5, help="share of jobs with a fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-live", action="store_true", help="skip part (b), the live 4-rank runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    result = run(args)
    if not args.no_live:
        result["live"] = run_live()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
