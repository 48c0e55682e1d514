"""Benchmark Helix on model-parallel layers over an emulated interconnect (2 or 4 CPU ranks, gloo).

Cases (forward + backward of one layer, batch-first [b, s, h], fp32):
  tp    tensor-parallel transformer layer (TP=2): 2 all-reduces forward, 2 backward
  moe   expert-parallel MoE layer (EP=2): 2 all-to-alls forward, 2 backward
  tpep  TP attention + EP MoE: one dimension's communication can hide under the other's compute
and three built from the runtime's own models (``runtime.model.build_model``: megatron-core's local
layer spec and MoELayer, made traceable by ``helix.adapter`` as ``--helix`` does; one decoder layer
and the final norm, on megatron's sequence-first [s, b, h] hidden states, rotary embeddings included):
  llama_tp  LLaMA-style layer (RMSNorm, rotary, GQA heads/2 groups, SwiGLU, no biases), TP=2, 2 ranks
  moe_ep    Qwen3-MoE-style layer (the LLaMA-style attention + q/k norm, 4 experts top-2, aux loss),
            EP=2 with the all-to-all dispatcher, 2 ranks
  moe_tpep  the same, TP=2 (sequence parallel) x EP=2 with the all-gather dispatcher (what gloo can
            run), 4 ranks -- two per core on a 2-core host
each over the emulated intra-node and cross-node links (``megatron_ext.helix.cost.PRESETS``). The
MoE cases compile Helix's static-shape dispatch (every token to every expert rank: E/k = 2x the
expert FLOPs of megatron's drop-free dispatcher, see docs/helix.md); the summary line also gives
megatron's own eager step for comparison ("megatron eager").

Variants, measured side by side (rounds of one step per variant in an order rotated by the round,
so each is first equally often; an A/A arm -- the baseline stepped a second time in each round --
as the noise floor; same process, same weights; 30 rounds by default):
  baseline  the graph as captured (aot_eager-style execution, no pass)
  inductor  Inductor's own overlap scheduler (fx_passes/overlap_scheduling) on the same graphs
  helix     tiling (K=2) + segmented round-robin + bucketing; the simulator may keep the baseline
  measured  the graph the job's measured selection keeps (--helix-select-rounds, helix/selection.py):
            untiled, helix or inductor -- each stepped once, the simulator's ranking, then
            --select-rounds rounds of those it times, before the measured rounds; its cost is
            reported (the selection's steps, and their time beyond as many untiled steps)
Helix gets a memory budget of the baseline's measured peak + 5 % (its predicted peak when none
was measured).

Figures: speedups as the median of the paired per-round ratios (baseline / variant) with a 90 %
bootstrap interval, beside the A/A ratio and its interval (``megatron_ext/bench/harness.py``);
median step time, median exposed communication (time the compute thread spent in waits: for the
slower peer to reach the collective, then for the emulated link; "link ms" is the link's share),
peak memory (a profiled step whose allocator accounting closes, ``measure.step_peak_bytes``; "n/a" /
null when none closed in --peak-attempts tries, default 100). Simulator: "sim ms"/"sim exp" are the
simulated step and exposed communication of the graphs as compiled, with the compute scale
calibrated to the compute thread's busy time in the measured steps (step minus time in waits,
median, slowest rank): the operators' relative costs come from the micro-benchmarks, their total
from the steps themselves, so the error measures the schedule and communication model rather than a
shared host's load drifting since compile. "compile" is the prediction made at compile time
(``GraphSummary.prediction``: the graphs that run, their compute scale fitted to a whole timing of
those graphs while compiling); "sim MiB" is the compile-time memory prediction. Simulator error =
|predicted - measured| / measured for the schedule Helix chose: "sim_makespan_err" with the rescaled
compute, "sim_makespan_err_predicted" for the makespan predicted at compile time (per-operator
micro-benchmarks and whole timings of the computation taken while compiling, beside the real
collectives; nothing from the measured steps). "sim_makespan_err_compile" is the same figure under
its old name. "sim_compile_miss_ms" splits each arm's compile-time miss by term (predicted minus
measured, ms): "busy", the compute thread's time outside waits, and "exposed", its time in waits;
the summary line gives Helix's. The real collectives are measured per case (at the payloads its
graphs carry) and every variant is priced with those measurements. ALL TIMES ARE EMULATED:
collectives really run on gloo, but their waits complete at latency + bytes / bandwidth of the
emulated link.

GPU interference (``--interference SHARE``, default 0.18; 0 skips it): every case again with the
emulated link's ``compute_interference`` set, i.e. compute overlapping an in-flight collective
loses SHARE of its throughput, as SMs taken by NCCL kernels make it on a GPU (0.18: an NCCL
all-gather holding 24 of an H100's 132 SMs; see docs/helix.md). The emulation charges it at each
wait and the simulator models the same rule, so the decision and the predictions account for it.
"slow ms" is the measured (emulated) slowdown per step.

Prints a table, then one JSON line:
  {"cases": {"tp_xnode": {"exposed_comm_reduction": ..., "speedup": ..., "sim_makespan_err": ...,
   "sim_makespan_err_compile": ..., "sim_makespan_err_predicted": ...,
   "sim_compile_miss_ms": {"baseline": {"busy": ..., "exposed": ...}, ...}, "sim_peak_mem_err": ...,
   "peak_mem_bytes": {"baseline": ..., "helix": ...}}, ...},
   "gpu_interference": {"share": 0.18, "cases": {"tp_xnode": {...same keys...}, ...}}}
``--timeline PNG`` also draws the simulated before/after timeline of tp_xnode.

Long-context activation memory (``--long-seqs``, default 4096 8192 16384 32768; none skips it; run
first, on 2 ranks): a small GPT of megatron-core (2 layers, hidden 64, 2 heads, rotary, TP=2) in
forward-only mode, one sequence per call, compiled untiled and with sequence tiles (each
``--long-tiles`` K, forced: query tiles against every key, the causal mask made per tile, one tile
at a time). Per arm: the peak allocation of one forward on the fullest rank (profiler allocator
events, ``measure.forward_peak_bytes``; megatron's own [b*np, s, s] score buffer is allocated
before and held in every arm, so it is not in the peak), the simulator's compile-time prediction,
the largest difference of the outputs from the untiled graph's, and the forward time over
``--long-rounds`` rounds in rotated order with an A/A arm. An arm whose predicted peak would not fit
in 80 % of the host's available memory on every rank at once is predicted and not run (the table
says so). JSON: ``"long_context": {"16384": {"seq-k2": {"peak_bytes", "predicted_peak_bytes",
"peak_cut", "sim_peak_err", "max_abs_diff", "speedup", ...}}}``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.config.defaults import FORMER_DEFAULTS  # noqa: E402
from megatron_ext.helix.compiler import HelixBackend  # noqa: E402
from megatron_ext.helix.blocks import MoELayer, TPEPLayer, TPTransformerLayer, capacity_for  # noqa: E402
from megatron_ext.helix.collectives import GroupRef  # noqa: E402
from megatron_ext.bench.harness import Report, aa_name, ratio_interval, rotated_order  # noqa: E402
from megatron_ext.helix.cost import PRESETS, DeviceSpec  # noqa: E402
from megatron_ext.helix.config import DEFAULT_SELECT_ROUNDS  # noqa: E402
from megatron_ext.helix.selection import MeasuredSelection, rank  # noqa: E402
from megatron_ext.helix.measure import (UnclosedAccounting, all_ranks_agree, step_peak_bytes, timed_step,  # noqa: E402
                                        train_step)
from megatron_ext.runtime.distributed import free_port  # noqa: E402

LINKS = {"intra": "intra_node", "xnode": "cross_node"}
VARIANTS = ("baseline", "inductor", "helix")
AA = aa_name("baseline")   # the baseline stepped twice per round: the noise floor
MEASURED = "measured"      # the graph the measured selection kept (helix/selection.py)


def build(case: str, args: argparse.Namespace, g: GroupRef) -> torch.nn.Module:
    h, s = args.hidden, args.seq
    if case == "tp":
        return TPTransformerLayer(h, args.heads, 4 * h, g)
    if case == "moe":
        return MoELayer(h, 4 * h, g, capacity_for(s, g.size))
    if case == "tpep":
        return TPEPLayer(h, args.heads, 4 * h, g, g, capacity_for(s, g.size))
    raise ValueError(f"unknown case {case!r}")


FAMILY_WORLD = {"llama_tp": 2, "moe_ep": 2, "moe_tpep": 4}
CASE_WORLD = {"tp": 2, "moe": 2, "tpep": 2, **FAMILY_WORLD}


def _family_values(case: str, args: argparse.Namespace) -> dict:
    llama = {**FORMER_DEFAULTS, "num_layers": 1, "hidden_size": args.hidden, "num_attention_heads": args.heads,
             "group_query_attention": True, "num_query_groups": args.heads // 2, "normalization": "RMSNorm",
             "swiglu": True, "position_embedding_type": "rope", "rotary_base": 500000, "disable_bias_linear": True,
             "seq_length": args.seq, "micro_batch_size": args.batch}
    moe = {**llama, "qk_layernorm": True, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": args.hidden,
           "moe_aux_loss_coeff": 0.01}
    if case == "llama_tp":
        return {**llama, "tensor_model_parallel_size": 2, "global_batch_size": args.batch}
    if case == "moe_ep":
        return {**moe, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall",
                "global_batch_size": 2 * args.batch}
    if case == "moe_tpep":
        return {**moe, "tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                "moe_token_dispatcher_type": "allgather", "global_batch_size": 2 * args.batch}
    raise ValueError(f"unknown case {case!r}")


class DecoderStack(torch.nn.Module):
    """The runtime model's decoder (its layers and final norm) on hidden states ``[s(/tp), b, h]``,
    with the model's rotary embeddings, as GPTModel.forward calls it."""

    def __init__(self, gpt: torch.nn.Module, seq: int) -> None:
        super().__init__()
        self.decoder, self.rope, self.seq = gpt.decoder, gpt.rotary_pos_emb, seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=self.rope(self.seq))


