#!/usr/bin/env python
"""Run the README's ResiHP example N times and count the runs that name the injected rank.

    python tools/check_resihp_example.py --runs 10
    python tools/check_resihp_example.py --runs 5 -- --train-iters 50     # extra flags for each run

Each run is ``pretrain_gpt.py --nproc-per-node 4`` with the README's flags (PP2 x DP2, packed documents,
``--resihp``, one slow rank); the run's own last lines say whether a verdict named the injected rank
("resihp: injected: rank R xF slow from iteration I; named at iteration J ..." or "... no verdict").
Prints a table, then one JSON line: runs, named, wrong-rank verdicts, delays.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Keep in step with README.md ("Extensions in the loop").
EXAMPLE = ["--pipeline-model-parallel-size", "2", "--doc-length-dist", "lognormal:3.5,1", "--resihp",
           "--train-iters", "100", "--inject-slow", "2:30:3.0"]
OUTCOME = re.compile(r"resihp: injected: rank (\d+) x([\d.]+) slow from iteration (\d+); (.*)")
NAMED = re.compile(r"named at iteration (\d+) \(x([\d.]+), (\d+) iterations later\)")


def one_run(extra: list[str], workdir: str) -> dict:
    verdicts = os.path.join(workdir, "verdicts.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--nproc-per-node", "4", *EXAMPLE,
           "--resihp-verdicts-out", verdicts, *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    outcome = next((m for m in map(OUTCOME.search, out.splitlines()) if m), None)
    named = NAMED.search(outcome.group(4)) if outcome else None
    injected = int(outcome.group(1)) if outcome else None
    rows = [json.loads(line) for line in open(verdicts)] if os.path.exists(verdicts) else []
    wrong = [r for r in rows if r["kind"] == "fail_slow" and r["rank"] != injected]
    tail = "" if proc.returncode == 0 else " / ".join(out.strip().splitlines()[-3:])
    return {"rc": proc.returncode, "tail": tail, "named": bool(named), "delay": int(named.group(3)) if named else None,
            "factor": float(named.group(2)) if named else None, "wrong_rank_verdicts": len(wrong),
            "outcome": outcome.group(0) if outcome else "no outcome line (the run failed?)",
            "wall_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("extra", nargs="*", help="flags added to each run (after --)")
    args = parser.parse_args(argv)
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="resihp-example-") as tmp:
            res = one_run(args.extra, tmp)
        results.append(res)
        print(f"run {i + 1:2d}/{args.runs}: rc {res['rc']} | {res['outcome']} | wrong-rank verdicts "
              f"{res['wrong_rank_verdicts']} | {res['wall_s']} s", flush=True)
        if res["tail"]:
            print(f"    failed run's last lines: {res['tail'][:600]}", flush=True)
    delays = [r["delay"] for r in results if r["delay"] is not None]
    summary = {"example": " ".join(EXAMPLE + args.extra), "runs": len(results),
               "named": sum(r["named"] for r in results),
               "wrong_rank_verdicts": sum(r["wrong_rank_verdicts"] for r in results),
               "failed_runs": sum(r["rc"] != 0 for r in results),
               "delay_iters": {"median": statistics.median(delays) if delays else None,
                               "max": max(delays) if delays else None}}
    print(f"\nnamed the injected rank in {summary['named']} of {summary['runs']} runs; "
          f"wrong-rank verdicts {summary['wrong_rank_verdicts']}; delay median {summary['delay_iters']['median']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
