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
  ``ramp`` iterations (gradual thermal / power throttling), labelled from ``since``.

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

from megatron_ext.resihp.flops import ModelSpec
from megatron_ext.resihp.trace import FaultLabel, Layout, TraceRecord

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

    @property
    def world_size(self) -> int:
        return self.tp * self.stages * self.dp

    def model(self) -> ModelSpec:
        return ModelSpec(num_layers=self.layers_per_chunk * self.stages * self.chunks, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size)

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.stages, dp=self.dp, vp=self.chunks, schedule=self.schedule,
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
    # Per token and layer, forward: QKV, projection and a 4h MLP (24 h^2 FLOPs), split over TP.
    lin_s_per_token = 24.0 * h * h / tp / (rate * job.gemm_efficiency)
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
                                   faults=labels))
    return DeviceTrace(records, stalls, phases, stall_mult, fault_mult, host_mult)


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
