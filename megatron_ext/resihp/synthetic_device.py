"""Synthetic ResiHP traces from a device model the detector does not share.

``synthetic.py`` times each op with the detector's own cost form (FLOPs per token plus FLOPs per
squared document length at two fixed efficiencies), so the detector's regression can fit it
exactly and a shift of all ranks cancels in its common-mode step; figures on it mostly measure
the normalisation against itself. This generator times ops the way a GPU kernel library does,
in terms the detector never sees:

* attention runs in square tiles (FlashAttention-style, ``attn_tile`` tokens): a document of
  ``L`` tokens costs ``ceil(L / tile)`` causal tile rows, not ``L**2``, at an efficiency that grows
  with the document's length (short documents leave the tensor cores idle:
  ``eff(L) = attn_peak_efficiency * L / (L + attn_half_length)``);
* every document costs a fixed per-layer kernel overhead (variable-length kernels set up per
  sequence), so the number of documents matters, not only their lengths;
* linear layers run at a GEMM efficiency of their own; the first chunk's embedding is memory bound;
* data-mix phases: the corpus changes every 30-120 iterations (chat, web, code, books: median
  document 250 to 12k tokens), moving the attention share of every op at once;
* a noisy host: an AR(1) slowdown shared by all ranks, one per node of ``node_size`` ranks, and
  one-iteration spikes of the whole job;
* short healthy stalls: one rank 1.5-2.5x slower for 1-3 iterations (a preemption, a page-cache
  flush). They are returned, unlabelled: a verdict on one is a false alarm;
* faults: one rank slower by ``factor`` from ``since`` on, as a step or as a linear ramp over
  ``ramp`` iterations (gradual thermal / power throttling), labelled from ``since``;
* mixture of experts (``num_experts``): every layer's MLP is ``num_experts`` experts split over
  expert-parallel groups of ``ep`` data-parallel ranks of a stage (megatron's layout with TP 1).
  The routing is drawn, not assumed: each stage has an expert popularity (Dirichlet with
  concentration ``routing_alpha``: small is strongly imbalanced) that changes every
  ``routing_phase`` iterations, each micro-batch's loads scatter around it (Dirichlet with
  ``routing_spread``) and top-k pairs per token of the EP group are drawn from that. An expert's
  GEMM runs on its pairs rounded up to ``expert_tile`` rows plus a fixed overhead per expert and
  layer, whatever its load; so a rank's expert time follows its routed pairs, neither linearly nor
  in the detector's terms. The records carry the routed pairs per rank (``routed_tokens``), as the
  live probe writes them, and durations without the expert-parallel collectives.

Documents are packed back to back into sequences of ``seq_length`` tokens; a document crossing a
sequence boundary is split there (its rest starts the next sequence), as megatron's GPT dataset
packs. The iteration time is a rough pipeline estimate (slowest stage plus the schedule's warm-up
and cool-down share); neither detector scores it.

``generate_device(spec)`` returns a :class:`DeviceTrace`: the records (fault labels included) and
what else was drawn (stalls, phases), so tests and benchmarks can check them.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.trace import FaultLabel, TraceLayout, TraceRecord

logger = logging.getLogger(__name__)

# Corpora of the data-mix phases: (median document length in tokens, log-normal sigma).
CORPORA: dict[str, tuple[float, float]] = {
    "chat": (250.0, 0.9),
    "web": (700.0, 1.3),
    "code": (2500.0, 1.1),
    "books": (12000.0, 0.8),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceFault:
    """One rank slower by ``factor`` from ``since`` (through ``until``, or to the end); with
    ``ramp`` > 0 the slowdown grows linearly from 1 and reaches ``factor`` after ``ramp`` iterations."""

    rank: int
    since: int
    factor: float
    ramp: int = 0
    until: int | None = None

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"DeviceFault.factor must be > 1 (a slowdown), got {self.factor}")
        if self.ramp < 0:
            raise ValueError(f"DeviceFault.ramp must be >= 0, got {self.ramp}")
        if self.until is not None and self.until < self.since:
            raise ValueError(f"DeviceFault.until ({self.until}) is before since ({self.since})")

    def active(self, it: int) -> bool:
        return self.since <= it and (self.until is None or it <= self.until)

    def slowdown(self, it: int) -> float:
        if not self.active(it):
            return 1.0
        if self.ramp == 0:
            return self.factor
        return 1.0 + (self.factor - 1.0) * min(1.0, (it - self.since + 1) / self.ramp)


@dataclasses.dataclass(frozen=True)
class Stall:
    """A short healthy slowdown of one rank (unlabelled)."""

    rank: int
    first: int
    last: int
    factor: float


@dataclasses.dataclass(frozen=True)
class Phase:
    """Iterations ``first..last`` drawn from ``corpus``."""

    first: int
    last: int
    corpus: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceJob:
    """One synthetic job under the device model (see the module docstring for each term)."""

    stages: int = 8
    microbatches: int = 16
    chunks: int = 1
    schedule: str = "1f1b"
    tp: int = 1
    dp: int = 1
    iterations: int = 200
    first_iteration: int = 1
    seq_length: int = 16384
    hidden_size: int = 2048
    num_attention_heads: int = 16
    layers_per_chunk: int = 2
    vocab_size: int = 50304
    peak_flops_per_s: float = 400e12
    gemm_efficiency: float = 0.6
    attn_tile: int = 128
    attn_peak_efficiency: float = 0.55
    attn_half_length: float = 1024.0
    attn_bwd_ratio: float = 2.5            # attention backward / forward time (recomputes scores)
    doc_overhead_s: float = 20e-6          # per document and layer, forward; backward twice
    embed_s_per_token: float = 2e-9
    op_overhead_s: float = 3e-4
    rank_speed_spread: float = 0.03
    op_noise: float = 0.04                 # log-normal sigma per op
    rank_noise: float = 0.02               # log-normal sigma per rank and iteration
    host_noise: float = 0.04               # AR(1) stationary sigma of the job-wide slowdown (log)
    node_noise: float = 0.02               # same, per node
    node_size: int = 8
    host_spike_prob: float = 0.02          # per iteration: the whole job 1.3-3x slower
    stall_prob: float = 0.003              # per rank and iteration: a healthy stall begins
    stall_factor: tuple[float, float] = (1.5, 2.5)
    stall_length: tuple[int, int] = (1, 3)
    phase_length: tuple[int, int] = (30, 120)
    corpora: tuple[str, ...] = ("chat", "web", "code", "books")
    tail_s: float = 0.03
    faults: tuple[DeviceFault, ...] = ()
    seed: int = 0
    num_experts: int | None = None         # MoE: experts per layer (None: dense MLP)
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 1408
    ep: int = 2                            # expert-parallel group: this many consecutive DP ranks
    routing_alpha: float = 1.0             # Dirichlet concentration of the expert popularity
    routing_spread: float = 50.0           # Dirichlet concentration of a micro-batch around it
    routing_phase: tuple[int, int] = (20, 80)
    expert_tile: int = 128                 # GEMM rows are computed in tiles of this many
    expert_overhead_s: float = 5e-5        # per local expert and layer, forward; backward twice

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "chunks", "tp", "dp", "iterations", "seq_length", "node_size",
                     "attn_tile", "layers_per_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"DeviceJob.{name} must be >= 1, got {getattr(self, name)}")
        unknown = [c for c in self.corpora if c not in CORPORA]
        if unknown or not self.corpora:
            raise ValueError(f"DeviceJob.corpora: unknown {unknown}; expected some of {sorted(CORPORA)}")
        for f in self.faults:
            if not 0 <= f.rank < self.world_size:
                raise ValueError(f"DeviceJob: fault rank {f.rank} outside 0..{self.world_size - 1}")
        if self.num_experts is not None:
            if self.tp != 1:
                raise ValueError("DeviceJob: experts are modelled with tp = 1 only")
            if self.ep < 1 or self.dp % self.ep or self.num_experts % self.ep:
                raise ValueError(f"DeviceJob: ep {self.ep} must divide dp {self.dp} and num_experts "
                                 f"{self.num_experts}")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"DeviceJob: moe_router_topk {self.moe_router_topk} outside 1..{self.num_experts}")

    @property
    def world_size(self) -> int:
        return self.tp * self.stages * self.dp

    def model(self) -> ModelSpec:
        moe = {} if self.num_experts is None else dict(num_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                                                         moe_ffn_hidden_size=self.moe_ffn_hidden_size)
        return ModelSpec(num_layers=self.layers_per_chunk * self.stages * self.chunks, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size, **moe)

    def layout(self) -> TraceLayout:
        return TraceLayout(tp=self.tp, pp=self.stages, dp=self.dp, vp=self.chunks, schedule=self.schedule,
                      num_microbatches=self.microbatches)


@dataclasses.dataclass
class DeviceTrace:
    records: list[TraceRecord]
    stalls: list[Stall]
    phases: list[Phase]
    # (iterations, world) slowdown multipliers actually applied, for checks: stalls, faults, and
    # the host and node factors together.
    stall_mult: np.ndarray
    fault_mult: np.ndarray
    host_mult: np.ndarray
    # MoE: (iterations, world) routed pairs of each rank over the iteration, and the share of its
    # EP group's pairs the most loaded rank of the group got, per op (empty for dense jobs).
    routed: np.ndarray | None = None
    max_share: np.ndarray | None = None


def pack_stream(rng: np.random.Generator, sequences: int, seq_length: int, median: float,
                sigma: float) -> tuple[list[np.ndarray], np.ndarray]:
    """Pieces of log-normal documents packed back to back into ``sequences`` sequences of
    ``seq_length`` tokens (a document crossing a boundary is split there). Returns the pieces of
    each sequence and the sequence index of every piece."""
    total = sequences * seq_length
    mean = median * np.exp(sigma * sigma / 2)
    lengths = np.empty(0, dtype=np.int64)
    while lengths.sum() < total:
        k = int(total / mean * 1.2) + 16
        draw = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, k))).astype(np.int64)
        lengths = np.concatenate([lengths, draw])
    ends = np.cumsum(lengths)
    ends = ends[ends < total]
    cuts = np.union1d(ends, np.arange(1, sequences + 1, dtype=np.int64) * seq_length)
    pieces = np.diff(np.concatenate([[0], cuts]))
    seq = (cuts - 1) // seq_length
    return np.split(pieces, np.flatnonzero(np.diff(seq)) + 1), seq


def _ar1(rng: np.random.Generator, n: int, width: int, sigma: float, rho: float = 0.9) -> np.ndarray:
    """(n, width) AR(1) series with stationary standard deviation ``sigma``."""
    out = np.zeros((n, width))
    if sigma <= 0:
        return out
    eps = rng.normal(0.0, sigma * np.sqrt(1 - rho * rho), (n, width))
    x = rng.normal(0.0, sigma, width)
    for k in range(n):
        x = rho * x + eps[k]
        out[k] = x
    return out


def draw_phases(rng: np.random.Generator, job: DeviceJob) -> list[Phase]:
    phases, it, last = [], job.first_iteration, job.first_iteration + job.iterations - 1
    prev = None
    while it <= last:
        n = int(rng.integers(job.phase_length[0], job.phase_length[1] + 1))
        choices = [c for c in job.corpora if c != prev] or list(job.corpora)
        corpus = str(rng.choice(choices))
        phases.append(Phase(it, min(last, it + n - 1), corpus))
        prev, it = corpus, it + n
    return phases


def generate_device(job: DeviceJob) -> DeviceTrace:
    """The records of one job under the device model, with its stalls and phases."""
    rng = np.random.default_rng(job.seed)
    layout, model = job.layout(), job.model()
    world, p, v, m, dp, tp = job.world_size, job.stages, job.chunks, job.microbatches, job.dp, job.tp
    coords = layout.coord_array
    stage_of, dp_of = coords[:, 0], coords[:, 1]
    h, S, n = job.hidden_size, job.seq_length, job.iterations
    rate = job.peak_flops_per_s
    # Per token and layer, forward: QKV, projection and a 4h MLP (24 h^2 FLOPs), split over TP; an
    # MoE layer has the router instead of the MLP (its experts are timed per routed pair below).
    dense_flops = 24.0 * h * h if job.num_experts is None else 8.0 * h * h + 2.0 * h * job.num_experts
    lin_s_per_token = dense_flops / tp / (rate * job.gemm_efficiency)
    head_s_per_token = 2.0 * h * job.vocab_size / tp / (rate * job.gemm_efficiency)
    first_chunk = (stage_of == 0)[:, None] & (np.arange(v) == 0)[None, :]            # (world, v)
    last_chunk = (stage_of == p - 1)[:, None] & (np.arange(v) == v - 1)[None, :]
    rank_speed = np.exp(rng.normal(0.0, job.rank_speed_spread, world))
    phases = draw_phases(rng, job)
    corpus_of = {it: ph.corpus for ph in phases for it in range(ph.first, ph.last + 1)}
    log_host = _ar1(rng, n, 1, job.host_noise)[:, 0]
    spikes = np.where(rng.random(n) < job.host_spike_prob, rng.uniform(1.3, 3.0, n), 1.0)
    nodes = (np.arange(world) // job.node_size)
    log_node = _ar1(rng, n, int(nodes.max()) + 1, job.node_noise)[:, nodes]
    host_mult = np.exp(log_host)[:, None] * spikes[:, None] * np.exp(log_node)         # (n, world)
    stall_mult = np.ones((n, world))
    fault_mult = np.ones((n, world))
    stalls: list[Stall] = []
    left = np.zeros(world, dtype=np.int64)
    for k in range(n):
        it = job.first_iteration + k
        start = (left == 0) & (rng.random(world) < job.stall_prob)
        for r in np.flatnonzero(start):
            length = int(rng.integers(job.stall_length[0], job.stall_length[1] + 1))
            factor = float(rng.uniform(*job.stall_factor))
            stalls.append(Stall(int(r), it, it + length - 1, factor))
            left[r] = length
            stall_mult[k:k + length, r] = factor
        left = np.maximum(left - 1, 0)
        for f in job.faults:
            fault_mult[k, f.rank] *= f.slowdown(it)
    fwd = np.empty((n, world, v, m))
    bwd = np.empty((n, world, v, m))
    # Experts draw from their own stream, so a dense job's draws are what they always were.
    moe = _expert_times(job, stage_of, dp_of) if job.num_experts is not None else None
    documents = []
    tile = job.attn_tile
    heads_h = h / tp
    for k in range(n):
        it = job.first_iteration + k
        median, sigma = CORPORA[corpus_of[it]]
        seqs, _ = pack_stream(rng, dp * m, S, median, sigma)
        docs = [[seqs[d * m + i].tolist() for i in range(m)] for d in range(dp)]
        documents.append(docs)
        feats = np.empty((dp, m, 3))  # tokens, attention seconds per layer (forward), documents
        for j, pieces in enumerate(seqs):
            L = pieces.astype(float)
            rows = np.ceil(L / tile)
            att_flops = 4.0 * tile * tile * heads_h * rows * (rows + 1) / 2  # causal tiles
            eff = job.attn_peak_efficiency * L / (L + job.attn_half_length)
            feats[j // m, j % m] = (L.sum(), float((att_flops / (rate * eff)).sum()), len(L))
        f = feats[dp_of]                                                              # (world, m, 3)
        layer_fwd = f[..., 0] * lin_s_per_token + f[..., 1] + f[..., 2] * job.doc_overhead_s
        layer_bwd = 2.0 * f[..., 0] * lin_s_per_token + job.attn_bwd_ratio * f[..., 1] + \
            2.0 * f[..., 2] * job.doc_overhead_s
        tokens = f[..., 0][:, None, :]                                               # (world, 1, m)
        t_f = job.layers_per_chunk * layer_fwd[:, None, :] + job.op_overhead_s + \
            first_chunk[..., None] * tokens * job.embed_s_per_token + last_chunk[..., None] * tokens * head_s_per_token
        t_b = job.layers_per_chunk * layer_bwd[:, None, :] + job.op_overhead_s + \
            first_chunk[..., None] * tokens * job.embed_s_per_token + \
            last_chunk[..., None] * tokens * 2.0 * head_s_per_token
        t_f = np.broadcast_to(t_f, (world, v, m)).copy()
        t_b = np.broadcast_to(t_b, (world, v, m)).copy()
        if moe is not None:
            t_f += moe[1][k]
            t_b += 2.0 * moe[1][k]
        mult = (host_mult[k] * stall_mult[k] * fault_mult[k] / rank_speed *
                rng.lognormal(0.0, job.rank_noise, world))[:, None, None]
        fwd[k] = t_f * mult * rng.lognormal(0.0, job.op_noise, t_f.shape)
        bwd[k] = t_b * mult * rng.lognormal(0.0, job.op_noise, t_b.shape)
    # Iteration time: per replica, a stage's op lasts as long as its slowest TP rank; the slowest
    # stage sets the pace, plus the schedule's fill and drain (p - 1 of v * m micro-batch slots).
    busy = np.zeros((n, dp, p))
    np.maximum.at(busy, (slice(None), dp_of, stage_of), fwd.sum(axis=(2, 3)) + bwd.sum(axis=(2, 3)))
    pace = busy.max(axis=2) * (1.0 + (p - 1) / (v * m))
    iteration_s = pace.max(axis=1) + job.tail_s * rng.lognormal(0.0, 0.05, n)
    records, clock = [], 0.0
    for k in range(n):
        it = job.first_iteration + k
        clock += float(iteration_s[k])
        labels = tuple(FaultLabel(kind="slow", rank=f.rank, since=f.since, factor=f.factor)
                       for f in job.faults if f.active(it))
        records.append(TraceRecord(iteration=it, iteration_s=float(iteration_s[k]), layout=layout, model=model,
                                   documents=documents[k], fwd_s=fwd[k], bwd_s=bwd[k], time_s=round(clock, 6),
                                   faults=labels, routed_tokens=None if moe is None else moe[0][k]))
    if moe is None:
        return DeviceTrace(records, stalls, phases, stall_mult, fault_mult, host_mult)
    return DeviceTrace(records, stalls, phases, stall_mult, fault_mult, host_mult,
                       routed=moe[0].sum(axis=(2, 3)), max_share=moe[2])


def _expert_times(job: DeviceJob, stage_of: np.ndarray, dp_of: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routed pairs (n, world, v, m), healthy forward expert seconds (n, world, v, m) and the most
    loaded rank's share of its EP group's pairs per op (n, groups, v, m)."""
    rng = np.random.default_rng([job.seed, 0x6D6F65])
    n, world, v, m, p = job.iterations, job.world_size, job.chunks, job.microbatches, job.stages
    e, ep, k = job.num_experts, job.ep, job.moe_router_topk
    groups = job.dp // ep
    local = e // ep
    tokens = ep * job.seq_length                        # one sequence per micro-batch and DP rank
    pair_s = 4.0 * job.hidden_size * job.moe_ffn_hidden_size / (job.peak_flops_per_s * job.gemm_efficiency)
    pairs = np.zeros((n, world, v, m))
    secs = np.zeros((n, world, v, m))
    share = np.zeros((n, p * groups, v, m))
    popularity = np.zeros((p, v, job.layers_per_chunk, e))
    left = np.zeros(p, dtype=np.int64)
    # rank of (stage, dp) with tp = 1: megatron's order, dp fastest within a stage
    rank_of = {(int(s), int(d)): r for r, (s, d) in enumerate(zip(stage_of, dp_of))}
    for it in range(n):
        for s in range(p):
            if left[s] == 0:  # a routing phase: which experts the tokens of this stage prefer
                popularity[s] = rng.dirichlet(np.full(e, job.routing_alpha), (v, job.layers_per_chunk))
                left[s] = int(rng.integers(job.routing_phase[0], job.routing_phase[1] + 1))
            left[s] -= 1
            for g in range(groups):
                for c in range(v):
                    for lay in range(job.layers_per_chunk):
                        q = rng.dirichlet(job.routing_spread * popularity[s, c, lay] + 1e-3, m)
                        load = rng.multinomial(k * tokens, q)                                        # (m, e)
                        rows = np.ceil(load / job.expert_tile) * job.expert_tile
                        t = rows * pair_s + job.expert_overhead_s                                    # (m, e)
                        for er in range(ep):
                            r = rank_of[(s, g * ep + er)]
                            mine = slice(er * local, (er + 1) * local)
                            pairs[it, r, c] += load[:, mine].sum(axis=1)
                            secs[it, r, c] += t[:, mine].sum(axis=1)
                group_ranks = [rank_of[(s, g * ep + er)] for er in range(ep)]
                grp = pairs[it, group_ranks]                                                        # (ep, v, m)
                share[it, s * groups + g] = grp.max(axis=0) / np.maximum(grp.sum(axis=0), 1)
    return pairs, secs, share


