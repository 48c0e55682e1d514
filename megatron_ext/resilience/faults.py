"""Device speeds and link bandwidths over wall-clock time: a fault trace.

A ``Fault`` changes one part from ``start_s`` to ``end_s`` (inf: for good):

* ``slow_device`` / ``slow_node``: compute ``factor`` times slower (one device / every device of a node);
* ``slow_nic``: one device's NIC at ``1 / factor`` of its bandwidth (its inter-node traffic: PP sends
  that cross nodes, its data-parallel ring);
* ``slow_path``: the network path between two nodes at ``1 / factor`` (a PP stage link that crosses
  them; target is ``(node_a, node_b)``);
* ``stop_device`` / ``stop_node``: gone (speed 0); a stopped device never comes back by itself.

Overlapping slowdowns of one part multiply (a node slow 2x with one device slow 1.5x on top: 3x).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Iterable

import numpy as np

logger = logging.getLogger(__name__)

KINDS = ("slow_device", "slow_node", "slow_nic", "slow_path", "stop_device", "stop_node")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    target: int | tuple[int, int]
    start_s: float
    end_s: float = math.inf
    factor: float = math.inf

    def check(self, num_devices: int, gpus_per_node: int) -> None:
        where = f"fault {self.kind} on {self.target} at {self.start_s} s"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"{where}: start_s must be finite and >= 0")
        if not self.end_s > self.start_s:
            raise ValueError(f"{where}: end_s ({self.end_s}) must be after start_s ({self.start_s})")
        nodes = num_devices // gpus_per_node
        if self.kind == "slow_path":
            if not (isinstance(self.target, tuple) and len(self.target) == 2
                    and all(isinstance(x, int) and 0 <= x < nodes for x in self.target) and self.target[0] != self.target[1]):
                raise ValueError(f"{where}: a slow_path targets two different nodes (a, b) in 0..{nodes - 1}")
        else:
            limit = nodes if self.kind.endswith("_node") else num_devices
            if not (isinstance(self.target, (int, np.integer)) and 0 <= self.target < limit):
                raise ValueError(f"{where}: target must be a {'node' if limit == nodes else 'device'} in 0..{limit - 1}")
        if self.kind.startswith("slow") and not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"{where}: a slowdown needs a finite factor >= 1, got {self.factor}")


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterState:
    """Speeds at one moment: ``speed[d]`` (1 healthy, 0 gone), ``nic[d]`` (bandwidth fraction of the
    device's NIC), ``path[(a, b)]`` (fraction of the path between nodes a < b; absent: 1)."""

    speed: np.ndarray
    nic: np.ndarray
    path: dict[tuple[int, int], float]

    def key(self) -> tuple:
        return (self.speed.tobytes(), self.nic.tobytes(), tuple(sorted(self.path.items())))

    def path_factor(self, a: int, b: int) -> float:
        return self.path.get((min(a, b), max(a, b)), 1.0)


def healthy_state(num_devices: int) -> ClusterState:
    return ClusterState(np.ones(num_devices), np.ones(num_devices), {})


class FaultTrace:
    """Faults over a cluster of ``num_devices`` (nodes of ``gpus_per_node``); piecewise constant."""

    def __init__(self, num_devices: int, gpus_per_node: int, faults: Iterable[Fault]) -> None:
        if num_devices < 1 or gpus_per_node < 1 or num_devices % gpus_per_node:
            raise ValueError(f"FaultTrace: {num_devices} devices do not make whole nodes of {gpus_per_node}")
        self.n, self.g = num_devices, gpus_per_node
        self.faults = tuple(faults)
        for f in self.faults:
            f.check(num_devices, gpus_per_node)
        pts = {0.0}
        for f in self.faults:
            pts.add(f.start_s)
            if math.isfinite(f.end_s):
                pts.add(f.end_s)
        self.changes = np.array(sorted(pts))
        self._cache: dict[int, ClusterState] = {}

    def segment(self, t: float) -> int:
        return int(np.searchsorted(self.changes, t, side="right") - 1)

    def next_change(self, t: float) -> float:
        k = self.segment(t) + 1
        return float(self.changes[k]) if k < len(self.changes) else math.inf

    def state(self, t: float) -> ClusterState:
        k = self.segment(t)
        if k not in self._cache:
            at = self.changes[k]
            speed, nic, path = np.ones(self.n), np.ones(self.n), {}
            for f in self.faults:
                if not f.start_s <= at < f.end_s:
                    continue
                if f.kind == "slow_device":
                    speed[f.target] /= f.factor
                elif f.kind == "slow_node":
                    speed[f.target * self.g:(f.target + 1) * self.g] /= f.factor
                elif f.kind == "slow_nic":
                    nic[f.target] /= f.factor
                elif f.kind == "slow_path":
                    a, b = sorted(f.target)
                    path[(a, b)] = path.get((a, b), 1.0) / f.factor
                elif f.kind == "stop_device":
                    speed[f.target] = 0.0
                else:
                    speed[f.target * self.g:(f.target + 1) * self.g] = 0.0
            self._cache[k] = ClusterState(speed, nic, path)
        return self._cache[k]

    def deaths_between(self, t0: float, t1: float) -> list[Fault]:
        """Stops that start in (t0, t1]."""
        return [f for f in self.faults if f.kind.startswith("stop") and t0 < f.start_s <= t1]
