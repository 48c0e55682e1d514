#!/usr/bin/env python
"""Pipeline-event instrumentation overhead and measured bubble fractions, per engine (issue #3).

    python tools/bench_timeline.py [--iters 8] [--rounds 15] [--block 1]

PP4 on 4 CPU ranks (gloo), the tiny GPT below, m = 4 and 8 micro-batches of one sequence, for the
megatron-core engine (1F1B) and the DeepSpeed engine (TrainSchedule):

* bubble: per stage, the median over ``--iters`` recorded iterations (after 2 warm-up ones) of the
  idle share of [first event, end of the last forward/backward], from the joined IterationRecord,
  against (p - 1) / (m + p - 1);
* overhead (m = 8): blocks of ``--block`` iterations with events off, on, and off again (the A/A
  arm: its ratio to the first "off" is the noise floor), the order rotated every round
  (``megatron_ext/bench/harness.py``), 90 % bootstrap intervals on both; overhead = median(on / off) - 1 of the
  CPU time of the block summed over the ranks (on a shared 2-core box the wall-clock ratio, also
  printed, swings by tens of percent from round to round: other processes' load, not ours). The
  table also gives a floor from first principles: events per iteration x the measured cost of one
  event through the engine's wrapper / iteration time.
  "Off" is the engine as shipped upstream: megatron with the schedule hooks uninstalled, DeepSpeed
  with the stock instruction map and train schedule set on the engine instance. "On" records every
  event (the extension's per-log-interval bubble all-reduce and trace writing are not included).

* expected_bubble: per stage, the bubble that the schedule gives when simulated with the same
  iteration's own measured op durations (``IterationRecord.schedule_check``), beside the measured
  one: on an oversubscribed host the textbook (p - 1) / (m + p - 1) cannot hold (op times vary and
  the last stage carries the head), but measured - expected isolates what the dataflow model
  misses (blocking sends, a descheduled rank) on any host;
* pipesim_err: ResiHP's pipeline simulator (the one the detector and the re-layout planner trust)
  fed each recorded iteration's op durations, against the recorded timeline: |makespan error| and
  the worst per-stage idle error as a share of the makespan, median and 95th percentile over
  every recorded iteration of both engines at m = 4 and 8, interleaved 1F1B (2 chunks per stage)
  and 1F1B with stage 1 slowed 2x.

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings

from megatron_ext.config.defaults import FORMER_DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PP = 4
MICROBATCHES = (4, 8)
OVERHEAD_M = 8
BASE = {**FORMER_DEFAULTS, "num_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "micro_batch_size": 1,
        "pipeline_model_parallel_size": PP, "lr": 1e-3, "lr_decay_style": "constant", "eval_iters": 0,
        "progress": False, "timeline": True, "log_interval": 1}   # the bubble figures every iteration, as measured


def _megatron_trainer(values: dict, state: dict):
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.extension import build_extensions
    from megatron_ext.runtime.loop import Trainer

    from megatron_ext.config.run import config_from_values

    cfg = config_from_values(values)
    ctx = state.get("ctx")
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed) if ctx is None else distributed.relayout(
        ctx, tp=1, pp=PP, vpp=values.get("virtual_pipeline_model_parallel_size"), seed=cfg.training.seed)
    state["ctx"] = ctx
    exts = build_extensions(cfg)
    return Trainer(cfg, ctx, exts).setup(), exts[0]


def _deepspeed_trainer(values: dict, state: dict):
    from deepspeed_patches import trainer as ds
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.extension import build_extensions

    cfg = config_from_values({**values, "engine": "deepspeed"})
    ctx = ds.setup_distributed(cfg.parallel, seed=cfg.training.seed)
    exts = build_extensions(cfg)
    return ds.DeepSpeedTrainer(cfg, ctx, exts).setup(), exts[0]


def _switch(engine: str, trainer, ext, on: bool) -> None:
    """Events on (as ``--timeline`` runs) or off (upstream code paths)."""
    if engine == "megatron":  # the trainer's own recorder installation (Trainer.install_recorder)
        if on and ext.hooks is None:
            ext.hooks = trainer.install_recorder(ext.recorder)
        elif not on and ext.hooks is not None:
            ext.hooks.uninstall()
            ext.hooks = None
        ext.recorder.enabled = on
        return
    from deepspeed.runtime.pipe.engine import PipelineEngine

    eng = trainer.engine
    if on:
        eng.__dict__.pop("_INSTRUCTION_MAP", None)
        eng.__dict__.pop("_train_schedule", None)
    else:  # instance attributes shadow the subclass: DeepSpeed's own map and schedule
        eng._INSTRUCTION_MAP = PipelineEngine._INSTRUCTION_MAP
        eng._train_schedule = types.MethodType(PipelineEngine._train_schedule, eng)


def _event_cost_us(engine: str, ext) -> float:
    """Cost of recording one event through this engine's wrapper around a no-op, in microseconds
    (a floor for the overhead that the noisy on/off timing cannot resolve)."""
    from megatron_ext.pipeline.events import EventRecorder, Phase

    rec = EventRecorder(capacity=20000)
    if engine == "deepspeed":
        from deepspeed_patches import engine as ds_engine

        wrapped = ds_engine._compute(lambda self, **kw: None, Phase.FORWARD)
        holder = types.SimpleNamespace(event_recorder=rec, _recording=True, _step_microbatch=0)
        call = lambda: wrapped(holder, buffer_id=0)  # noqa: E731
    else:
        from megatron_ext.pipeline.megatron_hooks import wrap_phase

        wrapped = wrap_phase(rec, lambda: None, Phase.FORWARD)
        call = wrapped
    n = 10000
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    with_events = time.perf_counter() - t0
    rec.enabled = False
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return max(with_events - (time.perf_counter() - t0), 0.0) / n * 1e6


def _extra_pipesim_cases(state: dict, iters: int) -> dict:
    """The simulator against more recorded timelines: interleaved 1F1B (2 chunks per stage), and
    1F1B with stage 1 slowed 2x (ResiHP's throttle: held idle inside each of its ops)."""
    from megatron_ext.resihp.injection import Throttle

    out = {}
    for name, extra, slow in (("interleaved_m8", {"virtual_pipeline_model_parallel_size": 2}, False),
                              ("1f1b_m8_stage1_slow2x", {}, True)):
        values = {**BASE, **extra, "global_batch_size": 8, "train_iters": 10**6}
        trainer, ext = _megatron_trainer(values, state)
        throttle = None
        if slow and trainer.ctx.coord.pp == 1:
            throttle = Throttle(list(trainer.model.chunks), 2.0)
            throttle.active = True
        checks = []
        for i in range(iters + 2):
            trainer.train_step()
            record = ext.record(trainer, trainer.iteration, dst=0)
            if i >= 2 and record is not None:
                checks.append(record.schedule_check())
        if throttle is not None:
            throttle.remove()
        ext.teardown(trainer)
        out[name] = checks
    return out


def _pipesim_summary(checks: list[dict]) -> dict:
    """Median and 95th percentile of |makespan error| and of the worst per-stage idle error (as a
    share of the measured makespan) over recorded iterations."""
    import numpy as np

    mk = np.abs([c["makespan_rel_error"] for c in checks])
    idle = np.array([c["idle_max_abs_error_s"] / c["measured_makespan_s"] for c in checks])
    return {"makespan": {"median": round(float(np.median(mk)), 4), "p95": round(float(np.percentile(mk, 95)), 4)},
            "idle": {"median": round(float(np.median(idle)), 4), "p95": round(float(np.percentile(idle, 95)), 4)},
            "iterations": len(checks)}


def worker(out_path: str, iters: int, rounds: int, block: int) -> None:
    from megatron_ext.bench.harness import aa_name, ratio_interval, rotated_order

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    result: dict = {}
    state: dict = {}
    for engine, build in (("megatron", _megatron_trainer), ("deepspeed", _deepspeed_trainer)):
        row: dict = {"bubble": {}, "expected_bubble": {}, "iter_ms": {}, "pipesim": {}}
        for m in MICROBATCHES:
            trainer, ext = build({**BASE, "global_batch_size": m, "train_iters": 10**6}, state)
            per_iter, expected, checks, times = [], [], [], []
            for i in range(iters + 2):
                metrics = trainer.train_step()
                record = ext.record(trainer, trainer.iteration, dst=0)
                if i >= 2 and record is not None:
                    check = record.schedule_check()
                    per_iter.append(check["measured_bubble"])
                    expected.append(check["expected_bubble"])
                    checks.append(check)
                    times.append(metrics.iter_time_s)
            if per_iter:
                row["bubble"][f"m{m}"] = [statistics.median(f[s] for f in per_iter) for s in range(PP)]
                row["expected_bubble"][f"m{m}"] = [statistics.median(f[s] for f in expected) for s in range(PP)]
                row["iter_ms"][f"m{m}"] = statistics.median(times) * 1000
                row["pipesim"][f"1f1b_m{m}" if engine == "megatron" else f"deepspeed_m{m}"] = checks
            if m == OVERHEAD_M:
                trainer.extensions = []  # time the events alone, not the extension's logging work
                row["events_per_iter"] = len(ext.recorder)

                def timed_block(on: bool) -> tuple[float, float]:
                    """(wall s on rank 0, CPU s summed over ranks) of ``block`` iterations."""
                    _switch(engine, trainer, ext, on)
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(block):
                        ext.before_iteration(trainer, trainer.iteration + 1)  # what --timeline does per step
                        trainer.train_step()
                    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                    dist.barrier()
                    wall = time.perf_counter() - t0
                    dist.all_reduce(cpu)
                    return wall, float(cpu)

                # Rounds of events-off, events-on and off again (the A/A arm, the noise floor), in an
                # order rotated by the round (the same on every rank: the blocks are collective).
                arms = {"off": False, "on": True, aa_name("off"): False}
                blocks: dict[str, list] = {name: [] for name in arms}
                for r in range(rounds):
                    for name in rotated_order(list(arms), r):
                        blocks[name].append(timed_block(arms[name]))
                cpu = {name: [b[1] for b in v] for name, v in blocks.items()}
                wall = {name: [b[0] for b in v] for name, v in blocks.items()}
                on_cpu, aa_cpu = ratio_interval(cpu["on"], cpu["off"]), ratio_interval(cpu[aa_name("off")], cpu["off"])
                on_wall = ratio_interval(wall["on"], wall["off"])
                row["overhead"] = on_cpu["median"] - 1.0
                row["overhead_interval"] = [x - 1.0 for x in on_cpu["interval"]]
                row["aa_overhead"] = aa_cpu["median"] - 1.0
                row["aa_interval"] = [x - 1.0 for x in aa_cpu["interval"]]
                row["overhead_wall"] = on_wall["median"] - 1.0
                row["cpu_ratios"], row["wall_ratios"] = on_cpu["ratios"], on_wall["ratios"]
                row["event_cost_us"] = _event_cost_us(engine, ext)
                _switch(engine, trainer, ext, True)
            ext.teardown(trainer)
        if engine == "megatron":
            row["pipesim"].update(_extra_pipesim_cases(state, iters))
        result[engine] = row
    if dist.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=8, help="recorded iterations per (engine, m)")
    parser.add_argument("--rounds", type=int, default=15, help="rotated off/on/off rounds for the overhead")
    parser.add_argument("--block", type=int, default=1, help="iterations per timed block")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.iters, args.rounds, args.block)
        return 0
    from megatron_ext.bench.harness import Report

    report = Report("bench_timeline")  # the load average before anything starts
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PP}",
                        os.path.abspath(__file__), "--worker", out, "--iters", str(args.iters),
                        "--rounds", str(args.rounds), "--block", str(args.block)],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.load(open(out, encoding="utf-8"))
    theory = {f"m{m}": (PP - 1) / (m + PP - 1) for m in MICROBATCHES}
    print(f"PP{PP} on {PP} CPU ranks; bubble = median per-stage idle share over {args.iters} iterations; "
          f"overhead at m={OVERHEAD_M} = median(on/off) - 1 of CPU time summed over ranks (wall in brackets)")
    print(f"{'engine':<10} {'m':>2} {'theory':>7} " + " ".join(f"{f'stage {s}':>8}" for s in range(PP))
          + f" {'iter ms':>8} {'overhead':>9} {'(wall)':>9} {'events':>7} {'us/event':>9} {'est.':>8}")
    figures: dict = {}
    for engine, row in result.items():
        figures[engine] = {"overhead": round(row["overhead"], 4),
                           "overhead_interval": [round(x, 4) for x in row["overhead_interval"]],
                           "aa_overhead": round(row["aa_overhead"], 4),
                           "aa_interval": [round(x, 4) for x in row["aa_interval"]],
                           "bubble": {k: [round(f, 3) for f in v] for k, v in row["bubble"].items()},
                           "expected_bubble": {k: [round(f, 3) for f in v] for k, v in row["expected_bubble"].items()}}
        for m in MICROBATCHES:
            key = f"m{m}"
            extra = ""
            if m == OVERHEAD_M:
                # per-event cost x events per iteration (one rank) / iteration time
                est = row["events_per_iter"] * row["event_cost_us"] * 1e-3 / row["iter_ms"][key]
                extra = (f" {row['overhead'] * 100:+8.2f}% {row['overhead_wall'] * 100:+8.2f}% "
                         f"{row['events_per_iter']:>7d} {row['event_cost_us']:>9.2f} {est * 100:>7.3f}%")
            print(f"{engine:<10} {m:>2} {theory[key]:>7.3f} " + " ".join(f"{f:>8.3f}" for f in row["bubble"][key])
                  + f" {row['iter_ms'][key]:>8.1f}{extra}")
    for engine, row in result.items():
        print(f"{engine} overhead (CPU) {row['overhead'] * 100:+.2f} %, 90 % interval "
              f"[{row['overhead_interval'][0] * 100:+.2f}, {row['overhead_interval'][1] * 100:+.2f}] %; A/A (off vs off) "
              f"{row['aa_overhead'] * 100:+.2f} % [{row['aa_interval'][0] * 100:+.2f}, {row['aa_interval'][1] * 100:+.2f}] %"
              f" over {len(row['cpu_ratios'])} rotated rounds")
        print(f"{engine} on/off ratios, CPU: " + " ".join(f"{r:.3f}" for r in row["cpu_ratios"])
              + " | wall: " + " ".join(f"{r:.3f}" for r in row["wall_ratios"]))
    print("\nmeasured bubble - bubble the schedule predicts from the same iteration's own op durations "
          "(medians per stage; the textbook figure assumes equal op times, which this host never gives):")
    for engine, row in result.items():
        for key in row["bubble"]:
            diff = [b - e for b, e in zip(row["bubble"][key], row["expected_bubble"][key])]
            print(f"{engine:<10} {key:>3} expected " + " ".join(f"{f:>6.3f}" for f in row["expected_bubble"][key])
                  + " | difference " + " ".join(f"{d:+6.3f}" for d in diff))
    print("\nResiHP pipeline simulator fed each recorded iteration's op durations, against the recorded timeline "
          "(|makespan error|, worst per-stage idle error / makespan):")
    cases = {name: checks for row in result.values() for name, checks in row["pipesim"].items()}
    everything = [c for checks in cases.values() for c in checks]
    for name, checks in {**cases, "all": everything}.items():
        summ = _pipesim_summary(checks)
        print(f"  {name:<24} n={summ['iterations']:>3} makespan median {summ['makespan']['median']:.4f} "
              f"p95 {summ['makespan']['p95']:.4f} | idle median {summ['idle']['median']:.4f} "
              f"p95 {summ['idle']['p95']:.4f}")
    all_summary = _pipesim_summary(everything)
    figures["pipesim_err"] = {"median": all_summary["makespan"]["median"], "p95": all_summary["makespan"]["p95"],
                              "idle_median": all_summary["idle"]["median"], "idle_p95": all_summary["idle"]["p95"],
                              "cases": {name: _pipesim_summary(c) for name, c in cases.items()}}
    figures["theory"] = {k: round(v, 4) for k, v in theory.items()}
    report.emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
