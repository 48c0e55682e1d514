"""Pipeline bubbles as a low-priority GPU resource (Hydro's Bubble Squeezer, modelled).

A running pipeline-parallel job leaves each of its GPUs idle for a fraction ``b`` of the time: the
1F1B / GPipe bubble (p-1)/(m+p-1) for p stages and m micro-batches, or a measured fraction. Each of
its GPUs becomes a *bubble slot* that one bubble-tolerant job (a 1-GPU HPO trial) may use:

* the guest runs at ``min(bubble_speed, b)`` of its exclusive speed — Hydro measured about 15 % of
  exclusive throughput for fused trials in bubbles, and a guest cannot get more than the idle share;
  or, with ``--bubble-speed-from`` a Bubble Squeezer run's figures, at the measured work per
  bubble-second times ``b``;
* the guest must fit the host GPU's spare memory. Under 1F1B, stage ``s`` of ``p`` holds
  ``min(p - s, m)`` micro-batches of activations, so early stages have less room:
  ``spare = gpu_mem - (mem_gb + act_mem_gb * min(p - s, m))``;
* the host is not slowed (Hydro observed no visible slowdown of the GPT job); when the host stops,
  its guests are displaced and re-queued with the restart cost.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Iterable

from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.trace import Job, VCSpec
from megatron_ext.config.base import ConfigError, doc
from megatron_ext.pipeline.bubbles import idle_fraction

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.cluster.state import JobState

logger = logging.getLogger(__name__)


def bubble_fraction_from_timeline(busy: "Iterable[tuple[float, float]]", start: float, end: float) -> float:
    """Idle share of one GPU over ``[start, end)`` from its busy intervals (e.g. the forward/backward
    events of one pipeline stage over a few iterations): a measured value for a trace's
    ``bubble_fraction`` column. The definition the timeline and the squeezer use."""
    return idle_fraction(busy, start, end)


class BubbleSlot:
    __slots__ = ("host", "stage", "spare_gb", "speed", "guest")

    def __init__(self, host: "JobState", stage: int, spare_gb: float, speed: float):
        self.host = host
        self.stage = stage
        self.spare_gb = spare_gb
        self.speed = speed
        self.guest: "JobState | None" = None

    def __repr__(self) -> str:
        return f"BubbleSlot(host={self.host.job.job_id}, stage={self.stage}, spare={self.spare_gb}GB, speed={self.speed})"


def host_slots(host: "JobState", bubble_speed: float, gpu_mem_gb: float,
               work_per_bubble_s: float | None = None) -> list[BubbleSlot]:
    """The bubble slots a running pipeline job offers, one per GPU. A guest runs at
    ``min(bubble_speed, b)``, or at ``work_per_bubble_s * b`` when that was measured."""
    job = host.job
    speed = work_per_bubble_s * job.bubble if work_per_bubble_s is not None else min(bubble_speed, job.bubble)
    if speed <= 0:
        return []
    p, m = max(1, job.pp_stages), max(1, job.micro_batches)
    per_stage = max(1, job.gpus // p)
    slots = []
    for stage in range(p):
        spare = gpu_mem_gb - (job.mem_gb + job.act_mem_gb * min(p - stage, m))
        slots.extend(BubbleSlot(host, stage, spare, speed) for _ in range(per_stage))
    return slots


class BubblePool:
    """Bubble slots of the running pipeline jobs of one VC."""

    def __init__(self, bubble_speed: float, gpu_mem_gb: float, work_per_bubble_s: float | None = None):
        self.bubble_speed = bubble_speed
        self.gpu_mem_gb = gpu_mem_gb
        self.work_per_bubble_s = work_per_bubble_s
        self.by_host: dict[int, list[BubbleSlot]] = {}
        self.free: list[BubbleSlot] = []

    def add_host(self, host: "JobState") -> None:
        slots = host_slots(host, self.bubble_speed, self.gpu_mem_gb, self.work_per_bubble_s)
        if slots:
            self.by_host[id(host)] = slots
            self.free.extend(slots)

    def remove_host(self, host: "JobState") -> list["JobState"]:
        """Drop a stopped host's slots; returns the guests that lose their slot."""
        slots = self.by_host.pop(id(host), None)
        if not slots:
            return []
        gone = {id(s) for s in slots}
        self.free = [s for s in self.free if id(s) not in gone]
        return [s.guest for s in slots if s.guest is not None]

    def acquire(self, guest: "JobState", mem_gb: float) -> BubbleSlot | None:
        """The fastest free slot with room for ``mem_gb``; among equals the tightest fit, so that
        roomy slots stay for bigger guests."""
        best = None
        for slot in self.free:
            if slot.spare_gb >= mem_gb and (best is None or (slot.speed, -slot.spare_gb) > (best.speed, -best.spare_gb)):
                best = slot
        if best is not None:
            self.free.remove(best)
            best.guest = guest
        return best

    def release(self, slot: BubbleSlot) -> None:
        slot.guest = None
        if id(slot.host) in self.by_host:
            self.free.append(slot)

    def has_room(self) -> bool:
        return bool(self.free)