def family_builder(case: str, args: argparse.Namespace, ctx):
    """(ctx, make(traceable) -> DecoderStack, input shape): ``make`` builds the model afresh (weights
    by name, identical every time) -- megatron modules hold process groups and cannot be deep-copied."""
    from megatron_ext.config.run import config_from_values
    from megatron_ext.helix.adapter import make_traceable
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.model import build_model

    cfg = config_from_values(_family_values(case, args))
    p = cfg.parallel
    ctx = distributed.relayout(ctx, tp=p.tensor_model_parallel_size, pp=1, vpp=None, seed=cfg.training.seed,
                               ep=p.expert_model_parallel_size)

    def make(traceable: bool = True) -> DecoderStack:
        gpt = build_model(cfg, ctx, vocab_size=256, wrap_ddp=False).chunks[0]
        if traceable:
            make_traceable(gpt)
        return DecoderStack(gpt, args.seq)

    s = args.seq // p.tensor_model_parallel_size if p.sequence_parallel else args.seq
    return ctx, make, (s, args.batch, args.hidden)


def effective_flops(model: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, reps: int = 5) -> float:
    """FLOP/s this layer actually runs at here and now (eager, real gloo collectives), agreed
    (min) over ranks. The emulated links are defined relative to it, so that the ratio of
    communication to computation is the preset's whatever the host's speed or load."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        train_step(model, x, gy, model.parameters())
    rate = torch.tensor(fc.get_total_flops() / _median_step_s(model, x, gy, reps))
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def _median_step_s(model: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, reps: int) -> float:
    """This rank's median of ``reps`` training steps, each started together (the caller runs a warm one)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, x, gy, model.parameters())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _megatron_eager_s(make, x: torch.Tensor, gy: torch.Tensor, reps: int) -> float:
    """Median step of megatron's own modules (its drop-free MoE dispatcher), slowest rank."""
    model = make(traceable=False)
    train_step(model, x, gy, model.parameters())
    t = torch.tensor(_median_step_s(model, x, gy, reps))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@dataclasses.dataclass
