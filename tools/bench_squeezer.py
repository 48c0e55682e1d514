#!/usr/bin/env python
"""Benchmark the Bubble Squeezer: Hydro trials in the bubbles of a PP2 job, on both engines.

For each case (megatron-core and DeepSpeed, m = 4 and m = 8 micro-batches): a GPT on PP2, two
ranks pinned to one core each (a bubble is then really idle core time; each rank's guest is pinned
to the same core, at nice 19), runs ``pretrain_gpt.py --squeeze`` with every second iteration a
guest-off control (``--squeeze-control-every 2``) and the safety monitor disarmed
(``--squeeze-max-slowdown 0.99``: this measures what the guests cost, it does not back off).
The guests' study (``--study``, default configs/squeeze_tiny.yaml with a trial budget no run
reaches) never ends during a case.

Figures per case:

* ``slowdown``: median iteration time of guest-on iterations over that of the interleaved
  guest-off ones, minus 1, from the iterations after both guests trained their first step; with
  the bootstrap 90 % interval of that ratio (``slowdown_ci90``);
* ``guest_fraction_of_exclusive``: trial-steps the guests did, over what the same bundle (same
  fusion count) does alone on one core in the guest-on iterations' time, per rank, averaged; the
  exclusive speed is measured right before the case, with nothing else running;
* ``bubble_fraction``: the stages' idle share in guest-on iterations (the timeline's, per iteration);
* ``bubble_used``: the share of window time (the ranks' waits while guests were on) guests ran;
* ``pause_latency_p50_s`` / ``p99``: from a window's end to its guest parked (0 when it parked
  ahead of the end);
* ``forecast_err_p50``: median |actual - forecast| / actual of the windows' lengths;
* ``trial_parity_max_abs_diff``: every guest's operation log replayed alone (``squeezer.replay``).

Prints a table, then one JSON line
``{"cases": {"megatron_pp2_m4": {...}, ...}, "settings": {...}}``; ``--figures-out`` writes, per
case, ``work_per_bubble_s`` (exclusive-seconds of guest work per bubble-second) for the cluster
simulator's ``--bubble-speed-from``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--eval-iters", "0",
         "--log-interval", "1", "--progress", "false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def study_for_bench(src: str, out_dir: str) -> str:
    """The study YAML with its outputs in ``out_dir`` and a trial budget no case reaches."""
    import yaml

    with open(src, encoding="utf-8") as fh:
        values = yaml.safe_load(fh)
    values.update(output_dir=out_dir, n_trials=100_000, study_name="bench_squeeze")
    path = os.path.join(out_dir, "study.yaml")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(values, fh)
    return path


def exclusive_rate(study: str, fusion: int, seconds: float, cpu: int) -> float:
    """Trial-steps per second of the guest's bundle alone on core ``cpu`` (the guest's code path)."""
    code = f"""
import os, time, torch
os.sched_setaffinity(0, {{{cpu}}})
torch.set_num_threads(1)
from megatron_ext.hydro.bundle import TrialSpec
from megatron_ext.hydro.config import load_config
from megatron_ext.hydro.tuner import HydroTuner
cfg, space, hp, dr = load_config({study!r}, {{"target_steps": 0, "threads": 1}})
t = HydroTuner(cfg, space, hp, dr, log=lambda s: None)
t._setup_data(); t._setup_models()
b = t._bundle(t.proxy_factory, [TrialSpec(i, seed=i, hparams=hp) for i in range({fusion})], t.proxy_multipliers)
for _ in range(5):
    b.train_step(*t.data.train_batch())
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < {seconds}:
    b.train_step(*t.data.train_batch()); n += 1
