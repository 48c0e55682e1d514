"""Synthetic, labelled ResiHP traces: pipelines of 8-64 stages running packed micro-batches of
heavy-tailed document lengths, with fail-slow faults at chosen ranks and times.

The generator is a model of a healthy cluster plus the noise a detector must not mistake for a
fault, and nothing more; figures measured on it say how the statistics behave, not how a real
cluster does (the live run is the check of that). Op durations follow the FLOPs model with
attention running at lower efficiency than the projections (so the work of a micro-batch depends
on its documents, not only its tokens), per stage and per rank speed differences, per-op and
per-iteration jitter, and short unlabelled slow bursts (a pause, a noisy neighbour) that last one
to three iterations. The iteration time is the pipeline simulation of the actual durations plus a
noisy optimizer tail.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megatron_ext.models.flops import ModelSpec, stage_costs
from megatron_ext.pipeline.schedule_orders import schedule_order
from megatron_ext.pipeline.pipesim import compile_plan, simulate
from megatron_ext.resihp.trace import FaultLabel, TraceLayout, TraceRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowFault:
    rank: int
    since: int        # first slow iteration
    factor: float
    until: int | None = None  # last slow iteration (None: to the end)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    """One synthetic job. Defaults: a long-context GPT where attention is a large, variable share."""

    stages: int = 8
    microbatches: int = 16
    chunks: int = 1
    schedule: str = "1f1b"
    tp: int = 1
    dp: int = 1
    iterations: int = 200
    first_iteration: int = 1
    seq_length: int = 16384
    micro_batch_size: int = 1
    hidden_size: int = 2048
    num_attention_heads: int = 16
    layers_per_chunk: int = 2
    vocab_size: int = 50304
    doc_length_median: float = 1024.0
    doc_length_sigma: float = 1.5       # log-normal shape: heavy right tail
    linear_flops_per_s: float = 100e12
    attention_efficiency: float = 0.5   # attention FLOPs run at this fraction of linear speed
    op_overhead_s: float = 5e-4
    stage_speed_spread: float = 0.05
    rank_speed_spread: float = 0.03
    op_noise: float = 0.03              # log-normal sigma per op
    iteration_noise: float = 0.02       # log-normal sigma per rank and iteration
    burst_prob: float = 0.002           # per rank and iteration: an unlabelled slow burst begins
    burst_factor: tuple[float, float] = (1.3, 3.0)
    burst_length: tuple[int, int] = (1, 3)
    p2p_latency_s: float = 1e-4
    tail_s: float = 0.05
    faults: tuple[SlowFault, ...] = ()
    # Iteration spans [first, last] drawn from a long-document corpus (books, code files: data-mix
    # shifts): more attention work on healthy hardware, which raw time mistakes for a slowdown.
    long_document_spans: tuple[tuple[int, int], ...] = ()
    long_document_median: float = 8192.0
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.stages * self.dp

    def model(self) -> ModelSpec:
        return ModelSpec(num_layers=self.layers_per_chunk * self.stages * self.chunks, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size)

    def layout(self) -> TraceLayout:
        return TraceLayout(tp=self.tp, pp=self.stages, dp=self.dp, vp=self.chunks, schedule=self.schedule,
                      num_microbatches=self.microbatches)


def pack_documents(rng: np.random.Generator, seq_length: int, sequences: int, median: float,
                   sigma: float) -> list[int]:
    """Document lengths filling ``sequences`` packed sequences of ``seq_length`` tokens; the last
    document of each sequence is cut at the boundary (documents never span sequences)."""
    out: list[int] = []
    for _ in range(sequences):
        left = seq_length
        while left > 0:
            draws = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, 32))).astype(np.int64)
            for n in draws:
                n = int(min(n, left))
                out.append(n)
                left -= n
                if left == 0:
                    break
    return out


def generate(spec: SyntheticSpec) -> list[TraceRecord]:
    """The records of one synthetic job, fault labels included."""
    rng = np.random.default_rng(spec.seed)
    layout, model = spec.layout(), spec.model()
    world, p, v, m, dp = spec.world_size, spec.stages, spec.chunks, spec.microbatches, spec.dp
    for f in spec.faults:
        if not 0 <= f.rank < world:
            raise ValueError(f"fault rank {f.rank} outside 0..{world - 1}")
    coords = layout.coord_array
    stage_of, dp_of = coords[:, 0], coords[:, 1]
    costs = stage_costs(model, p, v, spec.tp)
    per_token = np.array([[[c.fwd_per_token, c.bwd_per_token] for c in row] for row in costs])  # (p, v, 2)
    per_sq = np.array([[[c.fwd_per_sq, c.bwd_per_sq] for c in row] for row in costs])
    stage_speed = np.exp(rng.normal(0, spec.stage_speed_spread, p))
    rank_speed = stage_speed[stage_of] * np.exp(rng.normal(0, spec.rank_speed_spread, world))
    lin_rate = spec.linear_flops_per_s * rank_speed                       # (world,)
    att_rate = lin_rate * spec.attention_efficiency
    n = spec.iterations
    fwd = np.empty((n, world, v, m))
    bwd = np.empty((n, world, v, m))
    documents = []
    burst_left = np.zeros(world, dtype=np.int64)
    burst_mult = np.ones(world)
    for k in range(n):
        it = spec.first_iteration + k
        long = any(a <= it <= b for a, b in spec.long_document_spans)
        median, sigma = ((spec.long_document_median, 1.0) if long
                         else (spec.doc_length_median, spec.doc_length_sigma))
        docs = [[pack_documents(rng, spec.seq_length, spec.micro_batch_size, median, sigma) for _ in range(m)]
                for _ in range(dp)]
        documents.append(docs)
        tokens = np.array([[sum(x) for x in row] for row in docs], dtype=float)          # (dp, m)
        sq = np.array([[float(np.square(np.asarray(x, dtype=float)).sum()) for x in row] for row in docs])
        lin = per_token[stage_of][:, :, :, None] * tokens[dp_of][:, None, None, :]       # (world, v, 2, m)
        att = per_sq[stage_of][:, :, :, None] * sq[dp_of][:, None, None, :]
        t = lin / lin_rate[:, None, None, None] + att / att_rate[:, None, None, None] + spec.op_overhead_s
        t *= rng.lognormal(0, spec.op_noise, t.shape)
        t *= rng.lognormal(0, spec.iteration_noise, world)[:, None, None, None]
        start = (burst_left == 0) & (rng.random(world) < spec.burst_prob)
        burst_left[start] = rng.integers(spec.burst_length[0], spec.burst_length[1] + 1, int(start.sum()))
        burst_mult[start] = rng.uniform(*spec.burst_factor, int(start.sum()))
        active = burst_left > 0
        t[active] *= burst_mult[active][:, None, None, None]
        burst_left[active] -= 1
        for f in spec.faults:
            if f.since <= it and (f.until is None or it <= f.until):
                t[f.rank] *= f.factor
        fwd[k], bwd[k] = t[:, :, 0], t[:, :, 1]
    # Iteration time: per replica, a stage's op lasts as long as its slowest TP rank.
    plan = compile_plan(schedule_order(spec.schedule, p, m, v))
    sf = np.zeros((n, dp, p, v, m))
    sb = np.zeros((n, dp, p, v, m))
    np.maximum.at(sf, (slice(None), dp_of, stage_of), fwd)
    np.maximum.at(sb, (slice(None), dp_of, stage_of), bwd)
    makespan = np.empty(n)
    step = max(1, 20000 // max(1, dp * p * v * m // 64))
    for a in range(0, n, step):
        b = min(n, a + step)
        res = simulate(plan, sf[a:b].reshape(-1, p, v, m), sb[a:b].reshape(-1, p, v, m),
                       p2p_latency_s=spec.p2p_latency_s)
        makespan[a:b] = res.makespan_s.reshape(b - a, dp).max(axis=1)
    iteration_s = makespan + spec.tail_s * rng.lognormal(0, 0.05, n)
    records = []
    clock = 0.0
    for k in range(n):
        it = spec.first_iteration + k
        clock += float(iteration_s[k])
        labels = tuple(FaultLabel(kind="slow", rank=f.rank, since=f.since, factor=f.factor) for f in spec.faults
                       if f.since <= it and (f.until is None or it <= f.until))
        records.append(TraceRecord(iteration=it, iteration_s=float(iteration_s[k]), layout=layout, model=model,
                                       documents=documents[k], fwd_s=fwd[k], bwd_s=bwd[k], time_s=round(clock, 6),
                                       faults=labels))
    return records


def random_spec(rng: np.random.Generator, *, iterations: int, fault_prob: float = 0.5,
                factor_range: tuple[float, float] = (1.1, 3.0), warmup: int = 20, seed: int = 0,
                long_doc_prob: float = 0.5, stages_choices: tuple[int, ...] = (8, 16, 32, 64)) -> SyntheticSpec:
    """A random job for the benchmark: 8-64 stages, 1F1B or interleaved, TP/DP 1-2; with
    probability ``fault_prob`` one fail-slow fault of a random factor at a random rank, starting
    at a random iteration after warm-up and lasting to the end; with probability
    ``long_doc_prob`` one or two spans of 10-40 iterations from the long-document corpus."""
    stages = int(rng.choice(stages_choices))
    interleaved = bool(rng.random() < 0.5)
    chunks = 2 if interleaved else 1
    microbatches = stages * int(rng.choice([1, 2])) if interleaved else int(rng.choice([stages, 2 * stages]))
    tp = int(rng.choice([1, 2])) if stages <= 16 else 1
    dp = int(rng.choice([1, 2])) if stages <= 32 else 1
    world = tp * stages * dp
    faults: tuple[SlowFault, ...] = ()
    if rng.random() < fault_prob:
        since = int(rng.integers(warmup + 10, max(warmup + 11, iterations - 20)))
        faults = (SlowFault(rank=int(rng.integers(world)), since=since,
                            factor=float(np.round(rng.uniform(*factor_range), 3))),)
    spans = []
    if rng.random() < long_doc_prob:
        for _ in range(int(rng.integers(1, 3))):
            first = int(rng.integers(warmup + 1, max(warmup + 2, iterations - 10)))
            spans.append((first, first + int(rng.integers(10, 41))))
    return SyntheticSpec(stages=stages, microbatches=microbatches, chunks=chunks,
                         schedule="interleaved" if interleaved else "1f1b", tp=tp, dp=dp, iterations=iterations,
                         layers_per_chunk=1 if interleaved else 2, faults=faults,
                         long_document_spans=tuple(spans), seed=seed)


def main(argv: list[str] | None = None) -> int:
    """Write a synthetic trace: ``python -m megatron_ext.resihp.synthetic OUT.jsonl [options]``."""
    import argparse

    from megatron_ext.resihp.trace import write_trace

    parser = argparse.ArgumentParser(prog="python -m megatron_ext.resihp.synthetic",
                                     description="Write a labelled synthetic ResiHP trace (format v1).")
    parser.add_argument("out")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=1, help="model chunks per stage (>1: interleaved)")
    parser.add_argument("--schedule", default=None, help="1f1b / interleaved / deepspeed (default from --chunks)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:ITER:FACTOR[:UNTIL]",
                        help="a fail-slow fault (repeatable)")
    parser.add_argument("--long-docs", action="append", default=[], metavar="FIRST:LAST",
                        help="iterations drawn from the long-document corpus (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        faults = []
        for text in args.slow:
            parts = text.split(":")
            if len(parts) not in (3, 4):
                raise ValueError
            faults.append(SlowFault(rank=int(parts[0]), since=int(parts[1]), factor=float(parts[2]),
                                    until=int(parts[3]) if len(parts) == 4 else None))
    except ValueError:
        parser.error(f"--slow expects RANK:ITER:FACTOR[:UNTIL], got {args.slow}")
    try:
        spans = tuple(tuple(int(x) for x in t.split(":")) for t in args.long_docs)
        if any(len(s) != 2 for s in spans):
            raise ValueError
    except ValueError:
        parser.error(f"--long-docs expects FIRST:LAST, got {args.long_docs}")
    schedule = args.schedule or ("interleaved" if args.chunks > 1 else "1f1b")
    spec = SyntheticSpec(stages=args.stages, microbatches=args.microbatches, chunks=args.chunks, schedule=schedule,
                         tp=args.tp, dp=args.dp, iterations=args.iterations, faults=tuple(faults),
                         long_document_spans=spans, layers_per_chunk=1 if args.chunks > 1 else 2, seed=args.seed)
    write_trace(args.out, generate(spec))
    print(f"wrote {args.iterations} iterations to {args.out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
