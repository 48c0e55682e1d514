"""ResiHP detector configuration: flags ``--resihp*`` and the YAML keys of the same names.

What a lost rank leads to (heartbeats, on-stop action, respawn, exit file) is the fault-tolerance
core's: ``--ft-*`` (``ft/config.py``).
"""
from __future__ import annotations

import dataclasses

from megatron_ext.config.base import ConfigError, doc
from megatron_ext.config.run import section

DETECTORS = ("resihp", "raw")


@section("resihp")
@dataclasses.dataclass(kw_only=True)
class ResiHPConfig:
    """ResiHP fail-slow / fail-stop detection (FLOPs-normalised, pipeline-simulated)."""

    resihp: bool = doc("Run the ResiHP detector in the training loop.", False)
    resihp_detector: str = doc("Which detector issues verdicts: 'resihp' (FLOPs-normalised) or 'raw' "
                               "(per-rank busy time against its own median: the baseline).", "resihp",
                               choices=DETECTORS)
    resihp_threshold: float = doc("Fail-slow when a rank runs at least this many times slower than expected.",
                                  1.25)
    resihp_zscore: float = doc("...and the deviation is at least this many robust standard deviations of "
                               "the rank's healthy noise (so a noisy host needs a larger slowdown).", 2.0)
    resihp_window: int = doc("Persistence: a verdict needs all but one of a rank's last N iterations past "
                             "both bounds, the current one included.", 8)
    resihp_severe_factor: float = doc("A rank at least this many times slower than expected in each of its last "
                                      "--resihp-severe-window iterations is named at once, without waiting for "
                                      "--resihp-window (0: off).", 2.0)
    resihp_severe_window: int = doc("Consecutive iterations past --resihp-severe-factor that name a rank.", 4)
    resihp_warmup: int = doc("Iterations used to calibrate throughput before any fail-slow verdict.", 20)
    resihp_calibration_window: int = doc("Healthy iterations kept for the rolling calibration.", 100)
    resihp_refit_every: int = doc("Refit the throughput model every N iterations after warm-up.", 25)
    resihp_rank_bias_max: float = doc("Largest steady per-rank speed difference from its stage's peers that "
                                      "calibration accepts as normal (a rank slow from the start beyond "
                                      "this is still caught).", 1.1)
    resihp_common_mode: bool = doc("Score each rank against the median of the other ranks of the same "
                                   "iteration, so slowdowns all ranks share (host load, a data mix the "
                                   "FLOPs model misses) cancel. A slowdown of half the ranks or more is "
                                   "then not seen.", True)
    resihp_noise_floor: float = doc("Smallest relative noise assumed for a rank's score (keeps z-scores "
                                    "finite on very quiet runs).", 0.01)
    resihp_p2p_latency_s: float = doc("Point-to-point latency assumed by the pipeline simulation.", 0.0)
    resihp_links: bool = doc("Also watch the pipeline links (links.py): a link whose messages arrive late while "
                             "their receiver waits is named slow_link.", True)
    resihp_link_floor_ms: float = doc("Smallest excess over the healthy round trip of a link's messages that "
                                      "flags it, in milliseconds.", 10.0)
    resihp_link_severe_factor: float = doc("A pipeline link, NIC or path whose excess is at least this many times "
                                           "its flag's margin (max(--resihp-link-floor-ms, 4 x noise)) in each of its "
                                           "last --resihp-severe-window observations is named then, without waiting "
                                           "for --resihp-window (0: off).", 2.0)
    resihp_nic_probe_interval: int = doc("Every N iterations, time a small message from each rank to both of its "
                                         "ring neighbours (nic.py) and name a device whose sends are slow (slow_nic); "
                                         "0: off. A collective of all ranks per probe.", 0)
    resihp_nic_probe_kb: int = doc("Size of each ring-probe message, in KiB.", 64)
    resihp_trace_out: str = doc("Write the detector's input, one JSON record per iteration, to this "
                                "file (trace format v1, docs/resihp_trace_format.md).", "")
    resihp_verdicts_out: str = doc("Append verdicts as JSON lines to this file.", "")
    resihp_control_file: str = doc("Read this JSON file at iteration boundaries when it changes, to turn fail-slow "
                                   "detection off and on, change --resihp-threshold / --resihp-window, or ask "
                                   "for the detector's state (resihp/control.py); each change is logged.", "")
    resihp_act: str = doc("What a verdict leads to: 'off' (nothing), 'plan' (the re-layout planner's plan is "
                          "logged only), 'relayout' (the plan is applied live, as far as the engine's "
                          "re-layout knobs go: layers per stage, micro-batches per replica, a rank "
                          "permutation; other TP x PP x DP sizes with --resihp-act-reshape; a plan that "
                          "needs another engine's knob is logged, not applied).", "off",
                          choices=("off", "plan", "relayout"))
    resihp_act_reshape: bool = doc("Under --resihp-act relayout, also search other TP x PP x DP sizes over the same "
                                   "ranks (every group and model chunk rebuilt, state moved: the heaviest change; "
                                   "a slow NIC's data-parallel ring is only left by a shape without one over it).",
                                   False)
    resihp_act_min_gain: float = doc("Act only on a plan that shortens the iteration by more than this "
                                     "fraction, after its pause is amortized over --resihp-act-horizon.", 0.05)
    resihp_act_min_gain_healthy: float = doc("The threshold instead of --resihp-act-min-gain for a plan between "
                                             "layouts whose ranks are all believed healthy (a grow back onto "
                                             "returned ranks): only the cost model's error is at stake.", 0.02)
    resihp_act_horizon: int = doc("Iterations over which a re-layout's pause is amortized.", 500)

    def __post_init__(self) -> None:
        if self.resihp_detector not in DETECTORS:
            raise ConfigError(f"--resihp-detector must be one of {', '.join(DETECTORS)}, got {self.resihp_detector!r}")
        if not self.resihp_threshold > 1.0:
            raise ConfigError(f"--resihp-threshold must be > 1 (a slowdown factor), got {self.resihp_threshold}")
        if self.resihp_zscore < 0:
            raise ConfigError(f"--resihp-zscore must be >= 0, got {self.resihp_zscore}")
        if self.resihp_window < 1:
            raise ConfigError(f"--resihp-window must be >= 1, got {self.resihp_window}")
        if self.resihp_severe_factor and not self.resihp_severe_factor >= self.resihp_threshold:
            raise ConfigError(f"--resihp-severe-factor must be 0 (off) or >= --resihp-threshold "
                              f"({self.resihp_threshold}), got {self.resihp_severe_factor}")
        if self.resihp_nic_probe_interval < 0:
            raise ConfigError(f"--resihp-nic-probe-interval must be >= 0 (0: off), got {self.resihp_nic_probe_interval}")
        if self.resihp_nic_probe_kb < 1:
            raise ConfigError(f"--resihp-nic-probe-kb must be >= 1, got {self.resihp_nic_probe_kb}")
        if self.resihp_link_severe_factor and not self.resihp_link_severe_factor > 1:
            raise ConfigError(f"--resihp-link-severe-factor must be 0 (off) or > 1, got "
                              f"{self.resihp_link_severe_factor}")
        if self.resihp_severe_window < 1:
            raise ConfigError(f"--resihp-severe-window must be >= 1, got {self.resihp_severe_window}")
        if self.resihp_warmup < 3:
            raise ConfigError(f"--resihp-warmup must be >= 3 (calibration needs a few iterations), "
                              f"got {self.resihp_warmup}")
        if self.resihp_calibration_window < self.resihp_warmup:
            raise ConfigError(f"--resihp-calibration-window ({self.resihp_calibration_window}) must be >= "
                              f"--resihp-warmup ({self.resihp_warmup})")
        if self.resihp_refit_every < 1:
            raise ConfigError(f"--resihp-refit-every must be >= 1, got {self.resihp_refit_every}")
        if self.resihp_rank_bias_max < 1.0:
            raise ConfigError(f"--resihp-rank-bias-max must be >= 1, got {self.resihp_rank_bias_max}")
        if not self.resihp_rank_bias_max < self.resihp_threshold:
            raise ConfigError(f"--resihp-rank-bias-max ({self.resihp_rank_bias_max}) must be below "
                              f"--resihp-threshold ({self.resihp_threshold}), or a slow rank could be "
                              "calibrated as normal")
        if self.resihp_noise_floor <= 0:
            raise ConfigError(f"--resihp-noise-floor must be > 0, got {self.resihp_noise_floor}")
        if self.resihp_p2p_latency_s < 0:
            raise ConfigError(f"--resihp-p2p-latency-s must be >= 0, got {self.resihp_p2p_latency_s}")
        if not self.resihp_link_floor_ms > 0:
            raise ConfigError(f"--resihp-link-floor-ms must be > 0, got {self.resihp_link_floor_ms}")
        if self.resihp_links and self.resihp_window < 2:
            raise ConfigError("--resihp-window must be >= 2 while --resihp-links is on (a link's verdict needs "
                              f"all but one of its last N iterations flagged), got {self.resihp_window}")
        if not 0 <= self.resihp_act_min_gain < 1:
            raise ConfigError(f"--resihp-act-min-gain must be in [0, 1), got {self.resihp_act_min_gain}")
        if not 0 <= self.resihp_act_min_gain_healthy < 1:
            raise ConfigError(f"--resihp-act-min-gain-healthy must be in [0, 1), got {self.resihp_act_min_gain_healthy}")
        if self.resihp_act_horizon < 1:
            raise ConfigError(f"--resihp-act-horizon must be >= 1, got {self.resihp_act_horizon}")

    def capabilities(self) -> dict[str, str]:
        """What the rest of the job must know of this section (``RunConfig.capability``): the
        detector's fail-stop verdicts come from the fault-tolerance core, so ``--resihp`` runs it."""
        return {"fault_tolerance": "--resihp"} if self.resihp else {}

    @property
    def nic_probe_warmup(self) -> int:
        """Probes the NIC detector calibrates on: as many as fit in ``--resihp-warmup`` iterations at
        the probe's interval, at least 3 (0 with the probe off)."""
        every = self.resihp_nic_probe_interval
        return max(3, self.resihp_warmup // every) if every else 0
