"""Where a tiled graph's extra compute-thread time goes (issue #48 item 2): the untiled and the tiled
(K tiles, forced) graph of one bench_helix case, side by side under torch's profiler.

bench_helix found the tiled intra-node graphs' busy time (step minus time in waits) 40 % above the
untiled graphs' on these CPU ranks. This tool splits one step's busy time of each graph by what the
step's thread did, from the profiler's self times of the operators it ran:

  matmul        mm, addmm, bmm, baddbmm and the fused attention kernels: the arithmetic itself, so
                its growth is per-tile efficiency plus the host's interference (gloo's threads
                reducing and copying on the same cores while the overlapped compute runs)
  copies        data movement and allocation: cat, copy_, clone, stack, contiguous, fills, empties
                (the tiles' split-and-join costs, and the layout copies every graph has)
  views         metadata only: view, reshape, slice, split, transpose, expand, ...
  issue         starting a collective on gloo (c10d and _c10d_functional calls, not their wait)
  elementwise   every other ATen operator (norms, activations, softmax, adds, the optimizer-free
                backward's elementwise work)
  between ops   the rest of the busy time: the graphs' Python code and the autograd engine around
                the operators, and the profiler's own cost per operator

The busy time itself is measured twice: in profiled steps (what the split adds up to; the profiler
adds its own cost to every call) and in plain timed steps of the same graphs (rounds in rotated order
with an A/A arm, as bench_helix steps them), which also record each thread's time on a CPU (Linux
schedstat): the step's thread, and the process's other threads -- gloo's workers, which on a rank
pinned to one core run on the core the step needs. Beside them, "compute alone": the two graphs'
computation timed as the compiler's calibration times it (collectives made local copies, waits
removed, no autograd), which is what the cost model's per-operator times are scaled to; the same
with the backward fed what the forward just returned ("chained"), and that with denormal floats
flushed to zero (the compiler's made-up inputs are standard normal: a chained forward's activations
are not a trained layer's, and can reach denormal arithmetic in the backward), and the graphs run
the same way but with their real collectives, less the time in the collectives' starts and waits
("live": what running beside gloo does to the computation; the step's busy time beyond it is the
machinery outside the graphs: Dynamo's guards, the compiled function's wrappers, the autograd
engine, gradient accumulation). Last, one
all-reduce of the layer's activations alone: its wall time and the CPU time gloo's threads spend on it.

Everything runs on 2 gloo ranks pinned one per core, the case's layer shape and emulated link as
bench_helix sets them (no emulated GPU interference). Rank 0's split is printed (the cases are symmetric over ranks);
the JSON line gives every rank's.

Prints a table per case, then one JSON line:
  {"bench": "bench_helix_profile", "cases": {"tp_intra": [{"untiled": {"step_ms": ..., "busy_ms": ..., "exposed_ms": ...,
   "thread_cpu_ms": ..., "other_threads_cpu_ms": ..., "compute_alone_ms": ..., "compute_chained_ms": ...,
   "compute_chained_flushed_ms": ..., "compute_live_ms": ..., "profiled_busy_ms": ...,
   "categories_ms": {...}, "calls": {...}, "graph_nodes": ...}, "tiled": {...}, "untiled (A/A)": {...},
   "isolated_all_reduce": {"bytes", "wall_ms", "thread_cpu_ms", "other_threads_cpu_ms"}}, ...one per rank]}}
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report, aa_name, rotated_order  # noqa: E402
from megatron_ext.helix.calibrate import (_materialize, compute_only_copy, time_call, time_graphs_live,  # noqa: E402
                                         time_graphs)
from megatron_ext.helix.collectives import GroupRef  # noqa: E402
from megatron_ext.helix.compiler import HelixBackend  # noqa: E402
from megatron_ext.helix.ir import value_of  # noqa: E402
from megatron_ext.helix.measure import timed_step, train_step  # noqa: E402
from tools import bench_helix as bh  # noqa: E402

ARMS = ("untiled", "tiled")
AA = aa_name("untiled")
CATEGORIES = ("matmul", "copies", "views", "issue", "elementwise", "between ops")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
COPIES = {"aten::cat", "aten::copy_", "aten::clone", "aten::stack", "aten::contiguous", "aten::_to_copy",
          "aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like", "aten::empty", "aten::empty_like",
          "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::new_zeros", "aten::full",
          "aten::ones_like", "aten::resize_", "aten::index_put_", "aten::scatter_add_"}
VIEWS = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::slice", "aten::narrow", "aten::split",
         "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::select", "aten::transpose", "aten::t",
         "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::alias",
         "aten::detach", "aten::view_as", "aten::_reshape_alias", "aten::lift_fresh", "aten::numpy_T"}
WAIT = "_c10d_functional::wait_tensor"


def category(name: str) -> str | None:
    """The category of an operator event by its name (None: not an operator, e.g. the autograd
    engine's or the compiled function's wrapper events, whose self time is 'between ops')."""
    if name == WAIT:
        return "wait"
    if name in MATMUL:
        return "matmul"
    if name in COPIES:
        return "copies"
    if name in VIEWS:
        return "views"
    if "c10d" in name or name.startswith("gloo:"):
        return "issue"
    if name.startswith("aten::"):
        return "elementwise"
    return None


def split_step(events, thread: int, busy_s: float) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds of ``busy_s`` per category, and operator calls per category, from the profiler's
    events of one step on ``thread``; 'between ops' is the busy time no operator's self time covers."""
    secs = {c: 0.0 for c in CATEGORIES}
    calls = {c: 0 for c in CATEGORIES}
    for e in events:
        if e.thread != thread:
            continue
        c = category(e.name)
        if c is None or c == "wait":
            continue
        secs[c] += e.self_cpu_time_total / 1e6
        calls[c] += 1
    secs["between ops"] = busy_s - sum(v for k, v in secs.items() if k != "between ops")
    return secs, calls


