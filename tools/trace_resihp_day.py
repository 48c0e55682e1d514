"""ResiHP through one held-out mixed day of ``tools/bench_resilience.py``, traced: the planner's and
the policy's log (every re-plan, every threshold it missed, every measured shape factor) and the
tokens per hour of the day, as the nominal scorer times them.

Run: ``python tools/bench_resilience.py``'s cell ``MODEL/mixed_day@SEED`` as
``python tools/trace_resihp_day.py MODEL SEED`` (a minute or two; deterministic)."""
import argparse
import collections
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_ext.resilience import resihp_policy, setting  # noqa: E402
from megatron_ext.resilience.run import run_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=list(setting.LAYOUTS))
    ap.add_argument("seed", type=int, help="a held-out seed (bench_resilience prints them)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    for name in ("megatron_ext.resihp.planner", "megatron_ext.resihp.planner_policy"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    ctx = setting.context(args.model)
    day = setting.heldout_day(ctx, args.seed)
    per_hour: dict[int, float] = collections.defaultdict(float)
    result = run_policy(resihp_policy.make("resihp"), ctx, setting.trace(ctx, day), end_s=day.end_s,
                        measure_from_s=day.measure_from_s,
                        on_iteration=lambda t, tokens: per_hour.__setitem__(int(t // 3600), per_hour[int(t // 3600)] + tokens))
    print(f"{args.model}/{day.name}: resihp {result.throughput_vs_healthy:.4f} of healthy, "
          f"{result.relayouts} re-layouts, {result.pause_s:.0f} s paused")
    print("G tokens per hour: " + ", ".join(f"{h}: {v / 1e9:.3f}" for h, v in sorted(per_hour.items())))


if __name__ == "__main__":
    main()
