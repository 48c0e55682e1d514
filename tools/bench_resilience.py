"""ResiHP against the resilient-training systems it claims to beat, in the seed's setting, scored by an
independent simulator (``megatron_ext.resilience``; docs/resilience.md).

256 GPUs (32 nodes of 8, A100-like, NVLink in a node, a 200 Gb/s NIC per GPU) plus one spare node;
LLaMA-2-7B/13B/70B, Qwen2.5-14B and Qwen2-57B-A14B (MoE) shapes on usual TP x PP x DP layouts, a
global batch of 1,024 packed sequences of 4,096 tokens. Scenarios: one GPU slow 1.5x/2x/4x, a node
slow 2x, a NIC and a PP stage link at 1/2 and 1/4 bandwidth, one GPU lost, one node lost (each from
450 s, measured over the following hour), and a mixed day (24 hours, measured over all of it).

Policies: ``ckpt_restart`` (Megatron + NVRx in-job restart with a spare node), ``oobleck``,
``recycle``, ``malleus`` (Malleus-like re-planner), ``adaptra``, ``torchft`` (DP shrink),
``resihp`` (ResiHP's planner and hysteresis as they are, ``megatron_ext.resihp``, told the node
size, given the NIC verdicts of its ring probe), ``resihp-nodeless`` (the planner before it knew
nodes: the "before" of that change), ``resihp-nicless`` (the planner before it took NIC verdicts),
``resihp-noreadmit`` (before slow devices left out of the job were readmitted after an hour and DP
could grow back onto them) and ``resihp+rr`` (glue: reroutes a faulty stage's micro-batches to its peers at once and
re-lays out only when the planner predicts that beats rerouting).
Every policy gets the same detector model (a compute fail-slow named after 7 iterations, a loss
after a 30 s heartbeat timeout; a slow NIC or path after 7 iterations, used by ADAPTRA, which has a
link detector, and by ResiHP for NICs: its ring probe, ``--resihp-nic-probe-interval``). ``--start tuned`` starts every policy from the simulator's fastest healthy layout
instead of the usual one, so that no policy gains from a better shape that needed no fault.

Prints the table (throughput relative to the healthy job, per model, scenario and policy; the best
baseline; ResiHP's speedup over it), the simulator's error against recorded CPU runs, then one JSON
line: {"scenarios": {model/scenario: {policy: x}}, "speedup_vs_best": {...} (resihp over the best
baseline), "geomean_speedup_vs_best": x, "before": {policy: {...}}, "glue": {...},
"sim_err": {"median": .., "p95": ..}, ...}.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report  # noqa: E402
from megatron_ext.resilience import policies, resihp_policy, setting, validate  # noqa: E402
from megatron_ext.resilience.job import from_plan_layout, to_plan_layout  # noqa: E402
from megatron_ext.resilience.run import run_policy  # noqa: E402

logger = logging.getLogger("bench_resilience")

RESIHP = resihp_policy.BEFORE + ("resihp",) + resihp_policy.GLUE
SHORT = {"ckpt_restart": "ckpt", "oobleck": "oobleck", "recycle": "recycle", "malleus": "malleus",
         "adaptra": "adaptra", "torchft": "torchft", "resihp-nodeless": "nodeless", "resihp": "resihp",
         "resihp-nicless": "nicless", "resihp-noreadmit": "noreadm", "resihp+rr": "+rr"}


def planner_healthy_gain(ctx) -> float:
    """How much faster (simulator's score) the layout ResiHP's planner picks for a *healthy* cluster
    is than the start: the part of any ResiHP re-layout's gain that no fault was needed for."""
    pol = resihp_policy.ResiHP()
    pol.start(ctx)
    best, _ = pol.policy.planner.best_layout(to_plan_layout(ctx.start), np.ones(ctx.num_devices))
    return ctx.sim.healthy(ctx.start).time_s / ctx.sim.healthy(from_plan_layout(best)).time_s - 1


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(setting.LAYOUTS), choices=list(setting.LAYOUTS))
    ap.add_argument("--scenarios", nargs="+", default=None, help="scenario names (default: all)")
    ap.add_argument("--detector-delay", type=int, default=7, help="iterations to a fail-slow verdict")
    ap.add_argument("--detector-severe-factor", type=float, default=2.0,
                    help="a device more than this many times slower is named after --detector-severe-delay "
                         "iterations (ResiHP's --resihp-severe-factor; 0: off)")
    ap.add_argument("--detector-severe-delay", type=int, default=4, help="iterations to a severe verdict")
    ap.add_argument("--start", choices=setting.START, default="usual",
                    help="the healthy job: the usual layouts, or the simulator's fastest (tuned)")
    ap.add_argument("--no-validate", action="store_true", help="skip the simulator's error against recorded runs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every policy's actions")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    report = Report("bench_resilience")
    t0 = time.time()
    names = policies.BASELINES + RESIHP
    rows, figures, meta = [], {}, {}
    speedups: dict[str, dict[str, float]] = {n: {} for n in RESIHP}
    for model in args.models:
        ctx = setting.context(model, start=args.start, detector_delay=args.detector_delay,
                              detector_severe_factor=args.detector_severe_factor,
                              detector_severe_delay=args.detector_severe_delay)
        healthy = ctx.sim.healthy(ctx.start)
        p0 = ctx.start.pipelines[0]
        meta[model] = {"layout": f"tp{p0.tp}pp{p0.pp}dp{len(ctx.start.pipelines)}",
                       "layers": list(p0.layers), "healthy_iteration_s": round(healthy.time_s, 3),
                       "planner_healthy_gain": round(planner_healthy_gain(ctx), 4)}
        scen = setting.scenarios(ctx)
        unknown = sorted(set(args.scenarios or []) - set(scen))
        if unknown:
            ap.error(f"--scenarios: unknown {', '.join(unknown)}; choose from {', '.join(scen)}")
        for sname, sc in scen.items():
            if args.scenarios and sname not in args.scenarios:
                continue
            tr = setting.trace(ctx, sc)
            key = f"{model}/{sname}"
            res = {}
            for name in names:
                r = run_policy(resihp_policy.make(name), ctx, tr, end_s=sc.end_s, measure_from_s=sc.measure_from_s)
                res[name] = r
                if args.verbose:
                    for e in r.events[:8]:
                        print(f"    {key} {e}")
            thr = {n: round(r.throughput_vs_healthy, 4) for n, r in res.items()}
            best = max(policies.BASELINES, key=lambda n: thr[n])
            figures[key] = thr
            for n in RESIHP:
                speedups[n][key] = round(thr[n] / thr[best], 4)
            rows.append((model, sname, thr, best))
    head = f"{'model':<15} {'scenario':<14} " + " ".join(f"{SHORT[n]:>8}" for n in names) + \
        f"  {'best base':>9} " + " ".join(f"{SHORT[n] + '/':>9}" for n in RESIHP)
    lines = [f"bench_resilience: {len(rows)} model x scenario runs, {len(names)} policies each, "
             f"{time.time() - t0:.0f} s; throughput relative to the healthy job (simulated)", head, "-" * len(head)]
    for model, sname, thr, best in rows:
        key = f"{model}/{sname}"
        lines.append(f"{model:<15} {sname:<14} " + " ".join(f"{thr[n]:>8.3f}" for n in names)
                     + f"  {SHORT[best]:>9} " + " ".join(f"{speedups[n][key]:>9.3f}" for n in RESIHP))
    gm = {n: geomean(speedups[n].values()) for n in RESIHP}
    what = {"resihp-nodeless": "before: no nodes in the planner", "resihp-nicless": "before: no NIC verdicts",
            "resihp-noreadmit": "before: left-out slow devices never readmitted, no DP growth",
            "resihp": "as it is", "resihp+rr": "glue: + reroute first"}
    lines.append("over the best baseline, geometric mean (min, max): " + "; ".join(
        f"{n} ({what[n]}) {gm[n]:.3f}x ({min(speedups[n].values()):.3f}, {max(speedups[n].values()):.3f})"
        for n in RESIHP))
    severe = (f", {args.detector_severe_delay} when more than {args.detector_severe_factor:g}x slow"
              if args.detector_severe_factor else ", no severe rule")
    lines.append(f"detector (every policy): a fail-slow verdict after {args.detector_delay} iterations{severe}")
    lines.append("layouts: " + "; ".join(f"{m} {v['layout']} layers {'/'.join(map(str, v['layers']))} "
                                         f"{v['healthy_iteration_s']} s/it, planner's healthy gain "
                                         f"{100 * v['planner_healthy_gain']:+.1f} %" for m, v in meta.items()))
    out = {"scenarios": figures, "speedup_vs_best": speedups["resihp"],
           "geomean_speedup_vs_best": round(gm["resihp"], 4),
           "before": {n: {"speedup_vs_best": speedups[n], "geomean_speedup_vs_best": round(gm[n], 4)}
                      for n in resihp_policy.BEFORE},
           "glue": {n: {"speedup_vs_best": speedups[n], "geomean_speedup_vs_best": round(gm[n], 4)}
                    for n in resihp_policy.GLUE},
           "start": args.start, "models": meta,
           "detector": {"delay": args.detector_delay, "severe_factor": args.detector_severe_factor,
                        "severe_delay": args.detector_severe_delay}}
    if not args.no_validate:
        err = validate.sim_error()
        lines.append(f"simulator vs recorded CPU runs ({err['cases']} cases, predicted before any fitting): "
                     f"|error| median {err['median']:.3f}, p95 {err['p95']:.3f}; with the host's load change "
                     f"between windows factored out: median {err['load_normalised']['median']:.3f}, "
                     f"p95 {err['load_normalised']['p95']:.3f}; the composition alone (the window's own op "
                     f"times, no device speed predicted): median {err['composition']['median']:.3f}, "
                     f"p95 {err['composition']['p95']:.3f}")

        def _set_line(label: str, e: dict) -> str:
            return (f"  {label}: {e['cases']} cases, |error| median {e['median']:.3f}, p95 {e['p95']:.3f}; "
                    f"load factored out {e['load_normalised']['median']:.3f}; composition {e['composition']['median']:.3f}")

        for name, e in err["by_set"].items():
            lines.append(_set_line(f"set {name} ({validate.SETS[name]})", e))
        if err["one_rank_per_core"]:
            lines.append(_set_line("one rank per core (as the simulator's devices)", err["one_rank_per_core"]))
        for c in err["detail"]:
            lines.append(f"  {c['case']:<36} predicted {1e3 * c['predicted_s']:7.1f} ms  recorded "
                         f"{1e3 * c['observed_s']:7.1f} ms  {100 * c['rel_error']:+6.1f} %  composed "
                         f"{100 * c['rel_error_composition']:+6.1f} %  {c['set']}")
        out["sim_err"] = {"median": err["median"], "p95": err["p95"], "cases": err["cases"],
                          "load_normalised": err["load_normalised"], "composition": err["composition"],
                          "by_set": err["by_set"], "one_rank_per_core": err["one_rank_per_core"]}
    else:
        out["sim_err"] = None
    report.emit(out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