class CaseSetup:
    """One case on this rank: ``make()`` builds its model afresh (identical weights every time),
    ``x`` / ``gy`` the input and output gradient, ``batch_size`` the tiling's batch for the runtime's
    models (None: the benchmark's own layers, batch-first)."""

    ctx: object
    make: object
    x: torch.Tensor
    gy: torch.Tensor
    batch_size: int | None


def setup_case(case: str, args: argparse.Namespace, g: GroupRef, ctx=None) -> CaseSetup:
    # Every case compiles the same layer class with new backends; without a reset Dynamo's
    # per-function recompile limit (8) is reached after three runs of one layer.
    torch._dynamo.reset()
    torch.manual_seed(0)
    if case in FAMILY_WORLD:
        ctx, make, shape = family_builder(case, args, ctx)
        batch_size = args.batch
    else:
        model0 = build(case, args, g)
        shape, batch_size = (args.batch, args.seq, args.hidden), None

        def make(traceable: bool = True) -> torch.nn.Module:
            return copy.deepcopy(model0)
    torch.manual_seed(0)  # the same hidden states on every rank (replicated across TP ranks)
    x = torch.randn(*shape, requires_grad=True)
    return CaseSetup(ctx, make, x, torch.randn(*shape), batch_size)


def emulated_link(rate: float, link: str, interference: float = 0.0):
    """The emulated ``link`` ("intra" / "xnode") for a layer that runs at ``rate`` FLOP/s here: the
    preset's ratio of communication to computation, whatever the host's speed or load."""
    device = DeviceSpec(name="effective", peak_flops_per_s=rate, mem_bandwidth_Bps=1e10, op_overhead_s=0.0)
    return dataclasses.replace(PRESETS[LINKS[link]].resolve(device), compute_interference=interference)


