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


# The whole-simulator validation's model (issue #47 item 5): wide enough that its matrix products,
# not the loop's overheads, take an op's time, in the simulator's own setting -- SwiGLU (the FLOPs
# count's three MLP matrices), untied output layer, sequence parallelism and the distributed
# optimizer -- on 4 ranks: TP2 x PP2 and PP2 x DP2 (``megatron-w256-<layout>-*``, tests/resilience/data/).
WIDE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "768",
        "--swiglu", "--untie-embeddings-and-output-weights", "--seq-length", "512",
        "--doc-length-dist", "lognormal:3.5,1", "--use-distributed-optimizer"]
WIDE_LAYOUTS = {"tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--sequence-parallel"],
                "pp2dp2": ["--pipeline-model-parallel-size", "2"]}


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
    for lay, flags in WIDE_LAYOUTS.items():
        out[f"megatron-w256-{lay}-healthy"] = (4, WIDE + flags)
    # A slow device in each: in TP2 x PP2 its TP group waits for it; in PP2 x DP2 its pipeline.
    out["megatron-w256-tp2pp2-slow1x2@20"] = (4, WIDE + WIDE_LAYOUTS["tp2pp2"] + ["--inject-slow", "1:20:2"])
    out["megatron-w256-pp2dp2-slow2x2@20"] = (4, WIDE + WIDE_LAYOUTS["pp2dp2"] + ["--inject-slow", "2:20:2"])
    # The same with the slow rank burning its extra time on its core (``--inject-slow-mode work``)
    # instead of sleeping: a slow device that does not hand its share of the host to the others, as
    # the simulator's devices do not (added after the sleeping ones were seen; both are kept).
    for name in ("megatron-w256-tp2pp2-slow1x2@20", "megatron-w256-pp2dp2-slow2x2@20"):
        ranks, flags = out[name]
        out[name.replace("@20", "@20-work")] = (ranks, flags + ["--inject-slow-mode", "work"])
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


# ---- the host's device, measured once for the whole-simulator validation -------------------------

LINK_BYTES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)
OPTIMIZER_PARAMS = 1 << 20