def thread_cpu_ns() -> dict[int, int]:
    """Each of this process's threads' time on a CPU so far (ns; Linux schedstat), by thread id."""
    out = {}
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out


def with_cpu(fn):
    """``(fn(), this thread's CPU s, the process's other threads' CPU s)`` over the call."""
    me = threading.get_native_id()
    before = thread_cpu_ns()
    result = fn()
    after = thread_cpu_ns()
    mine = (after.get(me, 0) - before.get(me, 0)) / 1e9
    return result, mine, sum(v - before.get(t, 0) for t, v in after.items() if t != me) / 1e9


def cpu_step(step) -> tuple[float, float, float, float, float, int]:
    """One plain timed step: (step s, busy s, exposed s, the step thread's CPU s, the other threads'
    CPU s -- gloo's workers reducing and copying --, collectives). With a rank pinned to one core,
    the other threads' CPU time is taken from the step's thread whenever it is not waiting."""
    s, mine, others = with_cpu(lambda: timed_step(step, dist.barrier))
    return s.step_s, s.step_s - s.exposed_comm_s, s.exposed_comm_s, mine, others, s.collectives


def profiled_step(step) -> tuple[float, float, dict[str, float], dict[str, int]]:
    """One step under the profiler: (step s, busy s, seconds and calls per category)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("bench_helix_profile_step"):
            sample = timed_step(step, dist.barrier)
    events = prof.events()
    (mark,) = [e for e in events if e.name == "bench_helix_profile_step"]
    busy = sample.step_s - sample.exposed_comm_s
    secs, calls = split_step(events, mark.thread, busy)
    return sample.step_s, busy, secs, calls


def run_case(case: str, link: str, args: argparse.Namespace, g: GroupRef, ctx) -> tuple[dict, object]:
    c = bh.setup_case(case, args, g, ctx)
    ctx, make, x, gy = c.ctx, c.make, c.x, c.gy
    wire = bh.emulated_link(bh.effective_flops(make(), x, gy), link)
    common = dict(tiles=args.tiles, interconnect=wire, cost_model=args.cost_model, cost_cache=args.cost_cache,
                  batch_size=c.batch_size)
    backends = {"untiled": HelixBackend(mode="baseline", **common), "tiled": HelixBackend(mode="helix", **common)}
    models = {a: make() for a in ARMS}
    fns = {a: torch.compile(models[a], backend=backends[a]) for a in ARMS}

    def step(arm: str):
        return lambda: train_step(fns[arm], x, gy, models[arm].parameters())

    for arm in ARMS:
        if arm != "untiled":
            backends[arm].adopt_links(backends["untiled"])
        for _ in range(args.warmup):
            step(arm)()
    if not backends["tiled"].summaries[-1].tiled:
        raise RuntimeError(f"bench_helix_profile: {case}_{link}: the forced tiling was refused: "
                           f"{backends['tiled'].summaries[-1].line()}")
    timed = {a: [] for a in (*ARMS, AA)}
    for r in range(args.rounds):
        for arm in rotated_order([*ARMS, AA], r):
            timed[arm].append(cpu_step(step("untiled" if arm == AA else arm)))
    # The graphs' computation alone (collectives made local copies, no autograd, no_grad), timed as
    # the compiler's calibration times it: what the cost model's per-operator times are scaled to.
    alone = {a: time_graphs(list(backends[a].summaries[-1].graphs.values()), "cpu", reps=15) for a in ARMS}
    chained = {a: chained_s(backends[a].summaries[-1].graphs, flush=False) for a in ARMS}
    flushed = {a: chained_s(backends[a].summaries[-1].graphs, flush=True) for a in ARMS}
    live = {a: live_s(backends[a].summaries[-1].graphs) for a in ARMS}
    prof = {a: [] for a in ARMS}
    for r in range(args.profiled):
        for arm in rotated_order(list(ARMS), r):
            prof[arm].append(profiled_step(step(arm)))
    out = {}
    for arm in ARMS:
        rows = prof[arm]
        cats = {c: statistics.median(p[2][c] for p in rows) * 1e3 for c in CATEGORIES}
        calls = {c: int(statistics.median(p[3][c] for p in rows)) for c in CATEGORIES}
        summ = backends[arm].summaries[-1]
        out[arm] = {"step_ms": statistics.median(t[0] for t in timed[arm]) * 1e3,
                    "busy_ms": statistics.median(t[1] for t in timed[arm]) * 1e3,
                    "exposed_ms": statistics.median(t[2] for t in timed[arm]) * 1e3,
                    "thread_cpu_ms": statistics.median(t[3] for t in timed[arm]) * 1e3,
                    "other_threads_cpu_ms": statistics.median(t[4] for t in timed[arm]) * 1e3,
                    "collectives": int(statistics.median(t[5] for t in timed[arm])),
                    "profiled_busy_ms": statistics.median(p[1] for p in rows) * 1e3,
                    "compute_alone_ms": alone[arm] * 1e3,
                    "compute_chained_ms": chained[arm] * 1e3, "compute_chained_flushed_ms": flushed[arm] * 1e3,
                    "compute_live_ms": live[arm] * 1e3,
                    "categories_ms": cats, "calls": calls,
                    "graph_nodes": sum(len(gm.graph.nodes) for gm in summ.graphs.values())}
    out[AA] = {"busy_ms": statistics.median(t[1] for t in timed[AA]) * 1e3}
    out["isolated_all_reduce"] = isolated_all_reduce(x.numel() * x.element_size())
    return out, ctx


def chained_s(graphs: dict, flush: bool, reps: int = 15) -> float:
    """The forward and backward computation as the compiler times it, except that the backward's
    saved inputs are what the forward just returned (matched by name: AOT's partitioner names them
    after the forward's outputs); with ``flush``, denormal floats are flushed to zero meanwhile.
    The forward's inputs are made up (standard normal floats) as the compiler makes them, so its
    activations are not a trained layer's: the flushed timing shows what of the difference is
    denormal arithmetic."""
    fw, bw = compute_only_copy(graphs["fw"]), compute_only_copy(graphs["bw"])
    fw_in = [_materialize(value_of(n), torch.device("cpu")) for n in fw.graph.nodes if n.op == "placeholder"]
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    out_names = [a.name if isinstance(a, torch.fx.Node) else None for a in out]
    bw_ph = [n for n in bw.graph.nodes if n.op == "placeholder"]
    bw_made = {n.name: _materialize(value_of(n), torch.device("cpu")) for n in bw_ph}

    def once() -> None:
        with torch.no_grad():
            got = dict(zip(out_names, fw(*fw_in)))
            bw(*[got.get(n.name, bw_made[n.name]) for n in bw_ph])

    torch.set_flush_denormal(flush)
    try:
        once()
        return time_call(once, torch.device("cpu"), reps=reps, min_total_s=0.0)
    finally:
        torch.set_flush_denormal(False)   # torch's default; this tool sets it nowhere else


def live_s(graphs: dict, reps: int = 15) -> float:
    """The forward and backward graphs run as the compiler's timing runs them (made-up inputs, no
    autograd) but with their real collectives, every rank in step (a barrier before each run): the
    median over ``reps`` of the time outside the collectives' starts and waits
    (calibrate.time_graphs_live). What it adds to "compute alone" is what running beside real
    collectives does to the computation (gloo's threads on the core, its caches); what the step's
    busy time adds beyond it is the step's machinery outside the graphs (Dynamo's guards, the
    compiled function's wrappers, the autograd engine, gradient accumulation)."""
    return time_graphs_live([graphs["fw"], graphs["bw"]], "cpu", reps=reps, sync=dist.barrier)


def isolated_all_reduce(nbytes: int, reps: int = 15) -> dict:
    """One all-reduce of ``nbytes`` (the layer's activations) alone, the ranks lined up first: its
    wall time, and the CPU time the rank's threads spent on it (medians)."""
    ops = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    buf, sync = torch.randn(nbytes // 4), torch.zeros(1)

    def once() -> float:
        t0 = time.perf_counter()
        ops.wait_tensor(ops.all_reduce(buf, "sum", group))
        return time.perf_counter() - t0

    for _ in range(3):
        once()
    wall, mine, others = [], [], []
    for _ in range(reps):
        ops.wait_tensor(ops.all_reduce(sync, "sum", group))
        w, m, o = with_cpu(once)
        wall.append(w)
        mine.append(m)
        others.append(o)
    return {"bytes": nbytes, "wall_ms": statistics.median(wall) * 1e3, "thread_cpu_ms": statistics.median(mine) * 1e3,
            "other_threads_cpu_ms": statistics.median(others) * 1e3}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    with bh.rank_session(rank, world, port, args.cases) as state:
        results = {}
        for case in args.cases:
            res, state["ctx"] = run_case(case, args.link, args, state["group"], state["ctx"])
            gathered = [None] * world
            dist.all_gather_object(gathered, res)
            results[f"{case}_{args.link}"] = gathered
            if rank == 0:
                print(f"  done {case}_{args.link}", file=sys.stderr, flush=True)
        if rank == 0:
            queue.put(results)


def table(name: str, ranks: list[dict]) -> str:
    r0 = ranks[0]
    u, t = r0["untiled"], r0["tiled"]
    lines = [f"{name}: rank 0, ms per step (profiled steps' medians; calls = operator calls)",
             f"  {'':<14}{'untiled':>10}{'tiled':>10}{'change':>10}{'calls':>8}{'tiled':>8}"]
    for c in CATEGORIES:
        a, b = u["categories_ms"][c], t["categories_ms"][c]
        lines.append(f"  {c:<14}{a:>10.2f}{b:>10.2f}{b - a:>+10.2f}{u['calls'][c]:>8}{t['calls'][c]:>8}")
    lines.append(f"  {'busy profiled':<14}{u['profiled_busy_ms']:>10.2f}{t['profiled_busy_ms']:>10.2f}"
                 f"{t['profiled_busy_ms'] - u['profiled_busy_ms']:>+10.2f}")
    lines.append(f"  {'compute alone':<14}{u['compute_alone_ms']:>10.2f}{t['compute_alone_ms']:>10.2f}"
                 f"{t['compute_alone_ms'] - u['compute_alone_ms']:>+10.2f}   (no collectives, no autograd)")
    for key, label, what in (("compute_chained_ms", "... chained", "the backward on the forward's outputs"),
                             ("compute_chained_flushed_ms", "... flushed", "the same, denormals flushed"),
                             ("compute_live_ms", "... live", "real collectives, less their starts and waits")):
        lines.append(f"  {label:<14}{u[key]:>10.2f}{t[key]:>10.2f}{t[key] - u[key]:>+10.2f}   ({what})")
    lines.append(f"  {'busy plain':<14}{u['busy_ms']:>10.2f}{t['busy_ms']:>10.2f}{t['busy_ms'] - u['busy_ms']:>+10.2f}"
                 f"   (A/A {r0[AA]['busy_ms']:.2f})")
    lines.append(f"  {'exposed comm':<14}{u['exposed_ms']:>10.2f}{t['exposed_ms']:>10.2f}"
                 f"{t['exposed_ms'] - u['exposed_ms']:>+10.2f}")
    lines.append(f"  {'thread CPU':<14}{u['thread_cpu_ms']:>10.2f}{t['thread_cpu_ms']:>10.2f}"
                 f"{t['thread_cpu_ms'] - u['thread_cpu_ms']:>+10.2f}   (the step's thread on a core)")
    lines.append(f"  {'gloo CPU':<14}{u['other_threads_cpu_ms']:>10.2f}{t['other_threads_cpu_ms']:>10.2f}"
                 f"{t['other_threads_cpu_ms'] - u['other_threads_cpu_ms']:>+10.2f}   (the other threads, same core)")
    lines.append(f"  {'step plain':<14}{u['step_ms']:>10.2f}{t['step_ms']:>10.2f}{t['step_ms'] - u['step_ms']:>+10.2f}")
    calls = [sum(a["calls"].values()) for a in (u, t)]
    lines.append(f"  collectives per step {u['collectives']} -> {t['collectives']}; operator calls {calls[0]} -> "
                 f"{calls[1]}; graph nodes (fw + bw) {u['graph_nodes']} -> {t['graph_nodes']}")
    iso = r0["isolated_all_reduce"]
    lines.append(f"  one all-reduce of the activations ({iso['bytes'] // 1024} KiB) alone: {iso['wall_ms']:.3f} ms, "
                 f"the step's thread {iso['thread_cpu_ms']:.3f} ms and gloo's threads {iso['other_threads_cpu_ms']:.3f} "
                 f"ms on a core")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["tp", "llama_tp"], choices=["tp", "moe", "tpep", "llama_tp", "moe_ep"],
                   help="bench_helix's 2-rank cases")
    p.add_argument("--link", default="intra", choices=list(bh.LINKS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20, help="plain timed rounds (rotated, with an A/A arm)")
    p.add_argument("--profiled", type=int, default=10, help="profiled steps per arm (rotated)")
    p.add_argument("--cost-model", default="calibrated", choices=["calibrated", "analytical"])
    p.add_argument("--cost-cache", default=None)
    args = p.parse_args(argv)
    report = Report("bench_helix_profile")
    t0 = time.monotonic()
    results = bh._spawn_ranks(worker, 2, (args,), "the profiled ranks")
    text = "\n".join(table(name, ranks) for name, ranks in results.items())
    report.emit({"cases": results, "args": vars(args), "wall_s": round(time.monotonic() - t0, 1)}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
