#!/usr/bin/env python
"""Benchmark the Bubble Squeezer: Hydro trials in the bubbles of a PP2 job, on both engines.

For each case (megatron-core and DeepSpeed, m = 4 and m = 8 micro-batches): a GPT on PP2, two
ranks pinned to one core each (a bubble is then really idle core time; each rank's guest is pinned
to the same core, at nice 19), runs ``pretrain_gpt.py --squeeze`` with every second iteration a
guest-off control (``--squeeze-control-every 2``) and the safety monitor disarmed
(``--squeeze-max-slowdown 0.99``: this measures what the guests cost, it does not back off).
The guests' study (``--study``, default configs/squeeze_tiny.yaml with a trial budget no run
reaches) never ends during a case.

Before each case, with nothing else running, the guest alone on core 0 (``exclusive``: a real
guest process, its study a copy of the case's, offered one window that stays open; what it does is
what a guest does in windows -- per-step evaluation, storage calls, bundle resizes -- measured over
``--exclusive-s`` seconds from its first trained step). Then three runs of the job in an order
rotated from case to case (each first in a third of the cases): ``plain`` (the same job without
``--squeeze``: same model, pinning and iterations), the squeezed run, and ``plain`` again (A/A: the
noise floor of the run-to-run comparison).

Figures per case:

* ``slowdown``: guest-on against guest-off iterations of the squeezed run, from the iterations
  after both guests trained their first step, in rounds of four iterations (on, off, on, off: the
  on-iteration before the round's first off one in even rounds, after it in odd ones), the median of
  the rounds' ratios minus 1, its bootstrap 90 % interval (``slowdown_ci90``) and the A/A floor
  (``slowdown_aa``: the round's second off-iteration against its first). Guest-off iterations run
  beside a parked guest, whose memory and cache footprint they still carry, so also
  ``slowdown_vs_plain`` (``_ci90``): each guest-on iteration against the same iteration of the plain
  run (same data, same schedule), with ``slowdown_vs_plain_aa``: the second plain run against the
  first for the same iterations; and ``off_vs_plain``: the guest-off iterations against those;
* ``guest_fraction_of_exclusive``: trial-steps the guests did, over what the guest alone
  (``exclusive_trial_steps_per_s``) does in the guest-on iterations' time, per rank, averaged;
* ``bubble_fraction``: the stages' idle share in guest-on iterations (the timeline's, per iteration);
* ``bubble_used``: the guests' CPU time inside windows (their own CPU clock, read at each window's
  open and close) over the window time (the ranks' waits while guests were on);
* ``pause_latency_p50_s`` / ``p99``: over every window a guest ran in, its CPU time from the
  window's close until it stopped (halted by the rank, parked, or suspended after a storage call);
  0 when it parked ahead of the close;
* ``halts``, ``units_outlived``: per rank, the SIGSTOPs sent at a close, and the windows whose
  close found the guest running; ``restarts`` and ``deaths`` (pid, exit code) per rank;
* ``forecast_err_p50``: median |actual - forecast| / actual of the windows' lengths;
* ``trial_parity_max_abs_diff``: every guest's operation log replayed alone (``squeezer.replay``);
  NaN when a replay gave NaN.

Prints a table, then one JSON line through the benchmark harness (``megatron_ext.bench.harness``:
commit, dirty flag, command, load average before and after)
``{"bench": "bench_squeezer", "cases": {"megatron_pp2_m4": {...}, ...}, "settings": {...}, ...}``; ``--figures-out`` writes, per
case, ``work_per_bubble_s`` (exclusive-seconds of guest work per bubble-second) for the cluster
simulator's ``--bubble-speed-from``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.config.defaults import former_default_flags  # noqa: E402

MODEL = [*former_default_flags(), "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--micro-batch-size", "4", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
         "--eval-iters", "0", "--log-interval", "1", "--progress", "false"]


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


def exclusive_rate(study: str, seconds: float, cpu: int, log_dir: str, timeout_s: float = 600.0) -> dict:
    """Trial-steps per second of a guest alone on core ``cpu``: a real guest process (the code a
    guest runs in windows: steps, evaluations, storage calls, resizes), offered one window that
    stays open, counted over ``seconds`` from its first step after the memory probe. The rate is per
    second of the guest's CPU time (``trial_steps_per_s``: a whole core's worth), which a loaded
    host does not lower as it lowers the wall-time rate of a guest at nice 19
    (``trial_steps_per_wall_s``, kept to show the load)."""
    import torch

    from megatron_ext.hydro.memory import available_bytes
    from megatron_ext.hydro.squeezer.control import cpu_clock_s
    from megatron_ext.hydro.squeezer.controller import GuestProcess, Squeezer
    from megatron_ext.pipeline.windows import Window

    # the budget a case's rank gives its guest on CPU: half of MemAvailable shared by 2 ranks
    guest = GuestProcess(tune_config=study, rank=0, device="cpu", log_dir=log_dir, cpus={cpu},
                         budget_bytes=available_bytes(torch.device("cpu")) // 2)
    sq = Squeezer(guest, suspend=False)
    sq.active = True
    ctl = guest.ctl
    guest.start()
    try:
        end = time.monotonic() + timeout_s

        def wait(pred, what):
            while not pred():
                if time.monotonic() > end or guest.proc.poll() is not None:
                    raise RuntimeError(f"exclusive guest: {what} ({ctl.message or 'timed out'}; logs in {log_dir})")
                time.sleep(0.01)

        wait(lambda: guest.ready, "never reached a pause point")
        w = Window((0, 3, 1), time.perf_counter(), 10.0 * timeout_s)
        sq.window_open(w)
        # the memory probe's bundles step too: count from the first step of the study's own bundle
        wait(lambda: ctl["fusion"] > 0, "never finished its memory probe")
        probed = int(ctl["trial_steps"])
        wait(lambda: ctl["trial_steps"] > probed, "never trained a step")
        pid = guest.proc.pid
        n0, c0, t0 = int(ctl["trial_steps"]), cpu_clock_s(pid), time.perf_counter()
        time.sleep(seconds)
        n1, c1, t1 = int(ctl["trial_steps"]), cpu_clock_s(pid), time.perf_counter()
        sq.window_close(w, time.perf_counter())
        return {"trial_steps_per_s": (n1 - n0) / (c1 - c0), "trial_steps_per_wall_s": (n1 - n0) / (t1 - t0),
                "fusion": int(ctl["fusion"]), "seconds": t1 - t0, "trial_steps": n1 - n0}
    finally:
        guest.stop()
        guest.close()


def run_case(engine: str, m: int, study: str | None, work: str, iters: int, timeout_s: float,
             margin_ms: float | None = None) -> dict:
    """One PP2 run, ranks pinned one per core; ``study`` None: the plain run, without --squeeze."""
    from megatron_ext.runtime.distributed import free_port

    os.makedirs(work, exist_ok=True)
    sq_dir = os.path.join(work, "squeeze")
    metrics = os.path.join(work, "metrics.jsonl")
    args = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--engine", engine,
            "--pipeline-model-parallel-size", "2", "--global-batch-size", str(4 * m), "--train-iters", str(iters),
            "--metrics-file", metrics]
    if study is not None:
        args += ["--squeeze", study, "--squeeze-dir", sq_dir, "--squeeze-control-every", "2",
                 "--squeeze-check-every", "40", "--squeeze-max-slowdown", "0.99", "--squeeze-start-iter", "2"]
        args += [] if margin_ms is None else ["--squeeze-margin-ms", str(margin_ms)]
    port = str(free_port())
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
    if study is None:
        return {"rows": [r for r in rows if r["kind"] == "train"]}
    figs = [json.load(open(os.path.join(sq_dir, f"figures_rank{r}.json"))) for r in range(2)]
    return {"rows": [r for r in rows if r["kind"] == "train"], "figures": figs, "dir": sq_dir}


def in_run_rounds(rows: list[dict], start: int) -> dict[str, list[float]]:
    """Guest-on, guest-off and A/A samples of the squeezed run, one per round of four iterations
    (on, off, on, off from an odd iteration >= ``start``): ``guest_off`` the round's first off
    iteration, ``guest_on`` the on-iteration before it in even rounds and after it in odd ones (each
    first in half the rounds), the A/A copy the round's second off iteration."""
    from megatron_ext.bench.harness import aa_name

    times = {r["iteration"]: r["iter_time_s"] for r in rows}
    first = start + (0 if start % 2 else 1)
    out: dict[str, list[float]] = {"guest_off": [], "guest_on": [], aa_name("guest_off"): []}
    k = 0
    while all(first + 4 * k + j in times for j in range(4)):
        i = first + 4 * k
        out["guest_off"].append(times[i + 1])
        out["guest_on"].append(times[i] if k % 2 == 0 else times[i + 2])
        out[aa_name("guest_off")].append(times[i + 3])
        k += 1
    if k < 2:
        raise RuntimeError(f"only {k} round(s) of four iterations after iteration {start}: run more --iters")
    return out


