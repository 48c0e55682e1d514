"""Hydro's end-to-end setting in the cluster simulator: one tuning job with a single exclusive GPU
while large pipeline-parallel jobs hold most of the cluster, its trials run with exclusive GPUs only
and with the pipelines' bubbles as a resource (``python -m megatron_ext.cluster scenario``).
"""
from __future__ import annotations

import dataclasses

from megatron_ext.cluster.bubbles import host_slots
from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.engine import VCSimulator
from megatron_ext.cluster.state import JobState
from megatron_ext.cluster.trace import Job, VCSpec
from megatron_ext.config.base import ConfigError, doc


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
