"""What tiling costs on CPU ranks, apart from what it hides: why Helix's tiled schedule loses within a
node in ``tools/bench_helix.py`` (issue #48 item 2).

Tiling a layer into K tiles along the batch hides a collective behind the other tile's compute, and
pays three things a cost model has to know: (a) each collective's fixed cost, K times as many of
them; (b) the efficiency of the smaller kernels; (c) on CPU ranks, the collective's own CPU work,
which runs on the cores the compute needs (gloo reduces and copies on the host; on a GPU, NCCL's
kernels take SMs instead, the bench's ``--interference``). Measured on 2 gloo ranks of this host,
with the bench's default layer shape (batch 8 x sequence 64 tokens, hidden 256, fp32):

* (a) an all-reduce of the layer's activations (tokens x hidden) whole and in K pieces, on
  loopback: the fixed cost per collective from the two;
* (b) the layer's largest matmul (tokens x hidden by hidden x 4 hidden), whole and as K row tiles;
* (c) that matmul's time alone, and while an all-reduce of the same activations is in flight on the
  same rank (issued before, waited after): how much of the compute's throughput the collective's
  CPU work takes (the CPU's ``compute_interference``). Its A/A arm is the matmul alone again.

Arms run interleaved in rotated order, ``--rounds`` rounds of ``--reps`` calls each; the figures are
medians over rounds on rank 0. Prints a table, then one JSON line:
  {"allreduce_whole_us", "allreduce_tiled_us", "fixed_us_per_collective", "matmul_whole_us",
   "matmul_tiled_us", "tile_efficiency", "matmul_with_collective_us", "cpu_interference",
   "aa_ratio", ...}
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import Report  # noqa: E402


def _rank(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    tokens, h, k = args.batch * args.seq, args.hidden, args.tiles
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, h, generator=g)
    w = torch.randn(h, 4 * h, generator=g)
    act = torch.randn(tokens, h, generator=g)
    pieces = list(act.chunk(k))
    rows = list(x.chunk(k))

    def allreduce_whole():
        dist.all_reduce(act)

    def allreduce_tiled():
        for p in pieces:
            dist.all_reduce(p)

    def matmul_whole():
        torch.mm(x, w)

    def matmul_tiled():
        for r in rows:
            torch.mm(r, w)

    def matmul_with_collective():
        work = dist.all_reduce(act, async_op=True)
        torch.mm(x, w)
        t = time.perf_counter()
        work.wait()
        return time.perf_counter() - t           # time left waiting: not the compute's

    arms = {"allreduce_whole": allreduce_whole, "allreduce_tiled": allreduce_tiled, "matmul_whole": matmul_whole,
            "matmul_tiled": matmul_tiled, "matmul_with_collective": matmul_with_collective,
            "matmul_whole_again": matmul_whole}
    names = list(arms)
    for fn in arms.values():                      # warm-up
        for _ in range(3):
            fn()
    per: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in order:
            dist.barrier()
            spent = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                waited = arms[n]()
                spent.append(time.perf_counter() - t0 - (waited or 0.0))
            per[n].append(statistics.median(spent))
    return {n: statistics.median(v) for n, v in per.items()} if rank == 0 else None


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        out = _rank(args)
        if out is not None:
            import json

            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import json
    import subprocess
    import tempfile

    report = Report("bench_helix_cpu_costs")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), os.path.abspath(__file__), "--worker", "--out", out,
               "--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
               "--tiles", str(args.tiles), "--rounds", str(args.rounds), "--reps", str(args.reps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as f:
            m = json.load(f)
    us = {n: 1e6 * v for n, v in m.items()}
    k = args.tiles
    fixed = (us["allreduce_tiled"] - us["allreduce_whole"]) / (k - 1)
    fig = {
        "tokens": args.batch * args.seq, "hidden": args.hidden, "tiles": k, "rounds": args.rounds, "reps": args.reps,
        "allreduce_whole_us": round(us["allreduce_whole"], 1), "allreduce_tiled_us": round(us["allreduce_tiled"], 1),
        "fixed_us_per_collective": round(fixed, 1),
        "matmul_whole_us": round(us["matmul_whole"], 1), "matmul_tiled_us": round(us["matmul_tiled"], 1),
        "tile_efficiency": round(us["matmul_whole"] / us["matmul_tiled"], 4),
        "matmul_with_collective_us": round(us["matmul_with_collective"], 1),
        "cpu_interference": round(1 - us["matmul_whole"] / us["matmul_with_collective"], 4),
        "aa_ratio": round(us["matmul_whole"] / us["matmul_whole_again"], 4),
    }
    print(f"bench_helix_cpu_costs: 2 gloo ranks, {fig['tokens']} tokens x hidden {args.hidden} fp32, K={k}; "
          f"medians over {args.rounds} rotated rounds of {args.reps} calls (rank 0)")
    print(f"{'what':<52}{'us':>10}")
    for label, key in (("all-reduce of the activations, whole", "allreduce_whole"),
                       (f"... as {k} pieces (all of them)", "allreduce_tiled"),
                       ("matmul tokens x h by h x 4h, whole", "matmul_whole"),
                       (f"... as {k} row tiles (all of them)", "matmul_tiled"),
                       ("... whole, an all-reduce in flight (compute only)", "matmul_with_collective"),
                       ("... whole again (A/A)", "matmul_whole_again")):
        print(f"{label:<52}{us[key]:>10.1f}")
    print(f"fixed cost per collective {fig['fixed_us_per_collective']:.1f} us; {k} tiles run the matmul at "
          f"{fig['tile_efficiency']:.3f} of the whole one's throughput; an all-reduce in flight takes "
          f"{100 * fig['cpu_interference']:.1f} % of the compute's throughput (A/A {fig['aa_ratio']:.3f})")
    report.emit(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
