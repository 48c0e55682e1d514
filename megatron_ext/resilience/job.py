"""A training job's layout as the simulator runs it: data-parallel pipelines, each a list of stages
(a TP group of devices and the layers it holds), with the micro-batches it runs per iteration.

More general than one (tp, pp, dp) grid on purpose: Oobleck's pipelines of different depths,
Malleus's per-pipeline layer splits and ReCycle's rerouted micro-batches are all jobs here.
``from_plan_layout`` / ``to_plan_layout`` convert to and from ResiHP's ``PlanLayout``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from megatron_ext.resihp.planner_types import PlanLayout
from megatron_ext.resilience.hardware import Hardware
from megatron_ext.resilience.shapes import ModelShape

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One data-parallel pipeline. ``stages[k]`` is the TP group (devices) of stage ``k``."""

    stages: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    microbatches: int
    extra_warmup: tuple[int, ...] = ()
    """Forwards each stage runs ahead of 1F1B's ``p - k - 1`` (ADAPTRA's schedule adaptation); empty: none."""
    async_sends: bool = False
    """Sends do not hold the sending stage (ADAPTRA's host-side transfers); Megatron's do (head-of-line blocking)."""
    rerouted: tuple[int, ...] = ()
    """Micro-batches of each stage that the same stage of other pipelines computes (ReCycle); empty: none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(tuple(int(d) for d in g) for g in self.stages))
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        p = len(self.stages)
        if p < 1:
            raise ValueError("Pipeline: needs at least one stage")
        if len(self.layers) != p:
            raise ValueError(f"Pipeline: {p} stages but {len(self.layers)} layer counts {list(self.layers)}")
        if any(n < 1 for n in self.layers):
            raise ValueError(f"Pipeline: every stage needs at least one layer, got {list(self.layers)}")
        tps = {len(g) for g in self.stages}
        if len(tps) != 1 or min(tps) < 1:
            raise ValueError(f"Pipeline: every stage needs the same TP size >= 1, got {[len(g) for g in self.stages]}")
        if self.microbatches < 1:
            raise ValueError(f"Pipeline: microbatches must be >= 1, got {self.microbatches}")
        for name in ("extra_warmup", "rerouted"):
            v = getattr(self, name)
            if v and (len(v) != p or min(v) < 0):
                raise ValueError(f"Pipeline.{name}: one count >= 0 per stage ({p}), got {list(v)}")
        if self.rerouted and max(self.rerouted) > self.microbatches:
            raise ValueError(f"Pipeline.rerouted {list(self.rerouted)}: more than the {self.microbatches} micro-batches")

    @property
    def tp(self) -> int:
        return len(self.stages[0])

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.stages for d in g)

    def layer_ranges(self) -> list[tuple[int, int]]:
        edges = np.concatenate([[0], np.cumsum(self.layers)])
        return [(int(edges[k]), int(edges[k + 1])) for k in range(self.pp)]


@dataclasses.dataclass(frozen=True)
class Job:
    """The pipelines of one job (DP replicas; all hold the whole model)."""

    pipelines: tuple[Pipeline, ...]

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise ValueError("Job: needs at least one pipeline")
        n = {sum(p.layers) for p in self.pipelines}
        if len(n) != 1:
            raise ValueError(f"Job: pipelines hold different layer totals {sorted(n)}")
        seen: set[int] = set()
        for p in self.pipelines:
            dup = seen & set(p.devices)
            if dup or len(set(p.devices)) != len(p.devices):
                raise ValueError(f"Job: device(s) {sorted(dup) or sorted(p.devices)[:4]} used twice")
            seen |= set(p.devices)
        if len({p.tp for p in self.pipelines}) != 1:
            raise ValueError(f"Job: pipelines with different TP sizes {[p.tp for p in self.pipelines]}")

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for p in self.pipelines for d in p.devices)

    @property
    def num_layers(self) -> int:
        return sum(self.pipelines[0].layers)

    @property
    def microbatches(self) -> int:
        return sum(p.microbatches for p in self.pipelines)

    @property
    def tp(self) -> int:
        return self.pipelines[0].tp


def from_plan_layout(layout: PlanLayout) -> Job:
    if layout.vp != 1 or layout.schedule != "1f1b":
        raise ValueError(f"the simulator runs megatron's 1F1B with one chunk per stage; the layout asks for "
                         f"schedule {layout.schedule!r} with vp={layout.vp}")
    g = layout.grid()
    return Job(tuple(Pipeline(stages=tuple(tuple(int(x) for x in g[s, d]) for s in range(layout.pp)),
                              layers=layout.stage_layers, microbatches=int(layout.microbatches[d]))
                     for d in range(layout.dp)))


def to_plan_layout(job: Job) -> PlanLayout:
    """The job as a ``PlanLayout``; only for jobs that are one grid (same depth and split everywhere)."""
    p0 = job.pipelines[0]
    if any(p.pp != p0.pp or p.layers != p0.layers or p.extra_warmup or p.rerouted for p in job.pipelines):
        raise ValueError("to_plan_layout: the job's pipelines differ in depth or layer split (not one grid)")
    pp, dp, tp = p0.pp, len(job.pipelines), p0.tp
    grid = np.array([[p.stages[s] for p in job.pipelines] for s in range(pp)])  # (pp, dp, tp)
    return PlanLayout(tp=tp, pp=pp, dp=dp, layers=tuple((n,) for n in p0.layers),
                      microbatches=tuple(p.microbatches for p in job.pipelines),
                      devices=tuple(int(x) for x in grid.reshape(-1)))


def node_of(device: int, hw: Hardware) -> int:
    return device // hw.gpus_per_node


def node_aligned_job(shape: ModelShape, *, tp: int, pp: int, dp: int, global_microbatches: int,
                     layers: Sequence[int], first_device: int = 0) -> Job:
    """Pipeline ``d`` on devices ``[d * tp * pp, (d + 1) * tp * pp)``, stage by stage, TP fastest
    (Megatron's ``tp-pp-dp`` order): a pipeline occupies whole nodes when ``tp * pp`` is a multiple of
    the node size, so a node's loss takes whole stages of one pipeline."""
    if global_microbatches < dp:
        raise ValueError(f"{global_microbatches} micro-batches cannot feed {dp} pipelines")
    if sum(layers) != shape.num_layers or len(layers) != pp:
        raise ValueError(f"layers {list(layers)}: expected {pp} counts summing to {shape.num_layers}")
    base, extra = divmod(global_microbatches, dp)
    out = []
    for d in range(dp):
        first = first_device + d * tp * pp
        stages = tuple(tuple(range(first + k * tp, first + (k + 1) * tp)) for k in range(pp))
        out.append(Pipeline(stages=stages, layers=tuple(layers), microbatches=base + (1 if d < extra else 0)))
    return Job(tuple(out))


def balanced_layers(shape: ModelShape, pp: int, speeds: Sequence[float] | None = None,
                    cap: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's per-micro-batch time, the output layer counted
    on the last stage, at the stages' ``speeds`` (default all 1); each stage at most ``cap``.
    Greedy: one layer at a time to the stage that stays fastest (optimal for this min-max)."""
    sp = np.ones(pp) if speeds is None else np.asarray(speeds, dtype=float)
    cap_a = np.full(pp, shape.num_layers) if cap is None else np.asarray(cap)
    if sp.shape != (pp,) or (sp <= 0).any():
        raise ValueError(f"balanced_layers: need {pp} positive stage speeds, got {list(sp)}")
    if shape.num_layers < pp or cap_a.sum() < shape.num_layers or (cap_a < 1).any():
        raise ValueError(f"balanced_layers: {shape.num_layers} layers do not fit {pp} stages under caps {list(cap_a)}")
    unit = shape.layer_linear_flops() / sp
    fixed = np.zeros(pp)
    fixed[-1] = shape.head_flops() / sp[-1]
    n = np.ones(pp, dtype=np.int64)
    for _ in range(shape.num_layers - pp):
        cost = np.where(n < cap_a, (n + 1) * unit + fixed, np.inf)
        n[int(np.argmin(cost))] += 1
    return tuple(int(x) for x in n)


def stage_params(shape: ModelShape, pipe: Pipeline, k: int) -> float:
    """Parameters stage ``k`` holds (its layers, the embedding on the first, the output layer on the last)."""
    out = pipe.layers[k] * shape.layer_params()
    if k == 0:
        out += shape.embedding_params()
    if k == pipe.pp - 1:
        out += shape.embedding_params()
    return out


def stage_memory_bytes(shape: ModelShape, pipe: Pipeline, k: int, dp: int, seq_tokens: int) -> float:
    """Bytes one device of stage ``k`` needs: bf16 weights, fp32 gradient buffer, Adam state and
    fp32 master weights sharded over ``dp`` (Megatron's distributed optimizer), plus the activations
    of the micro-batches 1F1B keeps in flight (``34 s h`` bytes per layer with selective
    recomputation; sequence parallel divides them by TP), all over TP."""
    inflight = min(pipe.pp - k + (pipe.extra_warmup[k] if pipe.extra_warmup else 0), pipe.microbatches)
    return memory_bytes(shape, pipe.layers[k], first=k == 0, last=k == pipe.pp - 1, tp=pipe.tp, dp=dp,
                        inflight=inflight, seq_tokens=seq_tokens)


def memory_bytes(shape: ModelShape, layers: int, *, first: bool, last: bool, tp: int, dp: int, inflight: int,
                 seq_tokens: int) -> float:
    """``stage_memory_bytes`` from counts (any number of layers, zero included)."""
    params = (layers * shape.layer_params() + shape.embedding_params() * (int(first) + int(last))) / tp
    act = layers * 34.0 * seq_tokens * shape.hidden_size / tp * inflight
    return params * (2.0 + 4.0 + 12.0 / max(dp, 1)) + act


def fits(shape: ModelShape, job: Job, hw: Hardware, seq_tokens: int) -> bool:
    dp = len(job.pipelines)
    return all(stage_memory_bytes(shape, p, k, dp, seq_tokens) <= hw.memory_bytes
               for p in job.pipelines for k in range(p.pp))


def holdings(shape: ModelShape, job: Job) -> dict[int, tuple[int, int, int, int]]:
    """device -> (first layer, end layer, TP rank, TP size) of the model state it holds; the
    embedding is layer -1 and the output layer layer ``num_layers`` for this purpose."""
    out = {}
    n = job.num_layers
    for p in job.pipelines:
        for k, (a, b) in enumerate(p.layer_ranges()):
            lo = -1 if k == 0 else a
            hi = n + 1 if k == p.pp - 1 else b
            for t, d in enumerate(p.stages[k]):
                out[d] = (lo, hi, t, p.tp)
    return out


def move_bytes(shape: ModelShape, old: Job, new: Job, state_bytes_per_param: float = 16.0) -> dict[int, float]:
    """Bytes of model and optimizer state each device of ``new`` must receive: what it will hold
    minus what it already holds (same layers and the same TP shard); from a replica's memory."""
    had = holdings(shape, old)
    out = {}
    per_layer = shape.layer_params() * state_bytes_per_param
    emb = shape.embedding_params() * state_bytes_per_param
    n = new.num_layers

    def size(lo: int, hi: int) -> float:
        mid = max(0, min(hi, n) - max(lo, 0)) * per_layer
        return mid + (emb if lo < 0 < hi else 0.0) + (emb if lo <= n < hi else 0.0)

    for d, (lo, hi, t, tp) in holdings(shape, new).items():
        need = size(lo, hi) / tp
        if d in had:
            plo, phi, pt, ptp = had[d]
            if ptp == tp and pt == t:
                need -= size(max(lo, plo), min(hi, phi)) / tp if min(hi, phi) > max(lo, plo) else 0.0
        out[d] = max(need, 0.0)
    return out


__all__ = ["Job", "Pipeline", "balanced_layers", "fits", "from_plan_layout", "holdings", "move_bytes", "node_aligned_job",
           "node_of", "stage_memory_bytes", "stage_params", "to_plan_layout"]
