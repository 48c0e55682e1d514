"""Benchmark Helix on model-parallel layers over an emulated interconnect (2 CPU ranks, gloo).

Cases (forward + backward of one layer, batch-first [b, s, h], fp32):
  tp    tensor-parallel transformer layer (TP=2): 2 all-reduces forward, 2 backward
  moe   expert-parallel MoE layer (EP=2): 2 all-to-alls forward, 2 backward
  tpep  TP attention + EP MoE: one dimension's communication can hide under the other's compute
each over the emulated intra-node and cross-node links (``megatron_ext.helix.cost.PRESETS``).

Variants, measured side by side (round-robin per step, same process, same weights):
  baseline  the graph as captured (aot_eager-style execution, no pass)
  inductor  Inductor's own overlap scheduler (fx_passes/overlap_scheduling) on the same graphs
  helix     tiling (K=2) + segmented round-robin + bucketing; the simulator may keep the baseline
Helix gets a memory budget of the baseline's measured peak + 5 %.

Figures: median step time, median exposed communication (time the compute thread spent in
waits: for the slower peer to reach the collective, then for the emulated link; "link ms" is the
link's share), peak memory (median of 3 profiled steps, allocator events). Simulator: "sim ms"/"sim exp"
are the simulated step and exposed communication of the graphs as compiled, with the compute
scale calibrated to the compute thread's busy time in the measured steps (step minus time in
waits, median, slowest rank): the operators' relative costs come from the micro-benchmarks, their
total from the steps themselves, so the error measures the schedule and communication model rather
than a shared host's load drifting since compile. "compile" is the prediction made at compile time,
when the decision was taken; "sim MiB" is the compile-time memory prediction. Simulator error =
|predicted - measured| / measured for the schedule Helix chose: "sim_makespan_err" with the rescaled
compute, "sim_makespan_err_predicted" for the makespan predicted at compile time (per-operator
micro-benchmarks and one timing of the computation taken while compiling; nothing from the
measured steps). "sim_makespan_err_compile" is the same figure under its old name. The real
collectives are measured once per case and every variant is priced with that fit. ALL TIMES ARE
EMULATED: collectives really run on gloo, but their waits complete at latency + bytes / bandwidth
of the emulated link.

GPU interference (``--interference SHARE``, default 0.18; 0 skips it): every case again with the
emulated link's ``compute_interference`` set, i.e. compute overlapping an in-flight collective
loses SHARE of its throughput, as SMs taken by NCCL kernels make it on a GPU (0.18: an NCCL
all-gather holding 24 of an H100's 132 SMs; see docs/helix.md). The emulation charges it at each
wait and the simulator models the same rule, so the decision and the predictions account for it.
"slow ms" is the measured (emulated) slowdown per step.

Prints a table, then one JSON line:
  {"cases": {"tp_xnode": {"exposed_comm_reduction": ..., "speedup": ..., "sim_makespan_err": ...,
   "sim_makespan_err_compile": ..., "sim_makespan_err_predicted": ..., "sim_peak_mem_err": ...,
   "peak_mem_bytes": {"baseline": ..., "helix": ...}}, ...},
   "gpu_interference": {"share": 0.18, "cases": {"tp_xnode": {...same keys...}, ...}}}
``--timeline PNG`` also draws the simulated before/after timeline of tp_xnode.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.helix.compiler import HelixBackend  # noqa: E402
from megatron_ext.helix.blocks import MoELayer, TPEPLayer, TPTransformerLayer, capacity_for  # noqa: E402
from megatron_ext.helix.collectives import GroupRef  # noqa: E402
from megatron_ext.helix.cost import PRESETS, DeviceSpec  # noqa: E402
from megatron_ext.helix.measure import all_ranks_agree, step_peak_bytes, timed_step, train_step  # noqa: E402

LINKS = {"intra": "intra_node", "xnode": "cross_node"}
VARIANTS = ("baseline", "inductor", "helix")


def build(case: str, args: argparse.Namespace, g: GroupRef) -> torch.nn.Module:
    h, s = args.hidden, args.seq
    if case == "tp":
        return TPTransformerLayer(h, args.heads, 4 * h, g)
    if case == "moe":
        return MoELayer(h, 4 * h, g, capacity_for(s, g.size))
    if case == "tpep":
        return TPEPLayer(h, args.heads, 4 * h, g, g, capacity_for(s, g.size))
    raise ValueError(f"unknown case {case!r}")


def effective_flops(model: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, reps: int = 5) -> float:
    """FLOP/s this layer actually runs at here and now (eager, real gloo collectives), agreed
    (min) over ranks. The emulated links are defined relative to it, so that the ratio of
    communication to computation is the preset's whatever the host's speed or load."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        train_step(model, x, gy, model.parameters())
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, x, gy, model.parameters())
        times.append(time.perf_counter() - t0)
    rate = torch.tensor(fc.get_total_flops() / statistics.median(times))
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def run_case(case: str, link: str, args: argparse.Namespace, g: GroupRef, interference: float = 0.0) -> dict:
    # Every case compiles the same layer class with three new backends; without a reset Dynamo's
    # per-function recompile limit (8) is reached after three runs of one layer.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build(case, args, g)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    gy = torch.randn(args.batch, args.seq, args.hidden)
    rate = effective_flops(model, x, gy)
    device = DeviceSpec(name="effective", peak_flops_per_s=rate, mem_bandwidth_Bps=1e10, op_overhead_s=0.0)
    wire = dataclasses.replace(PRESETS[LINKS[link]].resolve(device), compute_interference=interference)
    common = dict(tiles=args.tiles, interconnect=wire, cost_model=args.cost_model, cost_cache=args.cost_cache)
    backends, fns, models = {}, {}, {}
    for name in VARIANTS:
        models[name] = copy.deepcopy(model)
    backends["baseline"] = HelixBackend(mode="baseline", **common)
    backends["inductor"] = HelixBackend(mode="inductor_overlap", **common)
    fns["baseline"] = torch.compile(models["baseline"], backend=backends["baseline"])
    fns["inductor"] = torch.compile(models["inductor"], backend=backends["inductor"])

    def step(name):
        return lambda: train_step(fns[name], x, gy, models[name].parameters())

    for name in ("baseline", "inductor"):
        # The baseline compiles first and measures the real collectives; the others reuse its fit,
        # so that identical graphs are priced identically (gloo timings on a loaded host vary).
        backends[name].adopt_links(backends["baseline"])
        for _ in range(args.warmup):
            step(name)()
    agree = all_ranks_agree()
    base_peak = step_peak_bytes(fns["baseline"], x, gy, models["baseline"].parameters(), agree=agree)
    budget = int(base_peak * 1.05)
    backends["helix"] = HelixBackend(memory_budget_bytes=budget, **common)
    backends["helix"].adopt_links(backends["baseline"])
    fns["helix"] = torch.compile(models["helix"], backend=backends["helix"])
    for _ in range(args.warmup):
        step("helix")()
    samples = {name: [] for name in VARIANTS}
    for _ in range(args.steps):
        for name in VARIANTS:
            samples[name].append(timed_step(step(name), dist.barrier))
    # Peak memory of a profiled step whose allocator accounting closes (see step_peak_bytes).
    peaks = {name: step_peak_bytes(fns[name], x, gy, models[name].parameters(), agree=agree) for name in VARIANTS}
    out = {"budget": budget, "link": {"latency_s": wire.latency_s, "bandwidth_Bps": wire.bandwidth_Bps,
                                       "layer_flops_per_s": rate}}
    for name in VARIANTS:
        summ = backends[name].summaries
        if len(summ) != 1:
            raise RuntimeError(f"{case}/{link}/{name}: expected one compiled graph, got {len(summ)}")
        chosen = summ[0].chosen
        # Compute-thread busy time in the steps: median over steps, slowest rank. The emulated
        # interference is not compute the operators did: the simulator adds it on top again.
        busy = torch.tensor(statistics.median(s.step_s - s.exposed_comm_s - s.interference_s
                                              for s in samples[name]))
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        now = backends[name].simulate_compiled(0, float(busy))
        out[name] = {"step_s": [s.step_s for s in samples[name]],
                     "exposed_s": [s.exposed_comm_s for s in samples[name]],
                     "link_s": [s.link_s for s in samples[name]],
                     "slow_s": [s.interference_s for s in samples[name]],
                     "sim_slow_s": now.interference_s,
                     "peak": peaks[name], "sim_makespan_s": now.makespan_s, "sim_peak": chosen.peak_bytes,
                     "sim_compile_s": chosen.makespan_s, "sim_exposed_s": now.exposed_comm_s,
                     "tiled": summ[0].tiled, "decision": summ[0].line()}
        if name == "helix" and case == "tp" and link == "xnode":
            out["timeline"] = {"baseline": summ[0].baseline, "helix": summ[0].helix}
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if args.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # one core per rank, as one GPU per rank
    logging.basicConfig(level=logging.INFO if (rank == 0 and args.verbose) else logging.WARNING,
                        format="%(name)s: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = GroupRef.of()
    results: dict[str, dict] = {"plain": {}, "interference": {}}
    shares = {"plain": 0.0} | ({"interference": args.interference} if args.interference > 0 else {})
    for case in args.cases:
        for link in args.links:
            for block, share in shares.items():
                res = run_case(case, link, args, g, share)
                # A layer is as slow as its slowest rank: take the per-step max over ranks.
                gathered = [None] * world
                dist.all_gather_object(gathered, {k: v for k, v in res.items() if k not in ("timeline", "link")})
                for name in VARIANTS:
                    for key in ("step_s", "exposed_s", "link_s", "slow_s"):
                        res[name][key] = [max(r[name][key][i] for r in gathered) for i in range(args.steps)]
                    res[name]["peak"] = max(r[name]["peak"] for r in gathered)
                results[block][f"{case}_{link}"] = res
                if rank == 0:
                    print(f"  done {case}_{link} ({block})", file=sys.stderr, flush=True)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot_timeline(tl: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 5.0), sharex=True)
    colors = {None: "#999999", 0: "#1f77b4", 1: "#ff7f0e", 2: "#2ca02c", 3: "#d62728"}
    for ax, (title, sim) in zip(axes, (("before: captured graph", tl["baseline"]),
                                        ("after: Helix (K=2 tiles, segmented round-robin)", tl["helix"]))):
        rows = {"compute": 2, "wait": 1}
        for ev in sim.events:
            row = rows.get(ev.stream, 0)
            color = "#d62728" if ev.stream == "wait" else colors.get(ev.tile, "#7f7f7f")
            ax.barh(row, (ev.end_s - ev.start_s) * 1e3, left=ev.start_s * 1e3, height=0.7, color=color,
                    edgecolor="black" if ev.stream.startswith("comm") else "none", linewidth=0.3)
        for ev in sim.events:
            if ev.name == "<backward>":
                ax.axvline(ev.start_s * 1e3, color="black", linestyle="--", linewidth=0.8)
                ax.text(ev.start_s * 1e3, 2.45, " backward", fontsize=8, va="bottom")
        ax.set_yticks([0, 1, 2], ["link (collectives)", "compute blocked\nin wait", "compute"])
        ax.set_ylim(-0.5, 2.9)
        ax.set_title(f"{title}: step {sim.makespan_s * 1e3:.1f} ms, exposed communication "
                     f"{sim.exposed_comm_s * 1e3:.1f} ms", fontsize=10, loc="left")
    axes[-1].set_xlabel("simulated time (ms); TP=2 transformer layer forward+backward, emulated cross-node link")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=colors[None], label="untiled"), Patch(color=colors[0], label="tile 0"),
                        Patch(color=colors[1], label="tile 1"), Patch(color="#d62728", label="blocked in a wait")],
               loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(results: dict, args: argparse.Namespace, title: str) -> dict:
    """Print one table and return its JSON figures per case."""
    med = statistics.median
    print(f"\nHelix benchmark{title}: 2 CPU ranks (gloo), b={args.batch} s={args.seq} h={args.hidden}, "
          f"K={args.tiles}, {args.steps} steps, medians. EMULATED interconnect: every time below is emulated.")
    hdr = f"{'case':<11}{'variant':<10}{'step ms':>9}{'exposed ms':>11}{'link ms':>8}{'slow ms':>8}{'peak MiB':>10}" \
          f"{'sim ms':>8}{'sim exp':>8}{'sim slow':>9}{'sim MiB':>9}{'compile':>9}{'tiled':>7}"
    print(hdr)
    print("-" * len(hdr))
    out = {}
    for key, res in results.items():
        for name in VARIANTS:
            r = res[name]
            print(f"{key:<11}{name:<10}{med(r['step_s']) * 1e3:>9.2f}{med(r['exposed_s']) * 1e3:>11.2f}"
                  f"{med(r['link_s']) * 1e3:>8.2f}{med(r['slow_s']) * 1e3:>8.2f}"
                  f"{r['peak'] / 2**20:>10.2f}{r['sim_makespan_s'] * 1e3:>8.2f}{r['sim_exposed_s'] * 1e3:>8.2f}"
                  f"{r['sim_slow_s'] * 1e3:>9.2f}{r['sim_peak'] / 2**20:>9.2f}{r['sim_compile_s'] * 1e3:>9.2f}"
                  f"{'yes' if r['tiled'] else 'no':>7}")
        b, h = res["baseline"], res["helix"]
        exp_b, exp_h = med(b["exposed_s"]), med(h["exposed_s"])
        t_b, t_h = med(b["step_s"]), med(h["step_s"])
        predicted = round(abs(h["sim_compile_s"] - t_h) / t_h, 4)
        out[key] = {
            "exposed_comm_reduction": round(1 - exp_h / exp_b, 4) if exp_b > 0 else 0.0,
            "speedup": round(t_b / t_h, 4),
            "sim_makespan_err": round(abs(h["sim_makespan_s"] - t_h) / t_h, 4),
            # The compile-time prediction (what decided the schedule), before any rescaling to
            # the measured steps; "_compile" is its old name.
            "sim_makespan_err_compile": predicted,
            "sim_makespan_err_predicted": predicted,
            "sim_peak_mem_err": round(abs(h["sim_peak"] - h["peak"]) / h["peak"], 4),
            "peak_mem_bytes": {"baseline": int(b["peak"]), "helix": int(h["peak"])},
        }
        i = res["inductor"]
        print(f"{'':<11}-> exposed comm -{out[key]['exposed_comm_reduction']:.1%}, speedup {out[key]['speedup']:.3f}x "
              f"(inductor {t_b / med(i['step_s']):.3f}x), sim err makespan {out[key]['sim_makespan_err']:.1%} "
              f"(predicted at compile time {predicted:.1%}) "
              f"peak {out[key]['sim_peak_mem_err']:.1%}, budget {res['budget'] / 2**20:.2f} MiB; link "
              f"{res['link']['bandwidth_Bps'] / 1e6:.0f} MB/s + {res['link']['latency_s'] * 1e6:.0f} us "
              f"(layer runs at {res['link']['layer_flops_per_s'] / 1e9:.1f} GFLOP/s)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["tp", "moe", "tpep"], choices=["tp", "moe", "tpep"])
    p.add_argument("--links", nargs="+", default=["xnode", "intra"], choices=list(LINKS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cost-model", default="calibrated", choices=["calibrated", "analytical"])
    p.add_argument("--cost-cache", default=None, help="micro-benchmark cache file (default: user cache dir)")
    p.add_argument("--interference", type=float, default=0.18,
                   help="share of compute throughput lost while a collective is in flight, for the "
                        "gpu_interference block (default 0.18; 0 skips it)")
    p.add_argument("--timeline", default=None, help="write the simulated tp_xnode before/after timeline PNG here")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin each rank to its own core")
    p.add_argument("--verbose", action="store_true", help="log each graph's Helix summary (rank 0)")
    args = p.parse_args(argv)
    if args.timeline and ("tp" not in args.cases or "xnode" not in args.links):
        p.error("--timeline needs the tp case and the xnode link")
    if not 0.0 <= args.interference < 1.0:
        p.error(f"--interference is a share of compute throughput in [0, 1), got {args.interference}")

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.spawn(worker, args=(2, _free_port(), args, queue), nprocs=2, join=False)
    # Read before joining: rank 0 blocks in put() until the pipe is drained, and the results
    # (two blocks, simulated timelines) are larger than its buffer.
    results = None
    while results is None:
        if not queue.empty():
            results = queue.get()
        elif procs.join(timeout=1):  # every rank exited (a failed one raises here)
            if queue.empty():
                raise RuntimeError("bench_helix: the ranks exited without results")
            results = queue.get()
    while not procs.join():
        pass

    plain = summarise(results["plain"], args, "")
    out: dict = {"cases": plain}
    if results["interference"]:
        out["gpu_interference"] = {"share": args.interference,
                                   "cases": summarise(results["interference"], args,
                                                      f" WITH GPU INTERFERENCE {args.interference:.0%}")}
    if args.timeline:
        tl = results["plain"]["tp_xnode"]["timeline"]
        plot_timeline(tl, args.timeline)
        print(f"timeline written to {args.timeline}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