def _links_and_optimizer(rank: int, world: int, addr: str, reps: int, path: str) -> None:
    """One of ``world`` gloo ranks: pairs (0, 1), (2, 3), ... each time a reduce-scatter then an
    all-gather (the ring all-reduce the simulator prices, the collectives sequence parallelism and
    the distributed optimizer call) of each size in ``LINK_BYTES`` fp32, all pairs at once, as in
    the recorded runs; then an AdamW step over ``OPTIMIZER_PARAMS`` fp32 parameters, every rank at
    once. Medians of ``reps`` each, every rank's, written by rank 0 to ``path`` (JSON)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # the _tensor collectives' renaming
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world)
    pair = None
    for a in range(0, world, 2):
        g = dist.new_group([a, a + 1])
        if rank in (a, a + 1):
            pair = g
    times = {}
    for nbytes in LINK_BYTES:
        x = torch.ones(nbytes // 4)
        half = torch.empty(nbytes // 8)
        got = []
        for _ in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.reduce_scatter_tensor(half, x, group=pair)
            dist.all_gather_into_tensor(x, half, group=pair)
            got.append(time.perf_counter() - t0)
        times[nbytes] = sorted(got[2:])[len(got[2:]) // 2]
    params = [torch.nn.Parameter(torch.randn(OPTIMIZER_PARAMS // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    steps = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t0)
    step_s = sorted(steps[2:])[len(steps[2:]) // 2]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"link_s": times, "optimizer_step_s": step_s})
    if rank == 0:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"ranks": gathered}, f)
    dist.destroy_process_group()


def measure_device(out_json: str, out_dir: str, iters: int, world: int = 4, reps: int = 20) -> dict:
    """The whole-simulator validation's device, measured once on this host with ``world`` busy
    processes (the recorded runs' contention): FLOP/s from ``world`` concurrent single-rank runs of
    the wide model (the simulator's FLOPs count over their op seconds), a link's bandwidth and
    latency from paired collectives, the optimizer's bytes per second from AdamW steps (the
    simulator's bytes per parameter, ``sim.OPTIMIZER_BYTES_PER_PARAM``, over the step's seconds)."""
    import tempfile
    import threading

    import numpy as np
    import torch.multiprocessing as mp

    from megatron_ext.resilience import validate
    from megatron_ext.resilience.sim import OPTIMIZER_BYTES_PER_PARAM
    from megatron_ext.runtime.distributed import free_port

    traces = [os.path.join(out_dir, f"megatron-w256-single-r{k}.trace.jsonl") for k in range(world)]
    for t in traces:
        if os.path.exists(t):
            os.remove(t)
    codes: list = [None] * world

    def one(k: int) -> None:
        res = launch_ranks(["pretrain_gpt.py", *MODEL, *WIDE, "--train-iters", str(iters), "--seed", str(7000 + k),
                            "--resihp", "--resihp-trace-out", traces[k]], 1, cwd=ROOT, timeout_s=900)
        codes[k] = res[0].returncode
        if res[0].returncode:
            print(res[0].output[-2000:], file=sys.stderr)

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(codes):
        raise SystemExit(f"the single-rank runs failed: exit codes {codes}")
    compute = validate.device_flops(traces)
    print(f"compute: {world} concurrent single-rank runs, {time.time() - t0:.0f} s: "
          f"{compute['flops'] / 1e9:.2f} GFLOP/s per rank", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "links.json")
        mp.spawn(_links_and_optimizer, args=(world, f"127.0.0.1:{free_port()}", reps, path), nprocs=world, join=True)
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    sizes = np.array(LINK_BYTES, dtype=float)
    med = np.array([np.median([r["link_s"][str(n)] for r in raw["ranks"]]) for n in LINK_BYTES])
    slope, intercept = np.polyfit(sizes, med, 1)
    # A ring of 2: t = bytes / bandwidth + 2 latency (sim.ring_s).
    bw, lat = 1.0 / slope, max(intercept / 2.0, 1e-6)
    step = float(np.median([r["optimizer_step_s"] for r in raw["ranks"]]))
    device = {"flops": compute["flops"], "link_bytes_per_s": float(bw), "link_latency_s": float(lat),
              "optimizer_bytes_per_s": OPTIMIZER_BYTES_PER_PARAM * OPTIMIZER_PARAMS / step,
              "measured": {"flops_per_run": compute["per_run"], "ranks": world,
                           "link_seconds_by_bytes": {str(n): float(t) for n, t in zip(LINK_BYTES, med)},
                           "optimizer_params": OPTIMIZER_PARAMS, "optimizer_step_s": step},
              "how": "python tools/collect_resihp_traces.py OUT --measure-device tests/resilience/data/cpu-device.json"}
    for n, t in zip(LINK_BYTES, med):
        print(f"link: {n / 1024:7.0f} KiB reduce-scatter + all-gather {1e3 * t:7.2f} ms "
              f"(fit {1e3 * (n / bw + 2 * lat):7.2f} ms)", flush=True)
    print(f"link: {bw / 1e9:.3f} GB/s, latency {1e6 * lat:.0f} us; optimizer: AdamW step over {OPTIMIZER_PARAMS} "
          f"parameters {1e3 * step:.1f} ms ({device['optimizer_bytes_per_s'] / 1e9:.2f} GB/s at {OPTIMIZER_BYTES_PER_PARAM:g} B/parameter)")
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(device, f, indent=1, sort_keys=True)
        f.write("\n")
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=2, help="runs of each scenario (default 2)")
    parser.add_argument("--iters", type=int, default=80, help="training iterations per run (default 80)")
    parser.add_argument("--only", nargs="*", default=[], help="scenarios whose name contains one of these")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the first run; run k adds k")
    parser.add_argument("--gzip", action="store_true", help="also write a compressed copy of each trace (1 us)")
    parser.add_argument("--measure-device", metavar="JSON", help="measure this host's device, link and optimizer "
                        "once (the whole-simulator validation's figures) into JSON, then stop")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.measure_device:
        measure_device(args.measure_device, args.out, args.iters)
        return 0
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
