"""ResiHP against the resilient-training systems it claims to beat, in the seed's setting, scored by a
simulator written apart from ResiHP's planner (``megatron_ext.resilience``; docs/resilience.md says
what the two share), and again by a perturbed scorer whose truths no policy is told.

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
could grow back onto them), ``resihp-pathless`` (before it took the ring probe's path verdicts and
reordered the data-parallel rings around a slow path) and ``resihp+rr`` (glue: reroutes a faulty stage's micro-batches to its peers at once and
re-lays out only when the planner predicts that beats rerouting).
Every policy gets the same detector model (a compute fail-slow named after 7 iterations, a loss
after a 30 s heartbeat timeout; a slow NIC or path after 7 iterations, used by ADAPTRA, which has a
link detector, and by ResiHP for NICs and paths: its ring probe, ``--resihp-nic-probe-interval``). ``--start tuned`` starts every policy from the simulator's fastest healthy layout
instead of the usual one, so that no policy gains from a better shape that needed no fault.

Issue #47: every cell also runs the oracle (``oracle.py``: each fault known at once at its true
size, layout changes free, the best layout the scorer finds among every policy's and ResiHP's
knobs), and each policy's throughput is given as a fraction of it. ``--perturb 0.2`` (default)
adds a table of the baselines and ``resihp`` scored on per-device efficiency and NIC, NVLink and
the document mix drawn per run (``perturb.py``; ``--perturb-seed``; 0: off). ``--heldout-seeds 5``
(default) adds mixed days whose seeds derive from the hash of ``--seed-from`` (default HEAD), none
of them the studied seed 22. Last, the goals: ResiHP against the best baseline in every cell, its
fraction of the oracle, the stretch 1.13x, and per fault kind the ceiling (the oracle over the
best baseline).

Prints the table (throughput relative to the healthy job, per model, scenario and policy, the
oracle; the best baseline; ResiHP's speedup over it; ResiHP's and the best baseline's fraction of
the oracle), the perturbed and held-out tables, the goals, the simulator's error against recorded
CPU runs, then one JSON line: {"scenarios": {model/scenario: {policy: x, "oracle": y}},
"speedup_vs_best": {...} (resihp over the best baseline), "geomean_speedup_vs_best": x, "oracle":
{...}, "oracle_fraction": {"cells": {policy: {...}}, "geomean": {...}}, "perturbed": {...} (null when
off), "heldout": {"commit", "seeds", "per_seed", ...} (null when off), "goals": {...}, "by_kind":
{...}, "before": {policy: {...}}, "glue": {...}, "sim_err": {"median": .., "p95": ..}, ...}.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report  # noqa: E402
from megatron_ext.resilience import oracle, perturb, policies, resihp_policy, setting, validate  # noqa: E402
from megatron_ext.resilience.job import from_plan_layout, to_plan_layout  # noqa: E402
from megatron_ext.resilience.run import run_policy  # noqa: E402

logger = logging.getLogger("bench_resilience")

RESIHP = resihp_policy.BEFORE + ("resihp",) + resihp_policy.GLUE
FAIR = policies.BASELINES + ("resihp",)
"""The policies of the perturbed and held-out tables: every baseline and ResiHP as it is."""
STRETCH = 1.13
"""The seed article's lowest claimed speedup over the state of the art: the stretch goal."""
SHORT = {"ckpt_restart": "ckpt", "oobleck": "oobleck", "recycle": "recycle", "malleus": "malleus",
         "adaptra": "adaptra", "torchft": "torchft", "resihp-nodeless": "nodeless", "resihp": "resihp",
         "resihp-nicless": "nicless", "resihp-noreadmit": "noreadm", "resihp-pathless": "pathless",
         "resihp+rr": "+rr"}


def planner_healthy_gain(ctx) -> float:
    """How much faster (simulator's score) the layout ResiHP's planner picks for a *healthy* cluster
    is than the start: the part of any ResiHP re-layout's gain that no fault was needed for."""
    pol = resihp_policy.ResiHP()
    pol.start(ctx)
    best, _ = pol.policy.planner.best_layout(to_plan_layout(ctx.start), np.ones(ctx.num_devices))
    return ctx.sim.healthy(ctx.start).time_s / ctx.sim.healthy(from_plan_layout(best)).time_s - 1


def fault_kind(scenario: str) -> str:
    """``gpu_slow_2x`` -> ``gpu_slow``; ``nic_1/4`` -> ``nic``; ``mixed_day@123`` -> ``mixed_day (held out)``."""
    if "@" in scenario:
        return "mixed_day (held out)"
    for kind in ("gpu_slow", "node_slow", "nic", "pp_link"):
        if scenario.startswith(kind + "_"):
            return kind
    return scenario


