#!/usr/bin/env python
"""Where in a scenario a resilience policy gains or loses: the throughput of each policy per time
bin (one hour by default), relative to the healthy job, in ``tools/bench_resilience.py``'s setting
(``megatron_ext.resilience``; docs/resilience.md).

A diagnostic beside the benchmark, not a benchmark: an iteration's tokens count in the bin in which
it ends, and a rollback's lost work is not taken back out of the bins (the last column of the
benchmark's table does that); ``-v`` prints every action with its time.

    python tools/resilience_hourly.py --model qwen2-57b-a14b --policies recycle resihp-noreadmit resihp
"""
from __future__ import annotations

import argparse
import logging
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_ext.resilience import resihp_policy, setting  # noqa: E402
from megatron_ext.resilience.run import run_policy  # noqa: E402

def hourly(model: str, scenario: str, policies: list[str], *, bin_s: float = 3600.0, start: str = "usual",
           verbose: bool = False) -> dict[str, list[float]]:
    """{policy: throughput relative to the healthy job in each bin of ``bin_s`` seconds}."""
    if not bin_s > 0:
        raise ValueError(f"--bin-s must be > 0, got {bin_s}")
    ctx = setting.context(model, start=start)
    scenarios = setting.scenarios(ctx)
    if scenario not in scenarios:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(scenarios)}")
    sc = scenarios[scenario]
    healthy = ctx.sim.healthy(ctx.start)
    rate = healthy.tokens / healthy.time_s
    bins = math.ceil(sc.end_s / bin_s)
    span = [min(bin_s, sc.end_s - k * bin_s) for k in range(bins)]
    trace = setting.trace(ctx, sc)
    out = {}
    for name in policies:
        tokens = [0.0] * bins

        def note(t: float, n: float, _tokens=tokens) -> None:
            _tokens[min(bins - 1, int(t // bin_s))] += n

        res = run_policy(resihp_policy.make(name), ctx, trace, end_s=sc.end_s, measure_from_s=sc.measure_from_s,
                         healthy_tokens_per_s=rate, on_iteration=note)
        out[name] = [tokens[k] / (rate * span[k]) for k in range(bins)]
        print(f"{name}: {res.throughput_vs_healthy:.4f} of healthy over the scenario, {res.relayouts} layout "
              f"changes, {res.restarts} restarts, {res.pause_s:.0f} s paused")
        if verbose:
            for e in res.events:
                print(f"    {e}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-57b-a14b", choices=list(setting.LAYOUTS))
    ap.add_argument("--scenario", default="mixed_day")
    ap.add_argument("--policies", nargs="+", default=["recycle", "resihp-noreadmit", "resihp"])
    ap.add_argument("--bin-s", type=float, default=3600.0, help="seconds per bin")
    ap.add_argument("--start", choices=setting.START, default="usual")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every policy's actions")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        for name in args.policies:
            resihp_policy.make(name)
        table = hourly(args.model, args.scenario, args.policies, bin_s=args.bin_s, start=args.start,
                       verbose=args.verbose)
    except ValueError as exc:
        print(f"resilience_hourly: {exc}", file=sys.stderr)
        return 2
    width = max(9, *(len(n) + 1 for n in args.policies))
    print(f"{args.model}/{args.scenario}: throughput relative to the healthy job per {args.bin_s:g} s")
    print(f"{'from (h)':>8} " + " ".join(f"{n:>{width}}" for n in args.policies))
    for k in range(len(next(iter(table.values())))):
        print(f"{k * args.bin_s / 3600:8.2f} " + " ".join(f"{table[n][k]:>{width}.3f}" for n in args.policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