FACTORS = (1.3, 1.5, 2.0, 3.0)


def random_job(rng: np.random.Generator, *, iterations: int, kind: str, warmup: int = 20, seed: int = 0,
               factor: float | None = None, stages_choices: tuple[int, ...] = (8, 16, 32)) -> DeviceJob:
    """A random job: 8-32 stages, 1F1B or interleaved, TP/DP 1-2; ``kind`` 'healthy', 'step'
    (one fault of ``factor`` at a random rank from a random iteration after warm-up) or 'ramp'
    (one fault ramping to ``factor`` over 20-60 iterations)."""
    if kind not in ("healthy", "step", "ramp"):
        raise ValueError(f"random_job: kind must be 'healthy', 'step' or 'ramp', got {kind!r}")
    stages = int(rng.choice(stages_choices))
    interleaved = bool(rng.random() < 0.5)
    chunks = 2 if interleaved else 1
    microbatches = stages * int(rng.choice([1, 2])) if interleaved else int(rng.choice([stages, 2 * stages]))
    tp = int(rng.choice([1, 2])) if stages <= 16 else 1
    dp = int(rng.choice([1, 2]))
    world = tp * stages * dp
    faults: tuple[DeviceFault, ...] = ()
    if kind != "healthy":
        if factor is None:
            raise ValueError("random_job: a faulty job needs a factor")
        ramp = int(rng.integers(20, 61)) if kind == "ramp" else 0
        since = int(rng.integers(warmup + 10, max(warmup + 11, iterations - 30 - ramp)))
        faults = (DeviceFault(rank=int(rng.integers(world)), since=since, factor=float(factor), ramp=ramp),)
    return DeviceJob(stages=stages, microbatches=microbatches, chunks=chunks,
                     schedule="interleaved" if interleaved else "1f1b", tp=tp, dp=dp, iterations=iterations,
                     layers_per_chunk=1 if interleaved else 2, faults=faults, seed=seed)
