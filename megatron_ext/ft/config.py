"""The fault-tolerance core's configuration: flags ``--ft-*`` and the YAML keys of the same names.

The core (``ft/core.py``) runs for a plain job as well as under ResiHP: ``--ft`` switches it on;
``--ft-on-stop continue`` needs it, so it switches it on too; and an extension section that
declares the ``fault_tolerance`` capability (ResiHP: its fail-stop verdicts come from the core)
does the same. Every field had a ``--resihp-*`` name before this section existed; those spellings
still work and say once which name replaced them.

``launcher_for`` is the one place that decides how ``pretrain_gpt.py --nproc-per-node N`` starts
its ranks, and ``enabled`` whether a rank builds the core.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ext.config.base import ConfigError, doc
from megatron_ext.config.run import section

ON_STOP = ("abort", "report", "continue")


@section("ft")
@dataclasses.dataclass(kw_only=True)
class FaultToleranceConfig:
    """Fault tolerance: heartbeats, and what a lost rank leads to."""

    ft: bool = doc("Run the fault-tolerance core: every rank beats a heartbeat and a lost rank is named, then "
                   "handled per --ft-on-stop. On by itself with --ft-on-stop continue and with --resihp.", False)
    ft_on_stop: str = doc("On a lost rank: 'abort' the job at once (exit 75, naming the rank; the last "
                          "checkpoint stays), only 'report' it, or 'continue' on the survivors without a "
                          "restart (needs the project's launcher, pretrain_gpt.py --nproc-per-node N, or a "
                          "store from python -m megatron_ext.ft.store). The survivors' layout comes from "
                          "ResiHP's planner with --resihp, else from the core's own chooser (the same TP and "
                          "PP, as many data-parallel replicas as the survivors fill).", "abort",
                          choices=ON_STOP, renamed_from="resihp_on_stop")
    ft_heartbeat_interval_s: float = doc("How often each rank publishes a heartbeat.", 1.0,
                                         renamed_from="resihp_heartbeat_interval_s")
    ft_heartbeat_timeout_s: float = doc("Fail-stop when a rank's heartbeat is older than this.", 10.0,
                                        renamed_from="resihp_heartbeat_timeout_s")
    ft_exit_file: str = doc("When a lost rank or an error ends the job, the rank that ends it writes "
                            "{\"code\": 75|1|2, \"message\": ..., \"lost\": [...]} here (75: resume with "
                            "--load). For launchers whose own exit code does not carry it: torchrun exits 1 "
                            "whatever its workers' codes. Remove it before each launch.", "",
                            renamed_from="resihp_exit_file")
    ft_respawn: int = doc("With --ft-on-stop continue under the project's launcher: start a lost rank's "
                          "process again, up to N times per rank; the new process joins at the next iteration "
                          "boundary and the layout chooser re-expands the layout to use it.", 0,
                          renamed_from="resihp_respawn")
    ft_keep_newer_stages: bool = doc("With --ft-on-stop continue, when a lost rank's state has no copy "
                                     "in memory: take only its shards from the last checkpoint and keep the "
                                     "other stages' newer state (stages from different iterations), instead "
                                     "of rolling every stage back to the checkpoint (the default).", False,
                                     renamed_from="resihp_keep_newer_stages")
    ft_continue_experimental_nccl: bool = doc("Allow --ft-on-stop continue on NCCL, whose abort path has "
                                              "not run on a machine with two GPUs yet.", False,
                                              renamed_from="resihp_continue_experimental_nccl")
    ft_continue_timeout_s: float = doc("With --ft-on-stop continue: the timeout of every collective and "
                                       "of each step of a regroup, so that nothing waits for a lost rank "
                                       "longer (it must exceed the longest wait of a healthy run, e.g. a "
                                       "checkpoint save).", 120.0, renamed_from="resihp_continue_timeout_s")

    ft_hang_timeout_s: float = doc("A rank alive (its heartbeat beats) whose training thread makes no progress "
                                   "for this long, while not waiting on a peer, is hung: named with where it "
                                   "stopped and its stack, then handled as a lost rank per --ft-on-stop. 0: "
                                   "derived, 10 x the median iteration time and at least 60 s (under continue "
                                   "at most 0.75 x --ft-continue-timeout-s), armed after 2 iterations of each "
                                   "layout.", 0.0)
    ft_grace_s: float = doc("Once the job has decided (go on without a rank, abort, fail), a rank that has not "
                            "followed this long after is terminated (by itself, else by the project's launcher: "
                            "SIGTERM, then SIGKILL after as long again).", 10.0)

    def __post_init__(self) -> None:
        if self.ft_hang_timeout_s < 0:
            raise ConfigError(f"--ft-hang-timeout-s must be >= 0 (0: derived), got {self.ft_hang_timeout_s}")
        if self.ft_grace_s <= 0:
            raise ConfigError(f"--ft-grace-s must be > 0, got {self.ft_grace_s}")
        if self.ft_on_stop == "continue" and self.ft_hang_timeout_s >= self.ft_continue_timeout_s:
            raise ConfigError(f"--ft-hang-timeout-s ({self.ft_hang_timeout_s:g}) must be below "
                              f"--ft-continue-timeout-s ({self.ft_continue_timeout_s:g}): the survivors' collectives "
                              "with a hung rank would time out before it is named")
        if self.ft_heartbeat_interval_s <= 0:
            raise ConfigError(f"--ft-heartbeat-interval-s must be > 0, got {self.ft_heartbeat_interval_s}")
        if self.ft_respawn < 0:
            raise ConfigError(f"--ft-respawn must be >= 0, got {self.ft_respawn}")
        if self.ft_continue_timeout_s <= self.ft_heartbeat_timeout_s:
            raise ConfigError(f"--ft-continue-timeout-s ({self.ft_continue_timeout_s}) must exceed "
                              f"--ft-heartbeat-timeout-s ({self.ft_heartbeat_timeout_s})")
        if self.ft_heartbeat_timeout_s <= self.ft_heartbeat_interval_s:
            raise ConfigError(f"--ft-heartbeat-timeout-s ({self.ft_heartbeat_timeout_s}) must exceed "
                              f"--ft-heartbeat-interval-s ({self.ft_heartbeat_interval_s})")


FAULT_TOLERANCE = "fault_tolerance"
"""The capability an extension section declares when it needs the core (``RunConfig.capability``)."""


def section_of(cfg: Any) -> FaultToleranceConfig:
    """The run's ``ft`` section (its defaults where the config was built without it)."""
    return cfg.ext("ft") or FaultToleranceConfig()


