"""One training iteration of a ``Job`` on a ``ClusterState``, op by op.

Per pipeline, per micro-batch and stage: the forward and backward compute (this module's own FLOPs
count of the micro-batch's packed documents, divided by TP, at the effective FLOP/s of the stage's
slowest TP member: a TP group waits for its slowest member at every collective), plus the TP
collectives of every layer (Megatron with sequence parallelism: per layer two all-gathers and two
reduce-scatters forward and backward, a ring over the group's links) and, for MoE layers, the
dispatch and combine all-to-alls over the TP group (experts sharded over it). Between stages: the
activation (forward) or its gradient (backward), each TP rank sending its sequence shard over its
own path, which carries one transfer at a time (FIFO). Megatron's sends hold the sending stage
until they complete (``Pipeline.async_sends`` lifts that). The pipeline schedule is megatron's 1F1B
(``pipeline.schedule_orders.megatron_1f1b``; ``extra_warmup`` runs more forwards ahead) compiled by
``pipeline.pipesim``; the dataflow is this module's own loop over pipesim's topological levels,
because it adds per-link transfer times and link queues that pipesim's scalar latency does not have.

After the slowest pipeline's last op: the data-parallel gradient reduce (reduce-scatter +
all-gather of bf16 gradients over a ring through the pipelines, at the ring's slowest link; not
overlapped with the backward) and the optimizer step (memory-bound, at the device's speed).

ReCycle's rerouting: a stage's rerouted micro-batches are computed by the same stage of the other
pipelines (at their speed, plus a transfer in and out); the work they add to those peers goes into
the peers' idle time at that stage first (what ReCycle's schedule is built to do; all of the idle
time counts as usable, generous to it), and only what does not fit lengthens the peer pipeline.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Sequence

import numpy as np

from megatron_ext.pipeline.pipesim import compile_plan
from megatron_ext.pipeline.schedule_orders import megatron_1f1b
from megatron_ext.resilience.faults import ClusterState
from megatron_ext.resilience.hardware import Hardware
from megatron_ext.resilience.job import Job, Pipeline, stage_params
from megatron_ext.resilience.shapes import BWD_ATTENTION, BWD_LINEAR, ModelShape

logger = logging.getLogger(__name__)


class DeviceGone(RuntimeError):
    """The job uses a device whose speed is 0: it hangs."""


# ---- data: packed variable-length documents ------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Data:
    """Packed sequences of ``seq_length`` tokens, ``micro_batch_size`` per micro-batch; ``sum_sq[i]`` is
    micro-batch ``i``'s sum of squared document lengths (attention work). Pipelines take consecutive
    micro-batches of this list (cyclically)."""

    seq_length: int
    micro_batch_size: int
    sum_sq: np.ndarray

    @property
    def tokens(self) -> int:
        return self.seq_length * self.micro_batch_size


def packed_documents(num_microbatches: int, *, seq_length: int = 4096, micro_batch_size: int = 1, seed: int = 0,
                     log_mean: float = 6.0, log_sigma: float = 1.4) -> Data:
    """Documents with log-normal lengths (median ``exp(log_mean)`` tokens) packed into sequences
    with per-document attention; a document longer than the room left is cut there."""
    if num_microbatches < 1 or seq_length < 1 or micro_batch_size < 1:
        raise ValueError(f"packed_documents: counts must be >= 1, got {num_microbatches}, {seq_length}, {micro_batch_size}")
    rng = np.random.default_rng(seed)
    sq = np.zeros(num_microbatches)
    for i in range(num_microbatches):
        for _ in range(micro_batch_size):
            left = seq_length
            while left > 0:
                n = int(min(left, max(1, round(rng.lognormal(log_mean, log_sigma)))))
                sq[i] += n * n
                left -= n
    return Data(seq_length, micro_batch_size, sq)


# ---- the schedule ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Compiled:
    n: int
    stage: np.ndarray
    microbatch: np.ndarray
    is_forward: np.ndarray
    prev: np.ndarray
    prod: np.ndarray
    cross: np.ndarray
    send_dir: np.ndarray    # 1: forward to k+1, 2: backward to k-1, 0: no send
    sprev: np.ndarray       # previous op on the stage sending the same way, or n
    levels: tuple[np.ndarray, ...]


@functools.lru_cache(maxsize=128)
def compiled(num_stages: int, num_microbatches: int, extra_warmup: tuple[int, ...] = ()) -> _Compiled:
    plan = compile_plan(megatron_1f1b(num_stages, num_microbatches, extra_warmup))
    n = plan.num_ops
    p = num_stages
    send_dir = np.zeros(n, dtype=np.int64)
    send_dir[plan.is_forward & (plan.stage < p - 1)] = 1
    send_dir[~plan.is_forward & (plan.stage > 0)] = 2
    sprev = np.full(n, n, dtype=np.int64)
    last: dict[tuple[int, int], int] = {}
    for j in range(n):  # ops are numbered stage by stage, in order
        if send_dir[j]:
            key = (int(plan.stage[j]), int(send_dir[j]))
            if key in last:
                sprev[j] = last[key]
            last[key] = j
    cross = plan.cross & (plan.prod != n)
    return _Compiled(n, plan.stage, plan.microbatch, plan.is_forward, plan.prev, plan.prod, cross, send_dir, sprev,
                     plan.levels)


def run_pipelines(c: _Compiled, fwd: np.ndarray, bwd: np.ndarray, send_fwd: np.ndarray, send_bwd: np.ndarray,
                  *, blocking: bool) -> tuple[np.ndarray, np.ndarray]:
    """Dataflow over a batch of pipelines of one shape: ``fwd``/``bwd`` (B, p, m) seconds,
    ``send_fwd[:, k]`` the transfer from stage k to k+1 and ``send_bwd[:, k]`` from k+1 to k (B, p-1).
    Returns the makespan (B,) and each stage's busy seconds (B, p)."""
    n = c.n
    b = fwd.shape[0]
    dur = np.where(c.is_forward[None, :], fwd[:, c.stage, c.microbatch], bwd[:, c.stage, c.microbatch])  # (B, n)
    p = fwd.shape[1]
    sf = np.concatenate([send_fwd, np.zeros((b, 1))], axis=1) if p > 1 else np.zeros((b, 1))
    sb = np.concatenate([np.zeros((b, 1)), send_bwd], axis=1) if p > 1 else np.zeros((b, 1))
    send = np.where(c.send_dir[None, :] == 1, sf[:, c.stage], np.where(c.send_dir[None, :] == 2, sb[:, c.stage], 0.0))
    dur_t, send_t = np.ascontiguousarray(dur.T), np.ascontiguousarray(send.T)
    finish = np.zeros((n + 1, b))
    sent = np.zeros((n + 1, b))       # when the op's output has arrived at its consumer
    release = np.zeros((n + 1, b))    # when the stage may start its next op
    for idx in c.levels:
        arrive = np.where(c.cross[idx][:, None], sent[c.prod[idx]], finish[c.prod[idx]])
        start = np.maximum(release[c.prev[idx]], arrive)
        fin = start + dur_t[idx]
        finish[idx] = fin
        se = np.maximum(fin, sent[c.sprev[idx]]) + send_t[idx]
        sent[idx] = se
        release[idx] = se if blocking else fin
    busy = np.zeros((b, p))
    for s in range(p):
        busy[:, s] = dur[:, c.stage == s].sum(axis=1)
    return release[:n].max(axis=0), busy