@dataclasses.dataclass(kw_only=True)
class TuningScenario:
    """One tuning job with a single exclusive GPU while large pipeline-parallel jobs hold most of the
    cluster (Hydro's end-to-end setting). Defaults: 5 nodes x 8 GPUs; one 32-GPU GPT job with 4
    stages and 8 micro-batches (bubble 3/11) that runs for the whole experiment; seven 1-GPU
    training jobs; 32 trials of 0.5-1.5 h (evenly spread) needing 20 GB each. Fields are prefixed
    ``scenario_`` because flag names are global."""

    scenario_nodes: int = doc("Nodes of the scenario's cluster.", 5)
    scenario_gpus_per_node: int = doc("GPUs per node.", 8)
    scenario_pipeline_jobs: int = doc("Pipeline-parallel jobs holding the cluster.", 1)
    scenario_pipeline_gpus: int = doc("GPUs of each pipeline job.", 32)
    scenario_pp_stages: int = doc("Pipeline stages of each pipeline job.", 4)
    scenario_micro_batches: int = doc("Micro-batches per iteration of each pipeline job.", 8)
    scenario_pipeline_mem_gb: float = doc("Weights + optimizer state per GPU of a pipeline job.", 40.0)
    scenario_pipeline_act_mem_gb: float = doc("Activation memory per in-flight micro-batch.", 8.0)
    scenario_tuning_gpus: int = doc("GPUs left to the tuning job (1-GPU training jobs hold the rest).", 1)
    scenario_trials: int = doc("Trials of the tuning job.", 32)
    scenario_trial_min_s: float = doc("Shortest trial (exclusive seconds); trials are spread evenly.", 1800.0)
    scenario_trial_max_s: float = doc("Longest trial (exclusive seconds).", 5400.0)
    scenario_trial_mem_gb: float = doc("GPU memory a trial needs.", 20.0)

    def __post_init__(self) -> None:
        if self.scenario_pp_stages < 2 or self.scenario_micro_batches < 1:
            raise ConfigError("need --scenario-pp-stages >= 2 and --scenario-micro-batches >= 1")
        if self.scenario_trials < 1 or self.scenario_tuning_gpus < 1:
            raise ConfigError("need --scenario-trials >= 1 and --scenario-tuning-gpus >= 1")
        if self.scenario_pipeline_gpus % self.scenario_pp_stages:
            raise ConfigError(f"--scenario-pipeline-gpus {self.scenario_pipeline_gpus} is not a multiple "
                              f"of --scenario-pp-stages {self.scenario_pp_stages}")
        held = self.scenario_pipeline_jobs * self.scenario_pipeline_gpus
        if held + self.scenario_tuning_gpus > self.total_gpus:
            raise ConfigError(f"pipeline jobs ({held} GPUs) + tuning ({self.scenario_tuning_gpus}) exceed "
                              f"the scenario's {self.total_gpus} GPUs")
        if not 0 < self.scenario_trial_min_s <= self.scenario_trial_max_s:
            raise ConfigError("need 0 < --scenario-trial-min-s <= --scenario-trial-max-s")

    @property
    def total_gpus(self) -> int:
        return self.scenario_nodes * self.scenario_gpus_per_node

    def jobs(self) -> list[Job]:
        """Everything arrives at t=0, big jobs first; they outlast the tuning by far."""
        long_s = 30 * 86400.0
        jobs: list[Job] = []
        for k in range(self.scenario_pipeline_jobs):
            jobs.append(Job(f"gpt{k}", 0, 0.0, long_s, self.scenario_pipeline_gpus, "scenario",
                            kind="pipeline", pp_stages=self.scenario_pp_stages,
                            micro_batches=self.scenario_micro_batches, mem_gb=self.scenario_pipeline_mem_gb,
                            act_mem_gb=self.scenario_pipeline_act_mem_gb))
        busy = self.scenario_pipeline_jobs * self.scenario_pipeline_gpus + self.scenario_tuning_gpus
        for k in range(self.total_gpus - busy):
            jobs.append(Job(f"train{k}", 0, 0.0, long_s, 1, "scenario", kind="train", mem_gb=70.0))
        lo, hi, n = self.scenario_trial_min_s, self.scenario_trial_max_s, self.scenario_trials
        for k in range(n):
            frac = k / (n - 1) if n > 1 else 0.0
            jobs.append(Job(f"trial{k}", 0, 0.0, lo + (hi - lo) * frac, 1, "scenario", kind="hpo",
                            mem_gb=self.scenario_trial_mem_gb))
        return jobs


def run_tuning_scenario(scn: TuningScenario, cfg: ClusterSimConfig) -> dict[str, float]:
    """Tuning makespan (the last trial's completion) with exclusive GPUs only and with bubbles."""
    from megatron_ext.cluster.engine import VCSimulator
    from megatron_ext.cluster.state import JobState

    spec = VCSpec("scenario", scn.scenario_nodes, scn.scenario_gpus_per_node)
    out: dict[str, float] = {}
    for label, use in (("exclusive", False), ("bubbles", True)):
        run = VCSimulator(spec, scn.jobs(), cfg, use_bubbles=use).run()
        trials = [js for js in run.states if js.job.kind == "hpo"]
        out[f"makespan_{label}_s"] = max(js.end for js in trials)
        out[f"trial_bubble_s_{label}"] = sum(js.bubble_s for js in trials)
    slots = [s for job in scn.jobs() if job.kind == "pipeline"
             for s in host_slots(JobState(job, 0), cfg.bubble_speed, cfg.gpu_mem_gb, cfg.work_per_bubble_s)]
    p, m = scn.scenario_pp_stages, scn.scenario_micro_batches
    out["bubble_slots"] = float(len(slots))
    out["usable_bubble_slots"] = float(sum(s.spare_gb >= scn.scenario_trial_mem_gb for s in slots))
    out["bubble_fraction"] = (p - 1) / (m + p - 1)
    out["guest_speed"] = cfg.guest_speed(out["bubble_fraction"])
    out["makespan_ratio"] = out["makespan_exclusive_s"] / out["makespan_bubbles_s"]
    return out
