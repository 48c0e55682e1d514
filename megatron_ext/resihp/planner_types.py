"""The ResiHP planner's data: a concrete layout, the cluster and workload it runs on, the
planner's knobs, and the ``Plan`` it proposes (one log line, JSON for the broadcast to ranks and
the verdicts log). Pure: numpy only.

Slots follow ``megatron_ext.layout.Layout``'s rank order (``slot = tp_rank + tp * (dp_rank + dp *
stage)``); a layout names the device (global rank) in each slot, so a TP regrouping is a
permutation of ``devices`` and a fail-stop shrink is a shorter one.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, Callable, Sequence

import numpy as np

from megatron_ext.models.flops import ModelSpec
from megatron_ext.pipeline.schedule_orders import SCHEDULES
from megatron_ext.layout import Layout, split_even

logger = logging.getLogger(__name__)

HEALTHY_EPS = 1e-6   # a speed within this of 1 counts as healthy
PLAN_FORMAT = "resihp-plan"


class PlanningError(ValueError):
    """The planner's input is inconsistent, or no layout can run on the usable devices."""


# --------------------------------------------------------------------------------------------
# Layout and inputs


DERIVED = frozenset({"members", "replica_microbatches", "stage_layers"})
"""The base layout's fields a ``PlanLayout`` derives from its own (never given, never written)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanLayout(Layout):
    """The project's ``Layout`` as the planner needs it: plus layers per [stage][chunk] and the
    schedule. ``devices`` and ``microbatches`` are the planner's names of the layout's ``members``
    and ``replica_microbatches`` (the layout's fields are set from them, ``stage_layers`` from
    ``layers``, always explicit: ``as_layout`` gives the normalised value a live job takes). Slots
    follow the ``Layout``'s rank order: ``slot = tp_rank + tp * (dp_rank + dp * stage)``. Devices not
    listed are spares."""

    vp: int = 1
    schedule: str = "1f1b"
    layers: tuple[tuple[int, ...], ...]
    microbatches: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vp"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise PlanningError(f"layout.{name} must be a positive integer, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise PlanningError(f"layout.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if (self.vp > 1) != (self.schedule == "interleaved"):
            raise PlanningError(f"layout.vp = {self.vp} does not fit schedule {self.schedule!r} "
                                "(vp > 1 needs 'interleaved', 'interleaved' needs vp > 1)")
        layers = tuple(tuple(int(x) for x in row) for row in self.layers)
        object.__setattr__(self, "layers", layers)
        if len(layers) != self.pp or any(len(row) != self.vp for row in layers):
            raise PlanningError(f"layout.layers must be a {self.pp} x {self.vp} table (stages x chunks), "
                                f"got {[list(r) for r in layers]}")
        bad = [(s, v) for s, row in enumerate(layers) for v, n in enumerate(row) if n < 1]
        if bad:
            raise PlanningError(f"layout.layers[{bad[0][0]}][{bad[0][1]}] = {layers[bad[0][0]][bad[0][1]]}: "
                                "every stage and chunk needs at least one layer")
        mbs = tuple(int(x) for x in self.microbatches)
        object.__setattr__(self, "microbatches", mbs)
        if len(mbs) != self.dp:
            raise PlanningError(f"layout.microbatches must list one count per DP replica ({self.dp}), got {len(mbs)}")
        if any(m < 1 for m in mbs):
            raise PlanningError(f"layout.microbatches[{next(i for i, m in enumerate(mbs) if m < 1)}] must be >= 1, "
                                f"got {list(mbs)}")
        arr = np.asarray(self.devices, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "devices", tuple(arr.tolist()))
        if arr.shape[0] != self.world_size:
            raise PlanningError(f"layout.devices must name {self.world_size} devices (tp {self.tp} x pp {self.pp} "
                                f"x dp {self.dp}), got {arr.shape[0]}")
        uniq, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any() or (arr < 0).any():
            bad = sorted(set(uniq[counts > 1].tolist()) | set(arr[arr < 0].tolist()))
            raise PlanningError(f"layout.devices must be distinct non-negative ranks; repeated or negative: {bad[:8]}")
        # The base layout's fields, derived: one value, the planner's names for it.
        object.__setattr__(self, "members", self.devices)
        object.__setattr__(self, "replica_microbatches", self.microbatches)
        object.__setattr__(self, "stage_layers", tuple(sum(row) for row in layers))

    @classmethod
    def even(cls, *, num_layers: int, tp: int, pp: int, dp: int, num_microbatches: int, vp: int = 1,
             schedule: str | None = None, devices: Sequence[int] | None = None) -> "PlanLayout":
        """Megatron's default: layers split as evenly as possible (earlier virtual stages take the
        remainder), micro-batches likewise, devices in rank order."""
        schedule = schedule or ("interleaved" if vp > 1 else "1f1b")
        if num_layers < pp * vp:
            raise PlanningError(f"num_layers {num_layers} is fewer than pp * vp = {pp * vp} virtual stages")
        if num_microbatches < dp:
            raise PlanningError(f"num_microbatches {num_microbatches} is fewer than dp = {dp} replicas")
        per = split_even(num_layers, pp * vp)
        layers = tuple(tuple(per[v * pp + s] for v in range(vp)) for s in range(pp))
        devs = tuple(range(tp * pp * dp)) if devices is None else tuple(devices)
        return cls(tp=tp, pp=pp, dp=dp, vp=vp, schedule=schedule, layers=layers,
                   microbatches=tuple(split_even(num_microbatches, dp)), devices=devs)

    @property
    def num_layers(self) -> int:
        return sum(map(sum, self.layers))

    @property
    def num_microbatches(self) -> int:
        return sum(self.microbatches)

    @property
    def shape(self) -> str:
        return self.name

    def as_layout(self) -> Layout:
        """The plain layout value (what the fault-tolerance core applies): even stages and an even
        split written as None."""
        return Layout(self.tp, self.pp, self.dp, vp=self.vp, members=self.devices, stage_layers=self.stage_layers,
                      replica_microbatches=self.microbatches).normalised()

    def grid(self) -> np.ndarray:
        """Devices as a (pp, dp, tp) array."""
        return np.asarray(self.devices, dtype=np.int64).reshape(self.pp, self.dp, self.tp)

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vp": self.vp, "schedule": self.schedule,
                "layers": [list(r) for r in self.layers], "microbatches": list(self.microbatches),
                "devices": list(self.devices)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "layout") -> "PlanLayout":
        known = {f.name for f in dataclasses.fields(cls)} - DERIVED
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanningError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
        try:
            return cls(**{k: (tuple(map(tuple, v)) if k == "layers" else v) for k, v in data.items()})
        except TypeError as exc:
            raise PlanningError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """What the devices and links can do (healthy)."""

    device_flops: float
    """Effective FLOP/s of one healthy device on this model's matrix products (FLOPs as ``flops.py``
    counts them, so achieved, not peak)."""
    memory_bytes: float | tuple[float, ...]
    """Memory per device: one figure for all, or one per device (indexed by rank)."""
    link_bytes_per_s: float
    """Inbound bandwidth per device for state moves and the data-parallel gradient all-reduce."""
    p2p_latency_s: float = 0.0
    """Latency per pipeline hop (activations, gradients)."""
    relayout_pause_s: float = 0.0
    """Fixed cost of a re-layout on top of moving bytes (groups and model chunks rebuilt, a
    barrier); a change of the micro-batch split alone does not pay it."""
    tp_bytes_per_s: float = math.inf
    """Bandwidth of the TP group's all-reduces (NVLink inside a node). Finite, it makes TP cost
    something, so a smaller TP group is not free of trade-offs; infinite ignores TP traffic."""
    devices_per_node: int | None = None
    """Devices per node: ranks ``n * g`` to ``n * g + g - 1`` share node ``n``. A TP group that spans
    nodes does its all-reduces over the NIC (``link_bytes_per_s``), not ``tp_bytes_per_s``, and the
    planner rebuilds such groups inside nodes where the devices allow. None: no nodes (one TP
    bandwidth for every group; a single host)."""

    def __post_init__(self) -> None:
        for name in ("device_flops", "link_bytes_per_s", "tp_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise PlanningError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        if self.devices_per_node is not None and not (isinstance(self.devices_per_node, int)
                                                      and self.devices_per_node >= 1):
            raise PlanningError(f"cluster.devices_per_node must be an integer >= 1 or None, got {self.devices_per_node!r}")
        for name in ("p2p_latency_s", "relayout_pause_s"):
            if not getattr(self, name) >= 0:
                raise PlanningError(f"cluster.{name} must be >= 0, got {getattr(self, name)}")
        mem = np.atleast_1d(np.asarray(self.memory_bytes, dtype=float))
        if not (mem > 0).all():
            raise PlanningError(f"cluster.memory_bytes must be > 0, got {self.memory_bytes}")

    def memory_of(self, num_devices: int) -> np.ndarray:
        mem = np.asarray(self.memory_bytes, dtype=float)
        if mem.ndim == 0:
            return np.full(num_devices, float(mem))
        if mem.shape[0] < num_devices:
            raise PlanningError(f"cluster.memory_bytes lists {mem.shape[0]} devices, the speeds {num_devices}")
        return mem[:num_devices]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What one micro-batch is, and what state costs."""

    seq_length: int
    micro_batch_size: int = 1
    attention_sq_per_sequence: float | None = None
    """Sum of squared document lengths per sequence (packed documents); default one document per
    sequence, ``seq_length ** 2``."""
    state_bytes_per_param: float = 16.0
    """Model + optimizer state per parameter held by a device (bf16 weights and gradients, fp32
    master weights and two Adam moments: 2 + 2 + 4 + 8); what a state move transfers."""
    grad_bytes_per_param: float = 2.0
    """Bytes per parameter the data-parallel gradient all-reduce sends."""
    activation_bytes_per_value: float = 2.0
    """Bytes per activation value a pipeline message carries (bf16: 2, fp32: 4)."""

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise PlanningError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_sq_per_sequence is not None and self.attention_sq_per_sequence < 0:
            raise PlanningError(f"workload.attention_sq_per_sequence must be >= 0, got {self.attention_sq_per_sequence}")
        for name in ("state_bytes_per_param", "grad_bytes_per_param", "activation_bytes_per_value"):
            if getattr(self, name) < 0:
                raise PlanningError(f"workload.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def tokens(self) -> float:
        return float(self.seq_length * self.micro_batch_size)

    @property
    def sum_sq(self) -> float:
        per = self.seq_length ** 2 if self.attention_sq_per_sequence is None else self.attention_sq_per_sequence
        return float(per * self.micro_batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Which knobs the search may turn, and when a plan is worth it."""

    min_gain: float = 0.05
    """Propose a plan only when it shortens the iteration by more than this fraction, after the
    state move is amortized over ``horizon_iterations``. It guards against acting on a believed
    speed that is off (a factor re-estimated from x2.0 to x2.1)."""
    min_gain_healthy: float = 0.02
    """The threshold instead of ``min_gain`` for a plan where no believed slowness is at stake: every
    device of the layout in force and of the plan believed healthy, and no slow link, NIC or path
    among them (a grow back onto devices that returned, a reshape between healthy layouts). Such a
    plan is wrong only by the cost model's error between the two layouts, not by a misjudged speed
    (docs/resilience.md, "the held-out days won back", and ``tools/bench_planner_error.py`` measure
    that error); under 5 %, a job shrunk by a lost node stayed shrunk after the node came back."""
    horizon_iterations: int = 500
    """Iterations over which a re-layout's pause is amortized (how long the new layout is expected
    to stay right)."""
    tp_regroup: bool = True
    """Permute devices so slow ones share TP groups."""
    pp_repartition: bool = True
    """Uneven layers per stage."""
    dp_migration: bool = True
    """Uneven micro-batches per replica."""
    uneven_microbatches: bool = True
    """Allow layouts whose replicas run different micro-batch counts at all (also the remainder of
    an even split over fewer replicas); False for an executor that cannot weight replicas
    (DeepSpeed's pipeline engine)."""
    link_avoid: bool = True
    """Around a slow pipeline link (``Planner.plan(links=...)``): swap the replicas of one end's TP
    group so the link carries no pipeline message (devices of one stage in two replicas hold the
    same state: nothing moves but the pause)."""
    drop_replicas: bool = True
    """Shrink DP: leave out replicas (those with dead devices; or slow ones when that is faster)."""
    grow_replicas: bool = True
    """Grow DP: add replicas of the current (tp, pp) on healthy idle devices (after a shrink, once
    devices recovered or came back)."""
    reshape: bool = True
    """Other (tp, pp, dp) sizes over the usable devices (TP only downwards)."""
    reshape_keeps_devices: bool = False
    """Reshape only to sizes over exactly the layout's devices, each keeping a place (a live
    re-layout without a fault keeps every rank: ``--resihp-act relayout``)."""
    max_reshapes: int = 6
    """Shapes other than the current (tp, pp) scored in full, best closed-form bound first."""
    simulate_top: int = 3
    """Candidates re-scored by the pipeline simulator, best closed form first (each distinct
    micro-batch count compiles a schedule once per process: the bulk of a cold decision)."""
    simulate_margin: float = 0.02
    """...of those, only the ones whose closed-form cost is within this fraction of the best."""

    def __post_init__(self) -> None:
        if not self.min_gain >= 0 or not self.min_gain_healthy >= 0:
            raise PlanningError(f"planner.min_gain and min_gain_healthy must be >= 0, got {self.min_gain} and "
                                f"{self.min_gain_healthy}")
        if self.horizon_iterations < 1:
            raise PlanningError(f"planner.horizon_iterations must be >= 1, got {self.horizon_iterations}")
        if self.max_reshapes < 0 or self.simulate_top < 1:
            raise PlanningError(f"planner.max_reshapes must be >= 0 and simulate_top >= 1, "
                                f"got {self.max_reshapes} and {self.simulate_top}")


MemoryModel = Callable[[ModelSpec, Workload, int, int, Sequence[int], int], np.ndarray]
"""``(spec, workload, tp, pp, layers per stage, dp) -> bytes each device of a stage needs, shape
(pp,)``; ``dp`` for a model whose optimizer state is sharded over the replicas (a distributed
optimizer)."""


# --------------------------------------------------------------------------------------------
# Plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A proposed re-layout. Times are predictions at the believed speeds."""

    old: PlanLayout
    new: PlanLayout
    actions: tuple[str, ...]
    iteration_s_before: float
    iteration_s_after: float
    bytes_to_move: float
    max_bytes_per_device: float
    move_s: float
    horizon_iterations: int
    optimum_s: float
    speeds: dict[int, float] = dataclasses.field(default_factory=dict)
    """The non-healthy devices the plan was made for (rank -> speed)."""
    links: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    """The slow pipeline links it was made for ((device, device) -> extra seconds per message)."""
    nics: dict[int, float] = dataclasses.field(default_factory=dict)
    """The slow NICs it was made for (device -> bytes/s)."""
    paths: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    """The slow network paths it was made for ((device, device) -> bytes/s)."""

    @property
    def gain(self) -> float:
        """Fraction of the iteration saved, the move amortized over the horizon."""
        after = self.iteration_s_after + self.move_s / self.horizon_iterations
        if math.isinf(self.iteration_s_before):
            return 1.0
        return (self.iteration_s_before - after) / self.iteration_s_before

    @property
    def dropped(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.old.devices) - set(self.new.devices)))

    def describe(self) -> str:
        """One log line, e.g. ``resihp plan [pp_repartition, dp_migration] tp1pp4dp2: layers
        3/3/3/3 -> 4/4/3/1; micro-batches 4/4 -> 5/3; iteration 1.62 s -> 1.21 s predicted
        (-25.3 %, the old shape at the capacity left 1.18 s); move 0.4 GB (max 0.1 GB/device, 0.05 s)``.
        "The old shape at the capacity left" is the capacity-proportional optimum of the layout's
        shape (its healthy time x devices / the sum of their speeds); another shape (fewer stages,
        fewer bubbles) can be predicted below it."""
        o, n = self.old, self.new
        parts = []
        parts.append(f"{o.shape}" + (f" -> {n.shape}" if o.shape != n.shape else ""))
        ol, nl = _runs(o.stage_layers), _runs(n.stage_layers)
        if ol != nl:
            parts.append(f"layers {ol} -> {nl}")
        om, nm = _runs(o.microbatches), _runs(n.microbatches)
        if om != nm:
            parts.append(f"micro-batches {om} -> {nm}")
        moved = _moved_devices(o, n)
        if moved:
            parts.append(f"{len(moved)} rank(s) change slot")
        if self.dropped:
            parts.append(f"leave out rank(s) {_short(self.dropped)}")
        slow = ", ".join(f"{r}:{'dead' if s <= 0 else f'x{1 / s:.2f}'}" for r, s in list(self.speeds.items())[:6])
        if len(self.speeds) > 6:
            slow += f", +{len(self.speeds) - 6}"
        links = ", ".join(f"link {a}-{b} +{1e3 * x:.1f} ms" for (a, b), x in list(self.links.items())[:4])
        nics = ", ".join(f"NIC {d} {_rate(x)}" for d, x in list(self.nics.items())[:4])
        paths = ", ".join(f"path {a}-{b} {_rate(x)}" for (a, b), x in list(self.paths.items())[:4])
        if len(self.paths) > 4:
            paths += f", +{len(self.paths) - 4} paths"
        slow = ", ".join(x for x in (slow, links, nics, paths) if x)
        before = "inf" if math.isinf(self.iteration_s_before) else f"{self.iteration_s_before:.3g} s"
        gain = "" if math.isinf(self.iteration_s_before) else \
            f"-{100 * (1 - self.iteration_s_after / self.iteration_s_before):.1f} %, "
        return (f"resihp plan [{', '.join(self.actions)}] for {slow or 'all healthy'}: " + "; ".join(parts)
                + f"; iteration {before} -> {self.iteration_s_after:.3g} s predicted ({gain}the old shape at the "
                f"capacity left {self.optimum_s:.3g} s); move {_gb(self.bytes_to_move)} (max {_gb(self.max_bytes_per_device)}"
                f"/device, {self.move_s:.3g} s)")

    def to_dict(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "old": self.old.to_dict(), "new": self.new.to_dict(),
                "actions": list(self.actions), "iteration_s_before": _num(self.iteration_s_before),
                "iteration_s_after": self.iteration_s_after, "bytes_to_move": self.bytes_to_move,
                "max_bytes_per_device": self.max_bytes_per_device, "move_s": self.move_s,
                "horizon_iterations": self.horizon_iterations, "optimum_s": _num(self.optimum_s),
                "speeds": {str(k): v for k, v in self.speeds.items()},
                **({"links": {f"{a}-{b}": x for (a, b), x in self.links.items()}} if self.links else {}),
                **({"nics": {str(d): x for d, x in self.nics.items()}} if self.nics else {}),
                **({"paths": {f"{a}-{b}": x for (a, b), x in self.paths.items()}} if self.paths else {})}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict) -> "Plan":
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise PlanningError(f"plan: not JSON: {exc}") from None
        if data.get("format") != PLAN_FORMAT:
            raise PlanningError(f"plan: expected format {PLAN_FORMAT!r}, got {data.get('format')!r}")
        want = {"old", "new", "actions", "iteration_s_before", "iteration_s_after", "bytes_to_move",
                "max_bytes_per_device", "move_s", "horizon_iterations", "optimum_s", "speeds"}
        missing, unknown = sorted(want - set(data)), sorted(set(data) - want - {"format", "links", "nics", "paths"})
        if missing or unknown:
            raise PlanningError(f"plan: missing keys {missing}, unknown keys {unknown}")
        return cls(old=PlanLayout.from_dict(data["old"], "plan.old"), new=PlanLayout.from_dict(data["new"], "plan.new"),
                   actions=tuple(data["actions"]), iteration_s_before=float(data["iteration_s_before"]),
                   iteration_s_after=float(data["iteration_s_after"]), bytes_to_move=float(data["bytes_to_move"]),
                   max_bytes_per_device=float(data["max_bytes_per_device"]), move_s=float(data["move_s"]),
                   horizon_iterations=int(data["horizon_iterations"]), optimum_s=float(data["optimum_s"]),
                   speeds={int(k): float(v) for k, v in data["speeds"].items()},
                   links={tuple(int(x) for x in k.split("-")): float(v) for k, v in data.get("links", {}).items()},
                   nics={int(k): float(v) for k, v in data.get("nics", {}).items()},
                   paths={tuple(int(x) for x in k.split("-")): float(v) for k, v in data.get("paths", {}).items()})