def vs_plain_samples(rows: list[dict], plain: dict, plain_aa: dict, start: int) -> dict[str, list[float]]:
    """Each guest-on iteration (odd, >= ``start``) beside the same iteration of the plain run and of
    its A/A repeat."""
    from megatron_ext.bench.harness import aa_name

    a = {r["iteration"]: r["iter_time_s"] for r in plain["rows"]}
    b = {r["iteration"]: r["iter_time_s"] for r in plain_aa["rows"]}
    its = [r["iteration"] for r in rows if r["iteration"] >= start and r["iteration"] % 2
           and r["iteration"] in a and r["iteration"] in b]
    on = {r["iteration"]: r["iter_time_s"] for r in rows}
    return {"plain": [a[i] for i in its], "squeezed": [on[i] for i in its], aa_name("plain"): [b[i] for i in its]}


def summarize(res: dict, exclusive: dict, study: str, plain: dict | None = None,
              plain_aa: dict | None = None) -> dict:
    from megatron_ext.bench.harness import aa_name, compare
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
    in_run = compare(in_run_rounds(rows, start), "guest_off", higher_is_better=False)
    guest = in_run["arms"]["guest_on"]
    floor = in_run["noise_floor"]
    vs_plain: dict = {}
    if plain is not None and plain_aa is not None:
        cmp = compare(vs_plain_samples(rows, plain, plain_aa, start), "plain", higher_is_better=False)
        sq, pf = cmp["arms"]["squeezed"], cmp["noise_floor"]
        alone = [r["iter_time_s"] for r in plain["rows"] if r["iteration"] >= start]
        vs_plain = {"slowdown_vs_plain": sq["ratio_vs_reference"] - 1,
                    "slowdown_vs_plain_ci90": [x - 1 for x in sq["interval"]],
                    "slowdown_vs_plain_verdict": sq["verdict"],
                    "slowdown_vs_plain_aa": pf["ratio"] - 1, "slowdown_vs_plain_aa_ci90": [x - 1 for x in pf["interval"]],
                    "off_vs_plain": statistics.median(off) / statistics.median(alone) - 1,
                    "iter_s_plain_median": statistics.median(alone),
                    "iter_s_plain_aa_median": cmp["arms"][aa_name("plain")]["median"],
                    "iterations_plain": len(alone), "comparison_vs_plain": cmp}
    bubbles = [statistics.mean([r[k] for k in r if k.startswith("bubble_s")]) for r in body if r["iteration"] % 2]
    on_time = sum(on)
    fracs, works, lat, errs, used_num, used_den = [], [], [], [], 0.0, 0.0
    rate = exclusive["trial_steps_per_s"]
    for f in res["figures"]:
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
        # max() drops a NaN that is not its first argument: a NaN difference is the figure
        diffs = [parity, r["max_abs_loss_diff"], r["max_abs_val_diff"]]
        parity = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"slowdown": guest["ratio_vs_reference"] - 1, "slowdown_ci90": [x - 1 for x in guest["interval"]],
            "slowdown_verdict": guest["verdict"], "slowdown_aa": floor["ratio"] - 1,
            "slowdown_aa_ci90": [x - 1 for x in floor["interval"]], "rounds": in_run["rounds"],
            "comparison": in_run, "iterations_on": len(on), "iterations_off": len(off),
            "iter_s_off_median": statistics.median(off),
            "guest_fraction_of_exclusive": statistics.mean(fracs) if fracs else float("nan"),
            "work_per_bubble_s": statistics.mean(works) if works else float("nan"),
            "bubble_fraction": statistics.mean(bubbles), "bubble_used": used_num / used_den if used_den else 0.0,
            "pause_latency_p50_s": q(lat, 0.5), "pause_latency_p99_s": q(lat, 0.99),
            "forecast_err_p50": statistics.median(errs) if errs else float("nan"),
            "trial_parity_max_abs_diff": parity, "oplogs_replayed": len(logs),
            "fusion": [f["fusion"] for f in res["figures"]],
            "halts": [f.get("halts", 0) for f in res["figures"]],
            "units_outlived": [f.get("units_outlived", 0) for f in res["figures"]],
            "restarts": [f.get("restarts", 0) for f in res["figures"]],
            "deaths": [f.get("deaths", []) for f in res["figures"]],
            "pause_latencies": len(lat), **vs_plain,
            "long_units_share": (sum(f["long_units"] for f in res["figures"]) /
                                 max(1, sum(f["units"] for f in res["figures"])))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", default=os.path.join(ROOT, "configs", "squeeze_tiny.yaml"))
    p.add_argument("--iters", type=int, default=240, help="iterations per case")
    p.add_argument("--engines", nargs="+", default=["megatron", "deepspeed"], choices=["megatron", "deepspeed"])
    p.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    p.add_argument("--exclusive-s", type=float, default=8.0, help="seconds of the exclusive guest measurement "
                   "(from its first step; long enough to include its evaluations and storage calls)")
    p.add_argument("--no-plain", action="store_true", help="skip the run without --squeeze before each case "
                   "(then no slowdown_vs_plain)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--figures-out", default=None, help="a directory: <case>.json with work_per_bubble_s, for the "
                   "cluster simulator's --bubble-speed-from")
    p.add_argument("--keep", default=None, help="keep the runs' files in this directory")
    p.add_argument("--margin-ms", type=float, default=None, help="--squeeze-margin-ms of the runs (default: the flag's)")
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("bench_squeezer.py: error: needs 2 cores (one per rank)", file=sys.stderr)
        return 2
    from megatron_ext.bench.harness import Report, format_comparison, rotated_order

    report = Report("bench_squeezer")
    base = args.keep or tempfile.mkdtemp(prefix="bench-squeeze-")
    cases: dict[str, dict] = {}
    orders: dict[str, list[str]] = {}
    finished = False
    try:
        ci = 0
        for engine in args.engines:
            for m in args.microbatches:
                name = f"{engine}_pp2_m{m}"
                work = os.path.join(base, name)
                shutil.rmtree(work, ignore_errors=True)
                # before the case, with nothing else running: the guest alone (its own copy of the
                # study, so the case's study starts as fresh)
                excl_study = study_for_bench(args.study, os.path.join(work, "exclusive"))
                excl = exclusive_rate(excl_study, args.exclusive_s, cpu=0, log_dir=os.path.join(work, "exclusive"))
                study = study_for_bench(args.study, work)
                order = ["squeeze"] if args.no_plain else rotated_order(["plain", "squeeze", "plain_aa"], ci)
                orders[name] = order
                ci += 1
                runs = {}
                for arm in order:
                    if arm == "squeeze":
                        runs[arm] = run_case(engine, m, study, work, args.iters, args.timeout_s, args.margin_ms)
                    else:
                        runs[arm] = run_case(engine, m, None, os.path.join(work, arm), args.iters, args.timeout_s)
                cases[name] = summarize(runs["squeeze"], excl, study, runs.get("plain"), runs.get("plain_aa"))
                cases[name]["exclusive_trial_steps_per_s"] = excl["trial_steps_per_s"]
                cases[name]["exclusive"] = excl
                cases[name]["run_order"] = order
                print(f"{name}: done (runs in the order {', '.join(order)})", flush=True)
        finished = True
    finally:
        if args.keep is None and finished:
            shutil.rmtree(base, ignore_errors=True)
        elif not finished:  # a failed run's logs are what explains it: keep them
            print(f"bench_squeezer.py: the runs' files (rank logs included) are kept in {base}", file=sys.stderr)
    head = ["case", "slowdown", "ci90", "A/A", "vs plain", "ci90", "A/A", "guest/excl", "bubble", "used",
            "pause p50/p99 ms", "fcst err", "parity"]
    lines = ["  ".join(head)]
    pc = lambda x: f"{x:+.2%}"  # noqa: E731
    ci90 = lambda v: f"[{v[0]:+.1%}, {v[1]:+.1%}]"  # noqa: E731
    for name, c in cases.items():
        vp = [pc(c["slowdown_vs_plain"]), ci90(c["slowdown_vs_plain_ci90"]), pc(c["slowdown_vs_plain_aa"])] \
            if "slowdown_vs_plain" in c else ["-", "-", "-"]
        lines.append(f"{name}  {pc(c['slowdown'])}  {ci90(c['slowdown_ci90'])}  {pc(c['slowdown_aa'])}  {'  '.join(vp)}  "
                     f"{c['guest_fraction_of_exclusive']:.3f}  {c['bubble_fraction']:.3f}  {c['bubble_used']:.3f}  "
                     f"{c['pause_latency_p50_s'] * 1e3:.2f}/{c['pause_latency_p99_s'] * 1e3:.1f}  "
                     f"{c['forecast_err_p50']:.3f}  {c['trial_parity_max_abs_diff']:.1e}")
    lines.append("slowdown: guest-on vs guest-off iterations of the squeezed run (A/A: off vs off); vs plain: the "
                 "same iterations of a run without --squeeze (A/A: that run repeated); 90 % bootstrap intervals of "
                 "the median of paired ratios")
    for name, c in cases.items():
        lines.append(f"\n{name}, guest-on vs guest-off (s per iteration):")
        lines.append(format_comparison(c["comparison"], "s"))
        if "comparison_vs_plain" in c:
            lines.append(f"{name}, squeezed vs plain (s per iteration):")
            lines.append(format_comparison(c["comparison_vs_plain"], "s"))
    if args.figures_out:
        os.makedirs(args.figures_out, exist_ok=True)
        for n, c in cases.items():
            with open(os.path.join(args.figures_out, f"{n}.json"), "w", encoding="utf-8") as fh:
                json.dump({"case": n, "work_per_bubble_s": c["work_per_bubble_s"], "bubble_used": c["bubble_used"],
                           "bubble_fraction": c["bubble_fraction"]}, fh, indent=1)
    settings = {"iters": args.iters, "study": os.path.relpath(args.study, ROOT), "model": " ".join(MODEL),
                "margin_ms": args.margin_ms, "load_avg_1m": os.getloadavg()[0]}
    report.emit({"cases": cases, "settings": settings}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