print(n * {fusion} / (time.perf_counter() - t0))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def run_case(engine: str, m: int, study: str, work: str, iters: int, timeout_s: float,
             margin_ms: float | None = None) -> dict:
    sq_dir = os.path.join(work, "squeeze")
    metrics = os.path.join(work, "metrics.jsonl")
    args = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--engine", engine,
            "--pipeline-model-parallel-size", "2", "--global-batch-size", str(4 * m), "--train-iters", str(iters),
            "--squeeze", study, "--squeeze-dir", sq_dir, "--squeeze-control-every", "2",
            "--squeeze-check-every", "40", "--squeeze-max-slowdown", "0.99", "--squeeze-start-iter", "2",
            "--metrics-file", metrics] + ([] if margin_ms is None else ["--squeeze-margin-ms", str(margin_ms)])
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        log = open(os.path.join(work, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=lambda r=rank: os.sched_setaffinity(0, {r})), log))
    t_end = time.monotonic() + timeout_s
    for p, log in procs:
        try:
            p.wait(max(1.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise RuntimeError(f"{engine} m={m}: timed out after {timeout_s:.0f} s (logs in {work})")
        log.close()
    for rank, (p, _) in enumerate(procs):
        if p.returncode != 0:
            with open(os.path.join(work, f"rank{rank}.log")) as fh:
                raise RuntimeError(f"{engine} m={m}: rank {rank} exited {p.returncode}:\n{fh.read()[-3000:]}")
    with open(metrics, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    figs = [json.load(open(os.path.join(sq_dir, f"figures_rank{r}.json"))) for r in range(2)]
    return {"rows": [r for r in rows if r["kind"] == "train"], "figures": figs, "dir": sq_dir}


def bootstrap_ratio_ci(on: list[float], off: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
                    for _ in range(reps))
    return ratios[int(0.05 * reps)] - 1, ratios[int(0.95 * reps) - 1] - 1


def summarize(res: dict, rates: dict[int, float], study: str) -> dict:
    from megatron_ext.hydro.squeezer.replay import read_oplog, replay

    rows = res["rows"]
    ready = next((r["iteration"] for r in rows if r.get("squeeze_trial_steps", 0) > 0), None)
    if ready is None:
        raise RuntimeError("the guests never trained a step")
    # both guests have trained once from here on (the all-reduced count grows past one bundle step)
    start = ready + 4
    body = [r for r in rows if r["iteration"] >= start]
    on = [r["iter_time_s"] for r in body if r["iteration"] % 2]
    off = [r["iter_time_s"] for r in body if not r["iteration"] % 2]
    ratio = statistics.median(on) / statistics.median(off)
    lo, hi = bootstrap_ratio_ci(on, off)
    bubbles = [statistics.mean([r[k] for k in r if k.startswith("bubble_s")]) for r in body if r["iteration"] % 2]
    on_time = sum(on)
    fracs, works, lat, errs, used_num, used_den = [], [], [], [], 0.0, 0.0
    for f in res["figures"]:
        rate = rates[f["fusion"]] if f["fusion"] in rates else None
        if rate:
            fracs.append(f["guest_trial_steps"] / (rate * on_time))
            if f["window_s"] > 0:
                works.append(f["guest_trial_steps"] / (rate * f["window_s"]))
        lat += f["pause_latencies_s"]
        if f["forecast"]["windows"]:
            errs.append(f["forecast"]["abs_err_p50"])
        used_num += f["guest_busy_s"]
        used_den += f["window_s"]
    lat.sort()
    parity = 0.0
    logs = sorted(p for p in os.listdir(res["dir"]) if p.startswith("oplog_"))
    for name in logs:
        r = replay(study, read_oplog(os.path.join(res["dir"], name)))
        parity = max(parity, r["max_abs_loss_diff"], r["max_abs_val_diff"])
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"slowdown": ratio - 1, "slowdown_ci90": [lo, hi], "iterations_on": len(on), "iterations_off": len(off),
            "iter_s_off_median": statistics.median(off),
            "guest_fraction_of_exclusive": statistics.mean(fracs) if fracs else float("nan"),
            "work_per_bubble_s": statistics.mean(works) if works else float("nan"),
            "bubble_fraction": statistics.mean(bubbles), "bubble_used": used_num / used_den if used_den else 0.0,
            "pause_latency_p50_s": q(lat, 0.5), "pause_latency_p99_s": q(lat, 0.99),
            "forecast_err_p50": statistics.median(errs) if errs else float("nan"),
            "trial_parity_max_abs_diff": parity, "oplogs_replayed": len(logs),
            "fusion": [f["fusion"] for f in res["figures"]],
            "long_units_share": (sum(f["long_units"] for f in res["figures"]) /
                                 max(1, sum(f["units"] for f in res["figures"])))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", default=os.path.join(ROOT, "configs", "squeeze_tiny.yaml"))
    p.add_argument("--iters", type=int, default=240, help="iterations per case")
    p.add_argument("--engines", nargs="+", default=["megatron", "deepspeed"], choices=["megatron", "deepspeed"])
    p.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    p.add_argument("--exclusive-s", type=float, default=8.0, help="seconds of the exclusive guest measurement")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--figures-out", default=None, help="a directory: <case>.json with work_per_bubble_s, for the "
                   "cluster simulator's --bubble-speed-from")
    p.add_argument("--keep", default=None, help="keep the runs' files in this directory")
    p.add_argument("--margin-ms", type=float, default=None, help="--squeeze-margin-ms of the runs (default: the flag's)")
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("bench_squeezer.py: error: needs 2 cores (one per rank)", file=sys.stderr)
        return 2
    base = args.keep or tempfile.mkdtemp(prefix="bench-squeeze-")
    cases: dict[str, dict] = {}
    try:
        for engine in args.engines:
            for m in args.microbatches:
                name = f"{engine}_pp2_m{m}"
                work = os.path.join(base, name)
                shutil.rmtree(work, ignore_errors=True)
                study = study_for_bench(args.study, work)
                res = run_case(engine, m, study, work, args.iters, args.timeout_s, args.margin_ms)
                # the exclusive speed of the bundle each guest ran, measured now, side by side
                rates = {f: exclusive_rate(study, f, args.exclusive_s, cpu=0) for f in {x["fusion"] for x in res["figures"]}}
                cases[name] = summarize(res, rates, study)
                cases[name]["exclusive_trial_steps_per_s"] = rates
                print(f"{name}: done", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    head = ["case", "slowdown", "ci90", "guest/excl", "bubble", "used", "pause p50/p99 ms", "fcst err", "parity"]
    print("  ".join(head))
    for name, c in cases.items():
        print(f"{name}  {c['slowdown']:+.2%}  [{c['slowdown_ci90'][0]:+.1%}, {c['slowdown_ci90'][1]:+.1%}]  "
              f"{c['guest_fraction_of_exclusive']:.3f}  {c['bubble_fraction']:.3f}  {c['bubble_used']:.3f}  "
              f"{c['pause_latency_p50_s'] * 1e3:.2f}/{c['pause_latency_p99_s'] * 1e3:.1f}  {c['forecast_err_p50']:.3f}  "
              f"{c['trial_parity_max_abs_diff']:.1e}")
    if args.figures_out:
        os.makedirs(args.figures_out, exist_ok=True)
        for n, c in cases.items():
            with open(os.path.join(args.figures_out, f"{n}.json"), "w", encoding="utf-8") as fh:
                json.dump({"case": n, "work_per_bubble_s": c["work_per_bubble_s"], "bubble_used": c["bubble_used"],
                           "bubble_fraction": c["bubble_fraction"]}, fh, indent=1)
    settings = {"iters": args.iters, "study": os.path.relpath(args.study, ROOT), "model": " ".join(MODEL),
                "margin_ms": args.margin_ms, "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps({"cases": cases, "settings": settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