# ---- costs of one op ------------------------------------------------------------------------

OPTIMIZER_BYTES_PER_PARAM = 30.0
"""The optimizer step's memory traffic per parameter of a device's shard: fp32 master weights and
two moments read and written, the fp32 gradient read, the bf16 weight written."""


def stage_flops(shape: ModelShape, tokens: int, sum_sq: np.ndarray | float, layers: int, head: bool
                ) -> tuple[np.ndarray | float, np.ndarray | float]:
    """Forward FLOPs of one micro-batch through ``layers`` layers (and the output layer where
    ``head``): (the projections', the attention's); ``sum_sq``: its sum of squared document lengths.
    The backward is ``BWD_LINEAR`` and ``BWD_ATTENTION`` times each."""
    lin = layers * shape.layer_linear_flops() * tokens + (shape.head_flops() * tokens if head else 0.0)
    return lin, layers * shape.layer_attention_flops_per_sq() * sum_sq


def link(a: int, b: int, state: ClusterState, hw: Hardware) -> tuple[float, float]:
    """(bytes/s, latency s) between two devices: NVLink inside a node, else the slower NIC and path."""
    na, nb = a // hw.gpus_per_node, b // hw.gpus_per_node
    if na == nb:
        return hw.nvlink_bytes_per_s, hw.nvlink_latency_s
    f = min(state.nic[a], state.nic[b], state.path_factor(na, nb))
    return hw.nic_bytes_per_s * f, hw.nic_latency_s