def continues(cfg: Any) -> bool:
    """Whether the survivors of a lost rank train on (``--ft-on-stop continue``)."""
    return section_of(cfg).ft_on_stop == "continue"


def enabled(cfg: Any) -> bool:
    """Whether the run builds the fault-tolerance core: ``--ft``, ``--ft-on-stop continue``, or an
    extension that declares it needs the core (``--resihp``)."""
    s = section_of(cfg)
    return s.ft or s.ft_on_stop == "continue" or cfg.capability(FAULT_TOLERANCE) is not None


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How ``pretrain_gpt.py --nproc-per-node N`` starts its ranks. ``own``: the project's launcher
    (``ft/launch.py``: it hosts the store and reports exits); else torch's elastic agent, which
    stops every rank when one dies. ``respawn``: processes started again per lost rank;
    ``abort``: a lost rank ends the job (exit 75)."""

    own: bool
    respawn: int = 0
    abort: bool = True
    grace_s: float = 10.0
    """A rank still running this long after the job decided without it (``--ft-grace-s``) is stopped."""


def launcher_for(cfg: Any) -> Launcher:
    """The launcher of the run: the project's own wherever the survivors of a lost rank act on it
    (``abort``: exit 75 with the line that names it; ``continue``), since torch's agent would stop
    them first; torch's agent otherwise."""
    s = section_of(cfg)
    own = continues(cfg) or (enabled(cfg) and s.ft_on_stop == "abort")
    return Launcher(own=own, respawn=s.ft_respawn if own else 0, abort=not continues(cfg), grace_s=s.ft_grace_s)


def process_group_timeout_s(cfg: Any) -> float:
    """The timeout of every collective: under ``continue`` nothing may wait for a lost rank longer
    than the continue timeout; otherwise Megatron-LM's --distributed-timeout-minutes (10)."""
    return section_of(cfg).ft_continue_timeout_s if continues(cfg) else cfg.parallel.distributed_timeout_minutes * 60

