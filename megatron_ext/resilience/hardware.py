"""What the simulated cluster's parts can do when healthy, and what each recovery mechanism costs.

Defaults describe an A100-80GB cluster of 8-GPU nodes with NVLink inside a node and one 200 Gb/s
NIC per GPU (rail-optimised), the kind of cluster the resilient-training papers evaluate on.
Every figure is a field, so a bench or a test can change it; none is fitted to a result.
"""
from __future__ import annotations

import dataclasses
import logging
import math

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """A healthy device and the links between devices."""

    gpus_per_node: int = 8
    peak_flops: float = 312e12
    """Dense bf16 peak of one device (A100)."""
    efficiency: float = 0.5
    """Fraction of the peak the matrix products and attention reach (model FLOPs utilisation of the
    compute alone; communication is simulated separately)."""
    hbm_bytes_per_s: float = 2.0e12
    """Memory bandwidth: what the optimizer step is bound by."""
    memory_bytes: float = 80e9
    nvlink_bytes_per_s: float = 150e9
    """Achieved bus bandwidth of a collective inside a node (per direction, per device)."""
    nic_bytes_per_s: float = 25e9
    """One 200 Gb/s NIC per device."""
    nvlink_latency_s: float = 5e-6
    nic_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Hardware.{f.name} must be a positive finite number, got {v!r}")
        if self.efficiency > 1:
            raise ValueError(f"Hardware.efficiency is a fraction of the peak, got {self.efficiency}")

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds each mechanism pays, by what it has to do (docs/resilience.md gives the reasons)."""

    heartbeat_timeout_s: float = 30.0
    """From a device's death to the job knowing (every policy; the lost iteration comes on top)."""
    restart_s: float = 120.0
    """In-job restart (NVRx's launcher restarts the workers inside the allocation: processes, NCCL
    communicators, data loader), before the checkpoint is read."""
    checkpoint_read_bytes_per_s: float = 2e9
    """Per device, reading its shard of the last checkpoint."""
    checkpoint_interval_s: float = 900.0
    """Wall time between checkpoints (asynchronous: free); a restart loses what came after the last."""
    reconfigure_s: float = 20.0
    """A live layout change: new communicators, model chunks and optimizer rebuilt, a barrier (every
    in-place re-layout system pays it: ResiHP, Oobleck, Malleus)."""
    quorum_s: float = 5.0
    """torchft: a new quorum and process-group reconfiguration without the lost replica group."""
    reroute_s: float = 2.0
    """ReCycle: switching to a precomputed rerouted schedule."""
    schedule_adapt_s: float = 1.0
    """ADAPTRA: switching the pipeline schedule and moving the slow link's transfers to the host."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Costs.{f.name} must be a finite number >= 0, got {v!r}")
        if self.checkpoint_interval_s <= 0 or self.checkpoint_read_bytes_per_s <= 0:
            raise ValueError("Costs.checkpoint_interval_s and checkpoint_read_bytes_per_s must be > 0")