def ring_s(devices: Sequence[int], nbytes: float, state: ClusterState, hw: Hardware, *, collectives: float = 1.0) -> float:
    """A ring all-reduce (or reduce-scatter + all-gather) of ``nbytes`` per device over ``devices``
    in that order: ``2 (n - 1) / n`` of the bytes at the ring's slowest link, ``2 (n - 1)`` hops of latency."""
    n = len(devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = min(link(devices[i], devices[(i + 1) % n], state, hw) for i in range(n))
    return collectives * (2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat)


@dataclasses.dataclass(frozen=True)
class IterationResult:
    time_s: float
    compute_s: float      # the slowest pipeline's last op
    grad_sync_s: float
    optimizer_s: float
    tokens: int
    pipeline_s: tuple[float, ...]


class Simulator:
    """Iteration times of jobs on cluster states, cached (a run asks for the same pair many times)."""

    def __init__(self, shape: ModelShape, hw: Hardware, data: Data, *, value_bytes: float = 2.0) -> None:
        """``value_bytes``: bytes of an activation or gradient value on the wire (bf16: 2; the fp32 CPU
        runs of the validation: 4)."""
        if not value_bytes > 0:
            raise ValueError(f"Simulator: value_bytes must be > 0, got {value_bytes!r}")
        self.shape, self.hw, self.data, self.value_bytes = shape, hw, data, float(value_bytes)
        self._cache: dict[tuple, IterationResult] = {}

    def iteration(self, job: Job, state: ClusterState) -> IterationResult:
        key = (job, state.key())
        if key not in self._cache:
            self._cache[key] = self._iteration(job, state)
        return self._cache[key]

    def healthy(self, job: Job) -> IterationResult:
        from megatron_ext.resilience.faults import healthy_state

        return self.iteration(job, healthy_state(max(job.devices) + 1))

    def op_seconds(self, job: Job, state: ClusterState, q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pipeline ``q``'s forward and backward seconds per (stage, micro-batch), rerouting not
        applied, and its send seconds per stage boundary: what the dataflow runs on."""
        p = job.pipelines[q]
        off = sum(x.microbatches for x in job.pipelines[:q])
        sq = self.data.sum_sq[(off + np.arange(p.microbatches)) % self.data.sum_sq.shape[0]]
        fwd = np.zeros((p.pp, p.microbatches))
        bwd = np.zeros((p.pp, p.microbatches))
        for k, g in enumerate(p.stages):
            fwd[k], bwd[k] = self._stage_op_s(p, k, float(state.speed[list(g)].min()), sq, state)
        return fwd, bwd, np.array([self._send_s(p, k, state) for k in range(p.pp - 1)])

    # ---- per pipeline ----

    def _stage_op_s(self, pipe: Pipeline, k: int, speed: float, sum_sq: np.ndarray, state: ClusterState
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of stage ``k``'s micro-batches (``sum_sq`` per micro-batch)."""
        sh, hw, tokens = self.shape, self.hw, self.data.tokens
        tp, layers = pipe.tp, pipe.layers[k]
        lin, att = stage_flops(sh, tokens, sum_sq, layers, k == pipe.pp - 1)
        rate = hw.flops * speed * tp
        fwd = (lin + att) / rate
        bwd = (BWD_LINEAR * lin + BWD_ATTENTION * att) / rate
        group = pipe.stages[k]
        act = self.value_bytes * tokens * sh.hidden_size   # the micro-batch's activations
        comm = layers * ring_s(group, act, state, hw, collectives=2.0)
        if sh.is_moe and tp > 1:
            bw, lat = min(link(group[i], group[(i + 1) % tp], state, hw) for i in range(tp))
            a2a = sh.moe_topk * act / tp * (tp - 1) / tp / bw + (tp - 1) * lat
            comm += layers * 2.0 * a2a
        return fwd + comm, bwd + comm

    def _send_s(self, pipe: Pipeline, k: int, state: ClusterState) -> float:
        """Stage k -> k+1 (and its gradient back): each TP rank sends its sequence shard."""
        nbytes = self.value_bytes * self.data.tokens * self.shape.hidden_size / pipe.tp
        worst = 0.0
        for a, b in zip(pipe.stages[k], pipe.stages[k + 1]):
            bw, lat = link(a, b, state, self.hw)
            worst = max(worst, nbytes / bw + lat)
        return worst

    def _iteration(self, job: Job, state: ClusterState) -> IterationResult:
        devs = np.asarray(job.devices)
        if devs.max() >= state.speed.shape[0]:
            raise ValueError(f"job uses device {devs.max()}; the cluster has {state.speed.shape[0]}")
        busy_devs = np.asarray(computing_devices(job))
        gone = busy_devs[state.speed[busy_devs] <= 0]
        if gone.size:
            raise DeviceGone(f"device(s) {gone.tolist()} of the job are gone")
        sq_all = self.data.sum_sq
        offsets = np.concatenate([[0], np.cumsum([p.microbatches for p in job.pipelines])])
        speeds = [[float(state.speed[list(g)].min()) if not _off(p, k) else 1.0 for k, g in enumerate(p.stages)]
                  for p in job.pipelines]
        groups: dict[tuple, list[int]] = {}
        for q, p in enumerate(job.pipelines):
            groups.setdefault((p.pp, p.microbatches, p.extra_warmup, p.async_sends), []).append(q)
        makespan = np.zeros(len(job.pipelines))
        busy: list[np.ndarray] = [np.zeros(0)] * len(job.pipelines)
        peer_speed = self._peer_speeds(job, speeds)
        hop = self.value_bytes * self.data.tokens * self.shape.hidden_size / job.tp / self.hw.nic_bytes_per_s + self.hw.nic_latency_s
        for (pp, m, extra, async_sends), qs in groups.items():
            fwd = np.zeros((len(qs), pp, m))
            bwd = np.zeros((len(qs), pp, m))
            sf = np.zeros((len(qs), max(pp - 1, 0)))
            for i, q in enumerate(qs):
                p = job.pipelines[q]
                idx = (offsets[q] + np.arange(m)) % sq_all.shape[0]
                sq = sq_all[idx]
                for k in range(pp):
                    fwd[i, k], bwd[i, k] = self._stage_op_s(p, k, speeds[q][k], sq, state)
                    r = p.rerouted[k] if p.rerouted else 0
                    if r:
                        # Spread over the micro-batches: every (m / r)-th runs on a peer.
                        sel = np.unique(np.floor(np.arange(r) * m / r).astype(int))
                        pf, pb = self._stage_op_s(p, k, peer_speed[k], sq[sel], state)
                        fwd[i, k, sel] = pf + 2 * hop
                        bwd[i, k, sel] = pb + 2 * hop
                for k in range(pp - 1):
                    sf[i, k] = self._send_s(p, k, state)
            c = compiled(pp, m, tuple(extra))
            ms, bz = run_pipelines(c, fwd, bwd, sf, sf, blocking=not async_sends)
            for i, q in enumerate(qs):
                makespan[q], busy[q] = ms[i], bz[i]
        makespan = self._absorb_rerouted(job, makespan, busy, speeds, peer_speed)
        compute = float(makespan.max())
        sync = self._grad_sync_s(job, state)
        opt = self._optimizer_s(job, speeds)
        return IterationResult(compute + sync + opt, compute, sync, opt, job.microbatches * self.data.tokens,
                               tuple(float(x) for x in makespan))

    def _peer_speeds(self, job: Job, speeds: list[list[float]]) -> list[float]:
        """Per stage index: the mean speed of the stages that take rerouted work (not rerouting themselves)."""
        out = []
        depth = max(p.pp for p in job.pipelines)
        for k in range(depth):
            v = [speeds[q][k] for q, p in enumerate(job.pipelines) if k < p.pp and not (p.rerouted and p.rerouted[k])]
            out.append(float(np.mean(v)) if v else 1.0)
        return out

    def _absorb_rerouted(self, job: Job, makespan: np.ndarray, busy: list[np.ndarray], speeds: list[list[float]],
                         peer_speed: list[float]) -> np.ndarray:
        if not any(p.rerouted for p in job.pipelines):
            return makespan
        out = makespan.copy()
        tokens, sh = self.data.tokens, self.shape
        mean_sq = float(self.data.sum_sq.mean())
        for k in range(max(p.pp for p in job.pipelines)):
            moved = [(q, p.rerouted[k]) for q, p in enumerate(job.pipelines) if p.rerouted and k < p.pp and p.rerouted[k]]
            if not moved:
                continue
            peers = [q for q, p in enumerate(job.pipelines) if k < p.pp and not (p.rerouted and p.rerouted[k])]
            if not peers:
                raise ValueError(f"stage {k}: every pipeline reroutes it; no peer computes the rerouted micro-batches")
            work = 0.0
            for q, r in moved:
                p = job.pipelines[q]
                lin, att = stage_flops(sh, tokens, mean_sq, p.layers[k], k == p.pp - 1)
                work += r * ((1 + BWD_LINEAR) * lin + (1 + BWD_ATTENTION) * att) / (self.hw.flops * p.tp)
            for q in peers:
                share = work / len(peers) / max(speeds[q][k], 1e-12)
                idle = makespan[q] - busy[q][k]
                out[q] = makespan[q] + max(0.0, share - idle)
        return out

    def _grad_sync_s(self, job: Job, state: ClusterState) -> float:
        if len(job.pipelines) == 1:
            return 0.0
        worst = 0.0
        done: set[tuple] = set()
        ranges = [p.layer_ranges() for p in job.pipelines]
        holders: dict[int, list[tuple[int, ...]]] = {}   # layer -> the TP groups holding it, by pipeline
        for q, p in enumerate(job.pipelines):
            for k, (a, b) in enumerate(ranges[q]):
                mid = (a + b - 1) // 2
                if _off(p, k):
                    continue
                if mid not in holders:
                    holders[mid] = [h for h in (_holder(o, mid, r) for o, r in zip(job.pipelines, ranges))
                                    if h is not None]
                for t in range(p.tp):
                    ring = tuple(h[t] for h in holders[mid])
                    key = (ring, a, b, k == 0, k == p.pp - 1)
                    if key in done:
                        continue
                    done.add(key)
                    nbytes = self.value_bytes * stage_params(self.shape, p, k) / p.tp
                    worst = max(worst, ring_s(ring, nbytes, state, self.hw))
        return worst

    def _optimizer_s(self, job: Job, speeds: list[list[float]]) -> float:
        dp = len(job.pipelines)
        worst = 0.0
        for q, p in enumerate(job.pipelines):
            for k in range(p.pp):
                if _off(p, k):
                    continue
                # the device's distributed-optimizer shard
                nbytes = OPTIMIZER_BYTES_PER_PARAM * stage_params(self.shape, p, k) / p.tp / dp
                worst = max(worst, nbytes / self.hw.hbm_bytes_per_s / speeds[q][k])
        return worst


def _off(p: Pipeline, k: int) -> bool:
    """Stage ``k`` of ``p`` computes nothing itself: every micro-batch of it is rerouted (ReCycle)."""
    return bool(p.rerouted) and p.rerouted[k] >= p.microbatches


def computing_devices(job: Job) -> list[int]:
    """The job's devices that compute (all but those of fully rerouted stages)."""
    return [d for p in job.pipelines for k, g in enumerate(p.stages) if not _off(p, k) for d in g]


def _holder(p: Pipeline, layer: int, ranges: list[tuple[int, int]] | None = None) -> tuple[int, ...] | None:
    for k, (a, b) in enumerate(ranges or p.layer_ranges()):
        if a <= layer < b:
            return None if _off(p, k) else p.stages[k]
    return None


def throughput(result: IterationResult) -> float:
    """Tokens per second."""
    return result.tokens / result.time_s if result.time_s > 0 else math.inf