def run_case(case: str, link: str, args: argparse.Namespace, g: GroupRef, interference: float = 0.0,
             ctx=None) -> tuple[dict, object]:
    c = setup_case(case, args, g, ctx)
    ctx, make, x, gy, batch_size = c.ctx, c.make, c.x, c.gy, c.batch_size
    extra: dict = {}
    if case in FAMILY_WORLD:
        extra["megatron_eager_s"] = _megatron_eager_s(make, x, gy, 5)
    model = make()
    rate = effective_flops(model, x, gy)
    wire = emulated_link(rate, link, interference)
    common = dict(tiles=args.tiles, interconnect=wire, cost_model=args.cost_model, cost_cache=args.cost_cache,
                  batch_size=batch_size)
    backends, fns, models = {}, {}, {}
    for name in VARIANTS:
        models[name] = make()
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

    def peak_of(name: str) -> int | None:
        # Only a profiled step whose allocator accounting closes is measured (step_peak_bytes); a
        # collective buffer freed on gloo's worker thread spoils a step, and with two ranks per
        # core (moe_tpep) that happens in nearly every step: then there is no measured peak (None;
        # every rank gives up together).
        try:
            return step_peak_bytes(fns[name], x, gy, models[name].parameters(), attempts=args.peak_attempts,
                                   agree=agree)
        except UnclosedAccounting:
            return None

    base_peak = peak_of("baseline")
    # The budget: the baseline's measured peak + 5 % (its compile-time prediction when unmeasured).
    budget = int((base_peak or backends["baseline"].summaries[-1].chosen.peak_bytes) * 1.05)
    backends["helix"] = HelixBackend(memory_budget_bytes=budget, **common)
    backends["helix"].adopt_links(backends["baseline"])
    fns["helix"] = torch.compile(models["helix"], backend=backends["helix"])
    for _ in range(args.warmup):
        step("helix")()
    # Measured selection (--helix-select-rounds, helix/selection.py): the job's own choice between the
    # untiled graph and Helix's, from rounds of its own; the "measured" arm then steps the graph it kept.
    # The candidates this bench compiles (the job also compiles forced tilings at each factor): each
    # once untimed, then the simulator's ranking (agreed over ranks, helix/selection.rank) picks
    # which are timed against the untiled graph, as the job does.
    cands = ["baseline", "helix", "inductor"]
    selection = MeasuredSelection(cands, args.select_rounds, measure=2, ranked=True)
    for i in range(selection.warmups):
        selection.record(i, timed_step(step(selection.candidate(i)), dist.barrier).step_s)
    figures = torch.tensor([backends[n].summaries[-1].prediction.makespan_s for n in cands]
                           + [float(backends[n].summaries[-1].tiled) for n in cands], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    predicted, tiled = figures[:len(cands)].tolist(), [bool(t) for t in figures[len(cands):].tolist()]
    ranked, dropped = rank(cands, predicted, tiled, always=["inductor"])
    selection.narrow(ranked, predicted_s=dict(zip(cands, predicted)), dropped=dropped)
    for i in range(selection.warmups, selection.done_after):
        selection.record(i, timed_step(step(selection.candidate(i)), dist.barrier).step_s)
    agreed = torch.tensor(selection.vector(), dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    decision = selection.decide(agreed.tolist())
    fns["measured"], models["measured"] = fns[decision.chosen], models[decision.chosen]
    # Rounds of one step per arm, the arms' order rotated by the round (every arm first equally
    # often; the same order on every rank, as the collectives need), and an A/A arm: the baseline
    # stepped a second time in each round, whose ratio to the baseline is the noise floor.
    arms = [*VARIANTS, MEASURED, AA]
    samples = {name: [] for name in arms}
    for r in range(args.steps):
        for name in rotated_order(arms, r):
            samples[name].append(timed_step(step("baseline" if name == AA else name), dist.barrier))
    # Peak memory of a profiled step whose allocator accounting closes (see step_peak_bytes).
    peaks = {name: peak_of(name) for name in VARIANTS}
    out = {"budget": budget, "link": {"latency_s": wire.latency_s, "bandwidth_Bps": wire.bandwidth_Bps,
                                       "layer_flops_per_s": rate}, **extra}
    for name in VARIANTS:
        summ = backends[name].summaries
        # megatron's attention allocates its global buffer in the first forward; the second
        # recompiles once (the graph measured from then on is the last one).
        if len(summ) not in ((1, 2) if case in FAMILY_WORLD else (1,)):
            raise RuntimeError(f"{case}/{link}/{name}: expected one compiled graph, got {len(summ)}")
        last = len(summ) - 1
        chosen, prediction = summ[last].chosen, summ[last].prediction
        # Compute-thread busy time in the steps: median over steps, slowest rank. The emulated
        # interference is not compute the operators did: the simulator adds it on top again.
        busy = torch.tensor(statistics.median(s.step_s - s.exposed_comm_s - s.interference_s
                                              for s in samples[name]))
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        now = backends[name].simulate_compiled(last, float(busy))
        out[name] = {"step_s": [s.step_s for s in samples[name]],
                     "exposed_s": [s.exposed_comm_s for s in samples[name]],
                     "link_s": [s.link_s for s in samples[name]],
                     "slow_s": [s.interference_s for s in samples[name]],
                     "sim_slow_s": now.interference_s,
                     "peak": peaks[name], "sim_makespan_s": now.makespan_s, "sim_peak": chosen.peak_bytes,
                     "sim_compile_s": prediction.makespan_s, "sim_compile_exposed_s": prediction.exposed_comm_s,
                     "sim_exposed_s": now.exposed_comm_s,
                     "tiled": summ[last].tiled, "decision": summ[last].line()}
        if name == "helix" and case == "tp" and link == "xnode":
            out["timeline"] = {"baseline": summ[0].baseline, "helix": summ[0].helix}
    out[AA] = {"step_s": [s.step_s for s in samples[AA]]}
    # Its cost: the selection's iterations, and the time they took beyond as many untiled steps.
    base_step = statistics.median(out["baseline"]["step_s"])
    out[MEASURED] = {"step_s": [s.step_s for s in samples[MEASURED]], "chosen": decision.chosen,
                     "select_iterations": decision.iterations,
                     "select_extra_s": sum(agreed.tolist()) - decision.iterations * base_step,
                     "decision": decision.line()}
    return out, ctx


@contextlib.contextmanager
def rank_session(rank: int, world: int, port: int, cases: list[str], pin: bool = True, verbose: bool = False):
    """This rank's process group (gloo), pinned to its own core (as one GPU per rank), with
    megatron's parallel state when a case is a runtime model; yields ``{"ctx": ...}``, which the
    cases update (they re-lay out megatron's groups), and tears it all down after."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)  # runtime.distributed reads them
    torch.set_num_threads(1)
    if pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    logging.basicConfig(level=logging.INFO if (rank == 0 and verbose) else logging.WARNING,
                        format="%(name)s: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state: dict = {"ctx": None, "group": GroupRef.of()}
    if any(c in FAMILY_WORLD for c in cases):  # megatron's parallel state (and CPU shims) for the runtime's models
        from megatron_ext.config.run import config_from_values
        from megatron_ext.runtime import distributed

        state["ctx"] = distributed.setup(config_from_values({}).parallel, seed=1234)
    yield state
    dist.barrier()
    if state["ctx"] is not None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, args: argparse.Namespace, cases: list[str], queue) -> None:
    with rank_session(rank, world, port, cases, args.pin, args.verbose) as state:
        results = _worker_cases(rank, world, args, cases, state)
        if rank == 0:
            queue.put(results)


def _worker_cases(rank: int, world: int, args: argparse.Namespace, cases: list[str], state: dict) -> dict:
    g, ctx = state["group"], state["ctx"]
    results: dict[str, dict] = {"plain": {}, "interference": {}}
    shares = {"plain": 0.0} | ({"interference": args.interference} if args.interference > 0 else {})
    for case in cases:
        for link in args.links:
            for block, share in shares.items():
                res, ctx = run_case(case, link, args, g, share, ctx)
                state["ctx"] = ctx
                # A layer is as slow as its slowest rank: take the per-step max over ranks.
                gathered = [None] * world
                dist.all_gather_object(gathered, {k: v for k, v in res.items() if k not in ("timeline", "link")})
                for name in VARIANTS:
                    for key in ("step_s", "exposed_s", "link_s", "slow_s"):
                        res[name][key] = [max(r[name][key][i] for r in gathered) for i in range(args.steps)]
                    peaks = [r[name]["peak"] for r in gathered]
                    res[name]["peak"] = None if None in peaks else max(peaks)
                for arm in (AA, MEASURED):
                    res[arm]["step_s"] = [max(r[arm]["step_s"][i] for r in gathered) for i in range(args.steps)]
                results[block][f"{case}_{link}"] = res
                if rank == 0:
                    print(f"  done {case}_{link} ({block})", file=sys.stderr, flush=True)
    return results


def _spawn(world: int, args: argparse.Namespace, cases: list[str]) -> dict:
    return _spawn_ranks(worker, world, (args, cases), "the ranks")


def _spawn_ranks(target, world: int, extra: tuple, what: str) -> dict:
    """Run ``target(rank, world, port, *extra, queue)`` on ``world`` spawned ranks; rank 0's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.spawn(target, args=(world, free_port(), *extra, queue), nprocs=world, join=False)
    # Read before joining: rank 0 blocks in put() until the pipe is drained, and the results
    # (two blocks, simulated timelines) are larger than its buffer.
    results = None
    while results is None:
        if not queue.empty():
            results = queue.get()
        elif procs.join(timeout=1):  # every rank exited (a failed one raises here)
            if queue.empty():
                raise RuntimeError(f"bench_helix: {what} exited without results")
            results = queue.get()
    while not procs.join():
        pass
    return results


# -- long-context activation memory (forward only, sequence tiles) ---------------------------------
def long_context_values(args: argparse.Namespace, seq: int) -> dict:
    """A small GPT of megatron-core (its local spec, as ``--helix`` builds it), TP=2, rotary
    positions, one sequence of ``seq`` tokens per micro-batch."""
    return {**FORMER_DEFAULTS, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
            "position_embedding_type": "rope", "seq_length": seq, "max_position_embeddings": seq,
            "tensor_model_parallel_size": 2, "micro_batch_size": 1, "global_batch_size": 1,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "seed": 1234}


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Predicted(Exception):
    pass


def _predicted_peak(model: torch.nn.Module, backend: HelixBackend, ids: torch.Tensor, pos: torch.Tensor) -> int:
    """The compile-time predicted peak of ``backend``'s graph of the forward, from compiling it
    without running it (the backend's result is discarded before Dynamo could call it)."""
    def predict(gm, example_inputs):
        backend(gm, example_inputs)
        raise _Predicted()

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model.forward, backend=predict, dynamic=False)(ids, pos, None)
    except Exception as exc:  # Dynamo wraps the backend's exception
        if not isinstance(exc, _Predicted) and not isinstance(exc.__cause__, _Predicted) \
                and "_Predicted" not in repr(exc):
            raise
    torch._dynamo.reset()
    return backend.summaries[-1].chosen.peak_bytes


def long_context_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    """Per sequence length: compile the forward of the same model untiled and with sequence tiles
    (each --long-tiles K, forced), measure each arm's peak allocation of one forward (the
    profiler's running sum, ``measure.forward_peak_bytes``) beside the simulator's compile-time
    prediction, the outputs' difference from the untiled graph's, and the forward time over rounds
    in rotated order with an A/A arm. An arm whose predicted peak on every rank would not fit in
    80 % of the host's available memory is compiled and predicted, not run."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    torch.set_num_threads(1)
    if args.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    logging.basicConfig(level=logging.INFO if (rank == 0 and args.verbose) else logging.WARNING,
                        format="%(name)s: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from megatron_ext.config.run import config_from_values
    from megatron_ext.helix.adapter import make_traceable, prefill_first_call_state
    from megatron_ext.helix.measure import forward_peak_bytes
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.model import build_model, unwrap

    seqs = sorted(args.long_seqs)
    cfg = config_from_values(long_context_values(args, seqs[-1]))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    model = unwrap(build_model(cfg, ctx, vocab_size=256, wrap_ddp=False).chunks[0])
    make_traceable(model)
    model.eval()
    agree = all_ranks_agree()
    arms = ["untiled", *[f"seq-k{k}" for k in args.long_tiles]]
    results = {}
    for seq in seqs:
        prefill_first_call_state(model, 1, seq)  # megatron's score buffer [b*np, s, s]: held by megatron, both arms
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, 256, (1, seq), generator=gen)
        pos = torch.arange(seq).unsqueeze(0)
        res: dict = {"arms": {}}
        compiled, outs = {}, {}
        for arm in arms:
            backend = (HelixBackend(mode="baseline") if arm == "untiled" else
                       HelixBackend(tiles=int(arm.split("k")[1]), seq_tiling=True, mode="helix", batch_size=1))
            predicted = _predicted_peak(model, backend, ids, pos)
            need = torch.tensor([float(predicted)])
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
            avail = _mem_available()
            fits = agree(avail is None or need.item() * world <= 0.8 * avail)
            res["arms"][arm] = {"predicted_peak": int(need.item()), "peak": None, "run": fits, "why_not": None if fits
                                else f"predicted {need.item() / 2**30:.2f} GiB per rank x {world} ranks over 80 % "
                                     f"of the {avail / 2**30:.1f} GiB available"}
            compiled[arm] = backend
        runnable = [a for a in arms if res["arms"][a]["run"]]
        fns = {}
        for arm in runnable:
            backend = compiled[arm]
            with torch.no_grad():
                f = fns[arm] = torch.compile(model.forward, backend=backend, dynamic=False)
                outs[arm] = f(ids, pos, None).detach().clone()  # compiles (the same graph again) and warms up
                summary = backend.summaries[-1]
                res["arms"][arm]["tiles"] = summary.tiling.tiles if summary.tiled else 1
                res["arms"][arm]["predicted_peak"] = summary.chosen.peak_bytes
                try:
                    res["arms"][arm]["peak"] = forward_peak_bytes(lambda: f(ids, pos, None), agree=agree)
                except UnclosedAccounting:
                    res["arms"][arm]["peak"] = None
        ref = outs.get("untiled")
        for arm in runnable:
            a = res["arms"][arm]
            a["max_abs_diff"] = None if ref is None else float((outs[arm] - ref).abs().max())
            # the slowest rank's figures: the job needs what its fullest rank needs
            vals = torch.tensor([float(-1 if a["peak"] is None else a["peak"]), float(a["predicted_peak"]),
                                 -1.0 if a["max_abs_diff"] is None else a["max_abs_diff"]], dtype=torch.float64)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            a["peak"] = None if vals[0] < 0 else int(vals[0])
            a["predicted_peak"] = int(vals[1])
            a["max_abs_diff"] = None if vals[2] < 0 else float(vals[2])
        # forward times: rounds of one call per arm (and an A/A arm), order rotated by the round
        timing = runnable + ([aa_name("untiled")] if "untiled" in runnable else [])
        times = {a: [] for a in timing}
        for r in range(args.long_rounds):
            for a in rotated_order(timing, r):
                f = fns[a if a in fns else "untiled"]
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    f(ids, pos, None)
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[a].append(dt.item())
        res["forward_s"] = times
        results[seq] = res
        if rank == 0:
            print(f"  done long context {seq}", file=sys.stderr, flush=True)
        del outs, compiled, fns
    if rank == 0:
        queue.put(results)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


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


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f}"


def _pct(x: float | None) -> str:
    return "n/a (unmeasured)" if x is None else f"{x:.1%}"


def summarise(results: dict, args: argparse.Namespace, title: str) -> dict:
    """Print one table and return its JSON figures per case."""
    med = statistics.median
    print(f"\nHelix benchmark{title}: CPU ranks (gloo; 2, moe_tpep 4), b={args.batch} s={args.seq} h={args.hidden}, "
          f"K={args.tiles}, {args.steps} steps, medians. EMULATED interconnect: every time below is emulated.")
    hdr = f"{'case':<15}{'variant':<10}{'step ms':>9}{'exposed ms':>11}{'link ms':>8}{'slow ms':>8}{'peak MiB':>10}" \
          f"{'sim ms':>8}{'sim exp':>8}{'sim slow':>9}{'sim MiB':>9}{'compile':>9}{'tiled':>7}"
    print(hdr)
    print("-" * len(hdr))
    out = {}
    for key, res in results.items():
        for name in VARIANTS:
            r = res[name]
            print(f"{key:<15}{name:<10}{med(r['step_s']) * 1e3:>9.2f}{med(r['exposed_s']) * 1e3:>11.2f}"
                  f"{med(r['link_s']) * 1e3:>8.2f}{med(r['slow_s']) * 1e3:>8.2f}"
                  f"{_mib(r['peak']):>10}{r['sim_makespan_s'] * 1e3:>8.2f}{r['sim_exposed_s'] * 1e3:>8.2f}"
                  f"{r['sim_slow_s'] * 1e3:>9.2f}{r['sim_peak'] / 2**20:>9.2f}{r['sim_compile_s'] * 1e3:>9.2f}"
                  f"{'yes' if r['tiled'] else 'no':>7}")
        b, h = res["baseline"], res["helix"]
        exp_b, exp_h = med(b["exposed_s"]), med(h["exposed_s"])
        t_h = med(h["step_s"])
        predicted = round(abs(h["sim_compile_s"] - t_h) / t_h, 4)

        def miss(r: dict) -> dict:
            # Which term of the compile-time prediction missed, ms (predicted - measured): the compute
            # thread's busy time (step less its waits) and the time in waits.
            step, exposed = med(r["step_s"]), med(r["exposed_s"])
            return {"busy": round(((r["sim_compile_s"] - r["sim_compile_exposed_s"]) - (step - exposed)) * 1e3, 3),
                    "exposed": round((r["sim_compile_exposed_s"] - exposed) * 1e3, 3)}
        # Speedups as medians of the paired per-round ratios (baseline / arm) with 90 % bootstrap
        # intervals, beside the A/A arm's (baseline / baseline again): the noise floor.
        spd = {name: ratio_interval(b["step_s"], res[name]["step_s"]) for name in ("inductor", "helix", MEASURED, AA)}
        m = res[MEASURED]
        rnd = lambda iv: [round(x, 4) for x in iv]  # noqa: E731
        out[key] = {
            "exposed_comm_reduction": round(1 - exp_h / exp_b, 4) if exp_b > 0 else 0.0,
            "speedup": round(spd["helix"]["median"], 4),
            "speedup_interval": rnd(spd["helix"]["interval"]),
            "speedup_inductor": round(spd["inductor"]["median"], 4),
            "speedup_inductor_interval": rnd(spd["inductor"]["interval"]),
            "aa_ratio": round(spd[AA]["median"], 4), "aa_interval": rnd(spd[AA]["interval"]),
            # the measured selection's arm: the graph it kept, its speedup and what choosing cost
            "speedup_measured": round(spd[MEASURED]["median"], 4),
            "speedup_measured_interval": rnd(spd[MEASURED]["interval"]),
            "measured_choice": m["chosen"], "measured_select_iterations": m["select_iterations"],
            "measured_select_extra_s": round(m["select_extra_s"], 4),
            "rounds": len(b["step_s"]),
            "sim_makespan_err": round(abs(h["sim_makespan_s"] - t_h) / t_h, 4),
            # The compile-time prediction (what decided the schedule), before any rescaling to
            # the measured steps; "_compile" is its old name.
            "sim_makespan_err_compile": predicted,
            "sim_makespan_err_predicted": predicted,
            # the compile-time prediction's miss split by term, per arm (ms, predicted - measured)
            "sim_compile_miss_ms": {name: miss(res[name]) for name in VARIANTS},
            # None: no profiled step closed its allocator accounting (see run_case)
            "sim_peak_mem_err": None if h["peak"] is None else round(abs(h["sim_peak"] - h["peak"]) / h["peak"], 4),
            "peak_mem_bytes": {"baseline": b["peak"], "helix": h["peak"]},
        }
        eager = (f"; megatron eager {res['megatron_eager_s'] * 1e3:.2f} ms" if "megatron_eager_s" in res else "")
        iv = lambda name: "[{:.3f}, {:.3f}]".format(*out[key][name])  # noqa: E731
        print(f"{'':<15}-> exposed comm {-out[key]['exposed_comm_reduction']:+.1%}, speedup {out[key]['speedup']:.3f}x "
              f"90 % {iv('speedup_interval')} (inductor {out[key]['speedup_inductor']:.3f}x "
              f"{iv('speedup_inductor_interval')}; A/A {out[key]['aa_ratio']:.3f}x {iv('aa_interval')}; "
              f"{out[key]['rounds']} rotated rounds; measured selection kept {m['chosen']}: "
              f"{out[key]['speedup_measured']:.3f}x {iv('speedup_measured_interval')}, choosing cost "
              f"{m['select_iterations']} steps, {m['select_extra_s'] * 1e3:+.1f} ms beyond untiled ones), "
              f"sim err makespan {out[key]['sim_makespan_err']:.1%} "
              f"(predicted at compile time {predicted:.1%}: busy {out[key]['sim_compile_miss_ms']['helix']['busy']:+.2f} ms, "
              f"waits {out[key]['sim_compile_miss_ms']['helix']['exposed']:+.2f} ms) "
              f"peak {_pct(out[key]['sim_peak_mem_err'])}, budget {res['budget'] / 2**20:.2f} MiB; link "
              f"{res['link']['bandwidth_Bps'] / 1e6:.0f} MB/s + {res['link']['latency_s'] * 1e6:.0f} us "
              f"(layer runs at {res['link']['layer_flops_per_s'] / 1e9:.1f} GFLOP/s){eager}")
    return out


def summarise_long(results: dict, args: argparse.Namespace) -> dict:
    """The long-context table: per sequence length and arm, the measured and predicted peak of one
    forward (the fullest rank), the cut against the untiled graph, the outputs' largest difference
    and the median forward time with its ratio to the untiled graph's (A/A beside it)."""
    med = statistics.median
    print(f"\nLONG-CONTEXT ACTIVATION MEMORY: forward only, {long_context_values(args, 0)['num_layers']} layers, "
          f"hidden {long_context_values(args, 0)['hidden_size']}, TP=2 on 2 ranks, one sequence per call; peak = "
          f"the fullest rank's allocation above what was live before the call (megatron's own [b*np, s, s] score "
          f"buffer, held in both arms, excluded); {args.long_rounds} rounds in rotated order")
    hdr = (f"{'seq':>7} {'arm':<9}{'peak MiB':>10}{'sim MiB':>10}{'sim err':>9}{'cut':>8}{'max |diff|':>12}"
           f"{'fwd s':>8}{'fwd x':>16}")
    print(hdr)
    print("-" * len(hdr))
    out: dict = {}
    for seq, res in results.items():
        base = res["arms"]["untiled"]
        times = res["forward_s"]
        row_out = {}
        for arm, a in res["arms"].items():
            peak, sim = a["peak"], a["predicted_peak"]
            err = None if peak is None or not peak else abs(sim - peak) / peak
            cut = None if peak is None or base["peak"] is None else 1 - peak / base["peak"]
            sim_cut = 1 - sim / base["predicted_peak"] if base["predicted_peak"] else None
            fwd = med(times[arm]) if times.get(arm) else None
            ratio = (ratio_interval(times["untiled"], times[arm]) if arm != "untiled" and fwd is not None
                     and times.get("untiled") else None)
            aa = ratio_interval(times["untiled"], times[aa_name("untiled")]) if times.get(aa_name("untiled")) else None
            shown = ratio if arm != "untiled" else aa
            diff = "n/a" if a.get("max_abs_diff") is None else f"{a['max_abs_diff']:.1e}"
            speed = "" if not shown else f"{shown['median']:.3f}x" + (" A/A" if arm == "untiled" else "")
            if not a["run"]:
                print(f"{seq:>7} {arm:<9}{'not run':>10}{_mib(sim):>10}{'':>9}{_pct(sim_cut) + '*':>8}  {a['why_not']}")
            else:
                print(f"{seq:>7} {arm:<9}{_mib(peak):>10}{_mib(sim):>10}{_pct(err):>9}"
                      f"{(_pct(-cut) if cut is not None else 'n/a'):>8}"
                      f"{diff:>12}"
                      f"{(f'{fwd:.2f}' if fwd is not None else 'n/a'):>8}"
                      f"{speed:>16}")
            row_out[arm] = {"peak_bytes": peak, "predicted_peak_bytes": sim, "sim_peak_err": err,
                            "peak_cut": cut, "predicted_peak_cut": sim_cut, "max_abs_diff": a.get("max_abs_diff"),
                            "tiles": a.get("tiles"), "run": a["run"], "why_not": a["why_not"],
                            "forward_s_median": fwd, "speedup": None if ratio is None else ratio["median"],
                            "speedup_interval": None if ratio is None else ratio["interval"],
                            "aa": None if aa is None else aa["median"],
                            "aa_interval": None if aa is None else aa["interval"]}
        out[str(seq)] = row_out
    print("cut: the measured peak's reduction against the untiled graph's (* where only predicted); fwd x: the untiled "
          "forward's time over the arm's, median of the per-round ratios (untiled row: its A/A)")
    return out


def _spawn_long(args: argparse.Namespace) -> dict:
    return _spawn_ranks(long_context_worker, 2, (args,), "the long-context ranks")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASE_WORLD), choices=list(CASE_WORLD),
                   help="the layer cases (none: only the long-context table)")
    p.add_argument("--links", nargs="+", default=["xnode", "intra"], choices=list(LINKS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tiles", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="measured rounds (one step per arm each, order rotated)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-attempts", type=int, default=100,
                   help="profiled steps tried for a peak-memory figure whose allocator accounting closes")
    p.add_argument("--select-rounds", type=int, default=DEFAULT_SELECT_ROUNDS,
                   help="rounds of the measured selection's own (untiled vs Helix), before the measured rounds "
                        "(default: the job's, --helix-select-rounds unset in auto mode)")
    p.add_argument("--cost-model", default="calibrated", choices=["calibrated", "analytical"])
    p.add_argument("--cost-cache", default=None, help="micro-benchmark cache file (default: user cache dir)")
    p.add_argument("--interference", type=float, default=0.18,
                   help="share of compute throughput lost while a collective is in flight, for the "
                        "gpu_interference block (default 0.18; 0 skips it)")
    p.add_argument("--timeline", default=None, help="write the simulated tp_xnode before/after timeline PNG here")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin each rank to its own core")
    p.add_argument("--verbose", action="store_true", help="log each graph's Helix summary (rank 0)")
    p.add_argument("--long-seqs", nargs="*", type=int, default=[4096, 8192, 16384, 32768],
                   help="sequence lengths of the long-context memory table (none: skip it)")
    p.add_argument("--long-tiles", nargs="+", type=int, default=[2, 4], help="sequence tiles K of its tiled arms")
    p.add_argument("--long-rounds", type=int, default=3, help="its forward-time rounds (one call per arm each)")
    args = p.parse_args(argv)
    if any(k < 2 for k in args.long_tiles) or any(s % (2 * k) for s in args.long_seqs for k in args.long_tiles):
        p.error("--long-tiles must be >= 2 and divide every --long-seqs length (times the TP size, 2)")
    if args.timeline and ("tp" not in args.cases or "xnode" not in args.links):
        p.error("--timeline needs the tp case and the xnode link")
    if not 0.0 <= args.interference < 1.0:
        p.error(f"--interference is a share of compute throughput in [0, 1), got {args.interference}")
    if args.select_rounds < 1 or args.peak_attempts < 1 or args.tiles < 2:
        p.error(f"--select-rounds and --peak-attempts must be >= 1 and --tiles >= 2, got "
                f"{args.select_rounds}, {args.peak_attempts} and {args.tiles}")

    report = Report("bench_helix")  # the load average before anything starts
    results: dict[str, dict] = {"plain": {}, "interference": {}}
    long_context = _spawn_long(args) if args.long_seqs else None
    for world in sorted({CASE_WORLD[c] for c in args.cases}):
        part = _spawn(world, args, [c for c in args.cases if CASE_WORLD[c] == world])
        for block in results:
            results[block].update(part[block])
    order = [f"{c}_{link}" for c in args.cases for link in args.links]
    results = {block: {k: res[k] for k in order if k in res} for block, res in results.items()}

    plain = summarise(results["plain"], args, "")
    out: dict = {"cases": plain}
    if results["interference"]:
        out["gpu_interference"] = {"share": args.interference,
                                   "cases": summarise(results["interference"], args,
                                                      f" WITH GPU INTERFERENCE {args.interference:.0%}")}
    if long_context is not None:
        out["long_context"] = summarise_long(long_context, args)
    if args.timeline:
        tl = results["plain"]["tp_xnode"]["timeline"]
        plot_timeline(tl, args.timeline)
        print(f"timeline written to {args.timeline}")
    report.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