def resolve_commit(rev: str) -> tuple[str, bool]:
    """``rev``'s full hash in this checkout, and whether tracked files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip() != ""
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ValueError(f"--seed-from {rev!r}: not a commit of {root} ({exc})") from None
    return sha, dirty


def run_cell(ctx, sc, names, *, scorer, planner, verbose: bool, key: str) -> tuple[dict, float]:
    """Every policy of ``names`` through the scenario, timed by ``scorer``; then the oracle on the
    layouts they ran (and its own). Returns ({policy: throughput}, the oracle's)."""
    tr = setting.trace(ctx, sc)
    runs = {}
    for name in names:
        r = run_policy(resihp_policy.make(name), ctx, tr, end_s=sc.end_s, measure_from_s=sc.measure_from_s,
                       scorer=scorer)
        runs[name] = r
        if verbose:
            for e in r.events[:8]:
                print(f"    {key} {e}")
    orc = oracle.run_oracle(ctx, tr, end_s=sc.end_s, measure_from_s=sc.measure_from_s, runs=list(runs.values()),
                            scorer=scorer, planner=planner)
    return {n: round(r.throughput_vs_healthy, 4) for n, r in runs.items()}, round(orc.throughput_vs_healthy, 4)


def summary(cells: dict[str, dict]) -> dict:
    """Over cells {key: {policy: x, "oracle": y}}: ResiHP over the best baseline and every fair
    policy over the oracle, per cell and as geometric means."""
    speed, frac = {}, {n: {} for n in FAIR}
    best = {}
    for key, thr in cells.items():
        b = max(policies.BASELINES, key=lambda n: thr[n])
        best[key] = b
        speed[key] = round(thr["resihp"] / thr[b], 4)
        for n in FAIR:
            frac[n][key] = round(thr[n] / thr["oracle"], 4)
    return {"speedup_vs_best": speed, "best_baseline": best,
            "geomean_speedup_vs_best": round(geomean(speed.values()), 4),
            "min_speedup_vs_best": round(min(speed.values()), 4) if speed else None,
            "cells_below_best": sorted(k for k, v in speed.items() if v < 1 - 5e-5),
            "oracle_fraction": frac,
            "geomean_oracle_fraction": {n: round(geomean(frac[n].values()), 4) for n in FAIR},
            "geomean_best_baseline_oracle_fraction": round(geomean(
                cells[k][best[k]] / cells[k]["oracle"] for k in cells), 4) if cells else None}


def by_kind(cells: dict[str, dict]) -> dict:
    """Per fault kind: ResiHP over the best baseline, the ceiling (the oracle over the best
    baseline: no policy of this setting can beat the best baseline by more) and ResiHP over the
    oracle, geometric means over the kind's cells."""
    out: dict[str, dict] = {}
    for key, thr in cells.items():
        k = fault_kind(key.split("/", 1)[1])
        b = max(thr[n] for n in policies.BASELINES)
        d = out.setdefault(k, {"speedup": [], "ceiling": [], "oracle_fraction": []})
        d["speedup"].append(thr["resihp"] / b)
        d["ceiling"].append(thr["oracle"] / b)
        d["oracle_fraction"].append(thr["resihp"] / thr["oracle"])
    return {k: {"cells": len(v["speedup"]), **{m: round(geomean(x), 4) for m, x in v.items()}} for k, v in out.items()}


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
    ap.add_argument("--perturb", type=float, default=0.2,
                    help="the perturbed scorer's spread: per-device efficiency and NIC, NVLink and the median "
                         "document length each drawn in [1 - x, 1 + x] per run, told to no policy (0: off)")
    ap.add_argument("--perturb-seed", type=int, default=0, help="the perturbed scorer's seed (each run derives its own)")
    ap.add_argument("--heldout-seeds", type=int, default=5,
                    help="held-out mixed days, seeds derived from --seed-from's hash (0: none)")
    ap.add_argument("--seed-from", default="HEAD", help="the commit the held-out seeds derive from")
    ap.add_argument("--no-validate", action="store_true", help="skip the simulator's error against recorded runs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every policy's actions")
    args = ap.parse_args()
    try:
        perturb.draw(1, args.perturb, 0)
        perturb.run_seed(args.perturb_seed, "")
        sha, dirty = resolve_commit(args.seed_from) if args.heldout_seeds else ("", False)
        seeds = setting.heldout_seeds(sha, args.heldout_seeds) if args.heldout_seeds else []
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    report = Report("bench_resilience")
    t0 = time.time()
    names = policies.BASELINES + RESIHP
    rows, figures, meta = [], {}, {}
    pert_cells: dict[str, dict] = {}
    held: dict[str, dict] = {}
    held_pert: dict[str, dict] = {}
    truths: dict[str, dict] = {}
    speedups: dict[str, dict[str, float]] = {n: {} for n in RESIHP}
    for model in args.models:
        ctx = setting.context(model, start=args.start, detector_delay=args.detector_delay,
                              detector_severe_factor=args.detector_severe_factor,
                              detector_severe_delay=args.detector_severe_delay)
        planner = resihp_policy.ResiHP().planner(ctx)
        healthy = ctx.sim.healthy(ctx.start)
        p0 = ctx.start.pipelines[0]
        meta[model] = {"layout": f"tp{p0.tp}pp{p0.pp}dp{len(ctx.start.pipelines)}",
                       "layers": list(p0.layers), "healthy_iteration_s": round(healthy.time_s, 3),
                       "planner_healthy_gain": round(planner_healthy_gain(ctx), 4)}
        scen = setting.scenarios(ctx)
        unknown = sorted(set(args.scenarios or []) - set(scen))
        if unknown:
            ap.error(f"--scenarios: unknown {', '.join(unknown)}; choose from {', '.join(scen)}")

        def perturbed_cell(key: str, sc) -> dict:
            t = perturb.cell_truths(ctx, key, args.perturb, args.perturb_seed)
            truths[key] = t.summary()
            thr, orc = run_cell(ctx, sc, FAIR, scorer=perturb.perturbed(ctx, t), planner=planner,
                                verbose=False, key=key)
            return {**thr, "oracle": orc}

        for sname, sc in scen.items():
            if args.scenarios and sname not in args.scenarios:
                continue
            key = f"{model}/{sname}"
            thr, orc = run_cell(ctx, sc, names, scorer=None, planner=planner, verbose=args.verbose, key=key)
            best = max(policies.BASELINES, key=lambda n: thr[n])
            figures[key] = {**thr, "oracle": orc}
            for n in RESIHP:
                speedups[n][key] = round(thr[n] / thr[best], 4)
            rows.append((model, sname, thr, best, orc))
            if args.perturb:
                pert_cells[key] = perturbed_cell(key, sc)
        for seed in seeds:
            sc = setting.heldout_day(ctx, seed)
            key = f"{model}/{sc.name}"
            thr, orc = run_cell(ctx, sc, FAIR, scorer=None, planner=planner, verbose=args.verbose, key=key)
            held[key] = {**thr, "oracle": orc}
            if args.perturb:
                held_pert[key] = perturbed_cell(key, sc)

    head = f"{'model':<15} {'scenario':<14} " + " ".join(f"{SHORT[n]:>8}" for n in names) + \
        f" {'oracle':>7}  {'best base':>9} " + " ".join(f"{SHORT[n] + '/':>9}" for n in RESIHP) + \
        f" {'resihp/or':>9} {'best/or':>8}"
    lines = [f"bench_resilience: {len(rows)} model x scenario runs, {len(names)} policies each, "
             f"{time.time() - t0:.0f} s; throughput relative to the healthy job (simulated)", head, "-" * len(head)]
    for model, sname, thr, best, orc in rows:
        key = f"{model}/{sname}"
        lines.append(f"{model:<15} {sname:<14} " + " ".join(f"{thr[n]:>8.3f}" for n in names)
                     + f" {orc:>7.3f}  {SHORT[best]:>9} " + " ".join(f"{speedups[n][key]:>9.3f}" for n in RESIHP)
                     + f" {thr['resihp'] / orc:>9.3f} {thr[best] / orc:>8.3f}")
    gm = {n: geomean(speedups[n].values()) for n in RESIHP}
    what = {"resihp-nodeless": "before: no nodes in the planner", "resihp-nicless": "before: no NIC verdicts",
            "resihp-noreadmit": "before: left-out slow devices never readmitted, no DP growth",
            "resihp-pathless": "before: no path verdicts, rings never reordered",
            "resihp": "as it is", "resihp+rr": "glue: + reroute first"}
    lines.append("over the best baseline, geometric mean (min, max): " + "; ".join(
        f"{n} ({what[n]}) {gm[n]:.3f}x ({min(speedups[n].values()):.3f}, {max(speedups[n].values()):.3f})"
        for n in RESIHP))
    nominal = summary(figures)
    lines.append("over the oracle (each fault known at once at its true size, layout changes free, the best of "
                 "every policy's layouts and ResiHP's knobs as the scorer times them), geometric mean: " + "; ".join(
                     f"{n} {v:.3f}" for n, v in nominal["geomean_oracle_fraction"].items())
                 + f"; the best baseline per cell {nominal['geomean_best_baseline_oracle_fraction']:.3f}")
    severe = (f", {args.detector_severe_delay} when more than {args.detector_severe_factor:g}x slow"
              if args.detector_severe_factor else ", no severe rule")
    lines.append(f"detector (every policy): a fail-slow verdict after {args.detector_delay} iterations{severe}")
    lines.append("layouts: " + "; ".join(f"{m} {v['layout']} layers {'/'.join(map(str, v['layers']))} "
                                         f"{v['healthy_iteration_s']} s/it, planner's healthy gain "
                                         f"{100 * v['planner_healthy_gain']:+.1f} %" for m, v in meta.items()))

    def small_table(title: str, cells: dict[str, dict]) -> list[str]:
        sm = summary(cells)
        h = f"{'model':<15} {'scenario':<22} " + " ".join(f"{SHORT[n]:>8}" for n in FAIR) + \
            f" {'oracle':>7}  {'best base':>9} {'resihp/':>8} {'resihp/or':>9} {'best/or':>8}"
        out = ["", title, h, "-" * len(h)]
        for key, thr in cells.items():
            model, sname = key.split("/", 1)
            b = sm["best_baseline"][key]
            out.append(f"{model:<15} {sname:<22} " + " ".join(f"{thr[n]:>8.3f}" for n in FAIR)
                       + f" {thr['oracle']:>7.3f}  {SHORT[b]:>9} {sm['speedup_vs_best'][key]:>8.3f}"
                       + f" {thr['resihp'] / thr['oracle']:>9.3f} {thr[b] / thr['oracle']:>8.3f}")
        out.append(f"resihp over the best baseline: geometric mean {sm['geomean_speedup_vs_best']:.3f}x, min "
                   f"{sm['min_speedup_vs_best']:.3f}x, {len(sm['cells_below_best'])} cell(s) below; over the "
                   f"oracle: resihp {sm['geomean_oracle_fraction']['resihp']:.3f}, the best baseline "
                   f"{sm['geomean_best_baseline_oracle_fraction']:.3f}")
        return out

    out = {"scenarios": figures, "speedup_vs_best": speedups["resihp"],
           "geomean_speedup_vs_best": round(gm["resihp"], 4),
           "oracle": {k: v["oracle"] for k, v in figures.items()},
           "oracle_fraction": {"cells": nominal["oracle_fraction"], "geomean": nominal["geomean_oracle_fraction"],
                               "best_baseline_geomean": nominal["geomean_best_baseline_oracle_fraction"]},
           "before": {n: {"speedup_vs_best": speedups[n], "geomean_speedup_vs_best": round(gm[n], 4)}
                      for n in resihp_policy.BEFORE},
           "glue": {n: {"speedup_vs_best": speedups[n], "geomean_speedup_vs_best": round(gm[n], 4)}
                    for n in resihp_policy.GLUE},
           "start": args.start, "models": meta,
           "detector": {"delay": args.detector_delay, "severe_factor": args.detector_severe_factor,
                        "severe_delay": args.detector_severe_delay}}
    groups = {"nominal": figures}
    if args.perturb:
        lines += small_table(f"perturbed scorer (+/-{100 * args.perturb:g} % per device efficiency and NIC, NVLink "
                             f"and the median document per run, seed {args.perturb_seed}; no policy is told)",
                             pert_cells)
        out["perturbed"] = {"scale": args.perturb, "seed": args.perturb_seed, "scenarios": pert_cells,
                            "truths": truths, **summary(pert_cells)}
        groups["perturbed"] = pert_cells
    else:
        out["perturbed"] = None
    if seeds:
        lines += small_table(f"held-out mixed days: seeds {', '.join(map(str, seeds))} from commit {sha}"
                             + (" (the tree had uncommitted changes)" if dirty else ""), held)
        per_seed = {}
        for seed in seeds:
            ks = {k: v for k, v in held.items() if k.endswith(f"@{seed}")}
            sm = summary(ks)
            per_seed[str(seed)] = {"geomean_speedup_vs_best": sm["geomean_speedup_vs_best"],
                                   "min_speedup_vs_best": sm["min_speedup_vs_best"],
                                   "geomean_oracle_fraction": sm["geomean_oracle_fraction"]["resihp"]}
            lines.append(f"  seed {seed}: resihp over the best baseline {sm['geomean_speedup_vs_best']:.3f}x "
                         f"(min {sm['min_speedup_vs_best']:.3f}), over the oracle "
                         f"{sm['geomean_oracle_fraction']['resihp']:.3f}")
        out["heldout"] = {"commit": sha, "dirty": dirty, "seeds": seeds, "scenarios": held, **summary(held),
                          "per_seed": per_seed}
        groups["held-out"] = held
        if args.perturb:
            lines += small_table("held-out mixed days, perturbed scorer", held_pert)
            out["heldout"]["perturbed"] = {"scenarios": held_pert, **summary(held_pert)}
            groups["held-out perturbed"] = held_pert
    else:
        out["heldout"] = None
    goals = {g: summary(c) for g, c in groups.items() if c}
    lines += ["", "goals (issue #47)" + " " * 34 + " ".join(f"{g:>20}" for g in goals)]
    lines.append(f"{'resihp >= the best baseline in every cell':<51}" + " ".join(
        f"{'min ' + format(v['min_speedup_vs_best'], '.3f') + ', ' + str(len(v['cells_below_best'])) + ' below':>20}"
        for v in goals.values()))
    lines.append(f"{'geomean resihp / oracle >= 0.95':<51}" + " ".join(
        f"{v['geomean_oracle_fraction']['resihp']:>20.3f}" for v in goals.values()))
    lines.append(f"{'stretch: geomean over the best baseline >= 1.13x':<51}" + " ".join(
        f"{v['geomean_speedup_vs_best']:>19.3f}x" for v in goals.values()))
    kinds = by_kind({**figures, **held})
    lines.append("per fault kind (nominal scorer; held-out days apart): resihp over the best baseline / the ceiling "
                 "(oracle over the best baseline) / resihp over the oracle")
    for k, v in kinds.items():
        lines.append(f"  {k:<22} {v['cells']:>3} cells  {v['speedup']:.3f}x / {v['ceiling']:.3f}x / "
                     f"{v['oracle_fraction']:.3f}  (short of {STRETCH}x by {STRETCH / v['speedup']:.3f}x; "
                     f"{'out of reach' if v['ceiling'] < STRETCH else 'within the ceiling'})")
    out["goals"] = {g: {"min_speedup_vs_best": v["min_speedup_vs_best"], "cells_below_best": v["cells_below_best"],
                        "geomean_oracle_fraction": v["geomean_oracle_fraction"]["resihp"],
                        "geomean_speedup_vs_best": v["geomean_speedup_vs_best"]} for g, v in goals.items()}
    out["by_kind"] = kinds
    if not args.no_validate:
        err = validate.sim_error()
        whole = err["whole_simulator"]
        if whole is not None:
            dev = whole["device"]
            lines.append(f"the whole simulator vs recorded TP2 x PP2 and PP2 x DP2 runs ({whole['cases']} cases; compute, "
                         f"TP collectives, sends, the DP gradient reduce and the optimizer all predicted from figures "
                         f"measured once: {dev['flops'] / 1e9:.1f} GFLOP/s, a link at {dev['link_bytes_per_s'] / 1e9:.3f} "
                         f"GB/s + {1e6 * dev['link_latency_s']:.0f} us, the optimizer at "
                         f"{dev['optimizer_bytes_per_s'] / 1e9:.2f} GB/s): |error| median {whole['median']:.3f}, "
                         f"p95 {whole['p95']:.3f}")
            for c in whole["detail"]:
                lines.append(f"  {c['case']:<36} predicted {1e3 * c['predicted_s']:7.1f} ms (compute "
                             f"{1e3 * c['compute_s']:6.1f}, grad reduce {1e3 * c['grad_sync_s']:5.1f}, optimizer "
                             f"{1e3 * c['optimizer_s']:4.1f})  recorded {1e3 * c['observed_s']:7.1f} ms  "
                             f"{100 * c['rel_error']:+6.1f} %")
                lines.append("      per op, predicted / recorded ms: " + "; ".join(
                    f"stage {st['stage']} forward {1e3 * st['predicted_fwd_s']:.1f} / {1e3 * st['recorded_fwd_s']:.1f}, "
                    f"backward {1e3 * st['predicted_bwd_s']:.1f} / {1e3 * st['recorded_bwd_s']:.1f}"
                    for st in c["stages"]))
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
                          "by_set": err["by_set"], "one_rank_per_core": err["one_rank_per_core"],
                          "whole_simulator": None if whole is None else {
                              k: whole[k] for k in ("median", "p95", "cases")} | {
                              "cases_detail": [{k: c[k] for k in ("case", "rel_error")} for c in whole["detail"]]}}
    else:
        out["sim_err"] = None
    report.emit(out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
