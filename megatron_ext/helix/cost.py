"""Cost models of the Helix simulator: how long a node computes, how long a collective transfers.

Two models, one interface (:class:`CostModel`), injectable everywhere:

* :class:`AnalyticalCostModel` -- roofline for compute (FLOPs from ``torch.utils.flop_counter``
  over the device's measured peak FLOP/s, bytes moved over its measured memory bandwidth, plus a
  fixed per-operator launch overhead) and ``latency + algorithm bytes / bandwidth`` for
  collectives, with the group size in the algorithm-bytes factor.
* :class:`MeasuredCostModel` -- per-operator times from automatic micro-benchmarks on the current
  device (see :mod:`megatron_ext.helix.calibrate`), falling back to the analytical model.

Everything here is pure: no ``torch.distributed``. Measured numbers must be agreed across ranks
by the caller before they drive decisions (the backend all-reduces them).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping, Protocol

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from megatron_ext.helix.ir import CollectiveInfo, IRNode, Kind, tensors_of, value_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Measured (or assumed) capabilities of the compute device."""

    name: str
    peak_flops_per_s: float
    mem_bandwidth_Bps: float
    op_overhead_s: float       # fixed cost of launching one operator from the graph
    graph_overhead_s: float = 0.0  # fixed cost of entering one compiled graph (runtime wrappers)

    def __post_init__(self) -> None:
        for key in ("peak_flops_per_s", "mem_bandwidth_Bps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"DeviceSpec.{key} must be > 0, got {getattr(self, key)}")


# A conservative stand-in until the device is calibrated (used by pure tests).
DEFAULT_CPU = DeviceSpec(name="cpu-default", peak_flops_per_s=20e9, mem_bandwidth_Bps=5e9,
                         op_overhead_s=5e-6, graph_overhead_s=50e-6)


def _algo_factor(kind: str, group_size: int) -> float:
    """Bytes on the busiest link per payload byte for ring algorithms (NCCL's bus-bandwidth factors)."""
    n = max(int(group_size), 1)
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """A link: every collective costs ``latency + algorithm bytes / bandwidth``.

    The payload is the larger of input and output (the gathered side for all-gather and
    reduce-scatter). Collectives on one process group share its link and run one after another.

    ``compute_interference``: the share of compute throughput lost while a collective is in
    flight. On a GPU the communication kernels (NCCL) occupy SMs and memory bandwidth, so the
    computation they overlap runs slower than alone; overlap hides the transfer but not this.
    Work ``w`` done at ``1 - share`` of full speed takes ``w / (1 - share)``: each compute second
    overlapping an in-flight collective costs ``share / (1 - share)`` extra seconds, charged at
    the collective's wait (the emulation and the simulator use the same rule). 0: no slowdown.
    """

    name: str
    latency_s: float
    bandwidth_Bps: float
    compute_interference: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bandwidth_Bps > 0:
            raise ValueError(f"Interconnect {self.name!r}: need latency >= 0 and bandwidth > 0, "
                             f"got {self.latency_s}, {self.bandwidth_Bps}")
        if not 0.0 <= self.compute_interference < 1.0:
            raise ValueError(f"Interconnect {self.name!r}: compute_interference is a share of compute "
                             f"throughput in [0, 1), got {self.compute_interference}")

    def collective_time_s(self, kind: str, payload_bytes: int, group_size: int) -> float:
        if group_size <= 1:
            return 0.0
        return self.latency_s + _algo_factor(kind, group_size) * payload_bytes / self.bandwidth_Bps

    def time_of(self, info: CollectiveInfo) -> float:
        return self.collective_time_s(info.kind, max(info.in_bytes, info.out_bytes), info.group_size)


@dataclasses.dataclass(frozen=True)
class InterconnectPreset:
    """A link described relative to the device, so that the ratio of communication to
    computation -- what decides whether overlap pays -- is the same on any host.

    ``flops_per_byte``: how many FLOPs the device computes (at ``device.peak_flops_per_s``) while
    the link moves one byte. The benchmark's TP=2 layer (hidden 256, fp32) computes ~600 FLOPs per
    byte it all-reduces over a training step, so ``intra_node`` (80 FLOP/B) makes communication
    ~0.13x of computation -- about what NVLink gives a GPT-3-size TP layer on H100s -- and
    ``cross_node`` (480 FLOP/B) ~0.8x: a link 6x slower per FLOP, where communication is as large
    as the computation that could hide it.
    """

    name: str
    flops_per_byte: float
    latency_s: float

    def resolve(self, device: DeviceSpec) -> Interconnect:
        return Interconnect(name=self.name, latency_s=self.latency_s,
                            bandwidth_Bps=device.peak_flops_per_s / self.flops_per_byte)


PRESETS: dict[str, InterconnectPreset] = {
    "intra_node": InterconnectPreset(name="intra_node", flops_per_byte=80.0, latency_s=50e-6),
    "cross_node": InterconnectPreset(name="cross_node", flops_per_byte=480.0, latency_s=250e-6),
}


def resolve_interconnect(spec: str | Interconnect | InterconnectPreset | None,
                         device: DeviceSpec) -> Interconnect | None:
    """``"intra_node"``/``"cross_node"``/a preset/an :class:`Interconnect`/None -> Interconnect."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, Interconnect):
        return spec
    if isinstance(spec, InterconnectPreset):
        return spec.resolve(device)
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec].resolve(device)
    raise ValueError(f"unknown interconnect {spec!r}; expected one of {sorted(PRESETS)}, "
                     "an Interconnect or None")


class CostModel(Protocol):
    """What the simulator asks: seconds on the compute stream, seconds on a link."""

    device: DeviceSpec

    def compute_s(self, node: IRNode) -> float: ...

    def collective_s(self, info: CollectiveInfo) -> float: ...


def _flops(node: fx.Node) -> int:
    from torch.utils.flop_counter import flop_registry

    t = node.target
    packet = getattr(t, "overloadpacket", None)
    fn = flop_registry.get(packet)
    if fn is None:
        return 0
    args, kwargs = tree_map(lambda a: value_of(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    try:
        return int(fn(*args, out_val=value_of(node), **kwargs))
    except Exception:  # an unusual overload: no FLOPs rather than a failed compile
        logger.debug("helix: no FLOP count for %s", node.name, exc_info=True)
        return 0


def moved_bytes(node: fx.Node) -> int:
    """Bytes read and written by a node (inputs + outputs), the memory-bound side of the roofline."""
    read = sum(t.numel() * t.element_size() for a in node.all_input_nodes for t in tensors_of(a))
    written = sum(t.numel() * t.element_size() for t in tensors_of(node))
    return int(read + written)


class AnalyticalCostModel:
    """Roofline compute + link model for collectives.

    ``interconnect``: the link the collectives are priced on (an emulated one on CPU, or a
    description of the real network). ``measured``: per (group name, collective kind), the time of
    the *actual* process group's collective, from micro-benchmarks at the graphs' payloads
    (``calibrate.measure_collectives``; a :class:`MeasuredLink`, or any link with ``time_of``). A
    collective costs the larger of the two -- an emulated wait cannot end before the real
    collective has. Neither given: links are free. ``issue``: per (group name, collective kind),
    what starting one costs the compute thread (``calibrate.measure_collectives(issue=)``): it is
    charged as the collective's compute, and the link's window starts after it (so the measured
    fit, which includes it, is shortened by it).
    """

    def __init__(self, device: DeviceSpec = DEFAULT_CPU, interconnect: Interconnect | None = None,
                 measured: Mapping[tuple[str, str], Interconnect | MeasuredLink] | None = None,
                 host_interference: float = 0.0, issue: Mapping[tuple[str, str], Interconnect] | None = None) -> None:
        if not 0.0 <= host_interference < 1.0:
            raise ValueError(f"host_interference is a share of compute throughput in [0, 1), got {host_interference}")
        self.device = device
        self.interconnect = interconnect
        self.measured = dict(measured or {})
        # On CPU ranks the real collective runs on the cores the compute needs (gloo reduces and
        # copies on the host): the share of compute throughput it takes while it works, measured
        # once (``calibrate.measure_host_interference``); 0 elsewhere.
        self.host_interference = float(host_interference)
        self.issue = dict(issue or {})

    def compute_s(self, node: IRNode) -> float:
        d = self.device
        if node.kind == Kind.OTHER or node.node.op in ("placeholder", "output", "get_attr"):
            return 0.0
        if node.kind == Kind.COLLECTIVE and node.collective is not None:
            return max(d.op_overhead_s, self.issue_s(node.collective))
        if node.kind in (Kind.VIEW, Kind.WAIT, Kind.COLLECTIVE):
            return d.op_overhead_s
        flops = _flops(node.node)
        return d.op_overhead_s + max(flops / d.peak_flops_per_s, moved_bytes(node.node) / d.mem_bandwidth_Bps)

    def issue_s(self, info: CollectiveInfo) -> float:
        """What starting the collective costs the compute thread (0 where unmeasured)."""
        fit = self.issue.get((info.group, info.kind))
        return fit.time_of(info) if fit is not None else 0.0

    def collective_s(self, info: CollectiveInfo) -> float:
        t = 0.0 if self.interconnect is None else self.interconnect.time_of(info)
        real = self.measured.get((info.group, info.kind))
        return max(t, real.time_of(info) - self.issue_s(info)) if real is not None else t

    def host_collective_s(self, info: CollectiveInfo) -> float:
        """How long the real collective works after its start (its measured fit; 0 where unmeasured)."""
        real = self.measured.get((info.group, info.kind))
        return max(0.0, real.time_of(info) - self.issue_s(info)) if real is not None else 0.0


def fit_link(name: str, kind: str, group_size: int, samples: list[tuple[int, float]]) -> Interconnect:
    """Least-squares ``latency + algorithm bytes / bandwidth`` through (payload bytes, seconds)."""
    factor = _algo_factor(kind, group_size) or 1.0
    xs = [b * factor for b, _ in samples]
    ys = [t for _, t in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)  # time per byte; a flat or noisy fit still gets a finite bandwidth
    latency = max(my - slope * mx, 0.0)
    return Interconnect(name=name, latency_s=latency, bandwidth_Bps=1.0 / slope)


@dataclasses.dataclass(frozen=True)
class MeasuredLink:
    """A real collective's time as measured at given payloads: ``points`` (payload bytes, seconds),
    sorted by payload, linear between two of them; outside them (or with fewer than one), ``fit``
    (``latency + algorithm bytes / bandwidth`` through every sample). Measured where the graphs'
    collectives are, rather than a line through two sizes: on CPU ranks gloo's time is not linear in
    the payload (see ``calibrate.measure_collectives``)."""

    name: str
    points: tuple[tuple[int, float], ...]
    fit: Interconnect

    def __post_init__(self) -> None:
        if any(b <= 0 or not (math.isfinite(t) and t >= 0) for b, t in self.points):
            raise ValueError(f"MeasuredLink {self.name!r}: need positive payloads and finite times >= 0, "
                             f"got {self.points}")
        payloads = [b for b, _ in self.points]
        if payloads != sorted(set(payloads)):
            raise ValueError(f"MeasuredLink {self.name!r}: points must be sorted by payload, one per payload")

    def time_of(self, info: CollectiveInfo) -> float:
        if info.group_size <= 1:
            return 0.0
        payload = max(info.in_bytes, info.out_bytes)
        pts = self.points
        if not pts or payload < pts[0][0] or payload > pts[-1][0]:
            return self.fit.time_of(info)
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b0 <= payload <= b1:
                return t0 + (t1 - t0) * (payload - b0) / (b1 - b0)
        return pts[0][1]  # a single point, exactly at the payload


def op_signature(node: fx.Node) -> str:
    """Rank-independent key of one operator call: op name, argument shapes/strides/dtypes, literals."""
    from megatron_ext.helix.ir import op_name

    def enc(a):
        if isinstance(a, fx.Node):
            v = value_of(a)
            if isinstance(v, torch.Tensor):
                return f"T{tuple(v.shape)}s{tuple(v.stride())}{str(v.dtype).removeprefix('torch.')}"
            return f"V{v!r}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(enc(x) for x in a) + "]"
        if isinstance(a, torch.dtype):
            return str(a)
        return repr(a)

    kw = ",".join(f"{k}={enc(v)}" for k, v in sorted(node.kwargs.items()))
    return f"{op_name(node)}({','.join(enc(a) for a in node.args)};{kw})"


class MeasuredCostModel:
    """Per-operator times measured on this device (``table``: signature -> seconds), with the
    analytical model for anything not measured. Collectives always come from the link model."""

    def __init__(self, table: Mapping[str, float], fallback: AnalyticalCostModel, scale: float = 1.0) -> None:
        self.table = dict(table)
        self.fallback = fallback
        # Whole-graph calibration: running a graph costs more than the sum of its operators timed
        # in isolation (cold caches, allocator, a loaded host); ``scale`` carries that ratio.
        self.scale = scale
        self.device = fallback.device
        self.interconnect = fallback.interconnect
        self.host_interference = getattr(fallback, "host_interference", 0.0)
        self.misses = 0

    def compute_s(self, node: IRNode) -> float:
        if node.kind == Kind.OTHER or node.node.op in ("placeholder", "output", "get_attr"):
            return 0.0
        if node.kind in (Kind.COLLECTIVE, Kind.WAIT):
            return self.fallback.compute_s(node)
        t = self.table.get(op_signature(node.node))
        if t is None or not math.isfinite(t):
            self.misses += 1
            t = self.fallback.compute_s(node)
        return t * self.scale

    def collective_s(self, info: CollectiveInfo) -> float:
        return self.fallback.collective_s(info)

    def host_collective_s(self, info: CollectiveInfo) -> float:
        return self.fallback.host_collective_s(info)
