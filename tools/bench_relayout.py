"""Benchmark ResiHP's re-layout planner against the other ways of living with bad devices.

(b) The joint planner's decision time at scale: a GPT-3-175B-like model (96 layers, hidden 12288,
    96 heads, sequence 2048, global batch 1536 sequences) on 4,096 devices, TP8, the pipeline depth
    and layer partition tuned for the healthy job; five devices slowed 1.3-4x and one dead: CPU
    seconds of one core to a plan, cold (schedules not yet compiled) and warm.

    Until issue #21 this part also ran ResiHP's policy against baselines on simulated fault traces,
    every policy scored by ``Planner.iteration_s`` (the model ResiHP itself optimises) and two
    baselines labelled after published systems that did not do what those systems do. That
    comparison is now ``tools/bench_resilience.py`` (docs/resilience.md): the systems as their papers
    describe them, scored by an independent event-level simulator validated against recorded runs.

(a) Live on CPU ranks (``tools/relayout_live_worker.py`` under torchrun): a 12-layer tiny GPT, m = 8,
    one rank slowed 2x (throttle); tokens/s healthy, slowed with no action, slowed after the
    planner's plan was applied by ``Trainer.relayout``, and the capacity-proportional optimum
    (healthy x the mean of the ranks' measured speeds relative to the fastest rank); the pause; the loss curve against a straight run. ``pp2``: PP2 on
    2 ranks, one core each (layer repartition). ``pp2dp2`` (skipped on fewer than 4 cores: no two ranks of a case share a core): PP2 x DP2 on 4 ranks, one core per
    replica, the slow rank in replica 0 (layers and micro-batches between replicas: DP work
    migration). ``fail_stop``: ``pretrain_gpt.py --nproc-per-node 4 --ft-on-stop continue``
    (PP2 x DP2) with rank 3 SIGKILLed in its optimizer step: whether the survivors trained to the
    end, iterations lost, the pause, the curve against a straight run; ``fail_stop_dp1``: the same
    on PP2 over 2 ranks (no replica: the lost stage comes from the last checkpoint).
    ``slow_nic``: PP2 x DP2 with one rank's NIC at 4 MB/s (its pipeline messages, ring-probe
    messages and share of the gradient all-reduce), named by the ring probe; the planner's plan
    applied (``--resihp-act relayout --resihp-act-reshape``) against the same run with the plan only
    logged, two rounds in rotated order, the arms' healthy windows as the A/A. ``--no-live`` skips part (a).

Prints a table, then one JSON line through the harness:
  {"bench": "bench_relayout", "live": {...}, "sim": {"decision_s_4096": ..., "decision_warm_s_4096": ...}, ...}
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report, aa_name, compare, format_comparison  # noqa: E402
from megatron_ext.config.defaults import former_default_flags  # noqa: E402
from megatron_ext.models.flops import ModelSpec  # noqa: E402
from megatron_ext.resihp import planner as planner_mod  # noqa: E402
from megatron_ext.resihp.planner import Cluster, PlanLayout, Planner, PlannerConfig, Workload  # noqa: E402

logger = logging.getLogger("bench_relayout")

GPT175 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200)
WORKLOAD = Workload(seq_length=2048, micro_batch_size=1)
GLOBAL_MICROBATCHES = 1536
ONLY = dict(tp_regroup=False, pp_repartition=False, dp_migration=False, drop_replicas=False, reshape=False)


def tuned_start(p: Planner, tp: int, pp: int, dp: int) -> PlanLayout:
    even = PlanLayout.even(num_layers=p.spec.num_layers, tp=tp, pp=pp, dp=dp, num_microbatches=GLOBAL_MICROBATCHES)
    tuner = Planner(p.spec, p.cluster, p.workload, PlannerConfig(**{**ONLY, "pp_repartition": True}))
    return tuner.best_layout(even, np.ones(even.world_size))[0]


def best_start(p: Planner, n: int, tp: int = 8) -> PlanLayout:
    """The healthy job as a user would set it up: TP8, the pipeline depth that is fastest among
    those that use every device and fit in memory, layers balanced for the output layer."""
    best, best_s = None, math.inf
    for pp in range(1, p.spec.num_layers + 1):
        if (n // tp) % pp or GLOBAL_MICROBATCHES < n // (tp * pp):
            continue
        lay = tuned_start(p, tp, pp, n // (tp * pp))
        if not p.fits(lay, p.cluster.memory_of(n)):
            continue
        t = p.iteration_s(lay, np.ones(n))
        if t < best_s:
            best, best_s = lay, t
    return best


def decision_time(cl: Cluster, args: argparse.Namespace) -> dict:
    """The joint planner deciding for the 4,096-device start layout (TP8) with five slow devices
    (1.3-4x) and one dead: CPU seconds of one core, cold (schedules not yet compiled) and warm,
    median of runs."""
    full = Planner(GPT175, cl, WORKLOAD, PlannerConfig(horizon_iterations=args.horizon, min_gain=args.min_gain))
    start = best_start(full, 4096)
    sp = np.ones(4096)
    for r, v in {1: 1 / 3, 1000: 0.5, 2000: 1 / 1.5, 3000: 0.25, 4000: 1 / 1.3, 2222: 0.0}.items():
        sp[r] = v
    cold, warm, plan = [], [], None
    for _ in range(args.decision_runs):
        planner_mod._sim_plan.cache_clear()
        t = time.process_time()
        plan = full.plan(start, sp)
        cold.append(time.process_time() - t)
        t = time.process_time()
        full.plan(start, sp)
        warm.append(time.process_time() - t)
    return {"cold_s": float(np.median(cold)), "warm_s": float(np.median(warm)), "plan": plan.describe(),
            "layout": start.shape}


LIVE_MODEL = [*former_default_flags(),
              "--num-layers", "12", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "constant",
              "--eval-iters", "0", "--log-interval", "1"]
"""The live model keeps the defaults from before issue 44 (no dropout; its own flags after them win):
a layout change then computes the same loss, so the curves compare to float reduction order."""
TOKENS = 8 * 128  # global batch x sequence of the live model


def _live_relayout(root: str, tmp: str, iters: int, scenario: str, nproc: int) -> dict:
    import subprocess

    out = os.path.join(tmp, f"{scenario}.json")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           os.path.join(root, "tools", "relayout_live_worker.py"), out, str(iters), scenario],
                          cwd=root, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"live part {scenario} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    r = json.load(open(out, encoding="utf-8"))
    healthy, slow = TOKENS / r["healthy_s"], TOKENS / r["slow_s"]
    after = TOKENS / r["relayout_s"] if "relayout_s" in r else None
    # The capacity optimum from each rank's measured speed in the slowed phase (its forward
    # seconds healthy / slowed, the throttle's hold included), not the nominal factor -- relative
    # to the fastest rank: the host's load between the two phases slows every rank alike and is
    # not a device's speed (raw, an unthrottled rank read 0.71 at load 5 and put the "optimum"
    # below what the re-layout reached).
    raw = np.asarray(r["measured_speeds"], dtype=float)
    relative = raw / raw.max()
    optimum = healthy * float(np.mean(relative))
    print(f"  {scenario}: rank speeds measured {' '.join(f'{v:.2f}' for v in raw)}, relative to the fastest "
          f"{' '.join(f'{v:.2f}' for v in relative)} (nominal {' '.join(f'{v:.2f}' for v in r['speeds'])})")
    print(f"  {scenario}: plan: {r['plan']}")
    knobs = (f"layers {r['stage_layers']}"
             + (f", micro-batches {r['replica_microbatches']}" if r.get("replica_microbatches") else "")
             + (f", launch ranks in rank order {r['members']}" if r.get("members") else "")) if after else ""
    print(f"  {scenario}: tokens/s healthy {healthy:.0f} | slowed, no action {slow:.0f} | slowed, after re-layout "
          + (f"{after:.0f} ({knobs})" if after else "n/a (no plan applied)") + f" | optimum {optimum:.0f}")
    if after:
        print(f"  {scenario}: after / optimum {after / optimum:.3f}; pause {r['pause_s']:.2f} s = "
              f"{r['pause_s'] / r['relayout_s']:.1f} iterations; planner decision {r['decide_s'] * 1e3:.0f} ms; "
              f"loss vs straight run max rel diff {r['loss_max_rel_diff']:.2e}")
    # Each phase's iterations against the healthy phase's, and the A/A: a second healthy phase run
    # right after the first (phases are sequential, paired by position in the phase).
    series = {"healthy": r["series"]["healthy"], aa_name("healthy"): r["series"]["healthy_again"],
              "slowed": r["series"]["slowed"]}
    if r["series"].get("after_relayout"):
        series["after_relayout"] = r["series"]["after_relayout"]
    cmp = compare(series, "healthy", higher_is_better=False)
    table = format_comparison(cmp, "s/iter").splitlines()
    table[-1] = (f"({cmp['rounds']} iterations per phase; the phases in sequence -- healthy, healthy again (the A/A), "
                 "slowed, after the re-layout -- and paired by position; ratio = median of the paired ratios)")
    print("\n".join("    " + line for line in table))
    return {"healthy_tok_s": round(healthy, 1), "slow_no_action_tok_s": round(slow, 1), "phases": cmp,
            "slow_relayout_tok_s": round(after, 1) if after else None,
            "optimum_fraction": round(after / optimum, 4) if after else None,
            "measured_speeds": [round(v, 4) for v in r["measured_speeds"]],
            "relative_speeds": [round(float(v), 4) for v in relative],
            "pause_s": round(r.get("pause_s", float("nan")), 3),
            "loss_max_rel_diff": r["loss_max_rel_diff"], "plan": r["plan"],
            "stage_layers": r.get("stage_layers"), "replica_microbatches": r.get("replica_microbatches")}


def _rows(path: str, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(path, encoding="utf-8")) if r["kind"] == kind] if os.path.exists(path) else []


def _launch_watched(argv: list[str], nproc: int, root: str, metrics: str, *, respawn: int = 0,
                    mark_iteration: int | None = None) -> tuple[list, float, float | None]:
    """``launch_ranks`` with the metrics file watched: returns the ranks, the wall seconds, and the
    seconds from the moment the row of ``mark_iteration`` appeared to the end of the job."""
    import threading

    from megatron_ext.ft.launch import launch_ranks

    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            if mark_iteration is not None and "mark" not in seen and any(
                    r["iteration"] >= mark_iteration for r in _rows(metrics, "train")):
                seen["mark"] = time.monotonic()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    t0 = time.monotonic()
    ranks = launch_ranks(argv, nproc, cwd=root, timeout_s=1800, respawn=respawn)
    end = time.monotonic()
    stop.set()
    t.join()
    return ranks, end - t0, (end - seen["mark"]) if "mark" in seen else None


def _straight(root: str, d: str, iters: int) -> dict[int, float]:
    import subprocess

    ref = os.path.join(d, "straight.jsonl")
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *LIVE_MODEL, "--train-iters",
                           str(iters), "--metrics-file", ref], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:  # a failed reference would make every curve comparison vacuous
        raise RuntimeError(f"the straight reference run exited {proc.returncode}:\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    curve = {r["iteration"]: r["loss"] for r in _rows(ref, "train")}
    if sorted(curve) != list(range(1, iters + 1)):
        raise RuntimeError(f"the straight reference run wrote iterations {sorted(curve)[:3]}..., not 1..{iters}")
    return curve


def _max_rel(train: dict[int, dict], straight: dict[int, float]) -> float | None:
    common = [i for i in straight if i in train]
    return max(abs(train[i]["loss"] - straight[i]) / abs(straight[i]) for i in common) if common else None


def _live_fail_stop(root: str, tmp: str, name: str, *, nproc: int, layout: list[str], stop: list[str], iters: int,
                    save_interval: int | None) -> dict:
    """One ``pretrain_gpt.py --ft-on-stop continue`` job through the project's launcher with
    ranks SIGKILLed, and a straight single-rank run of the same model and data for the curve."""
    from megatron_ext.ft.launch import job_exit_code

    d = os.path.join(tmp, name)
    metrics = os.path.join(d, "metrics.jsonl")
    argv = [os.path.join(root, "pretrain_gpt.py"), *LIVE_MODEL, *layout, "--train-iters", str(iters),
            "--resihp", "--ft-on-stop", "continue", "--inject-stop", *stop, "--metrics-file", metrics]
    if save_interval:
        argv += ["--save", os.path.join(d, "ck"), "--save-interval", str(save_interval)]
    ranks, wall, _ = _launch_watched(argv, nproc, root, metrics)
    straight = _straight(root, d, iters)
    train = {r["iteration"]: r for r in _rows(metrics, "train")}
    cont = _rows(metrics, "layout_change")
    codes = [r.returncode for r in ranks]
    continued = bool(cont) and max(train, default=0) == iters and job_exit_code(ranks) == 0
    at = min(int(s.split(":")[1]) for s in stop)
    before = [train[i]["iter_time_s"] for i in range(2, at) if i in train]
    iteration_s = float(np.median(before)) if before else float("nan")
    pause = sum(c["pause_s"] for c in cont)
    out = {"continued": continued, "lost_iterations": sum(c["lost_iterations"] for c in cont) if cont else None,
           "changes": len(cont), "pause_s": round(pause, 3) if cont else None, "iteration_s": round(iteration_s, 4),
           "pause_iterations": round(pause / iteration_s, 2) if cont else None,
           "rolled_back": cont[0]["rolled_back"] if cont else None, "to": cont[-1]["to"] if cont else None,
           "plan": cont[0]["plan"] if cont else None, "exit_codes": codes, "wall_s": round(wall, 1),
           "loss_max_rel_diff": _max_rel(train, straight)}
    print(f"  {name}: {' '.join(layout)} on {nproc} ranks, --inject-stop {' '.join(stop)}: continued {out['continued']} "
          f"(exit codes {codes}) -> {out['to']} in {len(cont)} change(s); iteration {out['rolled_back']} rolled back; "
          f"lost iterations {out['lost_iterations']}; pause {out['pause_s']} s = {out['pause_iterations']} iterations "
          f"of {iteration_s * 1e3:.0f} ms; loss vs straight run max rel diff "
          + (f"{out['loss_max_rel_diff']:.2e}" if out["loss_max_rel_diff"] is not None else "n/a"))
    return out


def _regrow_round(root: str, d: str, base: list[str], stop_at: int, first: str) -> dict:
    """One round: the healthy job and the job that loses rank 3 and takes it back, in the order
    ``first`` says."""
    out: dict = {}
    for arm in (("healthy", "fault") if first == "healthy" else ("fault", "healthy")):
        metrics = os.path.join(d, f"{arm}.jsonl")
        if arm == "healthy":
            _launch_watched([*base, "--metrics-file", metrics], 4, root, metrics)
            out["healthy"] = {r["iteration"]: r for r in _rows(metrics, "train")}
        else:
            argv = [*base, "--resihp", "--ft-on-stop", "continue", "--ft-respawn", "1",
                    "--inject-stop", f"3:{stop_at}:step", "--metrics-file", metrics]
            ranks, wall, _ = _launch_watched(argv, 4, root, metrics, respawn=1)
            out.update(fault={r["iteration"]: r for r in _rows(metrics, "train")}, ranks=ranks, wall_s=wall,
                       changes=_rows(metrics, "layout_change"))
    return out


def _live_regrow(root: str, tmp: str, *, iters: int = 100, stop_at: int = 10, rounds: int = 2) -> dict:
    """PP2 x DP2, rank 3 SIGKILLed in its step at ``stop_at`` with ``--ft-respawn 1``: the
    survivors shrink, the launcher starts rank 3 again, it rejoins. Beside it, the same job with no
    fault, the two interleaved over ``rounds`` rounds with the order rotated: tokens/s after the
    rejoin (from 5 iterations after it to the end) against the healthy job's over the same
    iterations, medians per round, then the median of the rounds' ratios; the loss curve against the
    straight single-rank run and against the healthy job (whose own difference from the straight
    run is the floor: float reduction order in another layout)."""
    base = [os.path.join(root, "pretrain_gpt.py"), *LIVE_MODEL, "--pipeline-model-parallel-size", "2",
            "--train-iters", str(iters)]
    straight = _straight(root, os.path.join(tmp, "regrow"), iters)
    per_round = []
    for k in range(rounds):
        d = os.path.join(tmp, f"regrow{k}")
        os.makedirs(d, exist_ok=True)
        r = _regrow_round(root, d, base, stop_at, "healthy" if k % 2 == 0 else "fault")
        train, ok = r["fault"], r["healthy"]
        grow = [c for c in r["changes"] if c["cause"] == "grow"]
        shrink = [c for c in r["changes"] if c["cause"] == "fail_stop"]
        row = {"first": "healthy" if k % 2 == 0 else "fault", "rejoined": bool(grow),
               "exit_codes": [x.incarnations for x in r["ranks"]], "wall_s": round(r["wall_s"], 1),
               "shrink_to": shrink[0]["to"] if shrink else None,
               "shrink_pause_s": round(shrink[0]["pause_s"], 3) if shrink else None,
               "loss_max_rel_diff": _max_rel(train, straight),
               "loss_max_rel_diff_vs_healthy_job": _max_rel(train, {i: x["loss"] for i, x in ok.items()}),
               "healthy_job_vs_straight": _max_rel(ok, straight)}
        if grow:
            g = grow[0]
            span = [i for i in range(g["iteration"] + 5, iters + 1) if i in train and i in ok]
            after = float(np.median([train[i]["tokens_per_s"] for i in span]))
            same = float(np.median([ok[i]["tokens_per_s"] for i in span]))
            row.update(grow_iteration=g["iteration"], grow_to=g["to"], pause_s=round(g["pause_s"], 3),
                       after_tok_s=round(after, 1), healthy_tok_s=round(same, 1),
                       after_vs_healthy=round(after / same, 4), after_iterations=len(span), plan=g["plan"])
        per_round.append(row)
        print(f"  regrow round {k + 1} ({row['first']} first): shrink to {row['shrink_to']} (pause "
              f"{row['shrink_pause_s']} s), "
              + (f"rejoined at iteration {row['grow_iteration']} -> {row['grow_to']} (pause {row['pause_s']} s); "
                 f"tokens/s after rejoin {row['after_tok_s']} vs the healthy job's {row['healthy_tok_s']} over the "
                 f"same {row['after_iterations']} iterations ({row['after_vs_healthy']})" if grow else "never rejoined")
              + f"; loss vs straight max rel diff {row['loss_max_rel_diff']:.2e} (the healthy job's own "
                f"{row['healthy_job_vs_straight']:.2e}; vs the healthy job {row['loss_max_rel_diff_vs_healthy_job']:.2e})")
    ratios = [r["after_vs_healthy"] for r in per_round if "after_vs_healthy" in r]
    pauses = [r["pause_s"] for r in per_round if "pause_s" in r]
    out = {"rounds": per_round, "rejoined": all(r["rejoined"] for r in per_round),
           "after_vs_healthy": round(float(np.median(ratios)), 4) if ratios else None,
           "pause_s": round(float(np.median(pauses)), 3) if pauses else None,
           "loss_max_rel_diff": max(r["loss_max_rel_diff"] for r in per_round),
           "loss_max_rel_diff_vs_healthy_job": max(r["loss_max_rel_diff_vs_healthy_job"] for r in per_round)}
    print(f"  regrow: median over {rounds} rounds: tokens/s after rejoin / healthy {out['after_vs_healthy']} "
          f"(rounds {ratios}), pause {out['pause_s']} s")
    return out


def _live_error_exit(root: str, tmp: str, name: str, errors: list[str], *, at: int = 10) -> dict:
    """A job whose ranks raise at iteration ``at`` (``--inject-error``) ends on every rank: the
    seconds from the last row before it to the end of every process, and what was printed."""
    from megatron_ext.ft.launch import job_exit_code

    d = os.path.join(tmp, name)
    metrics = os.path.join(d, "metrics.jsonl")
    argv = [os.path.join(root, "pretrain_gpt.py"), *LIVE_MODEL, "--pipeline-model-parallel-size", "2",
            "--train-iters", str(at + 10), "--resihp", "--ft-on-stop", "continue", "--inject-error", *errors,
            "--metrics-file", metrics]
    ranks, wall, exit_s = _launch_watched(argv, 4, root, metrics, mark_iteration=at - 1)
    lines = [line for r in ranks for line in r.output.splitlines() if line.startswith("pretrain_gpt.py:")]
    tracebacks = sum(r.output.count("Traceback") for r in ranks)
    # On the ranks that did not report the error (the reporter's own line may quote a gloo message).
    resets = sum(r.output.count("Connection reset") + r.output.count("Connection closed by peer") for r in ranks
                 if "pretrain_gpt.py: error:" not in r.output)
    out = {"exit_s": round(exit_s, 2) if exit_s is not None else None, "job_exit_code": job_exit_code(ranks),
           "exit_codes": [r.returncode for r in ranks], "error_lines": lines, "tracebacks": tracebacks,
           "connection_reset_lines": resets, "wall_s": round(wall, 1)}
    print(f"  {name}: --inject-error {' '.join(errors)}: job exit {out['job_exit_code']} (ranks {out['exit_codes']}) "
          f"{out['exit_s']} s after iteration {at - 1}; {len(lines)} error line(s), {tracebacks} traceback(s), "
          f"{resets} connection-reset line(s) on the other ranks; first: {lines[0] if lines else '-'}")
    return out


def _slow_nic_arm(root: str, d: str, arm: str, *, iters: int, since: int, mbps: float) -> dict:
    """One job of the ``slow_nic`` case: ``--resihp-act ARM`` (``relayout`` also with
    ``--resihp-act-reshape``); its iteration times, its first plan line and what that predicted."""
    import re

    from megatron_ext.ft.launch import job_exit_code

    metrics = os.path.join(d, "metrics.jsonl")
    argv = [os.path.join(root, "pretrain_gpt.py"), *LIVE_MODEL, "--pipeline-model-parallel-size", "2",
            "--train-iters", str(iters), "--resihp", "--resihp-nic-probe-interval", "1", "--resihp-act", arm,
            "--inject-slow-nic", f"1:{since}:{mbps:g}", "--metrics-file", metrics]
    if arm == "relayout":
        argv.append("--resihp-act-reshape")
    ranks, wall, _ = _launch_watched(argv, 4, root, metrics)
    text = "".join(r.output for r in ranks)
    changes = _rows(metrics, "layout_change")
    plan_line = next((line.strip() for line in text.splitlines() if " resihp plan [" in line), None)
    pred = re.search(r"iteration ([0-9.]+) s -> ([0-9.]+) s predicted", plan_line or "")
    named = re.search(r"iteration (\d+): rank \d+ slow NIC", text)
    return {"exit_code": job_exit_code(ranks), "wall_s": round(wall, 1), "changes": len(changes),
            "changed_at": changes[0]["iteration"] if changes else None, "to": changes[0]["to"] if changes else None,
            "plan": plan_line, "predicted_before_ms": round(1e3 * float(pred.group(1)), 1) if pred else None,
            "predicted_after_ms": round(1e3 * float(pred.group(2)), 1) if pred else None,
            "named_at": int(named.group(1)) if named else None,
            "train": {r["iteration"]: r["iter_time_s"] for r in _rows(metrics, "train")}}


def _live_slow_nic(root: str, tmp: str, *, iters: int = 55, since: int = 25, mbps: float = 4.0,
                   rounds: int = 2) -> dict:
    """PP2 x DP2 on 4 ranks, launch rank 1's NIC at ``mbps`` MB/s from iteration ``since`` (its
    pipeline messages, its ring-probe messages and its share of the gradient all-reduce held), the
    ring probe every iteration. Two arms per round, in an order rotated every round: ``relayout``
    (``--resihp-act relayout --resihp-act-reshape``: the planner's plan applied) and ``plan`` (the
    same verdict, the plan only logged: the job keeps its layout). Per round, iteration medians of
    the ``relayout`` arm before the fault, with it until the change, and after it (from 3 iterations
    after the change), the ``plan`` arm over the same iterations, and the two arms' healthy windows
    against each other (the A/A: the same code and data before the fault, the noise floor of the
    arm comparison); the figures are medians over rounds, every round kept in ``rounds``."""
    per_round = []
    for k in range(rounds):
        order = ("relayout", "plan") if k % 2 == 0 else ("plan", "relayout")
        arms = {arm: _slow_nic_arm(root, os.path.join(tmp, f"slow_nic_{k}_{arm}"), arm, iters=iters, since=since,
                                   mbps=mbps) for arm in order}
        act, plan = arms["relayout"], arms["plan"]
        at = act["changed_at"]

        def med(train: dict, lo: int, hi: int) -> float | None:
            xs = [train[i] for i in range(lo, hi + 1) if i in train]
            return round(1e3 * float(np.median(xs)), 1) if xs else None

        r = {"order": list(order), **{f"{arm}_{key}": v for arm in arms for key, v in arms[arm].items() if key != "train"},
             "before_ms": med(act["train"], 3, since - 1), "during_ms": med(act["train"], since + 1, at or iters),
             "plan_arm_before_ms": med(plan["train"], 3, since - 1)}
        if at is not None:
            r["after_ms"] = med(act["train"], at + 3, iters)
            r["plan_arm_same_window_ms"] = med(plan["train"], at + 3, iters)
            r["after_vs_plan_arm"] = round(r["after_ms"] / r["plan_arm_same_window_ms"], 3)
        r["aa_healthy_ratio"] = round(r["before_ms"] / r["plan_arm_before_ms"], 3)
        per_round.append(r)
        print(f"  slow_nic round {k + 1} ({' first, '.join(order)} second): PP2 x DP2, launch rank 1's NIC at "
              f"{mbps:g} MB/s from iteration {since} (ring probe every iteration): named at {act['named_at']}; relayout "
              f"arm -> {act['to']} at iteration {at}; iteration {r['before_ms']} ms healthy, {r['during_ms']} ms with "
              f"the slow NIC, {r.get('after_ms')} ms after the change; plan-only arm over the same iterations "
              f"{r.get('plan_arm_same_window_ms')} ms (after / plan-only {r.get('after_vs_plan_arm')}); A/A, the arms' "
              f"healthy windows: {r['before_ms']} / {r['plan_arm_before_ms']} ms = {r['aa_healthy_ratio']}; the planner "
              f"predicted {act['predicted_before_ms']} ms for the layout in force and {act['predicted_after_ms']} ms "
              f"for its plan; exit codes {act['exit_code']}/{plan['exit_code']}")

    def median(key: str) -> float | None:
        xs = [r[key] for r in per_round if r.get(key) is not None]
        return round(float(np.median(xs)), 3) if xs else None

    res = {"mbps": mbps, "since": since, "iterations": iters, "rounds": per_round,
           **{k: median(k) for k in ("before_ms", "during_ms", "after_ms", "plan_arm_same_window_ms",
                                     "after_vs_plan_arm", "aa_healthy_ratio", "relayout_predicted_before_ms",
                                     "relayout_predicted_after_ms")}}
    spread = [r.get("after_vs_plan_arm") for r in per_round]
    aa = [r["aa_healthy_ratio"] for r in per_round]
    print(f"  slow_nic: median over {rounds} rounds: after the change / the plan-only arm {res['after_vs_plan_arm']} "
          f"(rounds {spread}); A/A noise floor {res['aa_healthy_ratio']} (rounds {aa})")
    return res


LIVE_PARTS = ("pp2", "pp2dp2", "fail_stop", "fail_stop_dp1", "second_fault", "regrow", "plain_error",
              "collective_error", "slow_nic")


def run_live(iters: int, parts: tuple[str, ...] = LIVE_PARTS) -> dict:
    """Part (a): prints its table, returns the "live" JSON block (``parts``: which cases)."""
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"ResiHP re-layout benchmark (a), live on CPU ranks: 12-layer tiny GPT, m=8, a rank slowed 2x; medians of "
          f"{iters} iterations per phase; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start")
    with tempfile.TemporaryDirectory() as tmp:
        live: dict = {}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        for scenario, nproc in (("pp2", 2), ("pp2dp2", 4)):
            if scenario not in parts:
                continue
            if cores < nproc:
                # Ranks sharing a core: a slowed rank's idle hold gives its core-mate time, which
                # neither the planner nor the capacity optimum models -- no figure rather than a
                # flattering one.
                print(f"  {scenario}: skipped: needs {nproc} cores (one per rank), this machine has {cores}")
                live[scenario] = {"skipped": f"needs {nproc} cores (one per rank); {cores} available"}
                continue
            live[scenario] = _live_relayout(root, tmp, iters, scenario, nproc)
        if "fail_stop" in parts:
            live["fail_stop"] = _live_fail_stop(root, tmp, "fail_stop", nproc=4, iters=30, save_interval=None,
                                                layout=["--pipeline-model-parallel-size", "2"], stop=["3:15:step"])
        if "fail_stop_dp1" in parts:
            live["fail_stop_dp1"] = _live_fail_stop(root, tmp, "fail_stop_dp1", nproc=2, iters=30, save_interval=10,
                                                    layout=["--pipeline-model-parallel-size", "2"], stop=["1:15:step"])
        if "second_fault" in parts:  # a second loss inside the change that the first one started
            live["second_fault"] = _live_fail_stop(root, tmp, "second_fault", nproc=4, iters=30, save_interval=10,
                                                   layout=["--pipeline-model-parallel-size", "2"],
                                                   stop=["3:15", "1:15:relayout"])
        if "regrow" in parts:
            live["regrow"] = _live_regrow(root, tmp)
        if "plain_error" in parts:  # the same ValueError on every rank (a deterministic bug): one line, exit 1
            live["plain_error"] = _live_error_exit(root, tmp, "plain_error", [f"{r}:10" for r in range(4)])
            live["plain_error_exit_s"] = live["plain_error"]["exit_s"]
        if "collective_error" in parts:  # a collective failing while no rank is lost: re-raised on every rank
            live["collective_error"] = _live_error_exit(root, tmp, "collective_error", ["2:10:collective"])
        if "slow_nic" in parts:  # a slow NIC named by the ring probe, the planner reshaping around it
            live["slow_nic"] = _live_slow_nic(root, tmp)
    live["load_average_end"] = round(os.getloadavg()[0], 1)
    return live


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-tflops", type=float, default=150.0, help="effective TFLOP/s of a healthy device")
    ap.add_argument("--memory-gb", type=float, default=80.0)
    ap.add_argument("--link-gbps", type=float, default=25.0, help="GB/s per device for state moves and all-reduce")
    ap.add_argument("--nvlink-gbps", type=float, default=300.0, help="GB/s of the TP all-reduces")
    ap.add_argument("--relayout-pause-s", type=float, default=30.0, help="fixed cost of a live re-layout")
    ap.add_argument("--horizon", type=int, default=500, help="planner amortization horizon (iterations)")
    ap.add_argument("--min-gain", type=float, default=0.05)
    ap.add_argument("--decision-runs", type=int, default=5)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--no-live", action="store_true", help="skip part (a), the live CPU run")
    ap.add_argument("--live-iters", type=int, default=15, help="measured iterations per live phase")
    ap.add_argument("--live-parts", default=",".join(LIVE_PARTS),
                    help=f"comma-separated live cases to run (default: all of {','.join(LIVE_PARTS)})")
    ap.add_argument("--no-sim", action="store_true", help="skip part (b), the planner's decision time")
    args = ap.parse_args()
    parts = tuple(p.strip() for p in args.live_parts.split(",") if p.strip())
    unknown = sorted(set(parts) - set(LIVE_PARTS))
    if unknown:
        ap.error(f"--live-parts: unknown case(s) {', '.join(unknown)}; choose from {', '.join(LIVE_PARTS)}")
    report = Report("bench_relayout")  # the load average before anything starts
    live = None if args.no_live else run_live(args.live_iters, parts)
    if args.no_sim:
        report.emit({"live": live})
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    cl = Cluster(device_flops=args.device_tflops * 1e12, memory_bytes=args.memory_gb * 1e9,
                 link_bytes_per_s=args.link_gbps * 1e9, tp_bytes_per_s=args.nvlink_gbps * 1e9,
                 relayout_pause_s=args.relayout_pause_s)

    dec = decision_time(cl, args)
    print(f"ResiHP re-layout benchmark (b): the joint planner's decision at 4,096 devices ({dec['layout']}, 5 slow + "
          f"1 dead), CPU s of one core, median of {args.decision_runs}: cold {dec['cold_s']:.3f} s (schedules "
          f"compiled), warm {dec['warm_s']:.3f} s")
    print(f"  {dec['plan']}")
    print("  (the policy comparison on fault traces is tools/bench_resilience.py)")
    report.emit({"live": live, "sim": {"decision_s_4096": round(dec["cold_s"], 4),
                                       "decision_warm_s_4096": round(dec["warm_s"], 4), "plan": dec["plan"]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
