"""A scorer ResiHP's planner cannot read (issue #47 item 2): the simulator on truths drawn per run.

Every policy, ResiHP's planner included, decides from the nominal ``Context`` (``hw``, ``data``):
the effective FLOP/s, NIC and NVLink bandwidths and the mean document mix ResiHP's ``Cluster`` and
``Workload`` are built from. The perturbed scorer times the same jobs on a cluster that differs
from that, by amounts no policy is told:

* each device's efficiency (its FLOP/s, and the HBM-bound optimizer step with it) times a factor
  drawn uniformly from ``[1 - scale, 1 + scale]``;
* each device's NIC bandwidth times its own such factor;
* the NVLink bandwidth times one such factor for the run;
* the document mix: the median document length times one such factor, drawn with another seed (so
  the micro-batches' attention work differs too).

The faults stay the trace's, and the detector model names them at their nominal size: the spread
between healthy devices is what a relative detector (ResiHP's, NVRx's) treats as normal.

What stays shared with the planner, perturbed or not: the 1F1B order (both compile
``pipeline.schedule_orders.megatron_1f1b`` with ``pipeline.pipesim.compile_plan``), the FLOPs per
layer (``shapes.py`` and ``models/flops.py`` were written apart but a test holds them equal on the
projections), and the memory model ResiHP is handed (``job.memory_bytes``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math

import numpy as np

from megatron_ext.resilience.faults import ClusterState
from megatron_ext.resilience.hardware import Hardware
from megatron_ext.resilience.job import Job
from megatron_ext.resilience.run import Context
from megatron_ext.resilience.shapes import ModelShape
from megatron_ext.resilience.sim import Data, IterationResult, Simulator, packed_documents

logger = logging.getLogger(__name__)

LOG_MEAN = 6.0
"""``sim.packed_documents``' default log-median document length (the nominal mix)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Truths:
    """One run's draw: what the scorer runs on beside the nominal figures."""

    seed: int
    scale: float
    device_efficiency: np.ndarray
    """Per device: its FLOP/s (and HBM bandwidth) over the nominal."""
    nic: np.ndarray
    """Per device: its NIC's bandwidth over the nominal."""
    nvlink: float
    """The run's NVLink bandwidth over the nominal."""
    doc_median: float
    """The run's median document length over the nominal."""

    def summary(self) -> dict:
        return {"seed": self.seed, "scale": self.scale,
                "device_efficiency": [round(float(self.device_efficiency.min()), 4),
                                      round(float(self.device_efficiency.max()), 4)],
                "nic": [round(float(self.nic.min()), 4), round(float(self.nic.max()), 4)],
                "nvlink": round(self.nvlink, 4), "doc_median": round(self.doc_median, 4)}


def run_seed(base_seed: int, key: str) -> int:
    """A seed per run (``key``: the model and scenario), derived from ``base_seed``: every run draws
    afresh, and the same command draws the same."""
    if not isinstance(base_seed, int) or base_seed < 0:
        raise ValueError(f"the perturbation seed must be an int >= 0, got {base_seed!r}")
    return int.from_bytes(hashlib.sha256(f"{base_seed}:{key}".encode()).digest()[:4], "big")


def draw(num_devices: int, scale: float, seed: int) -> Truths:
    """Truths for ``num_devices`` devices, each factor uniform in ``[1 - scale, 1 + scale]``."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and 0 <= scale < 1):
        raise ValueError(f"--perturb must be a fraction in [0, 1), got {scale!r}")
    if num_devices < 1:
        raise ValueError(f"draw: need at least one device, got {num_devices}")
    rng = np.random.default_rng(seed)
    lo, hi = 1.0 - scale, 1.0 + scale
    return Truths(seed=seed, scale=float(scale), device_efficiency=rng.uniform(lo, hi, num_devices),
                  nic=rng.uniform(lo, hi, num_devices), nvlink=float(rng.uniform(lo, hi)),
                  doc_median=float(rng.uniform(lo, hi)))


def cell_truths(ctx: Context, key: str, scale: float, base_seed: int) -> Truths:
    """The truths of ``tools/bench_resilience.py``'s cell ``key`` (``MODEL/SCENARIO``, as its JSON
    names it) under ``--perturb scale --perturb-seed base_seed``: what every tool that re-times a
    bench cell draws, so that it times the bench's own world."""
    return draw(ctx.num_devices, scale, run_seed(base_seed, key))


class PerturbedSimulator(Simulator):
    """``Simulator`` on ``truths``: a state's device speeds and NIC fractions are multiplied by the
    drawn ones before the iteration is built (a gone device stays gone)."""

    def __init__(self, shape: ModelShape, hw: Hardware, data: Data, truths: Truths) -> None:
        super().__init__(shape, dataclasses.replace(hw, nvlink_bytes_per_s=hw.nvlink_bytes_per_s * truths.nvlink), data)
        self.truths = truths

    def iteration(self, job: Job, state: ClusterState) -> IterationResult:
        n = state.speed.shape[0]
        if n > self.truths.device_efficiency.shape[0]:
            raise ValueError(f"the perturbed scorer drew {self.truths.device_efficiency.shape[0]} devices; "
                             f"the state has {n}")
        true = ClusterState(state.speed * self.truths.device_efficiency[:n], state.nic * self.truths.nic[:n], state.path)
        return super().iteration(job, true)


def perturbed(ctx: Context, truths: Truths) -> PerturbedSimulator:
    """The scorer for ``ctx`` on ``truths``: the same shape, the hardware and documents drawn."""
    d = ctx.data
    data = packed_documents(d.sum_sq.shape[0], seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                            seed=truths.seed, log_mean=LOG_MEAN + math.log(truths.doc_median))
    return PerturbedSimulator(ctx.shape, ctx.hw, data, truths)


__all__ = ["PerturbedSimulator", "Truths", "draw", "perturbed", "run_seed"]
