"""The seed's setting: 256 GPUs (32 nodes of 8) plus one spare node, LLaMA-2 and Qwen shapes on
their usual TP x PP x DP layouts, a global batch of 1,024 packed sequences of 4,096 tokens (4M
tokens), and the fault scenarios of issue #22.

Layouts (TP inside a node, pipelines on whole nodes, Megatron's ``tp-pp-dp`` order):

* LLaMA-2-7B TP2 x PP4 x DP32 (a pipeline per node), LLaMA-2-13B TP4 x PP4 x DP16 (two nodes),
  LLaMA-2-70B TP8 x PP8 x DP4 (a stage per node), Qwen2.5-14B TP8 x PP2 x DP16, Qwen2-57B-A14B
  (MoE) TP4 x PP4 x DP16 with the experts sharded over the TP group.

Single-fault scenarios start at ``ONSET_S`` (half a checkpoint interval after a checkpoint: a
restart loses the average amount of work) and last until the end; throughput is measured over the
hour after the onset. The fault hits device ``VICTIM`` (node 5, a middle stage of a pipeline) or
its node, NIC or the path from its node to the next node of its pipeline (its PP stage link;
where a pipeline sits in one node, the path to the node of its ring neighbour: DP traffic only).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math

import numpy as np

from megatron_ext.resilience.faults import Fault, FaultTrace
from megatron_ext.resilience.hardware import Costs, Hardware
from megatron_ext.resilience.job import Job, balanced_layers, fits, node_aligned_job
from megatron_ext.resilience.run import Context
from megatron_ext.resilience.shapes import shape
from megatron_ext.resilience.sim import Simulator, packed_documents

logger = logging.getLogger(__name__)

NODES = 32
SPARE_NODES = 1
GLOBAL_MICROBATCHES = 1024
SEQ_LENGTH = 4096
LAYOUTS = {"llama2-7b": (2, 4, 32), "llama2-13b": (4, 4, 16), "llama2-70b": (8, 8, 4),
           "qwen2.5-14b": (8, 2, 16), "qwen2-57b-a14b": (4, 4, 16)}
ONSET_S = 450.0
MEASURE_S = 3600.0
VICTIM_NODE = 5
STUDIED_SEED = 22
"""The mixed day's seed that was studied hour by hour while readmission and DP growth were built
(issue #47): its rows are not held out."""


START = ("usual", "tuned")


def context(model: str, *, start: str = "usual", hw: Hardware | None = None, costs: Costs | None = None,
            detector_delay: int = 7, detector_severe_factor: float = 2.0, detector_severe_delay: int = 4,
            data_seed: int = 0) -> Context:
    """``start``: ``usual`` (``LAYOUTS``) or ``tuned`` (the simulator's fastest healthy layout with
    at least two stages: what ResiHP's planner could also reach without any fault)."""
    if model not in LAYOUTS:
        raise ValueError(f"no layout for model {model!r}; known: {', '.join(LAYOUTS)}")
    if start not in START:
        raise ValueError(f"start must be one of {', '.join(START)}, got {start!r}")
    hw = hw or Hardware()
    costs = costs or Costs()
    sh = shape(model)
    data = packed_documents(GLOBAL_MICROBATCHES, seq_length=SEQ_LENGTH, seed=data_seed)
    sim = Simulator(sh, hw, data)
    n = NODES * hw.gpus_per_node
    if start == "usual":
        tp, pp, dp = LAYOUTS[model]
        if tp * pp * dp != n:
            raise ValueError(f"{model}: tp {tp} x pp {pp} x dp {dp} is not the {n} GPUs")
        job = node_aligned_job(sh, tp=tp, pp=pp, dp=dp, global_microbatches=GLOBAL_MICROBATCHES,
                               layers=balanced_layers(sh, pp))
        if not fits(sh, job, hw, data.tokens):
            raise ValueError(f"{model}: the layout tp{tp} pp{pp} dp{dp} does not fit in {hw.memory_bytes / 1e9:.0f} GB")
    else:
        job = tuned_job(sim, n)
    return Context(shape=sh, hw=hw, costs=costs, data=data, sim=sim, start=job,
                   num_devices=(NODES + SPARE_NODES) * hw.gpus_per_node, detector_delay=detector_delay,
                   detector_severe_factor=detector_severe_factor, detector_severe_delay=detector_severe_delay)


def tuned_job(sim: Simulator, n: int) -> Job:
    """The fastest healthy node-aligned job over ``n`` devices with PP >= 2 (TP inside a node,
    dividing the heads and query groups; layers balanced; fits in memory)."""
    sh, hw = sim.shape, sim.hw
    best, best_s = None, math.inf
    for tp in (1, 2, 4, 8):
        if tp > hw.gpus_per_node or sh.num_attention_heads % tp or sh.num_query_groups % tp:
            continue
        for pp in (2, 4, 8, 16):
            if pp > sh.num_layers or n % (tp * pp) or n // (tp * pp) > GLOBAL_MICROBATCHES:
                continue
            job = node_aligned_job(sh, tp=tp, pp=pp, dp=n // (tp * pp), global_microbatches=GLOBAL_MICROBATCHES,
                                   layers=balanced_layers(sh, pp))
            if not fits(sh, job, hw, sim.data.tokens):
                continue
            t = sim.healthy(job).time_s
            if t < best_s:
                best, best_s = job, t
    if best is None:
        raise ValueError(f"{sh.name}: no node-aligned layout over {n} devices fits")
    return best


def victim(job: Job, hw: Hardware) -> int:
    """A device on ``VICTIM_NODE``: the first TP rank of the first stage it holds."""
    g = hw.gpus_per_node
    for p in job.pipelines:
        for grp in p.stages:
            if grp[0] // g == VICTIM_NODE:
                return grp[0]
    raise ValueError(f"node {VICTIM_NODE} holds no stage")


def stage_link(job: Job, hw: Hardware, device: int) -> tuple[int, int]:
    """The node pair of ``device``'s pipeline's next stage boundary that crosses nodes; else (its
    node, the next node of the ring)."""
    g = hw.gpus_per_node
    for p in job.pipelines:
        if device in p.devices:
            for k in range(p.pp - 1):
                a, b = p.stages[k][0] // g, p.stages[k + 1][0] // g
                if a != b and device // g in (a, b):
                    return (min(a, b), max(a, b))
    a = device // g
    return (a, (a + 1) % NODES)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[Fault, ...]
    end_s: float
    measure_from_s: float


def scenarios(ctx: Context) -> dict[str, Scenario]:
    hw = ctx.hw
    d = victim(ctx.start, hw)
    node = d // hw.gpus_per_node
    path = stage_link(ctx.start, hw, d)
    end = ONSET_S + MEASURE_S

    def one(name: str, *faults: Fault) -> Scenario:
        return Scenario(name, tuple(faults), end, ONSET_S)

    out = {}
    for f in (1.5, 2.0, 4.0):
        out[f"gpu_slow_{f:g}x"] = one(f"gpu_slow_{f:g}x", Fault("slow_device", d, ONSET_S, factor=f))
    out["node_slow_2x"] = one("node_slow_2x", Fault("slow_node", node, ONSET_S, factor=2.0))
    for f in (2.0, 4.0):
        out[f"nic_1/{f:g}"] = one(f"nic_1/{f:g}", Fault("slow_nic", d, ONSET_S, factor=f))
        out[f"pp_link_1/{f:g}"] = one(f"pp_link_1/{f:g}", Fault("slow_path", path, ONSET_S, factor=f))
    out["gpu_lost"] = one("gpu_lost", Fault("stop_device", d, ONSET_S))
    out["node_lost"] = one("node_lost", Fault("stop_node", node, ONSET_S))
    out["mixed_day"] = Scenario("mixed_day", mixed_day(ctx, seed=STUDIED_SEED), 24 * 3600.0, 0.0)
    return out


def heldout_seeds(commit: str, n: int) -> list[int]:
    """``n`` seeds for held-out mixed days derived from a commit hash (40 hex digits): fixed once the
    code is, and unknown to whoever wrote it. Never the studied seed; no repeats."""
    if not (isinstance(commit, str) and len(commit) == 40 and all(c in "0123456789abcdef" for c in commit.lower())):
        raise ValueError(f"heldout_seeds: a commit hash is 40 hex digits, got {commit!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"--heldout-seeds must be a count >= 0, got {n!r}")
    out: list[int] = []
    i = 0
    while len(out) < n:
        seed = int.from_bytes(hashlib.sha256(f"{commit.lower()}:{i}".encode()).digest()[:4], "big") % (2 ** 31)
        if seed != STUDIED_SEED and seed not in out:
            out.append(seed)
        i += 1
    return out


def heldout_day(ctx: Context, seed: int) -> Scenario:
    """The mixed day drawn with ``seed``: ``mixed_day@<seed>``."""
    return Scenario(f"mixed_day@{seed}", mixed_day(ctx, seed=seed), 24 * 3600.0, 0.0)


def mixed_day(ctx: Context, seed: int) -> tuple[Fault, ...]:
    """A day with the faults above at once-a-day-ish rates, seeded: six GPU fail-slow episodes
    (x1.3-4 log-uniform, Pareto durations from 10 minutes, shape 1.5, capped at 4 hours), a node
    slow 2x for two hours, a NIC at 1/4 for three hours, a GPU lost and a node lost."""
    rng = np.random.default_rng(seed)
    g, day = ctx.hw.gpus_per_node, 24 * 3600.0
    used = NODES * g
    faults = []
    for _ in range(6):
        start = float(rng.uniform(0, day - 600))
        dur = min(600.0 * (1 + rng.pareto(1.5)), 4 * 3600.0)
        faults.append(Fault("slow_device", int(rng.integers(used)), start, start + dur,
                            float(math.exp(rng.uniform(math.log(1.3), math.log(4.0))))))
    s = float(rng.uniform(0, day - 7200))
    faults.append(Fault("slow_node", int(rng.integers(NODES)), s, s + 7200, 2.0))
    s = float(rng.uniform(0, day - 3 * 3600))
    faults.append(Fault("slow_nic", int(rng.integers(used)), s, s + 3 * 3600, 4.0))
    faults.append(Fault("stop_device", int(rng.integers(used)), float(rng.uniform(0, day))))
    faults.append(Fault("stop_node", int(rng.integers(NODES)), float(rng.uniform(0, day))))
    return tuple(sorted(faults, key=lambda f: f.start_s))


def trace(ctx: Context, scenario: Scenario) -> FaultTrace:
    return FaultTrace(ctx.num_devices, ctx.hw.gpus_per_node, scenario.faults)


__all__ = ["Scenario", "context", "heldout_day", "heldout_seeds", "scenarios", "trace", "LAYOUTS", "STUDIED_SEED", "Simulator"]
