"""Configuration of the cluster scheduler simulator (``python -m megatron_ext.cluster``).

One ``kw_only`` dataclass; every field is also a flag of the CLI (``load_scale`` -> ``--load-scale``)
and a key of an optional YAML file (``--config sim.yaml``; flags override YAML).
"""
from __future__ import annotations

import dataclasses

from megatron_ext.config.base import ConfigError, doc

POLICIES = ("fifo", "sjf", "srtf", "tiresias", "qssf", "ftf")
# Policies the Helios artifact's QSSF-service simulator implements (``--helios-compat``).
HELIOS_POLICIES = ("fifo", "sjf", "srtf", "qssf")
PLACEMENTS = ("consolidate", "consolidate_first", "scatter")
BACKFILLS = ("none", "greedy", "easy")
TRACE_FORMATS = ("auto", "philly", "generic")
QSSF_ESTIMATORS = ("history", "noisy_oracle")


@dataclasses.dataclass(kw_only=True)
class ClusterSimConfig:
    """Trace-driven GPU-cluster scheduler simulation."""

    trace: str = doc("Job trace CSV (Philly format or the generic format of docs/cluster.md).", "")
    vc_config: str = doc("Virtual-cluster CSV: 'vc,node num' (Helios format), optional "
                         "'gpus_per_node' and 'gpu_type' columns.", "")
    trace_format: str = doc("Trace format; 'auto' decides from the header.", "auto", choices=TRACE_FORMATS)
    policy: str = doc("Scheduling policy.", "fifo", choices=POLICIES)
    load_scale: float = doc("Divide every arrival's offset from the first submit by this factor "
                            "(2 = arrivals twice as dense).", 1.0)
    helios_compat: bool = doc("Follow the Helios artifact's simulator semantics exactly (integer "
                              "seconds, consolidate placement, its FIFO/SJF/SRTF, and QSSF with its "
                              "Philly estimator).", False)
    skip_bad_rows: bool = doc("Drop malformed trace rows (each logged with line and reason) instead "
                              "of failing.", False)
    gpus_per_node: int = doc("GPUs per node when the VC file has no 'gpus_per_node' column.", 8)
    placement: str = doc("Placement: 'consolidate' waits for a packed allocation, "
                         "'consolidate_first' falls back to any GPUs, 'scatter' spreads.",
                         "consolidate", choices=PLACEMENTS)
    spread_slowdown: float = doc("Run-time factor (>= 1) for a job spread over more nodes than it "
                                 "needs.", 1.0)
    backfill: str = doc("Non-preemptive policies: 'none' blocks at the first job that does not fit; "
                        "'greedy' starts any later job that fits; 'easy' only if it does not delay "
                        "the blocked head (oracle run times).", "none", choices=BACKFILLS)
    restart_cost_s: list[float] = doc("Seconds of extra work a preempted job pays on restart, for "
                                      "1 GPU / up to one node / more (Helios: 7 30 60).",
                                      default_factory=lambda: [7.0, 30.0, 60.0])
    las_thresholds_gpu_s: list[float] = doc("Tiresias queue thresholds in attained GPU-seconds "
                                            "(K-1 values for K queues).",
                                            default_factory=lambda: [3250.0])
    las_promote_knob: float = doc("Tiresias starvation knob: a job waiting longer than this times its "
                                  "executed time returns to the top queue; 0 disables.", 0.0)
    ftf_lease_s: float = doc("Finish-time fairness: seconds between preemption rounds.", 3600.0)
    qssf_estimator: str = doc("QSSF duration estimate: 'history' (mean of the user's finished jobs, "
                              "VC when the trace has no users) or 'noisy_oracle' (Helios' Philly "
                              "error distribution).", "history", choices=QSSF_ESTIMATORS)
    estimator_seed: int = doc("Seed of the noisy-oracle estimator.", 0)
    gpu_speeds: list[str] = doc("Relative speed per GPU type, 'type=speed' (jobs given as 'work' run "
                                "work/speed seconds).", default_factory=list)
    bubble_speed: float = doc("Speed of a trial on a pipeline bubble, as a fraction of exclusive "
                              "speed (capped by the bubble fraction).", 0.15)
    bubble_speed_from: str | None = doc("Bubble Squeezer figures (a figures_rank*.json of a --squeeze run, or "
                                        "its directory): a trial on a bubble runs at the measured work per "
                                        "bubble-second times the host's bubble fraction, instead of "
                                        "--bubble-speed.", None)
    gpu_mem_gb: float = doc("GPU memory; a trial fits a bubble only within the host's spare memory.", 80.0)

    def __post_init__(self) -> None:
        if self.load_scale <= 0:
            raise ConfigError(f"--load-scale must be > 0, got {self.load_scale}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.spread_slowdown < 1:
            raise ConfigError(f"--spread-slowdown must be >= 1, got {self.spread_slowdown}")
        if len(self.restart_cost_s) == 1:
            self.restart_cost_s = list(self.restart_cost_s) * 3
        if len(self.restart_cost_s) != 3 or min(self.restart_cost_s) < 0:
            raise ConfigError(f"--restart-cost-s takes 1 or 3 values >= 0, got {self.restart_cost_s}")
        if sorted(self.las_thresholds_gpu_s) != list(self.las_thresholds_gpu_s) or \
                any(t <= 0 for t in self.las_thresholds_gpu_s):
            raise ConfigError("--las-thresholds-gpu-s must be increasing values > 0, got "
                              f"{self.las_thresholds_gpu_s}")
        if self.las_promote_knob < 0:
            raise ConfigError(f"--las-promote-knob must be >= 0, got {self.las_promote_knob}")
        if self.ftf_lease_s <= 0:
            raise ConfigError(f"--ftf-lease-s must be > 0, got {self.ftf_lease_s}")
        if not 0 < self.bubble_speed <= 1:
            raise ConfigError(f"--bubble-speed must be in (0, 1], got {self.bubble_speed}")
        self.work_per_bubble_s = (measured_work_per_bubble_s(self.bubble_speed_from)
                                  if self.bubble_speed_from else None)
        if self.gpu_mem_gb <= 0:
            raise ConfigError(f"--gpu-mem-gb must be > 0, got {self.gpu_mem_gb}")
        self.speed_table()  # validates --gpu-speeds
        if self.helios_compat:
            if self.policy not in HELIOS_POLICIES:
                raise ConfigError(f"--policy {self.policy} has no counterpart in the Helios simulator; "
                                  f"with --helios-compat use one of {', '.join(HELIOS_POLICIES)}")
            if self.placement != "consolidate" or self.backfill != "none":
                raise ConfigError("--helios-compat fixes --placement consolidate and --backfill none")

    def guest_speed(self, bubble_fraction: float) -> float:
        """Speed of a trial on a bubble of a host idle ``bubble_fraction`` of the time, as a share
        of its exclusive speed."""
        if self.work_per_bubble_s is not None:
            return self.work_per_bubble_s * bubble_fraction
        return min(self.bubble_speed, bubble_fraction)

    def speed_table(self) -> dict[str, float]:
        table: dict[str, float] = {}
        for item in self.gpu_speeds:
            name, sep, value = item.partition("=")
            try:
                speed = float(value)
            except ValueError:
                speed = -1.0
            if not sep or not name or speed <= 0:
                raise ConfigError(f"--gpu-speeds entry {item!r} is not 'type=speed' with speed > 0")
            table[name] = speed
        return table

    def restart_cost(self, gpus: int, gpus_per_node: int) -> float:
        """Checkpoint-restore cost of a preempted job, tiered like the Helios artifact."""
        if gpus <= 1:
            return self.restart_cost_s[0]
        if gpus <= gpus_per_node:
            return self.restart_cost_s[1]
        return self.restart_cost_s[2]


def measured_work_per_bubble_s(path: str) -> float:
    """Exclusive-seconds of guest work per bubble-second, from a squeezer run's figures: its
    ``work_per_bubble_s`` (the benchmark measures it against the bundle run alone) or, in a
    training run's figures, ``bubble_used`` (time guests ran inside windows, at their in-window
    speed taken as exclusive). A directory averages its ``figures_rank*.json``, weighted by bubble
    time."""
    import glob
    import json
    import os

    files = sorted(glob.glob(os.path.join(path, "figures_rank*.json"))) if os.path.isdir(path) else [path]
    if not files:
        raise ConfigError(f"--bubble-speed-from: {path} holds no figures_rank*.json (the --squeeze-dir of a run)")
    num = den = 0.0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                fig = json.load(fh)
        except OSError as exc:
            raise ConfigError(f"--bubble-speed-from: {f}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--bubble-speed-from: {f}: not JSON ({exc.msg} at line {exc.lineno})") from None
        value = fig.get("work_per_bubble_s", fig.get("bubble_used")) if isinstance(fig, dict) else None
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"--bubble-speed-from: {f}: no work_per_bubble_s or bubble_used in [0, 1] "
                              "(a Bubble Squeezer figures file?)")
        weight = float(fig.get("window_s", 1.0)) or 1.0
        num += value * weight
        den += weight
    value = num / den
    if value <= 0:
        raise ConfigError(f"--bubble-speed-from: {path}: the guests did no work in the bubbles (0)")
    return value