def _num(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def _runs(values: Sequence[int]) -> str:
    """``6x14/5/7`` for 6,6,...,6,5,7: long lists stay readable."""
    out, i = [], 0
    vals = list(values)
    while i < len(vals):
        j = i
        while j < len(vals) and vals[j] == vals[i]:
            j += 1
        out.append(f"{vals[i]}x{j - i}" if j - i > 2 else "/".join([str(vals[i])] * (j - i)))
        i = j
    return "/".join(out)


def _short(values: Sequence[int], k: int = 8) -> str:
    vals = list(values)
    return ",".join(map(str, vals[:k])) + (f",... ({len(vals)})" if len(vals) > k else "")


def _moved_devices(old: PlanLayout, new: PlanLayout) -> list[int]:
    """Ranks whose (stage, TP rank) changed (a DP-replica change alone moves no state)."""
    def where(lay: PlanLayout) -> dict[int, tuple[int, int]]:
        g = lay.grid()
        return {int(g[s, d, t]): (s, t) for s in range(lay.pp) for d in range(lay.dp) for t in range(lay.tp)}
    if (old.tp, old.pp) != (new.tp, new.pp):
        return sorted(set(new.devices))
    a, b = where(old), where(new)
    return sorted(r for r, c in b.items() if a.get(r) != c)

