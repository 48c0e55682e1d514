"""ResiHP through one held-out mixed day of ``tools/bench_resilience.py``, traced: the planner's and
the policy's log (every re-plan, every threshold it missed, every measured shape factor) and the
tokens per hour of the day, as the nominal scorer times them.

Run: ``python tools/bench_resilience.py``'s cell ``MODEL/mixed_day@SEED`` as
``python tools/trace_resihp_day.py MODEL SEED`` (a minute or two; deterministic). With
``--against recycle`` (any baseline of the bench) that policy runs the same day too, and each hour
prints both and ResiHP's share of it, so the hours where ResiHP falls behind stand out. With
``--perturb 0.2`` the day is timed by the bench's perturbed scorer instead (the same draw as the
bench's cell with ``--perturb 0.2 --perturb-seed 0``); no policy is told."""
import argparse
import collections
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_ext.resilience import perturb, resihp_policy, setting  # noqa: E402
from megatron_ext.resihp.planner import node_local_groups  # noqa: E402
from megatron_ext.resihp.planner_types import PlanLayout  # noqa: E402
from megatron_ext.resilience.policies import BASELINES  # noqa: E402
from megatron_ext.resilience.run import run_policy  # noqa: E402


TRACED = ("megatron_ext.resihp.planner", "megatron_ext.resihp.planner_policy")


def shapes_at_end(policy) -> None:
    """The planner's view at the day's end: the layout it holds and, for every (tp, pp) shape the
    job ran, that shape with even stages and micro-batches over the devices alive then (TP groups
    inside nodes), as the planner prices it (its measured shape factors included)."""
    pol = policy.policy
    planner, lay, speeds = pol.planner, pol.layout, pol.speeds
    alive = [d for d in range(speeds.shape[0]) if speeds[d] > 0]
    held = planner.iteration_s(lay, speeds, pol.links, pol.nics, pol.paths) * planner.shape_factor(lay)
    print(f"at the day's end: {len(alive)} devices alive; holding tp{lay.tp}pp{lay.pp}dp{lay.dp} at {held:.2f} s "
          "as the planner prices it; each shape the job ran, evenly over the alive devices:")
    for tp, pp in sorted(planner.shape_factors):
        dp = min(len(alive) // (tp * pp), lay.num_microbatches)
        if dp < 1:
            continue
        even = PlanLayout.even(num_layers=planner.spec.num_layers, tp=tp, pp=pp, dp=dp,
                               num_microbatches=lay.num_microbatches, devices=alive[:tp * pp * dp])
        if planner.cluster.devices_per_node:   # TP groups inside nodes, as the planner places them
            even = node_local_groups(even, planner.cluster.devices_per_node, speeds)
        t = planner.iteration_s(even, speeds, pol.links, pol.nics, pol.paths) * planner.shape_factor(even)
        print(f"  tp{tp}pp{pp}dp{dp}: {max(even.microbatches)} micro-batches on the busiest replica, {t:.2f} s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=list(setting.LAYOUTS))
    ap.add_argument("seed", type=int, help="a held-out seed (bench_resilience prints them)")
    ap.add_argument("--against", choices=list(BASELINES), default=None,
                    help="a baseline to run on the same day, hour by hour beside ResiHP")
    ap.add_argument("--perturb", type=float, default=0.0,
                    help="time the day by the perturbed scorer of this spread, as bench_resilience's --perturb "
                         "(default 0: the nominal scorer)")
    ap.add_argument("--perturb-seed", type=int, default=0, help="as bench_resilience's --perturb-seed")
    args = ap.parse_args(argv)
    if not 0.0 <= args.perturb < 1.0:
        ap.error(f"--perturb must be a fraction in [0, 1), got {args.perturb}")
    if args.perturb_seed < 0:
        ap.error(f"--perturb-seed must be >= 0, got {args.perturb_seed}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    for name in TRACED:
        logging.getLogger(name).setLevel(logging.DEBUG)
    ctx = setting.context(args.model)
    day = setting.heldout_day(ctx, args.seed)
    scorer = None
    if args.perturb:   # the bench's own draw for this cell
        scorer = perturb.perturbed(ctx, perturb.cell_truths(ctx, f"{args.model}/{day.name}", args.perturb,
                                                            args.perturb_seed))
    trace = setting.trace(ctx, day)

    def run(policy) -> dict[int, float]:
        """The policy through the day: its summary line, and its tokens per hour."""
        per_hour: dict[int, float] = collections.defaultdict(float)
        result = run_policy(policy, ctx, trace, end_s=day.end_s, measure_from_s=day.measure_from_s,
                            scorer=scorer,
                            on_iteration=lambda t, tokens: per_hour.__setitem__(int(t // 3600),
                                                                                per_hour[int(t // 3600)] + tokens))
        print(f"{args.model}/{day.name}{' (perturbed)' if scorer else ''}: {policy.name} "
              f"{result.throughput_vs_healthy:.4f} of healthy, "
              f"{result.relayouts} re-layouts, {result.pause_s:.0f} s paused")
        return per_hour

    resihp = resihp_policy.make("resihp")
    per_hour = run(resihp)
    shapes_at_end(resihp)
    print("G tokens per hour: " + ", ".join(f"{h}: {v / 1e9:.3f}" for h, v in sorted(per_hour.items())))
    if args.against:
        for name in TRACED:   # ResiHP's trace only
            logging.getLogger(name).setLevel(logging.WARNING)
        other = run(resihp_policy.make(args.against))
        print(f"hour  resihp  {args.against:>8}  resihp/{args.against} (G tokens)")
        for h in sorted(set(per_hour) | set(other)):
            a, b = per_hour.get(h, 0.0), other.get(h, 0.0)
            print(f"{h:4d}  {a / 1e9:6.3f}  {b / 1e9:8.3f}  {a / b if b else float('nan'):.3f}")


if __name__ == "__main__":
    main()
