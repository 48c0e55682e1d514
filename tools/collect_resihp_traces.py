"""Collect live ResiHP traces: pretrain_gpt.py on 4 CPU ranks with ``--resihp --resihp-trace-out``,
healthy and with an injected fail-slow, on both engines and two layouts, and on the MoE model
(PP2 x DP2 with EP2 in each stage, the all-to-all dispatcher: ``moe-pp2dp2ep2-*``; ``-noaux-``
without the load-balancing loss, whose routers drift to one EP rank's experts); and megatron PP2 on
2 ranks (``megatron-pp2-*``: one rank per core of a 2-core host, the resilience simulator's
validation set, tests/resilience/data/), healthy, with a slow stage, or with the pipeline link
between the two stages slowed (``megatron-pp2-link0-1at<MBPS>@<ITER>``, ``--inject-slow-link``).

    python tools/collect_resihp_traces.py OUT_DIR [--runs 2] [--iters 80] [--only NAME_SUBSTRING ...] [--gzip]

Each scenario is launched with the direct rank launcher (``megatron_ext.ft.launch``), one
after the other; a trace is written to ``OUT_DIR/<scenario>-r<k>.trace.jsonl`` and the live
verdicts to ``...verdicts.jsonl``. The live detector runs with its defaults, so the verdicts
show what the shipped settings do; the traces are then replayed offline with any setting
(``python -m megatron_ext.resihp.replay``). Prints one line per run: scenario, wall time,
verdicts. ``--gzip`` also writes ``<scenario>-r<k>.trace.jsonl.gz``: the same records with
durations rounded to the microsecond, gzip-compressed (how the regression traces under
tests/resihp/data/ are stored; the replay reads them directly).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.config.defaults import former_default_flags  # noqa: E402
from megatron_ext.ft.launch import launch_ranks  # noqa: E402

# Small model: the point is the detector's view of real, noisy CPU timings, not training.
MODEL = [*former_default_flags(), "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-iters", "0", "--lr-decay-style", "constant",
         "--log-interval", "20"]


# The MoE model of tests/resihp/live_scenarios_moe.py: the tiny Qwen3-MoE-style block, experts wide
# enough that a rank's routed tokens show in its op times.
MOE = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "0.001", "--group-query-attention", "--num-query-groups", "2",
       "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--seq-length", "128", "--doc-length-dist", "lognormal:3.5,1"]


def scenarios(iters: int) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, extra flags). Fault onsets vary so calibration sees different amounts of history."""
    out: dict[str, tuple[int, list[str]]] = {}
    layouts = {"pp2dp2": ["--pipeline-model-parallel-size", "2"], "pp4": ["--pipeline-model-parallel-size", "4"]}
    for engine in ("megatron", "deepspeed"):
        eng = ["--engine", "deepspeed"] if engine == "deepspeed" else []
        # DeepSpeed refuses packed documents (--doc-length-dist); it trains on plain sequences.
        data = ["--seq-length", "256", "--doc-length-dist", "lognormal:3.5,1"] if engine == "megatron" \
            else ["--seq-length", "128"]
        for lay, flags in layouts.items():
            base = eng + data + flags
            out[f"{engine}-{lay}-healthy"] = (4, base)
            slow_rank = 2 if lay == "pp2dp2" else 1
            for factor, since in ((1.3, 30), (1.6, 35), (2.0, 25), (3.0, 40)):
                out[f"{engine}-{lay}-slow{slow_rank}x{factor:g}@{since}"] = (4, base + [
                    "--inject-slow", f"{slow_rank}:{since}:{factor}"])
    # One rank per core (2 ranks on the 2-core host): what the resilience simulator assumes of a
    # device. On 4 ranks over 2 cores a throttled rank, held idle, hands its core to the others.
    base = ["--seq-length", "256", "--doc-length-dist", "lognormal:3.5,1", "--pipeline-model-parallel-size", "2"]
    out["megatron-pp2-healthy"] = (2, base)
    for factor, since in ((1.3, 30), (1.6, 35), (2.0, 25), (3.0, 40)):
        out[f"megatron-pp2-slow1x{factor:g}@{since}"] = (2, base + ["--inject-slow", f"1:{since}:{factor}"])
    # A slow pipeline link between the two stages (each 64 KB message held 16.4 / 32.8 ms): the
    # simulator's send model, validated.
    for mbps, since in ((4, 30), (2, 25)):
        out[f"megatron-pp2-link0-1at{mbps:g}@{since}"] = (2, base + ["--inject-slow-link", f"0:1:{since}:{mbps}"])
    out["moe-pp2dp2ep2-healthy"] = (4, MOE)
    out["moe-pp2dp2ep2-noaux-healthy"] = (4, MOE + ["--moe-aux-loss-coeff", "0"])
    for factor, since in ((1.6, 35), (2.0, 25), (3.0, 40)):
        out[f"moe-pp2dp2ep2-slow2x{factor:g}@{since}"] = (4, MOE + ["--inject-slow", f"2:{since}:{factor}"])
    return out


def pack(src: str, dst: str) -> None:
    """``src`` as gzip with durations rounded to 1 us (the clock's useful resolution here)."""
    def us(x):
        return [us(v) for v in x] if isinstance(x, list) else (round(x, 6) if isinstance(x, float) else x)

    with open(src, encoding="utf-8") as fh, gzip.open(dst, "wt", encoding="utf-8", compresslevel=9) as out:
        for line in fh:
            rec = json.loads(line)
            for key in ("fwd_s", "bwd_s", "iteration_s", "moe_comm_fwd_s", "moe_comm_bwd_s"):
                if key in rec:
                    rec[key] = us(rec[key])
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=2, help="runs of each scenario (default 2)")
    parser.add_argument("--iters", type=int, default=80, help="training iterations per run (default 80)")
    parser.add_argument("--only", nargs="*", default=[], help="scenarios whose name contains one of these")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the first run; run k adds k")
    parser.add_argument("--gzip", action="store_true", help="also write a compressed copy of each trace (1 us)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    todo = {n: f for n, f in scenarios(args.iters).items() if not args.only or any(s in n for s in args.only)}
    for k in range(args.runs):
        for name, (ranks, flags) in todo.items():
            stem = os.path.join(args.out, f"{name}-r{k}")
            trace, verdicts = stem + ".trace.jsonl", stem + ".verdicts.jsonl"
            for f in (trace, verdicts):
                if os.path.exists(f):
                    os.remove(f)
            t0 = time.time()
            res = launch_ranks(["pretrain_gpt.py", *MODEL, *flags, "--train-iters", str(args.iters),
                                "--seed", str(args.seed + k), "--resihp", "--resihp-trace-out", trace,
                                "--resihp-verdicts-out", verdicts], ranks, cwd=ROOT, timeout_s=900)
            codes = [r.returncode for r in res]
            found = [json.loads(x) for x in open(verdicts)] if os.path.exists(verdicts) else []
            summary = [(v["kind"], v["rank"], v["iteration"]) for v in found]
            print(f"{name}-r{k}: {time.time() - t0:.0f} s, exit {codes}, verdicts {summary}", flush=True)
            if args.gzip and os.path.exists(trace):
                pack(trace, trace + ".gz")
            if any(codes):
                print(res[0].output[-2000:], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
